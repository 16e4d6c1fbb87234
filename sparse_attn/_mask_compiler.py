"""The mask compiler: a pattern's description (a spec: which pairs it allows) to a BlockSparseMask.

:mod:`sparse_attn.patterns` states each pattern as a spec and calls :func:`compile_mask`; how the
mask is built is decided here. Every pattern is an element predicate over query position ``i``
and key position ``j``; its mask lists each (query block, key block) holding an allowed pair, as
a full block when every pair of it inside the sequences is allowed, else as a partial block with
its element bits. Nothing materialises an Lq x Lk tensor: bits are evaluated once per distinct
block (a band's blocks depend only on their diagonal offset and on how much of them lies inside
the sequences, so a causal mask of any length needs a few partial blocks, one more for a ragged
tail).

Equal query and key blocks (the default) take the square path, made for building masks on every
call of a model on a GPU, where the build is bound by the host's cost per device operation
(5-30 us each on an H100's host), not by the device:

- no host-device synchronisation (``compact=True`` aside), so the host never waits for the GPU;
- a fixed number of device operations per pattern, whatever the length: the distinct blocks are
  enumerated and their bits packed on the host (numpy), with each row's key blocks where they
  are runs, and the device copies that "plan" and does at most a table lookup;
- plans cached per set of arguments, so a rebuild is one copy and the device operations;
- CUDA graph capture: the copy reads page-locked memory kept for the process, which a captured
  graph reads again at every replay;
- under ``torch.compile`` and CUDA graph capture, interval bands (causal masks, sliding windows)
  take a form built from torch operations alone, which traces and copies no host array.

Unequal blocks take the generic path: the candidate blocks are found on the device (one sync)
and their bits evaluated by ``BlockSparseMask._from_predicate``, which ``from_flex`` uses too.
"""

from __future__ import annotations

import functools
import itertools
import math
import operator
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

from .masks import _FULL, _NONE, BlockSparseMask, cta_schedule, pack_bits

_BIG = 1 << 62
# Elements evaluated per chunk when the generic path computes the bits of distinct blocks.
_CHUNK = 1 << 22


# ------------------------------------------------------------------------------------ specs
# Frozen dataclasses: the square path caches its plans by them, and unlike tuples two kinds with
# equal fields do not compare equal (a Dilated(3, 2) must not get a Strided(3, 2)'s plan).
@dataclass(frozen=True)
class Interval:
    """``lo <= i - j <= hi`` (``hi`` None: unbounded)."""

    lo: int
    hi: int | None


@dataclass(frozen=True)
class Dilated:
    """``|i - j| < window`` and ``(i - j) % dilation == 0``."""

    window: int
    dilation: int


@dataclass(frozen=True)
class Strided:
    """``|i - j| < local`` or ``(i - j) % stride == 0``."""

    stride: int
    local: int


@dataclass(frozen=True)
class Dilated2d:
    """``i`` and ``j`` in one segment of length ``segment``, each at an offset in it that is a
    multiple of ``dilation``."""

    segment: int
    dilation: int


@dataclass(frozen=True)
class WindowUnion:
    """``|i - j| < window`` (None: no band) or ``i`` or ``j`` in ``global_idx`` (sorted, distinct);
    with ``random`` = (num_random, seed, heads), also each query block's random key blocks as full
    blocks (``_bigbird_random_blocks``: one set per head)."""

    window: int | None
    global_idx: tuple[int, ...]
    random: tuple[int, int, int] | None = None


@dataclass(frozen=True)
class RandomBlocks:
    """Each (query block, key block) on (full) with probability ``density``, one draw per head from
    a CPU generator seeded with ``seed``; the blocks holding a diagonal pair (i, i) always on."""

    density: float
    seed: int
    heads: int


Spec = Interval | Dilated | Strided | Dilated2d | WindowUnion | RandomBlocks


def compile_mask(
    spec: Spec, seq_lengths: tuple[int, int], block_size: tuple[int, int], device=None, *, compact: bool = False
) -> BlockSparseMask:
    """The (1, H|1, nQb, nKb) mask of ``spec`` for (Lq, Lk) = ``seq_lengths`` (equal, but for an
    ``Interval``) and (q_block, kv_block) = ``block_size`` (a checked pair), on ``device`` (None:
    the CPU).

    Equal blocks: no synchronisation, from the cached host plan (interval bands: from torch ops
    alone in one op of their own under ``torch.compile`` or CUDA graph capture, never merged);
    ``compact`` merges the identical partial blocks of a band (one synchronisation). Unequal
    blocks: the generic path (it synchronises, and always merges them). ``RandomBlocks``: drawn
    on the host at any block sizes.
    """
    dev = torch.device(device) if device is not None else torch.device("cpu")
    lq, lk = seq_lengths
    if isinstance(spec, RandomBlocks):
        return _random_mask(spec, lq, block_size, dev)
    bs = block_size[0]
    if block_size[1] != bs:
        return _generic(spec, seq_lengths, block_size, dev)
    if lq == 0 or lk == 0:
        heads = spec.random[2] if isinstance(spec, WindowUnion) and spec.random is not None else 1
        return _empty(lq, lk, bs, dev, heads)
    if isinstance(spec, Dilated2d):
        return _realise(_dilated_2d_plan(lq, bs, spec), dev)
    if isinstance(spec, WindowUnion):
        return _realise(_union_plan(lq, bs, spec), dev)
    tracing = torch.compiler.is_compiling() or (dev.type == "cuda" and torch.cuda.is_current_stream_capturing())
    if tracing and isinstance(spec, Interval):
        return _band_square(lq, lk, bs, spec, dev)
    return _realise(_band_plan(lq, lk, bs, spec), dev, compact)


# ------------------------------------------------------------------------------------ bands
class _Band(NamedTuple):
    """A predicate of d = i - j alone, described so that blocks can be grouped by their diagonal."""

    pred: Callable  # int64 d (numpy or torch) -> bool
    changes: tuple[int, ...]  # ascending; pred's regime differs between d - 1 and d
    periods: tuple[int, ...]  # period of pred in each of the len(changes) + 1 regions (0: constant)
    lo: int  # pred is False below lo
    hi: int  # and above hi


def _interval(lo: int, hi: int | None) -> _Band:
    """The band lo <= d <= hi (hi None: unbounded)."""
    top = _BIG if hi is None else hi
    changes = (lo,) if hi is None else (lo, hi + 1)
    return _Band(lambda d: (d >= lo) & (d <= top), changes, (0,) * (len(changes) + 1), lo, top)


def _band_of(spec: Interval | Dilated | Strided) -> _Band:
    """The d = i - j predicate of a band spec."""
    if isinstance(spec, Interval):
        return _interval(spec.lo, spec.hi)
    if isinstance(spec, Dilated):
        w, r = spec.window, spec.dilation
        return _Band(lambda d: (abs(d) < w) & (d % r == 0), (-(w - 1), w), (0, r, 0), -(w - 1), w - 1)
    stride, local = spec.stride, spec.local
    return _Band(
        lambda d: (abs(d) < local) | (d % stride == 0), (-(local - 1), local), (stride, 0, stride), -_BIG, _BIG
    )


# ------------------------------------------------------------------------------------ generic path
def _generic(spec: Spec, seq_lengths: tuple[int, int], block_size: tuple[int, int], dev: torch.device):
    """The mask of ``spec`` with unequal query and key blocks."""
    if isinstance(spec, Dilated2d):
        return _generic_dilated_2d(spec, seq_lengths, block_size, dev)
    if isinstance(spec, WindowUnion):
        return _generic_union(spec, seq_lengths[0], block_size, dev)
    return _generic_band(_band_of(spec), seq_lengths, block_size, dev)


def _from_geometry(
    seq_lengths: tuple[int, int],
    block_size: tuple[int, int],
    dev: torch.device,
    cand: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    key: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    allowed: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
) -> BlockSparseMask:
    """A (1, 1, nQb, nKb) mask from a pattern's geometry.

    cand(i0, j0) -> bool: blocks whose first element is (i0, j0) that may hold an allowed pair.
    key(i0, j0) -> int64 (..., K): a key such that blocks with equal keys have equal bits.
    allowed(i, j) -> bool: the element predicate (broadcasting int64 tensors).
    """
    (lq, lk), (bq, bk) = seq_lengths, block_size
    nq, nk = math.ceil(lq / bq), math.ceil(lk / bk)
    i0 = (torch.arange(nq, device=dev, dtype=torch.int64) * bq)[:, None].expand(nq, nk)
    j0 = (torch.arange(nk, device=dev, dtype=torch.int64) * bk)[None, :].expand(nq, nk)
    where = cand(i0, j0).nonzero(as_tuple=True)
    table = torch.full((1, 1, nq, nk), _NONE, dtype=torch.int32, device=dev)
    keys = key(i0[where], j0[where])
    return BlockSparseMask._from_predicate(
        table, where, allowed, seq_lengths, block_size, keys=keys, chunk_elements=_CHUNK
    )


def _generic_band(band: _Band, seq_lengths, block_size, dev) -> BlockSparseMask:
    """A band: block (i0, j0) holds d in [i0 - j0 - (bk - 1), i0 - j0 + bq - 1], so its bits depend
    on i0 - j0 alone (the key), and it is a candidate where that range meets [lo, hi]."""
    bq, bk = block_size

    def cand(i0, j0):
        return (i0 - j0 + bq - 1 >= band.lo) & (i0 - j0 - (bk - 1) <= band.hi)

    return _from_geometry(seq_lengths, block_size, dev, cand, operator.sub, lambda i, j: band.pred(i - j))


def _generic_dilated_2d(spec: Dilated2d, seq_lengths, block_size, dev) -> BlockSparseMask:
    bq, bk = block_size
    segment, dilation = spec.segment, spec.dilation

    def cand(i0, j0):
        # Segments spanned by the query rows and the key columns of each block overlap.
        return (i0 // segment <= (j0 + bk - 1) // segment) & (j0 // segment <= (i0 + bq - 1) // segment)

    def key(i0, j0):
        return torch.stack([i0 % segment, j0 % segment, i0 // segment - j0 // segment], -1)

    def allowed(i, j):
        return (i // segment == j // segment) & ((i % segment) % dilation == 0) & ((j % segment) % dilation == 0)

    return _from_geometry(seq_lengths, block_size, dev, cand, key, allowed)


def _generic_globals(seq_len: int, global_idx: tuple[int, ...], block_size, dev) -> BlockSparseMask:
    """``i`` or ``j`` a global token."""
    bq, bk = block_size
    span = math.ceil(seq_len / min(bq, bk)) * max(bq, bk)
    is_global = torch.zeros(span, dtype=torch.bool, device=dev)
    is_global[torch.tensor(global_idx, dtype=torch.int64, device=dev)] = True
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

    return _from_geometry((seq_len, seq_len), block_size, dev, cand, key, allowed)


def _generic_union(spec: WindowUnion, seq_len: int, block_size, dev) -> BlockSparseMask:
    """The band's, the global tokens' and the random blocks' masks, united by ``|``."""
    mask = None
    if spec.window is not None:
        band = _interval(-(spec.window - 1), spec.window - 1)
        mask = _generic_band(band, (seq_len, seq_len), block_size, dev)
    if spec.global_idx or mask is None:
        tokens = _generic_globals(seq_len, spec.global_idx, block_size, dev)
        mask = tokens if mask is None else mask | tokens
    if spec.random is not None:
        drawn = torch.from_numpy(_bigbird_random_blocks(seq_len, *spec.random, block_size))
        heads, nq, _ = drawn.shape
        blocks = torch.zeros(heads, nq, math.ceil(seq_len / block_size[1]), dtype=torch.bool).scatter_(-1, drawn, True)
        drawn_mask = BlockSparseMask.from_block_matrix(
            blocks[None].to(dev), seq_lengths=(seq_len, seq_len), block_size=block_size
        )
        mask = mask | drawn_mask
    return mask


def _random_mask(spec: RandomBlocks, seq_len: int, block_size: tuple[int, int], dev: torch.device):
    """Drawn on the host (the same blocks on every device), then listed on the device (one sync)."""
    bq, bk = block_size
    nq, nk = math.ceil(seq_len / bq), math.ceil(seq_len / bk)
    gen = torch.Generator().manual_seed(spec.seed)
    blocks = torch.rand(spec.heads, nq, nk, generator=gen) < spec.density
    # Every block holding a diagonal pair (i, i): more than one per query block when q_block > kv_block.
    pos = torch.arange(seq_len)
    blocks[:, pos // bq, pos // bk] = True
    return BlockSparseMask.from_block_matrix(
        blocks[None].to(dev), seq_lengths=(seq_len, seq_len), block_size=block_size
    )


# ------------------------------------------------------------------------------------ square blocks
# With q_block == kv_block every builder below runs without a host-device synchronisation and with
# a fixed number of device operations (one to a dozen, whatever the length). The bits of block
# (qb, kb) depend only on a few small attributes: its diagonal (a band's d = i - j ranges over
# t + r - c, t = (qb - kb) * bs) or, for dilated_2d, its segment offset; how many of its rows and
# columns lie inside the sequences; which of its rows and columns are global tokens. Each takes a
# handful of values, so the distinct blocks (classes) are enumerated on the host, their bits
# computed from the element predicate and packed there, and the (nQb, nKb) block table on the
# device is one lookup into the classes' states. Where each row's key blocks are a run (bands,
# dilations: those of the run that hold an allowed pair), plus global columns and random blocks,
# the host lists them (_row_lists, a few entries per row) and the device only copies them: building
# a pattern on a GPU is bound by the host's cost per device op, not by the device. On the host a
# block's bits are "block words": its packed int32 words (row-major, as pack_bits stores them) two
# to an int64, (bs * bs // 64,), so that the bitwise work and comparisons touch few numbers. The
# host work (a "plan": numpy, O(nQb + nKb), plus the row counts that give the width of kv_indices)
# is cached per set of arguments, so a pattern rebuilt with the same arguments costs one copy to
# the device and the device ops.

_LUT_MAX = 1 << 16  # entries of a one-step lookup table; beyond it the table takes two lookups
_RUN_SLACK = 4  # a plan lists its rows' key blocks on the host unless their runs are wider (_runs)


def _pack(bits: np.ndarray) -> np.ndarray:
    """(..., K) bool -> (..., K // 32) int32, bit ``c % 32`` of word ``c // 32`` (as ``pack_bits``)."""
    return np.packbits(bits, axis=-1, bitorder="little").view("<i4").astype(np.int32, copy=False)


def _classes(key: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(first, inverse) of the distinct values of ``key`` (n >= 1,) int64 >= 0: a representative
    index and the class of each entry, classes numbered in increasing key order."""
    if int(key.max()) > 4 * key.size + 1024:  # wide range: sort
        first, inverse = np.unique(key, return_index=True, return_inverse=True)[1:]
        return first, inverse.ravel()
    seen = np.zeros(int(key.max()) + 1, dtype=np.int64)
    seen[key] = 1
    ids = np.cumsum(seen) - 1
    inverse = ids[key]
    first = np.empty(int(ids[-1]) + 1, dtype=np.int64)
    first[inverse] = np.arange(key.size)
    return first, inverse


def _empty(lq: int, lk: int, bs: int, dev: torch.device, heads: int = 1) -> BlockSparseMask:
    nq, nk = math.ceil(lq / bs), math.ceil(lk / bs)
    table = torch.full((1, heads, nq, nk), _NONE, dtype=torch.int32, device=dev)
    bits = torch.zeros(0, bs, bs // 32, dtype=torch.int32, device=dev)
    return BlockSparseMask._from_table(table, bits, (lq, lk), (bs, bs), max_kv_blocks=0, compact=False)


def _block_classes(length: int, bs: int, global_idx: np.ndarray | None = None):
    """Classes of the (n >= 1) blocks of one sequence, query or key side: blocks of a class have the
    same number of positions in range and the same global tokens.

    Returns ``cls`` (n,) int64, and per class ``inside`` (C,) int64 (positions in range) and
    ``is_global`` (C, bs) bool. Only the last block (when ragged) and the blocks holding global
    tokens (``global_idx`` sorted, distinct) are looked at: the others are plain blocks.
    """
    n = -(-length // bs)
    tail = length - (n - 1) * bs
    if global_idx is None or global_idx.size == 0:
        cls = np.zeros(n, dtype=np.int64)
        if tail == bs:
            return cls, np.array([bs]), np.zeros((1, bs), dtype=bool)
        cls[-1] = 1
        return cls, np.array([bs, tail]), np.zeros((2, bs), dtype=bool)
    blocks = global_idx // bs
    special = blocks[np.diff(blocks, prepend=-1) != 0]
    if special[-1] != n - 1:
        special = np.append(special, n - 1)
    # Rows 0..len(special)-1: the special blocks; the last row: a plain block.
    pattern = np.zeros((special.size + 1, bs), dtype=bool)
    pattern[np.searchsorted(special, blocks), global_idx % bs] = True
    inside = np.append(np.minimum(length - special * bs, bs), bs)
    classes: dict = {}
    inverse = np.empty(special.size + 1, dtype=np.int64)
    for x, key in enumerate(zip(map(bytes, np.packbits(pattern, axis=-1)), inside.tolist(), strict=True)):
        inverse[x] = classes.setdefault(key, len(classes))
    first = np.empty(len(classes), dtype=np.int64)
    first[inverse[::-1]] = np.arange(special.size, -1, -1)
    cls = np.full(n, inverse[-1], dtype=np.int64)
    cls[special] = inverse[:-1]
    return cls, inside[first], pattern[first]


def _diag_classes(nq: int, nk: int, bs: int, band: _Band | None):
    """Classes of the block diagonals m = qb - kb in [-(nk - 1), nq - 1]: blocks on the diagonals of a
    class hold the same band bits (before they are cut to the sequences).

    A block on diagonal m holds d = t + r - c, t = m * bs, so |d - t| < bs. Where that range lies in
    one region of the predicate, the bits depend only on t mod the region's period (on nothing if
    it is constant); where it straddles a change of regime at b, i.e. b - bs < t - (bs - 1) and
    t + (bs - 1) >= b (at most two diagonals per change), the diagonal is a class alone.

    Returns ``cls`` (nq + nk - 1,) int64 indexed by m + nk - 1, and the classes' block words
    (K, bs * bs // 64). No band: one class, no bits.
    """
    size, m0 = nq + nk - 1, -(nk - 1)
    if band is None:
        return np.zeros(size, dtype=np.int64), np.zeros((1, bs * bs // 64), dtype=np.int64)
    cls = np.empty(size, dtype=np.int64)
    reps: list[int] = []  # each class's first diagonal, as m + nk - 1
    start = 0
    for region, period in enumerate(band.periods):
        end, after = size, size
        if region < len(band.changes):
            b = band.changes[region]
            # Diagonals straddling b: b - bs + 1 <= m * bs <= b + bs - 2.
            end = min(max(-((bs - 1 - b) // bs) - m0, start), size)
            after = min(max((b + bs - 2) // bs + 1 - m0, end), size)
        if end > start:
            runs = min(period // math.gcd(period, bs), end - start) if period else 1
            cls[start:end] = len(reps) + np.arange(end - start) % runs if runs > 1 else len(reps)
            reps += range(start, start + runs)
        cls[end:after] = np.arange(len(reps), len(reps) + after - end)
        reps += range(end, after)
        start = after
    t = (np.array(reps) + m0) * bs
    return cls, _toeplitz_words(band.pred(t[:, None] + _d_offsets(bs)), bs)


@functools.cache
def _d_offsets(bs: int) -> np.ndarray:
    """d - t where a block's d range is read by _toeplitz_words: bs - 1 down to -(bs + 64) (the
    last 65 entries pad the reads of the final words; they never land in a word)."""
    return np.arange(bs - 1, -bs - 65, -1)


@functools.cache
def _toeplitz_reads(bs: int):
    """Where word w of row r of a block starts in the bits of its d range (see _toeplitz_words):
    at bit x = bs - 1 - r + 32 w, i.e. uint64 word x // 64 shifted right by x % 64."""
    x = (bs - 1 - np.arange(bs))[:, None] + 32 * np.arange(bs // 32)
    shift = (x % 64).astype(np.uint64)
    return x // 64, x // 64 + 1, shift, np.uint64(63) - shift


def _toeplitz_words(bits: np.ndarray, bs: int) -> np.ndarray:
    """(K, 2 bs + 64) bool, entry bs - 1 - r + c the bit of element (r, c) (d = t + r - c, from
    ``_d_offsets``) -> the blocks' words (K, bs * bs // 64). Rows are shifted windows of one bit
    string, so the words are read out of it by 64-bit shifts instead of packing K x bs x bs bits."""
    string = np.packbits(bits, axis=-1, bitorder="little").view("<u8")
    lo, hi, shift, back = _toeplitz_reads(bs)
    words = (string[:, lo] >> shift) | ((string[:, hi] << np.uint64(1)) << back)
    return (words & np.uint64(0xFFFFFFFF)).astype(np.uint32, order="C").reshape(bits.shape[0], -1).view(np.int64)


def _in_range(rows, cols, bs: int):
    """Per row class, its rows in range as a mask (R, .) of -1 or 0 (an int64 word never straddles
    two rows); per column class, its columns in range (C, .); and a full block of each (row class,
    column class), (R, C, .). All in block words."""
    r = np.arange(bs)
    row_in = -np.repeat(r < rows[1][:, None], bs // 64, axis=1).astype(np.int64)
    col_in = np.tile(_pack(r < cols[1][:, None]).view(np.int64), bs)
    return row_in, col_in, row_in[:, None] & col_in


def _band_global_bits(band_bits: np.ndarray, rows, cols, bs: int):
    """Words (Kd, R, C, .) of each (diagonal class, row class, column class): band or row global or
    column global, cut to the positions in range; and those of full blocks (R, C, .)."""
    row_in, col_in, full = _in_range(rows, cols, bs)
    band = band_bits[:, None]
    if cols[2].any():
        band = band | np.tile(_pack(cols[2]).view(np.int64), bs)
    words = (band & col_in)[:, None] & row_in[:, None]  # (Kd, R, C, .)
    if rows[2].any():
        words = words | (-np.repeat(rows[2], bs // 64, axis=1).astype(np.int64))[:, None] & full
    return words, full


def _classify(words: np.ndarray, full: np.ndarray, bs: int):
    """State of each class (int32: ``_NONE``, ``_FULL`` or a row of the returned bits) from its words
    (..., bs * bs // 64) int64 and those of a full block of it; and the bits (P, bs, bs // 32) int32
    of the partial classes."""
    is_full = (words == full).all(-1)
    is_none = ~words.any(-1)
    partial = ~is_full & ~is_none
    row = np.cumsum(partial.ravel()).reshape(partial.shape) - 1
    state = np.where(is_full, _FULL, np.where(partial, row, _NONE)).astype(np.int32)
    return state, words[partial].view(np.int32).reshape(-1, bs, bs // 32)


_PLANS = 64  # host plans kept


class _Plan(NamedTuple):
    """Everything the device needs to build one mask, in one int32 buffer (never written: plans are
    cached and shared)."""

    seq_lengths: tuple[int, int]
    bs: int
    width: int  # the widest row: the width of kv_indices
    two_step: bool  # the table takes two lookups
    buffer: np.ndarray
    shapes: tuple[tuple[int, ...], ...]
    # Plans of bands and unions also carry their rows' key blocks, worked out on the host
    # (_row_lists), after the arrays above: then _realise skips the table.
    row_lists: int = 0  # trailing arrays of them: 2 ((H, nq, narrow) indices, states), 4 (rows holding globals)
    offsets: tuple[int, ...] = ()  # where each array starts in the buffer


class _Runs(NamedTuple):
    """Rows whose key blocks are those of a run ``k0..k1`` (empty when k1 < k0) that hold an
    allowed pair (all of them when ``drawn`` is given), the key blocks ``g``
    (sorted, distinct) that hold global tokens, and for each head the full ``random`` blocks
    (H, nq, r) outside those two (the others replaced by nk) or None, and the same as ``drawn``;
    rows ``full_rows`` (holding a global token) list every key block."""

    k0: np.ndarray  # (nq,)
    k1: np.ndarray  # (nq,)
    g: np.ndarray  # (ng,)
    full_rows: np.ndarray  # (nq,) bool
    random: np.ndarray | None = None  # (H, nq, r), nk where already listed
    drawn: np.ndarray | None = None  # (H, nq, r): the random blocks as drawn (each made full)


def _lookup(lut: list[np.ndarray], qb: np.ndarray, kb: np.ndarray) -> np.ndarray:
    """The block table at (qb, kb) (broadcasting), on the host: what _realise's lookup computes."""
    if len(lut) == 6:
        table, a, b, diag, ca, cb = lut
        return table[diag[ca[qb] + cb[kb]] + a[qb] + b[kb]]
    table, a, b = lut
    return table[a[qb] + b[kb]]


def _row_lists(runs: _Runs, lut: list[np.ndarray], counts: np.ndarray, nk: int) -> list[np.ndarray]:
    """Every row's key blocks and their states (the kv_indices / kv_partial entries), on the host:
    for rows without a global token (H, nq, narrow) arrays, 0 / _FULL past a row's count; rows
    holding one list every key block: their first ``narrow`` entries are in those arrays, the
    states of the rest in a (H * (nf + 1), nk - narrow) table that follows, with each (head,
    query block)'s row of it (the last of a head's nf + 1: all _FULL, for rows without one)."""
    k0, k1, g = runs.k0[:, None], runs.k1[:, None], runs.g
    nq, ng = runs.k0.size, g.size
    length = np.maximum(k1 - k0 + 1, 0)
    before = np.searchsorted(g, k0)
    inside = np.where(length > 0, np.searchsorted(g, k1, side="right") - before, 0)
    width = int(np.where(runs.full_rows, 0, (length + ng - inside)[:, 0]).max(initial=0))
    p = np.arange(width)[None]
    gp = np.append(g, 0)  # (padded: g may be empty)
    idx = np.where(p < before, gp[np.minimum(p, max(ng - 1, 0))], k0 + p - before)
    idx = np.where(p >= before + length, gp[np.clip(p - length + inside, 0, max(ng - 1, 0))], idx)
    idx = np.where(p < length + ng - inside, idx, nk)[None]  # nk: no block
    if runs.random is not None:  # merge the drawn blocks not listed yet
        idx = np.sort(np.concatenate([np.broadcast_to(idx, (runs.random.shape[0], *idx.shape[1:])), runs.random], -1))
    narrow = int(np.where(runs.full_rows, 0, counts).max(initial=0))
    live = idx < nk
    qb = np.arange(nq)[None, :, None]
    state = np.where(live, _lookup(lut, qb, np.where(live, idx, 0)), _FULL)
    if runs.drawn is None:  # a run may pass key blocks with no allowed pair (dilations): drop them
        live &= state != _NONE
        order = np.argsort(~live, axis=-1, kind="stable")
        idx, state, live = (np.take_along_axis(x, order, -1) for x in (idx, state, live))
        state = np.where(live, state, _FULL)
    idx, state, live = idx[..., :narrow], state[..., :narrow], live[..., :narrow]
    full = np.flatnonzero(runs.full_rows)
    full_state = np.broadcast_to(_lookup(lut, full[:, None], np.arange(nk)[None]), (idx.shape[0], full.size, nk))
    if runs.drawn is not None:  # drawn blocks are full, also where the band or a global column lists them
        state = np.where(live & (state == _NONE), _FULL, state)
        hit = (idx[..., :, None] == runs.drawn[..., None, :]).any(-1) & live
        state = np.where(hit, _FULL, state)
        full_state = full_state.copy()
        drawn_full = runs.drawn[:, full]  # (H, nf, r)
        hh, ff = np.meshgrid(np.arange(idx.shape[0]), np.arange(full.size), indexing="ij")
        full_state[hh[..., None], ff[..., None], drawn_full] = _FULL
    idx = np.where(live, idx, 0)
    if not full.size:
        return [idx, state]
    # Rows holding a global token: their first `narrow` entries here, the rest in `tails` (and a
    # last row of _FULL for the others), which `rows` picks for each (head, query block).
    h, nf = idx.shape[0], full.size
    idx = np.where(runs.full_rows[:, None], np.arange(narrow), idx)
    state = state.copy()
    state[:, full] = full_state[..., :narrow]
    tails = np.concatenate([full_state[..., narrow:], np.full((h, 1, nk - narrow), _FULL)], 1)
    rows = np.full((h, nq), nf)
    rows[:, full] = np.arange(nf)
    rows += np.arange(h)[:, None] * (nf + 1)
    return [idx, state, tails.reshape(h * (nf + 1), nk - narrow), rows.ravel()]


def _plan(lengths, bs, state, coord, diag_cls, rows, cols, bits, counts, runs=None) -> _Plan:
    """Plan of the block table ``state[diag_cls[coord_q[qb] + coord_k[kb]], rows[qb], cols[kb]]``
    (``coord``: the diagonal's coordinate split into a query and a key part), with the partial
    blocks' ``bits`` and each row's number of key blocks ``counts`` (H|1, nq). One lookup step
    unless its table would exceed ``_LUT_MAX`` entries. With ``runs`` (_Runs, which also carries
    BigBird's random blocks) the rows' key blocks are known without the table, which _realise then
    looks up only where a row lists a block."""
    kd, nr, nc = state.shape
    rc = nr * nc
    if kd == 1:
        lut = [state.ravel(), rows * nc, cols]
    elif diag_cls.size * rc <= _LUT_MAX:
        lut = [state[diag_cls].ravel(), coord[0] * rc + rows * nc, coord[1] * rc + cols]
    else:
        lut = [state.ravel(), rows * nc, cols, diag_cls * rc, coord[0], coord[1]]
    arrays = [*lut, bits, counts, np.arange(cols.size)]
    arrays.append(cta_schedule(counts.max(0)))  # the attention's, from the host's row counts
    lists = [] if runs is None else _row_lists(runs, [x.astype(np.int64) for x in lut], counts, cols.size)
    arrays += lists
    buffer = np.concatenate([x.ravel() for x in arrays]).astype(np.int32)
    shapes = tuple(x.shape for x in arrays)
    offsets = (0, *itertools.accumulate(x.size for x in arrays[:-1]))
    return _Plan(lengths, bs, int(counts.max()), len(lut) == 6, buffer, shapes, len(lists), offsets)


_PINNED: dict[int, tuple[np.ndarray, torch.Tensor]] = {}
# Pinned buffers that a CUDA graph's copy reads at every replay: kept for the process (never evicted
# nor cleared), by plan buffer, so recapturing a pattern adds nothing.
_CAPTURED: dict[int, tuple[np.ndarray, torch.Tensor]] = {}


def _pinned(plan: _Plan) -> torch.Tensor:
    """The plan's buffer in page-locked memory (made once per plan): a copy from pageable memory
    would wait for the stream's earlier work; from pinned memory it is queued like a kernel. Plan
    buffers are never written, so the copy may still be in flight when the builder returns."""
    hit = _PINNED.get(id(plan.buffer))
    if hit is None or hit[0] is not plan.buffer:
        if len(_PINNED) >= _PLANS:
            _PINNED.pop(next(iter(_PINNED)))
        hit = _PINNED[id(plan.buffer)] = (plan.buffer, torch.from_numpy(plan.buffer).pin_memory())
    return hit[1]


def _realise(plan: _Plan, dev: torch.device, compact: bool = False) -> BlockSparseMask:
    """The mask of a plan on ``dev``: one host-to-device copy and a few device ops, none of which
    waits for the device (``compact`` merges identical partial blocks: one sync). Plans with row
    lists are their arrays (views of the copy) unless ``compact``; only band plans are realised
    compact, and union plans (whose random blocks live only in their row lists) never are.
    Building a pattern on a GPU is bound by the host's cost per op (5-30 us each on the lent
    H100's host), so each array is one op, and widening rows for global tokens three."""
    if dev.type == "cuda":
        pinned = _pinned(plan)
        if torch.cuda.is_current_stream_capturing():  # the graph copies from this memory at replay
            _CAPTURED[id(plan.buffer)] = (plan.buffer, pinned)
        flat = pinned.to(dev, non_blocking=True)
    else:
        flat = torch.from_numpy(plan.buffer).to(dev, copy=True)

    def part(i: int, lead: tuple[int, ...] = ()) -> torch.Tensor:  # array i of the buffer, on the device
        shape = (*lead, *plan.shapes[i])
        strides = tuple(itertools.accumulate((1, *shape[:0:-1]), operator.mul))[::-1]
        return flat.as_strided(shape, strides, plan.offsets[i])

    n = len(plan.shapes)
    first = 6 if plan.two_step else 3  # the lookup's arrays, then bits, counts, positions
    bits, counts = part(first), part(first + 1, (1,))
    order = part(n - plan.row_lists - 1)  # the arrays end with the schedule, then the row lists
    lengths, block_size = plan.seq_lengths, (plan.bs, plan.bs)
    if plan.row_lists and not compact:
        idx, state = part(n - plan.row_lists, (1,)), part(n - plan.row_lists + 1, (1,))
        if plan.row_lists == 4:  # rows holding a global token list every key block: widen all rows
            _, h, nq, narrow = idx.shape
            nk = plan.shapes[first + 2][0]
            tail = (1, h, nq, nk - narrow)  # key blocks narrow.. (the other rows ignore theirs)
            idx = torch.cat([idx, flat.as_strided(tail, (0, 0, 0, 1), plan.offsets[first + 2] + narrow)], -1)
            tails = torch.index_select(part(n - 2), 0, part(n - 1)).view(tail)
            state = torch.cat([state, tails], -1)
        mask = BlockSparseMask._trusted(counts, idx, state, bits, lengths, block_size)
        mask._order = order
        return mask
    if plan.two_step:
        lut, a, b, diag_lut, ca, cb = (part(i) for i in range(6))
        table = lut[diag_lut[ca[:, None] + cb] + (a[:, None] + b)]
    else:
        lut, a, b = (part(i) for i in range(3))
        table = lut[a[:, None] + b]
    nk = table.shape[-1]
    table = table[None, None]
    if compact:
        mask = BlockSparseMask._from_table(table, bits, lengths, block_size, max_kv_blocks=plan.width)
    else:  # as BlockSparseMask._from_table, with the row counts and the width from the host
        pos = torch.where(table != _NONE, part(first + 2), nk).sort(-1).values[..., : plan.width]
        live = pos < nk
        idx = torch.where(live, pos, 0)
        state = torch.where(live, table.gather(-1, idx.long()), _FULL)
        mask = BlockSparseMask._trusted(counts, idx, state, bits, lengths, block_size)
    mask._order = order
    return mask


def _clear_plans() -> None:
    """Forget the cached host plans (to time or test the whole build)."""
    _PINNED.clear()
    for cached in (_band_plan, _union_plan, _dilated_2d_plan):
        cached.cache_clear()


def _band_counts(state, diag_cls, rows_cls, cols_cls, nq: int, nk: int) -> np.ndarray:
    """(nq,) key blocks listed by each query block of a band-only mask (no global tokens), by prefix
    sums along the diagonals. Key blocks kb < nk - 1 share one class; the last may differ."""
    listed = (state != _NONE)[diag_cls]  # (nq + nk - 1, R, C), by m + nk - 1
    plain, last = listed[:, :, cols_cls[0]], listed[:, :, cols_cls[-1]]
    prefix = np.concatenate([np.zeros((1, plain.shape[1]), dtype=np.int64), np.cumsum(plain, 0)])
    q = np.arange(nq)
    # Row qb: key blocks 0..nk-2 lie at m + nk - 1 = qb + nk - 1 .. qb + 1, key block nk - 1 at qb.
    return prefix[q + nk, rows_cls] - prefix[q + 1, rows_cls] + last[q, rows_cls]


def _runs(j_lo: np.ndarray, j_hi: np.ndarray, bs: int, counts: np.ndarray) -> _Runs | None:
    """_Runs of rows whose allowed keys lie in j_lo..j_hi (empty when j_lo > j_hi), or None (the
    plan then takes the device table) when the runs would hold over _RUN_SLACK times the entries
    of the rows' lists: a dilation can leave most blocks of a run without an allowed pair."""
    empty = j_lo > j_hi
    k0, k1 = np.where(empty, 0, j_lo // bs), np.where(empty, -1, j_hi // bs)
    if (k1 - k0 + 1).max(initial=0) > _RUN_SLACK * max(int(counts.max(initial=0)), 1):
        return None
    return _Runs(k0, k1, np.zeros(0, dtype=np.int64), np.zeros(k0.size, dtype=bool))


@functools.lru_cache(maxsize=_PLANS)
def _band_plan(lq: int, lk: int, bs: int, spec: Interval | Dilated | Strided) -> _Plan:
    """A band spec with bs x bs blocks (lq, lk > 0)."""
    nq, nk = math.ceil(lq / bs), math.ceil(lk / bs)
    band = _band_of(spec)
    rows, cols = _block_classes(lq, bs), _block_classes(lk, bs)
    diag_cls, band_bits = _diag_classes(nq, nk, bs, band)
    state, bits = _classify(*_band_global_bits(band_bits, rows, cols, bs), bs)
    counts = _band_counts(state, diag_cls, rows[0], cols[0], nq, nk)
    coord = (np.arange(nq) + (nk - 1), -np.arange(nk))
    runs = None
    if not isinstance(spec, Strided):  # row qb sees keys first_i - hi .. last_i - lo: one run of key blocks
        first = np.arange(nq) * bs
        j_lo = np.maximum(first - band.hi, 0)
        j_hi = np.minimum(np.minimum(first + bs, lq) - 1 - band.lo, lk - 1)
        runs = _runs(j_lo, j_hi, bs, counts)
    return _plan((lq, lk), bs, state, coord, diag_cls, rows[0], cols[0], bits, counts[None], runs=runs)


@functools.lru_cache(maxsize=_PLANS)
def _union_plan(seq_len: int, bs: int, spec: WindowUnion) -> _Plan:
    """A WindowUnion with bs x bs blocks (seq_len > 0)."""
    window, random = spec.window, spec.random
    n = math.ceil(seq_len / bs)
    idx = np.array(spec.global_idx, dtype=np.int64)
    blocks = _block_classes(seq_len, bs, idx)
    diag_cls, band_bits = _diag_classes(n, n, bs, None if window is None else _interval(-(window - 1), window - 1))
    state, bits = _classify(*_band_global_bits(band_bits, blocks, blocks, bs), bs)

    # Row counts: a query block holding a global token lists every key block; another lists its
    # band's run k0..k1 of key blocks, the key blocks holding global tokens, and its random blocks.
    has_global = np.zeros(n, dtype=bool)
    has_global[idx // bs] = True
    if window is None:
        k0, k1 = np.zeros(n, dtype=np.int64), np.full(n, -1)
    else:
        first = np.arange(n) * bs
        k0 = np.maximum(first - (window - 1), 0) // bs
        k1 = np.minimum(first + (window - 1) + bs - 1, seq_len - 1) // bs
    prefix = np.concatenate([[0], np.cumsum(has_global)])
    counts = ((k1 - k0 + 1) + prefix[-1] - (prefix[k1 + 1] - prefix[k0]))[None]
    extra = None
    if random is not None:
        random = _bigbird_random_blocks(seq_len, *random, (bs, bs))
        outside = ((random < k0[:, None]) | (random > k1[:, None])) & ~has_global[random]
        counts = counts + outside.sum(-1)
        extra = np.where(outside, random, n)
    counts = np.where(has_global, n, counts)
    coord = (np.arange(n) + (n - 1), -np.arange(n))
    # Realised from the row lists only: the random blocks are in `runs`, not in the table.
    runs = _Runs(k0, k1, np.flatnonzero(has_global), has_global, extra, random)
    return _plan((seq_len, seq_len), bs, state, coord, diag_cls, blocks[0], blocks[0], bits, counts, runs=runs)


@functools.lru_cache(maxsize=_PLANS)
def _dilated_2d_plan(seq_len: int, bs: int, spec: Dilated2d) -> _Plan:
    """A Dilated2d with bs x bs blocks (seq_len > 0).

    Block b starts at b * bs = s0 * segment + u. Its row r lies in segment s0 + f[r] with
    f[r] = (u + r) // segment, and is active iff ((u + r) % segment) % dilation == 0. So block
    (qb, kb) allows (r, c) iff both are active and f_q[r] - f_k[c] = s0(kb) - s0(qb) =: delta: its
    bits depend on delta, small for any block holding an allowed pair, and on the classes of qb
    and kb (u; when the block stays in one segment only its first active row
    min((-u) % dilation, bs) matters; the ragged last block is a class alone)."""
    segment, dilation = spec.segment, spec.dilation
    n = math.ceil(seq_len / bs)
    start = np.arange(n) * bs
    u, s0 = start % segment, start // segment
    inside = np.minimum(seq_len - start, bs)
    key = np.where(u + bs > segment, bs + 1 + u, np.minimum((-u) % dilation, bs))
    key += (inside < bs) * (bs + 1 + segment)
    first, cls = _classes(key)
    r = np.arange(bs)
    pos = u[first][:, None] + r  # (K, bs)
    f = pos // segment
    active = ((pos % segment) % dilation == 0) & (r < inside[first][:, None])
    span = int(f.max())
    # cols[g, q]: packed columns of class q that are active and lie at segment offset g.
    cols = _pack(active & (f == np.arange(span + 1)[:, None, None]))
    g = f - np.arange(-span, span + 1)[:, None, None]  # (2 span + 1, K, bs): offset row r needs
    ok = active & (g >= 0) & (g <= span)
    words = np.where(ok[:, :, None, :, None], cols[np.clip(g, 0, span)].transpose(0, 1, 3, 2, 4), 0)
    words = np.concatenate([words, np.zeros_like(words[:1])])  # last class: |delta| > span
    words = np.ascontiguousarray(words).reshape(*words.shape[:3], -1).view(np.int64)
    classes = (cls, inside[first], None)
    state, bits = _classify(words, _in_range(classes, classes, bs)[2], bs)

    # delta as a coordinate: s0(kb) - s0(qb) + s_max in [0, 2 s_max].
    s_max = int(s0[-1])
    z = np.arange(-s_max, s_max + 1)
    diag_cls = np.where(abs(z) <= span, z + span, 2 * span + 1)

    # Row counts: the key blocks starting in segment s0(qb) + delta, by class, where listed.
    per_segment = np.zeros((s_max + 1 + 2 * span, first.size), dtype=np.int64)
    np.add.at(per_segment, (s0 + span, cls), 1)
    near = per_segment[s0[:, None] + np.arange(2 * span + 1)]  # (n, 2 span + 1, K)
    listed = (state[: 2 * span + 1] != _NONE).transpose(1, 0, 2)[cls]  # (n, 2 span + 1, K)
    counts = (near * listed).sum((1, 2))
    # Row qb's keys lie in the segments of its first and last rows.
    i1 = np.minimum(start + bs, seq_len) - 1
    j_hi = np.minimum((i1 // segment + 1) * segment, seq_len) - 1
    runs = _runs(s0 * segment, j_hi, bs, counts)
    return _plan((seq_len, seq_len), bs, state, (s_max - s0, s0), diag_cls, cls, cls, bits, counts[None], runs=runs)


def _band_square_candidates(lq: int, lk: int, bs: int, lo: int, hi: int) -> tuple[list[int], int]:
    """The diagonal offsets t of the candidate partial blocks of _band_square, and the widest row."""
    nq = math.ceil(lq / bs)
    bounds = [lo] + ([hi] if hi != _BIG else [])
    t_vals = sorted(
        {
            m * bs
            for b in bounds
            for m in range(math.floor((b - bs + 1) / bs), math.ceil((b + bs - 1) / bs) + 1)
            if abs(m * bs - b) <= bs - 1
        }
    )
    # Widest row, from the band's key range per query block: a host computation, so building the
    # mask on the GPU needs no synchronisation.
    width = 0
    for qb in range(nq):
        j0, j1 = max(qb * bs - hi, 0), min(min(qb * bs + bs, lq) - 1 - lo, lk - 1)
        if j1 >= j0:
            width = max(width, j1 // bs - j0 // bs + 1)
    return t_vals, width


@torch.library.custom_op("sparse_attn::_band_square", mutates_args=())
def _band_square_op(
    lq: int, lk: int, bs: int, lo: int, hi: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Band mask lo <= i - j <= hi with bs x bs blocks, built arithmetically from torch ops alone:
    the form of an interval's plan that torch.compile can trace and a CUDA graph can capture (it
    copies no host array), at about ten times its device ops. An op of its own, so that inductor
    calls it rather than lowering its index arithmetic (which it failed to compile beyond one block).

    Block (qb, kb) holds d = i - j = t + r - c with t = (qb - kb) * bs, inside its rq x ck in-range
    region (rq, ck < bs only for the ragged last block row / column). It is full iff
    lo <= t - (ck - 1) and t + rq - 1 <= hi, empty iff t + rq - 1 < lo or t - (ck - 1) > hi, else
    partial; a partial block's bits depend only on (t, rq, ck), and t (a multiple of bs) must lie
    within bs - 1 of a boundary: at most 4 values, so at most 16 candidate bit patterns, enumerated
    up front. No device synchronisation and no data-dependent shapes. Returns the mask's
    kv_num_blocks, kv_indices, kv_partial and partial_masks (identical partial blocks not merged)."""
    nq, nk = math.ceil(lq / bs), math.ceil(lk / bs)
    t_vals, width = _band_square_candidates(lq, lk, bs, lo, hi)
    rq_vals = (bs, lq - (nq - 1) * bs)
    ck_vals = (bs, lk - (nk - 1) * bs)
    r = torch.arange(bs, device=device)[:, None]
    c = torch.arange(bs, device=device)[None, :]
    cands = [
        (t + r - c >= lo) & (t + r - c <= hi) & (r < rq) & (c < ck) for t in t_vals for rq in rq_vals for ck in ck_vals
    ]
    cands = torch.stack(cands) if cands else torch.zeros(0, bs, bs, dtype=torch.bool, device=device)
    qb = torch.arange(nq, device=device)[:, None]
    kb = torch.arange(nk, device=device)[None, :]
    t = (qb - kb) * bs
    rq = (lq - qb * bs).clamp(max=bs)
    ck = (lk - kb * bs).clamp(max=bs)
    full = (t - (ck - 1) >= lo) & (t + rq - 1 <= hi)
    empty = (t + rq - 1 < lo) | (t - (ck - 1) > hi)
    t_idx = torch.zeros_like(t)
    for n, tv in enumerate(t_vals):
        t_idx = torch.where(t == tv, n, t_idx)
    cand_id = t_idx * 4 + (rq != bs).long() * 2 + (ck != bs).long()
    table = torch.where(full, _FULL, torch.where(empty, _NONE, cand_id)).to(torch.int32)[None, None]
    mask = BlockSparseMask._from_table(table, pack_bits(cands), (lq, lk), (bs, bs), max_kv_blocks=width, compact=False)
    return tuple(t.clone() for t in mask._tensors())


@_band_square_op.register_fake
def _(lq, lk, bs, lo, hi, device):
    nq = math.ceil(lq / bs)
    t_vals, width = _band_square_candidates(lq, lk, bs, lo, hi)
    i32 = {"dtype": torch.int32, "device": device}
    return (
        torch.empty(1, 1, nq, **i32),
        torch.empty(1, 1, nq, width, **i32),
        torch.empty(1, 1, nq, width, **i32),
        torch.empty(len(t_vals) * 4, bs, bs // 32, **i32),
    )


def _band_square(lq: int, lk: int, bs: int, spec: Interval, dev: torch.device) -> BlockSparseMask:
    """An interval's mask from _band_square_op (partial blocks not merged: merging them needs a
    synchronisation, which tracing and graph capture forbid)."""
    hi = spec.hi if spec.hi is not None else _BIG
    tensors = torch.ops.sparse_attn._band_square(lq, lk, bs, spec.lo, hi, dev)
    return BlockSparseMask._trusted(*tensors, (lq, lk), (bs, bs))


# ------------------------------------------------------------------------------------ random blocks
# Up to this many random blocks per row, a drawn block is checked against the earlier picks by a
# scan; beyond it, against a bitmap of all key blocks. The draws are the same either way.
_SCAN_MAX = 32


def _random_key_blocks(rows: int, nk: int, num: int, generator: torch.Generator) -> np.ndarray:
    """(rows, min(num, nk)) int64: distinct key blocks for each row, a uniform draw by Floyd's
    algorithm vectorised over rows (min(num, nk) draws per row, no sort over all nk blocks)."""
    k = min(num, nk)
    if k == nk:
        return np.broadcast_to(np.arange(nk), (rows, nk)).copy()
    out = np.empty((rows, k), dtype=np.int64)
    seen = np.zeros((rows, nk), dtype=bool) if k > _SCAN_MAX else None
    every = np.arange(rows)
    for s, j in enumerate(range(nk - k, nk)):
        pick = torch.randint(0, j + 1, (rows,), generator=generator).numpy()
        taken = seen[every, pick] if seen is not None else (out[:, :s] == pick[:, None]).any(-1)
        pick = np.where(taken, j, pick)
        out[:, s] = pick
        if seen is not None:
            seen[every, pick] = True
    return out


def _bigbird_random_blocks(
    seq_len: int, num_random: int, seed: int, heads: int, block_size: tuple[int, int]
) -> np.ndarray:
    """(heads, nQb, min(num_random, nKb)) int64: the random key blocks of :func:`bigbird`."""
    nq, nk = math.ceil(seq_len / block_size[0]), math.ceil(seq_len / block_size[1])
    gen = torch.Generator().manual_seed(seed)
    return _random_key_blocks(heads * nq, nk, num_random, gen).reshape(heads, nq, min(num_random, nk))
