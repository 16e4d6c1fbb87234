"""Fake (meta) kernels, so torch.compile and torch.export trace every op without running it, and
the autograd registrations: gradients for query, key and value through the backward ops (CPU
kernels so far; on CUDA the backward ops raise a clear error)."""

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


@torch.library.register_fake("sparse_attn::_flash_fwd_out")
def _flash_fwd_out(query, key, value, out, lse, scale=None, causal=False, window_left=-1, window_right=-1):
    _check_qkv(query, key, value, out=out, lse=lse)
    b, h, lq, _ = query.shape
    _check(
        tuple(out.shape) == (b, h, lq, value.shape[3]) and out.dtype == query.dtype,
        f"out must be (B, H, Lq, Dv) of query's dtype, got {tuple(out.shape)} {out.dtype}",
    )
    _check(tuple(lse.shape) == (b, h, lq) and lse.dtype == torch.float32, "lse must be float32 (B, H, Lq)")


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


@torch.library.register_fake("sparse_attn::kvcache_fwd")
def _kvcache_fwd(
    query,
    key_cache,
    value_cache,
    cache_seqlens,
    key=None,
    value=None,
    block_table=None,
    kv_num_blocks=None,
    kv_indices=None,
    kv_block=0,
    scale=None,
    window_left=-1,
    window_right=-1,
):
    for name, t in (("key_cache", key_cache), ("value_cache", value_cache), ("cache_seqlens", cache_seqlens)):
        _check(t.device == query.device, f"{name} must be on the same device as query ({query.device}), got {t.device}")
    _check(query.dim() == 4 and value_cache.dim() == 4, "query and the caches must be 4-D")
    return _outputs(query, value_cache)


@torch.library.register_fake("sparse_attn::_decode_block_select")
def _decode_block_select(block_scores, cache_seqlens, k, block_size, sinks, recent):
    b, nkb = block_scores.shape
    kk = min(k, nkb)
    return block_scores.new_empty(b, dtype=torch.int32), block_scores.new_empty(b, kk, dtype=torch.int32)


@torch.library.register_fake("sparse_attn::_merge_partial_")
def _merge_partial_(out, lse, part, part_lse):
    _check(out.dim() == 4 and part.shape == out.shape, "out and part must be (B, H, L, D) of one shape")
    _check(lse.shape == out.shape[:3] and part_lse.shape == lse.shape, "lse and part_lse must be (B, H, L)")
    _check(lse.dtype == part_lse.dtype == torch.float32, "lse and part_lse must be float32")
    _check(part.dtype == out.dtype, f"part must have out's dtype {out.dtype}, got {part.dtype}")


@torch.library.register_fake("sparse_attn::_selection_mask")
def _selection_mask(indices, key_length, heads, q_block, kv_block, causal, row_offset, entry_block=1):
    from ._routes import selection_mask_size

    _check(indices.dtype == torch.int32, f"indices must be int32, got {indices.dtype}")
    _check(indices.dim() == 4, f"indices must be 4-D (B, G, Lq, k), got {indices.dim()}-D")
    _check(q_block in (64, 128) and kv_block in (64, 128), "q_block and kv_block must be 64 or 128")
    _check(entry_block in (1, 64, 128), f"entry_block must be 1 (keys), 64 or 128 (key blocks), got {entry_block}")
    b, g, lq, _ = indices.shape
    _check(heads % g == 0, f"heads ({heads}) must be a multiple of the groups ({g})")
    pairs, longest = selection_mask_size(lq, key_length, q_block, kv_block, causal, row_offset)
    nqb, out_heads = -(-lq // q_block), 1 if g == 1 else heads
    i32 = dict(dtype=torch.int32)
    return (
        indices.new_empty(b, out_heads, nqb, **i32),
        indices.new_empty(b, out_heads, nqb, longest, **i32),
        indices.new_empty(b, out_heads, nqb, longest, **i32),
        indices.new_empty(b * g * pairs, q_block, kv_block // 32, **i32),
    )


@torch.library.register_fake("sparse_attn::_selection_union")
def _selection_union(indices, key_length, q_block, kv_block, causal, row_offset, entry_block=1, samples=-1):
    _check(indices.dtype == torch.int32, f"indices must be int32, got {indices.dtype}")
    _check(indices.dim() == 4, f"indices must be 4-D (B, G, Lq, k), got {indices.dim()}-D")
    _check(q_block in (64, 128) and kv_block in (64, 128), "q_block and kv_block must be 64 or 128")
    _check(entry_block in (1, 64, 128), f"entry_block must be 1 (keys), 64 or 128 (key blocks), got {entry_block}")
    return indices.new_empty((), dtype=torch.int64)


@torch.library.register_fake("sparse_attn::_canonical_selection")
def _canonical_selection(indices):
    _check(indices.dtype == torch.int32 and indices.dim() >= 1, "indices must be int32 with a last dimension")
    return torch.empty_like(indices, memory_format=torch.contiguous_format)


@torch.library.register_fake("sparse_attn::_document_mask")
def _document_mask(
    cu_seqlens_q, cu_seqlens_k, partial_offsets, num_partial, total_q, total_k, q_block, kv_block, left, right, max_kb
):
    _check(cu_seqlens_q.dtype == cu_seqlens_k.dtype == torch.int32, "cu_seqlens_q and cu_seqlens_k must be int32")
    _check(cu_seqlens_q.dim() == 1 and cu_seqlens_q.shape == cu_seqlens_k.shape, "cu_seqlens must be (B + 1,)")
    _check(q_block in (64, 128) and kv_block in (64, 128), "q_block and kv_block must be 64 or 128")
    nqb = -(-total_q // q_block)
    _check(partial_offsets.dtype == torch.int64 and partial_offsets.shape == (nqb + 1,), "partial_offsets (nQb + 1,)")
    i32 = dict(dtype=torch.int32)
    return (
        cu_seqlens_q.new_empty(1, 1, nqb, **i32),
        cu_seqlens_q.new_empty(1, 1, nqb, max_kb, **i32),
        cu_seqlens_q.new_empty(1, 1, nqb, max_kb, **i32),
        cu_seqlens_q.new_empty(num_partial, q_block, kv_block // 32, **i32),
    )


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


@torch.library.register_fake("sparse_attn::flash_bwd")
def _flash_bwd(
    grad_out, query, key, value, out, lse, grad_lse=None, scale=None, causal=False, window_left=-1, window_right=-1
):
    _check_qkv(query, key, value, grad_out=grad_out)
    return query.new_empty(query.shape), key.new_empty(key.shape), value.new_empty(value.shape)


@torch.library.register_fake("sparse_attn::block_sparse_bwd")
def _block_sparse_bwd(
    grad_out,
    query,
    key,
    value,
    out,
    lse,
    grad_lse,
    kv_num_blocks,
    kv_indices,
    kv_partial,
    partial_masks,
    q_block,
    kv_block,
    scale=None,
):
    _check_qkv(query, key, value, grad_out=grad_out, kv_num_blocks=kv_num_blocks)
    return query.new_empty(query.shape), key.new_empty(key.shape), value.new_empty(value.shape)


@torch.library.register_fake("sparse_attn::gather_bwd")
def _gather_bwd(grad_out, query, key, value, out, lse, grad_lse, indices, scale=None):
    _check_qkv(query, key, value, grad_out=grad_out, indices=indices)
    return query.new_empty(query.shape), key.new_empty(key.shape), value.new_empty(value.shape)


# ------------------------------------------------------------------------------------ autograd
# Gradients for query, key and value; none for masks, indices or options. Each forward saves its
# inputs, output and LSE; its backward op recomputes the probabilities from the LSE. A gradient
# of the LSE (when the caller uses it) enters the backward as well.
def _setup_context(ctx, inputs, output):
    ctx.save_for_backward(*inputs[:3], *output)
    ctx.rest = inputs[3:]
    # An unused LSE's gradient arrives as None, not as a tensor of zeros (a fill per backward call,
    # and the backward kernels then read it).
    ctx.set_materialize_grads(False)


def first_order() -> None:
    """The backward ops are not themselves differentiable: a double backward (create_graph=True,
    under which autograd runs a backward with grad mode on) would get zeros; it raises instead."""
    if torch.is_grad_enabled() and not torch.compiler.is_compiling():
        raise NotImplementedError(
            "sparse_attn's attention backward is first-order only: double backward (create_graph=True) is not supported"
        )


def _grads(ctx, grad_out, grad_lse):
    first_order()
    query, key, value, out, lse = ctx.saved_tensors
    if grad_out is None:
        grad_out = torch.zeros_like(out)
    return query, key, value, out, lse, grad_out, grad_lse


def _flash_backward(ctx, grad_out, grad_lse):
    q, k, v, out, lse, g, gl = _grads(ctx, grad_out, grad_lse)
    scale, causal, left, right = ctx.rest
    dq, dk, dv = torch.ops.sparse_attn.flash_bwd(g, q, k, v, out, lse, gl, scale, causal, left, right)
    return dq, dk, dv, None, None, None, None


def _block_sparse_backward(ctx, grad_out, grad_lse):
    q, k, v, out, lse, g, gl = _grads(ctx, grad_out, grad_lse)
    cnt, idx, part, bits, q_block, kv_block, scale, _order = ctx.rest
    dq, dk, dv = torch.ops.sparse_attn.block_sparse_bwd(
        g, q, k, v, out, lse, gl, cnt, idx, part, bits, q_block, kv_block, scale
    )
    return dq, dk, dv, None, None, None, None, None, None, None, None


def _gather_backward(ctx, grad_out, grad_lse):
    q, k, v, out, lse, g, gl = _grads(ctx, grad_out, grad_lse)
    indices, scale = ctx.rest
    dq, dk, dv = torch.ops.sparse_attn.gather_bwd(g, q, k, v, out, lse, gl, indices, scale)
    return dq, dk, dv, None, None


def _dense_backward(ctx, grad_out, grad_lse):
    """dense_attention's backward: the baseline's math redone in fp32 through autograd (it
    materialises the scores, as its forward does); a floating attn_mask that requires grad gets
    its gradient too (an additive bias, as SDPA's), summed over the dims it broadcasts along."""
    first_order()
    query, key, value, out, lse = ctx.saved_tensors
    attn_mask, scale, causal = ctx.rest
    bias_grad = attn_mask is not None and attn_mask.is_floating_point() and attn_mask.requires_grad

    def math(q, k, v):
        g = q.shape[1] // max(k.shape[1], 1)
        k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
        s = (q.float() @ k.float().transpose(-1, -2)) * (scale if scale is not None else q.shape[-1] ** -0.5)
        if attn_mask is not None:
            s = s.masked_fill(~attn_mask, float("-inf")) if attn_mask.dtype == torch.bool else s + attn_mask.float()
        if causal:
            lq, lk = s.shape[-2:]
            visible = torch.ones(lq, lk, dtype=torch.bool, device=s.device).tril(lk - lq)
            s = s.masked_fill(~visible, float("-inf"))
        m = s.amax(-1, keepdim=True) if s.shape[-1] else s.new_zeros(*s.shape[:-1], 1)  # no keys: no max
        m = torch.where(torch.isneginf(m), torch.zeros_like(m), m)
        e = torch.exp(s - m)
        total = e.sum(-1, keepdim=True)
        p = torch.where(total > 0, e / total, torch.zeros_like(e))
        lse_ = torch.where(
            total[..., 0] > 0, m[..., 0] + torch.log(total[..., 0]), torch.full_like(m[..., 0], float("-inf"))
        )
        return (p @ v.float()).to(q.dtype), lse_

    with torch.enable_grad():
        q, k, v = (t.detach().requires_grad_(True) for t in (query, key, value))
        if bias_grad:
            attn_mask = attn_mask.detach().requires_grad_(True)
        o, l_ = math(q, k, v)
        outs, grads = [o], [grad_out if grad_out is not None else torch.zeros_like(o)]
        if grad_lse is not None:
            outs.append(l_)
            grads.append(torch.where(torch.isneginf(l_), torch.zeros_like(grad_lse), grad_lse))
        wrt = (q, k, v, attn_mask) if bias_grad else (q, k, v)
        got = torch.autograd.grad(outs, wrt, grads, allow_unused=True)
    return *got[:3], got[3] if bias_grad else None, None, None


torch.library.register_autograd("sparse_attn::flash_fwd", _flash_backward, setup_context=_setup_context)
torch.library.register_autograd("sparse_attn::block_sparse_fwd", _block_sparse_backward, setup_context=_setup_context)
torch.library.register_autograd("sparse_attn::gather_fwd", _gather_backward, setup_context=_setup_context)
torch.library.register_autograd("sparse_attn::dense_fwd", _dense_backward, setup_context=_setup_context)


def tracks_grad(query, key, value, *rest) -> bool:
    """Whether a call on these inputs may need a gradient (grad mode on and one of them, or a
    tensor among ``rest``, requires it)."""
    for name, t in (("query", query), ("key", key), ("value", value)):
        if not isinstance(t, torch.Tensor):  # the first place an op's Python reads them
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if not torch.is_grad_enabled():
        return False
    return (
        query.requires_grad
        or key.requires_grad
        or value.requires_grad
        or any(isinstance(t, torch.Tensor) and t.requires_grad for t in rest)
    )


def forward(op, query, key, value, *rest):
    """``op(query, key, value, *rest)`` for the forward ops above, whose gradients (for query, key
    and value only) register_autograd defines.

    The autograd wrapper that register_autograd installs runs in Python on every call, ~10-15 us
    even when nothing needs a gradient: most of SDPA's whole time on a small CPU input. An eager
    call where no gradient can be needed (grad mode off, or none of query, key, value requiring
    grad) dispatches below autograd directly, as that wrapper itself would; traced calls
    (torch.compile, torch.export) keep the registered path."""
    if tracks_grad(query, key, value, *rest):
        return op(query, key, value, *rest)
    if torch.compiler.is_compiling():
        return op(query, key, value, *rest)
    with torch._C._AutoDispatchBelowAutograd():
        return op(query, key, value, *rest)
