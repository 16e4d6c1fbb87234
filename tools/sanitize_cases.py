"""Tiny shapes through every CUDA kernel, for compute-sanitizer (memcheck, racecheck):

    PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer --tool memcheck --error-exitcode 1 \\
        python tools/sanitize_cases.py [--quick]
"""

import sys

import torch

import sparse_attn
from sparse_attn import patterns
from sparse_attn._plan import overrides

torch.manual_seed(0)
dev = "cuda"
quick = "--quick" in sys.argv  # racecheck is ~20x slower: bf16, two head dims
for dtype in (torch.bfloat16,) if quick else (torch.bfloat16, torch.float16, torch.float32):
    for d in (64, 128) if quick else (64, 128, 256, 40):
        for lq, lk in ((1, 1), (17, 129), (129, 17), (200, 300)):
            q = torch.randn(2, 4, lq, d, device=dev, dtype=dtype)
            k = torch.randn(2, 2, lk, d, device=dev, dtype=dtype)
            v = torch.randn(2, 2, lk, d, device=dev, dtype=dtype)
            for causal in (False, True):
                sparse_attn.flash_attention(q, k, v, causal=causal)
            sparse_attn.flash_attention(q, k, v, window=(50, 10))
            sparse_attn.dense_attention(q, k, v, causal=True)
            sparse_attn.topk_attention(q, k, v, 7, causal=True)
            if lq == lk or lq < lk:
                for bs in (64, 128, (64, 128)):
                    mask = patterns.causal(lq, lk, block_size=bs, device=dev)
                    sparse_attn.block_sparse_attention(q, k, v, mask)
            if lq == lk and lq >= 4:
                m = patterns.longformer(lq, 40, [0, 3], device=dev) | patterns.dilated(lq, 90, 3, device=dev)
                sparse_attn.block_sparse_attention(q, k, v, m)
                sparse_attn.topk_attention(q, k, v, 1, block_size=64, causal=True)
# Several key tiles per query tile: the Hopper core's K/V ring wraps around and its consumers
# ping-pong (and the portable core's double buffering runs more than once).
for d in (64, 128):
    q, k, v = (torch.randn(1, 2, 700, d, device=dev, dtype=torch.bfloat16) for _ in range(3))
    for causal in (False, True):
        sparse_attn.flash_attention(q, k, v, causal=causal)
    sparse_attn.block_sparse_attention(q, k, v, patterns.longformer(700, 150, [0, 400], device=dev))
# More query tiles than SMs: the Hopper core's persistent CTAs run several tiles each, static
# (full) and from the dynamic counter (causal, block-sparse with empty rows).
for d in (64, 128):
    q, k, v = (torch.randn(1, 48, 600, d, device=dev, dtype=torch.bfloat16) for _ in range(3))
    for causal in (False, True):
        sparse_attn.flash_attention(q, k, v, causal=causal)
    sparse_attn.block_sparse_attention(q, k, v, patterns.random_blocks(600, 0.3, seed=1, heads=48, device=dev))
    if d == 64:  # small shapes take 128-row tiles at head dim 64; the 192-row kernel too, and
        # 128-row tiles of 192 keys (a ragged last one)
        for tile in ((192, 128), (128, 192)):
            with overrides(tile=tile):
                for causal in (False, True):
                    sparse_attn.flash_attention(q, k, v, causal=causal)
iq = torch.randn(2, 100, 4, 64, device=dev, dtype=torch.bfloat16)
ik = torch.randn(2, 100, 64, device=dev, dtype=torch.bfloat16)
iw = torch.randn(2, 100, 4, device=dev, dtype=torch.bfloat16)
q = torch.randn(2, 4, 100, 64, device=dev, dtype=torch.bfloat16)
sparse_attn.topk_attention(q, q[:, :2], q[:, :2], 9, causal=True, index_query=iq, index_key=ik, index_weights=iw)
# Gathered attention with one index set for 32 heads over one kv head (two warps of 16 heads),
# with -1 and out-of-range entries.
q = torch.randn(1, 32, 50, 128, device=dev, dtype=torch.bfloat16)
kv = torch.randn(1, 1, 300, 128, device=dev, dtype=torch.bfloat16)
idx = torch.randint(-1, 310, (1, 1, 50, 70), device=dev, dtype=torch.int32)
torch.ops.sparse_attn.gather_fwd(q, kv, kv, idx)
torch.cuda.synchronize()
print("sanitize cases done")
