#!/usr/bin/env bash
# Issue 105's real-training check: 8 replicas of the small model, replicas 6
# and 7 slowed 3x (slowdown=6:3,7:3), against the same run on equal machines,
# with today's schedule (pace=steps) and the paced one (pace=speed). Prints,
# per method: the fast replicas' steps/s against the equal run's, the mean
# validation loss the paced and today's runs reach at the paced run's end
# (equal wall-clock), and the paced run's loss against the equal run's at the
# same total tokens.
#
#   scripts/unequal_check.sh DATA STEPS [train keys...]     # build/ built
#   scripts/unequal_check.sh data/tinyshakespeare.txt 2000
#   METHODS=noloco scripts/unequal_check.sh data/tinyshakespeare.txt 2000 partner_wait=0.25
set -euo pipefail
cd "$(dirname "$0")/.."
data=${1:?DATA} steps=${2:?STEPS}
shift 2
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
small="hidden=32 layers=2 heads=2 intermediate=64 context=32 batch=4 threads=1 eval_interval=$((steps / 10))
  eval_batches=10 log_interval=$((steps / 10)) spread_interval=$steps sample_tokens=0 data=$data"
for method in ${METHODS:-noloco diloco}; do
  for run in equal:pace=steps today:pace=steps paced:pace=speed; do
    name=${run%%:*} keys=${run#*:}
    slow=""
    [ "$name" != equal ] && slow="slowdown=6:3,7:3"
    build/noloco train configs/shakespeare.yaml $small method=$method replicas=8 steps="$steps" $keys $slow "$@" \
      out="$work/$method-$name" >"$work/$method-$name.log" 2>&1 || { tail -5 "$work/$method-$name.log"; exit 1; }
  done
  python3 - "$work" "$method" <<'PY'
import json, sys, statistics
work, method = sys.argv[1], sys.argv[2]
def load(name):
    d = f"{work}/{method}-{name}"
    val = {}
    for line in open(d + "/metrics.jsonl"):
        r = json.loads(line)
        if r.get("split") == "val" and "loss" in r:
            val.setdefault(r["step"], []).append((r["loss"], r["elapsed"]))
    curve = sorted((s, statistics.mean(l for l, _ in v), statistics.mean(e for _, e in v)) for s, v in val.items())
    reps = [json.load(open(f"{d}/summary_r{i}.json")) for i in range(8)]
    return curve, reps
def at(curve, x, key):  # loss interpolated at `x` of column key (1: elapsed, 0: step)
    col = {"elapsed": 2, "step": 0}[key]
    pts = [(c[col], c[1]) for c in curve]
    if x <= pts[0][0]: return pts[0][1]
    for (x0, y0), (x1, y1) in zip(pts, pts[1:]):
        if x <= x1: return y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    return pts[-1][1]
eq, eq_r = load("equal"); to, to_r = load("today"); pa, pa_r = load("paced")
fast = lambda reps: statistics.mean(r["trained_steps_per_second"] for r in reps[:6])
tokens = lambda reps: sum(r["tokens"] for r in reps)
end = pa[-1][2]
per_step = tokens(eq_r) / eq[-1][0]  # tokens of all replicas a slot on equal machines
print(f"{method}: fast replicas' steps/s: equal {fast(eq_r):.1f}, today {fast(to_r):.1f} ({fast(to_r)/fast(eq_r):.0%}), "
      f"paced {fast(pa_r):.1f} ({fast(pa_r)/fast(eq_r):.0%})")
print(f"{method}: slow replicas' steps an outer step, paced: "
      f"{[round(r.get('trained_steps_per_outer_step', 0), 1) for r in pa_r[6:]]}; wall s: equal {eq[-1][2]:.0f}, "
      f"today {to[-1][2]:.0f}, paced {end:.0f}")
print(f"{method}: val loss at the paced run's end ({end:.0f} s): paced {pa[-1][1]:.4f}, today {at(to, end, 'elapsed'):.4f}")
same = at(eq, tokens(pa_r) / per_step, "step")
print(f"{method}: at the paced run's {tokens(pa_r)} tokens: paced {pa[-1][1]:.4f}, equal machines {same:.4f} "
      f"({(pa[-1][1] - same) / same:+.2%})")
PY
done
