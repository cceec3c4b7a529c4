#!/usr/bin/env bash
# The README's recipe for homes, on the testbed (scripts/wan_testbed.sh): a
# `noloco serve` on the public host (no token given: it mints one), four
# homes behind their own routers on the same LAN address, each running the
# README's train line; at outer step KILL_AT of worker 0 the serve is killed
# (SIGKILL) and, PAUSE seconds later, the same command run again. Prints each
# worker's exit status and what its summary says of routes and the outage.
#
#   scripts/home_outage_check.sh [KILL_AT] [PAUSE] [train keys...]   # root; build/ built
set -euo pipefail
cd "$(dirname "$0")/.."
kill_at=${1:-10} pause=${2:-5}
shift $(($# < 2 ? $# : 2))
export NLW_PREFIX=${NLW_PREFIX:-hoc} NLW_SAME_LAN=1
work=$(mktemp -d)
cleanup() {
  pkill -f "[n]oloco serve advertise=198.51.100.1 port=29600" 2>/dev/null || true
  scripts/wan_testbed.sh down >/dev/null 2>&1 || true
  rm -rf "$work"
}
trap cleanup EXIT
scripts/wan_testbed.sh up 4 >/dev/null
serve_line="build/noloco serve advertise=198.51.100.1 port=29600 relay_port=29601"
start_serve() {
  ip netns exec "$NLW_PREFIX-pub" env -u NOLOCO_RUN_TOKEN XDG_STATE_HOME="$work/state" $serve_line \
    >"$work/serve$1.out" 2>"$work/serve$1.log" &
  echo $! >"$work/serve.pid"
  for _ in $(seq 300); do grep -q NOLOCO_RELAY "$work/serve$1.out" 2>/dev/null && return 0; sleep 0.1; done
  echo "the serve did not print its lines:"; cat "$work/serve$1.log"; exit 1
}
start_serve 0
exports=$(grep '^export ' "$work/serve0.out")
pids=()
for k in 0 1 2 3; do
  ip netns exec "$NLW_PREFIX-h$((k + 1))" bash -c "$exports
    RANK=$k WORLD_SIZE=4 exec build/noloco train configs/shakespeare.yaml method=noloco bind=10.0.0.2 uplink=20mbit \
      out=$work/h$k $*" >"$work/h$k.log" 2>&1 &
  pids+=($!)
done
outer_records() {
  local n
  n=$(grep -c '"split":"outer"' "$work/h0/metrics.jsonl" 2>/dev/null) || true
  echo "${n:-0}"
}
until (($(outer_records) >= kill_at)); do
  kill -0 "${pids[0]}" 2>/dev/null || { echo "worker 0 ended before outer step $kill_at"; break; }
  sleep 0.5
done
kill -KILL "$(cat "$work/serve.pid")"
echo "serve killed at worker 0's outer record $(outer_records); the same command again in ${pause}s"
sleep "$pause"
start_serve 1
same=$([ "$(grep '^export NOLOCO_RUN_TOKEN' "$work/serve1.out")" = "$(grep '^export NOLOCO_RUN_TOKEN' "$work/serve0.out")" ] && echo yes || echo no)
echo "the restarted serve printed the same token: $same; it said: $(grep -o 'taking back the run[^(]*' "$work/serve1.log" || echo nothing)"
for k in 0 1 2 3; do
  rc=0
  wait "${pids[$k]}" || rc=$?
  summary="$work/h$k/summary_r$k.json"
  if [ -f "$summary" ]; then
    .venv/bin/python - "$summary" "$rc" "$k" <<'EOF'
import json, sys
s = json.load(open(sys.argv[1]))
keys = ["bytes_sent", "bytes_punched", "bytes_relayed", "paired_fraction", "store_outages", "store_outage_seconds",
        "outer_steps_alone_without_store", "final_val_loss"]
print(f"worker {sys.argv[3]}: exit {sys.argv[2]}, " + ", ".join(f"{k} {s.get(k)}" for k in keys))
EOF
  else
    echo "worker $k: exit $rc, no summary"; tail -n 3 "$work/h$k.log"
  fi
done
