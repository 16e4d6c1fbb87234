"""Variable-length (packed) batches: checks of the packed layout and ``cu_seqlens``, and the run of
an op once per sequence on views of the packed tensors (no copy of the inputs; the outputs are
concatenated into the packed layout)."""

from __future__ import annotations

from collections.abc import Callable

import torch


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


def _view(x: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
    """Rows [lo, hi) of a packed (total, H, D) tensor as (1, H, hi - lo, D), in place."""
    return x[lo:hi].unsqueeze(0).transpose(1, 2)


def run(fn: Callable, query, key, value, bounds) -> tuple[torch.Tensor, torch.Tensor]:
    """fn(q, k, v) -> (out, lse) on each sequence's (1, H, L, D) views; the results packed as
    (total_q, H, Dv) and (H, total_q)."""
    outs, lses = [], []
    h, dv = query.shape[1], value.shape[2]
    for q0, q1, k0, k1 in bounds:
        if q1 == q0:
            continue
        o, lse = fn(_view(query, q0, q1), _view(key, k0, k1), _view(value, k0, k1))
        outs.append(o[0].transpose(0, 1))
        lses.append(lse[0])
    if not outs:
        empty_out = query.new_zeros(0, h, dv)
        return empty_out, torch.zeros(h, 0, dtype=torch.float32, device=query.device)
    return torch.cat(outs, dim=0), torch.cat(lses, dim=1)
