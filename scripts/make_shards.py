#!/usr/bin/env python3
"""Writes a token corpus of any size as llm.c uint16 shards, from repeated text.

The text's bytes are numbered as noloco's char tokenizer numbers them (its
distinct bytes, sorted), so a run on the shards trains as one on the text.
Used to measure noloco on corpora larger than memory without a download:

    scripts/make_shards.py /tmp/big 4000000000     # 40 shards of 10^8 tokens, 8 GB
    build/noloco train configs/shakespeare.yaml data=/tmp/big replicas=8 method=noloco steps=50

OUT gets train_000000.bin, ... and val_000000.bin (the text's last tenth,
once), each with llm.c's header (magic 20240520, version 1, token count) and
the vocabulary size in the header's fourth int, as `noloco prepare` writes.
"""
import argparse
import os
import struct


def shard(path, ids, vocab):
    header = struct.pack("<4i", 20240520, 1, len(ids) // 2, vocab) + bytes(1024 - 16)
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(header)
        f.write(ids)
    os.replace(tmp, path)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out")
    p.add_argument("tokens", type=int, help="training tokens in all")
    p.add_argument("--text", default=os.path.join(os.path.dirname(__file__), "..", "data", "tinyshakespeare.txt"))
    p.add_argument("--shard-tokens", type=int, default=100_000_000)
    a = p.parse_args()
    text = open(a.text, "rb").read()
    alphabet = sorted(set(text))
    index = {b: i for i, b in enumerate(alphabet)}
    ids = b"".join(struct.pack("<H", index[b]) for b in text)  # 2 bytes a token
    held = len(text) // 10
    train, val = ids[: 2 * (len(text) - held)], ids[2 * (len(text) - held):]
    os.makedirs(a.out, exist_ok=True)
    left, n = a.tokens, 0
    while left > 0:
        count = min(left, a.shard_tokens)
        repeats = -(-2 * count // len(train))
        shard(os.path.join(a.out, f"train_{n:06d}.bin"), (train * repeats)[: 2 * count], len(alphabet))
        left -= count
        n += 1
    shard(os.path.join(a.out, "val_000000.bin"), val, len(alphabet))
    print(f"{a.out}: {a.tokens} training tokens in {n} shard(s), {len(val) // 2} validation tokens, vocabulary {len(alphabet)}")


if __name__ == "__main__":
    main()
