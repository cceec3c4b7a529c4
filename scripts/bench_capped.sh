#!/usr/bin/env bash
# Sync time of pair exchanges and all-reduces on bandwidth-capped links
# (docs/communication.md, "Measured on capped links"). Root only: every worker
# gets its own network namespace and tc-tbf-capped veth.
# Usage: scripts/bench_capped.sh [OUT_DIR]   (default runs/bench_capped)
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-runs/bench_capped}
bench() { build/noloco bench comm megabytes=12.5 rounds=5 out="$out" "$@" | grep '^bench comm'; }
for rate in 100mbit 10mbit; do
  for method in noloco diloco; do bench method=$method replicas=2 rate=$rate rounds=3; done
done
for n in 8 16; do
  for method in diloco noloco; do bench method=$method replicas=$n rate=100mbit; done
done
for wire in bf16 int8 int4; do
  for method in diloco noloco; do bench method=$method replicas=16 rate=100mbit wire_dtype=$wire; done
done
