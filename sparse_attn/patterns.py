"""Static sparsity patterns, each a :class:`~sparse_attn.BlockSparseMask` with exact element masks.

Every pattern is defined by an element predicate over query position ``i`` and key position
``j`` (DESIGN.md section 4), and compose with ``|`` and ``&``::

    mask = patterns.sliding_window(L, 256) | patterns.global_tokens(L, [0, 1, 2, 3])

Construction never materialises an L x L tensor: candidate blocks come from the pattern's
geometry, and element bits are evaluated once per distinct block shape (a band's blocks depend
only on their diagonal offset and on how much of them lies inside the sequences, so a causal mask of
any length needs a few partial blocks, one more for a ragged tail).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch

from .masks import _FULL, _NONE, BlockSparseMask, _check_block_size, _pair, pack_bits

__all__ = [
    "causal",
    "sliding_window",
    "dilated",
    "dilated_2d",
    "strided",
    "global_tokens",
    "longformer",
    "bigbird",
    "random_blocks",
]

_BIG = 1 << 62
# Elements evaluated per chunk when computing the bits of distinct blocks.
_CHUNK = 1 << 22


def _positive(name: str, value: int, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return value


def _lengths(lq: int, lk: int) -> tuple[int, int]:
    return _positive("lq", lq, 0), _positive("lk", lk, 0)


def _build(
    seq_lengths: tuple[int, int],
    block_size: int | tuple[int, int],
    device,
    cand: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    key: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    allowed: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
) -> BlockSparseMask:
    """Build a (1, 1, nQb, nKb) mask from a pattern's geometry.

    cand(i0, j0) -> bool: blocks whose first element is (i0, j0) that may hold an allowed pair.
    key(i0, j0) -> int64 (..., K): a key such that blocks with equal keys have equal bits.
    allowed(i, j) -> bool: the element predicate (broadcasting int64 tensors).
    """
    bq, bk = _pair(block_size)
    _check_block_size((bq, bk))
    lq, lk = seq_lengths
    nq, nk = math.ceil(lq / bq), math.ceil(lk / bk)
    dev = torch.device(device) if device is not None else torch.device("cpu")
    i0 = (torch.arange(nq, device=dev, dtype=torch.int64) * bq)[:, None].expand(nq, nk)
    j0 = (torch.arange(nk, device=dev, dtype=torch.int64) * bk)[None, :].expand(nq, nk)
    where = cand(i0, j0).nonzero(as_tuple=True)
    keys = key(i0[where], j0[where])
    if keys.dim() == 1:
        keys = keys[:, None]
    # Positions past the sequence ends are outside the mask: a ragged tail block must not be
    # listed for pairs it holds only there, and is full when every pair in range is allowed.
    # So its key also records how many of its rows and columns are in range.
    rows_in = (lq - i0[where]).clamp(max=bq)[:, None]
    cols_in = (lk - j0[where]).clamp(max=bk)[:, None]
    keys = torch.cat([keys, rows_in, cols_in], -1)
    table = torch.full((1, 1, nq, nk), _NONE, dtype=torch.int32, device=dev)
    if keys.shape[0] == 0:
        return BlockSparseMask._from_table(
            table, torch.zeros(0, bq, bk // 32, dtype=torch.int32, device=dev), (lq, lk), (bq, bk)
        )
    uniq, inverse = torch.unique(keys, dim=0, return_inverse=True)
    n = inverse.shape[0]
    rep = torch.full((uniq.shape[0],), n, dtype=torch.int64, device=dev)
    rep = rep.scatter_reduce(0, inverse, torch.arange(n, device=dev), reduce="amin")
    ri, rj = i0[where][rep], j0[where][rep]
    r = torch.arange(bq, device=dev, dtype=torch.int64)
    c = torch.arange(bk, device=dev, dtype=torch.int64)
    step = max(1, _CHUNK // (bq * bk))
    bits = torch.cat(
        [
            allowed(ri[s : s + step, None, None] + r[None, :, None], rj[s : s + step, None, None] + c[None, None, :])
            for s in range(0, ri.shape[0], step)
        ]
    )
    inside = (ri[:, None, None] + r[None, :, None] < lq) & (rj[:, None, None] + c[None, None, :] < lk)
    bits = bits & inside
    full = (bits | ~inside).flatten(1).all(-1)
    partial = bits.flatten(1).any(-1) & ~full
    state = torch.full((uniq.shape[0],), _NONE, dtype=torch.int32, device=dev)
    state[partial] = torch.arange(int(partial.sum()), dtype=torch.int32, device=dev)
    state[full] = _FULL
    table[0, 0][where] = state[inverse]
    return BlockSparseMask._from_table(table, pack_bits(bits[partial]), (lq, lk), (bq, bk))


def _band(seq_lengths, block_size, device, lo: int, hi: int, pred=None) -> BlockSparseMask:
    """Patterns of the diagonal offset d = i - j: allowed iff lo <= d <= hi and pred(d)."""
    bq, bk = _pair(block_size)

    def cand(i0, j0):
        return (i0 - j0 + bq - 1 >= lo) & (i0 - j0 - (bk - 1) <= hi)

    def allowed(i, j):
        d = i - j
        ok = (d >= lo) & (d <= hi)
        return ok & pred(d) if pred is not None else ok

    return _build(seq_lengths, block_size, device, cand, lambda i0, j0: i0 - j0, allowed)


def causal(
    lq: int, lk: int, *, block_size: int | tuple[int, int] = 128, device=None, compact: bool = True
) -> BlockSparseMask:
    """Bottom-right aligned causal mask: query i sees key j iff j <= i + (Lk - Lq).

    With equal query and key blocks the mask is built arithmetically, with no device
    synchronisation and no data-dependent shapes (so it can run under ``torch.compile`` or CUDA
    graph capture) when ``compact=False``; ``compact=True`` (default) also merges identical partial
    blocks, which needs one synchronisation.

    Examples
    --------
    >>> from sparse_attn import patterns
    >>> patterns.causal(1024, 1024).density()  # doctest: +ELLIPSIS
    0.56...
    """
    lq, lk = _lengths(lq, lk)
    bq, bk = _pair(block_size)
    if bq != bk:
        return _band((lq, lk), (bq, bk), device, lo=-(lk - lq), hi=_BIG)
    _check_block_size((bq, bk))
    dev = torch.device(device) if device is not None else torch.device("cpu")
    return _band_square(lq, lk, bq, -(lk - lq), None, dev, compact)


def _band_square(lq: int, lk: int, bs: int, lo: int, hi: int | None, dev: torch.device, compact: bool):
    """Band mask lo <= i - j <= hi (hi None: unbounded) with bs x bs blocks, built arithmetically.

    Block (qb, kb) holds d = i - j = t + r - c with t = (qb - kb) * bs, inside its rq x ck in-range
    region (rq, ck < bs only for the ragged last block row / column). It is full iff
    lo <= t - (ck - 1) and t + rq - 1 <= hi, empty iff t + rq - 1 < lo or t - (ck - 1) > hi, else
    partial; a partial block's bits depend only on (t, rq, ck), and t (a multiple of bs) must lie
    within bs - 1 of a boundary: at most 4 values, so at most 16 candidate bit patterns, enumerated
    up front. No device synchronisation and no data-dependent shapes (when compact=False)."""
    nq, nk = math.ceil(lq / bs), math.ceil(lk / bs)
    bounds = [lo] + ([hi] if hi is not None else [])
    t_vals = sorted(
        {
            m * bs
            for b in bounds
            for m in range(math.floor((b - bs + 1) / bs), math.ceil((b + bs - 1) / bs) + 1)
            if abs(m * bs - b) <= bs - 1
        }
    )
    rq_vals = (bs, lq - (nq - 1) * bs if nq else bs)
    ck_vals = (bs, lk - (nk - 1) * bs if nk else bs)
    hi_ = hi if hi is not None else _BIG
    r = torch.arange(bs, device=dev)[:, None]
    c = torch.arange(bs, device=dev)[None, :]
    cands = [
        (t + r - c >= lo) & (t + r - c <= hi_) & (r < rq) & (c < ck) for t in t_vals for rq in rq_vals for ck in ck_vals
    ]
    cands = torch.stack(cands) if cands else torch.zeros(0, bs, bs, dtype=torch.bool, device=dev)
    qb = torch.arange(nq, device=dev)[:, None]
    kb = torch.arange(nk, device=dev)[None, :]
    t = (qb - kb) * bs
    rq = (lq - qb * bs).clamp(max=bs)
    ck = (lk - kb * bs).clamp(max=bs)
    full = (t - (ck - 1) >= lo) & (t + rq - 1 <= hi_)
    empty = (t + rq - 1 < lo) | (t - (ck - 1) > hi_)
    t_idx = torch.zeros_like(t)
    for n, tv in enumerate(t_vals):
        t_idx = torch.where(t == tv, n, t_idx)
    cand_id = t_idx * 4 + (rq != bs).long() * 2 + (ck != bs).long()
    table = torch.where(full, _FULL, torch.where(empty, _NONE, cand_id)).to(torch.int32)[None, None]
    # Widest row, from the band's key range per query block: a small CPU computation, so building
    # the mask on the GPU needs no synchronisation.
    i0 = torch.arange(nq, dtype=torch.int64) * bs
    i1 = (i0 + bs).clamp(max=lq) - 1
    j0 = (i0 - hi_).clamp(min=0)
    j1 = (i1 - lo).clamp(max=lk - 1)
    counts = torch.where(j1 >= j0, j1 // bs - j0 // bs + 1, 0)
    width = int(counts.max()) if nq else 0
    return BlockSparseMask._from_table(
        table, pack_bits(cands), (lq, lk), (bs, bs), max_kv_blocks=width, compact=compact
    )


def sliding_window(
    seq_len: int, window: int, *, causal: bool = False, block_size: int | tuple[int, int] = 128, device=None
) -> BlockSparseMask:
    """Band of half-width ``window``: ``|i - j| < window``; causal: ``0 <= i - j < window``."""
    seq_len = _positive("seq_len", seq_len, 0)
    window = _positive("window", window)
    lo = 0 if causal else -(window - 1)
    bq, bk = _pair(block_size)
    if bq == bk:
        _check_block_size((bq, bk))
        dev = torch.device(device) if device is not None else torch.device("cpu")
        return _band_square(seq_len, seq_len, bq, lo, window - 1, dev, compact=False)
    return _band((seq_len, seq_len), block_size, device, lo=lo, hi=window - 1)


def dilated(
    seq_len: int, window: int, dilation: int, *, block_size: int | tuple[int, int] = 128, device=None
) -> BlockSparseMask:
    """1-D dilated window (Longformer): ``|i - j| < window`` and ``|i - j| % dilation == 0``."""
    seq_len = _positive("seq_len", seq_len, 0)
    window = _positive("window", window)
    dilation = _positive("dilation", dilation)
    return _band(
        (seq_len, seq_len), block_size, device, lo=-(window - 1), hi=window - 1, pred=lambda d: d % dilation == 0
    )


def strided(
    seq_len: int, stride: int, local: int, *, block_size: int | tuple[int, int] = 128, device=None
) -> BlockSparseMask:
    """Sparse Transformer strided pattern: ``|i - j| < local`` or ``(i - j) % stride == 0``."""
    seq_len = _positive("seq_len", seq_len, 0)
    stride = _positive("stride", stride)
    local = _positive("local", local)
    return _band(
        (seq_len, seq_len),
        block_size,
        device,
        lo=-_BIG,
        hi=_BIG,
        pred=lambda d: (d.abs() < local) | (d % stride == 0),
    )


def dilated_2d(
    seq_len: int, segment: int, dilation: int, *, block_size: int | tuple[int, int] = 128, device=None
) -> BlockSparseMask:
    """LongNet-style dilated attention: i and j in the same segment of length ``segment``, each at
    a position within it that is a multiple of ``dilation``. Rows at other positions see no key."""
    seq_len = _positive("seq_len", seq_len, 0)
    segment = _positive("segment", segment)
    dilation = _positive("dilation", dilation)
    bq, bk = _pair(block_size)

    def cand(i0, j0):
        # Segments spanned by the query rows and the key columns of each block overlap.
        return (i0 // segment <= (j0 + bk - 1) // segment) & (j0 // segment <= (i0 + bq - 1) // segment)

    def key(i0, j0):
        return torch.stack([i0 % segment, j0 % segment, i0 // segment - j0 // segment], -1)

    def allowed(i, j):
        return (i // segment == j // segment) & ((i % segment) % dilation == 0) & ((j % segment) % dilation == 0)

    return _build((seq_len, seq_len), block_size, device, cand, key, allowed)


def global_tokens(
    seq_len: int,
    global_idx: Sequence[int] | torch.Tensor,
    *,
    block_size: int | tuple[int, int] = 128,
    device=None,
) -> BlockSparseMask:
    """Global tokens: ``i in global_idx`` or ``j in global_idx`` (they see and are seen by all)."""
    seq_len = _positive("seq_len", seq_len, 0)
    bq, bk = _pair(block_size)
    _check_block_size((bq, bk))
    dev = torch.device(device) if device is not None else torch.device("cpu")
    idx = torch.as_tensor(global_idx, dtype=torch.int64, device=dev).flatten()
    if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= seq_len):
        raise ValueError(f"global_idx must lie in [0, {seq_len}), got values in [{int(idx.min())}, {int(idx.max())}]")
    span = math.ceil(seq_len / min(bq, bk)) * max(bq, bk)
    is_global = torch.zeros(span, dtype=torch.bool, device=dev)
    is_global[idx] = True
    # Blocks with the same row pattern and the same column pattern have the same bits.
    row_pat = torch.unique(is_global[: span // bq * bq].reshape(-1, bq), dim=0, return_inverse=True)[1]
    col_pat = torch.unique(is_global[: span // bk * bk].reshape(-1, bk), dim=0, return_inverse=True)[1]
    row_any = is_global[: span // bq * bq].reshape(-1, bq).any(-1)
    col_any = is_global[: span // bk * bk].reshape(-1, bk).any(-1)

    def cand(i0, j0):
        return row_any[i0 // bq] | col_any[j0 // bk]

    def key(i0, j0):
        return torch.stack([row_pat[i0 // bq], col_pat[j0 // bk]], -1)

    def allowed(i, j):
        return is_global[i] | is_global[j]

    return _build((seq_len, seq_len), (bq, bk), dev, cand, key, allowed)


def longformer(
    seq_len: int,
    window: int,
    global_idx: Sequence[int] | torch.Tensor,
    *,
    block_size: int | tuple[int, int] = 128,
    device=None,
) -> BlockSparseMask:
    """Longformer: a symmetric sliding window of half-width ``window`` plus global tokens."""
    return sliding_window(seq_len, window, block_size=block_size, device=device) | global_tokens(
        seq_len, global_idx, block_size=block_size, device=device
    )


def _random_block_matrix(nq: int, nk: int, per_row: int, generator: torch.Generator, heads: int) -> torch.Tensor:
    """(heads, nq, nk) bool with ``per_row`` distinct random key blocks per query block."""
    per_row = min(per_row, nk)
    scores = torch.rand(heads, nq, nk, generator=generator)
    pick = scores.topk(per_row, dim=-1).indices
    return torch.zeros(heads, nq, nk, dtype=torch.bool).scatter_(-1, pick, True)


def bigbird(
    seq_len: int,
    window: int,
    num_global: int,
    num_random: int,
    seed: int = 0,
    *,
    heads: int = 1,
    block_size: int | tuple[int, int] = 128,
    device=None,
) -> BlockSparseMask:
    """BigBird: sliding window ∪ the first ``num_global`` tokens as global tokens ∪
    ``num_random`` random key blocks per query block (seeded; ``heads`` > 1 draws one set per head)."""
    seq_len = _positive("seq_len", seq_len, 0)
    _positive("num_global", num_global, 0)
    _positive("num_random", num_random, 0)
    heads = _positive("heads", heads)
    bq, bk = _pair(block_size)
    mask = sliding_window(seq_len, window, block_size=(bq, bk), device=device)
    if num_global:
        mask = mask | global_tokens(seq_len, range(min(num_global, seq_len)), block_size=(bq, bk), device=device)
    if num_random:
        nq, nk = math.ceil(seq_len / bq), math.ceil(seq_len / bk)
        gen = torch.Generator().manual_seed(seed)
        blocks = _random_block_matrix(nq, nk, num_random, gen, heads)[None]
        rand = BlockSparseMask.from_block_matrix(
            blocks.to(device) if device is not None else blocks, seq_lengths=(seq_len, seq_len), block_size=(bq, bk)
        )
        mask = mask | rand
    return mask


def random_blocks(
    seq_len: int,
    density: float,
    seed: int = 0,
    *,
    heads: int = 1,
    block_size: int | tuple[int, int] = 128,
    device=None,
) -> BlockSparseMask:
    """Random block pattern: each (query block, key block) pair on with probability ``density``
    (seeded), the blocks holding the diagonal always on. ``heads`` > 1 draws one pattern per head."""
    seq_len = _positive("seq_len", seq_len, 0)
    if not 0.0 <= float(density) <= 1.0:
        raise ValueError(f"density must lie in [0, 1], got {density}")
    heads = _positive("heads", heads)
    bq, bk = _pair(block_size)
    _check_block_size((bq, bk))
    nq, nk = math.ceil(seq_len / bq), math.ceil(seq_len / bk)
    gen = torch.Generator().manual_seed(seed)
    blocks = torch.rand(heads, nq, nk, generator=gen) < density
    # Every block holding a diagonal pair (i, i): more than one per query block when q_block > kv_block.
    pos = torch.arange(seq_len)
    blocks[:, pos // bq, pos // bk] = True
    blocks = blocks[None]
    if device is not None:
        blocks = blocks.to(device)
    return BlockSparseMask.from_block_matrix(blocks, seq_lengths=(seq_len, seq_len), block_size=(bq, bk))
