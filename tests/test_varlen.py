"""Packed variable-length batches: each sequence of flash/block-sparse/top-k varlen equals the op on
that sequence alone (the same kernel: bitwise), the outputs and LSE packed; gradients flow; bad
cu_seqlens raise errors naming the argument. flash_attention_varlen's document route (one
block-sparse call over the packed batch) has a mask equal to the sequences' element mask, the same
on both builders, and results within tolerance of the per-sequence ones."""

from __future__ import annotations

import pytest
import torch

import sparse_attn
from sparse_attn import _varlen, patterns


@pytest.fixture
def per_run(monkeypatch):
    """flash_attention_varlen on its per-run route (one flash call per run of equal lengths), whose
    results are bitwise those of the per-sequence calls."""
    monkeypatch.setattr(_varlen, "document_route", lambda *a, **kw: False)


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
def test_flash_varlen(device, causal, window, lens_q, lens_k, per_run):
    q, k, v, cu_q, cu_k = packed(lens_q, lens_k, device=device)
    out, lse = sparse_attn.flash_attention_varlen(
        q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), causal=causal, window=window, return_lse=True
    )
    ref, ref_lse = per_sequence(sparse_attn.flash_attention, q, k, v, cu_q, cu_k, causal=causal, window=window)
    assert out.shape == (sum(lens_q), 4, 64) and lse.shape == (4, sum(lens_q))
    assert torch.equal(out, ref) and torch.equal(lse, ref_lse)


@pytest.mark.parametrize("grad", [False, True])
def test_flash_varlen_equal_lengths_batched(device, grad, per_run):
    # Runs of consecutive sequences of equal lengths go through one batched call (24 x 48 here,
    # broken by an empty query sequence and a longer one): bitwise the per-sequence results.
    lens_q = [48] * 10 + [0] + [48] * 14 + [100]
    lens_k = [48] * 10 + [7] + [48] * 14 + [120]
    q, k, v, cu_q, cu_k = packed(lens_q, lens_k, device=device)
    bounds = _varlen.check(q, k, v, cu_q, cu_k, 100, 120)
    assert [(n, lq, lk) for _, _, n, lq, lk in _varlen._runs(bounds)] == [(10, 48, 48), (14, 48, 48), (1, 100, 120)]
    with torch.set_grad_enabled(grad):
        v.requires_grad_(grad)
        out, lse = sparse_attn.flash_attention_varlen(q, k, v, cu_q, cu_k, 100, 120, causal=True, return_lse=True)
    ref, ref_lse = per_sequence(sparse_attn.flash_attention, q, k, v.detach(), cu_q, cu_k, causal=True)
    assert torch.equal(out.detach(), ref) and torch.equal(lse, ref_lse)


def test_explain_flash_varlen(per_run):
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


def test_flash_varlen_cpu_seqlens_and_empty_sequences(device, per_run):
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
def test_flash_varlen_writes_in_place(monkeypatch, per_run):
    # On CUDA in 16-bit, with no gradient to track, each sequence's kernel writes into the packed
    # output (no concatenation): bitwise the per-sequence results; a call that tracks gradients
    # keeps the per-sequence ops (their autograd) and their concatenation.
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


def row_intervals(lens_q, lens_k, left, right):
    """The reference: the (total_q, total_k) element mask of packed sequences, each row seeing its
    sequence's keys in its band (bottom-right aligned; -1 unbounded)."""
    tq, tk = sum(lens_q), sum(lens_k)
    dense = torch.zeros(tq, tk, dtype=torch.bool)
    q0 = k0 = 0
    for lq, lk in zip(lens_q, lens_k, strict=True):
        i = torch.arange(lq)[:, None] + (lk - lq)  # diagonal key of each row, local
        j = torch.arange(lk)[None]
        ok = torch.ones(lq, lk, dtype=torch.bool)
        if left >= 0:
            ok &= j >= i - left
        if right >= 0:
            ok &= j <= i + right
        dense[q0 : q0 + lq, k0 : k0 + lk] = ok
        q0, k0 = q0 + lq, k0 + lk
    return dense


DOCUMENT_BATCHES = [
    ([37, 1, 130, 64, 300], [37, 1, 130, 64, 300]),  # self-attention, ragged
    ([128, 128, 256], [128, 128, 256]),  # block-aligned: full blocks, diagonal partials
    ([3, 50, 0, 1, 200], [40, 50, 7, 0, 20]),  # Lq != Lk, empty sequences, rows that see nothing
    ([500], [700]),
]


@pytest.mark.parametrize("left,right", [(-1, -1), (-1, 0), (17, 0), (5, 9), (0, 3), (200, -1)])
@pytest.mark.parametrize("block", [(128, 128), (64, 128), (128, 64), (64, 64)])
@pytest.mark.parametrize("lens_q,lens_k", DOCUMENT_BATCHES)
def test_document_mask_is_the_sequences_mask(lens_q, lens_k, left, right, block):
    # The builder's mask equals the element mask of the sequences' bands; a block every row of its
    # query block sees whole (within the lengths) is listed full; the host's bounds hold.
    q, k, v, cu_q, cu_k = packed(lens_q, lens_k)
    bounds = _varlen.check(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k))
    mask = _varlen.document_mask(bounds, q.shape[0], k.shape[0], left, right, "cpu", block)
    mask.validate()
    ref = row_intervals(lens_q, lens_k, left, right)
    assert torch.equal(mask.to_dense()[0, 0], ref)
    bq, bk = block
    table = mask.block_table()[0, 0]
    for qb in range(table.shape[0]):
        for kb in range(table.shape[1]):
            tile = ref[qb * bq : (qb + 1) * bq, kb * bk : (kb + 1) * bk]
            assert (table[qb, kb] == -1) == bool(tile.all()), (qb, kb)


@pytest.mark.parametrize("causal,window", [(False, None), (True, None), (True, 33), (False, (5, 9))])
@pytest.mark.parametrize("lens_q,lens_k", DOCUMENT_BATCHES[:3])
def test_flash_varlen_documents(device, causal, window, lens_q, lens_k):
    # The document route (one block-sparse call) against the per-sequence flash calls: outputs,
    # LSE and gradients within the 16-bit tolerance.
    q, k, v, cu_q, cu_k = packed(lens_q, lens_k, device=device)
    bounds = _varlen.check(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k))
    left, right = sparse_attn._args.window_bounds(window)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out, lse = _varlen.run_documents(q, k, v, bounds, None, causal, left, right)
    ref, ref_lse = per_sequence(sparse_attn.flash_attention, q, k, v, cu_q, cu_k, causal=causal, window=window)
    assert out.shape == ref.shape and out.is_contiguous() and lse.shape == ref_lse.shape
    torch.testing.assert_close(out, ref, atol=2e-2, rtol=2e-2)
    seen = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), seen)
    torch.testing.assert_close(lse[seen], ref_lse[seen], atol=1e-3, rtol=1e-3)
    g = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), g)
    refs = torch.autograd.grad(ref, (q, k, v), g)
    for a, b in zip(grads, refs, strict=True):
        torch.testing.assert_close(a, b, atol=5e-2, rtol=5e-2)


def test_document_route_choice():
    # CPU calls keep the per-run route; on a GPU, many short runs (or a gradient) take the
    # document route, a single run or a few long ones do not.
    short = packed([100, 37, 300, 64, 5], [100, 37, 300, 64, 5])
    long = packed([4000, 6000], [4000, 6000], h=1, hkv=1, d=8)
    one = packed([64] * 8, [64] * 8)
    route = lambda t, cuda: _varlen.document_route(  # noqa: E731
        t[0], t[1], t[2], _varlen.check(*t, 1 << 20, 1 << 20), cuda=cuda
    )
    assert not route(short, False) and route(short, True)
    assert not route(long, True) and not route(one, True)
    long[0].requires_grad_()
    assert route(long, True) and not route(long, False)
    longer = packed([9000, 12000], [9000, 12000], h=1, hkv=1, d=8)
    longer[0].requires_grad_()
    assert not route(longer, True)
    plan = sparse_attn.explain(sparse_attn.flash_attention_varlen, *short, 300, 300, causal=True, target="sm90")
    assert plan.route == "varlen_documents" and plan.launches[0].kernel == "block_sparse_fwd", str(plan)
    assert "block_sparse_bwd" in plan.backward and "fewer than" in plan.why, str(plan)


def test_document_mask_op(device):
    # The builder op passes opcheck (fake kernel, schema, dispatch) and refuses bad arguments by name.
    cu = torch.tensor([0, 100, 130, 300], dtype=torch.int32, device=device)
    q = torch.zeros(300, 1, 8)
    bounds = _varlen.check(q, q, q, cu.cpu(), cu.cpu(), 300, 300)
    max_kb, offsets, _ = _varlen.document_mask_bounds(*_varlen.packed_offsets(bounds, 300, 300), -1, 0)
    offsets = torch.from_numpy(offsets).to(device)
    args = (cu, cu, offsets, int(offsets[-1]), 300, 300, 128, 128, -1, 0, max_kb)
    op = torch.ops.sparse_attn._document_mask.default
    result = torch.library.opcheck(op, args)
    assert all(v == "SUCCESS" for v in result.values()), result
    with pytest.raises(RuntimeError, match="partial_offsets must be int64"):
        op(cu, cu, offsets.int(), *args[3:])
    with pytest.raises(RuntimeError, match="q_block and kv_block"):
        op(*args[:6], 32, *args[7:])
    with pytest.raises(RuntimeError, match="cu_seqlens_q must be int32"):
        op(cu.long(), *args[1:])


@pytest.mark.cuda
@pytest.mark.parametrize("left,right", [(-1, -1), (-1, 0), (40, 0)])
def test_document_mask_cuda_builder_equals_cpu(left, right):
    # The CUDA builder writes the CPU builder's lists and the same bits in every listed partial row.
    g = torch.Generator().manual_seed(5)
    lens = torch.randint(0, 700, (40,), generator=g).tolist()
    q, k, v, cu_q, cu_k = packed(lens, lens, h=1, hkv=1, d=8)
    bounds = _varlen.check(q, k, v, cu_q, cu_k, 700, 700)
    for block in ((128, 128), (64, 128), (128, 64)):
        a = _varlen.document_mask(bounds, q.shape[0], k.shape[0], left, right, "cpu", block)
        b = _varlen.document_mask(bounds, q.shape[0], k.shape[0], left, right, "cuda", block)
        for x, y in zip(a._tensors()[:3], b._tensors()[:3], strict=True):
            assert torch.equal(x, y.cpu())
        assert torch.equal(a.partial_masks, b.partial_masks.cpu())


@pytest.mark.cuda
def test_flash_varlen_documents_route_on_cuda():
    # A batch of many short sequences takes the document route on CUDA (no gradient) and matches
    # the per-sequence calls; so does a training call over a few runs, gradients included.
    g = torch.Generator().manual_seed(2)
    lens = torch.randint(1, 400, (30,), generator=g).tolist()
    q, k, v, cu_q, cu_k = packed(lens, lens, h=8, hkv=2, d=128, device="cuda")
    bounds = _varlen.check(q, k, v, cu_q, cu_k, 400, 400)
    assert _varlen.document_route(q, k, v, bounds)
    out, lse = sparse_attn.flash_attention_varlen(q, k, v, cu_q, cu_k, 400, 400, causal=True, return_lse=True)
    ref, ref_lse = per_sequence(sparse_attn.flash_attention, q, k, v, cu_q, cu_k, causal=True)
    torch.testing.assert_close(out, ref, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(lse, ref_lse, atol=1e-3, rtol=1e-3)
    q2, k2, v2, cu_q2, cu_k2 = packed([700, 900], [700, 900], h=8, hkv=2, d=128, device="cuda")
    q2, k2, v2 = (t.requires_grad_() for t in (q2, k2, v2))
    out = sparse_attn.flash_attention_varlen(q2, k2, v2, cu_q2, cu_k2, 900, 900, causal=True)
    ref, _ = per_sequence(sparse_attn.flash_attention, q2, k2, v2, cu_q2, cu_k2, causal=True)
    torch.testing.assert_close(out, ref, atol=2e-2, rtol=2e-2)
    gr = torch.randn_like(out)
    for a, b in zip(
        torch.autograd.grad(out, (q2, k2, v2), gr), torch.autograd.grad(ref, (q2, k2, v2), gr), strict=True
    ):
        torch.testing.assert_close(a, b, atol=5e-2, rtol=5e-2)


def test_documents_pattern(device):
    # patterns.documents: the packed sequences' element mask (as flash_attention_varlen's route
    # builds it), on the requested device; composes with other patterns; bad offsets raise.
    from sparse_attn import patterns

    lens = [37, 0, 130, 64, 300]
    cu = [0, *torch.tensor(lens).cumsum(0).tolist()]
    mask = patterns.documents(cu, causal=True, window=50, device=device)
    assert mask.device.type == torch.device(device).type and mask.seq_lengths == (531, 531)
    assert torch.equal(mask.to_dense()[0, 0].cpu(), row_intervals(lens, lens, 50, 0))
    both = patterns.documents(torch.tensor(cu, dtype=torch.int32), device=device) & patterns.sliding_window(
        531, 20, device=device
    )
    assert torch.equal(both.to_dense()[0, 0].cpu(), row_intervals(lens, lens, 19, 19))
    q, k, v, cu_q, cu_k = packed(lens, lens, device=device)
    out = sparse_attn.block_sparse_attention(*(t.unsqueeze(0).transpose(1, 2) for t in (q, k, v)), mask)
    ref, _ = per_sequence(sparse_attn.flash_attention, q, k, v, cu_q, cu_k, causal=True, window=(50, 0))
    torch.testing.assert_close(out[0].transpose(0, 1), ref, atol=2e-2, rtol=2e-2)
    for bad, match in (([1, 5], "starting at 0"), ([0, 5, 3], "non-decreasing"), ([0, 2.5], "integer")):
        with pytest.raises(ValueError, match=match):
            patterns.documents(bad)


def test_document_masks_reused_across_calls(monkeypatch):
    # The document route builds a batch's mask once: a second call with the same sequences and band
    # (another layer of the model) reuses it; another band or batch builds its own; at most
    # DOCUMENT_MASKS_KEPT are kept.
    built = []
    build = _varlen.document_mask
    monkeypatch.setattr(_varlen, "document_mask", lambda *a, **kw: built.append(a[3:5]) or build(*a, **kw))
    monkeypatch.setattr(_varlen, "_DOCUMENT_MASKS", type(_varlen._DOCUMENT_MASKS)())
    q, k, v, cu_q, cu_k = packed([40, 90, 7], [40, 90, 7])
    bounds = _varlen.check(q, k, v, cu_q, cu_k, 90, 90)
    first = _varlen.run_documents(q, k, v, bounds, None, True, -1, -1)
    again = _varlen.run_documents(q, k, v, bounds, None, True, -1, -1)
    assert built == [(-1, 0)] and torch.equal(first[0], again[0])
    _varlen.run_documents(q, k, v, bounds, None, False, 5, 5)
    assert built == [(-1, 0), (5, 5)]
    for n in range(1, _varlen.DOCUMENT_MASKS_KEPT + 1):
        _varlen.run_documents(q, k, v, bounds, None, False, n + 10, -1)
    assert len(_varlen._DOCUMENT_MASKS) == _varlen.DOCUMENT_MASKS_KEPT
    _varlen.run_documents(q, k, v, bounds, None, True, -1, -1)  # evicted: built again
    assert built[-1] == (-1, 0) and len(built) == 3 + _varlen.DOCUMENT_MASKS_KEPT
