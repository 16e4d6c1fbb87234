"""The routes the plan chooses (``_plan.py``), as calls of the registered kernels. A route decides
nothing: which one runs, and why, is ``_plan``'s answer; how each launch runs is the C++ plan's
(csrc/plan/plan.cpp)."""

from __future__ import annotations

import math

import torch

from . import _meta
from .masks import _FULL, _NONE, BlockSparseMask, cta_schedule
from .patterns import causal as _causal_pattern

_ops = torch.ops.sparse_attn


def flash(query, key, value, scale, causal: bool = False, left: int = -1, right: int = -1):
    return _meta.forward(_ops.flash_fwd.default, query, key, value, scale, causal, left, right)


def dilated_half_window(window: int, dilation: int) -> int:
    """The window, in positions of one residue class, of ``patterns.dilated(L, window, dilation)``."""
    return -(-window // dilation) - 1


def dilated(query, key, value, window: int, dilation: int, scale):
    """patterns.dilated's mask (|i - j| < window, i = j mod dilation; Lq = Lk) as one sliding window
    per residue class c: queries and keys c, c + dilation, ... (strided views, read in place) with
    |a - b| <= ceil(window / dilation) - 1 between their positions a, b in the class. Every pair
    computed is visible, where the block mask's partial blocks compute `dilation` times as many."""
    half = dilated_half_window(window, dilation)
    b, h, lq = query.shape[:3]
    out = torch.empty(b, lq, h, value.shape[-1], dtype=query.dtype, device=query.device).transpose(1, 2)
    lse = torch.empty(b, h, lq, dtype=torch.float32, device=query.device)
    for c in range(min(dilation, lq)):
        o_c, lse_c = flash(
            query[:, :, c::dilation], key[:, :, c::dilation], value[:, :, c::dilation], scale, False, half, half
        )
        out[:, :, c::dilation] = o_c
        lse[:, :, c::dilation] = lse_c
    return out, lse


def dilated_2d_positions(x: torch.Tensor, segment: int, dilation: int) -> torch.Tensor:
    """(B, H, L, ...) -> (B, H, whole segments, ceil(segment / dilation), ...): the attending
    positions of patterns.dilated_2d's whole segments, a view."""
    whole = x.shape[2] // segment
    return x[:, :, : whole * segment].unflatten(2, (whole, segment))[:, :, :, ::dilation]


def dilated_2d_batch(x: torch.Tensor, segment: int, dilation: int, data: bool = True) -> torch.Tensor:
    """The whole segments' attending positions as one batch, (B * whole, H, ceil(segment / dilation),
    ...): a copy (data=False: an uninitialised tensor of the copy's layout, for planning)."""
    view = dilated_2d_positions(x, segment, dilation).transpose(1, 2)
    if data:
        return view.flatten(0, 1)
    return torch.empty((view.shape[0] * view.shape[1], *view.shape[2:]), dtype=x.dtype, device=x.device)


def dilated_2d(query, key, value, segment: int, dilation: int, scale):
    """patterns.dilated_2d's mask (i, j in one segment, both at positions that are multiples of
    dilation within it; Lq = Lk) as dense attention per segment over those positions. The whole
    segments are gathered into one batch (segments x batch, a copy of 1 / dilation of Q, K and V:
    one launch that fills the GPU), the ragged last segment runs on strided views; rows at other
    positions see no key (0, LSE -inf)."""
    b, h, lq = query.shape[:3]
    out = torch.zeros(b, lq, h, value.shape[-1], dtype=query.dtype, device=query.device).transpose(1, 2)
    lse = torch.full((b, h, lq), -math.inf, dtype=torch.float32, device=query.device)
    whole = lq // segment
    if whole > 0:
        q, k, v = (dilated_2d_batch(x, segment, dilation) for x in (query, key, value))
        o, l_ = flash(q, k, v, scale)
        dilated_2d_positions(out, segment, dilation).copy_(o.unflatten(0, (b, whole)).transpose(1, 2))
        dilated_2d_positions(lse, segment, dilation).copy_(l_.unflatten(0, (b, whole)).transpose(1, 2))
    if whole * segment < lq:
        tail = slice(whole * segment, lq, dilation)
        o, l_ = flash(query[:, :, tail], key[:, :, tail], value[:, :, tail], scale)
        out[:, :, tail] = o
        lse[:, :, tail] = l_
    return out, lse


def schedule(m: BlockSparseMask) -> torch.Tensor:
    """The mask's CTA schedule (masks.cta_schedule), made on the mask's device on first use and
    kept on it: a few small kernels, a noticeable share of a short sparse attention if paid on
    every call. (Pattern builders attach it from their host plans.)"""
    if m._order is not None:
        return m._order
    order = cta_schedule(m.kv_num_blocks.amax(dim=(0, 1)))
    if not torch.compiler.is_compiling():
        m._order = order
    return order


def _mask_args(m: BlockSparseMask) -> tuple:
    """The block kernels' mask arguments, in their schema's order."""
    return m.kv_num_blocks, m.kv_indices, m.kv_partial, m.partial_masks, m.q_block, m.kv_block


def block_kernel(query, key, value, m: BlockSparseMask, scale):
    return _meta.forward(_ops.block_sparse_fwd.default, query, key, value, *_mask_args(m), scale, schedule(m))


def block_kernel_backward(grad_out, query, key, value, out, lse, grad_lse, m: BlockSparseMask, scale):
    """(dq, dk, dv) of the pairs of m, given the rows' out and lse (those of a softmax over more keys
    than m holds, when the forward was split over key sets: each part's backward is then exact)."""
    return _ops.block_sparse_bwd.default(grad_out, query, key, value, out, lse, grad_lse, *_mask_args(m), scale)


def block_topk_mask(query, key, k: int, block_size: int, causal: bool):
    """Top-k key blocks per (batch, head, query block), as a mask.

    A key block's score is the mean over the query block's rows of an upper bound of q . k over
    the key block (Quest's): sum_d max(q_d * max_k_d, q_d * min_k_d) = relu(q) . max_k + min(q, 0)
    . min_k, so one strong key is not averaged away as by mean pooling; linear in relu(q) and
    min(q, 0), it is two matmuls of pooled rows. Under causal the diagonal key block(s), the one
    before them (the local band) and the first key block (attention sinks: the first tokens take
    much of the attention) are always kept and count towards k.

    Returns the mask and the chosen blocks (B, H, nQb, k'), int32, ascending, -1 padded (k' is
    max(k, the blocks always kept), at most nKb). No host synchronisation: the mask's width is
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

    def blocks(x, n, fill):  # (B, H', n, block_size, D), the ragged tail padded with fill
        pad = n * block_size - x.shape[2]
        return torch.nn.functional.pad(x.float(), (0, 0, 0, pad), value=fill).view(
            x.shape[0], x.shape[1], n, block_size, -1
        )

    rows = (lq - torch.arange(nq, device=query.device) * block_size).clamp(max=block_size)[:, None].float()
    q_pos = blocks(query.clamp(min=0), nq, 0.0).sum(3) / rows  # mean of relu(q) per query block
    q_neg = blocks(query.clamp(max=0), nq, 0.0).sum(3) / rows  # mean of min(q, 0)
    k_max = blocks(key, nk, float("-inf")).amax(3).repeat_interleave(h // hkv, dim=1)
    k_min = blocks(key, nk, float("inf")).amin(3).repeat_interleave(h // hkv, dim=1)
    scores = q_pos @ k_max.transpose(-1, -2) + q_neg @ k_min.transpose(-1, -2)  # (B, H, nQb, nKb)
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
        sink = (kb == 0) & (last_diag >= 0)[:, None]
        # The local band: the key block before the first diagonal one, so that every query sees at
        # least its block_size most recent keys.
        band = (kb == first_diag.clamp(min=0)[:, None] // block_size - 1) & (last_diag >= 0)[:, None]
        scores = torch.where(diag | sink | band, float("inf"), scores)
        kk = min(max(k, (1 if off % block_size == 0 else 2) + 2), nk)
    top = scores.topk(kk, dim=-1)
    chosen = top.indices.to(torch.int32)
    if causal:
        chosen = torch.where(top.values > neg, chosen, -1)
    chosen = torch.where(chosen < 0, nk, chosen).sort(-1).values
    chosen = torch.where(chosen == nk, -1, chosen).to(torch.int32)
    table = torch.full((b, h, nq, nk + 1), _NONE, dtype=torch.int32, device=query.device)
    # (the value as an int32 tensor: torch 2.11's inductor folded a scalar-valued scatter into a
    # constant to int64 when the selection was constant, one key block)
    col = torch.where(chosen < 0, nk, chosen).long()
    table.scatter_(-1, col, torch.full(col.shape, _FULL, dtype=torch.int32, device=query.device))
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


def user_selection(query, key, indices, k, block_size) -> torch.Tensor:
    """A user's selection (B, G, Lq, k) of keys or key blocks, checked (layout only: no value is
    read on the host), in the op's form: each row's distinct entries ascending, then -1s (a key or
    block listed more than once counts once; a negative entry is none)."""
    b, h, lq = query.shape[0], query.shape[1], query.shape[2]
    hkv = key.shape[1]
    if not isinstance(indices, torch.Tensor) or indices.dtype != torch.int32 or indices.dim() != 4:
        raise ValueError(
            f"indices must be an int32 tensor (B, G, Lq, k), got {getattr(indices, 'dtype', type(indices).__name__)}"
            f" {tuple(getattr(indices, 'shape', ()))}"
        )
    if indices.device != query.device:
        raise ValueError(f"indices must be on query's device ({query.device}), got {indices.device}")
    g = indices.shape[1]
    if indices.shape[0] != b or indices.shape[2] != lq or g not in (1, hkv, h):
        raise ValueError(
            f"indices must have shape (B={b}, G, Lq={lq}, k) with G in (1, Hkv={hkv}, H={h}), "
            f"got {tuple(indices.shape)}"
        )
    if k is not None and k != indices.shape[3]:
        raise ValueError(
            f"k ({k}) must equal the selection's last dimension ({indices.shape[3]}) when indices are given"
        )
    if block_size not in (None, 64, 128):
        raise ValueError(f"block_size must be None (tokens), 64 or 128, got {block_size}")
    if indices.device.type != "cuda" or indices.shape[-1] <= CANONICAL_SELECTION_MAX_K:
        return _ops._canonical_selection.default(indices)  # rows already in the form copied
    return drop_repeats(indices)


# The longest rows _canonical_selection takes on CUDA (kCanonicalSelectionMaxK,
# csrc/include/sparse_attn/cuda/topk.h); the CPU's take any length.
CANONICAL_SELECTION_MAX_K = 4096


def drop_repeats(indices: torch.Tensor) -> torch.Tensor:
    """Each row of a selection in topk_attention's form: its distinct non-negative entries
    ascending, then -1s (the reference of ``_canonical_selection``, and what CUDA rows of more than
    4096 entries take; an entry of 2^31 - 1 counts as none here). Two sorts of every row: on an
    H100 the first alone took 3.9 ms for 64k rows of 2048 entries, the kernel 0.9 ms for all of it."""
    top = torch.iinfo(torch.int32).max
    rows = torch.where(indices >= 0, indices, top).sort(-1).values
    repeat = torch.zeros_like(rows, dtype=torch.bool)
    repeat[..., 1:] = rows[..., 1:] == rows[..., :-1]
    rows = torch.where(repeat, top, rows).sort(-1).values
    return torch.where(rows == top, -1, rows).contiguous()


def selection_tokens(query, key, entries, block_size, causal: bool) -> torch.Tensor:
    """user_selection's entries as the gather kernel's token indices (B, G, Lq, k or k *
    block_size), -1 for a listed key hidden by ``causal`` (bottom-right) or past Lk."""
    lq, lk = query.shape[2], key.shape[2]
    tok = entries
    if block_size is not None:  # each listed block: its block_size keys
        offs = torch.arange(block_size, dtype=torch.int32, device=entries.device)
        listed = (entries >= 0) & (entries < -(-lk // block_size))  # a block past the keys drops (no int32 wrap)
        tok = torch.where(listed[..., None], entries[..., None] * block_size + offs, -1).flatten(-2)
    if causal:
        limit = torch.arange(lq, device=entries.device, dtype=torch.int32) + (lk - lq)  # last visible key per row
        tok = torch.where(tok <= limit[:, None], tok, -1)
    return torch.where((tok >= 0) & (tok < lk), tok, -1).to(torch.int32).contiguous()


# Partial-mask bytes one masked-block call holds at most; a longer selection runs in query chunks
# (selection_chunks), each a launch with its own tail: 512 MiB against 256 took 16k, 16 sets of
# 2048 keys, from 5.13 to 4.42 ms (one launch instead of two) and 64k from 35.98 / 40.34 to
# 34.40 / 38.95 ms (1 / 4 sets; H100, docs/PERF_LOG.md).
SELECTION_MASK_BYTES = 512 << 20


def selection_mask_size(lq: int, lk: int, q_block: int, kv_block: int, causal: bool, row_offset: int):
    """(partial rows per (batch, group), longest list) of ``_selection_mask`` for a selection of lq
    rows: every key block per query block, or under causal those up to its last row's last
    visible key (selection_block_cap in csrc/include/sparse_attn/selection_mask.h)."""
    nqb, nkb = -(-lq // q_block), -(-lk // kv_block)
    if not causal:
        return nqb * nkb, nkb if nqb else 0
    caps = [_block_cap(qb, lq, lk, q_block, kv_block, causal, row_offset) for qb in range(nqb)]
    return sum(caps), max(caps, default=0)


def _block_cap(qb: int, lq: int, lk: int, q_block: int, kv_block: int, causal: bool, row_offset: int) -> int:
    """Key blocks query block qb may list: all, or under causal those up to its last row's last
    visible key."""
    nkb = -(-lk // kv_block)
    if not causal:
        return nkb
    last_key = min((qb + 1) * q_block, lq) - 1 + row_offset
    return 0 if last_key < 0 else min(nkb, last_key // kv_block + 1)


def selection_chunks(bg: int, lq: int, lk: int, q_block: int, kv_block: int, causal: bool) -> list[tuple[int, int]]:
    """The query chunks [r0, r1) of a masked-block call, whole query blocks each: as few as keep
    the partial rows they may list (bg = batch x groups of them per query block, q_block x
    kv_block bits each; under causal only the key blocks a query block sees) within
    SELECTION_MASK_BYTES, of near-equal size (each chunk is one launch, with its own tail). A
    query block whose rows alone exceed the budget is a chunk of its own."""
    row_bytes = bg * q_block * kv_block // 8
    needs = [_block_cap(qi, lq, lk, q_block, kv_block, causal, lk - lq) * row_bytes for qi in range(-(-lq // q_block))]
    total = sum(needs)
    if total <= SELECTION_MASK_BYTES:
        return [(0, lq)] if lq else []
    # Cuts at every total / n of the running sum: a chunk holds less than total / n plus one block.
    n = -(-total // max(SELECTION_MASK_BYTES - max(needs), 1))
    chunks, r0, held, cut = [], 0, 0, 1
    for qi, need in enumerate(needs):
        if held * n >= cut * total and qi * q_block > r0:
            chunks.append((r0, qi * q_block))
            r0 = qi * q_block
            while held * n >= cut * total:
                cut += 1
        held += need
    chunks.append((r0, lq))
    return chunks


def selection_blocks(
    query, key, value, indices, scale, causal: bool, block: tuple[int, int] = (128, 128), entry_block: int = 1
):
    """Top-k's masked-block route: a selection (B, G, Lq, k) of keys (``entry_block`` 1) or of key
    blocks of ``entry_block`` keys (-1 padded, G in {1, Hkv, H}) through the block-sparse kernel.
    Per query block the key blocks its rows select (the union) are listed, each with the exact
    bits of every row's selection (full when every row took the whole block), so each selected key
    row is loaded once per query tile instead of once per query. A key listed twice counts once;
    under ``causal`` each row keeps the keys it sees (bottom-right). Queries run in chunks whose
    bits stay within SELECTION_MASK_BYTES."""
    b, h, lq = query.shape[0], query.shape[1], query.shape[2]
    lk, g = key.shape[2], indices.shape[1]
    qb, kvb = block
    outs, lses = [], []
    for r0, r1 in selection_chunks(b * g, lq, lk, qb, kvb, causal):
        num, kvi, kvp, words = _ops._selection_mask.default(
            indices[:, :, r0:r1], lk, h, qb, kvb, causal, lk - lq + r0, entry_block
        )
        m = BlockSparseMask(num, kvi, kvp, words, seq_lengths=(r1 - r0, lk), block_size=block, validate=False)
        q = query if (r0, r1) == (0, lq) else query[:, :, r0:r1]
        o, l_ = block_kernel(q, key, value, m, scale)
        outs.append(o)
        lses.append(l_)
    if len(outs) == 1:
        return outs[0], lses[0]
    return torch.cat(outs, 2), torch.cat(lses, 2)


def can_synchronize(query) -> bool:
    """Whether a route may read a value on the host: not while tracing or capturing a CUDA graph."""
    if torch.compiler.is_compiling():
        return False
    return not (query.device.type == "cuda" and torch.cuda.is_current_stream_capturing())


def union_sample_blocks(entries_shape, max_entries: int | None, block: int = 128) -> int:
    """Query blocks selection_union measures for a selection of ``entries_shape`` (B, G, Lq, k):
    all of them, or where it holds more than ``max_entries``, as many as hold at most that (>= 1)."""
    b, g, lq, k = entries_shape
    nqb = -(-lq // block)
    if max_entries is None or b * g * lq * k <= max_entries:
        return nqb
    return max(1, min(nqb, max_entries // max(1, b * g * block * k)))


def selection_union(
    entries, lq: int, lk: int, entry_block: int, causal: bool, block: int = 128, max_entries: int | None = None
) -> float:
    """The share of the (query block, key block) pairs a selection (entries of ``entry_block`` keys,
    -1 for none) touches, over the pairs the masked route could list: what the block kernel would
    compute, relative to dense. One pass over the entries (``_selection_union``) and one host read
    (the cost model's input for selections whose union it cannot know from shapes). ``max_entries``:
    a selection holding more is measured on evenly spaced query blocks holding at most that many
    (an estimate, its cost cut in proportion)."""
    b, g, k = entries.shape[0], entries.shape[1], entries.shape[-1]
    if entries.numel() == 0 or lk == 0:
        return 0.0
    nqb = -(-lq // block)
    n = union_sample_blocks((b, g, lq, k), max_entries, block)
    touched = _ops._selection_union.default(entries, lk, block, block, causal, lk - lq, entry_block, n)
    blocks = [(2 * i + 1) * nqb // (2 * n) for i in range(n)]  # the middles of n equal parts (all: n = nqb)
    pairs = sum(_block_cap(qb, lq, lk, block, block, causal, lk - lq) for qb in blocks)
    return touched.item() / max(1, b * g * pairs)
