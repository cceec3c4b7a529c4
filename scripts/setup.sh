#!/usr/bin/env bash
# Installs the Debian packages noloco needs. Idempotent: does nothing when all are present.
set -euo pipefail
packages=(
  build-essential cmake ninja-build ccache pkg-config procps iproute2 python3
  python3-dev python3-torch pybind11-dev
  libtorch-dev libopenblas0-pthread libgloo-dev etcd-server libcurl4-openssl-dev
  libsentencepiece-dev libyaml-cpp-dev libcli11-dev nlohmann-json3-dev
  libspdlog-dev libfmt-dev libgtest-dev libbenchmark-dev libpcre2-dev
  clang libclang-rt-14-dev libsodium-dev libssl-dev openssl tcpdump nftables zlib1g-dev libzstd-dev zstd
  libcpp-httplib-dev libjs-dygraphs chromium curl python3-websocket
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
# LibTorch trains ~17x slower on the reference BLAS: make sure OpenBLAS is the one used.
blas=$(update-alternatives --query libblas.so.3-x86_64-linux-gnu 2>/dev/null | awk '/^Value:/{print $2}')
case "$blas" in
  *openblas*) ;;
  *) echo "setup: warning: libblas.so.3 points to '${blas:-unknown}', not OpenBLAS; training will be slow" >&2 ;;
esac
