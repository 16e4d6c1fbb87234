"""Plain PyTorch references: short, in float64 by default, and checked against SDPA in the tests.

They materialise the full score matrix, so they are for tests and small inputs only.
"""

from __future__ import annotations

import torch

__all__ = ["attention", "causal_mask", "block_sparse_attention", "gather_attention", "topk_indices", "indexer_scores"]


def causal_mask(lq: int, lk: int, device=None) -> torch.Tensor:
    """(Lq, Lk) bool, bottom-right aligned: j <= i + (Lk - Lq)."""
    return torch.ones(lq, lk, dtype=torch.bool, device=device).tril(lk - lq)


def attention(query, key, value, *, mask=None, causal=False, scale=None, dtype=torch.float64):
    """softmax(scale * Q K^T masked) V computed in ``dtype``; returns (out, lse).

    ``mask`` is bool, broadcastable to (B, H, Lq, Lk), True = attend. A row with no visible key
    gives 0 and LSE -inf. GQA: key/value heads are repeated to match the query heads.
    """
    q, k, v = (t.to(dtype) for t in (query, key, value))
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    s = (q @ k.transpose(-1, -2)) * scale
    if causal:
        c = causal_mask(q.shape[2], k.shape[2], q.device)
        mask = c if mask is None else mask & c
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    # Only a row with no visible key (LSE -inf) is defined as 0: NaN from the inputs, or from an
    # overflowing low-precision run, must propagate rather than turn into a finite 0.
    p = torch.exp(s - lse.unsqueeze(-1)).masked_fill(torch.isneginf(lse).unsqueeze(-1), 0.0)
    return p @ v, lse


def block_sparse_attention(query, key, value, mask, *, scale=None, dtype=torch.float64):
    """Attention under ``mask`` (a BlockSparseMask) expanded to its element mask."""
    return attention(query, key, value, mask=mask.to_dense().to(query.device), scale=scale, dtype=dtype)


def gather_attention(query, key, value, indices, *, scale=None, dtype=torch.float64):
    """Attention of each query over the keys ``indices`` (B, Hi, Lq, k) lists (-1 = none)."""
    b, hi, lq, _ = indices.shape
    lk = key.shape[2]
    mask = torch.zeros(b, hi, lq, lk + 1, dtype=torch.bool, device=indices.device)
    mask.scatter_(-1, torch.where((indices >= 0) & (indices < lk), indices, lk).long(), True)
    mask = mask[..., :lk].repeat_interleave(query.shape[1] // hi, dim=1)
    return attention(query, key, value, mask=mask, scale=scale, dtype=dtype)


def indexer_scores(index_query, index_key, index_weights, dtype=torch.float64):
    """(B, Lq, Lk): sum_j w[t, j] * relu(q_I[t, j] . k_I[s])."""
    qi, ki, w = (t.to(dtype) for t in (index_query, index_key, index_weights))
    per_head = torch.einsum("bthd,bsd->bths", qi, ki).relu()
    return torch.einsum("bths,bth->bts", per_head, w)


def topk_indices(scores: torch.Tensor, k: int, *, causal: bool = False) -> torch.Tensor:
    """The k largest visible scores of each row of ``scores`` (..., Lq, Lk): ties go to the lower
    index, result ascending, -1 where fewer than k keys are visible."""
    lq, lk = scores.shape[-2:]
    k = min(k, lk)
    visible = torch.ones(lq, lk, dtype=torch.bool, device=scores.device)
    if causal:
        visible = causal_mask(lq, lk, scores.device)
    visible = visible.expand(scores.shape)
    # Visible keys by score, descending (ties keep the lower index; NaN ranks first, so it
    # propagates instead of being dropped), then the hidden keys.
    key = torch.where(torch.isnan(scores), float("inf"), scores.double())
    by_score = torch.sort(key, dim=-1, descending=True, stable=True).indices
    hidden_first_last = torch.sort((~visible).gather(-1, by_score).to(torch.int8), dim=-1, stable=True).indices
    order = by_score.gather(-1, hidden_first_last)[..., :k]
    chosen_visible = torch.gather(visible, -1, order)
    order = torch.where(chosen_visible, order, lk).sort(-1).values
    return torch.where(order == lk, -1, order).to(torch.int32)
