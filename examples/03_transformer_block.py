"""A small transformer block whose attention call is swapped from SDPA to sparse_attn.

Dense: the same output within tolerance. With a sparsity pattern: the measured error against the
dense block and the speed of each variant (CUDA: bf16 at L = 8192; CPU: fp32 at L = 1024).

The top-k row is the exact selection: every query scored against every key of its head, the
best L / 8 kept per query head, then attended. It shows what a selection costs in accuracy, and it
is slower than dense attention (this block ran ~10x slower on an H200): the scoring alone is half of
dense attention's work, and each query head gathers its own keys. Top-k pays where a cheap scorer
picks the keys (the lightning indexer: ``topk_attention(..., index_query=, index_key=,
index_weights=)``) and many query heads share one selection (MQA, DeepSeek's 64 heads over one
K/V head); the README's top-k section has the figures.

    python examples/03_transformer_block.py
"""

# %%
import time

import torch
import torch.nn.functional as F
from torch import nn

import sparse_attn
from sparse_attn import patterns

device = "cuda" if torch.cuda.is_available() and sparse_attn.cuda_kernels_available() else "cpu"
dtype = torch.bfloat16 if device == "cuda" else torch.float32
L = 8192 if device == "cuda" else 1024


class Block(nn.Module):
    """Pre-norm transformer block with grouped-query attention; `attention` is pluggable."""

    def __init__(self, dim=1024, heads=16, kv_heads=4, attention=None):
        super().__init__()
        self.heads, self.kv_heads, self.hd = heads, kv_heads, dim // heads
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, (heads + 2 * kv_heads) * self.hd, bias=False)
        self.proj = nn.Linear(dim, dim, bias=False)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
        self.attention = attention or (
            lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        )

    def forward(self, x):
        b, n, _ = x.shape
        qkv = self.qkv(self.norm1(x))
        q, k, v = qkv.split([self.heads * self.hd, self.kv_heads * self.hd, self.kv_heads * self.hd], dim=-1)
        # (B, L, H, D) views transposed to (B, H, L, D): sparse_attn reads them in place
        q = q.view(b, n, self.heads, self.hd).transpose(1, 2)
        k = k.view(b, n, self.kv_heads, self.hd).transpose(1, 2)
        v = v.view(b, n, self.kv_heads, self.hd).transpose(1, 2)
        o = self.attention(q, k, v)  # (B, H, L, D), stored (B, L, H, D): the reshape below is free
        x = x + self.proj(o.transpose(1, 2).reshape(b, n, -1))
        return x + self.mlp(self.norm2(x))


def timed(fn, reps=5):
    fn()
    if device == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        out = fn()
    if device == "cuda":
        torch.cuda.synchronize()
    return out, (time.perf_counter() - t0) / reps * 1e3


# %%
torch.manual_seed(0)
block = Block().to(device, dtype).eval()
x = torch.randn(1, L, 1024, device=device, dtype=dtype)
window = patterns.sliding_window(L, 1024, causal=True, device=device)
variants = {
    "SDPA (reference)": None,
    "sparse_attn.flash_attention": lambda q, k, v: sparse_attn.flash_attention(q, k, v, causal=True),
    "sparse_attn causal window 1024": lambda q, k, v: sparse_attn.block_sparse_attention(q, k, v, window),
    f"sparse_attn top-k {L // 8}": lambda q, k, v: sparse_attn.topk_attention(q, k, v, L // 8, causal=True),
}
with torch.no_grad():
    ref, ref_ms = timed(lambda: block(x))
    print(f"{'variant':<34} {'block ms':>9} {'max |diff| vs SDPA':>20} {'rel. error':>11}")
    for name, attn in variants.items():
        block.attention = attn or (
            lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        )
        out, ms = timed(lambda: block(x))
        diff = (out.float() - ref.float()).abs().max().item()
        rel = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
        print(f"{name:<34} {ms:9.2f} {diff:20.3e} {rel:11.2e}")
