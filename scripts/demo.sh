#!/usr/bin/env bash
# The main job: install, build, train NoLoCo and DiLoCo with 4 replicas each on
# Tiny Shakespeare, then print their comparison. Extra key=value arguments
# apply to both runs (e.g. steps=500 replicas=8).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
scripts/build.sh
stamp=$(date +%Y%m%d-%H%M%S)
for method in noloco diloco; do
  build/noloco train configs/shakespeare.yaml method="$method" replicas=4 out="runs/demo-$stamp-$method" "$@"
done
echo
echo "NoLoCo vs DiLoCo (report: build/noloco report runs/demo-$stamp-*):"
build/noloco report "runs/demo-$stamp-noloco" "runs/demo-$stamp-diloco"
echo
echo "Sample from the NoLoCo replica 0:"
build/noloco generate "runs/demo-$stamp-noloco" prompt="ROMEO:" tokens=200 seed=1
