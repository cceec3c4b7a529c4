#!/usr/bin/env bash
# Our training step against the same step in plain PyTorch (Debian's
# python3-torch, installed here rather than by setup.sh), run alternately so
# both see the same machine; prints the median tokens/s of each, the ratio and
# peak memory, for the Shakespeare shape and a larger one; both run the same
# OpenBLAS kernels (OPENBLAS_CORETYPE, named in the output with the CPU).
#   scripts/bench_vs_pytorch.sh [REPEATS] [THREADS]
set -euo pipefail
cd "$(dirname "$0")/.."
repeats=${1:-5}
threads=${2:-1}
sudo_if_needed() { if [ "$(id -u)" = 0 ]; then "$@"; else sudo "$@"; fi; }
# Debian's interpreter, the one python3-torch installs into (a python3 earlier
# on PATH, e.g. pyenv's, would not see it); PYTHON overrides.
py=${PYTHON:-/usr/bin/python3}
"$py" -c 'import torch' 2>/dev/null || sudo_if_needed apt-get install -y --no-install-recommends python3-torch
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
    # PyTorch leaves OpenBLAS's own pool at one thread per core whatever
    # set_num_threads says; noloco runs BLAS single-threaded inside each
    # intra-op thread unless OPENBLAS_NUM_THREADS asks for a pool
    # (src/util/compute_threads.h). Both are given a pool of `threads`, so
    # that threads=1 means one core for both and threads=2 the same pools.
    o=$(OPENBLAS_NUM_THREADS=$threads build/noloco bench ${kv/steps=$steps/bench_steps=$steps} threads=$threads \
      peak_tflops=1 2>/dev/null | tail -1)
    # The same OpenBLAS kernels for both: noloco names its own where Debian's
    # OpenBLAS falls back to SSE3 ones (src/util/process_runtime.cpp), and
    # reports the core it ran; PyTorch is given that core.
    core=$(echo "$o" | python3 -c 'import json,sys;print(json.load(sys.stdin).get("blas_core",""))')
    t=$(OPENBLAS_CORETYPE=${OPENBLAS_CORETYPE:-$core} OPENBLAS_NUM_THREADS=$threads "$py" benchmarks/pytorch_step.py \
      $py_args --threads "$threads")
    ours+=("$(echo "$o" | python3 -c 'import json,sys;print(json.load(sys.stdin)["tokens_per_s"])')")
    theirs+=("$(echo "$t" | python3 -c 'import json,sys;print(json.load(sys.stdin)["tokens_per_s"])')")
    ours_mem=$(echo "$o" | python3 -c 'import json,sys;print(json.load(sys.stdin)["peak_rss_mib"])')
    theirs_mem=$(echo "$t" | python3 -c 'import json,sys;print(json.load(sys.stdin)["peak_rss_mib"])')
  done
  python3 - "$name" "$threads" "$ours_mem" "$theirs_mem" "${ours[*]}" "${theirs[*]}" "${OPENBLAS_CORETYPE:-$core}" <<'PY'
import statistics, sys
name, threads, om, tm, o, t, core = sys.argv[1:]
cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), "?")
o = [float(v) for v in o.split()]; t = [float(v) for v in t.split()]
mo, mt = statistics.median(o), statistics.median(t)
print(f"{name} ({threads} thread(s), median of {len(o)} alternating runs, {cpu}, OpenBLAS {core} kernels for both): "
      f"noloco {mo:.0f} tokens/s, PyTorch {mt:.0f} tokens/s, ratio {mo / mt:.2f}x; "
      f"peak memory {float(om):.0f} MiB vs {float(tm):.0f} MiB")
PY
done
