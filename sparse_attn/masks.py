"""Block-sparse masks: which (query block, key block) pairs attention computes.

A :class:`BlockSparseMask` is a compressed sparse row list of key blocks per query block, in the
layout the kernels read:

========================  ===================================  =========================================
field                     shape, dtype                         meaning
========================  ===================================  =========================================
``kv_num_blocks``         (B|1, H|1, nQb) int32                key blocks visited by each query block
``kv_indices``            (B|1, H|1, nQb, maxKb) int32          those key blocks, strictly ascending
``kv_partial``            (B|1, H|1, nQb, maxKb) int32          -1: full block; p >= 0: row p of
                                                               ``partial_masks`` decides per element
``partial_masks``         (P, q_block, kv_block // 32) int32    packed bits: bit ``c % 32`` of word
                                                               ``c // 32`` in row ``r`` allows (r, c)
========================  ===================================  =========================================

Full blocks run with no masking arithmetic; partial blocks are exact to the element, so any
pattern (including one a FlexAttention ``mask_mod`` defines) is computed exactly. Entries past
``kv_num_blocks`` are padding and never read. Keys past the sequence end are always hidden, and
rows past it are never written, so the tail block of a ragged length can be full.

Identical partial blocks share one row of ``partial_masks`` (a square causal mask needs one row,
two with a ragged tail, whatever its length).
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

__all__ = ["BlockSparseMask", "ExactForm", "cta_schedule"]

_BLOCK_SIZES = (64, 128)
# Elements a predicate is evaluated on at once when blocks' bits are computed from it.
_CHUNK = 1 << 24

# Block-table states (see BlockSparseMask.block_table).
_NONE = -2
_FULL = -1


@dataclass(frozen=True)
class ExactForm:
    """The attention a mask is exactly, when a pattern built it (and nothing combined it since).

    ``block_sparse_attention`` runs such a mask in this form instead of through its block lists
    (``sparse_attn.explain`` names the route it takes):

    ==============  ==================  ==================  =================================================
    ``kind``        ``a``               ``b``               runs as
    ==============  ==================  ==================  =================================================
    ``"causal"``    Lq                  Lk                  ``flash_attention(causal=True)``
    ``"window"``    left                right               ``flash_attention(window=(left, right))``
    ``"dilated"``   window              dilation            one sliding window per residue class
    ``"dilated_2d"`` segment            dilation            dense attention over each segment's positions
    ==============  ==================  ==================  =================================================
    """

    kind: str
    a: int
    b: int


def _pair(x: int | Sequence[int], name: str = "block_size") -> tuple[int, int]:
    """An integer, or a pair of them (query side, key side), as a pair; else TypeError naming it."""
    try:
        if not isinstance(x, bool) and not isinstance(x, (tuple, list)):
            v = operator.index(x)
            return (v, v)
        if isinstance(x, (tuple, list)) and len(x) == 2 and not any(isinstance(v, bool) for v in x):
            return (operator.index(x[0]), operator.index(x[1]))
    except TypeError:
        pass
    raise TypeError(f"{name} must be an int or a pair of ints, got {x!r}")


def _check_block_size(block_size: tuple[int, int]) -> None:
    for name, b in zip(("q_block", "kv_block"), block_size, strict=True):
        if b not in _BLOCK_SIZES:
            raise ValueError(f"{name} must be one of {_BLOCK_SIZES}, got {b}")


def pack_bits(bits: torch.Tensor) -> torch.Tensor:
    """(P, QB, KB) bool -> (P, QB, KB // 32) int32, bit ``c % 32`` of word ``c // 32``."""
    p, qb, kb = bits.shape
    words = bits.reshape(p, qb, kb // 32, 32).to(torch.int64)
    weights = torch.ones(32, dtype=torch.int64, device=bits.device) << torch.arange(32, device=bits.device)
    packed = (words * weights).sum(-1)
    packed = torch.where(packed >= 2**31, packed - 2**32, packed)
    return packed.to(torch.int32)


def unpack_bits(words: torch.Tensor, kv_block: int) -> torch.Tensor:
    """(P, QB, KB // 32) int32 -> (P, QB, KB) bool."""
    shifts = torch.arange(32, dtype=torch.int32, device=words.device)
    bits = (words.unsqueeze(-1) >> shifts) & 1
    return bits.reshape(words.shape[0], words.shape[1], kv_block).bool()


def cta_schedule(weights):
    """The block-sparse kernel's CTA schedule (its ``q_block_order``) from each query block's weight.

    Query blocks far heavier than the mean (global-token rows) run first across every head, so
    they do not finish alone at the end; the rest run one head at a time, heaviest first, so the
    CTAs in flight share that head's K/V in L2.

    Parameters
    ----------
    weights : Tensor or numpy array, (nQb,) integer
        Key blocks of each query block's widest row: ``kv_num_blocks.amax(dim=(0, 1))``.

    Returns
    -------
    Tensor or numpy array, (nQb + 1,) int32
        The query blocks by weight, descending (ties in block order), then the number of blocks
        weighing more than twice the mean weight. A tensor for a tensor, on its device (no
        synchronisation: the attention makes it on the mask's device); a numpy array for an
        array (the pattern builders make it from their host plans).

    Examples
    --------
    >>> cta_schedule(torch.tensor([2, 9, 2, 1], dtype=torch.int32))
    tensor([1, 0, 2, 3, 1], dtype=torch.int32)
    """
    # Both compare weight > 2 * mean in integers: exact at any length.
    if isinstance(weights, torch.Tensor):
        w = weights.long()
        heavy = (w * w.numel() > 2 * w.sum()).sum().reshape(1)
        return torch.cat([torch.argsort(w, descending=True, stable=True), heavy]).to(torch.int32)
    # The same in numpy: a host plan made with torch ops would pay their cost per op (~10 % of it).
    w = np.asarray(weights, dtype=np.int64)
    heavy = np.count_nonzero(w * w.size > 2 * w.sum())
    return np.append(np.argsort(-w, kind="stable"), heavy).astype(np.int32)


class BlockSparseMask:
    """Which (query block, key block) pairs to compute, with exact element masks in partial blocks.

    Build one with a pattern from :mod:`sparse_attn.patterns`, or with :meth:`from_block_matrix`,
    :meth:`from_element_mask` or :meth:`from_flex`. Masks with the same lengths and block sizes
    compose with ``|`` (union) and ``&`` (intersection); a size-1 batch or head dimension
    broadcasts.

    Parameters
    ----------
    kv_num_blocks, kv_indices, kv_partial, partial_masks : Tensor
        The compressed layout described in the module docstring (int32).
    seq_lengths : (int, int)
        (Lq, Lk) the mask was built for.
    block_size : int or (int, int)
        (q_block, kv_block), each 64 or 128.
    validate : bool
        Check every index (one device synchronisation). Constructors of this module build valid
        masks and skip it; the kernels never read out of range even for an unchecked mask.

    Examples
    --------
    >>> import torch, sparse_attn
    >>> blocks = torch.tensor([[1, 0], [1, 1]], dtype=torch.bool)
    >>> mask = sparse_attn.BlockSparseMask.from_block_matrix(blocks, seq_lengths=(256, 256))
    >>> mask.density()
    0.75
    """

    def __init__(
        self,
        kv_num_blocks: torch.Tensor,
        kv_indices: torch.Tensor,
        kv_partial: torch.Tensor,
        partial_masks: torch.Tensor,
        *,
        seq_lengths: tuple[int, int],
        block_size: int | tuple[int, int] = 128,
        validate: bool = True,
    ):
        if not isinstance(seq_lengths, (tuple, list)) or len(seq_lengths) != 2:
            raise TypeError(f"seq_lengths must be a pair (Lq, Lk) of ints, got {seq_lengths!r}")
        seq_lengths = _pair(seq_lengths, "seq_lengths")
        self._assign(kv_num_blocks, kv_indices, kv_partial, partial_masks, seq_lengths, _pair(block_size))
        _check_block_size(self.block_size)
        self._check_layout()
        if validate:
            self.validate()

    def _assign(self, kv_num_blocks, kv_indices, kv_partial, partial_masks, seq_lengths, block_size) -> None:
        self.kv_num_blocks = kv_num_blocks
        self.kv_indices = kv_indices
        self.kv_partial = kv_partial
        self.partial_masks = partial_masks
        self.seq_lengths = (int(seq_lengths[0]), int(seq_lengths[1]))
        self.block_size = block_size
        # The attention kernel's CTA schedule for this mask (see cta_schedule), made on first use
        # (or by the pattern builders, from their host plan) and kept: the mask is not modified.
        self._order: torch.Tensor | None = None
        # Set by the pattern builders when the mask is exactly their pattern (see ExactForm);
        # dropped by every operation that changes the mask.
        self.exact_form: ExactForm | None = None
        # The mask intersected with the causal pattern, made on the first causal=True call of
        # block_sparse_attention and kept (the mask is not modified).
        self._causal: BlockSparseMask | None = None

    @classmethod
    def _trusted(cls, kv_num_blocks, kv_indices, kv_partial, partial_masks, seq_lengths, block_size) -> BlockSparseMask:
        """A mask from tensors a builder of this package laid out (int32, on one device, of
        consistent shapes; ``block_size`` a valid pair), without the layout checks: their Python
        cost is a tenth of building a pattern on a GPU."""
        mask = cls.__new__(cls)
        mask._assign(kv_num_blocks, kv_indices, kv_partial, partial_masks, seq_lengths, block_size)
        return mask

    # ------------------------------------------------------------------ shape
    @property
    def q_block(self) -> int:
        return self.block_size[0]

    @property
    def kv_block(self) -> int:
        return self.block_size[1]

    @property
    def num_q_blocks(self) -> int:
        return math.ceil(self.seq_lengths[0] / self.q_block)

    @property
    def num_kv_blocks(self) -> int:
        return math.ceil(self.seq_lengths[1] / self.kv_block)

    @property
    def shape(self) -> tuple[int, int, int, int]:
        """(B|1, H|1, num_q_blocks, num_kv_blocks)."""
        b, h, nq = self.kv_num_blocks.shape
        return (b, h, nq, self.num_kv_blocks)

    @property
    def device(self) -> torch.device:
        return self.kv_num_blocks.device

    def to(self, device: torch.device | str) -> BlockSparseMask:
        moved = BlockSparseMask(
            *(t.to(device) for t in self._tensors()),
            seq_lengths=self.seq_lengths,
            block_size=self.block_size,
            validate=False,
        )
        moved._order = None if self._order is None else self._order.to(device)
        moved.exact_form = self.exact_form
        return moved

    def _tensors(self):
        return (self.kv_num_blocks, self.kv_indices, self.kv_partial, self.partial_masks)

    def __repr__(self) -> str:
        b, h, nq, nk = self.shape
        return (
            f"BlockSparseMask(shape=({b}, {h}, {nq}, {nk}), seq_lengths={self.seq_lengths}, "
            f"block_size={self.block_size}, max_kv_blocks={self.kv_indices.shape[-1]}, "
            f"partial_rows={self.partial_masks.shape[0]}, device={self.device})"
        )

    # ------------------------------------------------------------------ checks
    def _check_layout(self) -> None:
        names = ("kv_num_blocks", "kv_indices", "kv_partial", "partial_masks")
        for name, t in zip(names, self._tensors(), strict=True):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
            if t.dtype != torch.int32:
                raise TypeError(f"{name} must be int32, got {t.dtype}")
            if t.device != self.kv_num_blocks.device:
                raise ValueError(f"{name} is on {t.device} but kv_num_blocks is on {self.kv_num_blocks.device}")
        if self.kv_num_blocks.dim() != 3:
            raise ValueError(
                f"kv_num_blocks must be 3-D (B|1, H|1, num_q_blocks), got shape {tuple(self.kv_num_blocks.shape)}"
            )
        if self.kv_num_blocks.shape[2] != self.num_q_blocks:
            raise ValueError(
                f"kv_num_blocks has {self.kv_num_blocks.shape[2]} query blocks, but Lq={self.seq_lengths[0]} "
                f"with q_block={self.q_block} needs {self.num_q_blocks}"
            )
        if self.kv_indices.dim() != 4 or self.kv_indices.shape[:3] != self.kv_num_blocks.shape:
            raise ValueError(
                f"kv_indices must have shape {tuple(self.kv_num_blocks.shape)} + (max_kv_blocks,), "
                f"got {tuple(self.kv_indices.shape)}"
            )
        if self.kv_partial.shape != self.kv_indices.shape:
            raise ValueError(
                f"kv_partial must have the shape of kv_indices {tuple(self.kv_indices.shape)}, "
                f"got {tuple(self.kv_partial.shape)}"
            )
        want = (self.q_block, self.kv_block // 32)
        if self.partial_masks.dim() != 3 or tuple(self.partial_masks.shape[1:]) != want:
            raise ValueError(
                f"partial_masks must have shape (P, {want[0]}, {want[1]}), got {tuple(self.partial_masks.shape)}"
            )

    def validate(self) -> None:
        """Raise ``ValueError`` unless every listed block is in range, ascending and unique."""
        cnt, idx, part = self.kv_num_blocks, self.kv_indices, self.kv_partial
        maxk = idx.shape[-1]
        if cnt.numel() == 0:
            return
        if int(cnt.min()) < 0 or int(cnt.max()) > maxk:
            raise ValueError(f"kv_num_blocks must lie in [0, {maxk}] (the width of kv_indices)")
        live = torch.arange(maxk, device=idx.device) < cnt.unsqueeze(-1)
        if bool(((idx < 0) | (idx >= self.num_kv_blocks))[live].any()):
            raise ValueError(f"kv_indices out of range: every listed block must lie in [0, {self.num_kv_blocks})")
        if maxk > 1 and bool((idx[..., 1:] <= idx[..., :-1])[live[..., 1:]].any()):
            raise ValueError("kv_indices must be strictly increasing within each query block (sorted, no duplicates)")
        npart = self.partial_masks.shape[0]
        if bool(((part < -1) | (part >= npart))[live].any()):
            raise ValueError(f"kv_partial entries must be -1 (full) or a row of partial_masks in [0, {npart})")

    # ------------------------------------------------------------------ block table
    def block_table(self) -> torch.Tensor:
        """(B|1, H|1, nQb, nKb) int32: -2 not computed, -1 full, p >= 0 partial with bits row p."""
        b, h, nq, nk = self.shape
        table = torch.full((b, h, nq, nk + 1), _NONE, dtype=torch.int32, device=self.device)
        maxk = self.kv_indices.shape[-1]
        live = torch.arange(maxk, device=self.device) < self.kv_num_blocks.unsqueeze(-1)
        # Padding entries are sent to the extra column nk, dropped below.
        col = torch.where(live, self.kv_indices, nk).long()
        table.scatter_(-1, col, torch.where(live, self.kv_partial, _NONE))
        return table[..., :nk].contiguous()

    @classmethod
    def _from_table(
        cls,
        table: torch.Tensor,
        partial_masks: torch.Tensor,
        seq_lengths: tuple[int, int],
        block_size: tuple[int, int],
        *,
        max_kv_blocks: int | None = None,
        compact: bool = True,
    ) -> BlockSparseMask:
        """Compress a block table. ``max_kv_blocks`` (when known) avoids a device synchronisation;
        ``compact`` drops unused and duplicate rows of ``partial_masks`` (one synchronisation)."""
        nk = table.shape[-1]
        if compact and partial_masks.shape[0] > 0:
            table, partial_masks = _compact_partials(table, partial_masks)
        on = table != _NONE
        counts = on.sum(-1, dtype=torch.int32)
        if max_kv_blocks is None:
            max_kv_blocks = int(counts.max()) if counts.numel() else 0
        arange = torch.arange(nk, device=table.device, dtype=torch.int32)
        pos = torch.where(on, arange, nk).sort(-1).values[..., :max_kv_blocks]
        live = pos < nk
        idx = torch.where(live, pos, 0)
        part = torch.gather(table, -1, idx.long()).masked_fill(~live, _FULL)
        return cls(
            counts.contiguous(),
            idx.to(torch.int32).contiguous(),
            part.to(torch.int32).contiguous(),
            partial_masks.contiguous(),
            seq_lengths=seq_lengths,
            block_size=block_size,
            validate=False,
        )

    # ------------------------------------------------------------------ constructors
    @classmethod
    def from_block_matrix(
        cls,
        blocks: torch.Tensor,
        *,
        seq_lengths: tuple[int, int],
        block_size: int | tuple[int, int] = 128,
    ) -> BlockSparseMask:
        """Full blocks where ``blocks`` is True.

        ``blocks`` is bool (nQb, nKb) or (B|1, H|1, nQb, nKb) with nQb = ceil(Lq / q_block) and
        nKb = ceil(Lk / kv_block).
        """
        block_size = _pair(block_size)
        _check_block_size(block_size)
        if not isinstance(blocks, torch.Tensor) or blocks.dtype != torch.bool:
            raise TypeError("blocks must be a bool tensor")
        if blocks.dim() == 2:
            blocks = blocks[None, None]
        want = tuple(math.ceil(s / b) for s, b in zip(seq_lengths, block_size, strict=True))
        if blocks.dim() != 4 or tuple(blocks.shape[2:]) != want:
            raise ValueError(
                f"blocks must have shape (B|1, H|1, {want[0]}, {want[1]}) for seq_lengths={tuple(seq_lengths)} "
                f"and block_size={block_size}, got {tuple(blocks.shape)}"
            )
        table = torch.where(blocks, _FULL, _NONE).to(torch.int32)
        empty = torch.zeros(0, block_size[0], block_size[1] // 32, dtype=torch.int32, device=blocks.device)
        return cls._from_table(table, empty, tuple(seq_lengths), block_size)

    @classmethod
    def from_element_mask(cls, mask: torch.Tensor, *, block_size: int | tuple[int, int] = 128) -> BlockSparseMask:
        """Exact mask from a bool element mask (Lq, Lk) or (B|1, H|1, Lq, Lk), True = attend."""
        block_size = _pair(block_size)
        _check_block_size(block_size)
        if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool:
            raise TypeError("mask must be a bool tensor")
        if mask.dim() == 2:
            mask = mask[None, None]
        if mask.dim() != 4:
            raise ValueError(f"mask must be (Lq, Lk) or (B|1, H|1, Lq, Lk), got shape {tuple(mask.shape)}")
        b, h, lq, lk = mask.shape
        bq, bk = block_size
        nq, nk = math.ceil(lq / bq), math.ceil(lk / bk)
        padded = torch.zeros(b, h, nq * bq, nk * bk, dtype=torch.bool, device=mask.device)
        padded[..., :lq, :lk] = mask
        cand = padded.reshape(b, h, nq, bq, nk, bk).any(5).any(3)  # (b, h, nq, nk): blocks holding a pair
        table = torch.full(cand.shape, _NONE, dtype=torch.int32, device=mask.device)
        where = cand.nonzero(as_tuple=True)
        return cls._from_predicate(
            table, where, lambda bi, hi, i, j: mask[bi, hi, i, j], (lq, lk), block_size, chunk_elements=_CHUNK
        )

    @classmethod
    def _from_predicate(
        cls,
        table: torch.Tensor,
        where: tuple[torch.Tensor, ...],
        allowed: Callable[..., torch.Tensor],
        seq_lengths: tuple[int, int],
        block_size: tuple[int, int],
        *,
        keys: torch.Tensor | None = None,
        chunk_elements: int,
    ) -> BlockSparseMask:
        """The mask of ``table`` (B|1, H|1, nQb, nKb) int32 of ``_FULL`` and ``_NONE``, with its
        candidate blocks ``where`` made full, partial or none by the element predicate: the one
        way every builder turns a predicate into a mask (the generic pattern path, from_flex,
        from_element_mask). ``table`` is written in place.

        ``where`` indexes the table: leading indices (batch, head: any number, none included),
        then query and key blocks, (N,) int64 each. ``allowed(*lead, i, j)`` -> bool (M, QB, KB)
        gets the leading indices of M of these blocks as (M, 1, 1) and their query and key
        positions as (M, QB, 1) and (M, 1, KB), int64; M * QB * KB is at most ``chunk_elements``
        (one block at least). Positions past the sequence ends reach it clamped to the last one,
        as FlexAttention bounds them (a ``mask_mod`` may index a tensor of length Lq or Lk:
        document ids); their bits are dropped.

        ``keys`` (N,) or (N, K) int64: blocks with equal keys have equal bits inside the
        sequences, so only the first block of each key is evaluated (None: every block).
        """
        (lq, lk), (bq, bk) = seq_lengths, block_size
        dev = table.device
        *lead, qb, kb = where
        n = qb.shape[0]
        if n == 0:
            empty = torch.zeros(0, bq, bk // 32, dtype=torch.int32, device=dev)
            return cls._from_table(table, empty, seq_lengths, block_size)
        inverse = None
        if keys is not None:
            # A ragged tail block's bits also depend on how many of its rows and columns are in
            # range: a block must not be listed for pairs it holds only past the ends, and is
            # full when every pair in range is allowed. So its key records both.
            rows_in = (lq - qb * bq).clamp(max=bq)[:, None]
            cols_in = (lk - kb * bk).clamp(max=bk)[:, None]
            keys = torch.cat([keys.reshape(n, -1), rows_in, cols_in], -1)
            uniq, inverse = torch.unique(keys, dim=0, return_inverse=True)
            first = torch.full((uniq.shape[0],), n, dtype=torch.int64, device=dev)
            first = first.scatter_reduce(0, inverse, torch.arange(n, device=dev), reduce="amin")
            lead, qb, kb = [x[first] for x in lead], qb[first], kb[first]
        lead = [x[:, None, None] for x in lead]
        i = qb[:, None, None] * bq + torch.arange(bq, device=dev)[:, None]  # (blocks, QB, 1)
        j = kb[:, None, None] * bk + torch.arange(bk, device=dev)  # (blocks, 1, KB)
        inside = (i < lq) & (j < lk)
        i, j = i.clamp(max=max(lq - 1, 0)), j.clamp(max=max(lk - 1, 0))
        step = max(1, chunk_elements // (bq * bk))
        chunks = [
            (*(x[s : s + step] for x in lead), i[s : s + step], j[s : s + step]) for s in range(0, i.shape[0], step)
        ]
        bits = torch.cat([allowed(*chunk) for chunk in chunks]) & inside
        full = (bits | ~inside).flatten(1).all(-1)
        partial = bits.flatten(1).any(-1) & ~full
        state = torch.full((qb.shape[0],), _NONE, dtype=torch.int32, device=dev)
        state[partial] = torch.arange(int(partial.sum()), dtype=torch.int32, device=dev)
        state[full] = _FULL
        table[(..., *where)] = state if inverse is None else state[inverse]
        return cls._from_table(table, pack_bits(bits[partial]), seq_lengths, block_size)

    @classmethod
    def from_flex(cls, block_mask, *, chunk_elements: int = _CHUNK) -> BlockSparseMask:
        """From a FlexAttention ``BlockMask``: its full blocks stay full; its partial blocks get
        exact bits by evaluating ``block_mask.mask_mod`` over them (vectorised, in chunks)."""
        lq, lk = block_mask.seq_lengths
        block_size = _pair(block_mask.BLOCK_SIZE)
        _check_block_size(block_size)
        nq, nk = math.ceil(lq / block_size[0]), math.ceil(lk / block_size[1])
        cnt, idx = block_mask.kv_num_blocks, block_mask.kv_indices
        if cnt.shape[-1] != nq:
            raise ValueError(f"BlockMask has {cnt.shape[-1]} query blocks, but seq_lengths {lq, lk} need {nq}")
        b, h = cnt.shape[:2]
        dev = cnt.device
        table = torch.full((b, h, nq, nk + 1), _NONE, dtype=torch.int32, device=dev)

        def mark(c, i, value):
            live = torch.arange(i.shape[-1], device=dev) < c.unsqueeze(-1)
            col = torch.where(live & (i >= 0) & (i < nk), i, nk).long()
            table.scatter_(-1, col, torch.where(live, value, _NONE).to(torch.int32).expand_as(col).contiguous())

        mark(cnt, idx, torch.tensor(0, device=dev))  # 0 marks "partial, bits pending"
        if block_mask.full_kv_num_blocks is not None:
            mark(block_mask.full_kv_num_blocks, block_mask.full_kv_indices, torch.tensor(_FULL, device=dev))
        table = table[..., :nk]
        pending = (table == 0).nonzero(as_tuple=True)
        full = torch.where(table == _FULL, _FULL, _NONE).to(torch.int32)
        allowed = _flex_predicate(block_mask.mask_mod)
        return cls._from_predicate(full, pending, allowed, (lq, lk), block_size, chunk_elements=chunk_elements)

    # ------------------------------------------------------------------ conversions
    def to_dense(self) -> torch.Tensor:
        """(B|1, H|1, Lq, Lk) bool element mask (O(L^2): for tests and small inputs)."""
        table = self.block_table().long()
        (lq, lk), (bq, bk) = self.seq_lengths, self.block_size
        bits = unpack_bits(self.partial_masks, bk)
        bits = torch.cat([bits, torch.zeros(1, bq, bk, dtype=torch.bool, device=self.device)])
        none_row = bits.shape[0] - 1
        b, h, nq, nk = table.shape
        rows = torch.where(table >= 0, table, none_row)
        dense = bits[rows]  # (b, h, nq, nk, bq, bk)
        dense = dense | (table == _FULL)[..., None, None]
        dense = dense.permute(0, 1, 2, 4, 3, 5).reshape(b, h, nq * bq, nk * bk)
        return dense[..., :lq, :lk].contiguous()

    def to_flex_block_mask(self):
        """The same mask as a FlexAttention ``BlockMask`` (full and partial blocks kept apart;
        its ``mask_mod`` reads this mask's bits)."""
        from torch.nn.attention.flex_attention import BlockMask

        table = self.block_table()
        b, h, nq, nk = table.shape
        bq, bk = self.block_size
        arange = torch.arange(nk, device=self.device, dtype=torch.int32)

        def csr(sel):
            counts = sel.sum(-1, dtype=torch.int32)
            pos = torch.where(sel, arange, nk).sort(-1).values
            return counts, torch.where(pos < nk, pos, 0).to(torch.int32).contiguous()

        cnt, idx = csr(table >= 0)
        full_cnt, full_idx = csr(table == _FULL)
        bits = self.partial_masks
        if bits.shape[0] == 0:
            bits = torch.zeros(1, bq, bk // 32, dtype=torch.int32, device=self.device)
        bcast_b, bcast_h = b > 1, h > 1

        def mask_mod(bi, hi, q_idx, kv_idx):
            st = table[bi * bcast_b, hi * bcast_h, q_idx // bq, kv_idx // bk]
            word = bits[st.clamp(min=0), q_idx % bq, (kv_idx % bk) // 32]
            bit = (word >> ((kv_idx % bk) % 32)) & 1
            return (st == _FULL) | ((st >= 0) & (bit == 1))

        return BlockMask.from_kv_blocks(
            cnt, idx, full_cnt, full_idx, BLOCK_SIZE=(bq, bk), mask_mod=mask_mod, seq_lengths=self.seq_lengths
        )

    # ------------------------------------------------------------------ statistics
    def computed_pairs(self) -> torch.Tensor:
        """(B|1, H|1) int64: (query, key) pairs the kernels compute (visited blocks, clipped to
        the sequence lengths)."""
        (lq, lk), (bq, bk) = self.seq_lengths, self.block_size
        dev = self.device
        rows = (lq - torch.arange(self.num_q_blocks, device=dev) * bq).clamp(max=bq)
        cols_per_block = (lk - torch.arange(self.num_kv_blocks, device=dev) * bk).clamp(max=bk)
        live = torch.arange(self.kv_indices.shape[-1], device=dev) < self.kv_num_blocks.unsqueeze(-1)
        # Padding entries past kv_num_blocks may hold anything: never index with them.
        cols = torch.where(live, cols_per_block[torch.where(live, self.kv_indices, 0).long()], 0).sum(-1)
        return (cols * rows).sum(-1)

    def density(self) -> float:
        """Fraction of the Lq x Lk (query, key) pairs computed, averaged over batch and heads."""
        lq, lk = self.seq_lengths
        if lq * lk == 0:
            return 0.0
        return float(self.computed_pairs().double().mean()) / (lq * lk)

    # ------------------------------------------------------------------ composition
    def _check_compatible(self, other: BlockSparseMask) -> None:
        if not isinstance(other, BlockSparseMask):
            raise TypeError(f"cannot combine a BlockSparseMask with {type(other).__name__}")
        if other.seq_lengths != self.seq_lengths or other.block_size != self.block_size:
            raise ValueError(
                f"masks differ: seq_lengths {self.seq_lengths} vs {other.seq_lengths}, "
                f"block_size {self.block_size} vs {other.block_size}"
            )
        if other.device != self.device:
            raise ValueError(f"masks are on different devices: {self.device} and {other.device}")

    def _combine(self, other: BlockSparseMask, union: bool) -> BlockSparseMask:
        self._check_compatible(other)
        ta, tb = torch.broadcast_tensors(self.block_table(), other.block_table())
        pa, pb = self.partial_masks, other.partial_masks
        na = pa.shape[0]
        # Rows of the result's bits: A's rows, then B's rows, then one row per (partial, partial) pair.
        both = (ta >= 0) & (tb >= 0)
        where = both.nonzero(as_tuple=True)
        ra, rb = pa[ta[where].long()], pb[tb[where].long()]
        combined = (ra | rb) if union else (ra & rb)
        out = torch.full_like(ta, _NONE)
        if union:
            out = torch.where((ta >= 0) & (tb == _NONE), ta, out)
            out = torch.where((tb >= 0) & (ta == _NONE), tb + na, out)
            out = torch.where((ta == _FULL) | (tb == _FULL), _FULL, out)
        else:
            out = torch.where((ta >= 0) & (tb == _FULL), ta, out)
            out = torch.where((tb >= 0) & (ta == _FULL), tb + na, out)
            out = torch.where((ta == _FULL) & (tb == _FULL), _FULL, out)
        nb = pb.shape[0]
        out[where] = torch.arange(where[0].shape[0], dtype=torch.int32, device=out.device) + na + nb
        bits = torch.cat([pa, pb, combined])
        if not union and bits.shape[0] > 0:
            # A partial pair can intersect to nothing. (With no partial rows there is nothing to index.)
            empty_rows = (bits == 0).flatten(1).all(-1)
            out = torch.where((out >= 0) & empty_rows[out.clamp(min=0).long()], _NONE, out)
        return BlockSparseMask._from_table(out.to(torch.int32), bits, self.seq_lengths, self.block_size)

    def __or__(self, other: BlockSparseMask) -> BlockSparseMask:
        return self._combine(other, union=True)

    def __and__(self, other: BlockSparseMask) -> BlockSparseMask:
        return self._combine(other, union=False)


def _compact_partials(table: torch.Tensor, bits: torch.Tensor):
    """Drop unused rows of ``bits`` and merge identical ones; renumber the table."""
    flat = bits.flatten(1)
    uniq, inverse = torch.unique(flat, dim=0, return_inverse=True)
    used = torch.zeros(uniq.shape[0] + 1, dtype=torch.bool, device=bits.device)
    live = table >= 0
    new_ids = inverse.to(torch.int32)[table.clamp(min=0).long()]
    used[torch.where(live, new_ids, uniq.shape[0]).flatten().long()] = True
    used = used[:-1]
    renumber = torch.cumsum(used.to(torch.int32), 0, dtype=torch.int32) - 1
    table = torch.where(live, renumber[new_ids.long()], table)
    return table, uniq[used].reshape(-1, *bits.shape[1:])


def _flex_predicate(mask_mod: Callable | None) -> Callable[..., torch.Tensor]:
    """A FlexAttention ``mask_mod`` (one (b, h, q, kv) of scalar tensors -> bool) as a predicate
    over broadcasting position tensors, as ``BlockSparseMask._from_predicate`` calls it: vmap over
    their elements. None (no mask_mod): every pair allowed."""
    if mask_mod is None:
        return lambda *pos: torch.ones(
            torch.broadcast_shapes(*(x.shape for x in pos)), dtype=torch.bool, device=pos[0].device
        )
    fn = torch.vmap(mask_mod, in_dims=(0, 0, 0, 0))

    def allowed(*pos):
        pos = torch.broadcast_tensors(*pos)
        return fn(*(x.reshape(-1) for x in pos)).reshape(pos[0].shape).bool()

    return allowed
