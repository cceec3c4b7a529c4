#!/usr/bin/env bash
# The main job: install, build, train NoLoCo and DiLoCo with 4 replicas each on
# Tiny Shakespeare, then print their comparison and draw it. Extra key=value
# arguments apply to both runs (e.g. steps=500 replicas=8).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
scripts/build.sh
stamp=$(date +%Y%m%d-%H%M%S)
runs=("runs/demo-$stamp-noloco" "runs/demo-$stamp-diloco")
echo "Two runs follow, NoLoCo then DiLoCo, 4 replicas each (configs/shakespeare.yaml $*), one after the other:"
echo "each line's ETA is its own run's; the second takes about as long as the first."
echo "At the default budget they took 10m37s in all on a 2-core machine (5m16s and 5m11s of training;"
echo "more cores, less time) and left 1.1 GB in runs/ (535 MB each, nearly all checkpoints)."
start=$(date +%s)
for run in "${runs[@]}"; do
  build/noloco train configs/shakespeare.yaml method="${run##*-}" replicas=4 out="$run" "$@"
done
echo
echo "NoLoCo vs DiLoCo (final val loss: the mean over each run's replicas; the runs' logs end with replica 0's):"
build/noloco report "${runs[@]}" out="runs/demo-$stamp-report"
echo
echo "Sample from the NoLoCo run's model (the mean of its replicas' weights where it validated best):"
build/noloco generate "${runs[0]}" prompt="ROMEO:" tokens=200 seed=1
echo
echo "Took $(( ($(date +%s) - start) / 60 )) min; the runs hold $(du -shc "${runs[@]}" | tail -1 | cut -f1)."
echo "Plots and table: runs/demo-$stamp-report/report.md (build/noloco report ${runs[*]} out=DIR draws them again)."
