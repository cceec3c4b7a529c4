#!/usr/bin/env bash
# The pace of a run with idle strangers at its relay or at a forwarded port
# (issue 81): two homes of the testbed (scripts/wan_testbed.sh) train the
# same small NoLoCo run ROUNDS times without and ROUNDS times with a stranger
# on the public host holding N idle connections (scripts/port_stranger.py
# --hold; the far end closes each after its proof window and it is opened
# again). Prints each run's seconds per home, its bytes and routes.
#
#   scripts/stranger_run.sh relay [N] [ROUNDS]  # symmetric-like NAT: every byte through serve's relay; strangers there
#   scripts/stranger_run.sh port [N] [ROUNDS]   # forwarded ports, no relay: every byte direct; strangers at home 1's port
#
# Root; build/ built. Everything it makes is removed on exit.
set -euo pipefail
cd "$(dirname "$0")/.."
mode=${1:-relay} count=${2:-1000} rounds=${3:-2}
case "$mode" in relay) nat=random ;; port) nat=eim ;; *) echo "usage: $0 relay|port [N] [ROUNDS]" >&2; exit 2 ;; esac
P=nls
bin=$PWD/build/noloco
[ -x "$bin" ] || { echo "stranger_run: build/noloco not built (scripts/build.sh)" >&2; exit 2; }
dir=$(mktemp -d)
serve_pid="" stranger=""
cleanup() {
  for pid in $stranger $serve_pid; do kill -TERM "$pid" 2>/dev/null || true; done
  NLW_PREFIX=$P scripts/wan_testbed.sh down
  rm -rf "$dir"
}
trap cleanup EXIT
NLW_PREFIX=$P NLW_SAME_LAN=1 NLW_NAT=$nat scripts/wan_testbed.sh up 2 >/dev/null
port=29600
if [ "$mode" = port ]; then
  NLW_PREFIX=$P scripts/wan_testbed.sh forward 1 $port
  NLW_PREFIX=$P scripts/wan_testbed.sh forward 2 $port
fi
start_serve() {  # one serve a run: its store holds one run's keys
  ip netns exec $P-pub "$bin" serve bind=198.51.100.1 view=false >"$dir/$1.serve" 2>"$dir/$1.serve.log" &
  serve_pid=$!
  for _ in $(seq 100); do grep -q NOLOCO_RELAY "$dir/$1.serve" 2>/dev/null && break; sleep 0.1; done
  grep -q NOLOCO_RELAY "$dir/$1.serve" || { echo "stranger_run: serve printed no exports" >&2; cat "$dir/$1.serve.log" >&2; exit 1; }
  # shellcheck disable=SC1090
  source "$dir/$1.serve"
  relay=$NOLOCO_RELAY
  [ "$mode" = relay ] || unset NOLOCO_RELAY
}
stop_serve() {
  kill -TERM "$serve_pid"
  wait "$serve_pid" || true
  serve_pid=""
}
run="train configs/shakespeare.yaml data=data/tinyshakespeare.txt hidden=64 layers=2 heads=2 intermediate=128
     context=64 batch=4 warmup=2 steps=1000 outer_interval=50 method=noloco eval_interval=1000 eval_batches=2
     log_interval=100 sample_tokens=0 threads=1 peer_timeout=30 bind=10.0.0.2"
one_run() {  # name, with strangers (0/1)
  local name=$1
  start_serve "$name"
  local target
  target=$([ "$mode" = relay ] && echo "$relay" || echo "100.64.1.2:$port")
  stranger=""
  if [ "$2" = 1 ]; then
    ip netns exec $P-pub python3 scripts/port_stranger.py 600 --hold "$target" "$count" >"$dir/$name.stranger" 2>&1 &
    stranger=$!
    sleep 2
  fi
  local start
  start=$(date +%s.%N)
  local homes=()
  for k in 0 1; do
    local extra=""
    [ "$mode" = port ] && extra="listen_port=$port advertise=100.64.$((k + 1)).2"
    # shellcheck disable=SC2086
    (RANK=$k WORLD_SIZE=2 ip netns exec "$P-h$((k + 1))" "$bin" $run out="$dir/$name/h$k" $extra \
      >"$dir/$name.h$k.log" 2>&1; echo "$? $(date +%s.%N)" >"$dir/$name.h$k.end") &
    homes+=($!)
  done
  wait "${homes[@]}"
  [ -z "$stranger" ] || { kill -TERM "$stranger"; wait "$stranger" || true; stranger=""; }
  stop_serve
  python3 - "$dir" "$name" "$start" <<'EOF'
import json, sys
d, name, start = sys.argv[1], sys.argv[2], float(sys.argv[3])
cells = []
for k in (0, 1):
    code, end = open(f"{d}/{name}.h{k}.end").read().split()
    if code != "0":
        sys.exit(f"{name}: home {k + 1} exited {code}: " + open(f"{d}/{name}.h{k}.log").read()[-2000:])
    s = json.load(open(f"{d}/{name}/h{k}/summary_r{k}.json"))
    outer = [json.loads(l) for l in open(f"{d}/{name}/h{k}/metrics.jsonl") if '"outer"' in l]
    alone = sum(1 for o in outer if len(o["arrived"]) < 2)
    cells.append(f"home {k + 1} {float(end) - start:.1f} s ({s['bytes_sent']} B sent, {s.get('bytes_relayed', 0)} relayed, "
                 f"routes {s.get('routes')}, {alone} of {len(outer)} outer steps alone)")
try:
    cells.append(open(f"{d}/{name}.stranger").read().strip())
except FileNotFoundError:
    pass
print(f"{name}: " + "; ".join(cells), flush=True)
EOF
}
for r in $(seq "$rounds"); do
  one_run "plain$r" 0
  one_run "strangers$r" 1
done
