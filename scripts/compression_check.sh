#!/usr/bin/env bash
# Issue 101's table: the compression presets against fp32 messages on the
# small model, one row per run. Prints, per method, messages and replica
# count: the replicas' final validation loss (min / mean / max), the mean of
# their weights' loss, the weights' spread, bits a parameter per inner step,
# and each compressed row's replicas' mean and mean model against fp32's.
#
#   scripts/compression_check.sh DATA STEPS [train keys...]     # build/ built (or NOLOCO=binary)
#   METHODS="noloco diloco" PRESETS="none topk sparse" REPLICAS="4 8 16" \
#     scripts/compression_check.sh data/tinyshakespeare.txt 2000
set -euo pipefail
cd "$(dirname "$0")/.."
data=${1:?DATA} steps=${2:?STEPS}
shift 2
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
small="hidden=32 layers=2 heads=2 intermediate=64 context=32 batch=4 threads=1 eval_interval=$((steps / 4))
  eval_batches=20 log_interval=$((steps / 4)) spread_interval=$steps sample_tokens=0 data=$data"
echo "| corpus | replicas x steps | method | messages | replicas' loss min / mean / max | mean model | weight std | bits/param/inner step | vs fp32: replicas' mean, mean model |"
echo "|---|---|---|---|---|---|---|---|---|"
for method in ${METHODS:-noloco diloco}; do
  for replicas in ${REPLICAS:-4 8 16}; do
    for preset in ${PRESETS:-none topk sparse}; do
      run="$work/$method-$replicas-$preset"
      ${NOLOCO:-build/noloco} train configs/shakespeare.yaml $small method=$method replicas=$replicas steps="$steps" \
        compression=$preset "$@" out="$run" >"$run.log" 2>&1 || { tail -5 "$run.log"; exit 1; }
      python3 - "$run" "$work/$method-$replicas-none" "$data" "$replicas x $steps" "$method" "$preset" <<'PY'
import json, os, sys
run, fp32, data, size, method, preset = sys.argv[1:]
s = json.load(open(run + "/summary.json"))
reps = s["final_val_loss_replicas"]
mean = sum(reps) / len(reps)
against = "-"
if preset != "none":
    f = json.load(open(fp32 + "/summary.json"))
    f_reps = f["final_val_loss_replicas"]
    against = (f"{100 * (mean / (sum(f_reps) / len(f_reps)) - 1):+.2f}%, "
               f"{100 * (s['final_val_loss_mean_model'] / f['final_val_loss_mean_model'] - 1):+.2f}%")
print(f"| {os.path.basename(data)} | {size} | {method} | {'fp32' if preset == 'none' else preset} | "
      f"{min(reps):.4f} / {mean:.4f} / {max(reps):.4f} | {s['final_val_loss_mean_model']:.4f} | "
      f"{s['weight_std']:.2e} | {s['bits_per_param_per_inner_step']:.4f} | {against} |", flush=True)
PY
    done
  done
done
