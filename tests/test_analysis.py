"""sparse_attn.analysis: softmax-mass recall against a brute-force fp64 softmax, the defined edge
cases, what evaluate() reports for each method kind, the top-k optimality of recall, the study input
generators, and argument checks."""

from __future__ import annotations

import dataclasses
import doctest

import pytest
import torch
from utils import make_qkv

import sparse_attn
from sparse_attn import BlockSparseMask, analysis, patterns, reference
from sparse_attn.analysis import evaluate, softmax_mass_recall

# (B, H, Hkv, Lq, Lk, D)
SHAPES = {
    "tiny": (1, 1, 1, 5, 7, 16),
    "gqa_ragged": (2, 4, 2, 33, 70, 32),
    "lq_gt_lk": (1, 2, 1, 90, 37, 16),
    "square_200": (1, 2, 2, 200, 200, 64),
}


def brute_recall(q, k, sel, *, causal=False, scale=None):
    """fp64, whole score matrix: the mass of the full visible softmax on ``sel`` (bool, broadcast to
    (B, H, Lq, Lk)); 1 for a row that sees no key."""
    kk = k.double().repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    s = (q.double() @ kk.transpose(-1, -2)) * scale
    lq, lk = s.shape[-2:]
    visible = reference.causal_mask(lq, lk, q.device) if causal else torch.ones(lq, lk, dtype=torch.bool)
    s = s.masked_fill(~visible.to(q.device), float("-inf"))
    lse = torch.logsumexp(s, -1, keepdim=True)
    p = torch.exp(s - lse).nan_to_num(0.0)
    r = (p * (sel.to(q.device) & visible.to(q.device))).sum(-1)
    return torch.where(torch.isneginf(lse[..., 0]), 1.0, r)


def dense_of_indices(idx, lk, heads):
    """(B, H, Lq, Lk) bool of the listed keys (-1 = none); a (B, Lq, k) set is shared by the heads."""
    if idx.dim() == 3:
        idx = idx.unsqueeze(1)
    m = torch.zeros(*idx.shape[:3], lk + 1, dtype=torch.bool, device=idx.device)
    m.scatter_(-1, torch.where(idx >= 0, idx, lk).long(), True)
    return m[..., :lk].expand(idx.shape[0], heads, idx.shape[2], lk)


def qk(shape, seed=0, dtype=torch.float32, device="cpu"):
    b, h, hkv, lq, lk, d = shape
    q, k, v = make_qkv(b, h, hkv, lq, lk, d, dtype=dtype, device=device, seed=seed)
    return q, k, v


def assert_recall(got, want, tol=2e-5):
    assert got.shape == want.shape and got.dtype == torch.float32
    err = (got.double() - want.double()).abs().max().item() if got.numel() else 0.0
    assert err <= tol, f"recall differs from the fp64 brute force by {err:.3e}"


# ------------------------------------------------------------------------------------ recall vs brute force
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", list(SHAPES), ids=list(SHAPES))
def test_recall_random_element_mask(shape, causal):
    b, h, _, lq, lk, _ = SHAPES[shape]
    q, k, _ = qk(SHAPES[shape], seed=1)
    g = torch.Generator().manual_seed(2)
    for mshape in [(lq, lk), (b, 1, lq, lk), (1, h, 1, lk), (b, h, lq, lk)]:
        sel = torch.rand(mshape, generator=g) < 0.3
        assert_recall(softmax_mass_recall(q, k, sel, causal=causal), brute_recall(q, k, sel, causal=causal))


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", list(SHAPES), ids=list(SHAPES))
def test_recall_indices_with_padding(shape, causal):
    b, h, hkv, lq, lk, _ = SHAPES[shape]
    q, k, _ = qk(SHAPES[shape], seed=3)
    g = torch.Generator().manual_seed(4)
    for heads in (h, 1):
        idx = torch.randint(-1, lk, (b, heads, lq, 6), generator=g, dtype=torch.int32)  # -1s and repeats
        want = brute_recall(q, k, dense_of_indices(idx, lk, h), causal=causal)
        assert_recall(softmax_mass_recall(q, k, idx, causal=causal), want)
    shared = torch.randint(-1, lk, (b, lq, 4), generator=g)  # (B, Lq, k) int64, indexer-style
    want = brute_recall(q, k, dense_of_indices(shared, lk, h), causal=causal)
    assert_recall(softmax_mass_recall(q, k, shared, causal=causal), want)


@pytest.mark.parametrize("causal", [False, True])
def test_recall_of_topk_indices_token_and_indexer(causal):
    b, h, hkv, lq, lk, d = SHAPES["gqa_ragged"]
    q, k, v = qk(SHAPES["gqa_ragged"], seed=5)
    _, idx = sparse_attn.topk_attention(q, k, v, 9, causal=causal, return_indices=True)
    assert idx.shape == (b, h, lq, 9)
    want = brute_recall(q, k, dense_of_indices(idx, lk, h), causal=causal)
    assert_recall(softmax_mass_recall(q, k, idx, causal=causal), want)
    g = torch.Generator().manual_seed(6)
    iq, ik, iw = torch.randn(b, lq, 2, 8, generator=g), torch.randn(b, lk, 8, generator=g), torch.rand(b, lq, 2)
    _, shared = sparse_attn.topk_attention(
        q, k, v, 9, causal=causal, index_query=iq, index_key=ik, index_weights=iw, return_indices=True
    )
    assert shared.shape == (b, 1, lq, 9)
    want = brute_recall(q, k, dense_of_indices(shared, lk, h), causal=causal)
    assert_recall(softmax_mass_recall(q, k, shared, causal=causal), want)


@pytest.mark.parametrize("block", [64, 128])
def test_recall_block_sparse_masks(block):
    lq = lk = 200
    q, k, _ = qk((2, 3, 1, lq, lk, 32), seed=7)
    g = torch.Generator().manual_seed(8)
    masks = {
        "random element": BlockSparseMask.from_element_mask(
            torch.rand(2, 3, lq, lk, generator=g) < 0.2, block_size=block
        ),
        "dilated": patterns.dilated(lq, 90, 3, block_size=block),
        "bigbird per head": patterns.bigbird(lq, 40, 2, 1, seed=1, heads=3, block_size=block),
        "causal window": patterns.sliding_window(lq, 50, causal=True, block_size=block),
        "empty": BlockSparseMask.from_block_matrix(
            torch.zeros(2, 2, dtype=torch.bool), seq_lengths=(lq, lk), block_size=128
        ),
    }
    for name, mask in masks.items():
        for causal in (False, True):
            want = brute_recall(q, k, mask.to_dense(), causal=causal)
            got = softmax_mass_recall(q, k, mask, causal=causal)
            assert_recall(got, want)
            flex = softmax_mass_recall(q, k, mask.to_flex_block_mask(), causal=causal)
            assert torch.equal(flex, got), f"{name}: a FlexAttention BlockMask gives the same recall"


@pytest.mark.parametrize("causal", [False, True])
def test_recall_chunking_does_not_change_it(causal):
    q, k, _ = qk(SHAPES["gqa_ragged"], seed=9)
    lq, lk = q.shape[2], k.shape[2]
    g = torch.Generator().manual_seed(10)
    mask = BlockSparseMask.from_element_mask(torch.rand(lq, lk, generator=g) < 0.4, block_size=64)
    idx = torch.randint(-1, lk, (q.shape[0], q.shape[1], lq, 5), generator=g)
    for sel in (mask, idx, torch.rand(lq, lk, generator=g) < 0.4):
        whole = softmax_mass_recall(q, k, sel, causal=causal, chunk_rows=lq)
        for rows in (1, 7):
            chunked = softmax_mass_recall(q, k, sel, causal=causal, chunk_rows=rows)
            torch.testing.assert_close(chunked, whole, atol=1e-6, rtol=0)
        assert torch.equal(softmax_mass_recall(q, k, sel, causal=causal), whole)  # default: one chunk here


def test_recall_scale_and_low_precision_inputs():
    q, k, _ = qk(SHAPES["square_200"], seed=11, dtype=torch.bfloat16)
    sel = torch.rand(200, 200, generator=torch.Generator().manual_seed(12)) < 0.1
    for scale in (0.05, 0.5, -0.3):
        want = brute_recall(q, k, sel, causal=True, scale=scale)
        assert_recall(softmax_mass_recall(q, k, sel, causal=True, scale=scale), want, tol=1e-4)


# ------------------------------------------------------------------------------------ defined values
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", list(SHAPES), ids=list(SHAPES))
def test_recall_is_one_for_everything_selected(shape, causal):
    b, h, _, lq, lk, _ = SHAPES[shape]
    q, k, v = qk(SHAPES[shape], seed=13)
    for kk in (lk, lk + 5):
        _, idx = sparse_attn.topk_attention(q, k, v, kk, causal=causal, return_indices=True)
        torch.testing.assert_close(softmax_mass_recall(q, k, idx, causal=causal), torch.ones(b, h, lq))
    ones = BlockSparseMask.from_block_matrix(
        torch.ones(-(-lq // 128), -(-lk // 128), dtype=torch.bool), seq_lengths=(lq, lk)
    )
    for sel in (ones, torch.ones(lq, lk, dtype=torch.bool), torch.ones((), dtype=torch.bool)):
        assert torch.equal(softmax_mass_recall(q, k, sel, causal=causal), torch.ones(b, h, lq))


def test_recall_edge_rows():
    # Lq > Lk under causal: the first Lq - Lk rows see no key (recall 1); an empty selection gives 0
    # on every row that sees a key.
    q, k, _ = qk((1, 2, 1, 10, 4, 16), seed=14)
    r = softmax_mass_recall(q, k, torch.zeros(10, 4, dtype=torch.bool), causal=True)
    assert torch.equal(r[..., :6], torch.ones(1, 2, 6)) and torch.equal(r[..., 6:], torch.zeros(1, 2, 4))
    none = torch.full((1, 2, 10, 3), -1)
    assert torch.equal(softmax_mass_recall(q, k, none), torch.zeros(1, 2, 10))
    no_keys = torch.zeros(1, 1, 0, 16)
    assert torch.equal(softmax_mass_recall(q, no_keys, torch.ones(10, 0, dtype=torch.bool)), torch.ones(1, 2, 10))
    assert softmax_mass_recall(q[:, :, :0], k, torch.ones(1, dtype=torch.bool)).shape == (1, 2, 0)


def test_recall_propagates_nan():
    q, k, _ = qk((1, 1, 1, 6, 6, 16), seed=15)
    q[0, 0, 2, 0] = float("nan")
    r = softmax_mass_recall(q, k, torch.ones(6, 6, dtype=torch.bool))
    assert torch.isnan(r[0, 0, 2]) and not torch.isnan(r[0, 0, torch.arange(6) != 2]).any()


# ------------------------------------------------------------------------------------ top-k optimality
@pytest.mark.parametrize("causal", [False, True])
def test_topk_recall_nondecreasing_in_k(causal):
    q, k, v = qk(SHAPES["gqa_ragged"], seed=16)
    prev = None
    for kk in (1, 2, 4, 8, 16, 32, 70):
        _, idx = sparse_attn.topk_attention(q, k, v, kk, causal=causal, return_indices=True)
        r = softmax_mass_recall(q, k, idx, causal=causal)
        if prev is not None:
            assert bool((r >= prev - 1e-6).all()), f"recall decreased going to k={kk}"
        prev = r
    torch.testing.assert_close(prev, torch.ones_like(prev))


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("kk", [1, 5, 20])
def test_exact_topk_maximises_recall(kk, causal):
    b, h, hkv, lq, lk, d = shape = SHAPES["gqa_ragged"]
    q, k, v = qk(shape, seed=17 + kk)
    _, idx = sparse_attn.topk_attention(q, k, v, kk, causal=causal, return_indices=True)
    best = softmax_mass_recall(q, k, idx, causal=causal)
    g = torch.Generator().manual_seed(18)
    for trial in range(20):
        # Any other kk distinct visible keys per row (random ones, or a window ending at the diagonal).
        if trial == 0:
            last = torch.arange(lq) + (lk - lq) if causal else torch.full((lq,), lk - 1)
            other = (last[:, None] - torch.arange(kk)).expand(b, h, lq, kk)
            other = torch.where(other >= 0, other, -1)
        else:
            other = torch.rand(b, h, lq, lk, generator=g).argsort(-1)[..., :kk]
        r = softmax_mass_recall(q, k, other, causal=causal)
        assert bool((best >= r - 1e-6).all()), f"trial {trial}: a selection of {kk} keys beats the top-{kk}"


# ------------------------------------------------------------------------------------ evaluate
def test_evaluate_exact_dense_methods(device):
    b, h, hkv, lq, lk, d = SHAPES["gqa_ragged"]
    q, k, v = qk(SHAPES["gqa_ragged"], seed=19, device=device)
    all_blocks = BlockSparseMask.from_block_matrix(
        torch.ones(1, 1, 1, 2, dtype=torch.bool), seq_lengths=(lq, lk), block_size=64
    ).to(device)
    for causal in (False, True):
        methods = {"k = Lk": lk, "all blocks": all_blocks, "block top-k, every block": ("block", 10, 64)}
        for label, method in methods.items():
            r = evaluate(q, k, v, method, causal=causal)
            assert r.density == 1.0 and r.recall_min == 1.0 and r.recall_mean == 1.0, (label, r)
            assert r.rel_error < 1e-5 and r.max_abs_error < 1e-5, (label, r)


@pytest.mark.parametrize("causal", [False, True])
def test_evaluate_topk_reports_its_selection(causal):
    b, h, hkv, lq, lk, d = SHAPES["gqa_ragged"]
    q, k, v = qk(SHAPES["gqa_ragged"], seed=20)
    ref = sparse_attn.flash_attention(q, k, v, causal=causal)
    out, idx = sparse_attn.topk_attention(q, k, v, 8, causal=causal, return_indices=True)
    r = evaluate(q, k, v, 8, causal=causal)
    sel = dense_of_indices(idx, lk, h)
    want = brute_recall(q, k, sel, causal=causal)
    assert_recall(r.recall, want)
    assert r.recall_mean == pytest.approx(float(want.mean()), abs=1e-6)
    assert r.recall_min == pytest.approx(float(want.min()), abs=2e-5)
    assert r.recall_p01 == pytest.approx(float(torch.quantile(r.recall.double().flatten(), 0.01)), abs=1e-12)
    visible = reference.causal_mask(lq, lk) if causal else torch.ones(lq, lk, dtype=torch.bool)
    assert r.density == pytest.approx(float((sel & visible).sum()) / (b * h * float(visible.sum())))
    assert r.rel_error == pytest.approx(float((out.double() - ref.double()).norm() / ref.double().norm()))
    assert r.max_abs_error == pytest.approx(float((out.double() - ref.double()).abs().max()))
    assert r.name == "token top-k, k=8"
    assert evaluate(q, k, v, 8, causal=causal, reference=ref, name="x") == dataclasses.replace(r, name="x")


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("lq,lk", [(200, 200), (150, 230)])
def test_evaluate_block_topk_selection_is_what_the_op_computed(lq, lk, causal):
    from sparse_attn._routes import block_topk_mask as _block_topk_mask

    q, k, v = qk((1, 2, 1, lq, lk, 32), seed=21)
    out, blocks = sparse_attn.topk_attention(q, k, v, 2, block_size=64, causal=causal, return_indices=True)
    mask = analysis.mask_from_block_indices(blocks, (lq, lk), 64, causal=causal)
    op_mask, _ = _block_topk_mask(q, k, 2, 64, causal)
    assert torch.equal(mask.to_dense(), op_mask.to_dense())
    gold, _ = reference.attention(q, k, v, mask=mask.to_dense())
    torch.testing.assert_close(out.double(), gold, atol=1e-5, rtol=1e-5)
    r = evaluate(q, k, v, ("block", 2, 64), causal=causal)
    assert_recall(r.recall, brute_recall(q, k, mask.to_dense(), causal=causal))


def test_evaluate_mask_with_causal_intersects_it():
    q, k, v = qk((1, 2, 2, 256, 256, 32), seed=22)
    window = patterns.sliding_window(256, 40)  # symmetric: evaluate(causal=True) keeps its causal half
    r = evaluate(q, k, v, window, causal=True)
    half = patterns.sliding_window(256, 40, causal=True)
    out = sparse_attn.block_sparse_attention(q, k, v, half)
    ref = sparse_attn.flash_attention(q, k, v, causal=True)
    assert r.rel_error == pytest.approx(analysis.relative_error(out, ref), rel=1e-6)
    assert_recall(r.recall, brute_recall(q, k, half.to_dense(), causal=True))
    visible = reference.causal_mask(256, 256)
    assert r.density == pytest.approx(float((half.to_dense() & visible).sum() / visible.sum()))
    assert r.name.startswith("block-sparse mask")


def test_evaluate_indexer_and_study_inputs():
    q, k, v = analysis.structured_qkv(1, 2, 256, 32, seed=0)
    iq, ik, iw = analysis.structured_indexer(q, k, index_heads=2, index_dim=16)
    assert iq.shape == (1, 256, 2, 16) and ik.shape == (1, 256, 16) and iw.shape == (1, 256, 2)
    r = evaluate(q, k, v, ("indexer", 32, iq, ik, iw), causal=True)
    _, idx = sparse_attn.topk_attention(
        q, k, v, 32, causal=True, index_query=iq, index_key=ik, index_weights=iw, return_indices=True
    )
    assert_recall(r.recall, brute_recall(q, k, dense_of_indices(idx, 256, 2), causal=True))
    # The indexer follows the real attention: far better than 32 random visible keys, below exact top-k.
    g = torch.Generator().manual_seed(0)
    rand = torch.rand(1, 2, 256, 256, generator=g).masked_fill(~reference.causal_mask(256, 256), -1).topk(32).indices
    assert r.recall_mean > softmax_mass_recall(q, k, rand, causal=True).mean() + 0.2
    assert r.recall_mean <= evaluate(q, k, v, 32, causal=True).recall_mean + 1e-6


def test_structured_inputs_are_concentrated():
    q, k, v = analysis.structured_qkv(1, 2, 512, 64, seed=1)
    qr, kr, _ = analysis.random_qkv(1, 2, 512, 64, seed=1)
    top = evaluate(q, k, v, 32, causal=True).recall_mean
    _, idx = sparse_attn.topk_attention(qr, kr, kr, 32, causal=True, return_indices=True)
    assert top > 0.6 and top > softmax_mass_recall(qr, kr, idx, causal=True).mean() + 0.3
    sink = torch.zeros(512, 512, dtype=torch.bool)
    sink[:, 0] = True
    assert softmax_mass_recall(q, k, sink, causal=True)[..., 100:].mean() > 0.1, "position 0 is an attention sink"
    # 16 nearest keys against 16 keys 200 positions back (rows that have both, past the sinks' rows).
    d = torch.arange(512)[:, None] - torch.arange(512)[None, :]
    local = softmax_mass_recall(q, k, (d >= 0) & (d < 16), causal=True)[..., 216:]
    far = softmax_mass_recall(q, k, (d >= 200) & (d < 216) & (torch.arange(512) > 64), causal=True)[..., 216:]
    assert local.mean() > 4 * far.mean() > 0


def test_generators_shapes_seeds_dtypes(device):
    a = analysis.random_qkv(2, 3, 40, 16, dtype=torch.bfloat16, device=device, seed=5)
    b = analysis.random_qkv(2, 3, 40, 16, dtype=torch.bfloat16, device=device, seed=5)
    c = analysis.structured_qkv(2, 3, 40, 16, dtype=torch.float16, device=device, seed=5)
    for x, y in zip(a, b, strict=True):
        assert x.shape == (2, 3, 40, 16) and x.dtype == torch.bfloat16 and x.device.type == device
        assert torch.equal(x, y)
    assert not torch.equal(a[0], analysis.random_qkv(2, 3, 40, 16, dtype=torch.bfloat16, device=device, seed=6)[0])
    assert all(x.shape == (2, 3, 40, 16) and x.dtype == torch.float16 and x.device.type == device for x in c)
    iq, ik, iw = analysis.structured_indexer(*c[:2], index_heads=5, index_dim=8, seed=1)
    assert (iq.shape, ik.shape, iw.shape) == ((2, 40, 5, 8), (2, 40, 8), (2, 40, 5))
    assert iq.dtype == ik.dtype == iw.dtype == torch.float16 and iq.device.type == device


def test_recall_on_device(device):
    q, k, v = qk(SHAPES["gqa_ragged"], seed=23, device=device)
    causal_mask = patterns.causal(33, 70, block_size=64, device=device)
    got = softmax_mass_recall(q, k, causal_mask, causal=True)
    assert got.device.type == device and torch.allclose(got, torch.ones_like(got))
    sel = torch.rand(33, 70, generator=torch.Generator().manual_seed(24)) < 0.3
    want = brute_recall(q.cpu(), k.cpu(), sel)
    assert_recall(softmax_mass_recall(q, k, sel.to(device)).cpu(), want)
    dense_mask = BlockSparseMask.from_element_mask(sel, block_size=64)  # on the CPU: moved to q's device
    assert_recall(softmax_mass_recall(q, k, dense_mask).cpu(), want)
    _, idx = sparse_attn.topk_attention(q, k, v, 6, causal=True, return_indices=True)
    want = brute_recall(q.cpu(), k.cpu(), dense_of_indices(idx.cpu(), 70, 4), causal=True)
    assert_recall(softmax_mass_recall(q, k, idx, causal=True).cpu(), want)
    r = evaluate(q, k, v, ("block", 1, 64), causal=True)
    assert 0 < r.recall_mean <= 1 and r.recall.device.type == device
    assert softmax_mass_recall(q, k, torch.ones(33, 70, dtype=torch.bool)).device.type == device


# ------------------------------------------------------------------------------------ errors and results
def test_relative_and_max_abs_error():
    ref = torch.tensor([[3.0, 4.0]])
    assert analysis.relative_error(ref.clone(), ref) == 0.0
    assert analysis.relative_error(torch.tensor([[0.0, 4.0]]), ref) == pytest.approx(0.6)
    assert analysis.relative_error(torch.zeros(2), torch.zeros(2)) == 0.0
    assert analysis.relative_error(torch.ones(2), torch.zeros(2)) == float("inf")
    assert analysis.max_abs_error(torch.tensor([[0.0, 4.5]]), ref) == 3.0
    assert analysis.max_abs_error(torch.zeros(0), torch.zeros(0)) == 0.0
    half = ref.half()
    assert analysis.relative_error(half, ref) == 0.0  # compared in fp64, any dtypes
    nan = torch.tensor([[float("nan"), 4.0]])
    assert torch.isnan(torch.tensor(analysis.relative_error(nan, ref)))
    assert torch.isnan(torch.tensor(analysis.max_abs_error(nan, ref)))


def test_result_is_frozen_and_renders_markdown():
    q, k, v = qk((1, 1, 1, 64, 64, 16), seed=24)
    results = [evaluate(q, k, v, 8, name="top-8"), evaluate(q, k, v, 64, name="dense")]
    with pytest.raises(dataclasses.FrozenInstanceError):
        results[0].density = 1.0
    table = analysis.to_markdown(results).splitlines()
    assert table[0] == analysis.AnalysisResult.HEADER and table[1] == "|---|---|---|---|---|---|---|"
    assert table[2].startswith("| top-8 | 0.125 |") and table[3].startswith("| dense | 1.000 |")
    assert all(line.count("|") == 8 for line in table)
    assert "recall" not in repr(results[0]).split("recall_p01")[1]
    with pytest.raises(TypeError, match="AnalysisResult"):
        analysis.to_markdown(["x"])


def test_bad_inputs_name_the_argument():
    q, k, v = qk((1, 2, 1, 8, 10, 16), seed=25)
    ones = torch.ones(8, 10, dtype=torch.bool)
    cases = [
        (TypeError, "selection", lambda: softmax_mass_recall(q, k, [[True]])),
        (TypeError, "selection", lambda: softmax_mass_recall(q, k, ones.float())),
        (ValueError, "selection", lambda: softmax_mass_recall(q, k, torch.ones(8, 9, dtype=torch.bool))),
        (ValueError, "selection", lambda: softmax_mass_recall(q, k, torch.ones(1, 1, 1, 8, 10, dtype=torch.bool))),
        (ValueError, "selection", lambda: softmax_mass_recall(q, k, torch.full((1, 2, 8, 3), 10))),
        (ValueError, "selection", lambda: softmax_mass_recall(q, k, torch.full((1, 2, 8, 3), -2))),
        (ValueError, "selection", lambda: softmax_mass_recall(q, k, torch.zeros(1, 3, 8, 3, dtype=torch.int32))),
        (ValueError, "selection", lambda: softmax_mass_recall(q, k, torch.zeros(1, 7, 3, dtype=torch.int32))),
        (ValueError, "selection", lambda: softmax_mass_recall(q, k, torch.zeros(8, 3, dtype=torch.int32))),
        (ValueError, "selection", lambda: softmax_mass_recall(q, k, patterns.causal(8, 8))),
        (ValueError, "selection", lambda: softmax_mass_recall(q, k, patterns.random_blocks(8, 0.5, heads=3))),
        (ValueError, "chunk_rows", lambda: softmax_mass_recall(q, k, ones, chunk_rows=0)),
        (ValueError, "query", lambda: softmax_mass_recall(q[0], k, ones)),
        (TypeError, "key", lambda: softmax_mass_recall(q, "k", ones)),
        (ValueError, "heads", lambda: softmax_mass_recall(q, k.expand(1, 3, 10, 16), ones)),
        (ValueError, "head dimension", lambda: softmax_mass_recall(q, k[..., :8], ones)),
        (TypeError, "scale", lambda: softmax_mass_recall(q, k, ones, scale="0.1")),
        (TypeError, "method", lambda: evaluate(q, k, v, "top-k")),
        (TypeError, "method", lambda: evaluate(q, k, v, True)),
        (ValueError, "k must be positive", lambda: evaluate(q, k, v, 0)),
        (TypeError, "k must be an int", lambda: evaluate(q, k, v, ("block", 2.0, 64))),
        (ValueError, "method", lambda: evaluate(q, k, v, ("indexer", 3))),
        (ValueError, "method", lambda: evaluate(q, k, v, ("block", 3))),
        (ValueError, "method", lambda: evaluate(q, k, v, ("blocks", 3, 64))),
        (ValueError, "block_size", lambda: evaluate(q, k, v, ("block", 3, 32))),
        (ValueError, "reference", lambda: evaluate(q, k, v, 3, reference=torch.zeros(1))),
        (ValueError, "out and ref", lambda: analysis.relative_error(torch.zeros(2), torch.zeros(3))),
        (TypeError, "ref", lambda: analysis.max_abs_error(torch.zeros(2), [0.0, 0.0])),
        (ValueError, "D", lambda: analysis.structured_qkv(1, 1, 8, 18)),
        (ValueError, "heavy_hitters", lambda: analysis.structured_qkv(1, 1, 8, 16, heavy_hitters=9)),
        (ValueError, "local_scale", lambda: analysis.structured_qkv(1, 1, 8, 16, local_scale=-1.0)),
        (ValueError, "L", lambda: analysis.random_qkv(1, 1, 0, 16)),
        (TypeError, "seed", lambda: analysis.random_qkv(1, 1, 4, 16, seed=1.5)),
        (ValueError, "noise", lambda: analysis.structured_indexer(q, k, noise=-0.1)),
        (ValueError, "index_dim", lambda: analysis.structured_indexer(q, k, index_dim=0)),
        (TypeError, "indices", lambda: analysis.mask_from_block_indices(torch.zeros(1, 1, 1, 1), (8, 8), 64)),
        (
            ValueError,
            "indices",
            lambda: analysis.mask_from_block_indices(torch.zeros(1, 1, 2, 1, dtype=torch.int32), (8, 8), 64),
        ),
        (
            ValueError,
            "indices",
            lambda: analysis.mask_from_block_indices(torch.full((1, 1, 1, 1), 1, dtype=torch.int32), (8, 8), 64),
        ),
    ]
    for exc, words, call in cases:
        with pytest.raises(exc, match=words):
            call()
    # A rejected call leaves nothing behind.
    assert torch.equal(softmax_mass_recall(q, k, ones), torch.ones(1, 2, 8))


def test_docstring_examples_run():
    failures, tried = doctest.testmod(analysis, optionflags=doctest.ELLIPSIS)
    assert tried > 10 and failures == 0
