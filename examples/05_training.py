"""Training with sparse_attn: a small causal language model learns a task that needs attention
(each sequence repeats a random 32-token motif, so from the second period on the next token is the
one 32 positions back), with SDPA, our flash attention, a causal sliding window of 64 keys and
token top-k. Every op has a backward pass on the CPU and the GPU. What to look for: SDPA's and our
flash attention's losses agree step for step (the last line prints the largest gap), and a
pattern that fits the task (the window holds the previous period) learns it in fewer steps.

    python examples/05_training.py        # CPU: fp32, L = 256 (under a minute); CUDA: bf16, L = 4096
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
L, PERIOD, VOCAB = (4096, 32, 32) if device == "cuda" else (256, 32, 32)
STEPS = 80


class Block(nn.Module):
    def __init__(self, dim, heads, attention):
        super().__init__()
        self.heads, self.attention = heads, attention
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim, bias=False), nn.Linear(dim, dim, bias=False)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x):
        b, n, dim = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, n, 3, self.heads, -1).unbind(2)
        o = self.attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        x = x + self.proj(o.transpose(1, 2).reshape(b, n, dim))
        return x + self.mlp(self.norm2(x))


class LM(nn.Module):
    def __init__(self, attention, dim=64, heads=4, layers=2):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, dim)
        self.pos = nn.Embedding(L, dim)
        self.blocks = nn.ModuleList(Block(dim, heads, attention) for _ in range(layers))
        self.head = nn.Linear(dim, VOCAB)

    def forward(self, tokens):
        x = self.embed(tokens) + self.pos(torch.arange(tokens.shape[1], device=tokens.device))
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def batch(gen, b=8):
    motif = torch.randint(0, VOCAB, (b, PERIOD), generator=gen)
    return motif.repeat(1, L // PERIOD + 1)[:, : L + 1].to(device)


window = patterns.sliding_window(L, 2 * PERIOD, causal=True, device=device)
variants = {
    "SDPA": lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True),
    "sparse_attn flash": lambda q, k, v: sparse_attn.flash_attention(q, k, v, causal=True),
    f"sparse_attn window {2 * PERIOD}": lambda q, k, v: sparse_attn.block_sparse_attention(q, k, v, window),
    "sparse_attn top-k 32": lambda q, k, v: sparse_attn.topk_attention(q, k, v, 32, causal=True),
}

# %%
curves = {}
print(f"device {device}, {dtype}, L = {L}, {STEPS} steps of AdamW")
for name, attention in variants.items():
    torch.manual_seed(0)
    model = LM(attention).to(device, dtype)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(1)
    losses, t0 = [], time.perf_counter()
    for _ in range(STEPS):
        tokens = batch(gen)
        logits = model(tokens[:, :-1])
        # Only positions from the second period on can be predicted.
        loss = F.cross_entropy(logits[:, PERIOD:].flatten(0, 1).float(), tokens[:, PERIOD + 1 :].flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    curves[name] = losses
    print(
        f"{name:<28} loss {losses[0]:.3f} -> {losses[-1]:.3f}   {(time.perf_counter() - t0) / STEPS * 1e3:.0f} ms/step"
    )

# %%
gap = max(abs(a - b) for a, b in zip(curves["SDPA"], curves["sparse_attn flash"], strict=True))
print(f"largest gap between SDPA's and our flash attention's loss over {STEPS} steps: {gap:.2e}")
