#!/usr/bin/env python3
"""Writes the same documents as JSONL and as plain text, to measure `noloco prepare`.

Each document is a random passage of the text (300-6000 bytes). PREFIX.jsonl
holds one {"id": N, "text": ...} a line; PREFIX.txt the same documents, each
followed by the separator (`</s>`, the end-of-text piece of the BPE tokenizers
`prepare` trains), so both must give byte-identical token shards:

    scripts/make_documents.py /tmp/docs 1050000000 && zstd -T2 /tmp/docs.jsonl
    build/noloco prepare data/tinyshakespeare.txt out=/tmp/tok vocab_size=2048
    build/noloco prepare /tmp/docs.jsonl.zst out=/tmp/a tokenizer=/tmp/tok
    build/noloco prepare /tmp/docs.txt out=/tmp/b tokenizer=/tmp/tok && cmp /tmp/a/train_000000.bin /tmp/b/train_000000.bin
"""
import argparse
import json
import os
import random


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("prefix")
    p.add_argument("bytes", type=int, help="about this much JSONL")
    p.add_argument("--text", default=os.path.join(os.path.dirname(__file__), "..", "data", "tinyshakespeare.txt"))
    p.add_argument("--separator", default="</s>")
    p.add_argument("--seed", type=int, default=1)
    a = p.parse_args()
    text = open(a.text, encoding="utf-8").read()
    rng = random.Random(a.seed)
    written = n = 0
    with open(a.prefix + ".jsonl", "w", encoding="utf-8") as jsonl, open(a.prefix + ".txt", "w", encoding="utf-8") as plain:
        while written < a.bytes:
            size = rng.randint(300, 6000)
            at = rng.randint(0, len(text) - size)
            line = json.dumps({"id": n, "text": text[at:at + size]}) + "\n"
            jsonl.write(line)
            plain.write(text[at:at + size] + a.separator)
            written += len(line)
            n += 1
    print(f"{a.prefix}.jsonl and {a.prefix}.txt: {n} documents")


if __name__ == "__main__":
    main()
