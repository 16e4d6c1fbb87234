"""Packed variable-length batches: each sequence of flash/block-sparse/top-k varlen equals the op on
that sequence alone (the same kernel: bitwise), the outputs and LSE packed; gradients flow; bad
cu_seqlens raise errors naming the argument."""

from __future__ import annotations

import pytest
import torch

import sparse_attn
from sparse_attn import patterns


def packed(lens_q, lens_k, h=4, hkv=2, d=64, *, dtype=torch.bfloat16, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(sum(lens_q), h, d, generator=g).to(dtype).to(device)
    k = torch.randn(sum(lens_k), hkv, d, generator=g).to(dtype).to(device)
    v = torch.randn(sum(lens_k), hkv, d, generator=g).to(dtype).to(device)
    cu = lambda lens: torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)  # noqa: E731
    return q, k, v, cu(lens_q).to(device), cu(lens_k).to(device)


def per_sequence(op, q, k, v, cu_q, cu_k, **kw):
    outs, lses = [], []
    cq, ck = cu_q.tolist(), cu_k.tolist()
    for b in range(len(cq) - 1):
        qs = q[cq[b] : cq[b + 1]].unsqueeze(0).transpose(1, 2)
        ks = k[ck[b] : ck[b + 1]].unsqueeze(0).transpose(1, 2)
        vs = v[ck[b] : ck[b + 1]].unsqueeze(0).transpose(1, 2)
        o, lse = op(qs, ks, vs, return_lse=True, **kw)
        outs.append(o[0].transpose(0, 1))
        lses.append(lse[0])
    return torch.cat(outs), torch.cat(lses, dim=1)


@pytest.mark.parametrize("causal,window", [(False, None), (True, None), (True, 17), (False, (5, 9))])
@pytest.mark.parametrize("lens_q,lens_k", [([37, 1, 130, 64], [37, 1, 130, 64]), ([3, 50, 1], [40, 50, 77])])
def test_flash_varlen(device, causal, window, lens_q, lens_k):
    q, k, v, cu_q, cu_k = packed(lens_q, lens_k, device=device)
    out, lse = sparse_attn.flash_attention_varlen(
        q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), causal=causal, window=window, return_lse=True
    )
    ref, ref_lse = per_sequence(sparse_attn.flash_attention, q, k, v, cu_q, cu_k, causal=causal, window=window)
    assert out.shape == (sum(lens_q), 4, 64) and lse.shape == (4, sum(lens_q))
    assert torch.equal(out, ref) and torch.equal(lse, ref_lse)


@pytest.mark.parametrize("grad", [False, True])
def test_flash_varlen_equal_lengths_batched(device, grad):
    # Runs of consecutive sequences of equal lengths go through one batched call (24 x 48 here,
    # broken by an empty query sequence and a longer one): bitwise the per-sequence results.
    lens_q = [48] * 10 + [0] + [48] * 14 + [100]
    lens_k = [48] * 10 + [7] + [48] * 14 + [120]
    q, k, v, cu_q, cu_k = packed(lens_q, lens_k, device=device)
    from sparse_attn import _varlen

    bounds = _varlen.check(q, k, v, cu_q, cu_k, 100, 120)
    assert [(n, lq, lk) for _, _, n, lq, lk in _varlen._runs(bounds)] == [(10, 48, 48), (14, 48, 48), (1, 100, 120)]
    with torch.set_grad_enabled(grad):
        v.requires_grad_(grad)
        out, lse = sparse_attn.flash_attention_varlen(q, k, v, cu_q, cu_k, 100, 120, causal=True, return_lse=True)
    ref, ref_lse = per_sequence(sparse_attn.flash_attention, q, k, v.detach(), cu_q, cu_k, causal=True)
    assert torch.equal(out.detach(), ref) and torch.equal(lse, ref_lse)


def test_explain_flash_varlen():
    # One flash launch per run of equal-length sequences; on a GPU target in 16-bit the kernels
    # write into the packed output, in fp32 (or with gradients) the outputs are concatenated.
    q, k, v, cu_q, cu_k = packed([48, 48, 0, 100], [48, 48, 7, 120])
    plan = sparse_attn.explain(sparse_attn.flash_attention_varlen, q, k, v, cu_q, cu_k, 100, 120, causal=True)
    assert plan.route == "varlen_flash" and [launch.role for launch in plan.launches] == [
        "2 x 48 queries, 48 keys",
        "1 x 100 queries, 120 keys",
    ], str(plan)
    assert "concatenated" in plan.why and plan.launches[0].core == "cpu" and "flash_bwd" in plan.backward
    plan = sparse_attn.explain(
        sparse_attn.flash_attention_varlen, q, k, v, cu_q, cu_k, 100, 120, causal=True, target="sm90"
    )
    assert "write into the packed output" in plan.why and plan.launches[0].core == "hopper", str(plan)
    plan = sparse_attn.explain(
        "flash_attention_varlen", q.float(), k.float(), v.float(), cu_q, cu_k, 100, 120, target="sm90"
    )
    assert "concatenated" in plan.why, str(plan)


def test_flash_varlen_cpu_seqlens_and_empty_sequences(device):
    # Empty sequences (no query, or no key) and cu_seqlens on the CPU for GPU tensors.
    q, k, v, cu_q, cu_k = packed([5, 0, 7], [5, 3, 0], device=device)
    out, lse = sparse_attn.flash_attention_varlen(q, k, v, cu_q.cpu(), cu_k.cpu(), 7, 5, return_lse=True)
    assert torch.equal(out[5:], torch.zeros_like(out[5:])) and torch.isneginf(lse[:, 5:]).all()
    ref, _ = per_sequence(sparse_attn.flash_attention, q[:5], k[:5], v[:5], cu_q[:2], cu_k[:2])
    assert torch.equal(out[:5], ref)


def test_flash_varlen_gradients(device):
    q, k, v, cu_q, cu_k = packed([20, 9], [20, 30], dtype=torch.float32, device=device)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out = sparse_attn.flash_attention_varlen(q, k, v, cu_q, cu_k, 20, 30, causal=True)
    grads = torch.autograd.grad(out.square().sum(), (q, k, v))
    q2, k2, v2 = (t.detach().clone().requires_grad_() for t in (q, k, v))
    ref, _ = per_sequence(sparse_attn.flash_attention, q2, k2, v2, cu_q, cu_k, causal=True)
    refs = torch.autograd.grad(ref.square().sum(), (q2, k2, v2))
    for a, b in zip(grads, refs, strict=True):
        torch.testing.assert_close(a, b)


@pytest.mark.cuda
def test_flash_varlen_writes_in_place(monkeypatch):
    # On CUDA in 16-bit, with no gradient to track, each sequence's kernel writes into the packed
    # output (no concatenation): bitwise the per-sequence results; a call that tracks gradients
    # keeps the per-sequence ops (their autograd) and their concatenation.
    from sparse_attn import _varlen

    q, k, v, cu_q, cu_k = packed([300, 0, 77, 129], [300, 5, 77, 200], h=8, hkv=2, d=128, device="cuda")
    ref, ref_lse = per_sequence(sparse_attn.flash_attention, q, k, v, cu_q, cu_k, causal=True)
    calls = []
    into = _varlen.run_flash_into
    monkeypatch.setattr(_varlen, "run_flash_into", lambda *a: calls.append(1) or into(*a))
    out, lse = sparse_attn.flash_attention_varlen(q, k, v, cu_q, cu_k, 300, 300, causal=True, return_lse=True)
    assert calls and torch.equal(out, ref) and torch.equal(lse, ref_lse)
    calls.clear()
    out = sparse_attn.flash_attention_varlen(q, k, v.requires_grad_(), cu_q, cu_k, 300, 300, causal=True)
    assert not calls and out.requires_grad and torch.equal(out.detach(), ref)


@pytest.mark.cuda
def test_flash_fwd_out_checks_its_outputs():
    q = torch.randn(1, 4, 64, 64, device="cuda", dtype=torch.bfloat16)
    lse = torch.empty(1, 4, 64, device="cuda")
    op = torch.ops.sparse_attn._flash_fwd_out.default
    for bad in (torch.empty(1, 4, 64, 64, device="cuda"), torch.empty(1, 4, 63, 64, device="cuda", dtype=q.dtype)):
        with pytest.raises(RuntimeError, match="out must"):
            op(q, q, q, bad, lse)
    with pytest.raises(RuntimeError, match="lse must"):
        op(q, q, q, torch.empty_like(q), lse[..., :32])
    misaligned = torch.empty(1, 4, 64, 65, device="cuda", dtype=q.dtype)[..., 1:]
    with pytest.raises(RuntimeError, match="16-byte aligned"):
        op(q, q, q, misaligned, lse)


def test_block_sparse_varlen(device):
    lens = [200, 70, 129]
    q, k, v, cu_q, cu_k = packed(lens, lens, device=device)
    out = sparse_attn.block_sparse_attention_varlen(
        q, k, v, cu_q, cu_k, 200, 200, lambda lq, lk: patterns.sliding_window(lq, 32, device=device), causal=True
    )
    masks = [patterns.sliding_window(n, 32, device=device) for n in lens]
    it = iter(masks)
    ref, _ = per_sequence(
        lambda qq, kk, vv, **kw: sparse_attn.block_sparse_attention(qq, kk, vv, next(it), causal=True, **kw),
        q,
        k,
        v,
        cu_q,
        cu_k,
    )
    assert torch.equal(out, ref)
    listed = sparse_attn.block_sparse_attention_varlen(q, k, v, cu_q, cu_k, 200, 200, masks, causal=True)
    assert torch.equal(listed, ref)


def test_topk_varlen(device):
    lens = [90, 33]
    q, k, v, cu_q, cu_k = packed(lens, lens, device=device)
    out = sparse_attn.topk_attention_varlen(q, k, v, cu_q, cu_k, 90, 90, 16, causal=True)
    ref, _ = per_sequence(
        lambda qq, kk, vv, **kw: sparse_attn.topk_attention(qq, kk, vv, 16, causal=True, **kw), q, k, v, cu_q, cu_k
    )
    assert torch.equal(out, ref)


@pytest.mark.parametrize(
    "cu_q,match",
    [
        (torch.tensor([0, 5, 3, 12], dtype=torch.int32), "non-decreasing"),
        (torch.tensor([0, 5, 12], dtype=torch.int32), "same number of sequences"),
        (torch.tensor([1, 5, 9, 12], dtype=torch.int32), "must start at 0"),
        (torch.tensor([0, 5, 9, 12], dtype=torch.int64), "int32"),
        (torch.tensor([0, 1, 2, 12], dtype=torch.int32), "more than its max_seqlen"),
    ],
)
def test_bad_cu_seqlens(cu_q, match):
    q, k, v, _, cu_k = packed([5, 4, 3], [5, 4, 3])
    with pytest.raises(ValueError, match=match):
        sparse_attn.flash_attention_varlen(q, k, v, cu_q, cu_k, 5, 5)


def test_bad_layout():
    q, k, v, cu_q, cu_k = packed([5], [5])
    with pytest.raises(ValueError, match="query must be a packed 3-D tensor"):
        sparse_attn.flash_attention_varlen(q[None], k, v, cu_q, cu_k, 5, 5)
