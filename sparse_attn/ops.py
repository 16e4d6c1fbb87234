"""The four attention operators. Layout follows SDPA: query (B, H, Lq, D), key (B, Hkv, Lk, D),
value (B, Hkv, Lk, Dv), output (B, H, Lq, Dv) stored (B, Lq, H, Dv)-contiguous.

Every op takes ``scale`` (default ``1/sqrt(D)``) and ``return_lse`` (also return the natural-log
softmax normaliser, fp32 (B, H, Lq); -inf for a query that sees no key, whose output is 0).
Causal masks are bottom-right aligned: query i sees key j iff ``j <= i + (Lk - Lq)``.
"""

from __future__ import annotations

import torch

from . import _args, _kvcache, _meta, _plan, _routes, _varlen

__all__ = [
    "attention_with_kvcache",
    "block_sparse_attention",
    "block_sparse_attention_varlen",
    "dense_attention",
    "flash_attention",
    "flash_attention_varlen",
    "kvcache_topk_mask",
    "topk_attention",
    "topk_attention_varlen",
]

_ops = torch.ops.sparse_attn


def _result(out, lse, indices, return_lse, return_indices=False):
    parts = [out]
    if return_lse:
        parts.append(lse)
    if return_indices:
        parts.append(indices)
    return parts[0] if len(parts) == 1 else tuple(parts)


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
        scores; a learned bias that requires grad gets its gradient), as in SDPA. Combined with
        ``causal`` when both are given.
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
    out, lse = _meta.forward(_ops.dense_fwd.default, query, key, value, attn_mask, _args.scale(scale), bool(causal))
    return _result(out, lse, None, return_lse)


def flash_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    causal: bool = False,
    window: int | tuple[int | None, int | None] | None = None,
    scale: float | None = None,
    return_lse: bool = False,
    key_lengths: torch.Tensor | None = None,
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
        ``off = Lk - Lq`` (``None`` = unbounded side); an int w is (w, w): 2w + 1 keys. With
        ``causal`` the right bound is 0. ``patterns.sliding_window(L, (left, right))`` is the same
        band as a mask (its int form ``sliding_window(L, w)`` is ``(w - 1, w - 1)``).
    scale : float, optional
        Softmax scale, default ``1 / sqrt(D)``.
    return_lse : bool
        Also return the log-sum-exp, fp32 (B, H, Lq).
    key_lengths : Tensor, optional
        (B,) integers: key j of batch element b is hidden iff ``j >= key_lengths[b]`` (right-padded
        keys), on top of ``causal`` and ``window``, whose alignment stays that of the tensors' Lq
        and Lk. Runs as ``block_sparse_attention`` with the mask of the lengths (no host
        synchronisation; a window with Lq > Lk is not supported here). Values past Lk act as Lk
        on a GPU tensor (a CPU tensor is checked).

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
    left, right = _args.window_bounds(window)
    if key_lengths is not None:
        mask = _args.key_length_mask(key_lengths, query, key, (128, 128))
        if left >= 0 or right >= 0:
            mask = mask & _window_band(query.shape[-2], key.shape[-2], left, right, query.device)
        return block_sparse_attention(query, key, value, mask, causal=causal, scale=scale, return_lse=return_lse)
    out, lse = _routes.flash(query, key, value, _args.scale(scale), bool(causal), left, right)
    return _result(out, lse, None, return_lse)


def _window_band(lq: int, lk: int, left: int, right: int, device):
    """flash_attention's window (bounds -1 = unbounded) for (Lq, Lk) as a mask, Lq <= Lk."""
    from ._mask_compiler import Interval, compile_mask

    if lq > lk:
        raise NotImplementedError("flash_attention with key_lengths and a window needs Lq <= Lk")
    off = lk - lq  # i + off - left <= j <= i + off + right  <=>  -right - off <= i - j <= left - off
    lo = -(lk + lq) if right < 0 else -right - off
    return compile_mask(Interval(lo, None if left < 0 else left - off), (lq, lk), (128, 128), device)


def block_sparse_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask,
    *,
    causal: bool = False,
    scale: float | None = None,
    return_lse: bool = False,
    key_lengths: torch.Tensor | None = None,
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
        (block size 128, or 64 if only that matches). A ``BlockMask`` is converted once
        (its ``mask_mod`` evaluated on the partial blocks, as :meth:`BlockSparseMask.from_flex`)
        and the conversion kept with the mask object: passing the same BlockMask at every step
        costs no conversion. Its block tensors changed in place convert again; a ``mask_mod``
        whose captured tensors change needs a new BlockMask (as with Flex itself).
    causal : bool
        Also hide the keys after each query (bottom-right aligned): the mask intersected with
        ``patterns.causal(Lq, Lk)`` (made once per mask and kept with it; a window pattern's mask
        still runs as ``flash_attention`` with its window capped at the diagonal).
    scale : float, optional
        Softmax scale, default ``1 / sqrt(D)``.
    return_lse : bool
        Also return the log-sum-exp, fp32 (B, H, Lq).
    key_lengths : Tensor, optional
        (B,) integers: key j of batch element b is also hidden iff ``j >= key_lengths[b]``
        (the mask intersected with the lengths' block mask; see :func:`flash_attention`).

    Examples
    --------
    >>> import torch, sparse_attn
    >>> from sparse_attn import patterns
    >>> q = k = v = torch.randn(1, 2, 512, 64)
    >>> mask = patterns.sliding_window(512, 128) | patterns.global_tokens(512, [0])
    >>> sparse_attn.block_sparse_attention(q, k, v, mask).shape
    torch.Size([1, 2, 512, 64])
    """
    m = _args.block_sparse_mask(mask, query, key)
    if key_lengths is not None:
        m = m & _args.key_length_mask(key_lengths, query, key, m.block_size)
    scale = _args.scale(scale)
    route = _plan.block_sparse_route(m, key, value, bool(causal))
    if route.kind == "block_kernel" and causal:
        m = _args.with_causal(m)
    if route.kind == "flash_causal":
        out, lse = _routes.flash(query, key, value, scale, True)
    elif route.kind == "flash_window":
        out, lse = _routes.flash(query, key, value, scale, False, *route.args)
    elif route.kind == "dilated":
        out, lse = _routes.dilated(query, key, value, *route.args, scale)
    elif route.kind == "dilated_2d":
        out, lse = _routes.dilated_2d(query, key, value, *route.args, scale)
    else:
        out, lse = _routes.block_kernel(query, key, value, m, scale)
    return _result(out, lse, None, return_lse)


def topk_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    k: int | None = None,
    *,
    block_size: int | None = None,
    causal: bool = False,
    scale: float | None = None,
    index_query: torch.Tensor | None = None,
    index_key: torch.Tensor | None = None,
    index_weights: torch.Tensor | None = None,
    indices: torch.Tensor | None = None,
    return_indices: bool = False,
    return_lse: bool = False,
    key_lengths: torch.Tensor | None = None,
    sinks: int = 0,
):
    """Attention of each query over the k keys (or k key blocks) chosen for it at run time.

    Token mode (``block_size=None``): each query attends to exactly its k selected keys, the
    softmax running over that set only. Selection, per query head, takes the k largest
    ``q . k_j`` among the visible keys (ties: the lower index wins). With a lightning indexer
    (``index_query`` (B, Lq, HI, DI), ``index_key`` (B, Lk, DI), ``index_weights`` (B, Lq, HI),
    DeepSeek V3.2) the score is ``sum_j w[t, j] * relu(q_I[t, j] . k_I[s])`` and one index set per
    token serves every head. Block mode (``block_size`` 64 or 128): per query block and head, the
    k key blocks with the largest score run through the block-sparse kernel; a block's score is
    the mean over the query block of an upper bound of ``q . k`` over the key block (Quest's,
    ``relu(q) . max_k + min(q, 0) . min_k``), so one strong key is not averaged away. Under
    causal the diagonal key block(s) and the first key block (attention sinks) are always kept
    and count towards k.

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
    indices : Tensor, optional
        A selection made elsewhere (NSA, MoBA, Quest, cuDNN's sparse attention): int32
        (B, G, Lq, k) with G in {1, Hkv, H} (shared by all heads, per K/V head, per query head),
        -1 padded, of keys (``block_size=None``) or of key blocks of ``block_size`` tokens (64 or
        128), per query token. Each query attends to the listed keys (a listed block: all of its
        keys), under ``causal`` only the visible ones; a key or block listed more than once
        counts once, and an entry outside the keys (or key blocks) counts as -1 (not read on the
        host, so no error for it). ``k`` is then optional (the selection's last dimension). No
        selection runs; the attention takes the route the cost model picks (gathered rows or the
        masked block kernel, ``sparse_attn.explain`` says which); gradients flow to query, key and
        value as for a selection made here. Not combined with ``sinks`` (list the sink keys).
    return_indices : bool
        Also return the selection, int32, ascending, -1 where fewer than k are visible:
        (B, H, Lq, k) per head, (B, 1, Lq, k) from the indexer, (B, H, nQb, k') key blocks in block
        mode (k' = max(k, the blocks always kept under causal)).
    return_lse : bool
        Also return the log-sum-exp, fp32 (B, H, Lq).
    key_lengths : Tensor, optional
        (B,) integers: key j of batch element b is hidden iff ``j >= key_lengths[b]`` (as in
        :func:`flash_attention`), before selection: the k best among the keys left. Token and
        indexer modes read the lengths on the host and run each batch element on its first
        ``key_lengths[b]`` keys (under causal, the rows whose causal bound ends inside them as
        causal, the later rows over all of them); the selection returned is then padded with -1
        to ``min(k, Lk)``. With ``indices`` the listed keys past a length are dropped (no host
        read). Block mode does not take it.
    sinks : int
        Token and indexer modes: the first ``sinks`` keys are always selected (StreamingLLM's
        attention sinks; under causal, for the queries that see them) and count towards k; the
        other k - sinks come from the rest of the keys. (Block mode keeps the first key block
        under causal already.)

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
    scale = _args.scale(scale)
    if block_size is not None and (isinstance(block_size, bool) or not isinstance(block_size, int)):
        raise TypeError(f"block_size must be an int (64 or 128), got {type(block_size).__name__}")
    if indices is not None:
        if any(t is not None for t in (index_query, index_key, index_weights)):
            raise ValueError("indices is a selection made elsewhere: it cannot be combined with the indexer inputs")
        if sinks:
            raise ValueError(f"sinks={sinks!r} cannot be combined with indices: list the sink keys in the selection")
        _args.check_inputs(query, key, value)
        entries = _routes.user_selection(query, key, indices, k, block_size)
        per_entry = block_size or 1
        tokens = indices.shape[3] * per_entry
        if key_lengths is None:  # (with key lengths: the gather, which drops the listed keys past them)
            route = _plan.measured_selection_route(query, key, value, entries, tokens, bool(causal), per_entry)
        if key_lengths is None and route.kind == "masked_block":
            out, lse = _routes.selection_blocks(query, key, value, entries, scale, bool(causal), entry_block=per_entry)
            return _result(out, lse, indices, return_lse, return_indices)
        token_indices = _routes.selection_tokens(query, key, entries, block_size, bool(causal))
        if key_lengths is not None:  # listed keys past a sequence's length dropped
            lens = _args.key_lengths_on(key_lengths, query, key)
            token_indices = torch.where(token_indices < lens[:, None, None, None], token_indices, -1)
        out, lse = _meta.forward(_ops.gather_fwd.default, query, key, value, token_indices, scale)
        return _result(out, lse, indices, return_lse, return_indices)
    if isinstance(k, bool) or not isinstance(k, int):
        raise TypeError(f"k must be an int, got {type(k).__name__}")
    if k <= 0:
        raise ValueError(f"k must be positive, got {k}")
    # The composite paths (sinks, per-sequence key lengths) call back into this function.
    composite = dict(
        causal=bool(causal),
        scale=scale,
        indexer=(index_query, index_key, index_weights),
        key_lengths=key_lengths,
        return_lse=return_lse,
        return_indices=return_indices,
    )
    if sinks:
        return _topk_with_sinks(query, key, value, k, sinks, block_size=block_size, **composite)
    if key_lengths is not None:
        if block_size is not None:
            raise NotImplementedError("topk_attention's block mode does not take key_lengths")
        return _topk_per_sequence(query, key, value, k, **composite)
    given = [t is not None for t in (index_query, index_key, index_weights)]
    if any(given) and not all(given):
        raise ValueError("index_query, index_key and index_weights must be given together")
    if all(given) and isinstance(query, torch.Tensor):
        for name, t in (("index_query", index_query), ("index_key", index_key), ("index_weights", index_weights)):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
            if t.device != query.device:
                raise ValueError(f"{name} must be on query's device ({query.device}), got {t.device}")
    if block_size is not None:
        if any(given):
            raise ValueError("the lightning indexer selects tokens: it cannot be combined with block_size")
        if block_size not in (64, 128):
            raise ValueError(f"block_size must be 64 or 128, got {block_size}")
    route = _plan.topk_route(block_size, all(given))
    if route.kind == "block_topk":
        _args.check_inputs(query, key, value)
        mask, indices = _routes.block_topk_mask(query, key, k, block_size, bool(causal))
        out, lse = _routes.block_kernel(query, key, value, mask, scale)
        return _result(out, lse, indices, return_lse, return_indices)
    if route.kind == "indexer_topk":
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
    out, lse = _attend_selection(query, key, value, indices, scale, k, bool(causal))
    return _result(out, lse, indices, return_lse, return_indices)


def _attend_selection(query, key, value, indices, scale, k, causal):
    """Attention over a selection of topk_attention's own (distinct keys per row): gathered rows or
    the masked block kernel, as _plan.measured_selection_route decides."""
    route = _plan.measured_selection_route(query, key, value, indices, k, causal)
    if route.kind == "masked_block":
        return _routes.selection_blocks(query, key, value, indices, scale, causal)
    return _meta.forward(_ops.gather_fwd.default, query, key, value, indices, scale)


def _topk_with_sinks(
    query, key, value, k, sinks, *, causal, scale, block_size, indexer, key_lengths, return_lse, return_indices
):
    """topk_attention with sinks: keys [0, n) always, the best k - n of keys [n, Lk) (selected on
    key[..., n:, :], which keeps the bottom-right alignment), one gathered attention over both."""
    if isinstance(sinks, bool) or not isinstance(sinks, int) or sinks < 0:
        raise ValueError(f"sinks must be a non-negative int, got {sinks!r}")
    if block_size is not None:
        raise NotImplementedError(
            "topk_attention's block mode keeps the first key block under causal; it takes no sinks"
        )
    _args.check_inputs(query, key, value)
    lq, lk = query.shape[-2], key.shape[-2]
    n = min(sinks, k, lk)
    iq, ik, iw = indexer
    groups = 1 if iq is not None else query.shape[1]
    j = torch.arange(n, device=query.device, dtype=torch.int32)
    sink_idx = j.expand(query.shape[0], groups, lq, n)
    if causal:  # query i sees key j iff j <= i + Lk - Lq
        i = torch.arange(lq, device=query.device)[:, None] + (lk - lq)
        sink_idx = torch.where(j <= i, sink_idx, -1)
    lens = None if key_lengths is None else _args.key_lengths_on(key_lengths, query, key)
    parts = [sink_idx]
    if k > n and lk > n:
        extra = {}
        if iq is not None:
            extra = dict(index_query=iq, index_key=ik[:, n:], index_weights=iw)
        _, rest = topk_attention(
            query,
            key[..., n:, :],
            value[..., n:, :],
            k - n,
            causal=causal,
            scale=scale,
            key_lengths=None if lens is None else (lens - n).clamp(min=0),
            return_indices=True,
            **extra,
        )
        parts.append(torch.where(rest >= 0, rest + n, -1).to(torch.int32))
    indices = torch.cat(parts, -1).contiguous()
    token_indices = indices
    if lens is not None:
        token_indices = torch.where(indices < lens[:, None, None, None], indices, -1)
    out, lse = _attend_selection(query, key, value, token_indices, scale, k, causal)
    return _result(out, lse, token_indices, return_lse, return_indices)


def _topk_per_sequence(query, key, value, k, *, causal, scale, key_lengths, indexer, return_lse, return_indices):
    """topk_attention with key_lengths, token and indexer modes: batch element b over its first
    L = key_lengths[b] keys. Under causal, rows i with i + (Lk - Lq) < L see only keys below L
    anyway: they run causal on the first L keys with the rows [0, L - (Lk - Lq)) (which keeps the
    alignment); the later rows see all L keys (non-causal on them)."""
    lens = _args.key_lengths_on(key_lengths, query, key).tolist()
    b_, h, lq, dv = query.shape[0], query.shape[1], query.shape[2], value.shape[-1]
    lk = key.shape[-2]
    iq, ik, iw = indexer
    out = query.new_zeros(b_, lq, h, dv).transpose(1, 2)
    lse = torch.full((b_, h, lq), float("-inf"), dtype=torch.float32, device=query.device)
    kmax = min(k, lk)
    idx = torch.full((b_, 1 if iq is not None else h, lq, kmax), -1, dtype=torch.int32, device=query.device)
    for b, length in enumerate(lens):
        if length == 0:
            continue
        split = max(0, min(lq, length - (lk - lq))) if causal else 0
        for r0, r1, is_causal in ((0, split, True), (split, lq, False)):
            if r1 <= r0:
                continue
            extra = {}
            if iq is not None:
                extra = dict(
                    index_query=iq[b : b + 1, r0:r1],
                    index_key=ik[b : b + 1, :length],
                    index_weights=iw[b : b + 1, r0:r1],
                )
            o, l_, i_ = topk_attention(
                query[b : b + 1, :, r0:r1],
                key[b : b + 1, :, :length],
                value[b : b + 1, :, :length],
                k,
                causal=is_causal,
                scale=scale,
                return_lse=True,
                return_indices=True,
                **extra,
            )
            out[b, :, r0:r1] = o[0]
            lse[b, :, r0:r1] = l_[0]
            idx[b, :, r0:r1, : i_.shape[-1]] = i_[0]
    return _result(out, lse, idx, return_lse, return_indices)


def attention_with_kvcache(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    cache_seqlens: torch.Tensor,
    *,
    key: torch.Tensor | None = None,
    value: torch.Tensor | None = None,
    block_table: torch.Tensor | None = None,
    causal: bool = True,
    window: int | tuple[int | None, int | None] | None = None,
    mask=None,
    scale: float | None = None,
    return_lse: bool = False,
    validate: bool | None = None,
):
    """Attention of a few new tokens over a KV cache (decode and chunked prefill), FlashAttention's
    ``flash_attn_with_kvcache`` contract.

    On CUDA (bf16/fp16, Dv == D) one split-KV kernel reads the cache once at memory speed, with
    the query heads of a K/V head sharing every load; the split count comes from the shapes and the
    lengths are read on the device, so a call never waits for the host and replays in a CUDA graph
    with new ``cache_seqlens`` and ``block_table``. Other inputs take a composite path (the cache
    gathered per sequence, then ``dense_attention``'s kernel with the same element mask).

    Parameters
    ----------
    query : Tensor (B, H, Lq, D)
        The new tokens' queries (Lq = 1 for one decode step).
    key_cache, value_cache : Tensor
        Contiguous (B, Hkv, Lmax, D) / (B, Hkv, Lmax, Dv), or with ``block_table`` paged
        (num_pages, page_size, Hkv, D) / (..., Dv). Written in place when ``key``/``value`` are given.
    cache_seqlens : Tensor (B,), int32
        Tokens already in each sequence's cache.
    key, value : Tensor (B, Hkv, Lq, D) / (B, Hkv, Lq, Dv), optional
        New keys and values, written at positions ``cache_seqlens[b] + i`` before attending. The
        caller advances ``cache_seqlens`` afterwards.
    block_table : Tensor (B, max_pages), int32, optional
        Page of each sequence's ``p``-th block of ``page_size`` tokens (any page size >= 1).
    causal : bool
        Bottom-right aligned over cache + new tokens: query i sees key j iff
        ``j <= i + Lk_b - Lq`` with ``Lk_b = cache_seqlens[b] (+ Lq when key is given)``.
    window : int or (left, right), optional
        ``flash_attention``'s window, relative to the same alignment.
    mask : BlockSparseMask, optional
        Sparse decode: the cache blocks to read, per sequence and K/V head (``(B|1, Hkv|1)``, one
        query block, ``seq_lengths = (Lq, capacity)``, whole blocks of 64 or 128 tokens, e.g.
        ``BlockSparseMask.from_block_matrix``), intersected with ``causal`` and ``window``. Only the
        listed blocks are read.
    scale : float, optional
        Softmax scale, default ``1 / sqrt(D)``.
    return_lse : bool
        Also return the LSE, fp32 (B, H, Lq).
    validate : bool, optional
        Check ``cache_seqlens`` and ``block_table`` against the cache (ValueError naming the
        entry). Default: on the CPU and on the composite path; on the CUDA kernel path only when
        True, since it reads them on the host (one synchronisation); never inside torch.compile.
        Unchecked, no path reads or writes outside the cache: lengths are clamped to [0, the
        cache's capacity], new tokens past it or in a page outside it are dropped, and a page
        outside it reads as zeros.

    Returns
    -------
    Tensor (B, H, Lq, Dv), or (out, lse).

    Examples
    --------
    >>> import torch, sparse_attn
    >>> cache_k = torch.zeros(2, 2, 64, 32); cache_v = torch.zeros(2, 2, 64, 32)
    >>> lens = torch.tensor([5, 9], dtype=torch.int32)
    >>> q = torch.randn(2, 4, 1, 32); k = v = torch.randn(2, 2, 1, 32)
    >>> sparse_attn.attention_with_kvcache(q, cache_k, cache_v, lens, key=k, value=v).shape
    torch.Size([2, 4, 1, 32])
    """
    left, right = _args.window_bounds(window)
    if causal:
        right = 0
    scale = _args.scale(scale)
    cap = _kvcache.capacity(key_cache, block_table)
    cnt, idx, kv_block = _kvcache.mask_tensors(mask, query, key_cache, block_table, cap)
    args = (query, key_cache, value_cache, cache_seqlens, key, value, block_table, cnt, idx, kv_block)
    if torch.compiler.is_compiling():  # an op returning an int cannot be traced
        kernel = _kvcache.traced_route(query, key_cache, value_cache, block_table, kv_block)
    else:
        kernel = _ops._kvcache_route.default(*args) == 1  # checks every shape, dtype and device
    if (validate or (validate is None and not kernel)) and not torch.compiler.is_compiling():
        _kvcache.validate(query, key_cache, cache_seqlens, key, block_table)
    if kernel:
        out, lse = _ops.kvcache_fwd.default(*args, scale, left, right)
    else:
        out, lse = _kvcache.composite(*args, scale, left, right)
    return _result(out, lse, None, return_lse)


def kvcache_topk_mask(
    index_query: torch.Tensor,
    index_weights: torch.Tensor,
    index_key_cache: torch.Tensor,
    cache_seqlens: torch.Tensor,
    k: int,
    *,
    block_size: int = 128,
    sinks: int = 1,
    recent: int = 1,
):
    """Top-k decode: the mask of the k cache blocks a lightning indexer scores highest, for
    ``attention_with_kvcache(..., mask=...)``, which then reads only those blocks.

    A token's score is DeepSeek V3.2's ``sum_j w[j] * relu(q_I[j] . k_I[t])`` (the max over the new
    tokens), a block's the max over its tokens; the first ``sinks`` blocks (attention sinks) and
    the ``recent`` blocks holding the newest tokens are always kept and count towards k. Built
    with device ops only (no host synchronisation; capturable in a CUDA graph).

    Parameters
    ----------
    index_query : Tensor (B, Lq, HI, DI)
        The new tokens' indexer queries.
    index_weights : Tensor (B, Lq, HI)
    index_key_cache : Tensor (B, Lmax, DI)
        The indexer's keys of the cached tokens (Lmax = the KV cache's capacity), kept by the
        caller next to the KV cache, the new tokens' keys included.
    cache_seqlens : Tensor (B,), int32
        Tokens that count, the new ones included (the KV cache's lengths after the append).
    k : int
        Blocks per sequence.
    block_size : int
        64 or 128 tokens per block.

    Returns
    -------
    BlockSparseMask of seq_lengths (Lq, Lmax), one selection per sequence shared by its heads.

    Examples
    --------
    >>> import torch, sparse_attn
    >>> iq = torch.randn(2, 1, 4, 64); iw = torch.rand(2, 1, 4); ik = torch.randn(2, 1024, 64)
    >>> lens = torch.tensor([700, 1024], dtype=torch.int32)
    >>> mask = sparse_attn.kvcache_topk_mask(iq, iw, ik, lens, 3)
    >>> mask.kv_num_blocks.flatten().tolist()
    [3, 3]
    """
    return _kvcache.topk_mask(
        index_query,
        index_weights,
        index_key_cache,
        cache_seqlens,
        k,
        block_size=block_size,
        sinks=sinks,
        recent=recent,
    )


def flash_attention_varlen(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    *,
    causal: bool = False,
    window: int | tuple[int | None, int | None] | None = None,
    scale: float | None = None,
    return_lse: bool = False,
):
    """``flash_attention`` over a packed batch of sequences of different lengths (FlashAttention's
    ``flash_attn_varlen_func``).

    ``query`` (total_q, H, D), ``key`` (total_k, Hkv, D), ``value`` (total_k, Hkv, Dv): sequence b
    is rows ``cu_seqlens[b]:cu_seqlens[b + 1]``; ``cu_seqlens_q``/``cu_seqlens_k`` are int32
    (B + 1,) and ``max_seqlen_q``/``max_seqlen_k`` bound the lengths. Each sequence runs the op's
    own kernel on views of the packed tensors (no padding, no copy of the inputs), consecutive
    sequences of equal lengths as one batched call; on CUDA in 16-bit, where no gradient is
    tracked, the kernels write straight into the packed output. On CUDA, a batch of many short
    sequences, or of several runs when a gradient is needed, runs instead as one block-sparse
    call (forward and backward) over the packed tensors with the sequences' document mask
    (``sparse_attn.explain`` names the route). ``causal`` and ``window`` align
    per sequence (bottom-right). The lengths are read once on the host: one
    synchronisation when ``cu_seqlens`` live on the GPU (pass CPU tensors to avoid it), and the
    call cannot be captured in a CUDA graph. Differentiable like ``flash_attention``.

    Returns (total_q, H, Dv), or (out, lse) with lse (H, total_q) fp32.

    Examples
    --------
    >>> import torch, sparse_attn
    >>> q = torch.randn(10, 4, 64); kv = torch.randn(10, 2, 64)
    >>> cu = torch.tensor([0, 3, 10], dtype=torch.int32)
    >>> sparse_attn.flash_attention_varlen(q, kv, kv, cu, cu, 7, 7, causal=True).shape
    torch.Size([10, 4, 64])
    """
    bounds = _varlen.check(query, key, value, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    left, right = _args.window_bounds(window)
    if _varlen.document_route(query, key, value, bounds):
        out, lse = _varlen.run_documents(query, key, value, bounds, scale, bool(causal), left, right)
        return _result(out, lse, None, return_lse)
    if _varlen.packed_flash(query, key, value):
        out, lse = _varlen.run_flash_into(query, key, value, bounds, _args.scale(scale), bool(causal), left, right)
        return _result(out, lse, None, return_lse)
    out, lse = _varlen.run(
        lambda q, k, v: flash_attention(q, k, v, causal=causal, window=window, scale=scale, return_lse=True),
        query,
        key,
        value,
        bounds,
        batched=True,
    )
    return _result(out, lse, None, return_lse)


def block_sparse_attention_varlen(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    masks,
    *,
    causal: bool = False,
    scale: float | None = None,
    return_lse: bool = False,
):
    """``block_sparse_attention`` over a packed batch, one mask per sequence: ``masks`` is a list
    (a mask, pattern or bool block matrix per sequence, as ``block_sparse_attention`` takes) or a
    callable ``(Lq, Lk) -> mask`` (e.g. ``lambda lq, lk: patterns.sliding_window(lq, 256)``).
    Packed layout, ``cu_seqlens``, the host read of the lengths and the outputs as in
    :func:`flash_attention_varlen`.
    """
    bounds = _varlen.check(query, key, value, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    if not callable(masks) and not isinstance(masks, (list, tuple)):
        raise TypeError(
            f"masks must be a list of masks (one per sequence) or a callable (Lq, Lk) -> mask, got {masks!r}"
        )
    if not callable(masks) and len(masks) != len(bounds):
        raise ValueError(f"masks must have one mask per sequence ({len(bounds)}), got {len(masks)}")
    per_seq = iter(
        [masks(q1 - q0, k1 - k0) for q0, q1, k0, k1 in bounds if q1 > q0]
        if callable(masks)
        else [m for m, (q0, q1, _, _) in zip(masks, bounds, strict=True) if q1 > q0]
    )
    out, lse = _varlen.run(
        lambda q, k, v: block_sparse_attention(q, k, v, next(per_seq), causal=causal, scale=scale, return_lse=True),
        query,
        key,
        value,
        bounds,
    )
    return _result(out, lse, None, return_lse)


def topk_attention_varlen(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    k: int,
    *,
    block_size: int | None = None,
    causal: bool = False,
    scale: float | None = None,
    return_lse: bool = False,
):
    """``topk_attention`` (exact per-head selection, token or block mode) over a packed batch: each
    sequence selects among its own keys. Packed layout, ``cu_seqlens``, the host read of the
    lengths and the outputs as in :func:`flash_attention_varlen`.
    """
    bounds = _varlen.check(query, key, value, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    out, lse = _varlen.run(
        lambda q, kk, v: topk_attention(
            q, kk, v, k, block_size=block_size, causal=causal, scale=scale, return_lse=True
        ),
        query,
        key,
        value,
        bounds,
    )
    return _result(out, lse, None, return_lse)
