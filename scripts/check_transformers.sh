#!/usr/bin/env bash
# Trains a small character-level and a small BPE model, exports each as shards,
# and checks that Hugging Face transformers loads the directory (model and
# tokenizer) and continues a prompt exactly as `noloco generate` does.
#   scripts/check_transformers.sh [NOLOCO_BINARY]   (default build/noloco)
# Needs python3 with torch and transformers (sentencepiece too for the BPE run).
set -euo pipefail
cd "$(dirname "$0")/.."
noloco=${1:-build/noloco}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
rc=0
for tokenizer in char bpe; do
  "$noloco" train configs/shakespeare.yaml tokenizer=$tokenizer vocab_size=500 steps=60 eval_interval=60 \
    sample_tokens=0 out="$work/$tokenizer" >"$work/$tokenizer.log" 2>&1 || { tail -5 "$work/$tokenizer.log"; exit 1; }
  "$noloco" export "$work/$tokenizer" "$work/${tokenizer}_hf" shard_size=300KB >/dev/null
  ours=$("$noloco" generate "$work/${tokenizer}_hf" temperature=0 tokens=40 prompt="ROMEO:")
  theirs=$(python3 scripts/check_transformers.py "$work/${tokenizer}_hf" --prompt "ROMEO:" --tokens 40 2>"$work/py.log") ||
    { echo "$tokenizer: transformers could not load the export:"; tail -5 "$work/py.log"; rc=1; continue; }
  if [ "$ours" = "$theirs" ]; then
    echo "$tokenizer: transformers continues the prompt exactly as noloco does"
  else
    printf '%s: differ\n  noloco:       %q\n  transformers: %q\n' "$tokenizer" "$ours" "$theirs"
    rc=1
  fi
done
exit "$rc"
