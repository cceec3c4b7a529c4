#!/usr/bin/env bash
# The whole test suite: install, build, ctest.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
scripts/build.sh
cd build && ctest --output-on-failure -j 2 --timeout 600
