"""Static sparsity patterns, each a :class:`~sparse_attn.BlockSparseMask` with exact element masks.

Every pattern is an element predicate over query position ``i`` and key position ``j``: the pair
is computed iff the predicate holds (pairs past the sequence ends never are). Each builder states
its predicate and parameters; the mask lists a block iff it holds an allowed pair, as a full
block iff every pair of it inside the sequences is allowed, else with the block's exact bits.
Patterns compose with ``|`` and ``&``::

    mask = patterns.sliding_window(L, 256) | patterns.global_tokens(L, [0, 1, 2, 3])

The masks are built by ``sparse_attn._mask_compiler``, never over an L x L tensor. With equal
query and key blocks (the default) no pattern synchronises the host with the device
(``causal(compact=True)`` aside), each runs the same few device operations at any length, and a
rebuild with the same arguments reuses the host work of the first. Under ``torch.compile`` or
CUDA graph capture, ``causal`` and ``sliding_window`` are built from torch operations alone; the
other patterns can be captured too. Mixed block sizes take a generic path that synchronises.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from ._mask_compiler import Dilated, Dilated2d, Interval, RandomBlocks, Strided, WindowUnion, compile_mask
from .masks import BlockSparseMask, ExactForm, _check_block_size, _pair

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


def _positive(name: str, value: int, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return value


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


def sliding_window(
    seq_len: int,
    window: int | tuple[int, int],
    *,
    causal: bool = False,
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

    ``block_sparse_attention`` runs this mask (as built here, not combined with others) as
    ``flash_attention`` with the same window, at every block size."""
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
    mask.exact_form = ExactForm("window", left, right)
    return mask


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


def strided(
    seq_len: int, stride: int, local: int, *, block_size: int | tuple[int, int] = 128, device=None
) -> BlockSparseMask:
    """Sparse Transformer strided pattern: ``|i - j| < local`` or ``(i - j) % stride == 0``."""
    seq_len = _positive("seq_len", seq_len, 0)
    stride = _positive("stride", stride)
    local = _positive("local", local)
    return compile_mask(Strided(stride, local), (seq_len, seq_len), _blocks(block_size), device)


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


def longformer(
    seq_len: int,
    window: int,
    global_idx: Sequence[int] | torch.Tensor,
    *,
    block_size: int | tuple[int, int] = 128,
    device=None,
) -> BlockSparseMask:
    """Longformer: a symmetric sliding window of half-width ``window`` plus global tokens:
    ``|i - j| < window`` or ``i in global_idx`` or ``j in global_idx``."""
    seq_len = _positive("seq_len", seq_len, 0)
    window = _positive("window", window)
    blocks = _blocks(block_size)
    spec = WindowUnion(window, _global_idx(seq_len, global_idx))
    return compile_mask(spec, (seq_len, seq_len), blocks, device)


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
    return compile_mask(spec, (seq_len, seq_len), _blocks(block_size), device)


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
