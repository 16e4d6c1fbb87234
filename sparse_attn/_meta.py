"""Fake (meta) kernels, so torch.compile and torch.export trace every op without running it,
and the autograd registration (forward only for now: backward raises a clear error)."""

from __future__ import annotations

import torch

_OPS = ("dense_fwd", "flash_fwd", "block_sparse_fwd", "gather_fwd", "topk_select", "indexer_select")


def _outputs(query: torch.Tensor, value: torch.Tensor):
    b, h, lq, _ = query.shape
    dv = value.shape[-1]
    out = query.new_empty(b, lq, h, dv).transpose(1, 2)
    lse = query.new_empty(b, h, lq, dtype=torch.float32)
    return out, lse


@torch.library.register_fake("sparse_attn::dense_fwd")
def _dense_fwd(query, key, value, attn_mask=None, scale=None, causal=False):
    return _outputs(query, value)


@torch.library.register_fake("sparse_attn::flash_fwd")
def _flash_fwd(query, key, value, scale=None, causal=False, window_left=-1, window_right=-1):
    return _outputs(query, value)


@torch.library.register_fake("sparse_attn::block_sparse_fwd")
def _block_sparse_fwd(
    query,
    key,
    value,
    kv_num_blocks,
    kv_indices,
    kv_partial,
    partial_masks,
    q_block,
    kv_block,
    scale=None,
    q_block_order=None,
):
    return _outputs(query, value)


@torch.library.register_fake("sparse_attn::gather_fwd")
def _gather_fwd(query, key, value, indices, scale=None):
    return _outputs(query, value)


@torch.library.register_fake("sparse_attn::_check_inputs")
def _check_inputs(query, key, value):
    return None


@torch.library.register_fake("sparse_attn::topk_select")
def _topk_select(query, key, k, causal=False):
    torch._check(k > 0, lambda: f"k must be positive, got {k}")
    b, h, lq, _ = query.shape
    return query.new_empty(b, h, lq, torch.sym_min(k, key.shape[2]), dtype=torch.int32)


@torch.library.register_fake("sparse_attn::indexer_select")
def _indexer_select(index_query, index_key, index_weights, k, causal=False):
    torch._check(k > 0, lambda: f"k must be positive, got {k}")
    b, lq = index_query.shape[:2]
    return index_query.new_empty(b, 1, lq, torch.sym_min(k, index_key.shape[1]), dtype=torch.int32)


def _no_backward(ctx, *grads):
    raise NotImplementedError(
        "sparse_attn: the backward pass is not implemented yet; these ops are forward-only "
        "(use them under torch.no_grad() or for inference)"
    )


def _setup_context(ctx, inputs, output):
    pass


for _name in ("dense_fwd", "flash_fwd", "block_sparse_fwd", "gather_fwd"):
    torch.library.register_autograd(f"sparse_attn::{_name}", _no_backward, setup_context=_setup_context)
