#!/usr/bin/env bash
# The whole test suite: install, build (the fuzz targets too), ctest.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
scripts/build.sh
if command -v clang++ >/dev/null; then scripts/fuzz.sh build; fi
cd build && ctest --output-on-failure -j 2 --timeout 600
