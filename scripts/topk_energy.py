#!/usr/bin/env python3
"""How much of a pseudo-gradient a top-k or a low-rank message can carry.

Reads two checkpoints of one worker of a run (model.safetensors, fp32) and
prints, for their difference Δ, the share of |Δ|² that

- top=K: the K largest values of each 4096-value chunk hold (chunks over the
  parameters in name order; `compression=topk` sends the top 64), next to
  the same share for Gaussian noise;
- rank=R: the best rank-R approximation of each matrix holds (vectors sent
  whole), with the share of the values such a message sends.

Where Δ holds little more than noise does, a top-k message leaves most of
the increment behind (docs/results-log.md, issue 47).

    /usr/bin/python3 scripts/topk_energy.py RUN_DIR STEP_A STEP_B [top=K ...] [rank=R ...]

Needs numpy (Debian python3-numpy).
"""
import glob
import json
import struct
import sys

import numpy as np

CHUNK = 4096


def load_fp32(path):
    with open(path, "rb") as f:
        data = f.read()
    (header_len,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + header_len])
    base = 8 + header_len
    tensors = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        if entry["dtype"] != "F32":
            sys.exit(f"{path}: {name} is {entry['dtype']}, not F32")
        begin, end = entry["data_offsets"]
        values = np.frombuffer(data[base + begin:base + end], dtype=np.float32).astype(np.float64)
        tensors[name] = values.reshape(entry["shape"])
    return tensors


def checkpoint(run, step):
    found = sorted(glob.glob(f"{run}/checkpoints/*/step_{step:08d}/model.safetensors"))
    if not found:
        sys.exit(f"{run}: no checkpoint of step {step}")
    return load_fp32(found[0])


def top_share(values, k):
    padded = np.concatenate([values, np.zeros((-len(values)) % CHUNK)])
    energy = padded.reshape(-1, CHUNK) ** 2
    return np.sort(energy, axis=1)[:, -k:].sum() / energy.sum()


def rank_share(deltas, r):
    """The share of |Δ|² and of the values a rank-r message of every matrix holds."""
    total = kept = 0.0
    sent = values = 0
    for d in deltas:
        values += d.size
        if d.ndim == 2 and min(d.shape) > r:
            singular = np.linalg.svd(d, compute_uv=False) ** 2
            total, kept, sent = total + singular.sum(), kept + singular[:r].sum(), sent + r * sum(d.shape)
        else:
            energy = (d ** 2).sum()
            total, kept, sent = total + energy, kept + energy, sent + d.size
    return kept / total, sent / values


def main():
    if len(sys.argv) < 4:
        sys.exit(__doc__)
    run, a, b = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    asks = sys.argv[4:] or ["top=64"]
    before, after = checkpoint(run, a), checkpoint(run, b)
    deltas = [after[n] - before[n] for n in sorted(before)]
    flat = np.concatenate([d.ravel() for d in deltas])
    noise = np.random.default_rng(0).standard_normal(len(flat))
    for ask in asks:
        kind, _, number = ask.partition("=")
        if kind not in ("top", "rank") or not number.isdigit() or int(number) < 1:
            sys.exit(f"{ask}: expected top=K or rank=R with a positive integer")
        n = int(number)
        if kind == "top":
            print(f"{run}: {len(flat)} values, steps {a} -> {b}: the top {n} of each {CHUNK} hold "
                  f"{top_share(flat, n):.3f} of |delta|^2 (Gaussian noise: {top_share(noise, n):.3f})")
        else:
            share, sent = rank_share(deltas, n)
            print(f"{run}: {len(flat)} values, steps {a} -> {b}: rank {n} holds {share:.3f} of |delta|^2 "
                  f"in {sent:.4f} of the values")


if __name__ == "__main__":
    main()
