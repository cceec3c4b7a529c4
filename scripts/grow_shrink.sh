#!/usr/bin/env bash
# A NoLoCo run that grows from 4 to 8 replicas and shrinks back to 4
# (docs/results-log.md, "Joining and leaving"): 4 workers join (`noloco join`)
# once the run has logged step GROW_AT, and those 4 leave (SIGTERM) once it
# has logged step SHRINK_AT. Extra arguments go to `train` (and so to the
# joiners through the run's config.yaml).
# Usage: scripts/grow_shrink.sh OUT_DIR [GROW_AT [SHRINK_AT [key=value...]]]
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:?usage: scripts/grow_shrink.sh OUT_DIR [GROW_AT [SHRINK_AT [key=value...]]]}
grow_at=${2:-500}
shrink_at=${3:-1500}
shift $(( $# < 3 ? $# : 3 ))
rm -rf "$out"

# The newest training step any replica has logged (0 before the first).
logged_step() {
  [ -f "$out/metrics.jsonl" ] || { echo 0; return; }
  local newest
  newest=$(grep '"split":"train"' "$out/metrics.jsonl" | grep -o '"step":[0-9]*' | cut -d: -f2 | sort -n | tail -1 || true)
  echo "${newest:-0}"
}
wait_for_step() {
  while [ "$(logged_step)" -lt "$1" ]; do
    kill -0 "$trainer" 2>/dev/null || { echo "the run ended before step $1" >&2; exit 1; }
    sleep 1
  done
}

build/noloco train configs/shakespeare.yaml method=noloco replicas=4 sample_tokens=0 out="$out" "$@" \
  > "$out.train.log" 2>&1 &
trainer=$!
trap 'kill $trainer ${joiners[*]:-} 2>/dev/null || true' EXIT

wait_for_step "$grow_at"
joiners=()
for i in 1 2 3 4; do
  build/noloco join "$out" > "$out.join$i.log" 2>&1 &
  joiners+=($!)
done
started=$(date +%s.%N)
echo "step $(logged_step): 4 joiners started (pids ${joiners[*]})"
# From start to first outer step: each joiner's first "outer" record (to about 1 s).
for id in 4 5 6 7; do
  until grep '"split":"outer"' "$out/metrics.jsonl" | grep -q "\"replica\":$id,"; do
    kill -0 "$trainer" 2>/dev/null || break
    sleep 1
  done
  echo "replica $id: first outer step $(awk -v now="$(date +%s.%N)" -v t0="$started" 'BEGIN { printf "%.1f", now - t0 }') s after the joiners started"
done

wait_for_step "$shrink_at"
kill -TERM "${joiners[@]}"
echo "step $(logged_step): SIGTERM to the joiners"
status=0
for pid in "${joiners[@]}"; do wait "$pid" || status=$?; done
wait "$trainer" || status=$?
trap - EXIT
echo "run exit status $status; summary: $out/summary.json"
exit $status
