#!/usr/bin/env python3
"""Turn a llama.cpp vocabulary-only GGUF file (models/ggml-vocab-*.gguf) into
a Hugging Face tokenizer.json for a GPT-2- or StarCoder-style byte-level BPE.

Used once to make tests/fixtures/gpt2/tokenizer.json from llama.cpp's
ggml-vocab-gpt-2.gguf, whose .inp/.out files hold ids that Hugging Face's own
tokenizer produced; the test checks our tokenizer against those ids.

usage: gguf_vocab_to_tokenizer_json.py VOCAB.gguf OUT.json
"""
import json
import struct
import sys

SCALAR = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}


def read_gguf_metadata(path):
    with open(path, "rb") as f:
        data = f.read()
    if data[:4] != b"GGUF":
        sys.exit(f"{path}: not a GGUF file")
    pos = 4

    def take(fmt):
        nonlocal pos
        (v,) = struct.unpack_from(fmt, data, pos)
        pos += struct.calcsize(fmt)
        return v

    def string():
        nonlocal pos
        n = take("<Q")
        s = data[pos : pos + n].decode("utf-8")
        pos += n
        return s

    def value(kind):
        if kind == 8:
            return string()
        if kind == 9:
            item, count = take("<I"), take("<Q")
            return [value(item) for _ in range(count)]
        return take(SCALAR[kind])

    version = take("<I")
    if version < 2:
        sys.exit(f"{path}: GGUF version {version} is not supported")
    take("<Q")  # tensor count: a vocabulary file has none
    meta = {}
    for _ in range(take("<Q")):
        key = string()
        meta[key] = value(take("<I"))
    return meta


def main():
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    meta = read_gguf_metadata(sys.argv[1])
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}
    # StarCoder's (SmolLM2's layout): every digit on its own before GPT-2's split.
    pre_tokenizers = {
        "gpt-2": byte_level,
        "starcoder": {"type": "Sequence", "pretokenizers": [{"type": "Digits", "individual_digits": True}, byte_level]},
    }
    pre = meta.get("tokenizer.ggml.pre", "gpt-2")
    if meta.get("tokenizer.ggml.model") != "gpt2" or pre not in pre_tokenizers:
        sys.exit(f"only byte-level BPE (tokenizer.ggml.model gpt2) with pre {sorted(pre_tokenizers)} is converted")
    tokens = meta["tokenizer.ggml.tokens"]
    types = meta.get("tokenizer.ggml.token_type", [1] * len(tokens))
    control = 3  # llama.cpp's LLAMA_TOKEN_TYPE_CONTROL: special tokens
    added = [
        {"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False, "normalized": False,
         "special": True}
        for i, (t, kind) in enumerate(zip(tokens, types))
        if kind == control
    ]
    out = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": None,
        "pre_tokenizer": pre_tokenizers[pre],
        "post_processor": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": False, "use_regex": True},
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": "",
            "end_of_word_suffix": "",
            "fuse_unk": False,
            "byte_fallback": False,
            "vocab": {t: i for i, t in enumerate(tokens)},
            "merges": meta["tokenizer.ggml.merges"],
        },
    }
    with open(sys.argv[2], "w", encoding="utf-8") as f:
        json.dump(out, f, ensure_ascii=False, separators=(",", ":"))


if __name__ == "__main__":
    main()
