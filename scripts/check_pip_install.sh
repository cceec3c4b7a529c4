#!/usr/bin/env bash
# What a user with torch in a venv of their own does: builds noloco's wheel
# (from build/, incrementally, against .venv's torch), installs it into a new
# venv that has only torch==2.13.0, imports it, asks `noloco --version`, and
# trains examples/char_gru_noloco.py under the installed `noloco launch`.
# With OTHER_TORCH_VENV naming a venv that has another torch, checks that
# `import noloco` there fails in one line naming both versions.
#   scripts/check_pip_install.sh [WORK_DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
source=$PWD
work=${1:-$(mktemp -d)}
mkdir -p "$work"
log() { echo "check_pip_install: $*" >&2; }

start=$(date +%s)
.venv/bin/pip wheel -q --no-build-isolation --no-deps -C build-dir=build -C cmake.define.NOLOCO_BUILD_TESTS=ON \
  . -w "$work/dist" 2>&1 | grep -v "^WARNING: Location" || true
wheel=$(ls "$work"/dist/noloco-*.whl)
log "built $(basename "$wheel") in $(($(date +%s) - start)) s"

python3 -m venv "$work/user"
"$work/user/bin/pip" install -q --disable-pip-version-check torch==2.13.0 2>&1 | grep -v "^WARNING: Location" || true
"$work/user/bin/pip" install -q --disable-pip-version-check "$wheel" 2>&1 | grep -v "^WARNING: Location" || true
(cd "$work" && "$work/user/bin/python" -c "import noloco, torch; print('import noloco: ok beside torch', torch.__version__)")
"$work/user/bin/noloco" --version
start=$(date +%s)
(cd "$work" && PATH="$work/user/bin:$PATH" noloco launch 4 -- python "$source/examples/char_gru_noloco.py" \
  --data "$source/data/tinyshakespeare.txt" >"$work/gru.log" 2>&1) || { tail -20 "$work/gru.log"; exit 1; }
log "examples/char_gru_noloco.py under the installed noloco launch: $(($(date +%s) - start)) s"
grep -i "val" "$work/gru.log" | tail -4

if [ -n "${OTHER_TORCH_VENV:-}" ]; then
  site=$("$OTHER_TORCH_VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  cp -r "$work/user/lib/python3.11/site-packages/noloco" "$site/"
  if (cd "$work" && "$OTHER_TORCH_VENV/bin/python" -c "import noloco" 2>"$work/other.log"); then
    log "import noloco beside $("$OTHER_TORCH_VENV/bin/python" -c 'import torch; print(torch.__version__)') did not fail"
    exit 1
  fi
  tail -1 "$work/other.log"
  rm -rf "$site/noloco"
fi
