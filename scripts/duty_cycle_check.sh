#!/usr/bin/env bash
# Issue 105's slow machine made from outside the program: four NoLoCo workers
# started as machines of their own (RANK, WORLD_SIZE, MASTER_ADDR on
# loopback), worker 3's process held by SIGSTOP for STOP seconds and let run
# for CONT seconds, over and over, by this script. Prints, for pace=steps and
# pace=speed, each worker's trained steps/s against the same run with nobody
# held.
#
#   scripts/duty_cycle_check.sh DATA STEPS [STOP CONT] [train keys...]   # build/ built
#   scripts/duty_cycle_check.sh data/tinyshakespeare.txt 1000 0.2 0.1
set -euo pipefail
cd "$(dirname "$0")/.."
data=${1:?DATA} steps=${2:?STEPS} stop=${3:-0.2} cont=${4:-0.1}
shift $(($# < 4 ? $# : 4))
work=$(mktemp -d)
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill -CONT "$p" 2>/dev/null || true; kill "$p" 2>/dev/null || true; done
  rm -rf "$work"
}
trap cleanup EXIT
small="hidden=32 layers=2 heads=2 intermediate=64 context=32 batch=4 threads=1 eval_interval=$steps eval_batches=10
  log_interval=$((steps / 10)) spread_interval=0 sample_tokens=0 data=$data method=noloco steps=$steps"

run() {  # NAME HELD PACE
  local name=$1 held=$2 pace=$3 port
  shift 3
  port=$(.venv/bin/python -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
  pids=()
  for k in 0 1 2 3; do
    RANK=$k WORLD_SIZE=4 MASTER_ADDR=127.0.0.1 MASTER_PORT=$port NOLOCO_RUN_TOKEN=duty-cycle-$name \
      timeout -k 5 600 build/noloco train configs/shakespeare.yaml $small pace="$pace" "$@" out="$work/$name" \
      >"$work/$name-$k.log" 2>&1 &
    pids+=($!)
  done
  if [ "$held" = yes ]; then
    local worker=""  # the worker itself, not the timeout around it
    until [ -n "$worker" ]; do worker=$(pgrep -P "${pids[3]}" || true); done
    while kill -STOP "$worker" 2>/dev/null; do
      sleep "$stop"
      kill -CONT "$worker" 2>/dev/null || break
      sleep "$cont"
    done
  fi
  for k in 0 1 2 3; do
    wait "${pids[$k]}" || { echo "$name: worker $k failed:"; tail -3 "$work/$name-$k.log"; exit 1; }
  done
  pids=()
}

for pace in steps speed; do
  run "free-$pace" no "$pace" "$@"
  run "held-$pace" yes "$pace" "$@"
  .venv/bin/python - "$work" "$pace" <<'PY'
import json, sys
work, pace = sys.argv[1], sys.argv[2]
rate = lambda name, k: json.load(open(f"{work}/{name}-{pace}/summary_r{k}.json"))["trained_steps_per_second"]
ratios = [rate("held", k) / rate("free", k) for k in range(4)]
print(f"pace={pace}: steps/s held/free: workers 0-2 " + ", ".join(f"{r:.2f}" for r in ratios[:3]) +
      f"; worker 3 (held) {ratios[3]:.2f}")
PY
done
