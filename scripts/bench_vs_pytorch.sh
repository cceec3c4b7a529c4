#!/usr/bin/env bash
# Our training step against the same step in plain PyTorch eager, run
# alternately so both see the same machine; prints the median tokens/s of
# each, the ratio and peak memory, for the Shakespeare shape and a larger one.
# Both run on one LibTorch, the project's .venv torch that noloco links, so
# both have the same kernels; both get the same threads.
#   scripts/bench_vs_pytorch.sh [REPEATS] [THREADS]
set -euo pipefail
cd "$(dirname "$0")/.."
repeats=${1:-5}
threads=${2:-1}
py=${PYTHON:-.venv/bin/python}
[ -x build/noloco ] || scripts/build.sh
export OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-passive}  # the same for both (ours would set it itself)

shapes=(
  "tiny: hidden=128 layers=4 heads=4 intermediate=384 context=64 batch=12 steps=40"
  "larger: hidden=512 layers=8 heads=8 intermediate=1536 context=256 batch=8 steps=6"
)
for shape in "${shapes[@]}"; do
  name=${shape%%:*}
  kv=${shape#*: }
  ours=() theirs=() ours_mem=0 theirs_mem=0
  py_args=$(echo "$kv" | sed -E 's/([a-z]+)=/--\1 /g')
  steps=$(echo "$kv" | sed -E 's/.*steps=([0-9]+).*/\1/')
  for ((i = 0; i < repeats; i++)); do
    o=$(build/noloco bench ${kv/steps=$steps/bench_steps=$steps} threads=$threads peak_tflops=1 2>/dev/null | tail -1)
    t=$("$py" benchmarks/pytorch_step.py $py_args --threads "$threads")
    ours+=("$(echo "$o" | python3 -c 'import json,sys;print(json.load(sys.stdin)["tokens_per_s"])')")
    theirs+=("$(echo "$t" | python3 -c 'import json,sys;print(json.load(sys.stdin)["tokens_per_s"])')")
    ours_mem=$(echo "$o" | python3 -c 'import json,sys;print(json.load(sys.stdin)["peak_rss_mib"])')
    theirs_mem=$(echo "$t" | python3 -c 'import json,sys;print(json.load(sys.stdin)["peak_rss_mib"])')
  done
  "$py" - "$name" "$threads" "$ours_mem" "$theirs_mem" "${ours[*]}" "${theirs[*]}" <<'PY'
import statistics, sys
import torch
name, threads, om, tm, o, t = sys.argv[1:]
cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), "?")
o = [float(v) for v in o.split()]; t = [float(v) for v in t.split()]
mo, mt = statistics.median(o), statistics.median(t)
print(f"{name} ({threads} thread(s), median of {len(o)} alternating runs, {cpu}, torch {torch.__version__} for both): "
      f"noloco {mo:.0f} tokens/s, PyTorch {mt:.0f} tokens/s, ratio {mo / mt:.2f}x; "
      f"peak memory {float(om):.0f} MiB vs {float(tm):.0f} MiB")
PY
done
