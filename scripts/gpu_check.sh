#!/usr/bin/env bash
# The GPU check: builds noloco against the LibTorch of this machine's PyTorch
# (CUDA), runs the CUDA tests, benchmarks 125m and 1.3b in bf16 against the same
# model in PyTorch on the same GPU, and writes the figures to RESULTS_DIR
# (default gpu_check/): gpu_results.json, tests.log, build.log.
#
#   scripts/gpu_check.sh [RESULTS_DIR]
#   scripts/gpu_check.sh --build-only     (just build-gpu/, e.g. to train on the GPU)
#   scripts/gpu_check.sh --tests-only [RESULTS_DIR]   (the build and the CUDA tests, no benchmarks)
#
# Needs python3 with a CUDA build of torch, cmake, ninja (or make) and a C++17
# compiler, plus the Debian packages the project builds with. As root with a
# working apt-get they are installed; on a machine without a network, fetch them
# on a Debian 12 machine with
#   scripts/gpu_check.sh --fetch-debs DIR
# copy DIR over and run with NOLOCO_DEBS=DIR: the packages are unpacked into a
# private prefix, nothing on the system is touched.
set -euo pipefail
cd "$(dirname "$0")/.."

build_packages=(etcd-server libyaml-cpp-dev libfmt-dev libspdlog-dev nlohmann-json3-dev libcurl4-openssl-dev libgloo-dev libgtest-dev
  libpcre2-dev libsodium-dev libssl-dev libzstd-dev zlib1g-dev)
# What those link against, minus the C and C++ runtimes every machine has.
runtime_packages=(libyaml-cpp0.7 libfmt9 libspdlog1.10 libcurl4 libpcre2-8-0 libsodium23 libbrotli1 libcom-err2 libdb5.3 libffi8 libgmp10
  libgnutls30 libgssapi-krb5-2 libhogweed6 libidn2-0 libk5crypto3 libkeyutils1 libkrb5-3 libkrb5support0
  libldap-2.5-0 libnettle8 libnghttp2-14 libp11-kit0 libpsl5 librtmp1 libsasl2-2 libsasl2-modules-db libssh2-1
  libssl3 libtasn1-6 libunistring2 libzstd1 zlib1g)

if [ "${1:-}" = --fetch-debs ]; then
  dir=${2:?usage: scripts/gpu_check.sh --fetch-debs DIR}
  mkdir -p "$dir"
  (cd "$dir" && apt-get download "${build_packages[@]}" "${runtime_packages[@]}")
  echo "fetched $(ls "$dir"/*.deb | wc -l) packages into $dir"
  exit 0
fi

build_only=false tests_only=false
if [ "${1:-}" = --build-only ]; then build_only=true; shift; fi
if [ "${1:-}" = --tests-only ]; then tests_only=true; shift; fi
results=${1:-gpu_check}
mkdir -p "$results"
results=$(cd "$results" && pwd)
log() { echo "gpu_check: $*" >&2; }

prefix_path=$(python3 -c 'import torch; print(torch.utils.cmake_prefix_path)')
python3 -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else "torch sees no CUDA device")'
cxx_flags=""
if [ -n "${NOLOCO_DEBS:-}" ]; then
  deps=${NOLOCO_DEPS_PREFIX:-/tmp/noloco-gpu-deps}
  mkdir -p "$deps"
  for f in "$NOLOCO_DEBS"/*.deb; do dpkg -x "$f" "$deps"; done
  # The packages' pkg-config files name /usr; point them at the private prefix.
  find "$deps/usr" -name '*.pc' -exec sed -i "s|=/usr|=$deps/usr|g" {} +
  export PKG_CONFIG_PATH="$deps/usr/lib/x86_64-linux-gnu/pkgconfig:$deps/usr/share/pkgconfig${PKG_CONFIG_PATH:+:$PKG_CONFIG_PATH}"
  prefix_path="$prefix_path;$deps/usr"
  # pip's LibTorch ships fmt headers of its own (a newer fmt than spdlog was
  # built with); a directory given with -I is searched before LibTorch's
  # -isystem ones, so fmt and spdlog come from the packages.
  rm -rf "$deps/first" && mkdir -p "$deps/first" && cp -r "$deps/usr/include/fmt" "$deps/usr/include/spdlog" "$deps/first/"
  cxx_flags="-I$deps/first"
  export LD_LIBRARY_PATH="$deps/usr/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  export LIBRARY_PATH="$deps/usr/lib/x86_64-linux-gnu"
  export NOLOCO_ETCD=${NOLOCO_ETCD:-$deps/usr/bin/etcd}
elif command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
  apt-get install -y --no-install-recommends "${build_packages[@]}"
fi

# pip's NCCL wheel (nvidia-nccl-*) holds nccl.h for a replica's NCCL group.
if [ -z "${NCCL_ROOT:-}" ]; then
  NCCL_ROOT=$(python3 -c 'import glob, os, nvidia
print(next((os.path.dirname(os.path.dirname(h)) for b in nvidia.__path__
            for h in glob.glob(os.path.join(b, "**", "nccl.h"), recursive=True)), ""))' 2>/dev/null || true)
  export NCCL_ROOT
fi
log "building against $(python3 -c 'import torch; print(torch.__version__)'), NCCL from ${NCCL_ROOT:-nowhere}"
generator=() keep_going=(-k)
if command -v ninja >/dev/null; then generator=(-G Ninja) keep_going=(-k 0); fi
configure() {
  cmake -S . -B build-gpu "${generator[@]}" -DCMAKE_BUILD_TYPE=Release -DCMAKE_PREFIX_PATH="$prefix_path" \
    -DCMAKE_CXX_FLAGS="$cxx_flags" "$@" >>"$results/build.log" 2>&1 || { tail -30 "$results/build.log"; exit 1; }
  grep "NCCL for a replica" "$results/build.log" | tail -1 >&2
}
build() { cmake --build build-gpu -j "$(nproc)" -- "${keep_going[@]}" >>"$results/build.log" 2>&1; }
: >"$results/build.log"
configure
if ! build; then
  grep -m 20 -A 5 "error" "$results/build.log" >&2
  # The NCCL group is the one piece only this kind of machine compiles: without it the rest is still checked.
  grep -q "NCCL for a replica's own group: ON" "$results/build.log" || exit 1
  log "the build failed with NCCL on; building without it"
  configure -DNOLOCO_NCCL=OFF
  build || { grep -m 20 -A 5 "error" "$results/build.log"; exit 1; }
fi

if $build_only; then
  log "built build-gpu/noloco${LD_LIBRARY_PATH:+ (run it with LD_LIBRARY_PATH=$LD_LIBRARY_PATH NOLOCO_ETCD=$NOLOCO_ETCD)}"
  exit 0
fi

log "CUDA tests"
tests_rc=0
# Not Golden.*: its losses are bit-identical on the LibTorch they were recorded with (1.13) only.
stdbuf -oL build-gpu/noloco_tests --gtest_filter='Cuda*:InnerOptimizer.*:Model.*' >"$results/tests.log" 2>&1 || tests_rc=$?
grep -E "^\[  (PASSED|FAILED|SKIPPED) \]|largest train-loss" "$results/tests.log" >&2 || true

if $tests_only; then exit "$tests_rc"; fi
log "benchmarks"
bench() {  # name, noloco bench arguments, pytorch_step.py arguments
  local ours theirs
  ours=$(build-gpu/noloco bench device=cuda precision=bf16 $2 2>/dev/null | tail -1)
  theirs=$(python3 benchmarks/pytorch_step.py --device cuda --bf16 $3 | tail -1)
  python3 - "$1" "$ours" "$theirs" <<'PY'
import json, sys
name, ours, theirs = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3])
print(json.dumps({"name": name, "noloco": ours, "pytorch": theirs,
                  "ratio": ours["tokens_per_s"] / theirs["tokens_per_s"]}))
PY
}
{
  bench 125m "model=125m batch=16 context=1024 bench_steps=30" \
    "--hidden 768 --layers 12 --heads 12 --intermediate 3072 --context 1024 --batch 16 --steps 30"
  bench 1.3b "model=1.3b batch=8 context=1024 bench_steps=12" \
    "--hidden 2048 --layers 24 --heads 32 --intermediate 8192 --context 1024 --batch 8 --steps 12"
} >"$results/bench.jsonl"
python3 - "$results" "$tests_rc" <<'PY'
import json, sys
results, tests_rc = sys.argv[1], int(sys.argv[2])
import torch
rows = [json.loads(l) for l in open(f"{results}/bench.jsonl")]
out = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "tests_exit_code": tests_rc, "bench": rows}
json.dump(out, open(f"{results}/gpu_results.json", "w"), indent=1)
print(f"{'model':6} {'noloco tok/s':>13} {'MFU':>6} {'peak GiB':>9} {'PyTorch tok/s':>14} {'ratio':>6}")
for r in rows:
    o, t = r["noloco"], r["pytorch"]
    print(f"{r['name']:6} {o['tokens_per_s']:13.0f} {o['mfu']:6.1%} {o.get('peak_gpu_gib', 0):9.1f} "
          f"{t['tokens_per_s']:14.0f} {r['ratio']:6.2f}")
PY
exit "$tests_rc"
