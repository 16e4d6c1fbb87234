"""Top-k selection and gathered attention at shapes that reach every path of the selection
(two-level radix select with many and few ties, the overflow fallback, rows that take every
visible key), small enough for compute-sanitizer's racecheck:

    compute-sanitizer --tool racecheck --error-exitcode 1 python tools/sanitize_topk.py
"""

import torch

import sparse_attn

dev = "cuda"
g = torch.Generator(device=dev).manual_seed(0)
for spread in (4, 100):
    q = torch.randint(-spread, spread, (1, 2, 8, 64), device=dev, generator=g).bfloat16()
    k = torch.randint(-spread, spread, (1, 1, 3000, 64), device=dev, generator=g).bfloat16()
    for causal in (False, True):
        sparse_attn.topk_attention(q, k, k, 100, causal=causal)
# Rows of 20000 keys: the sampled select, and its fallback when the top keys crowd one segment.
long_k = torch.randint(-100, 100, (1, 1, 20000, 64), device=dev, generator=g).bfloat16()
sparse_attn.topk_attention(q, long_k, long_k, 2048)
rising = (torch.arange(20000, device=dev) // 100).bfloat16()[None, None, :, None].expand(1, 1, 20000, 64)
sparse_attn.topk_attention(q, rising.contiguous(), long_k, 2048)
same = k[:, :, :1].expand(1, 1, 5000, 64).contiguous()
sparse_attn.topk_attention(q, same, same, 9)
iq = torch.randn(1, 130, 4, 64, device=dev, generator=g).bfloat16()
ik = torch.randn(1, 130, 64, device=dev, generator=g).bfloat16()
iw = torch.rand(1, 130, 4, device=dev, generator=g).bfloat16()
q = torch.randn(1, 16, 130, 128, device=dev, generator=g).bfloat16()
kv = torch.randn(1, 1, 130, 128, device=dev, generator=g).bfloat16()
sparse_attn.topk_attention(q, kv, kv, 40, causal=True, index_query=iq, index_key=ik, index_weights=iw)
torch.cuda.synchronize()
print("sanitize topk cases done")
