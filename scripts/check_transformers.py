#!/usr/bin/env python3
"""Greedy continuation of a prompt by a directory that `noloco export` wrote,
loaded with Hugging Face transformers (AutoModelForCausalLM, AutoTokenizer):
printed like `noloco generate DIR temperature=0`, so the two can be compared."""
import argparse

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

parser = argparse.ArgumentParser()
parser.add_argument("hf_dir")
parser.add_argument("--prompt", default="ROMEO:")
parser.add_argument("--tokens", type=int, default=40)
args = parser.parse_args()
tokenizer = AutoTokenizer.from_pretrained(args.hf_dir)
model = AutoModelForCausalLM.from_pretrained(args.hf_dir, torch_dtype=torch.float32)
ids = tokenizer(args.prompt, return_tensors="pt", add_special_tokens=False).input_ids
with torch.no_grad():
    out = model.generate(ids, max_new_tokens=args.tokens, do_sample=False, pad_token_id=0)
print(tokenizer.decode(out[0], skip_special_tokens=False, clean_up_tokenization_spaces=False))
