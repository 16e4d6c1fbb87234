"""The four attention operators. Layout follows SDPA: query (B, H, Lq, D), key (B, Hkv, Lk, D),
value (B, Hkv, Lk, Dv), output (B, H, Lq, Dv) stored (B, Lq, H, Dv)-contiguous.

Every op takes ``scale`` (default ``1/sqrt(D)``) and ``return_lse`` (also return the natural-log
softmax normaliser, fp32 (B, H, Lq); -inf for a query that sees no key, whose output is 0).
Causal masks are bottom-right aligned: query i sees key j iff ``j <= i + (Lk - Lq)``.
"""

from __future__ import annotations

import math

import torch

from .masks import _FULL, _NONE, BlockSparseMask
from .patterns import causal as _causal_pattern

__all__ = ["dense_attention", "flash_attention", "block_sparse_attention", "topk_attention"]

_ops = torch.ops.sparse_attn


def _result(out, lse, indices, return_lse, return_indices=False):
    parts = [out]
    if return_lse:
        parts.append(lse)
    if return_indices:
        parts.append(indices)
    return parts[0] if len(parts) == 1 else tuple(parts)


def _check_scale(scale):
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, (int, float))):
        raise TypeError(f"scale must be a float or None, got {type(scale).__name__}")
    return None if scale is None else float(scale)


def dense_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    attn_mask: torch.Tensor | None = None,
    causal: bool = False,
    scale: float | None = None,
    return_lse: bool = False,
):
    """Naive attention: materialises S = scale * Q K^T in fp32, then softmax, then P V.

    The baseline the other ops are measured against; its extra memory is O(B * H * Lq * Lk).

    Parameters
    ----------
    query : Tensor (B, H, Lq, D)
    key : Tensor (B, Hkv, Lk, D)
        H must be a multiple of Hkv (GQA/MQA); query head h reads key head ``h // (H // Hkv)``.
    value : Tensor (B, Hkv, Lk, Dv)
    attn_mask : Tensor, optional
        Broadcastable to (B, H, Lq, Lk): bool (True = attend) or floating point (added to the
        scores), as in SDPA. Combined with ``causal`` when both are given.
    causal : bool
        Bottom-right aligned causal mask.
    scale : float, optional
        Softmax scale, default ``1 / sqrt(D)``.
    return_lse : bool
        Also return the log-sum-exp of each row, fp32 (B, H, Lq).

    Returns
    -------
    Tensor (B, H, Lq, Dv), or (out, lse).

    Examples
    --------
    >>> import torch, sparse_attn
    >>> q = k = v = torch.randn(1, 2, 16, 64)
    >>> sparse_attn.dense_attention(q, k, v, causal=True).shape
    torch.Size([1, 2, 16, 64])
    """
    out, lse = _ops.dense_fwd.default(query, key, value, attn_mask, _check_scale(scale), bool(causal))
    return _result(out, lse, None, return_lse)


def _window_bounds(window) -> tuple[int, int]:
    if window is None:
        return -1, -1
    if isinstance(window, int):
        window = (window, window)
    try:
        left, right = window
    except (TypeError, ValueError):
        raise TypeError(f"window must be None, an int or a (left, right) pair, got {window!r}") from None
    bounds = []
    for name, w in (("left", left), ("right", right)):
        if w is None or (isinstance(w, int) and w == -1):
            bounds.append(-1)
        elif isinstance(w, int) and not isinstance(w, bool) and w >= 0:
            bounds.append(w)
        else:
            raise ValueError(f"window {name} bound must be a non-negative int or None (unbounded), got {w!r}")
    return bounds[0], bounds[1]


def flash_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    causal: bool = False,
    window: int | tuple[int | None, int | None] | None = None,
    scale: float | None = None,
    return_lse: bool = False,
):
    """Tiled, fused attention with an online softmax (FlashAttention-style).

    The score matrix never leaves on-chip memory (a per-thread tile on the CPU); extra memory
    is the LSE only.

    Parameters
    ----------
    query, key, value : Tensor
        (B, H, Lq, D), (B, Hkv, Lk, D), (B, Hkv, Lk, Dv); any strides with a unit last stride,
        e.g. ``x.view(B, L, H, D).transpose(1, 2)`` is read in place.
    causal : bool
        Bottom-right aligned causal mask.
    window : int or (left, right), optional
        Local attention: query i sees keys ``i + off - left <= j <= i + off + right`` with
        ``off = Lk - Lq`` (``None`` = unbounded side). With ``causal`` the right bound is 0.
    scale : float, optional
        Softmax scale, default ``1 / sqrt(D)``.
    return_lse : bool
        Also return the log-sum-exp, fp32 (B, H, Lq).

    Returns
    -------
    Tensor (B, H, Lq, Dv), or (out, lse).

    Examples
    --------
    >>> import torch, sparse_attn
    >>> q = torch.randn(2, 8, 128, 64); kv = torch.randn(2, 2, 128, 64)
    >>> out, lse = sparse_attn.flash_attention(q, kv, kv, causal=True, return_lse=True)
    >>> out.shape, lse.shape
    (torch.Size([2, 8, 128, 64]), torch.Size([2, 8, 128]))
    """
    left, right = _window_bounds(window)
    out, lse = _ops.flash_fwd.default(query, key, value, _check_scale(scale), bool(causal), left, right)
    return _result(out, lse, None, return_lse)


def _as_block_sparse_mask(mask, query: torch.Tensor, key: torch.Tensor) -> BlockSparseMask:
    _check_4d(query=query, key=key)
    lq, lk = query.shape[-2], key.shape[-2]
    if isinstance(mask, BlockSparseMask):
        result = mask
    elif isinstance(mask, torch.Tensor):
        if mask.dtype != torch.bool:
            raise TypeError(f"a tensor mask must be a bool block matrix, got dtype {mask.dtype}")
        nq, nk = mask.shape[-2:]
        sizes = [b for b in (128, 64) if math.ceil(lq / b) == nq and math.ceil(lk / b) == nk]
        if not sizes:
            raise ValueError(
                f"block matrix of shape {tuple(mask.shape)} matches neither 64 nor 128 blocks for Lq={lq}, Lk={lk}"
            )
        result = BlockSparseMask.from_block_matrix(mask, seq_lengths=(lq, lk), block_size=sizes[0])
    elif type(mask).__name__ == "BlockMask":
        result = BlockSparseMask.from_flex(mask)
    else:
        raise TypeError(
            "mask must be a BlockSparseMask, a FlexAttention BlockMask or a bool block matrix, "
            f"got {type(mask).__name__}"
        )
    if tuple(result.seq_lengths) != (lq, lk):
        raise ValueError(
            f"mask was built for seq_lengths {tuple(result.seq_lengths)} but query/key have Lq={lq}, Lk={lk}; "
            "build the mask for these lengths"
        )
    return result


def block_sparse_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask,
    *,
    scale: float | None = None,
    return_lse: bool = False,
):
    """Attention restricted to the (query block, key block) pairs of a block-sparse mask.

    Exact inside each block: full blocks are computed without masking, partial blocks apply
    their element mask. A query that sees no key gets 0 (LSE -inf).

    Parameters
    ----------
    query, key, value : Tensor
        As in :func:`flash_attention`.
    mask : BlockSparseMask, FlexAttention BlockMask, or bool Tensor
        Built for (Lq, Lk). A bool tensor is a block matrix (B|1, H|1, nQb, nKb) of full blocks
        (block size 128, or 64 if only that matches). A ``BlockMask`` is converted on every call
        (its ``mask_mod`` is evaluated on the partial blocks): convert it once with
        :meth:`BlockSparseMask.from_flex` when it is reused.
    scale : float, optional
        Softmax scale, default ``1 / sqrt(D)``.
    return_lse : bool
        Also return the log-sum-exp, fp32 (B, H, Lq).

    Examples
    --------
    >>> import torch, sparse_attn
    >>> from sparse_attn import patterns
    >>> q = k = v = torch.randn(1, 2, 512, 64)
    >>> mask = patterns.sliding_window(512, 128) | patterns.global_tokens(512, [0])
    >>> sparse_attn.block_sparse_attention(q, k, v, mask).shape
    torch.Size([1, 2, 512, 64])
    """
    m = _as_block_sparse_mask(mask, query, key)
    if m.device != query.device:  # checked here for every route, not only by the block kernel
        raise RuntimeError(f"mask must be on the same device as query ({query.device}), got {m.device}")
    scale = _check_scale(scale)
    # Masks that are exactly a pattern with a faster exact form run as that (masks.ExactForm);
    # value's shape is left for the kernels to check otherwise.
    if m.exact_form is not None and value.dim() == 4 and value.shape[-2] == key.shape[-2]:
        f = m.exact_form
        out, lse = _run_route(query, key, value, (f.kind, f.a, f.b), scale)
    else:
        out, lse = _run_block_sparse(query, key, value, m, scale)
    return _result(out, lse, None, return_lse)


def _run_route(query, key, value, route: tuple[str, int, int], scale):
    """A pattern's mask as the attention it is: causal and windows as the flash kernel's (the
    Hopper core at every block size the mask has, no block lists; causal also in its own tile
    order), dilated ones as dense attention over the positions they connect (no masked pairs)."""
    kind, a, b = route
    if kind == "causal":
        return _ops.flash_fwd.default(query, key, value, scale, True, -1, -1)
    if kind == "window":
        return _ops.flash_fwd.default(query, key, value, scale, False, a, b)
    run = _run_dilated if kind == "dilated" else _run_dilated_2d
    return run(query, key, value, a, b, scale)


def _run_dilated(query, key, value, window: int, dilation: int, scale):
    """patterns.dilated's mask (|i - j| < window, i = j mod dilation; Lq = Lk) as one sliding window
    per residue class c: queries and keys c, c + dilation, ... (strided views, read in place) with
    |a - b| <= ceil(window / dilation) - 1 between their positions a, b in the class. Every pair
    computed is visible, where the block mask's partial blocks compute `dilation` times as many."""
    half = -(-window // dilation) - 1
    b, h, lq = query.shape[:3]
    out = torch.empty(b, lq, h, value.shape[-1], dtype=query.dtype, device=query.device).transpose(1, 2)
    lse = torch.empty(b, h, lq, dtype=torch.float32, device=query.device)
    for c in range(min(dilation, lq)):
        o_c, lse_c = _ops.flash_fwd.default(
            query[:, :, c::dilation], key[:, :, c::dilation], value[:, :, c::dilation], scale, False, half, half
        )
        out[:, :, c::dilation] = o_c
        lse[:, :, c::dilation] = lse_c
    return out, lse


def _run_dilated_2d(query, key, value, segment: int, dilation: int, scale):
    """patterns.dilated_2d's mask (i, j in one segment, both at positions that are multiples of
    dilation within it; Lq = Lk) as dense attention per segment over those positions. The whole
    segments are gathered into one batch (segments x batch, a copy of 1 / dilation of Q, K and V:
    one launch that fills the GPU), the ragged last segment runs on strided views; rows at other
    positions see no key (0, LSE -inf)."""
    b, h, lq = query.shape[:3]
    out = torch.zeros(b, lq, h, value.shape[-1], dtype=query.dtype, device=query.device).transpose(1, 2)
    lse = torch.full((b, h, lq), -math.inf, dtype=torch.float32, device=query.device)
    whole = lq // segment

    def positions(x):  # (B, H, L, ...) -> (B, H, whole, ceil(segment / dilation), ...), a view
        return x[:, :, : whole * segment].unflatten(2, (whole, segment))[:, :, :, ::dilation]

    if whole > 0:
        q, k, v = (positions(x).transpose(1, 2).flatten(0, 1) for x in (query, key, value))
        o, l_ = _ops.flash_fwd.default(q, k, v, scale, False, -1, -1)
        positions(out).copy_(o.unflatten(0, (b, whole)).transpose(1, 2))
        positions(lse).copy_(l_.unflatten(0, (b, whole)).transpose(1, 2))
    if whole * segment < lq:
        tail = slice(whole * segment, lq, dilation)
        o, l_ = _ops.flash_fwd.default(query[:, :, tail], key[:, :, tail], value[:, :, tail], scale, False, -1, -1)
        out[:, :, tail] = o
        lse[:, :, tail] = l_
    return out, lse


def _schedule(m: BlockSparseMask) -> torch.Tensor:
    """The CTA schedule of a mask (tile_of_cta), (nQb + 1,) int32: query blocks far heavier than
    the mean (global-token rows) run first across every head, so they do not finish alone at the
    end; the rest run one head at a time, heaviest first, so the CTAs in flight share that head's
    K/V in L2. Made on the mask's device (no synchronisation) and kept on the mask: it is a few
    small kernels, a noticeable share of a short sparse attention if paid on every call."""
    if m._order is not None:
        return m._order
    weights = m.kv_num_blocks.amax(dim=(0, 1))
    order = torch.argsort(weights, descending=True, stable=True)
    heavy = (weights.float() > 2 * weights.float().mean()).sum().reshape(1)
    order = torch.cat([order, heavy]).to(torch.int32)
    if not torch.compiler.is_compiling():
        m._order = order
    return order


def _run_block_sparse(query, key, value, m: BlockSparseMask, scale):
    order = _schedule(m)
    return _ops.block_sparse_fwd.default(
        query,
        key,
        value,
        m.kv_num_blocks,
        m.kv_indices,
        m.kv_partial,
        m.partial_masks,
        m.q_block,
        m.kv_block,
        scale,
        order,
    )


_LAYOUT = {"query": "(B, H, Lq, D)", "key": "(B, Hkv, Lk, D)", "value": "(B, Hkv, Lk, Dv)"}


def _check_4d(**tensors) -> None:
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name} must be 4-D {_LAYOUT[name]}, got {t.dim()}-D")


def _check_block_mode(query, key, value) -> None:
    """What block mode's pooling needs, checked before it runs (the kernel's checks, same words)."""
    _check_4d(query=query, key=key, value=value)
    for name, t in (("key", key), ("value", value)):
        if t.device != query.device:
            raise ValueError(f"query and {name} must be on the same device, got {query.device} and {t.device}")
        if t.dtype != query.dtype:
            raise TypeError(f"query and {name} must have the same dtype, got {query.dtype} and {t.dtype}")
    if not (query.shape[0] == key.shape[0] == value.shape[0]):
        raise ValueError(
            f"query, key and value must have the same batch size, got {query.shape[0]}, "
            f"{key.shape[0]}, {value.shape[0]}"
        )
    if key.shape[1] != value.shape[1]:
        raise ValueError(f"key and value must have the same number of heads, got {key.shape[1]} and {value.shape[1]}")
    if key.shape[2] != value.shape[2]:
        raise ValueError(f"key and value must have the same sequence length, got {key.shape[2]} and {value.shape[2]}")
    if query.shape[3] != key.shape[3]:
        raise ValueError(f"query and key must have the same head dimension, got {query.shape[3]} and {key.shape[3]}")
    h, hkv = query.shape[1], key.shape[1]
    if (hkv == 0 and h != 0) or (hkv > 0 and h % hkv != 0):
        raise ValueError(f"the number of query heads ({h}) must be a multiple of the number of key/value heads ({hkv})")


def _block_topk_mask(query, key, k: int, block_size: int, causal: bool):
    """Top-k key blocks per (batch, head, query block) from mean-pooled scores, as a mask.

    Returns the mask and the chosen blocks (B, H, nQb, k'), int32, ascending, -1 padded (k' is k,
    or k + 1 when causal needs two diagonal blocks). No host synchronisation: the mask's width is
    known and its partial blocks are the causal pattern's."""
    b, h, lq, d = query.shape
    hkv, lk = key.shape[1], key.shape[2]
    nq, nk = math.ceil(lq / block_size), math.ceil(lk / block_size)
    if min(b, h, lq, lk) == 0:  # nothing to select: an empty mask, outputs filled by the op
        table = torch.full((1, 1, nq, nk), _NONE, dtype=torch.int32, device=query.device)
        bits = torch.zeros(0, block_size, block_size // 32, dtype=torch.int32, device=query.device)
        mask = BlockSparseMask._from_table(
            table, bits, (lq, lk), (block_size, block_size), max_kv_blocks=0, compact=False
        )
        return mask, torch.full((b, h, nq, 0), -1, dtype=torch.int32, device=query.device)

    def pool(x, n):
        pad = n * block_size - x.shape[2]
        xs = torch.nn.functional.pad(x.float(), (0, 0, 0, pad)).view(x.shape[0], x.shape[1], n, block_size, -1)
        counts = (x.shape[2] - torch.arange(n, device=x.device) * block_size).clamp(max=block_size)
        return xs.sum(3) / counts[:, None].to(torch.float32)

    qp = pool(query, nq)
    kp = pool(key, nk).repeat_interleave(h // hkv, dim=1)
    scores = qp @ kp.transpose(-1, -2)  # (B, H, nQb, nKb)
    neg = torch.finfo(torch.float32).min
    kk = min(k, nk)
    if causal:
        # Every key block holding some row's diagonal key (i + Lk - Lq) is kept: one block when
        # Lk - Lq is a multiple of the block size, else two, so a query block can get k + 1.
        off = lk - lq
        rows0 = torch.arange(nq, device=query.device) * block_size
        first_diag = rows0 + off
        last_diag = (rows0 + block_size - 1).clamp(max=lq - 1) + off
        kb = torch.arange(nk, device=query.device)[None, :]
        visible = kb * block_size <= last_diag[:, None]
        diag = (
            (kb >= first_diag.clamp(min=0)[:, None] // block_size)
            & (kb <= last_diag[:, None] // block_size)
            & (last_diag >= 0)[:, None]
        )
        scores = torch.where(visible, scores, float("-inf"))
        scores = torch.where(diag, float("inf"), scores)
        kk = min(max(k, 1 if off % block_size == 0 else 2), nk)
    top = scores.topk(kk, dim=-1)
    chosen = top.indices.to(torch.int32)
    if causal:
        chosen = torch.where(top.values > neg, chosen, -1)
    chosen = torch.where(chosen < 0, nk, chosen).sort(-1).values
    chosen = torch.where(chosen == nk, -1, chosen).to(torch.int32)
    table = torch.full((b, h, nq, nk + 1), _NONE, dtype=torch.int32, device=query.device)
    table.scatter_(-1, torch.where(chosen < 0, nk, chosen).long(), _FULL)
    table = table[..., :nk]
    if causal:
        pattern = _causal_pattern(lq, lk, block_size=block_size, device=query.device, compact=False)
        ctable = pattern.block_table()
        table = torch.where(table == _FULL, ctable, table)
        bits = pattern.partial_masks
    else:
        bits = torch.zeros(0, block_size, block_size // 32, dtype=torch.int32, device=query.device)
    mask = BlockSparseMask._from_table(table, bits, (lq, lk), (block_size, block_size), max_kv_blocks=kk, compact=False)
    return mask, chosen


def topk_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    k: int,
    *,
    block_size: int | None = None,
    causal: bool = False,
    scale: float | None = None,
    index_query: torch.Tensor | None = None,
    index_key: torch.Tensor | None = None,
    index_weights: torch.Tensor | None = None,
    return_indices: bool = False,
    return_lse: bool = False,
):
    """Attention of each query over the k keys (or k key blocks) chosen for it at run time.

    Token mode (``block_size=None``): each query attends to exactly its k selected keys, the
    softmax running over that set only. Selection, per query head, takes the k largest
    ``q . k_j`` among the visible keys (ties: the lower index wins). With a lightning indexer
    (``index_query`` (B, Lq, HI, DI), ``index_key`` (B, Lk, DI), ``index_weights`` (B, Lq, HI),
    DeepSeek V3.2) the score is ``sum_j w[t, j] * relu(q_I[t, j] . k_I[s])`` and one index set per
    token serves every head. Block mode (``block_size`` 64 or 128): per query block and head, the
    k key blocks with the largest mean-pooled score (the diagonal block always kept under causal)
    run through the block-sparse kernel.

    Causal masking applies before selection; when k reaches the number of visible keys the
    result equals dense attention. Selection never holds a (B, H, Lq, Lk) tensor.

    Parameters
    ----------
    query, key, value : Tensor
        As in :func:`flash_attention`.
    k : int
        Keys (token mode) or key blocks (block mode) per query; clamped to Lk (or nKb).
    block_size : int, optional
        Block mode's block size (64 or 128).
    causal : bool
        Bottom-right aligned causal mask, applied before selection.
    scale : float, optional
        Softmax scale, default ``1 / sqrt(D)``.
    index_query, index_key, index_weights : Tensor, optional
        Lightning-indexer inputs (token mode only), same dtype as each other.
    return_indices : bool
        Also return the selection, int32, ascending, -1 where fewer than k are visible:
        (B, H, Lq, k) per head, (B, 1, Lq, k) from the indexer, (B, H, nQb, k) key blocks in block mode.
    return_lse : bool
        Also return the log-sum-exp, fp32 (B, H, Lq).

    Returns
    -------
    out, or a tuple in the order (out, lse, indices) keeping the parts asked for.

    Examples
    --------
    >>> import torch, sparse_attn
    >>> q = k = v = torch.randn(1, 2, 256, 64)
    >>> out, idx = sparse_attn.topk_attention(q, k, v, 32, causal=True, return_indices=True)
    >>> idx.shape
    torch.Size([1, 2, 256, 32])
    """
    if isinstance(k, bool) or not isinstance(k, int):
        raise TypeError(f"k must be an int, got {type(k).__name__}")
    if k <= 0:
        raise ValueError(f"k must be positive, got {k}")
    scale = _check_scale(scale)
    given = [t is not None for t in (index_query, index_key, index_weights)]
    if any(given) and not all(given):
        raise ValueError("index_query, index_key and index_weights must be given together")
    if block_size is not None:
        if any(given):
            raise ValueError("the lightning indexer selects tokens: it cannot be combined with block_size")
        if block_size not in (64, 128):
            raise ValueError(f"block_size must be 64 or 128, got {block_size}")
        _check_block_mode(query, key, value)
        mask, indices = _block_topk_mask(query, key, k, block_size, bool(causal))
        out, lse = _run_block_sparse(query, key, value, mask, scale)
        return _result(out, lse, indices, return_lse, return_indices)
    if all(given):
        if (
            query.dim() == 4
            and index_query.dim() == 4
            and (index_query.shape[0] != query.shape[0] or index_query.shape[1] != query.shape[2])
        ):
            raise ValueError(
                f"index_query must be (B, Lq, HI, DI) with B={query.shape[0]}, Lq={query.shape[2]}, "
                f"got {tuple(index_query.shape)}"
            )
        if key.dim() == 4 and index_key.dim() == 3 and index_key.shape[1] != key.shape[2]:
            raise ValueError(f"index_key must be (B, Lk, DI) with Lk={key.shape[2]}, got {tuple(index_key.shape)}")
        indices = _ops.indexer_select.default(index_query, index_key, index_weights, k, bool(causal))
    else:
        indices = _ops.topk_select.default(query, key, k, bool(causal))
    out, lse = _ops.gather_fwd.default(query, key, value, indices, scale)
    return _result(out, lse, indices, return_lse, return_indices)
