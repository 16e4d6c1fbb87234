"""One launch each of our flash kernel and SDPA's FlashAttention-2 kernel on the same inputs,
inside a cudaProfilerStart/Stop range, for `ncu --profile-from-start off` (see PERF_LOG.md).

    ncu --profile-from-start off --clock-control none --section ... python3 tools/ncu_flash.py [D] [L] [causal]
"""

import sys

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

import sparse_attn

d = int(sys.argv[1]) if len(sys.argv) > 1 else 128
length = int(sys.argv[2]) if len(sys.argv) > 2 else 8192
causal = len(sys.argv) > 3 and sys.argv[3] == "causal"
q, k, v = (torch.randn(2, length, 16, d, device="cuda", dtype=torch.bfloat16).transpose(1, 2) for _ in range(3))
for _ in range(3):
    sparse_attn.flash_attention(q, k, v, causal=causal)
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
        torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)
torch.cuda.synchronize()
torch.cuda.cudart().cudaProfilerStart()
sparse_attn.flash_attention(q, k, v, causal=causal)
with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
    torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)
torch.cuda.synchronize()
torch.cuda.cudart().cudaProfilerStop()
