#!/usr/bin/env bash
# Builds the fuzz targets (clang, libFuzzer, ASan, UBSan) into build-fuzz/ and
# runs each for a bounded number of inputs from a seed corpus.
#   scripts/fuzz.sh [RUNS]   (default 20000; -1 runs until stopped)
#   scripts/fuzz.sh build    (builds the targets only: scripts/test.sh does, before ctest)
set -euo pipefail
cd "$(dirname "$0")/.."
runs=${1:-20000}
if [ ! -f build-fuzz/build.ninja ]; then
  CXX=clang++ cmake -S fuzz -B build-fuzz -G Ninja > /dev/null
fi
# Quiet unless it fails (a failed build had ended the test with no output at all).
cmake --build build-fuzz > build-fuzz/build.log 2>&1 || { grep -m 20 -B 2 -A 5 "error" build-fuzz/build.log; exit 1; }
[ "$runs" = build ] && exit 0
corpus=build-fuzz/corpus
mkdir -p "$corpus"/{config,safetensors,safetensors_index,token_file,codec,tokenizer_json,sealed,documents,link_handshake,link_frames}
cp configs/*.yaml "$corpus/config/"
printf 'lr: 1e-3\nsteps: 10\nmodel: 125m\nmethod: noloco\n' > "$corpus/config/small.yaml"
# A valid safetensors file and a valid token file to mutate from.
printf '\x40\x00\x00\x00\x00\x00\x00\x00{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}           \x00\x00\x80\x3f\x00\x00\x00\x40' \
  > "$corpus/safetensors/seed.safetensors"
printf '{"metadata":{"total_size":16},"weight_map":{"a":"model-00001-of-00002.safetensors","b":"model-00002-of-00002.safetensors"}}' \
  > "$corpus/safetensors_index/index.json"
head -c 1024 /dev/zero | tr '\0' '\1' > "$corpus/token_file/raw.bin"
# llm.c layout: magic 20240520, version 1, 4 tokens, zero padding to 1024 bytes, then the tokens.
{ printf '\x88\xd8\x34\x01\x01\x00\x00\x00\x04\x00\x00\x00'; head -c 1012 /dev/zero; printf '\x01\x00\x02\x00\x03\x00\x04\x00'; } \
  > "$corpus/token_file/llmc.bin"
# Outer-step payloads: a valid int4 message of 64 values (block 64) and a coset-coded one of 16 (block 8, 4 bits).
{ printf '\x02\x40\x00\x03\x00\x3c'; head -c 32 /dev/zero | tr '\0' '\x88'; } > "$corpus/codec/int4.bin"
{ printf '\x80\x10\x00\x00'; for b in 1 2; do printf '\x80\x3a\x00\x00'; done; head -c 8 /dev/zero; } > "$corpus/codec/coset.bin"
# Top-k: 4 of 16 fp32 values, Rice-coded positions 0, 1, 5, 15 (tests/test_codec.cpp works them by hand).
printf '\x2a\x10\x00\x00\xd0\x17\x00\x00\x80\x40\x00\x00\x40\xc0\x00\x00\x00\x40\x00\x00\xc0\xc0' > "$corpus/codec/topk.bin"
# bins2: one block of 8 values, bin means 1 and 3, codes 0 1 2 3 0 0 2 2 (the same test's hand example).
printf '\x06\x08\x00\x00\x80\x3f\x40\x40\xe4\xa0' > "$corpus/codec/bins2.bin"
# A byte-level BPE tokenizer.json (every byte, one merge, a Split pre-tokenizer, an added token), a NUL, a text.
python3 - "$corpus/tokenizer_json/seed" <<'PY'
import json, sys
printable = lambda b: 33 <= b <= 126 or 161 <= b <= 172 or b >= 174
chars, n = {}, 256
for b in range(256):
    if printable(b): chars[b] = chr(b)
    else: chars[b] = chr(n); n += 1
vocab = {chars[b]: b for b in range(256)}
vocab["ab"] = 256
tok = {"normalizer": None, "added_tokens": [{"id": 257, "content": "<|end|>", "special": True}],
       "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
           {"type": "Split", "pattern": {"Regex": r"\p{L}+|\p{N}{1,3}|\s+"}, "behavior": "Isolated", "invert": False},
           {"type": "ByteLevel", "add_prefix_space": False, "use_regex": False}]},
       "decoder": {"type": "ByteLevel"}, "model": {"type": "BPE", "vocab": vocab, "merges": ["a b"]}}
open(sys.argv[1], "wb").write(json.dumps(tok).encode() + b"\0" + "abc 1234 café<|end|>".encode())
PY
# A sealed message: a header (72 bytes), mode and flip position, then an int4 payload to seal.
{ head -c 72 /dev/zero; printf '\x02\x05\x00\x02\x40\x00\x03\x00\x3c'; head -c 32 /dev/zero | tr '\0' '\x88'; } > "$corpus/sealed/int4.bin"
# Documents: JSONL (form byte 0), zstd JSONL (1), plain text with end-of-text markers (3).
printf '\0{"text": "one"}\n{"text": "two\\nlines \\u00e9"}\n' > "$corpus/documents/jsonl"
{ printf '\1'; printf '{"text": "zstd"}\n' | zstd -q -c; } > "$corpus/documents/zst"
printf '\3first<|end|>second, a little longer than the limit of sixty-four bytes a piece\nyes<|end|>' > "$corpus/documents/text"
# A link hello (magic, scope, ranks, attempt, nonce, sealed), fed in pieces of 4 and wanted, then a proof of zeros.
{ printf '\x07nolocoL1'; head -c 64 /dev/zero; printf '\x01\x00\x00\x00'; head -c 32 /dev/zero; } > "$corpus/link_handshake/hello"
# Link frames: a message of two frames in clear as it comes off the wire (mode 0), and one sent sealed through a real sending end (mode 3).
printf '\x00\xff\xff\x06\x00\x00\x00\x00hello\x03\x00\x00\x00\x01ab' > "$corpus/link_frames/clear"
printf '\x03\xff\xffa message sealed by a sending end' > "$corpus/link_frames/sealed"
for target in config safetensors safetensors_index token_file codec tokenizer_json sealed documents link_handshake link_frames; do
  echo "fuzz_$target: $runs runs"
  log=build-fuzz/fuzz_$target.log
  # libFuzzer exits non-zero on any crash, sanitizer report, leak or timeout,
  # and saves the input that caused it under build-fuzz/.
  set +e
  max_len=4096
  [ "$target" = tokenizer_json ] && max_len=16384  # the seed's vocabulary alone is ~4 KB
  build-fuzz/fuzz_$target -runs="$runs" -max_len=$max_len -timeout=10 -rss_limit_mb=2048 -print_final_stats=1 \
    -artifact_prefix=build-fuzz/ "$corpus/$target" > "$log" 2>&1
  rc=$?
  set -e
  grep -E "^Done|stat::number_of_executed_units" "$log" || true
  if [ "$rc" -ne 0 ]; then
    tail -40 "$log"
    echo "fuzz_$target FAILED (exit $rc); see $log"
    exit "$rc"
  fi
done
