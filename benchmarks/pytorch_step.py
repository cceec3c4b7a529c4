"""The same Llama training step as `noloco bench`, in plain PyTorch.

Same architecture (RMSNorm, rotary embeddings in Hugging Face's rotate_half
layout, SwiGLU MLP, untied head, no biases), same AdamW (two groups: weight
decay on matrices only), same clipping, same threads. Prints one JSON line:
tokens/s over the timed steps and the process's peak resident memory.
On PyTorch 2.x it uses what our LibTorch 2.x build uses (fused attention,
fused RMSNorm, on CUDA the fused AdamW); --device cuda --bf16 runs it under
bf16 autocast as `noloco bench device=cuda precision=bf16` does.
Used by scripts/bench_vs_pytorch.sh and scripts/gpu_check.sh; run alone:
  python3 benchmarks/pytorch_step.py --hidden 128 --layers 4 --heads 4 --intermediate 384 --context 64 --batch 12
"""
import argparse
import contextlib
import json
import math
import resource
import time

import torch
import torch.nn as nn
import torch.nn.functional as F


class RMSNorm(nn.Module):
    def __init__(self, dim, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        if hasattr(F, "rms_norm"):
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rotary_tables(context, head_dim, theta=10000.0):
    inv_freq = theta ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    freqs = torch.outer(torch.arange(context, dtype=torch.float64), inv_freq)
    emb = torch.cat([freqs, freqs], -1)
    return emb.cos().float(), emb.sin().float()


def apply_rotary(x, cos, sin):
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], -1)
    T = x.shape[-2]
    return x * cos[:T].to(x.dtype) + rotated * sin[:T].to(x.dtype)


class Attention(nn.Module):
    def __init__(self, hidden, heads):
        super().__init__()
        self.heads, self.head_dim = heads, hidden // heads
        self.q_proj = nn.Linear(hidden, hidden, bias=False)
        self.k_proj = nn.Linear(hidden, hidden, bias=False)
        self.v_proj = nn.Linear(hidden, hidden, bias=False)
        self.o_proj = nn.Linear(hidden, hidden, bias=False)

    def forward(self, x, cos, sin):
        B, T, _ = x.shape
        split = lambda t: t.view(B, T, self.heads, self.head_dim).transpose(1, 2)
        q = apply_rotary(split(self.q_proj(x)), cos, sin)
        k = apply_rotary(split(self.k_proj(x)), cos, sin)
        v = split(self.v_proj(x))
        if hasattr(F, "scaled_dot_product_attention"):
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            return self.o_proj(y.transpose(1, 2).reshape(B, T, -1))
        scores = q @ k.transpose(-2, -1) / math.sqrt(self.head_dim)
        mask = torch.ones(T, T, dtype=torch.bool).triu(1)
        y = torch.softmax(scores.masked_fill(mask, float("-inf")), -1) @ v
        return self.o_proj(y.transpose(1, 2).reshape(B, T, -1))


class Layer(nn.Module):
    def __init__(self, hidden, heads, intermediate, eps):
        super().__init__()
        self.self_attn = Attention(hidden, heads)
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)
        self.input_layernorm = RMSNorm(hidden, eps)
        self.post_attention_layernorm = RMSNorm(hidden, eps)

    def forward(self, x, cos, sin):
        h = x + self.self_attn(self.input_layernorm(x), cos, sin)
        m = self.post_attention_layernorm(h)
        return h + self.down_proj(F.silu(self.gate_proj(m)) * self.up_proj(m))


class Llama(nn.Module):
    def __init__(self, a):
        super().__init__()
        self.embed_tokens = nn.Embedding(a.vocab, a.hidden)
        self.layers = nn.ModuleList(Layer(a.hidden, a.heads, a.intermediate, 1e-5) for _ in range(a.layers))
        self.norm = RMSNorm(a.hidden, 1e-5)
        self.lm_head = nn.Linear(a.hidden, a.vocab, bias=False)
        self.cos, self.sin = rotary_tables(a.context, a.hidden // a.heads)
        for p in self.parameters():
            if p.dim() >= 2:
                nn.init.normal_(p, 0.0, 0.02)

    def forward(self, tokens):
        x = self.embed_tokens(tokens)
        for layer in self.layers:
            x = layer(x, self.cos, self.sin)
        return self.lm_head(self.norm(x))


def main():
    p = argparse.ArgumentParser()
    for name, default in [("hidden", 128), ("layers", 4), ("heads", 4), ("intermediate", 384), ("context", 64),
                          ("batch", 12), ("vocab", 256), ("steps", 20), ("threads", 1)]:
        p.add_argument("--" + name, type=int, default=default)
    p.add_argument("--device", default="cpu")
    p.add_argument("--bf16", action="store_true", help="bf16 autocast (CUDA)")
    p.add_argument("--profile", action="store_true", help="also print the kernels' time shares (stderr)")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    device = torch.device(a.device)
    model = Llama(a).to(device)
    model.cos, model.sin = model.cos.to(device), model.sin.to(device)
    decay = [q for q in model.parameters() if q.dim() >= 2]
    no_decay = [q for q in model.parameters() if q.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=1e-3, betas=(0.9, 0.99), eps=1e-8, **({"fused": True} if device.type == "cuda" else {}))
    x = torch.randint(a.vocab, (a.batch, a.context), device=device)
    y = torch.randint(a.vocab, (a.batch, a.context), device=device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    # A CPU-only torch refuses even a disabled CUDA autocast.
    autocast = (lambda: torch.autocast("cuda", dtype=torch.bfloat16)) if a.bf16 else contextlib.nullcontext

    def step():
        opt.zero_grad(set_to_none=False)
        with autocast():
            logits = model(x)
        loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()

    step()
    step()
    sync()
    t0 = time.perf_counter()
    for _ in range(a.steps):
        step()
    sync()
    seconds = time.perf_counter() - t0
    if a.profile:
        import sys
        from torch.profiler import ProfilerActivity, profile
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(3):
                step()
            sync()
        print(prof.key_averages().table(sort_by="self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total",
                                        row_limit=30, max_name_column_width=60), file=sys.stderr)
    print(json.dumps({"tokens_per_s": a.steps * a.batch * a.context / seconds, "seconds": seconds,
                      "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                      "peak_gpu_gib": torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else 0,
                      "params": sum(q.numel() for q in model.parameters()), "threads": torch.get_num_threads()}))


if __name__ == "__main__":
    main()
