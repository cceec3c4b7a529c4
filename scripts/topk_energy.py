#!/usr/bin/env python3
"""How much of a pseudo-gradient a top-k message can carry.

Reads two checkpoints of one worker of a run (model.safetensors, fp32) and
prints the share of the squared norm of their difference, Δ, that the k
largest values of each chunk hold (chunks over the parameters in name order),
next to the same share for Gaussian noise. `compression=topk` sends the top
64 of each 4096: where Δ holds little more than noise does, the message
leaves most of the increment behind (docs/results.md, issue 47).

    /usr/bin/python3 scripts/topk_energy.py RUN_DIR STEP_A STEP_B [K ...]

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
        tensors[name] = np.frombuffer(data[base + begin:base + end], dtype=np.float32).astype(np.float64)
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


def main():
    if len(sys.argv) < 4:
        sys.exit(__doc__)
    run, a, b = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    ks = [int(k) for k in sys.argv[4:]] or [64]
    before, after = checkpoint(run, a), checkpoint(run, b)
    delta = np.concatenate([after[n] - before[n] for n in sorted(before)])
    noise = np.random.default_rng(0).standard_normal(len(delta))
    for k in ks:
        print(f"{run}: {len(delta)} values, steps {a} -> {b}: the top {k} of each {CHUNK} hold "
              f"{top_share(delta, k):.3f} of |delta|^2 (Gaussian noise: {top_share(noise, k):.3f})")


if __name__ == "__main__":
    main()
