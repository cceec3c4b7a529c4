#!/usr/bin/env bash
# The main job: install, build, train on Tiny Shakespeare, print a summary and a sample.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
scripts/build.sh
build/noloco train configs/shakespeare.yaml "$@"
