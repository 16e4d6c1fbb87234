"""Variable-length (packed) batches: checks of the packed layout and ``cu_seqlens``, and the run of
an op once per sequence (flash: once per run of equal-length sequences) on views of the packed
tensors (no copy of the inputs; the outputs concatenated into the packed layout, or, for flash on
CUDA without gradients, written there by the kernels); or, for flash over many sequences, one
block-sparse call over the whole packed batch with the sequences' document mask
(``document_mask``)."""

from __future__ import annotations

import operator
from collections import OrderedDict
from collections.abc import Callable

import numpy as np
import torch

from . import _meta
from .masks import BlockSparseMask, cta_schedule

# flash_attention_varlen's document route (one block-sparse call) takes a batch of two runs of
# equal-length sequences or more whose runs average fewer query tokens than these: without and
# with a gradient to track (each run's backward is then a call of its own, and the per-run
# route's launches cost more). docs/PERF_LOG.md, "varlen in one launch".
DOCUMENT_ROUTE_TOKENS = 1536
DOCUMENT_ROUTE_TOKENS_GRAD = 8192

# The document route's masks of recent calls, by sequences, band, device and stream: a model's
# layers pass the same cu_seqlens, so the first layer builds the mask and the others reuse it.
_DOCUMENT_MASKS: OrderedDict = OrderedDict()
DOCUMENT_MASKS_KEPT = 8


def check(query, key, value, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int, max_seqlen_k: int):
    """The sequences' (q0, q1, k0, k1) bounds, read from ``cu_seqlens`` on the host (one
    synchronisation for CUDA tensors; pass them as CPU tensors to avoid it)."""
    for name, t, layout in (
        ("query", query, "(total_q, H, D)"),
        ("key", key, "(total_k, Hkv, D)"),
        ("value", value, "(total_k, Hkv, Dv)"),
    ):
        if not isinstance(t, torch.Tensor) or t.dim() != 3:
            raise ValueError(f"{name} must be a packed 3-D tensor {layout}, got {getattr(t, 'shape', type(t))}")
    if key.shape[0] != value.shape[0]:
        raise ValueError(f"key and value must have the same total length, got {key.shape[0]} and {value.shape[0]}")
    for name, n in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
        try:
            if isinstance(n, bool):
                raise TypeError
            operator.index(n)  # ints, NumPy's, 0-D integer tensors
        except TypeError:
            raise TypeError(f"{name} must be an int, got {n!r}") from None
    for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        if not isinstance(cu, torch.Tensor) or cu.dtype != torch.int32 or cu.dim() != 1 or cu.numel() < 1:
            raise ValueError(f"{name} must be a 1-D int32 tensor (B + 1,), got {getattr(cu, 'dtype', type(cu))}")
        if cu.device.type != "cpu" and cu.device != query.device:
            raise ValueError(f"{name} must be on the CPU or on query's device ({query.device}), got {cu.device}")
    if cu_seqlens_q.numel() != cu_seqlens_k.numel():
        raise ValueError(
            f"cu_seqlens_q and cu_seqlens_k must describe the same number of sequences, got "
            f"{cu_seqlens_q.numel() - 1} and {cu_seqlens_k.numel() - 1}"
        )
    cq = cu_seqlens_q.tolist()
    ck = cu_seqlens_k.tolist()
    for name, cu, total, max_len in (
        ("cu_seqlens_q", cq, query.shape[0], max_seqlen_q),
        ("cu_seqlens_k", ck, key.shape[0], max_seqlen_k),
    ):
        if cu[0] != 0 or cu[-1] != total:
            raise ValueError(f"{name} must start at 0 and end at the packed length {total}, got {cu[0]} ... {cu[-1]}")
        for b in range(len(cu) - 1):
            n = cu[b + 1] - cu[b]
            if n < 0:
                raise ValueError(f"{name} must be non-decreasing: {name}[{b + 1}] = {cu[b + 1]} < {cu[b]}")
            if n > max_len:
                raise ValueError(f"sequence {b} has {n} tokens in {name}, more than its max_seqlen {max_len}")
    return [(cq[b], cq[b + 1], ck[b], ck[b + 1]) for b in range(len(cq) - 1)]


def _runs(bounds) -> list[tuple[int, int, int, int, int]]:
    """(q0, k0, n, lq, lk): runs of consecutive sequences with the same query and key lengths
    (lq > 0), which one batched call of n serves; each run's rows are one strided block."""
    runs = []
    for q0, q1, k0, k1 in bounds:
        lq, lk = q1 - q0, k1 - k0
        if lq == 0:
            continue
        if (
            runs
            and runs[-1][3:] == (lq, lk)
            and runs[-1][0] + runs[-1][2] * lq == q0
            and runs[-1][1] + runs[-1][2] * lk == k0
        ):
            r = runs[-1]
            runs[-1] = (r[0], r[1], r[2] + 1, lq, lk)
        else:
            runs.append((q0, k0, 1, lq, lk))
    return runs


def _batch(x: torch.Tensor, lo: int, n: int, length: int) -> torch.Tensor:
    """n consecutive sequences of `length` rows from row lo of a packed (total, H, D) tensor as
    (n, H, length, D), in place."""
    return x[lo : lo + n * length].unflatten(0, (n, length)).transpose(1, 2)


def calls(query, key, value, bounds, batched: bool):
    """(q0, n, lq, lk, q, k, v) per call: each sequence's (1, H, L, D) views, or (batched) each run
    of equal-length sequences as one (n, H, L, D) batch."""
    runs = _runs(bounds) if batched else [(q0, k0, 1, q1 - q0, k1 - k0) for q0, q1, k0, k1 in bounds if q1 > q0]
    for q0, k0, n, lq, lk in runs:
        yield q0, n, lq, lk, _batch(query, q0, n, lq), _batch(key, k0, n, lk), _batch(value, k0, n, lk)


def _packed_lse(lses: list[torch.Tensor], h: int, device) -> torch.Tensor:
    """The calls' LSEs, each (n, H, L), as one (H, total_q)."""
    rows = [lse.transpose(0, 1).reshape(h, -1) for lse in lses]
    return torch.cat(rows, dim=1) if rows else torch.zeros(h, 0, dtype=torch.float32, device=device)


def run(fn: Callable, query, key, value, bounds, batched: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """fn(q, k, v) -> (out, lse) on each call's views (``calls``); the results packed as
    (total_q, H, Dv) and (H, total_q)."""
    outs, lses = [], []
    h, dv = query.shape[1], value.shape[2]
    for _, n, lq, _, q, k, v in calls(query, key, value, bounds, batched):
        o, lse = fn(q, k, v)
        outs.append(o.transpose(1, 2).reshape(n * lq, h, dv))
        lses.append(lse)
    out = torch.cat(outs, dim=0) if outs else query.new_zeros(0, h, dv)
    return out, _packed_lse(lses, h, query.device)


def packed_flash(query, key, value, cuda: bool | None = None) -> bool:
    """Whether flash_attention_varlen can write each sequence's result straight into the packed
    output (run_flash_into): eager CUDA calls in 16-bit that need no gradient (``cuda``: whether
    the call runs on a GPU, default the query's device; explain's targets say so)."""
    return (
        (query.is_cuda if cuda is None else cuda)
        and query.dtype in (torch.bfloat16, torch.float16)
        and not torch.compiler.is_compiling()
        and not _meta.tracks_grad(query, key, value)
    )


def run_flash_into(query, key, value, bounds, scale, causal: bool, left: int, right: int):
    """flash_fwd on each run of equal-length sequences (one batched call), its output written in
    place into the packed (total_q, H, Dv) result (the private op sparse_attn::_flash_fwd_out), so
    no sequence's output is copied (run's concatenation: 2-3 % of a prefill); the LSEs (4 bytes
    per row and head) are concatenated as run's."""
    h, dv = query.shape[1], value.shape[2]
    out = query.new_empty(query.shape[0], h, dv)
    lses = []
    with torch._C._AutoDispatchBelowAutograd():
        for q0, n, lq, _, q, k, v in calls(query, key, value, bounds, True):
            lses.append(torch.empty(n, h, lq, dtype=torch.float32, device=query.device))
            torch.ops.sparse_attn._flash_fwd_out.default(
                q, k, v, _batch(out, q0, n, lq), lses[-1], scale, causal, left, right
            )
    return out, _packed_lse(lses, h, query.device)


def document_route(query, key, value, bounds, cuda: bool | None = None) -> bool:
    """Whether flash_attention_varlen runs the batch as one block-sparse call over its document
    mask rather than one flash call per run of equal-length sequences: on a GPU (not while a CUDA
    graph is captured or torch.compile traces: the mask's offsets are copied from the host), for
    two runs or more that are short, where each call's start-up, tail and host work cost more than
    the mask's partial blocks (DOCUMENT_ROUTE_TOKENS, more with a gradient to track)."""
    if not (query.is_cuda if cuda is None else cuda) or torch.compiler.is_compiling():
        return False
    if query.is_cuda and torch.cuda.is_current_stream_capturing():
        return False
    runs = _runs(bounds)
    if len(runs) < 2:
        return False
    per_run = DOCUMENT_ROUTE_TOKENS_GRAD if _meta.tracks_grad(query, key, value) else DOCUMENT_ROUTE_TOKENS
    return query.shape[0] < per_run * len(runs)


def packed_offsets(bounds, total_q: int, total_k: int):
    """The sequences' query and key offsets (cu_seqlens, B + 1 each) as int64 arrays."""
    cq = np.array([b[0] for b in bounds] + [total_q], dtype=np.int64)
    ck = np.array([b[2] for b in bounds] + [total_k], dtype=np.int64)
    return cq, ck


def document_mask_bounds(cq, ck, left: int, right: int, block=(128, 128)):
    """(max_kb, partial_offsets (nQb + 1,) int64, weights (nQb,)) of ``_document_mask`` for the
    sequences of offsets cq, ck (``packed_offsets``), in O(B + nQb): per query block, its key-block
    range from its first row's lowest and last row's highest visible key (both ends are
    non-decreasing in the row, csrc/include/sparse_attn/document_mask.h), and the partial rows it
    may need: the whole range where it spans sequences (or has rows that see nothing), else at most
    the blocks its rows' band edges cross, 2 * ((q_block - 1) // kv_block + 2)."""
    qb_size, kvb = block
    total_q, total_k = int(cq[-1]), int(ck[-1])
    nqb, nkb = -(-total_q // qb_size), -(-total_k // kvb)
    if nqb == 0 or nkb == 0:
        return 0, np.zeros(nqb + 1, dtype=np.int64), np.zeros(nqb, dtype=np.int64)
    r0 = np.arange(nqb, dtype=np.int64) * qb_size
    r1 = np.minimum(r0 + qb_size, total_q) - 1
    d0 = np.searchsorted(cq, r0, side="right") - 1
    d1 = np.searchsorted(cq, r1, side="right") - 1

    def seq(d, r):
        q0, k0 = cq[d], ck[d]
        lq, lk = cq[d + 1] - q0, ck[d + 1] - k0
        return k0, lq, lk, r - q0 + lk - lq  # the row's diagonal key, local

    k0, _, _, pos = seq(d0, r0)
    lo = k0 + (np.maximum(pos - left, 0) if left >= 0 else 0)
    k1, lq1, lk1, pos1 = seq(d1, r1)
    hi = k1 + (np.minimum(lk1 - 1, pos1 + right) if right >= 0 else lk1 - 1)
    hi = np.maximum(hi, k1 - 1)  # rows of earlier sequences end before this one's keys
    first = np.clip(lo, 0, total_k - 1) // kvb
    last = np.clip(hi, 0, total_k - 1) // kvb
    span = np.maximum(last - first + 1, 0)
    single = (d0 == d1) & (lk1 >= lq1) & (lk1 > 0)  # one sequence whose every row sees a key
    partial = np.where(single, np.minimum(span, 2 * ((qb_size - 1) // kvb + 2)), span)
    offsets = np.concatenate([[0], np.cumsum(partial)]).astype(np.int64)
    return int(min(max(span.max(), 1), nkb)), offsets, span


def document_mask(bounds, total_q: int, total_k: int, left: int, right: int, device, block=(128, 128)):
    """The packed sequences' block-sparse mask: row i of sequence b sees the keys of sequence b in
    its band (window (left, right) per sequence, bottom-right aligned; -1 unbounded, causal is
    (-1, 0)), built on ``device`` by ``sparse_attn::_document_mask`` from one host-to-device copy
    of the offsets, the partial-row bounds and the CTA schedule (from pinned memory: the host does
    not wait for the GPU)."""
    cq, ck = packed_offsets(bounds, total_q, total_k)
    max_kb, offsets, weights = document_mask_bounds(cq, ck, left, right, block)
    n = len(bounds)
    order = cta_schedule(weights) if weights.size else np.zeros(1, dtype=np.int32)
    head = np.concatenate([cq, ck, order]).astype(np.int32)
    head = np.concatenate([head, np.zeros(len(head) % 2, dtype=np.int32)])  # offsets 8-byte aligned
    buf = torch.from_numpy(np.concatenate([head, offsets.view(np.int32)]))
    if torch.device(device).type == "cuda":  # staged in pinned memory: the copy does not wait for the GPU
        buf = buf.pin_memory().to(device, non_blocking=True)
    cu_q, cu_k = buf[: n + 1], buf[n + 1 : 2 * n + 2]
    kernel_order = buf[2 * n + 2 : 2 * n + 2 + order.size]
    part_offsets = buf[len(head) :].view(torch.int64)
    num, idx, part, words = torch.ops.sparse_attn._document_mask.default(
        cu_q, cu_k, part_offsets, int(offsets[-1]), total_q, total_k, block[0], block[1], left, right, max_kb
    )
    mask = BlockSparseMask(num, idx, part, words, seq_lengths=(total_q, total_k), block_size=block, validate=False)
    if weights.size:
        mask._order = kernel_order
    return mask


def _cached_document_mask(bounds, total_q: int, total_k: int, left: int, right: int, device):
    """document_mask, kept for the next DOCUMENT_MASKS_KEPT distinct calls (the masks are never
    modified; the stream is part of the key, so a mask is only reused in its own stream's order)."""
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
    key = (tuple(x for b in bounds for x in b), total_q, total_k, left, right, str(device), stream)
    mask = _DOCUMENT_MASKS.get(key)
    if mask is not None:
        _DOCUMENT_MASKS.move_to_end(key)
        return mask
    mask = document_mask(bounds, total_q, total_k, left, right, device)
    _DOCUMENT_MASKS[key] = mask
    while len(_DOCUMENT_MASKS) > DOCUMENT_MASKS_KEPT:
        _DOCUMENT_MASKS.popitem(last=False)
    return mask


def causal_band(left: int, right: int, causal: bool) -> tuple[int, int]:
    """A window's (left, right) bounds with ``causal`` folded in (no key after the row's own)."""
    return (left, 0 if right < 0 else min(right, 0)) if causal else (left, right)


def run_documents(query, key, value, bounds, scale, causal: bool, left: int, right: int):
    """The packed batch as one block_sparse_attention call over its document mask: the packed
    (total, H, D) tensors viewed as one (1, H, total, D) sequence; returns (total_q, H, Dv) and
    (H, total_q)."""
    from .ops import block_sparse_attention

    left, right = causal_band(left, right, causal)
    mask = _cached_document_mask(bounds, query.shape[0], key.shape[0], left, right, query.device)
    q, k, v = (x.unsqueeze(0).transpose(1, 2) for x in (query, key, value))
    out, lse = block_sparse_attention(q, k, v, mask, scale=scale, return_lse=True)
    return out[0].transpose(0, 1).contiguous(), lse[0]
