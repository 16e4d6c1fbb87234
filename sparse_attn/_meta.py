"""Fake (meta) kernels, so torch.compile and torch.export trace every op without running it,
and the autograd registration (forward only for now: backward raises a clear error)."""

from __future__ import annotations

import torch

_OPS = ("dense_fwd", "flash_fwd", "block_sparse_fwd", "gather_fwd", "topk_select", "indexer_select")


_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _check(cond, message: str) -> None:
    torch._check(cond, lambda: message)


def _check_qkv(query, key, value, **others) -> None:
    """What the C++ glue's check_qkv checks (csrc/api/common.cpp, in its words), on fake tensors:
    so a traced call with bad inputs fails while tracing, and tensors of different devices (a meta
    tensor with a CPU one, whose call reaches this fake kernel) are refused rather than given an
    uninitialised output. ``others``: the mask or index tensors, which must share the device."""
    for name, t, layout in (
        ("query", query, "(B, H, Lq, D)"),
        ("key", key, "(B, Hkv, Lk, D)"),
        ("value", value, "(B, Hkv, Lk, Dv)"),
    ):
        _check(t.dim() == 4, f"{name} must be 4-D {layout}, got {t.dim()}-D")
    for name, t in (("key", key), ("value", value)):
        _check(
            t.device == query.device, f"query and {name} must be on the same device, got {query.device} and {t.device}"
        )
    for name, t in others.items():
        if t is not None:
            _check(
                t.device == query.device, f"{name} must be on the same device as query ({query.device}), got {t.device}"
            )
    _check(query.dtype in _DTYPES, f"query dtype must be float32, bfloat16 or float16, got {query.dtype}")
    for name, t in (("key", key), ("value", value)):
        _check(t.dtype == query.dtype, f"query and {name} must have the same dtype, got {query.dtype} and {t.dtype}")
    b, h, _, d = query.shape
    _check(key.shape[0] == b and value.shape[0] == b, "query, key and value must have the same batch size")
    _check(value.shape[1] == key.shape[1], "key and value must have the same number of heads")
    _check(value.shape[2] == key.shape[2], "key and value must have the same sequence length")
    _check(key.shape[3] == d, "query and key must have the same head dimension")
    hkv = key.shape[1]
    _check(
        (hkv == 0 and h == 0) or (hkv > 0 and h % hkv == 0),
        f"the number of query heads ({h}) must be a multiple of the number of key/value heads ({hkv})",
    )
    for what, dim in (("query and key", d), ("value", value.shape[3])):
        _check(dim % 8 == 0 and 8 <= dim <= 256, f"head dimension of {what} must be a multiple of 8 in [8, 256]")
    for name, t in (("query", query), ("key", key), ("value", value)):
        _check(t.stride(-1) == 1 or t.shape[-1] <= 1, f"{name} must have stride 1 in its last dimension")
    if query.device.type == "cuda" and query.dtype != torch.float32:
        _check(value.shape[3] == d, "on CUDA the value head dimension must equal the query head dimension")


def _outputs(query: torch.Tensor, value: torch.Tensor):
    b, h, lq, _ = query.shape
    dv = value.shape[-1]
    out = query.new_empty(b, lq, h, dv).transpose(1, 2)
    lse = query.new_empty(b, h, lq, dtype=torch.float32)
    return out, lse


@torch.library.register_fake("sparse_attn::dense_fwd")
def _dense_fwd(query, key, value, attn_mask=None, scale=None, causal=False):
    _check_qkv(query, key, value, attn_mask=attn_mask)
    return _outputs(query, value)


@torch.library.register_fake("sparse_attn::flash_fwd")
def _flash_fwd(query, key, value, scale=None, causal=False, window_left=-1, window_right=-1):
    _check_qkv(query, key, value)
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
    _check_qkv(
        query,
        key,
        value,
        kv_num_blocks=kv_num_blocks,
        kv_indices=kv_indices,
        kv_partial=kv_partial,
        partial_masks=partial_masks,
        q_block_order=q_block_order,
    )
    for name, t in (
        ("kv_num_blocks", kv_num_blocks),
        ("kv_indices", kv_indices),
        ("kv_partial", kv_partial),
        ("partial_masks", partial_masks),
    ):
        _check(t.dtype == torch.int32, f"{name} must be int32, got {t.dtype}")
    _check(q_block in (64, 128) and kv_block in (64, 128), "q_block and kv_block must be 64 or 128")
    return _outputs(query, value)


@torch.library.register_fake("sparse_attn::gather_fwd")
def _gather_fwd(query, key, value, indices, scale=None):
    _check_qkv(query, key, value, indices=indices)
    _check(indices.dtype == torch.int32, f"indices must be int32, got {indices.dtype}")
    _check(indices.dim() == 4, "indices must be 4-D (B, Hi, Lq, k)")
    return _outputs(query, value)


@torch.library.register_fake("sparse_attn::_check_inputs")
def _check_inputs(query, key, value):
    return None


@torch.library.register_fake("sparse_attn::topk_select")
def _topk_select(query, key, k, causal=False):
    _check_qkv(query, key, key)
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
