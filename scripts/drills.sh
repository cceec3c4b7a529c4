#!/usr/bin/env bash
# Randomized failure drills (issue 32): 4-replica NoLoCo runs of a small model
# in which one or two workers are killed, frozen, killed halfway through a
# checkpoint or thrown off (weights plus noise: a replica that blew up, which
# its partners must refuse), at random ranks and steps, with and without restarts; every
# other run a worker joins at a random moment and may be killed; every third
# run the run's store (the launcher's etcd) is killed (SIGKILL) at a random
# moment. Every run must end by itself within twice the undisturbed run's
# wall time (plus the outage's cost, with the store killed), write its
# summary and leave no process behind. Writes a Markdown table.
#
#   scripts/drills.sh [RUNS] [OUT_DIR]     (defaults: 20, runs/drills)
#   DRILL_SEED=7 scripts/drills.sh ...     (the same drills again)
set -euo pipefail
cd "$(dirname "$0")/.."
runs=${1:-20}
out=${2:-runs/drills}
seed=${DRILL_SEED:-$RANDOM}
RANDOM=$seed
bin=build/noloco
[ -x "$bin" ] || { echo "drills: build first (scripts/build.sh)" >&2; exit 1; }
rm -rf "$out"
mkdir -p "$out"
steps=1500
common=(train configs/shakespeare.yaml hidden=32 layers=2 heads=2 context=32 batch=4 steps=$steps warmup=10
        eval_interval=100 eval_batches=2 log_interval=100 sample_tokens=0 method=noloco replicas=4
        outer_interval=20 heartbeat_timeout=5 peer_timeout=10)

# Seconds since the epoch, with fractions.
now() { date +%s.%N; }

# Whether any process of the run in $1 is left.
leftovers() { pgrep -f "[n]oloco (train .*out=$1( |$)|join $1 )" > /dev/null && echo yes || echo no; }

start=$(now)
"$bin" "${common[@]}" out="$out/undisturbed" > "$out/undisturbed.log" 2>&1
base=$(echo "$(now) - $start" | bc)
limit=$(echo "2 * $base" | bc)
# The worst replica's final validation loss in a run's summary.
worst_val() { python3 -c 'import json,sys; print("%.3f" % max(json.load(open(sys.argv[1])).get("final_val_loss_replicas") or [float("nan")]))' "$1/summary.json"; }
echo "drills: undisturbed run ${base%.*} s, worst final val loss $(worst_val "$out/undisturbed"); each drill must end within ${limit%.*} s (seed $seed)"

table="$out/drills.md"
{
  echo "| # | failures | restarts | joiner | store killed | exit | wall s | within 2x | summary | finished | failed / restarted | joined | renewed | worst val | processes left |"
  echo "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"
} > "$table"
ok=0
for ((i = 1; i <= runs; i++)); do
  failures=$((1 + RANDOM % 2))
  first=$((RANDOM % 4))
  plan=""
  for ((f = 0; f < failures; f++)); do
    rank=$(((first + f * (1 + RANDOM % 3)) % 4))
    case $((RANDOM % 4)) in
      0) point="$rank:$((20 + RANDOM % (steps - 40)))" ;;
      1) point="$rank:$((20 + RANDOM % (steps - 40))):freeze" ;;
      2) point="$rank:$((100 * (1 + RANDOM % (steps / 100 - 1)))):checkpoint" ;;
      3) point="$rank:$((20 + RANDOM % (steps - 40))):diverge" ;;
    esac
    plan+="${plan:+,}$point"
  done
  restarts=$((RANDOM % 2))
  dir="$out/drill_$i"
  # Every other drill, a worker joins the running run (`noloco join`, id 4)
  # at a random moment: killed during its hand-over, killed (SIGKILL) at a
  # random moment after it started, or left to train to the end.
  join=""
  if ((RANDOM % 2)); then
    join_at=$((3 + RANDOM % (${base%.*} / 2 + 1)))
    case $((RANDOM % 3)) in
      0) join="join@${join_at}s:handover" ;;
      1) join="join@${join_at}s:kill@$((join_at + 1 + RANDOM % 10))s" ;;
      2) join="join@${join_at}s" ;;
    esac
  fi
  # The outage's own cost is allowed on top: up to one peer_timeout (10 s), at
  # the first evaluation across replicas after it.
  store_kill="" run_limit=$limit
  ((RANDOM % 3 == 0)) && store_kill=$((3 + RANDOM % (${base%.*} / 2 + 1))) && run_limit=$(echo "$limit + 10" | bc)
  t0=$(now)
  set +e
  timeout -k 10 "$run_limit" "$bin" "${common[@]}" restarts=$restarts inject_crash="$plan" out="$dir" > "$dir.log" 2>&1 &
  run_pid=$!
  if [ -n "$join" ]; then
    (
      sleep "$join_at"
      crash=""; [[ $join == *:handover ]] && crash="inject_crash=4:handover"
      timeout -k 5 "$limit" "$bin" join "$dir" threads=1 $crash > "$dir.join.log" 2>&1 &
      joiner=$!
      if [[ $join == *:kill@* ]]; then
        kill_at=${join##*kill@}; sleep $((${kill_at%s} - join_at)); pkill -9 -f "[n]oloco join $dir " 2> /dev/null
      fi
      wait "$joiner"
    ) &
    join_pid=$!
  fi
  if [ -n "$store_kill" ]; then
    (
      sleep "$store_kill"
      launcher=$(pgrep -P "$run_pid" -x noloco | head -1)
      [ -n "$launcher" ] && pkill -9 -P "$launcher" -x etcd
    ) &
    store_pid=$!
  fi
  wait "$run_pid"
  code=$?
  [ -n "$store_kill" ] && { kill "$store_pid" 2> /dev/null; wait "$store_pid" 2> /dev/null; }
  [ -n "$join" ] && { kill "$join_pid" 2> /dev/null; wait "$join_pid" 2> /dev/null; }
  set -e
  wall=$(echo "$(now) - $t0" | bc)
  sleep 1
  left=$(leftovers "$dir")
  [ "$left" = yes ] && pkill -9 -f "[n]oloco (train .*out=$dir( |$)|join $dir )" || true
  summary=no finished="" lost="" joined="" renewed="" worst=""
  if [ -f "$dir/summary.json" ]; then
    summary=yes
    finished=$(python3 -c 'import json,sys; s=json.load(open(sys.argv[1])); print(",".join(map(str,s["replicas_finished"])))' "$dir/summary.json")
    joined=$(python3 -c 'import json,sys; s=json.load(open(sys.argv[1])); print(",".join(str(j["replica"]) for j in s.get("joined", [])))' "$dir/summary.json")
    renewed=$(python3 -c 'import json,sys; print(",".join(map(str, json.load(open(sys.argv[1])).get("replicas_renewed", []))))' "$dir/summary.json")
    worst=$(worst_val "$dir")
    lost=$(python3 -c 'import json,sys; s=json.load(open(sys.argv[1])); print(" ".join([str(f["replica"]) for f in s["replicas_failed"]] + [str(f["replica"]) + "(restarted)" for f in s.get("replicas_restarted", [])]))' "$dir/summary.json")
  fi
  store_cell=${store_kill:+at ${store_kill}s}
  store_cell=${store_cell:-–}
  within=$([ "$code" -ne 124 ] && [ "$code" -ne 137 ] && echo yes || echo no)
  [ "$within" = yes ] && [ "$summary" = yes ] && [ "$left" = no ] && ok=$((ok + 1))
  printf '| %d | `%s` | %d | %s | %s | %d | %.0f | %s | %s | %s | %s | %s | %s | %s | %s |\n' "$i" "$plan" "$restarts" \
    "${join:-–}" "$store_cell" "$code" "$wall" "$within" "$summary" "$finished" "$lost" "$joined" "$renewed" "$worst" "$left" | tee -a "$table"
done
echo "drills: $ok of $runs ended by themselves within ${limit%.*} s with a summary and no process left (seed $seed)" | tee -a "$table"
[ "$ok" -eq "$runs" ]
