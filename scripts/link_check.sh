#!/usr/bin/env bash
# Measures one link between two homes of the testbed (scripts/wan_testbed.sh):
# MB megabytes each way, both directions at once, ROUNDS times, over the route
# the homes' NAT kind allows (eim: a punched hole; random: the relay on the
# public host). Prints each end's JSON line (route, seconds per round), the
# links' physical limit, the worst round against it, how busy both routers'
# uplinks were together (their byte counters, sampled every 0.1 s), and the
# relay's CPU per GB carried.
#
#   scripts/link_check.sh [eim|random] [MB] [ROUNDS] [PAUSE] [paced[=RATE]]    # root; build/ built
#
# PAUSE (default 5) is the seconds each end waits between rounds, as a link
# idles between outer steps: the kernel then restarts the connection's
# congestion window, which back-to-back rounds never show. `paced`: each end
# is told its uplink's speed (the `uplink` key) and paces its links to it;
# `paced=RATE` tells it RATE instead (a speed test's figure that is off).
set -euo pipefail
cd "$(dirname "$0")/.."
nat=${1:-eim} mb=${2:-10} rounds=${3:-10} pause=${4:-5}
up=${NLW_UPLINK:-20mbit}
told=()
case "${5:-}" in
  paced) told=("$up") ;;
  paced=*) told=("${5#paced=}") ;;
esac
P=nlc
probe=$PWD/build/link_probe
[ -x "$probe" ] || { echo "link_check: build/link_probe not built (scripts/build.sh)" >&2; exit 2; }
dir=$(mktemp -d)
cleanup() { NLW_PREFIX=$P scripts/wan_testbed.sh down; rm -rf "$dir"; }
trap cleanup EXIT
NLW_PREFIX=$P NLW_SAME_LAN=1 NLW_NAT=$nat NLW_UPLINK=$up scripts/wan_testbed.sh up 2 >/dev/null
ip netns exec $P-pub "$probe" relay 198.51.100.1 7700 >"$dir/relay.out" 2>&1 &
relay=$!
sleep 0.3
tx() { ip netns exec "$P-r$1" cat /sys/class/net/wan/statistics/tx_bytes; }
( while :; do echo "$(date +%s.%N) $(tx 1) $(tx 2)"; sleep 0.1; done ) >"$dir/tx" &
sampler=$!
cpu0=$(awk '{print $14 + $15}' /proc/$relay/stat)
ip netns exec $P-h1 "$probe" end "$dir" a b 0 10.0.0.2 198.51.100.1:7700 "$mb" "$rounds" "$pause" "${told[@]}" >"$dir/a.out" 2>&1 &
ip netns exec $P-h2 "$probe" end "$dir" b a 1 10.0.0.2 198.51.100.1:7700 "$mb" "$rounds" "$pause" "${told[@]}" >"$dir/b.out" 2>&1 &
wait %3 %4 || true
cpu1=$(awk '{print $14 + $15}' /proc/$relay/stat)
kill $sampler
kill -TERM $relay; wait $relay || true
cat "$dir/a.out" "$dir/b.out"
python3 - "$dir" "$mb" "$up" "$cpu0" "$cpu1" <<'EOF'
import json, sys
d, mb, up, cpu0, cpu1 = sys.argv[1], float(sys.argv[2]), sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
rate = float(up.rstrip("mbit")) * 1e6 if up != "off" else None
ends = [json.loads(open(f"{d}/{n}.out").read()) for n in "ab"]
relay = json.loads(open(f"{d}/relay.out").read().splitlines()[-1])
rows = [list(map(float, l.split())) for l in open(f"{d}/tx") if len(l.split()) == 3]
if rate:
    limit = mb * 1e6 * 8 / rate
    worst = max(max(e["seconds"]) for e in ends)
    print(f"route {ends[0]['route']}: limit {limit:.2f} s for {mb:g} MB at {up}; "
          f"worst round {worst:.2f} s = {worst / limit:.3f}x; rounds (a) "
          + " ".join(f"{s:.2f}" for s in ends[0]["seconds"]))
    # Intervals of 0.5 s in which either uplink moved data: in how many were both above half their rate?
    busy = both = 0
    for i in range(5, len(rows), 5):
        dt = rows[i][0] - rows[i - 5][0]
        r1, r2 = ((rows[i][k] - rows[i - 5][k]) * 8 / dt for k in (1, 2))
        if max(r1, r2) > 0.5 * rate:
            busy += 1
            both += r1 > 0.5 * rate and r2 > 0.5 * rate
    print(f"uplinks: of {busy} half-second intervals with an uplink busy, both were busy in {both}")
hz = 100  # clock ticks per second (getconf CLK_TCK)
gb = relay["bytes"] / 1e9
print(f"relay: carried {relay['bytes']} bytes, spliced {relay['spliced']}, CPU {(cpu1 - cpu0) / hz:.2f} s"
      + (f" = {(cpu1 - cpu0) / hz / gb:.2f} CPU-s per GB" if gb > 0.01 else ""))
EOF
