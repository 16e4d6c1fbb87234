"""sparse_attn: dense, flash, block-sparse and top-k attention for PyTorch.

>>> import torch, sparse_attn
>>> q = k = v = torch.randn(1, 4, 256, 64)
>>> out = sparse_attn.flash_attention(q, k, v, causal=True)
"""

from __future__ import annotations

import torch

from . import (
    _C,  # noqa: F401  (registers the sparse_attn::* ops)
    _meta,  # noqa: F401  (fake kernels and autograd registrations)
    analysis,
    distributed,
    patterns,
    reference,
)
from ._plan import explain
from .masks import BlockSparseMask, ExactForm
from .ops import (
    attention_with_kvcache,
    block_sparse_attention,
    block_sparse_attention_varlen,
    dense_attention,
    flash_attention,
    flash_attention_varlen,
    kvcache_topk_mask,
    topk_attention,
    topk_attention_varlen,
)

__version__ = "0.1.0"

__all__ = [
    "BlockSparseMask",
    "attention_with_kvcache",
    "ExactForm",
    "analysis",
    "block_sparse_attention",
    "block_sparse_attention_varlen",
    "cuda_kernels_available",
    "dense_attention",
    "distributed",
    "explain",
    "flash_attention",
    "flash_attention_varlen",
    "kvcache_topk_mask",
    "patterns",
    "reference",
    "topk_attention",
    "topk_attention_varlen",
]


def cuda_kernels_available() -> bool:
    """True when this build holds the CUDA kernels (a GPU may still be absent)."""
    return torch._C._dispatch_has_kernel_for_dispatch_key("sparse_attn::flash_fwd", "CUDA")
