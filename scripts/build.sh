#!/usr/bin/env bash
# Configures (once) and builds into build/. Incremental on later runs.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -f build/build.ninja ]; then
  cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release
  # Measured on the 2-core reference machine, CLI, module and tests.
  echo "build.sh: a first build compiles about 160 steps, some 15 minutes on 2 free cores (ccache makes the next one quicker)"
fi
cmake --build build -j "$(nproc)"
# `import noloco`: the module's folder on the path of the Python it was built
# for (.venv's, whose torch is this LibTorch).
if [ -f build/python/interpreter ] && compgen -G "build/python/noloco/_noloco*.so" >/dev/null; then
  python=$(cat build/python/interpreter)
  site=$("$python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')  # a venv reads no user site
  mkdir -p "$site"
  echo "$PWD/build/python" >"$site/noloco.pth"
fi
