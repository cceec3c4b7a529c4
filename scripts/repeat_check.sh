#!/usr/bin/env bash
# Runs one training command RUNS times, with BUSY busy loops beside it (a
# loaded machine: threads are scheduled late), and counts the distinct
# outcomes: each run's final validation loss of every replica, to the bit
# (summary.json's final_val_loss_replicas). One outcome: the run does not
# depend on thread timing.
#
#   scripts/repeat_check.sh RUNS BUSY [train keys...]     # build/ built
#   scripts/repeat_check.sh 20 2 method=noloco replicas=2 overlap=true compression=sparse steps=200 outer_interval=10
set -euo pipefail
cd "$(dirname "$0")/.."
runs=${1:?RUNS} busy=${2:?BUSY}
shift 2
work=$(mktemp -d)
: >"$work/went_on"
loops=()
cleanup() {
  ((${#loops[@]})) && kill "${loops[@]}" 2>/dev/null || true
  rm -rf "$work"
}
trap cleanup EXIT
for ((b = 0; b < busy; ++b)); do
  (while :; do :; done) &
  loops+=($!)
done
# A small model that trains in seconds on 2 cores.
small="hidden=32 layers=2 heads=2 intermediate=64 context=32 batch=4 eval_interval=100 eval_batches=2 sample_tokens=0"
for ((r = 0; r < runs; ++r)); do
  out="$work/run$r"
  if ! build/noloco train configs/shakespeare.yaml $small "$@" out="$out" >"$work/log$r" 2>&1; then
    echo "run $r failed:"
    tail -n 5 "$work/log$r"
    exit 1
  fi
  .venv/bin/python -c 'import json,sys; s=json.load(open(sys.argv[1])); print(repr(s["final_val_loss_replicas"]))' \
    "$out/summary.json" >>"$work/outcomes"
  grep -h "went on without it" "$work/log$r" >>"$work/went_on" || true
done
echo "$runs runs beside $busy busy loops: $(sort -u "$work/outcomes" | wc -l) distinct outcome(s)"
sort "$work/outcomes" | uniq -c
echo "lines 'went on without it': $(wc -l <"$work/went_on")"
