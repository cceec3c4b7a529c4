#!/usr/bin/env bash
# The swarm benchmark: N tiny NoLoCo replicas on this machine, for each N
# given (8 16 32 64 by default), so that what grows with the swarm's size can
# be read: per run its wall time, the seconds outer steps held training up
# (meetings, exchanges) per replica, what training asked of the run's store
# per replica per outer step (requests and KiB; heartbeats and the live page
# go by the clock and are left out), the evaluations' sample (k of N), and
# the warnings the run printed. On one machine compute per replica slows as
# N grows (N processes share its cores); the store's figures should not.
# Extra key=value arguments go to every run.
# Usage: scripts/swarm.sh OUT_DIR [N...] [-- key=value...]
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:?usage: scripts/swarm.sh OUT_DIR [N...] [-- key=value...]}
shift
sizes=()
while [ $# -gt 0 ] && [ "$1" != "--" ]; do sizes+=("$1"); shift; done
[ "${1:-}" = "--" ] && shift
[ ${#sizes[@]} -gt 0 ] || sizes=(8 16 32 64)
mkdir -p "$out"

printf '%4s %6s %4s %8s %10s %12s %13s %8s %8s\n' N wall_s rc blocked_s startup_s store_req/os store_KiB/os spread warnings
for n in "${sizes[@]}"; do
  run="$out/n$n"
  rm -rf "$run"
  rc=0
  start=$(date +%s.%N)
  build/noloco train configs/shakespeare.yaml method=noloco replicas="$n" max_local_workers="$n" \
    hidden=16 layers=1 heads=1 context=32 batch=4 steps=100 outer_interval=10 eval_interval=50 eval_batches=2 \
    warmup=10 log_interval=50 sample_tokens=0 out="$run" "$@" > "$run.log" 2>&1 || rc=$?
  wall=$(awk -v now="$(date +%s.%N)" -v t0="$start" 'BEGIN { printf "%.1f", now - t0 }')
  warnings=$(grep -c 'warning' "$run.log" || true)
  if [ -f "$run/summary.json" ]; then
    jq -r --arg n "$n" --arg wall "$wall" --arg rc "$rc" --arg warnings "$warnings" '
      def f(x; d): if x == null then "-" else (x * d | round) / d | tostring end;
      [$n, $wall, $rc, f(.outer_blocked_seconds_per_replica; 10), f(.worker_startup_seconds; 10),
       f(.store_requests_per_outer_step; 10), f(.store_kib_read_per_outer_step; 10),
       (if .spread_replicas == null then "-" else "\(.spread_replicas)/\(.live_replicas)" end), $warnings]
      | @tsv' "$run/summary.json" |
      awk -F'\t' '{ printf "%4s %6s %4s %8s %10s %12s %13s %8s %8s\n", $1, $2, $3, $4, $5, $6, $7, $8, $9 }'
  else
    printf '%4s %6s %4s %8s %10s %12s %13s %8s %8s\n' "$n" "$wall" "$rc" - - - - - "$warnings"
  fi
done
