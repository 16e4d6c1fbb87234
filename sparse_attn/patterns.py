"""Static sparsity patterns, each a :class:`~sparse_attn.BlockSparseMask` with exact element masks.

Every pattern is an element predicate over query position ``i`` and key position ``j``: the pair
is computed iff the predicate holds (pairs past the sequence ends never are). Each builder states
its predicate and parameters; the mask lists a block iff it holds an allowed pair, as a full
block iff every pair of it inside the sequences is allowed, else with the block's exact bits.
Patterns compose with ``|`` and ``&``::

    mask = patterns.sliding_window(L, 256) | patterns.global_tokens(L, [0, 1, 2, 3])

Called without its length, a builder returns a :class:`Pattern` instead, which
``block_sparse_attention`` resolves for each call's (Lq, Lk), bottom-right aligned (the last Lq rows
of the Lk x Lk pattern: prefill and KV-cache decode alike)::

    window = patterns.sliding_window(window=256, sinks=4)   # or patterns.sliding_window(256)
    out = sparse_attn.block_sparse_attention(q, k, v, window, causal=True)  # any Lq <= Lk

The masks are built by ``sparse_attn._mask_compiler``, never over an L x L tensor. With equal
query and key blocks (the default) no pattern synchronises the host with the device
(``causal(compact=True)`` aside), each runs the same few device operations at any length, and a
rebuild with the same arguments reuses the host work of the first. Under ``torch.compile`` or
CUDA graph capture, ``causal`` and ``sliding_window`` are built from torch operations alone; the
other patterns can be captured too. Mixed block sizes take a generic path that synchronises.
"""

from __future__ import annotations

import functools
import math
from collections import OrderedDict
from collections.abc import Callable, Sequence

import numpy as np
import torch

from . import _args
from ._mask_compiler import Dilated, Dilated2d, Interval, RandomBlocks, Strided, WindowUnion, compile_mask
from .masks import _CHUNK, _FULL, _NONE, BlockSparseMask, ExactForm, _check_block_size, _pair, unpack_bits

__all__ = [
    "Pattern",
    "causal",
    "sliding_window",
    "dilated",
    "dilated_2d",
    "strided",
    "global_tokens",
    "longformer",
    "bigbird",
    "random_blocks",
    "documents",
]


def _positive(name: str, value: int, minimum: int = 1) -> int:
    return _args.at_least(name, value, minimum)


def _lengths(lq: int, lk: int) -> tuple[int, int]:
    return _positive("lq", lq, 0), _positive("lk", lk, 0)


def _blocks(block_size: int | tuple[int, int]) -> tuple[int, int]:
    """(q_block, kv_block), checked."""
    pair = _pair(block_size)
    _check_block_size(pair)
    return pair


def _global_idx(seq_len: int, global_idx: Sequence[int] | torch.Tensor) -> tuple[int, ...]:
    """Sorted distinct global tokens (a device tensor is copied to the host: one sync)."""
    if isinstance(global_idx, range):  # sorted and distinct already (once ascending)
        idx = global_idx if global_idx.step > 0 else global_idx[::-1]
    elif isinstance(global_idx, (list, tuple)) and all(isinstance(x, int) for x in global_idx):
        idx = sorted(set(global_idx))  # the common case, without numpy's per-call overhead
    else:
        idx = None
    if idx is not None:
        if idx and (idx[0] < 0 or idx[-1] >= seq_len):
            raise ValueError(f"global_idx must lie in [0, {seq_len}), got values in [{idx[0]}, {idx[-1]}]")
        return tuple(idx)
    if isinstance(global_idx, torch.Tensor):
        idx = global_idx.detach().to("cpu", torch.int64).numpy().ravel()
    else:
        idx = np.asarray(global_idx, dtype=np.int64).ravel()
    if idx.size and (idx.min() < 0 or idx.max() >= seq_len):
        raise ValueError(f"global_idx must lie in [0, {seq_len}), got values in [{idx.min()}, {idx.max()}]")
    return tuple(np.unique(idx).tolist())


# ------------------------------------------------------------------------ length-agnostic patterns
class Pattern:
    """A pattern not bound to lengths: ``builder``'s mask for whatever (Lq, Lk) a call has.

    Made by calling a builder without its length (``patterns.longformer(window=256,
    global_idx=[0])``, ``patterns.sliding_window(256)``) or as ``Pattern(builder, **params)``.
    :meth:`resolve` (which ``block_sparse_attention`` calls) gives the last Lq query rows of the
    builder's Lk x Lk mask: query i sits at position i + Lk - Lq, as causal masks and KV-cache
    decode align it; with Lq > Lk the first Lq - Lk queries see no key. Equal lengths give the
    builder's own mask (its exact form included, so a window still runs as ``flash_attention``);
    other lengths read the square mask's blocks and bits (with Lq < Lk a sliding window keeps its
    exact form, whose flash window is bottom-right aligned too). The last few resolved masks are kept, per
    (Lq, Lk, device); a decode step (Lq = 1, a new Lk each step) costs one square build and
    O(Lq x the pattern's keys) element tests.

    ``causal`` resolves to ``causal(Lq, Lk)`` itself. Patterns combine with ``|`` and ``&`` (each
    side resolved, then combined).
    """

    _KEEP = 8  # resolved masks kept

    def __init__(self, builder: Callable[..., BlockSparseMask], /, **params):
        self.builder, self.params = builder, params
        self._resolved: OrderedDict = OrderedDict()

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.params.items())
        return f"Pattern({getattr(self.builder, '__name__', 'combined')}, {args})"

    def resolve(self, lq: int, lk: int, *, device=None) -> BlockSparseMask:
        """The mask for (Lq, Lk) on ``device`` (None: the CPU)."""
        lq, lk = _lengths(lq, lk)
        dev = torch.device(device) if device is not None else torch.device("cpu")
        key = (lq, lk, dev)
        hit = self._resolved.get(key)
        if hit is not None:
            self._resolved.move_to_end(key)
            return hit
        mask = self._build(lq, lk, dev)
        if not torch.compiler.is_compiling():
            self._resolved[key] = mask
            while len(self._resolved) > self._KEEP:
                self._resolved.popitem(last=False)
        return mask

    def _build(self, lq: int, lk: int, dev: torch.device) -> BlockSparseMask:
        if self.builder is causal:
            return causal(lq, lk, device=dev, **self.params)
        square = self.builder(lk, device=dev, **self.params)
        if lq == lk:
            return square
        rows = _bottom_rows(square, lq)
        form = square.exact_form
        if form is not None and form.kind == "window" and lq < lk:  # (flash's window is not empty above row Lq - Lk)
            rows.exact_form = form
        return rows

    def __or__(self, other: Pattern) -> Pattern:
        return _Combined(self, other, union=True)

    def __and__(self, other: Pattern) -> Pattern:
        return _Combined(self, other, union=False)


class _Combined(Pattern):
    def __init__(self, a: Pattern, b: Pattern, union: bool):
        super().__init__(None, a=a, b=b, op="|" if union else "&")
        self._union = union

    def _build(self, lq: int, lk: int, dev: torch.device) -> BlockSparseMask:
        ma, mb = self.params["a"].resolve(lq, lk, device=dev), self.params["b"].resolve(lq, lk, device=dev)
        return (ma | mb) if self._union else (ma & mb)


def _length_agnostic(single: str | None = None):
    """A builder called without its length (first argument) returns a :class:`Pattern` of it.
    ``single``: the parameter that one positional argument alone stands for
    (``sliding_window(256)`` is ``sliding_window(window=256)``)."""

    def wrap(builder):
        @functools.wraps(builder)
        def call(*args, **kwargs):
            if "seq_len" in kwargs or "lq" in kwargs or len(args) > 1:
                return builder(*args, **kwargs)
            if len(args) == 1:
                if single is None or single in kwargs:
                    return builder(*args, **kwargs)
                kwargs[single] = args[0]
            return Pattern(call, **kwargs)

        return call

    return wrap


def _bottom_rows(square: BlockSparseMask, lq: int) -> BlockSparseMask:
    """The last ``lq`` query rows of a square (Lk, Lk) mask as an (Lq, Lk) mask (Lq > Lk: the
    first Lq - Lk rows empty), read from its block table and bits: only the blocks the rows touch
    are tested, element by element."""
    lk = square.seq_lengths[1]
    bq, bk = square.block_size
    dev = square.device
    off = lk - lq  # new row i is square row i + off
    sq_table = square.block_table()  # (B|1, H|1, nQb, nKb)
    nq = math.ceil(lq / bq) if lq else 0
    qb = torch.arange(nq, device=dev)
    first, last = qb * bq + off, torch.clamp((qb + 1) * bq, max=lq) - 1 + off
    live = last >= 0
    r0 = (first.clamp(0, max(lk - 1, 0)) // bq).long()
    r1 = (last.clamp(0, max(lk - 1, 0)) // bq).long()
    nonempty = sq_table != _NONE
    cand = (nonempty[..., r0, :] | nonempty[..., r1, :]) & live[:, None]
    table = torch.full(cand.shape, _NONE, dtype=torch.int32, device=dev)
    bits = unpack_bits(square.partial_masks, bk)
    if bits.shape[0] == 0:
        bits = torch.zeros(1, bq, bk, dtype=torch.bool, device=dev)

    def allowed(bi, hi, i, j):
        p = i + off
        pc = p.clamp(0, max(lk - 1, 0))
        t = sq_table[bi, hi, pc // bq, j // bk]
        inside = bits[t.clamp(min=0).long(), pc % bq, j % bk]
        return (p >= 0) & ((t == _FULL) | ((t >= 0) & inside))

    return BlockSparseMask._from_predicate(
        table, cand.nonzero(as_tuple=True), allowed, (lq, lk), square.block_size, chunk_elements=_CHUNK
    )


def _sink_columns(seq_len: int, sinks: int, blocks: tuple[int, int], device, causal: bool) -> BlockSparseMask:
    """Keys ``j < sinks`` visible from every query (StreamingLLM's attention sinks); causal: from
    the queries at or after them."""
    bq, bk = blocks
    dev = torch.device(device) if device is not None else torch.device("cpu")
    nq, nk = math.ceil(seq_len / bq), math.ceil(seq_len / bk)
    cand = torch.zeros(1, 1, nq, nk, dtype=torch.bool, device=dev)
    cand[..., : math.ceil(min(sinks, seq_len) / bk)] = True
    table = torch.full(cand.shape, _NONE, dtype=torch.int32, device=dev)

    def allowed(bi, hi, i, j):
        return (j < sinks) & ((j <= i) if causal else (i >= 0))

    return BlockSparseMask._from_predicate(
        table, cand.nonzero(as_tuple=True), allowed, (seq_len, seq_len), blocks, chunk_elements=_CHUNK
    )


def _with_sinks(mask: BlockSparseMask, seq_len: int, sinks: int, blocks, device, causal=False) -> BlockSparseMask:
    sinks = _positive("sinks", sinks, 0)
    return mask if sinks == 0 else mask | _sink_columns(seq_len, sinks, blocks, device, causal)


@_length_agnostic()
def causal(
    lq: int, lk: int, *, block_size: int | tuple[int, int] = 128, device=None, compact: bool = True
) -> BlockSparseMask:
    """Bottom-right aligned causal mask: query i sees key j iff j <= i + (Lk - Lq).

    ``block_sparse_attention`` runs this mask (as built here, not combined with others) as
    ``flash_attention(causal=True)``, the same attention without the mask's block lists.

    With equal query and key blocks the build needs no device synchronisation and has no
    data-dependent shapes when ``compact=False``; ``compact=True`` (default) also merges identical
    partial blocks, which needs one synchronisation. Under ``torch.compile`` or CUDA graph capture
    the mask is built without that merge (whatever ``compact`` says), so it traces at any length.

    Examples
    --------
    >>> from sparse_attn import patterns
    >>> patterns.causal(1024, 1024).density()  # doctest: +ELLIPSIS
    0.56...
    """
    lq, lk = _lengths(lq, lk)
    mask = compile_mask(Interval(-(lk - lq), None), (lq, lk), _blocks(block_size), device, compact=compact)
    mask.exact_form = ExactForm("causal", lq, lk)
    return mask


@_length_agnostic(single="window")
def sliding_window(
    seq_len: int,
    window: int | tuple[int, int],
    *,
    causal: bool = False,
    sinks: int = 0,
    block_size: int | tuple[int, int] = 128,
    device=None,
) -> BlockSparseMask:
    """A band around the diagonal.

    ``window`` an int w: ``|i - j| < w`` (w - 1 keys on each side and the query's own: 2w - 1
    keys); causal: ``0 <= i - j < w`` (the w most recent keys, itself included).
    ``window`` a pair (left, right): FlashAttention's convention, as ``flash_attention(window=...)``
    takes it: ``i - left <= j <= i + right`` (left + right + 1 keys), so that a setting ports
    between the two unchanged; ``causal`` then caps right at 0. ``sliding_window(L, w)`` is
    ``sliding_window(L, (w - 1, w - 1))``, and ``flash_attention(window=w)`` is
    ``sliding_window(L, (w, w))``.

    ``sinks`` > 0: the first ``sinks`` keys too, for every query (causal: every query at or after
    them): StreamingLLM's attention sinks.

    ``block_sparse_attention`` runs this mask (as built here without sinks, not combined with
    others) as ``flash_attention`` with the same window, at every block size. Without
    ``seq_len`` (``sliding_window(256)``, ``sliding_window(window=(255, 0), sinks=4)``): a
    :class:`Pattern` for any lengths."""
    seq_len = _positive("seq_len", seq_len, 0)
    if isinstance(window, tuple):
        if len(window) != 2:
            raise ValueError(f"window must be an int or a (left, right) pair, got {window!r}")
        left, right = (_positive(f"window {n}", w, 0) for n, w in zip(("left", "right"), window, strict=True))
        right = 0 if causal else right
    else:
        window = _positive("window", window)
        left, right = window - 1, 0 if causal else window - 1
    # i - j in [-right, left]: flash's (left, right).
    mask = compile_mask(Interval(-right, left), (seq_len, seq_len), _blocks(block_size), device)
    if sinks:
        return _with_sinks(mask, seq_len, sinks, _blocks(block_size), device, causal)
    mask.exact_form = ExactForm("window", left, right)
    return mask


@_length_agnostic()
def dilated(
    seq_len: int, window: int, dilation: int, *, block_size: int | tuple[int, int] = 128, device=None
) -> BlockSparseMask:
    """1-D dilated window (Longformer): ``|i - j| < window`` and ``|i - j| % dilation == 0``.

    ``block_sparse_attention`` runs this mask (as built here, not combined with others) as one
    dense sliding window per residue class ``i mod dilation``, computing no masked pairs."""
    seq_len = _positive("seq_len", seq_len, 0)
    window = _positive("window", window)
    dilation = _positive("dilation", dilation)
    mask = compile_mask(Dilated(window, dilation), (seq_len, seq_len), _blocks(block_size), device)
    # The route of the docstring (every block of the band is partial in the block kernel); with
    # dilation 1 the mask is a sliding window.
    mask.exact_form = (
        ExactForm("dilated", window, dilation) if dilation > 1 else ExactForm("window", window - 1, window - 1)
    )
    return mask


@_length_agnostic()
def strided(
    seq_len: int, stride: int, local: int, *, block_size: int | tuple[int, int] = 128, device=None
) -> BlockSparseMask:
    """Sparse Transformer strided pattern: ``|i - j| < local`` or ``(i - j) % stride == 0``."""
    seq_len = _positive("seq_len", seq_len, 0)
    stride = _positive("stride", stride)
    local = _positive("local", local)
    return compile_mask(Strided(stride, local), (seq_len, seq_len), _blocks(block_size), device)


@_length_agnostic()
def dilated_2d(
    seq_len: int, segment: int, dilation: int, *, block_size: int | tuple[int, int] = 128, device=None
) -> BlockSparseMask:
    """LongNet-style dilated attention: i and j in the same segment of length ``segment``, each at
    a position within it that is a multiple of ``dilation``. Rows at other positions see no key.

    ``block_sparse_attention`` runs this mask (as built here, not combined with others, dilation > 1)
    as dense attention over each segment's attending positions, computing no masked pairs."""
    seq_len = _positive("seq_len", seq_len, 0)
    segment = _positive("segment", segment)
    dilation = _positive("dilation", dilation)
    mask = compile_mask(Dilated2d(segment, dilation), (seq_len, seq_len), _blocks(block_size), device)
    if dilation > 1:  # with dilation 1 every position attends: the block kernel runs the mask
        mask.exact_form = ExactForm("dilated_2d", segment, dilation)
    return mask


@_length_agnostic()
def global_tokens(
    seq_len: int,
    global_idx: Sequence[int] | torch.Tensor,
    *,
    block_size: int | tuple[int, int] = 128,
    device=None,
) -> BlockSparseMask:
    """Global tokens: ``i in global_idx`` or ``j in global_idx`` (they see and are seen by all).

    Pass ``global_idx`` as a list or a CPU tensor: a device tensor has to be read back (one sync)."""
    seq_len = _positive("seq_len", seq_len, 0)
    blocks = _blocks(block_size)
    spec = WindowUnion(None, _global_idx(seq_len, global_idx))
    return compile_mask(spec, (seq_len, seq_len), blocks, device)


@_length_agnostic()
def longformer(
    seq_len: int,
    window: int,
    global_idx: Sequence[int] | torch.Tensor,
    *,
    sinks: int = 0,
    block_size: int | tuple[int, int] = 128,
    device=None,
) -> BlockSparseMask:
    """Longformer: a symmetric sliding window of half-width ``window`` plus global tokens:
    ``|i - j| < window`` or ``i in global_idx`` or ``j in global_idx``; ``sinks``: also
    ``j < sinks``."""
    seq_len = _positive("seq_len", seq_len, 0)
    window = _positive("window", window)
    blocks = _blocks(block_size)
    spec = WindowUnion(window, _global_idx(seq_len, global_idx))
    return _with_sinks(compile_mask(spec, (seq_len, seq_len), blocks, device), seq_len, sinks, blocks, device)


@_length_agnostic()
def bigbird(
    seq_len: int,
    window: int,
    num_global: int,
    num_random: int,
    seed: int = 0,
    *,
    heads: int = 1,
    sinks: int = 0,
    block_size: int | tuple[int, int] = 128,
    device=None,
) -> BlockSparseMask:
    """BigBird (``sinks``: also ``j < sinks``): sliding window ∪ the first ``num_global`` tokens as global tokens ∪
    ``num_random`` random key blocks per query block (seeded; ``heads`` > 1 draws one set per head).

    The random blocks are full blocks: for each head and query block, ``min(num_random, nKb)``
    distinct key blocks drawn uniformly (Floyd's algorithm) from a CPU generator seeded with
    ``seed``, so the same on every device. This draw replaced a top-k over nQb x nKb random scores,
    so a seed now gives other blocks than it did before."""
    seq_len = _positive("seq_len", seq_len, 0)
    window = _positive("window", window)
    _positive("num_global", num_global, 0)
    _positive("num_random", num_random, 0)
    heads = _positive("heads", heads)
    random = (num_random, seed, heads) if num_random else None
    spec = WindowUnion(window, tuple(range(min(num_global, seq_len))), random)
    blocks = _blocks(block_size)
    return _with_sinks(compile_mask(spec, (seq_len, seq_len), blocks, device), seq_len, sinks, blocks, device)


@_length_agnostic()
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
    return compile_mask(RandomBlocks(density, seed, heads), (seq_len, seq_len), _blocks(block_size), device)


def documents(
    cu_seqlens: Sequence[int] | torch.Tensor,
    *,
    causal: bool = False,
    window: int | tuple[int | None, int | None] | None = None,
    block_size: int | tuple[int, int] = 128,
    device=None,
) -> BlockSparseMask:
    """Packed sequences (FlexAttention's document masking): query i sees key j iff both lie in the
    same sequence, and, within it, ``causal`` (j <= i) and ``window`` hold (``flash_attention``'s
    window: an int w or a (left, right) pair, i - left <= j <= i + right; None unbounded).

    ``cu_seqlens``: the sequences' offsets in the packed length, (B + 1,) from 0 to L, non-decreasing
    (as ``flash_attention_varlen`` takes them; a CPU or GPU tensor, or a sequence of ints). The mask
    is (L, L); each query block lists one range of key blocks, full where all its rows see them
    whole. It is what ``flash_attention_varlen`` runs a batch of many short sequences with, built on
    ``device`` (default CPU) by one kernel from one host-to-device copy, never over an L x L
    tensor; with block-sparse patterns of the same L it composes like any mask (``&`` to restrict a
    pattern to each sequence).

    Examples
    --------
    >>> from sparse_attn import patterns
    >>> mask = patterns.documents([0, 100, 300], causal=True)
    >>> mask.seq_lengths, mask.to_dense()[0, 0, 150, 99].item(), mask.to_dense()[0, 0, 150, 100].item()
    ((300, 300), False, True)
    """
    from . import _varlen

    cu = cu_seqlens.tolist() if isinstance(cu_seqlens, torch.Tensor) else list(cu_seqlens)
    if not cu or cu[0] != 0 or any(not isinstance(c, int) or isinstance(c, bool) for c in cu):
        raise ValueError(f"cu_seqlens must be integer offsets (B + 1,) starting at 0, got {cu_seqlens!r}")
    if any(b < a for a, b in zip(cu, cu[1:], strict=False)):
        raise ValueError(f"cu_seqlens must be non-decreasing, got {cu}")
    left, right = _varlen.causal_band(*_args.window_bounds(window), causal)
    bounds = [(a, b, a, b) for a, b in zip(cu, cu[1:], strict=False)]
    blocks = _blocks(block_size)
    dev = torch.device(device) if device is not None else torch.device("cpu")
    return _varlen.document_mask(bounds, cu[-1], cu[-1], left, right, dev, blocks)
