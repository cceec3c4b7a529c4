#!/usr/bin/env bash
# Installs the Debian packages noloco needs, and makes .venv: the project's
# Python with pip's torch (the LibTorch the build uses) and the libraries the
# suite checks our files with (requirements-dev.txt). Idempotent: does nothing
# when all are present.
set -euo pipefail
packages=(
  build-essential cmake ninja-build ccache pkg-config procps iproute2 python3 python3-venv
  libgloo-dev etcd-server libcurl4-openssl-dev
  libsentencepiece-dev libyaml-cpp-dev libcli11-dev nlohmann-json3-dev
  libspdlog-dev libfmt-dev libgtest-dev libbenchmark-dev libpcre2-dev
  clang libclang-rt-14-dev libsodium-dev libssl-dev openssl tcpdump nftables zlib1g-dev libzstd-dev zstd
  libjs-dygraphs chromium curl python3-websocket
)
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  echo "setup: installing ${missing[*]}"
  sudo=""; [ "$(id -u)" -eq 0 ] || sudo="sudo"
  $sudo apt-get update -q
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -q "${missing[@]}"
fi
cd "$(dirname "$0")/.."
# The python3 on PATH (3.11 on the project's machines, where pip finds the
# torch wheel on disk); NOLOCO_PYTHON names another.
python=${NOLOCO_PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  echo "setup: making .venv with $("$python" --version 2>&1)"
  "$python" -m venv .venv
fi
if ! .venv/bin/python -m pip install -q --disable-pip-version-check -r requirements-dev.txt 2>.venv/pip.log; then
  grep -v "^WARNING: Location" .venv/pip.log >&2
  exit 1
fi
