"""The four operators on random inputs, each compared with the fp64 reference.

python examples/01_quickstart.py
"""

# %%
import torch

import sparse_attn
from sparse_attn import patterns, reference

device = "cuda" if torch.cuda.is_available() and sparse_attn.cuda_kernels_available() else "cpu"
dtype = torch.bfloat16 if device == "cuda" else torch.float32
torch.manual_seed(0)
B, H, HKV, L, D = 2, 8, 2, 1024, 64  # GQA: 8 query heads share 2 key/value heads
q = torch.randn(B, H, L, D, device=device, dtype=dtype)
k = torch.randn(B, HKV, L, D, device=device, dtype=dtype)
v = torch.randn(B, HKV, L, D, device=device, dtype=dtype)


def err(out, ref):
    return (out.double() - ref).abs().max().item()


# %% dense_attention: the naive baseline (materialises the L x L score matrix)
out = sparse_attn.dense_attention(q, k, v, causal=True)
print(f"dense_attention   max error {err(out, reference.attention(q, k, v, causal=True)[0]):.2e}")

# %% flash_attention: tiled, online softmax, O(L) memory; also returns the log-sum-exp
out, lse = sparse_attn.flash_attention(q, k, v, causal=True, return_lse=True)
print(
    f"flash_attention   max error {err(out, reference.attention(q, k, v, causal=True)[0]):.2e}, lse {tuple(lse.shape)}"
)

# %% block_sparse_attention: only the blocks a mask names (here a 256-token window plus 4 global tokens)
mask = patterns.sliding_window(L, 256, device=device) | patterns.global_tokens(L, [0, 1, 2, 3], device=device)
out = sparse_attn.block_sparse_attention(q, k, v, mask)
print(
    f"block_sparse      max error {err(out, reference.block_sparse_attention(q, k, v, mask)[0]):.2e}, "
    f"density {mask.density():.2f}"
)

# %% topk_attention: each query attends to its 64 highest-scoring visible keys
out, idx = sparse_attn.topk_attention(q, k, v, 64, causal=True, return_indices=True)
print(
    f"topk_attention    max error {err(out, reference.gather_attention(q, k, v, idx)[0]):.2e}, "
    f"indices {tuple(idx.shape)}"
)
