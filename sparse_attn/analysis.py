"""How much accuracy a sparsity choice costs: softmax-mass recall, output error, study inputs.

For a query row, the **recall** of a selection is the share of the row's dense attention
probability (softmax over the keys the row can see) that falls on the selected keys. A recall of
1 means the sparse op drops nothing; ``1 - recall`` bounds how far the sparse output can move,
since sparse attention renormalises over the kept keys: ``||o_sparse - o_dense|| <= 2 (1 - recall)
max_j ||v_j||``. :func:`evaluate` runs a sparse op, compares it with dense
:func:`~sparse_attn.flash_attention`, and summarises recall and error in an :class:`AnalysisResult`;
:func:`to_markdown` turns a list of them into a table. :func:`random_qkv`, :func:`structured_qkv` and
:func:`structured_indexer` make inputs for studies (``benchmarks/accuracy_study.py``).

Scores are computed in fp32 in chunks of query rows, so no (Lq, Lk) matrix is ever held whole:
this works on a CPU in a notebook at the lengths the ops run at.

Examples
--------
>>> import sparse_attn
>>> from sparse_attn import analysis, patterns
>>> q, k, v = analysis.structured_qkv(1, 2, 512, 64, seed=0)
>>> results = [
...     analysis.evaluate(q, k, v, patterns.sliding_window(512, 64, causal=True), causal=True, name="window 64"),
...     analysis.evaluate(q, k, v, 64, causal=True, name="top-64"),
... ]
>>> print(analysis.to_markdown(results).splitlines()[0])
| method | density | rel. error | max abs error | recall mean | recall min | recall p01 |
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from .masks import BlockSparseMask, unpack_bits
from .ops import block_sparse_attention, flash_attention, topk_attention
from .patterns import causal as _causal_pattern

__all__ = [
    "AnalysisResult",
    "evaluate",
    "mask_from_block_indices",
    "max_abs_error",
    "random_qkv",
    "relative_error",
    "softmax_mass_recall",
    "structured_indexer",
    "structured_qkv",
    "to_markdown",
]

# Default chunk: at most this many fp32 scores (B * H * rows * Lk) at a time (256 MiB).
_CHUNK_ELEMENTS = 1 << 26


# ------------------------------------------------------------------------------------ checks
def _check_qk(query, key) -> None:
    for name, t in (("query", query), ("key", key)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            layout = "(B, H, Lq, D)" if name == "query" else "(B, Hkv, Lk, D)"
            raise ValueError(f"{name} must be 4-D {layout}, got {t.dim()}-D")
        if not t.is_floating_point():
            raise TypeError(f"{name} must be a floating point tensor, got {t.dtype}")
    if key.device != query.device:
        raise ValueError(f"query and key must be on the same device, got {query.device} and {key.device}")
    if key.shape[0] != query.shape[0]:
        raise ValueError(f"query and key must have the same batch size, got {query.shape[0]} and {key.shape[0]}")
    if key.shape[3] != query.shape[3]:
        raise ValueError(f"query and key must have the same head dimension, got {query.shape[3]} and {key.shape[3]}")
    h, hkv = query.shape[1], key.shape[1]
    if (hkv == 0 and h != 0) or (hkv > 0 and h % hkv != 0):
        raise ValueError(f"the number of query heads ({h}) must be a multiple of the number of key heads ({hkv})")


def _check_scale(scale, head_dim: int) -> float:
    if scale is None:
        return head_dim**-0.5 if head_dim else 1.0
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise TypeError(f"scale must be a float or None, got {type(scale).__name__}")
    return float(scale)


def _check_chunk_rows(chunk_rows, b: int, h: int, lk: int) -> int:
    if chunk_rows is None:
        return max(1, _CHUNK_ELEMENTS // max(1, b * h * lk))
    if isinstance(chunk_rows, bool) or not isinstance(chunk_rows, int) or chunk_rows <= 0:
        raise ValueError(f"chunk_rows must be a positive int or None, got {chunk_rows!r}")
    return chunk_rows


# ------------------------------------------------------------------------------------ selections
class _Selection:
    """A selection, validated once, that yields its bool rows [r0, r1) as (B|1, H|1, rows, Lk)."""

    def rows(self, r0: int, r1: int) -> torch.Tensor:
        raise NotImplementedError


class _ElementMask(_Selection):
    def __init__(self, mask: torch.Tensor, shape: tuple[int, int, int, int]):
        if mask.dim() > 4:
            raise ValueError(f"selection (a bool mask) must have at most 4 dims, got shape {tuple(mask.shape)}")
        try:
            full = torch.broadcast_shapes(mask.shape, shape)
        except RuntimeError:
            full = None
        if full != torch.Size(shape):
            raise ValueError(
                f"selection (a bool mask) of shape {tuple(mask.shape)} does not broadcast to (B, H, Lq, Lk) = {shape}"
            )
        self.mask = mask.reshape((1,) * (4 - mask.dim()) + tuple(mask.shape))
        self.per_row = self.mask.shape[2] != 1

    def rows(self, r0, r1):
        return self.mask[:, :, r0:r1] if self.per_row else self.mask


class _Indices(_Selection):
    def __init__(self, indices: torch.Tensor, shape: tuple[int, int, int, int]):
        b, h, lq, lk = shape
        if indices.dim() == 3:  # (B, Lq, k): indexer mode, one set per token for every head
            indices = indices.unsqueeze(1)
        if indices.dim() != 4:
            raise ValueError(
                f"selection (indices) must be (B, H|1, Lq, k) or (B, Lq, k), got shape {tuple(indices.shape)}"
            )
        if indices.shape[0] != b or indices.shape[1] not in (1, h) or indices.shape[2] != lq:
            raise ValueError(
                f"selection (indices) must be (B, H|1, Lq, k) or (B, Lq, k) with B={b}, H={h}, Lq={lq}, "
                f"got shape {tuple(indices.shape)}"
            )
        if indices.numel() and (int(indices.min()) < -1 or int(indices.max()) >= lk):
            raise ValueError(
                f"selection (indices) must lie in [0, {lk}) or be -1 (none), "
                f"got values in [{int(indices.min())}, {int(indices.max())}]"
            )
        self.indices = indices
        self.lk = lk

    def rows(self, r0, r1):
        idx = self.indices[:, :, r0:r1]
        sel = torch.zeros(*idx.shape[:3], self.lk + 1, dtype=torch.bool, device=idx.device)
        # -1 goes to the extra column lk, dropped below; a repeated index selects its key once.
        sel.scatter_(-1, torch.where(idx >= 0, idx, self.lk).long(), True)
        return sel[..., : self.lk]


class _Blocks(_Selection):
    """A BlockSparseMask expanded to elements a few rows at a time (never to_dense()'s Lq x Lk)."""

    def __init__(self, mask: BlockSparseMask, shape: tuple[int, int, int, int], device):
        b, h, lq, lk = shape
        if tuple(mask.seq_lengths) != (lq, lk):
            raise ValueError(
                f"selection (a BlockSparseMask) was built for seq_lengths {tuple(mask.seq_lengths)}, "
                f"but query/key have Lq={lq}, Lk={lk}"
            )
        mb, mh = mask.shape[:2]
        if mb not in (1, b) or mh not in (1, h):
            raise ValueError(
                f"selection (a BlockSparseMask) has batch/heads ({mb}, {mh}); expected (1 or {b}, 1 or {h})"
            )
        mask = mask.to(device)
        bq, bk = mask.block_size
        self.bq, self.bk, self.lk = bq, bk, lk
        # block_table(): -2 not computed, -1 full, p >= 0 partial with bits row p. Two rows are
        # appended to the unpacked bits, all-zero (P) and all-one (P + 1), so every state is a row.
        table = mask.block_table()
        p = mask.partial_masks.shape[0]
        self.code = torch.where(table >= 0, table, torch.where(table == -1, p + 1, p)).long()
        bits = unpack_bits(mask.partial_masks, bk)
        self.bits = torch.cat(
            [
                bits,
                torch.zeros(1, bq, bk, dtype=torch.bool, device=device),
                torch.ones(1, bq, bk, dtype=torch.bool, device=device),
            ]
        )

    def rows(self, r0, r1):
        i = torch.arange(r0, r1, device=self.code.device)
        code = self.code[:, :, i // self.bq]  # (B|1, H|1, rows, nKb): block-level, so the index is small
        sel = self.bits[code, (i % self.bq)[:, None]]  # (B|1, H|1, rows, nKb, bk)
        return sel.flatten(-2)[..., : self.lk]


def _as_selection(selection, shape, device) -> _Selection:
    if isinstance(selection, BlockSparseMask):
        return _Blocks(selection, shape, device)
    if type(selection).__name__ == "BlockMask":  # FlexAttention's
        return _Blocks(BlockSparseMask.from_flex(selection), shape, device)
    if not isinstance(selection, torch.Tensor):
        raise TypeError(
            "selection must be a BlockSparseMask, a bool element mask or an int index tensor, "
            f"got {type(selection).__name__}"
        )
    selection = selection.to(device)
    if selection.dtype == torch.bool:
        return _ElementMask(selection, shape)
    if selection.is_floating_point() or selection.is_complex():
        raise TypeError(f"selection must be a bool mask or integer indices, got dtype {selection.dtype}")
    return _Indices(selection, shape)


# ------------------------------------------------------------------------------------ recall
def _recall_and_density(query, key, selection, causal, scale, chunk_rows):
    """Recall (B, H, Lq) fp32, and (selected visible pairs, visible pairs) summed over B and H."""
    _check_qk(query, key)
    causal = bool(causal)
    b, h, lq, d = query.shape
    hkv, lk = key.shape[1], key.shape[2]
    scale = _check_scale(scale, d)
    sel = _as_selection(selection, (b, h, lq, lk), query.device)
    step = _check_chunk_rows(chunk_rows, b, h, lk)
    recall = torch.ones(b, h, lq, dtype=torch.float32, device=query.device)
    n_sel = torch.zeros((), dtype=torch.int64, device=query.device)
    n_vis = 0
    if min(b, h, lq, lk) == 0:
        return recall, 0, 0
    g = h // hkv
    kf = key.float().transpose(-1, -2)  # (B, Hkv, D, Lk): O(Lk) copy, made once
    cols = torch.arange(lk, device=query.device)
    for r0 in range(0, lq, step):
        r1 = min(r0 + step, lq)
        rows = r1 - r0
        # Query heads of one kv head side by side: (B, Hkv, g * rows, D) @ (B, Hkv, D, Lk).
        qc = query[:, :, r0:r1].float().reshape(b, hkv, g * rows, d)
        s = torch.matmul(qc, kf).view(b, h, rows, lk).mul_(scale)
        if causal:
            visible = cols[None, :] <= torch.arange(r0, r1, device=query.device)[:, None] + (lk - lq)
            s.masked_fill_(~visible, float("-inf"))
            n_vis += int(visible.sum()) * b * h
        else:
            visible = None
            n_vis += rows * lk * b * h
        lse_all = torch.logsumexp(s, dim=-1)
        chosen = sel.rows(r0, r1)
        s.masked_fill_(~chosen, float("-inf"))
        lse_sel = torch.logsumexp(s, dim=-1)
        # recall = sum_{selected} p = exp(lse_sel - lse_all); a row that sees nothing is 1.
        recall[:, :, r0:r1] = torch.where(torch.isneginf(lse_all), 1.0, torch.exp(lse_sel - lse_all))
        both = chosen if visible is None else chosen & visible
        n_sel += both.sum(dim=(-1, -2), dtype=torch.int64).expand(b, h).sum()
    return recall, int(n_sel), n_vis


def softmax_mass_recall(
    query: torch.Tensor,
    key: torch.Tensor,
    selection,
    *,
    causal: bool = False,
    scale: float | None = None,
    chunk_rows: int | None = None,
) -> torch.Tensor:
    """Share of each query row's dense attention probability that the selected keys cover.

    ``recall[b, h, i] = sum over selected visible j of softmax_j(scale * q_i . k_j)``, the softmax
    running over the keys row i can see (all of them, or ``j <= i + Lk - Lq`` under ``causal``).
    Selected keys that are not visible carry no mass. Defined edge cases: a row with **no visible
    key** has recall **1.0** (there is nothing to lose); a row with visible keys but none selected
    has recall 0.

    Scores are computed in fp32, ``chunk_rows`` query rows at a time, so at most
    B * H * chunk_rows * Lk scores exist at once (a bool mask selection is read, never copied).

    Parameters
    ----------
    query : Tensor (B, H, Lq, D)
    key : Tensor (B, Hkv, Lk, D)
        H a multiple of Hkv (GQA: query head h reads key head ``h // (H // Hkv)``).
    selection : BlockSparseMask, bool Tensor or integer Tensor
        - a :class:`~sparse_attn.BlockSparseMask` (or FlexAttention ``BlockMask``) built for (Lq, Lk),
          batch and heads of size 1 or B and H; expanded to elements a chunk at a time;
        - a bool element mask broadcastable to (B, H, Lq, Lk), True = selected;
        - integer key indices (B, H|1, Lq, k), or (B, Lq, k) shared by every head (indexer mode),
          -1 meaning none, as ``topk_attention(..., return_indices=True)`` returns them in token mode.
          Values must lie in [-1, Lk); a repeated index counts once.

        Moved to the query's device if it is elsewhere.
    causal : bool
        Bottom-right aligned causal visibility, as in the ops.
    scale : float, optional
        Softmax scale, default ``1 / sqrt(D)``.
    chunk_rows : int, optional
        Query rows per chunk; default keeps B * H * chunk_rows * Lk <= 2**26.

    Returns
    -------
    Tensor (B, H, Lq), fp32, on the query's device.

    Examples
    --------
    >>> import torch, sparse_attn
    >>> from sparse_attn.analysis import random_qkv, softmax_mass_recall
    >>> q, k, v = random_qkv(1, 2, 64, 16, seed=0)
    >>> r = softmax_mass_recall(q, k, torch.ones(64, 64, dtype=torch.bool), causal=True)
    >>> r.shape, bool((r == 1).all())
    (torch.Size([1, 2, 64]), True)
    >>> _, idx = sparse_attn.topk_attention(q, k, v, 8, causal=True, return_indices=True)
    >>> bool((softmax_mass_recall(q, k, idx, causal=True) <= 1 + 1e-6).all())
    True
    """
    return _recall_and_density(query, key, selection, causal, scale, chunk_rows)[0]


# ------------------------------------------------------------------------------------ errors
def _check_pair(out, ref) -> None:
    for name, t in (("out", out), ("ref", ref)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if out.shape != ref.shape:
        raise ValueError(f"out and ref must have the same shape, got {tuple(out.shape)} and {tuple(ref.shape)}")


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """Frobenius relative error ``||out - ref|| / ||ref||``, computed in fp64.

    0 when both are zero, ``inf`` when only ``ref`` is; NaN in either propagates.

    Examples
    --------
    >>> import torch
    >>> from sparse_attn.analysis import relative_error
    >>> relative_error(torch.tensor([3.0, 4.0]), torch.tensor([3.0, 0.0]))
    1.3333333333333333
    """
    _check_pair(out, ref)
    ref64 = ref.double()
    num = float(torch.linalg.vector_norm(out.to(ref64.device).double() - ref64))
    den = float(torch.linalg.vector_norm(ref64))
    if den == 0.0:
        return 0.0 if num == 0.0 else (num if math.isnan(num) else math.inf)
    return num / den


def max_abs_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """Largest ``|out - ref|`` over all elements, computed in fp64 (0 for empty tensors).

    Examples
    --------
    >>> import torch
    >>> from sparse_attn.analysis import max_abs_error
    >>> max_abs_error(torch.tensor([1.0, 2.0]), torch.tensor([1.5, 2.0]))
    0.5
    """
    _check_pair(out, ref)
    if out.numel() == 0:
        return 0.0
    return float((out.to(ref.device).double() - ref.double()).abs().max())


# ------------------------------------------------------------------------------------ evaluate
@dataclass(frozen=True)
class AnalysisResult:
    """What one sparse method costs on one input, against dense attention.

    Attributes
    ----------
    name : str
        The method's label (``evaluate``'s ``name``, or a description of the method).
    density : float
        Share of the visible (query, key) pairs that the method attends to, over all rows, batches
        and heads (0 when no pair is visible).
    rel_error, max_abs_error : float
        Of the sparse output against dense ``flash_attention`` (Frobenius relative; max absolute).
    recall_mean, recall_min, recall_p01 : float
        Mean, minimum and 1st percentile (linear interpolation) of the per-row recall
        (:func:`softmax_mass_recall`); NaN when there are no rows.
    recall : Tensor (B, H, Lq), fp32
        The per-row recall itself, for histograms (not shown in ``repr`` nor compared).
    """

    name: str
    density: float
    rel_error: float
    max_abs_error: float
    recall_mean: float
    recall_min: float
    recall_p01: float
    recall: torch.Tensor | None = field(default=None, repr=False, compare=False)

    HEADER = "| method | density | rel. error | max abs error | recall mean | recall min | recall p01 |"

    def row(self) -> str:
        """This result as a markdown table row (columns of :attr:`HEADER`).

        Examples
        --------
        >>> from sparse_attn.analysis import AnalysisResult
        >>> AnalysisResult("top-8", 0.125, 0.05, 0.2, 0.97, 0.8, 0.85).row()
        '| top-8 | 0.125 | 0.05 | 0.2 | 0.9700 | 0.8000 | 0.8500 |'
        """
        return (
            f"| {self.name} | {self.density:.3f} | {self.rel_error:.3g} | {self.max_abs_error:.3g} | "
            f"{self.recall_mean:.4f} | {self.recall_min:.4f} | {self.recall_p01:.4f} |"
        )


def to_markdown(results: Sequence[AnalysisResult]) -> str:
    """A markdown table with one row per result.

    Examples
    --------
    >>> from sparse_attn.analysis import AnalysisResult, to_markdown
    >>> print(to_markdown([AnalysisResult("dense", 1.0, 0.0, 0.0, 1.0, 1.0, 1.0)]))
    | method | density | rel. error | max abs error | recall mean | recall min | recall p01 |
    |---|---|---|---|---|---|---|
    | dense | 1.000 | 0 | 0 | 1.0000 | 1.0000 | 1.0000 |
    """
    results = list(results)
    for r in results:
        if not isinstance(r, AnalysisResult):
            raise TypeError(f"results must hold AnalysisResult objects, got {type(r).__name__}")
    return "\n".join([AnalysisResult.HEADER, "|" + "---|" * 7, *(r.row() for r in results)])


def _percentile(x: torch.Tensor, q: float) -> float:
    """Linear-interpolation percentile (torch.quantile's default) with no size limit."""
    v = x.flatten().double().sort().values
    pos = q * (v.numel() - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, v.numel() - 1)
    return float(v[lo] + (v[hi] - v[lo]) * (pos - lo))


def mask_from_block_indices(
    indices: torch.Tensor,
    seq_lengths: tuple[int, int],
    block_size: int,
    *,
    causal: bool = False,
) -> BlockSparseMask:
    """The element selection of block-mode top-k, from the key blocks it returned.

    ``topk_attention(..., block_size=b, return_indices=True)`` returns, per (batch, head, query
    block), the chosen key blocks (B, H, nQb, k), -1 padded. It attends to every pair of those
    blocks, intersected with the causal mask when ``causal``; this rebuilds that mask.

    Examples
    --------
    >>> import torch, sparse_attn
    >>> from sparse_attn.analysis import mask_from_block_indices
    >>> q = k = v = torch.randn(1, 2, 256, 64)
    >>> _, blocks = sparse_attn.topk_attention(q, k, v, 1, block_size=64, causal=True, return_indices=True)
    >>> mask = mask_from_block_indices(blocks, (256, 256), 64, causal=True)  # the blocks always kept
    >>> mask.density()  # whole blocks: per query block the diagonal, the one before it, the first
    0.5625
    """
    if not isinstance(indices, torch.Tensor) or indices.is_floating_point() or indices.dtype == torch.bool:
        raise TypeError("indices must be an integer tensor (B, H, nQb, k)")
    if block_size not in (64, 128):
        raise ValueError(f"block_size must be 64 or 128, got {block_size}")
    lq, lk = (int(s) for s in seq_lengths)
    nq, nk = math.ceil(lq / block_size), math.ceil(lk / block_size)
    if indices.dim() != 4 or indices.shape[2] != nq:
        raise ValueError(
            f"indices must be (B, H, nQb={nq}, k) for Lq={lq} and block_size={block_size}, got {tuple(indices.shape)}"
        )
    if indices.numel() and (int(indices.min()) < -1 or int(indices.max()) >= nk):
        raise ValueError(f"indices must lie in [0, {nk}) or be -1 (none)")
    blocks = torch.zeros(*indices.shape[:3], nk + 1, dtype=torch.bool, device=indices.device)
    blocks.scatter_(-1, torch.where(indices >= 0, indices, nk).long(), True)
    mask = BlockSparseMask.from_block_matrix(blocks[..., :nk], seq_lengths=(lq, lk), block_size=block_size)
    if causal:
        mask = mask & _causal_pattern(lq, lk, block_size=block_size, device=indices.device)
    return mask


def _method_name(method) -> str:
    if isinstance(method, BlockSparseMask):
        return f"block-sparse mask ({method.q_block}x{method.kv_block} blocks)"
    if isinstance(method, int):
        return f"token top-k, k={method}"
    if method[0] == "indexer":
        return f"indexer top-k, k={method[1]}"
    return f"block top-k, k={method[1]} x {method[2]}"


def _check_k(k) -> int:
    if isinstance(k, bool) or not isinstance(k, int):
        raise TypeError(f"method's k must be an int, got {type(k).__name__}")
    if k <= 0:
        raise ValueError(f"method's k must be positive, got {k}")
    return k


def evaluate(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    method,
    *,
    causal: bool = False,
    scale: float | None = None,
    name: str | None = None,
    reference: torch.Tensor | None = None,
    chunk_rows: int | None = None,
) -> AnalysisResult:
    """Run one sparse method and measure what it loses against dense attention.

    Parameters
    ----------
    query, key, value : Tensor
        (B, H, Lq, D), (B, Hkv, Lk, D), (B, Hkv, Lk, Dv), as for the ops.
    method : BlockSparseMask, int or tuple
        - a :class:`~sparse_attn.BlockSparseMask` (or FlexAttention ``BlockMask``): runs
          :func:`~sparse_attn.block_sparse_attention`; with ``causal`` the mask is first intersected
          with :func:`sparse_attn.patterns.causal` (the op itself has no causal flag);
        - an int ``k``: token top-k, ``topk_attention(q, k, v, k, causal=..., return_indices=True)``;
        - ``("indexer", k, index_query, index_key, index_weights)``: token top-k chosen by the
          lightning indexer (see :func:`structured_indexer`);
        - ``("block", k, block_size)``: block top-k; the element selection is rebuilt from the
          returned key blocks with :func:`mask_from_block_indices`.
    causal : bool
        Bottom-right aligned causal attention, for the sparse op and the dense reference alike.
    scale : float, optional
        Softmax scale, default ``1 / sqrt(D)``.
    name : str, optional
        Label for the result; default describes the method.
    reference : Tensor, optional
        The dense output ``flash_attention(query, key, value, causal=causal, scale=scale)`` when
        already computed (a study evaluating many methods on one input computes it once).
    chunk_rows : int, optional
        Passed to the recall computation (:func:`softmax_mass_recall`).

    Returns
    -------
    AnalysisResult

    Examples
    --------
    >>> from sparse_attn import analysis, patterns
    >>> q, k, v = analysis.random_qkv(1, 2, 256, 64, seed=0)
    >>> r = analysis.evaluate(q, k, v, 256, causal=True)  # k = Lk: exactly dense
    >>> r.density, r.recall_min, r.rel_error < 1e-5
    (1.0, 1.0, True)
    >>> r = analysis.evaluate(q, k, v, patterns.sliding_window(256, 64, causal=True), causal=True)
    >>> 0 < r.recall_mean < 1
    True
    """
    _check_qk(query, key)
    causal = bool(causal)
    lq, lk = query.shape[2], key.shape[2]
    label = name
    if type(method).__name__ == "BlockMask":
        method = BlockSparseMask.from_flex(method)
    if isinstance(method, BlockSparseMask):
        mask = method.to(query.device)
        if causal:
            mask = mask & _causal_pattern(lq, lk, block_size=mask.block_size, device=query.device)
        out = block_sparse_attention(query, key, value, mask, scale=scale)
        selection = mask
    elif isinstance(method, int) and not isinstance(method, bool):
        _check_k(method)
        out, selection = topk_attention(query, key, value, method, causal=causal, scale=scale, return_indices=True)
    elif isinstance(method, tuple) and method and method[0] == "indexer":
        if len(method) != 5:
            raise ValueError("method ('indexer', ...) must be ('indexer', k, index_query, index_key, index_weights)")
        _, k, iq, ik, iw = method
        out, selection = topk_attention(
            query,
            key,
            value,
            _check_k(k),
            causal=causal,
            scale=scale,
            index_query=iq,
            index_key=ik,
            index_weights=iw,
            return_indices=True,
        )
    elif isinstance(method, tuple) and method and method[0] == "block":
        if len(method) != 3:
            raise ValueError("method ('block', ...) must be ('block', k, block_size)")
        _, k, block_size = method
        out, blocks = topk_attention(
            query, key, value, _check_k(k), block_size=block_size, causal=causal, scale=scale, return_indices=True
        )
        selection = mask_from_block_indices(blocks, (lq, lk), block_size, causal=causal)
    elif isinstance(method, tuple):
        raise ValueError(
            f"method tuple must start with 'indexer' or 'block', got {method[0] if method else 'an empty tuple'!r}"
        )
    else:
        raise TypeError(
            "method must be a BlockSparseMask, an int k, ('indexer', k, index_query, index_key, index_weights) "
            f"or ('block', k, block_size), got {type(method).__name__}"
        )
    if reference is None:
        reference = flash_attention(query, key, value, causal=causal, scale=scale)
    elif not isinstance(reference, torch.Tensor) or reference.shape != out.shape:
        got = tuple(reference.shape) if isinstance(reference, torch.Tensor) else type(reference).__name__
        raise ValueError(f"reference must be the dense output, shape {tuple(out.shape)}, got {got}")
    recall, n_sel, n_vis = _recall_and_density(query, key, selection, causal, scale, chunk_rows)
    if recall.numel():
        stats = float(recall.double().mean()), float(recall.min()), _percentile(recall, 0.01)
    else:
        stats = (math.nan,) * 3
    return AnalysisResult(
        name=label if label is not None else _method_name(method),
        density=n_sel / n_vis if n_vis else 0.0,
        rel_error=relative_error(out, reference),
        max_abs_error=max_abs_error(out, reference),
        recall_mean=stats[0],
        recall_min=stats[1],
        recall_p01=stats[2],
        recall=recall,
    )


# ------------------------------------------------------------------------------------ study inputs
def _generator(seed) -> torch.Generator:
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"seed must be an int, got {type(seed).__name__}")
    return torch.Generator().manual_seed(seed)


def _check_sizes(**sizes) -> None:
    for name, n in sizes.items():
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"{name} must be a positive int, got {n!r}")


def random_qkv(
    B: int,
    H: int,
    L: int,
    D: int,
    *,
    dtype: torch.dtype = torch.float32,
    device=None,
    seed: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Independent standard normal query, key and value (B, H, L, D): the unstructured baseline.

    With the default scale the scores of a row are ~N(0, 1): attention is spread thinly over all
    keys and no sparse method recovers much of it. Real attention is far more concentrated
    (:func:`structured_qkv`); this is the worst case. Drawn in fp32 on the CPU, then cast and moved.

    Examples
    --------
    >>> from sparse_attn.analysis import random_qkv
    >>> q, k, v = random_qkv(1, 2, 8, 16, seed=0)
    >>> q.shape, q.dtype
    (torch.Size([1, 2, 8, 16]), torch.float32)
    """
    _check_sizes(B=B, H=H, L=L, D=D)
    g = _generator(seed)
    return tuple(torch.randn(B, H, L, D, generator=g).to(dtype=dtype, device=device) for _ in range(3))


def structured_qkv(
    B: int,
    H: int,
    L: int,
    D: int,
    *,
    local_scale: float = 6.0,
    heavy_hitters: int = 4,
    heavy_scale: float = 6.0,
    content_scale: float = 1.0,
    max_wavelength: float | None = None,
    dtype: torch.dtype = torch.float32,
    device=None,
    seed: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Query, key and value (B, H, L, D) whose attention looks like a trained model's: mostly local,
    plus a few heavy-hitter keys that every query attends to.

    Each score ``q_i . k_j / sqrt(D)`` (the default scale) is the sum of three independent parts:

    - **position** (half the head dimension, like partial rotary embeddings): ``q_i`` and ``k_j``
      carry the same unit vector of sinusoids ``cos/sin(w_f * position)`` with D/4 wavelengths
      log-spaced from 4 to ``max_wavelength`` (default L), so their product
      ``local_scale * mean_f cos(w_f (i - j))`` depends on the distance only: ``local_scale`` at
      ``i = j``, decaying slowly (about logarithmically) with ``|i - j|``; a relative-position bias
      (ALiBi-like decay, RoPE-like realisation) carried by the vectors themselves;
    - **content** (the other half): independent Gaussians giving ~N(0, ``content_scale`` ** 2) per
      score, different in every head: the part no static pattern can predict;
    - **heavy hitters** (attention sinks, H2O's heavy hitters): position 0 and ``heavy_hitters - 1``
      other seeded positions get keys of large norm along one direction ``u`` that every query of
      every head shares, adding ``heavy_scale`` to their scores (``u`` is removed from every other
      content vector, so it adds nothing elsewhere).

    The values are standard normal. Drawn in fp32 on the CPU, then cast and moved.

    Examples
    --------
    >>> import torch
    >>> from sparse_attn.analysis import structured_qkv
    >>> q, k, _ = structured_qkv(1, 1, 64, 16, heavy_hitters=1, content_scale=0.0)
    >>> q0, k0, _ = structured_qkv(1, 1, 64, 16, heavy_hitters=0, content_scale=0.0)
    >>> s, s0 = (q @ k.transpose(-1, -2))[0, 0] / 4, (q0 @ k0.transpose(-1, -2))[0, 0] / 4
    >>> round(float(s[10, 10]), 3), round(float(s[10, 0] - s0[10, 0]), 3)  # local_scale; the sink's boost
    (6.0, 6.0)
    """
    _check_sizes(B=B, H=H, L=L, D=D)
    if D % 4 != 0:
        raise ValueError(f"D must be a multiple of 4 (half of it carries the position), got {D}")
    for name, x in (("local_scale", local_scale), ("heavy_scale", heavy_scale), ("content_scale", content_scale)):
        if isinstance(x, bool) or not isinstance(x, (int, float)) or x < 0:
            raise ValueError(f"{name} must be a non-negative number, got {x!r}")
    if isinstance(heavy_hitters, bool) or not isinstance(heavy_hitters, int) or not 0 <= heavy_hitters <= L:
        raise ValueError(f"heavy_hitters must be an int in [0, L={L}], got {heavy_hitters!r}")
    g = _generator(seed)
    f, dc = D // 4, D // 2
    max_wavelength = float(L if max_wavelength is None else max_wavelength)
    if max_wavelength < 4:
        raise ValueError(f"max_wavelength must be at least 4, got {max_wavelength}")
    wavelengths = torch.logspace(math.log10(4.0), math.log10(max_wavelength), f, dtype=torch.float64)
    angle = torch.arange(L, dtype=torch.float64)[:, None] * (2 * math.pi / wavelengths)
    pos = torch.cat([angle.cos(), angle.sin()], -1) / math.sqrt(f)  # (L, D/2), unit rows
    pos = (pos * math.sqrt(local_scale * math.sqrt(D))).float()
    # Content: per-score std content_scale when both sides are N(0, c^2) over dc dims.
    c = math.sqrt(content_scale) * (D / dc) ** 0.25
    qc = torch.randn(B, H, L, dc, generator=g) * c
    kc = torch.randn(B, H, L, dc, generator=g) * c
    u = torch.nn.functional.normalize(torch.randn(dc, generator=g), dim=-1)
    qc -= (qc * u).sum(-1, keepdim=True) * u
    kc -= (kc * u).sum(-1, keepdim=True) * u
    amp = math.sqrt(heavy_scale * math.sqrt(D))
    qc += amp * u
    if heavy_hitters:
        others = torch.randperm(L - 1, generator=g)[: heavy_hitters - 1] + 1
        heavy = torch.cat([torch.zeros(1, dtype=torch.int64), others])
        kc[:, :, heavy] += amp * u
    q = torch.cat([pos.expand(B, H, L, dc), qc], -1)
    k = torch.cat([pos.expand(B, H, L, dc), kc], -1)
    v = torch.randn(B, H, L, D, generator=g)
    return tuple(t.to(dtype=dtype, device=device) for t in (q, k, v))


def structured_indexer(
    query: torch.Tensor,
    key: torch.Tensor,
    *,
    index_heads: int = 4,
    index_dim: int = 32,
    noise: float = 0.25,
    seed: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Lightning-indexer inputs that approximate the attention of ``query``/``key``, for studies.

    Models a trained indexer (DeepSeek V3.2): a cheap, low-rank scorer that has learnt what the
    heads share but not what each head does alone. With one Gaussian projection R (D, DI) scaled so
    that ``(R^T q) . (R^T k) ~ q . k`` (Johnson-Lindenstrauss):

    - ``index_key[b, s] = mean over heads of R^T k[b, h, s]`` (one key per token, as the indexer's
      single MQA head): the structure shared by the heads (position, heavy hitters) survives,
      per-head content averages out;
    - ``index_query[b, t, j] = R^T q[b, h_j, t]`` with indexer head j reading query head
      ``h_j = j * H // HI``;
    - ``index_weights = 1 / HI``;

    plus Gaussian noise of ``noise`` times each tensor's RMS on the queries and keys (an imperfect
    indexer). Outputs have the query's dtype and device. Rank DI < D loses information too.

    Parameters
    ----------
    query : Tensor (B, H, L, D)
    key : Tensor (B, Hkv, L, D)
    index_heads, index_dim : int
        HI and DI.
    noise : float
        Relative noise level (0: the projection alone).
    seed : int

    Returns
    -------
    index_query (B, L, HI, DI), index_key (B, L, DI), index_weights (B, L, HI).

    Examples
    --------
    >>> import sparse_attn
    >>> from sparse_attn.analysis import structured_qkv, structured_indexer
    >>> q, k, v = structured_qkv(1, 2, 128, 64)
    >>> iq, ik, iw = structured_indexer(q, k, index_heads=2, index_dim=16)
    >>> iq.shape, ik.shape, iw.shape
    (torch.Size([1, 128, 2, 16]), torch.Size([1, 128, 16]), torch.Size([1, 128, 2]))
    >>> out = sparse_attn.topk_attention(q, k, v, 32, index_query=iq, index_key=ik, index_weights=iw)
    """
    _check_qk(query, key)
    _check_sizes(index_heads=index_heads, index_dim=index_dim)
    if isinstance(noise, bool) or not isinstance(noise, (int, float)) or noise < 0:
        raise ValueError(f"noise must be a non-negative number, got {noise!r}")
    g = _generator(seed)
    b, h, _, d = query.shape
    r = (torch.randn(d, index_dim, generator=g) / math.sqrt(index_dim)).to(query.device)
    heads = torch.arange(index_heads) * h // index_heads
    iq = (query.float()[:, heads.to(query.device)] @ r).transpose(1, 2)  # (B, L, HI, DI)
    ik = (key.float() @ r).mean(1)  # (B, L, DI)

    def noisy(x):
        rms = x.pow(2).mean().sqrt() if x.numel() else 0.0
        return x + noise * rms * torch.randn(x.shape, generator=g).to(x.device)

    iq, ik = noisy(iq), noisy(ik)
    iw = torch.full((b, query.shape[2], index_heads), 1.0 / index_heads, device=query.device)
    return iq.to(query.dtype).contiguous(), ik.to(query.dtype).contiguous(), iw.to(query.dtype)
