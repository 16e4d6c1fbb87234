"""topk_attention: exact selection on integer-valued inputs (ties go to the lower
index), the top-k property on float inputs, attention given the indices, the lightning indexer,
block mode, and argument checks."""

from __future__ import annotations

import math

import pytest
import torch
from utils import check_attention, check_close, make_qkv

import sparse_attn
from sparse_attn import BlockSparseMask, _routes, patterns, reference
from sparse_attn._plan import overrides

DTYPES = [torch.float32, torch.bfloat16, torch.float16]

# (B, H, Hkv, Lq, Lk, D)
SHAPES = {
    "tiny": (1, 1, 1, 5, 7, 64),
    "gqa_ragged": (2, 4, 2, 33, 70, 64),
    "mqa_lq_gt_lk": (1, 3, 1, 100, 37, 128),
    "decode": (2, 2, 2, 1, 300, 64),
    "square_257": (1, 2, 1, 257, 257, 64),
}


def small_ints(shape, seed, dtype, device="cpu", lo=-3, hi=4):
    """Integers in [lo, hi): exact in every dtype, and their dot products are exact in fp32."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(lo, hi, shape, generator=g).to(dtype).to(device)


def head_scores(q, k):
    """(B, H, Lq, Lk) fp64 q . k with GQA (query head h reads kv head h // (H // Hkv))."""
    k = k.double().repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    return q.double() @ k.transpose(-1, -2)


def indices_mask(indices, lk, heads):
    """(B, H, Lq, Lk) bool of the selected keys (-1 = none), repeated over heads when shared."""
    b, hi, lq, _ = indices.shape
    m = torch.zeros(b, hi, lq, lk + 1, dtype=torch.bool, device=indices.device)
    m.scatter_(-1, torch.where(indices >= 0, indices, lk).long(), True)
    return m[..., :lk].repeat_interleave(heads // hi, dim=1)


def check_selection_layout(idx, scores, k, causal):
    """Ascending, visible, -1 padding exactly where fewer than k keys are visible."""
    lq, lk = scores.shape[-2:]
    kk = min(k, lk)
    assert idx.dtype == torch.int32 and idx.shape == (*scores.shape[:-1], kk)
    visible = torch.ones(lq, lk, dtype=torch.bool)
    if causal:
        visible = reference.causal_mask(lq, lk)
    n_visible = visible.sum(-1).clamp(max=kk)  # (Lq,)
    pos = torch.arange(kk)
    want_valid = (pos < n_visible[:, None]).expand_as(idx)
    assert torch.equal(idx >= 0, want_valid), "counts: min(k, visible keys) indices, then -1 padding"
    assert bool((idx[~want_valid] == -1).all())
    live = idx.long().clamp(min=0)
    assert bool((live < lk).all())
    assert bool(visible.expand(*idx.shape[:-1], lk).gather(-1, live)[want_valid].all()), "selected a hidden key"
    if kk > 1:
        inc = idx[..., 1:] > idx[..., :-1]
        assert bool(inc[want_valid[..., 1:]].all()), "indices must be strictly ascending"
    return want_valid


def check_topk_property(idx, scores, k, causal, tol):
    """Every selected score >= every unselected visible score - tol."""
    want_valid = check_selection_layout(idx, scores, k, causal)
    lq, lk = scores.shape[-2:]
    visible = reference.causal_mask(lq, lk) if causal else torch.ones(lq, lk, dtype=torch.bool)
    chosen = indices_mask(idx, lk, idx.shape[1])
    inf = torch.tensor(float("inf"), dtype=scores.dtype)
    min_chosen = torch.where(chosen, scores, inf).amin(-1)
    max_rest = torch.where(visible & ~chosen, scores, -inf).amax(-1)
    bad = min_chosen < max_rest - tol
    assert not bool(bad.any()), (
        f"{int(bad.sum())} rows select a key scoring below an unselected visible one, "
        f"worst gap {(max_rest - min_chosen)[bad].max().item():.3e} > tol {tol:.1e}"
    )
    return want_valid


def check_gather(out, lse, q, k, v, idx, name):
    """Attention over the selected keys against reference.gather_attention: fp64 gold, the same
    math in the input dtype as the peer; LSE -inf exactly on the rows with no selected key."""
    gold, gold_lse = reference.gather_attention(q, k, v, idx)
    lp, _ = reference.gather_attention(q, k, v, idx, dtype=q.dtype)
    defined = torch.isfinite(gold_lse)
    check_close(name, out, gold, lp, dtype=q.dtype, defined=defined.unsqueeze(-1).expand_as(gold))
    if lse is not None:
        assert lse.dtype == torch.float32
        assert torch.equal(torch.isneginf(lse), ~defined), f"{name}: LSE must be -inf exactly on empty rows"
        tol = 1e-4 if q.dtype == torch.float32 else 2e-3
        assert torch.allclose(lse[defined].double(), gold_lse[defined], rtol=tol, atol=tol), f"{name}: LSE"


# ------------------------------------------------------------------------------------ token mode
@pytest.mark.parametrize("k_sel", [1, 3, 64])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", list(SHAPES), ids=list(SHAPES))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_token_selection_exact_on_integer_inputs(dtype, shape, causal, k_sel, device):
    b, h, hkv, lq, lk, d = SHAPES[shape]
    seed = sum(map(ord, shape)) + 7 * k_sel + causal
    q = small_ints((b, h, lq, d), seed, dtype, device)
    k = small_ints((b, hkv, lk, d), seed + 1, dtype, device)
    _, v, _ = make_qkv(b, hkv, hkv, lk, lk, d, dtype=dtype, device=device, seed=seed)
    out, lse, idx = sparse_attn.topk_attention(q, k, v, k_sel, causal=causal, return_indices=True, return_lse=True)
    scores = head_scores(q, k).cpu()
    want = reference.topk_indices(scores, k_sel, causal=causal)
    assert torch.equal(idx.cpu(), want), f"selection differs at {(idx.cpu() != want).nonzero()[:4].tolist()}"
    check_selection_layout(idx.cpu(), scores, k_sel, causal)
    check_gather(out, lse, q, k, v, idx, name=f"gather {shape} {dtype} causal={causal} k={k_sel}")


@pytest.mark.parametrize("causal", [False, True])
def test_token_selection_exact_ties_lower_index_wins(causal, device):
    b, h, lq, lk, d = 1, 2, 40, 100, 64
    q = small_ints((b, h, lq, d), 1, torch.bfloat16, device)
    base = small_ints((b, 1, 5, d), 2, torch.bfloat16, device)
    # Keys repeat in groups of 5 distinct rows: every score is tied with 19 others.
    k = base.repeat(1, 1, lk // 5, 1)
    v = make_qkv(b, 1, 1, lk, lk, d, dtype=torch.bfloat16, device=device, seed=3)[2]
    out, idx = sparse_attn.topk_attention(q, k, v, 7, causal=causal, return_indices=True)
    scores = head_scores(q, k).cpu()
    assert torch.equal(idx.cpu(), reference.topk_indices(scores, 7, causal=causal))
    # All keys equal: the k lowest visible positions win.
    same = k[:, :, :1].expand(b, 1, lk, d).contiguous()
    _, idx = sparse_attn.topk_attention(q, same, v, 7, causal=causal, return_indices=True)
    # (Under causal every row sees at least Lk - Lq + 1 = 61 keys.)
    assert torch.equal(idx.cpu(), torch.arange(7, dtype=torch.int32).expand(b, h, lq, 7))


@pytest.mark.parametrize("k_sel", [1, 100, 2048, 3000])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("spread", [4, 100], ids=["many_ties", "few_ties"])
@pytest.mark.parametrize("lk", [6000, 20000])
def test_token_selection_exact_on_long_rows(lk, spread, causal, k_sel, device):
    """Long rows (the CUDA select samples rows of 8192 keys or more when k <= 2925, else bins
    them): many tied scores, or few."""
    b, h, lq, d = 1, 2, 8, 64
    q = small_ints((b, h, lq, d), 61, torch.bfloat16, device, lo=-spread, hi=spread)
    k = small_ints((b, 1, lk, d), 62, torch.bfloat16, device, lo=-spread, hi=spread)
    v = make_qkv(b, 1, 1, lk, lk, d, device=device, seed=63)[2]
    _, idx = sparse_attn.topk_attention(q, k, v, k_sel, causal=causal, return_indices=True)
    want = reference.topk_indices(head_scores(q, k).cpu(), k_sel, causal=causal)
    assert torch.equal(idx.cpu(), want), f"selection differs at {(idx.cpu() != want).nonzero()[:4].tolist()}"


@pytest.mark.parametrize("layout", ["rising", "in_sample_only"])
def test_token_selection_when_the_sample_misjudges(layout, device):
    """Rows the sampled select cannot finish: the top keys crowd into one warp's segment (its
    region overflows), or sit only where the sample looks (too few keys pass its threshold)."""
    lk, d = 20000, 64
    j = torch.arange(lk)
    if layout == "rising":
        level = j // 100  # the largest scores at the end of the row
    else:
        level = torch.where(j % 2048 < 128, 200 + j % 7, j % 5)  # the sample's runs hold the large ones
    k = (level.float()[:, None] / 8).expand(lk, d).to(torch.bfloat16)[None, None].contiguous().to(device)
    q = torch.ones(1, 1, 4, d, dtype=torch.bfloat16, device=device)
    for k_sel in (100, 2048):
        _, idx = sparse_attn.topk_attention(q, k, k, k_sel, return_indices=True)
        want = reference.topk_indices(head_scores(q, k).cpu(), k_sel)
        where = (idx.cpu() != want).nonzero()[:4].tolist()
        assert torch.equal(idx.cpu(), want), f"{layout} k={k_sel}: differs at {where}"


def test_token_selection_when_one_bin_overflows(device):
    """5000 equal scores in one row: more than the selection's shared-memory candidates."""
    q = small_ints((1, 1, 3, 64), 64, torch.float16, device)
    k = small_ints((1, 1, 1, 64), 65, torch.float16, device).expand(1, 1, 5000, 64).contiguous()
    _, idx = sparse_attn.topk_attention(q, k, k, 9, return_indices=True)
    assert torch.equal(idx.cpu(), torch.arange(9, dtype=torch.int32).expand(1, 1, 3, 9))


@pytest.mark.parametrize("k_sel", [1, 50])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", ["gqa_ragged", "mqa_lq_gt_lk", "square_257"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_token_selection_property_on_random_inputs(dtype, shape, causal, k_sel, device):
    b, h, hkv, lq, lk, d = SHAPES[shape]
    q, k, v = make_qkv(b, h, hkv, lq, lk, d, dtype=dtype, device=device, seed=k_sel + 100 * causal)
    out, lse, idx = sparse_attn.topk_attention(q, k, v, k_sel, causal=causal, return_indices=True, return_lse=True)
    scores = head_scores(q, k).cpu()
    # Scores are fp32 sums of d products of the inputs: allow their rounding, nothing more.
    tol = 1e-6 * d * float(scores.abs().max())
    check_topk_property(idx.cpu(), scores, k_sel, causal, tol)
    check_gather(out, lse, q, k, v, idx, name=f"gather {shape} {dtype} causal={causal} k={k_sel}")


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", ["tiny", "gqa_ragged", "mqa_lq_gt_lk", "decode"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_k_at_least_lk_equals_dense(dtype, shape, causal, device):
    b, h, hkv, lq, lk, d = SHAPES[shape]
    q, k, v = make_qkv(b, h, hkv, lq, lk, d, dtype=dtype, device=device, seed=21)
    for k_sel in (lk, lk + 3, 1 << 20):
        out, lse, idx = sparse_attn.topk_attention(q, k, v, k_sel, causal=causal, return_indices=True, return_lse=True)
        assert idx.shape[-1] == lk
        check_attention(out, lse, q, k, v, causal=causal, name=f"k={k_sel} vs dense")
        gold, _ = reference.attention(q, k, v, causal=causal)
        dense = sparse_attn.dense_attention(q, k, v, causal=causal)
        check_close(f"k={k_sel} vs dense_attention", out, gold, dense, dtype=dtype)


@pytest.mark.parametrize("indexer", [False, True])
def test_rows_with_no_visible_key(indexer, device):
    b, h, lq, lk, d = 2, 2, 50, 20, 64  # causal, Lq > Lk: the first 30 rows see nothing
    q, k, v = make_qkv(b, h, h, lq, lk, d, dtype=torch.bfloat16, device=device, seed=22)
    extra = {}
    if indexer:
        extra = {
            "index_query": small_ints((b, lq, 2, 32), 1, torch.bfloat16, device),
            "index_key": small_ints((b, lk, 32), 2, torch.bfloat16, device),
            "index_weights": small_ints((b, lq, 2), 3, torch.bfloat16, device),
        }
    out, lse, idx = sparse_attn.topk_attention(q, k, v, 4, causal=True, return_indices=True, return_lse=True, **extra)
    empty = slice(0, lq - lk)
    assert bool((idx[:, :, empty] == -1).all())
    assert bool((out[:, :, empty] == 0).all()), "a row with no visible key is exactly 0"
    assert bool(torch.isneginf(lse[:, :, empty]).all())
    assert not bool(torch.isneginf(lse[:, :, lq - lk :]).any())
    assert not torch.isnan(out).any()
    check_gather(out, lse, q, k, v, idx, name="partly empty")


def test_gqa_heads_of_one_group_select_independently(device):
    b, h, hkv, lq, lk, d = 1, 4, 1, 64, 128, 64
    q = small_ints((b, h, lq, d), 31, torch.float16, device)
    k = small_ints((b, hkv, lk, d), 32, torch.float16, device)
    v = make_qkv(b, 1, 1, lk, lk, d, dtype=torch.float16, device=device, seed=33)[2]
    out, lse, idx = sparse_attn.topk_attention(q, k, v, 8, return_indices=True, return_lse=True)
    assert idx.shape == (b, h, lq, 8)
    assert not torch.equal(idx[:, 0], idx[:, 1]), "each query head selects its own keys"
    assert torch.equal(idx.cpu(), reference.topk_indices(head_scores(q, k).cpu(), 8))
    check_gather(out, lse, q, k, v, idx, name="gqa")


def test_strided_inputs_select_and_attend_like_contiguous(device):
    q, k, v = make_qkv(2, 4, 2, 100, 130, 64, dtype=torch.bfloat16, device=device, seed=34, layout="blhd")
    assert not q.is_contiguous()
    out, idx = sparse_attn.topk_attention(q, k, v, 9, causal=True, return_indices=True)
    out_c, idx_c = sparse_attn.topk_attention(
        q.contiguous(), k.contiguous(), v.contiguous(), 9, causal=True, return_indices=True
    )
    assert torch.equal(idx, idx_c)
    check_gather(out, None, q, k, v, idx, name="strided")
    check_close("strided vs contiguous", out, reference.gather_attention(q, k, v, idx)[0], out_c, dtype=q.dtype)


def unique_indices(b, hi, lq, lk, k, seed, device):
    """(B, Hi, Lq, k) int32 rows of distinct keys in random order, with -1 and out-of-range
    entries (both mean "no key") sprinkled in, and a few rows with no key at all."""
    g = torch.Generator().manual_seed(seed)
    idx = torch.argsort(torch.rand(b, hi, lq, lk, generator=g), dim=-1)[..., :k].to(torch.int32)
    drop = torch.rand(b, hi, lq, k, generator=g)
    idx = torch.where(drop < 0.1, torch.tensor(-1, dtype=torch.int32), idx)
    idx = torch.where((drop >= 0.1) & (drop < 0.15), torch.tensor(lk + 7, dtype=torch.int32), idx)
    idx[:, :, :2] = -1
    return idx.to(device)


# (B, H, Hkv, Hi, Lq, Lk, D): heads sharing a kv head and an index set are served together
# (groups of 32 -> two warps of 16, 4, 2 (gcd(4, 6)), and 1).
GATHER_SHAPES = {
    "mqa_shared_32": (1, 32, 1, 1, 21, 300, 128),
    "gqa_per_kv_head": (2, 16, 4, 4, 19, 130, 64),
    "gqa_gcd_2": (1, 12, 3, 2, 17, 200, 96),
    "per_head": (2, 8, 2, 8, 9, 90, 64),
    # Four groups of 16 heads per token share K/V stages (gather_mma's kShared), at both head dims,
    # and beside them heads in 2 K/V groups of 64 (a batch of two: every CTA one token).
    "mqa_64_heads_shared": (2, 64, 1, 1, 13, 300, 128),
    "gqa_128_heads_shared_d64": (1, 128, 2, 2, 11, 150, 64),
}


@pytest.mark.parametrize("k_sel", [5, 77])
@pytest.mark.parametrize("shape", list(GATHER_SHAPES), ids=list(GATHER_SHAPES))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gather_with_index_sets_shared_across_heads(dtype, shape, k_sel, device):
    b, h, hkv, hi, lq, lk, d = GATHER_SHAPES[shape]
    q, k, v = make_qkv(b, h, hkv, lq, lk, d, dtype=dtype, device=device, seed=k_sel + lk)
    idx = unique_indices(b, hi, lq, lk, k_sel, seed=k_sel + h, device=device)
    out, lse = torch.ops.sparse_attn.gather_fwd(q, k, v, idx)
    check_gather(out, lse, q, k, v, idx, name=f"gather {shape} {dtype} k={k_sel}")
    assert bool(torch.isneginf(lse[:, :, :2]).all()), "rows listing no key have LSE -inf"


# (B, H, Hkv, Hi, Lq, Lk, D) whose runs of 64 heads share a kv head and an index set: on an H100
# the wgmma gather (gather_wgmma.cuh), one CTA per token and 64 heads, 64-key stages in a ring of 3.
WGMMA_GATHER_SHAPES = {
    "dsa_64_heads": (1, 64, 1, 1, 9, 1500, 128),
    "two_kv_groups_d64": (2, 128, 2, 2, 5, 700, 64),
}


@pytest.mark.cuda
@pytest.mark.parametrize("k_sel", [64, 130, 641])
@pytest.mark.parametrize("shape", list(WGMMA_GATHER_SHAPES), ids=list(WGMMA_GATHER_SHAPES))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_gather_of_64_heads_over_many_stages(dtype, shape, k_sel):
    """Selections longer than the stage ring (k = 641: 11 stages of 64 keys, the last partial;
    130: a ring turn and a 2-key stage), with -1 and out-of-range slots and rows with none; the
    Hopper plan on sm_90, the same inputs through the mma.sync gather for comparison."""
    b, h, hkv, hi, lq, lk, d = WGMMA_GATHER_SHAPES[shape]
    q, k, v = make_qkv(b, h, hkv, lq, lk, d, dtype=dtype, device="cuda", seed=k_sel + h)
    idx = unique_indices(b, hi, lq, lk, k_sel, seed=k_sel + lk, device="cuda")
    idx[0, 0, 3, : k_sel // 2] = -1  # a row whose first stages hold no key
    out, lse = torch.ops.sparse_attn.gather_fwd(q, k, v, idx)
    check_gather(out, lse, q, k, v, idx, name=f"wgmma gather {shape} {dtype} k={k_sel}")
    with overrides(portable_only=True):
        out_p, lse_p = torch.ops.sparse_attn.gather_fwd(q, k, v, idx)
    defined = torch.isfinite(lse_p)
    assert torch.equal(torch.isfinite(lse), defined)
    torch.testing.assert_close(lse[defined], lse_p[defined], rtol=2e-3, atol=2e-3)
    torch.testing.assert_close(out.float(), out_p.float(), rtol=2e-2, atol=2e-2)


@pytest.mark.cuda
@pytest.mark.parametrize("indexer", [False, True])
@pytest.mark.parametrize("workspace", [2 * 64 * 200 * 4, 10_000], ids=["two_tiles", "row_chunks"])
@pytest.mark.parametrize("causal", [False, True])
def test_selection_over_a_small_workspace_in_chunks(causal, workspace, indexer):
    """The score workspace is cut to two 64-row tiles (tensor-core scoring, 9 chunks) or to a few
    rows (CUDA-core scoring): the selection must not change."""
    b, h, hkv, lq, lk, d = 2, 3, 1, 150, 200, 64
    q = small_ints((b, h, lq, d), 51, torch.bfloat16, "cuda")
    k = small_ints((b, hkv, lk, d), 52, torch.bfloat16, "cuda")
    v = make_qkv(b, hkv, hkv, lk, lk, d, device="cuda", seed=53)[2]
    extra = {}
    if indexer:
        extra = {
            "index_query": small_ints((b, lq, 3, 64), 54, torch.bfloat16, "cuda"),
            "index_key": small_ints((b, lk, 64), 55, torch.bfloat16, "cuda"),
            "index_weights": small_ints((b, lq, 3), 56, torch.bfloat16, "cuda"),
        }
    with overrides(select_workspace_bytes=workspace):
        plan = sparse_attn.explain(sparse_attn.topk_attention, q, k, v, 33, causal=causal, **extra)
        _, idx = sparse_attn.topk_attention(q, k, v, 33, causal=causal, return_indices=True, **extra)
    select = plan.launches[0]
    assert select.options["chunks"] > 1 and select.options["workspace_bytes"] <= workspace
    assert select.core == ("portable" if workspace == 2 * 64 * 200 * 4 else "cuda_cores")
    if indexer:
        scores = reference.indexer_scores(*(t.cpu() for t in extra.values())).unsqueeze(1)
    else:
        scores = head_scores(q, k).cpu()
    want = reference.topk_indices(scores, 33, causal=causal)
    assert torch.equal(idx.cpu(), want), f"selection differs at {(idx.cpu() != want).nonzero()[:4].tolist()}"


# ------------------------------------------------------------------------------------ lightning indexer
@pytest.mark.parametrize("k_sel", [1, 4, 32])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize(
    "dims",
    [(1, 2, 1, 20, 20, 1, 16), (2, 4, 2, 33, 70, 4, 32), (1, 2, 2, 100, 37, 2, 64), (2, 3, 1, 1, 257, 3, 32)],
)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_indexer_selection_exact_on_integer_inputs(dtype, dims, causal, k_sel, device):
    b, h, hkv, lq, lk, hi, di = dims
    seed = lq + lk + hi + k_sel
    q, k, v = make_qkv(b, h, hkv, lq, lk, 64, dtype=dtype, device=device, seed=seed)
    iq = small_ints((b, lq, hi, di), seed + 1, dtype, device)
    ik = small_ints((b, lk, di), seed + 2, dtype, device)
    iw = small_ints((b, lq, hi), seed + 3, dtype, device)
    out, lse, idx = sparse_attn.topk_attention(
        q,
        k,
        v,
        k_sel,
        causal=causal,
        index_query=iq,
        index_key=ik,
        index_weights=iw,
        return_indices=True,
        return_lse=True,
    )
    assert idx.shape == (b, 1, lq, min(k_sel, lk)), "one index set per token, shared by all heads"
    scores = reference.indexer_scores(iq, ik, iw).unsqueeze(1).cpu()
    want = reference.topk_indices(scores, k_sel, causal=causal)
    assert torch.equal(idx.cpu(), want), f"selection differs at {(idx.cpu() != want).nonzero()[:4].tolist()}"
    check_selection_layout(idx.cpu(), scores, k_sel, causal)
    check_gather(out, lse, q, k, v, idx, name=f"indexer {dims} {dtype} causal={causal} k={k_sel}")


def test_indexer_scores_reference_is_the_formula():
    g = torch.Generator().manual_seed(0)
    iq, ik, iw = (
        torch.randn(2, 5, 3, 8, generator=g),
        torch.randn(2, 7, 8, generator=g),
        torch.randn(2, 5, 3, generator=g),
    )
    got = reference.indexer_scores(iq, ik, iw)
    want = torch.zeros(2, 5, 7, dtype=torch.float64)
    for b in range(2):
        for t in range(5):
            for s in range(7):
                want[b, t, s] = sum(
                    iw[b, t, j].double() * torch.relu(iq[b, t, j].double() @ ik[b, s].double()) for j in range(3)
                )
    assert torch.allclose(got, want, atol=1e-12)


@pytest.mark.parametrize("causal", [False, True])
def test_indexer_selection_property_on_random_inputs(causal, device):
    b, h, lq, lk, hi, di = 2, 2, 80, 150, 4, 32
    q, k, v = make_qkv(b, h, h, lq, lk, 64, dtype=torch.bfloat16, device=device, seed=41)
    g = torch.Generator().manual_seed(41)
    iq = torch.randn(b, lq, hi, di, generator=g).to(torch.bfloat16).to(device)
    ik = torch.randn(b, lk, di, generator=g).to(torch.bfloat16).to(device)
    iw = torch.rand(b, lq, hi, generator=g).to(torch.bfloat16).to(device)
    out, idx = sparse_attn.topk_attention(
        q, k, v, 12, causal=causal, index_query=iq, index_key=ik, index_weights=iw, return_indices=True
    )
    scores = reference.indexer_scores(iq, ik, iw).unsqueeze(1).cpu()
    check_topk_property(idx.cpu(), scores, 12, causal, tol=1e-4 * float(scores.abs().max()) + 1e-6)
    check_gather(out, None, q, k, v, idx, name="indexer random")


def test_indexer_rejects_partial_arguments():
    q, k, v = make_qkv(1, 2, 2, 16, 16, 64, dtype=torch.bfloat16, seed=42)
    iq, ik = small_ints((1, 16, 2, 16), 1, torch.bfloat16), small_ints((1, 16, 16), 2, torch.bfloat16)
    iw = small_ints((1, 16, 2), 3, torch.bfloat16)
    with pytest.raises(ValueError, match="index_query, index_key and index_weights"):
        sparse_attn.topk_attention(q, k, v, 4, index_query=iq, index_key=ik)
    with pytest.raises(ValueError, match="block_size"):
        sparse_attn.topk_attention(q, k, v, 1, block_size=64, index_query=iq, index_key=ik, index_weights=iw)
    with pytest.raises(ValueError, match="index_query"):
        sparse_attn.topk_attention(q, k, v, 4, index_query=iq[:, :8], index_key=ik, index_weights=iw[:, :8])
    with pytest.raises(ValueError, match="index_key"):
        sparse_attn.topk_attention(q, k, v, 4, index_query=iq, index_key=ik[:, :8], index_weights=iw)
    out = sparse_attn.topk_attention(q, k, v, 4, index_query=iq, index_key=ik, index_weights=iw)
    assert out.shape == q.shape


# ------------------------------------------------------------------------------------ block mode
def block_indices_mask(idx, lq, lk, block_size, causal):
    """The mask block mode attends through: the returned key blocks, intersected with causal."""
    nk = math.ceil(lk / block_size)
    blocks = torch.zeros(*idx.shape[:-1], nk + 1, dtype=torch.bool)
    blocks.scatter_(-1, torch.where(idx < 0, nk, idx).long().cpu(), True)
    mask = BlockSparseMask.from_block_matrix(blocks[..., :nk], seq_lengths=(lq, lk), block_size=block_size)
    return mask & patterns.causal(lq, lk, block_size=block_size) if causal else mask


@pytest.mark.parametrize("k_sel", [1, 3])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("block_size", [64, 128])
@pytest.mark.parametrize(
    "shape",
    [(1, 2, 2, 256, 256, 64), (2, 4, 2, 257, 300, 64), (1, 2, 1, 300, 130, 128), (2, 2, 2, 1, 300, 64)],
)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_block_mode_equals_block_sparse_reference(dtype, shape, block_size, causal, k_sel, device):
    b, h, hkv, lq, lk, d = shape
    q, k, v = make_qkv(b, h, hkv, lq, lk, d, dtype=dtype, device=device, seed=lq + k_sel)
    out, lse, idx = sparse_attn.topk_attention(
        q, k, v, k_sel, block_size=block_size, causal=causal, return_indices=True, return_lse=True
    )
    nq, nk = math.ceil(lq / block_size), math.ceil(lk / block_size)
    # Under causal every block holding a row's diagonal key is kept (two when Lk - Lq is not a
    # multiple of the block size), the block before them (the local band) and the first key block
    # (the sinks): the width is at least that.
    n_kept = (2 if (lk - lq) % block_size else 1) + 2 if causal else 1
    kk = min(max(k_sel, n_kept), nk)
    assert idx.dtype == torch.int32 and idx.shape == (b, h, nq, kk)
    idx_c = idx.cpu()
    live = idx_c >= 0
    assert bool((idx_c[live] < nk).all()) and bool((idx_c[~live] == -1).all())
    # Ascending, -1 padding at the end only.
    assert bool((live[..., 1:] <= live[..., :-1]).all())
    assert bool((idx_c[..., 1:] > idx_c[..., :-1])[live[..., 1:]].all())
    if not causal:
        assert bool(live.all()), "with no causal mask every query block gets min(k, nKb) key blocks"
    mask = block_indices_mask(idx_c, lq, lk, block_size, causal)
    check_attention(out, lse, q, k, v, mask=mask.to_dense().to(device), name=f"block mode k={k_sel}")


@pytest.mark.parametrize("block_size", [64, 128])
@pytest.mark.parametrize("length", [1, 200, 256, 257, 640])
def test_block_mode_causal_keeps_the_diagonal_band_and_sink_blocks(length, block_size, device):
    q, k, v = make_qkv(1, 3, 3, length, length, 64, dtype=torch.bfloat16, device=device, seed=length)
    for k_sel in (1, 2):
        out, lse, idx = sparse_attn.topk_attention(
            q, k, v, k_sel, block_size=block_size, causal=True, return_indices=True, return_lse=True
        )
        nq = math.ceil(length / block_size)
        diag = torch.arange(nq, dtype=torch.int32)[None, None, :, None]
        assert bool((idx.cpu() == diag).any(-1).all()), "the diagonal block is always kept under causal"
        assert bool((idx.cpu() == 0).any(-1).all()), "the first key block (the sinks) is always kept"
        band = (diag - 1).clamp(min=0)
        assert bool((idx.cpu() == band).any(-1).all()), "the block before the diagonal is always kept"
        assert not bool(torch.isneginf(lse).any()), "every query sees at least itself"


def test_block_mode_scores_keep_one_strong_key():
    # A key block holding one key aligned with every query beats blocks of middling keys, though
    # its mean is no larger than theirs: the score bounds q . k over the block (Quest), it does
    # not average the block's keys.
    d, bs = 64, 64
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 1, bs, d, generator=g).abs() + 1  # one query block, positive queries
    k = torch.full((1, 1, 4 * bs, d), 0.1)  # four key blocks of middling keys ...
    k[0, 0, 2 * bs + 5] = 3.0  # ... block 2 holding one strong key ...
    k[0, 0, 2 * bs :] -= 3.0 / bs  # ... and no larger a mean than the others
    _, idx = sparse_attn.topk_attention(q, k, k, 1, block_size=bs, return_indices=True)
    assert idx.flatten().tolist() == [2]


@pytest.mark.parametrize("lengths", [(257, 300), (300, 130)])
def test_block_mode_causal_every_row_sees_its_diagonal_key(lengths):
    lq, lk = lengths
    q, k, v = make_qkv(1, 2, 2, lq, lk, 64, dtype=torch.float32, seed=51)
    out, lse, idx = sparse_attn.topk_attention(
        q, k, v, 1, block_size=64, causal=True, return_indices=True, return_lse=True
    )
    rows = torch.arange(lq)
    diag_key = rows + (lk - lq)
    has_keys = diag_key >= 0
    assert not bool(torch.isneginf(lse[..., has_keys]).any()), "rows with visible keys returned as empty"
    mask = block_indices_mask(idx, lq, lk, 64, causal=True).to_dense()
    assert bool(mask[..., rows[has_keys], diag_key[has_keys]].all())


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("block_size", [64, 128])
@pytest.mark.parametrize("lengths", [(256, 256), (200, 300), (300, 200)])
def test_block_mode_k_at_least_nkb_equals_dense(lengths, block_size, causal, device):
    lq, lk = lengths
    q, k, v = make_qkv(2, 4, 2, lq, lk, 64, dtype=torch.bfloat16, device=device, seed=61)
    nk = math.ceil(lk / block_size)
    for k_sel in (nk, nk + 1, 1000):
        out, lse = sparse_attn.topk_attention(q, k, v, k_sel, block_size=block_size, causal=causal, return_lse=True)
        check_attention(out, lse, q, k, v, causal=causal, name=f"block mode k={k_sel} >= nKb={nk}")


def test_block_mode_selects_the_dominant_block(device):
    # Every query points along u; key block 2 points along u strongly, the rest is noise:
    # block 2 is the top-scoring block of every query block, however the blocks are pooled.
    b, h, lq, lk, d, bs = 1, 2, 256, 512, 64, 64
    g = torch.Generator().manual_seed(71)
    u = torch.randn(d, generator=g)
    q = (u + 0.1 * torch.randn(b, h, lq, d, generator=g)).to(torch.bfloat16).to(device)
    k = 0.1 * torch.randn(b, h, lk, d, generator=g)
    k[:, :, 2 * bs : 3 * bs] += 3 * u
    k = k.to(torch.bfloat16).to(device)
    v = torch.randn(b, h, lk, d, generator=g).to(torch.bfloat16).to(device)
    out, idx = sparse_attn.topk_attention(q, k, v, 1, block_size=bs, return_indices=True)
    assert bool((idx == 2).all())
    mask = block_indices_mask(idx.cpu(), lq, lk, bs, causal=False)
    check_attention(out, None, q, k, v, mask=mask.to_dense().to(device))


# ------------------------------------------------------------------------------------ arguments
def test_return_value_order(device):
    q, k, v = make_qkv(1, 2, 2, 20, 30, 64, dtype=torch.bfloat16, device=device, seed=81)
    out = sparse_attn.topk_attention(q, k, v, 4)
    assert isinstance(out, torch.Tensor) and out.shape == q.shape
    out2, idx = sparse_attn.topk_attention(q, k, v, 4, return_indices=True)
    assert idx.dtype == torch.int32 and torch.equal(out, out2)
    out3, lse = sparse_attn.topk_attention(q, k, v, 4, return_lse=True)
    assert lse.dtype == torch.float32 and lse.shape == (1, 2, 20) and torch.equal(out, out3)
    out4, lse4, idx4 = sparse_attn.topk_attention(q, k, v, 4, return_lse=True, return_indices=True)
    assert torch.equal(out4, out) and torch.equal(lse4, lse) and torch.equal(idx4, idx)


@pytest.mark.parametrize("mode", ["token", "block", "indexer"])
@pytest.mark.parametrize("bad, exc", [(0, ValueError), (-1, ValueError), (1.5, TypeError), (True, TypeError)])
def test_bad_k_raises(bad, exc, mode):
    q, k, v = make_qkv(1, 2, 2, 100, 100, 64, dtype=torch.bfloat16, seed=82)
    extra = {}
    if mode == "block":
        extra = {"block_size": 64}
    if mode == "indexer":
        extra = {
            "index_query": small_ints((1, 100, 2, 16), 1, torch.bfloat16),
            "index_key": small_ints((1, 100, 16), 2, torch.bfloat16),
            "index_weights": small_ints((1, 100, 2), 3, torch.bfloat16),
        }
    with pytest.raises(exc, match="k must be"):
        sparse_attn.topk_attention(q, k, v, bad, **extra)
    out, lse, idx = sparse_attn.topk_attention(q, k, v, 1, return_lse=True, return_indices=True, **extra)
    assert idx.shape[-1] == 1 and bool((idx >= 0).all()) and not bool(torch.isneginf(lse).any())
    if mode == "block":
        mask = block_indices_mask(idx, 100, 100, 64, causal=False).to_dense()
    else:
        mask = indices_mask(idx, 100, 2)
    check_attention(out, lse, q, k, v, mask=mask)


# ---- user selections (indices=) ----


def _user_reference(q, k, v, sel, block_size, causal):
    """fp64 attention over each query's listed keys (blocks expanded), causal applied, a key listed
    more than once counted once."""
    b, h, lq, _ = q.shape
    lk = k.shape[2]
    g = sel.shape[1]
    tok = sel.long()
    if block_size:
        tok = torch.where(tok[..., None] >= 0, tok[..., None] * block_size + torch.arange(block_size), -1).flatten(-2)
    tok = tok.repeat_interleave(h // g, dim=1)
    counts = torch.zeros(b, h, lq, lk + 1, dtype=torch.float64)
    tok = torch.where((tok >= 0) & (tok < lk), tok, lk)
    counts.scatter_add_(-1, tok, torch.ones_like(tok, dtype=torch.float64))
    counts = counts[..., :lk].clamp(max=1)
    if causal:
        counts = counts * sparse_attn.reference.causal_mask(lq, lk).double()
    kk = k.double().repeat_interleave(h // k.shape[1], dim=1)
    vv = v.double().repeat_interleave(h // v.shape[1], dim=1)
    s = (q.double() @ kk.transpose(-1, -2)) * q.shape[-1] ** -0.5
    w = torch.exp(s - s.amax(-1, keepdim=True)) * counts
    den = w.sum(-1, keepdim=True)
    return torch.where(den > 0, (w @ vv) / den.clamp_min(1e-300), 0.0)


@pytest.mark.parametrize("route", ["gather", "masked_block"])
@pytest.mark.parametrize("g", [1, 2, 4])
@pytest.mark.parametrize("block_size", [None, 64, 128])
@pytest.mark.parametrize("causal", [False, True])
def test_user_selection(device, g, block_size, causal, route):
    """Both routes, entries repeated and out of range, Lq < Lk (bottom-right causal)."""
    b, h, hkv, lq, lk, d = 2, 4, 2, 70, 300, 64
    gen = torch.Generator().manual_seed(g * 10 + (block_size or 0) + causal)
    q = torch.randn(b, h, lq, d, generator=gen)
    k = torch.randn(b, hkv, lk, d, generator=gen)
    v = torch.randn(b, hkv, lk, d, generator=gen)
    n_units = lk if block_size is None else -(-lk // block_size)
    width = 9 if block_size is None else 3
    sel = torch.randint(-1, n_units + 1, (b, g, lq, width), generator=gen).to(torch.int32)
    sel[..., -1] = sel[..., 0]  # a repeat in every row
    gold = _user_reference(q, k, v, sel, block_size, causal)
    dev = [t.to(device) for t in (q, k, v, sel)]
    with overrides(topk_attention_route=route):
        out, idx = sparse_attn.topk_attention(
            dev[0], dev[1], dev[2], indices=dev[3], block_size=block_size, causal=causal, return_indices=True
        )
    assert torch.equal(idx.cpu(), sel)
    torch.testing.assert_close(out.cpu().double(), gold, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("route", ["gather", "masked_block"])
def test_user_selection_gradients(device, route):
    b, h, lq, lk, d = 1, 2, 12, 40, 32
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(b, h, n, d, generator=gen) for n in (lq, lk, lk))
    sel = torch.randint(-1, lk, (b, 1, lq, 6), generator=gen).to(torch.int32)
    ours = [t.to(device).requires_grad_() for t in (q, k, v)]
    gold = [t.double().requires_grad_() for t in (q, k, v)]
    with overrides(topk_attention_route=route):
        out = sparse_attn.topk_attention(*ours, indices=sel.to(device), causal=True)
    ref = _user_reference(*gold, sel, None, True)
    dout = torch.randn(ref.shape, generator=gen)
    got = torch.autograd.grad(out, ours, dout.to(device))
    want = torch.autograd.grad(ref, gold, dout.double())
    for a, w in zip(got, want, strict=True):
        torch.testing.assert_close(a.cpu().double(), w, atol=1e-4, rtol=1e-4)


def test_user_selection_canonical_form(device):
    """A selection in topk_attention's own form (each row ascending, then only -1s) is taken as
    given; any other order, a repeat, a -1 before an entry or another negative gives the reference
    sort's form; the attention is the same either way."""
    gen = torch.Generator().manual_seed(5)
    rows = []
    for n in (0, 1, 5, 9):
        vals = torch.randperm(40, generator=gen)[:n].sort().values
        rows.append(torch.cat([vals, torch.full((9 - n,), -1)]))
    canon = torch.stack(rows).to(torch.int32).view(1, 1, 4, 9).to(device)
    q = torch.randn(1, 2, 4, 16, generator=gen).to(device)
    k, v = (torch.randn(1, 2, 40, 16, generator=gen).to(device) for _ in range(2))
    assert torch.equal(_routes.drop_repeats(canon), canon)
    assert torch.equal(_routes.user_selection(q, k, canon, None, None), canon)
    swapped = canon.clone()
    swapped[0, 0, 2, :2] = canon[0, 0, 2, :2].flip(0)
    repeat = canon.clone()
    repeat[0, 0, 3, 1] = repeat[0, 0, 3, 0]
    hole = canon.clone()
    hole[0, 0, 2, 1] = -1
    other = canon.clone()
    other[0, 0, 1, 3] = -2
    late = canon.clone()  # the first row fine, a later one not
    late[0, 0, 3, 4] = late[0, 0, 3, 5]
    for bad in (swapped, repeat, hole, other, late):
        got = _routes.user_selection(q, k, bad, None, None)
        assert not torch.equal(got, bad)
        assert torch.equal(got, _routes.drop_repeats(bad))
    shuffled = canon[..., torch.randperm(9, generator=gen).to(device)].contiguous()
    want = sparse_attn.topk_attention(q, k, v, indices=shuffled)
    torch.testing.assert_close(sparse_attn.topk_attention(q, k, v, indices=canon), want, atol=0, rtol=0)


def test_canonical_selection_rows(device):
    # The op (CPU, or CUDA's kernel) against the reference sort on rows of several lengths and kinds.
    gen = torch.Generator().manual_seed(11)
    for k in (1, 3, 64, 300):
        rows = torch.randint(-3, 2 * k + 3, (12, k), generator=gen, dtype=torch.int32)
        rows[0] = torch.arange(k, dtype=torch.int32)
        rows[1] = -1
        rows[2] = -5
        rows[3] = rows[3].sort().values
        got = torch.ops.sparse_attn._canonical_selection(rows.view(3, 4, 1, k).to(device))
        assert torch.equal(got.view(12, k).cpu(), _routes.drop_repeats(rows))
    with pytest.raises(RuntimeError, match="int32"):
        torch.ops.sparse_attn._canonical_selection(rows.long().to(device))


@pytest.mark.cuda
@pytest.mark.parametrize("k", [1, 7, 512, 513, 2048, 2049, 4096])
@pytest.mark.parametrize("wide", [False, True], ids=["bitmap", "sort"])
def test_cuda_canonical_selection_matches_the_sort(k, wide):
    # The CUDA kernel against the reference sort (drop_repeats) on rows already
    # in the form (kept as they are), rows out of order, with repeats, -1s between entries, other
    # negatives, only -1s, only negatives and one key; entries below 2^17 (the kernel's bitmap)
    # or up to 2^31 - 2 (its radix sort); then the user call's attention with either selection.
    gen = torch.Generator().manual_seed(k)
    n, top = 40, torch.iinfo(torch.int32).max
    hi = top - 1 if wide else 3 * k + 5
    rows = torch.randint(0, hi, (n, k), generator=gen, dtype=torch.int32)
    rows[0] = torch.arange(k, dtype=torch.int32)  # in the form
    rows[1, : k // 2] = torch.randperm(3 * k, generator=gen)[: k // 2].sort().values.to(torch.int32)
    rows[1, k // 2 :] = -1
    rows[2] = -1
    rows[3] = 5
    rows[4, ::3] = -1
    rows[5, 1::2] = -7
    rows[6] = rows[6].sort().values  # ascending with repeats
    rows[7] = torch.randperm(k, generator=gen).to(torch.int32)
    rows[8] = -7  # only negatives, not in the form
    rows[9, -1] = hi  # the largest entry last
    rows[10, : k // 2] = rows[10, k // 2 : 2 * (k // 2)]  # every entry twice
    sel = rows.view(2, 1, n // 2, k).cuda()
    got = torch.ops.sparse_attn._canonical_selection(sel)
    assert torch.equal(got.view(n, k).cpu(), _routes.drop_repeats(rows))
    assert torch.equal(got.view(n, k)[:3].cpu(), rows[:3])  # rows in the form kept as they are
    assert torch.equal(torch.ops.sparse_attn._canonical_selection(got), got)
    result = torch.library.opcheck(torch.ops.sparse_attn._canonical_selection.default, (sel,))
    assert set(result.values()) == {"SUCCESS"}, result
    if wide:
        return
    q = torch.randn(2, 2, n // 2, 32, device="cuda")
    kk, v = (torch.randn(2, 1, 3 * k + 5, 32, device="cuda") for _ in range(2))
    want = sparse_attn.topk_attention(q, kk, v, indices=got)
    torch.testing.assert_close(sparse_attn.topk_attention(q, kk, v, indices=sel), want, atol=0, rtol=0)
    if k == 4096:  # longer rows: the op refuses them, the call takes the reference sort
        wide_rows = torch.randint(-2, 50, (1, 1, 3, k + 1), generator=gen, dtype=torch.int32).cuda()
        with pytest.raises(RuntimeError, match="at most 4096"):
            torch.ops.sparse_attn._canonical_selection(wide_rows)
        q1 = torch.randn(1, 2, 3, 32, device="cuda")
        got1 = _routes.user_selection(q1, kk[:1], wide_rows, None, None)
        assert torch.equal(got1, _routes.drop_repeats(wide_rows))


def test_user_selection_bad_input():
    q = k = v = torch.randn(1, 4, 16, 32)
    with pytest.raises(ValueError, match="int32"):
        sparse_attn.topk_attention(q, k, v, indices=torch.zeros(1, 1, 16, 3, dtype=torch.int64))
    with pytest.raises(ValueError, match="G in"):
        sparse_attn.topk_attention(q, k, v, indices=torch.zeros(1, 3, 16, 3, dtype=torch.int32))
    with pytest.raises(ValueError, match="must equal the selection's last dimension"):
        sparse_attn.topk_attention(q, k, v, 4, indices=torch.zeros(1, 1, 16, 3, dtype=torch.int32))
    with pytest.raises(ValueError, match="block_size"):
        sparse_attn.topk_attention(q, k, v, indices=torch.zeros(1, 1, 16, 3, dtype=torch.int32), block_size=32)
    with pytest.raises(TypeError, match="k must be an int"):
        sparse_attn.topk_attention(q, k, v)
    with pytest.raises(ValueError, match="sinks=4 cannot be combined with indices"):
        sparse_attn.topk_attention(q, k, v, indices=torch.zeros(1, 1, 16, 3, dtype=torch.int32), sinks=4)
    with pytest.raises(TypeError, match="block_size must be an int"):
        sparse_attn.topk_attention(q, k, v, indices=torch.zeros(1, 1, 16, 3, dtype=torch.int32), block_size=64.0)


@pytest.mark.parametrize("route", ["gather", "masked_block"])
def test_user_selection_entries_past_the_keys_count_as_padding(route, device):
    # Key blocks past the keys (even where entry * block_size passes 2**31) and keys past Lk are
    # dropped like -1, on both routes.
    q, k, v = make_qkv(1, 4, 2, 8, 4096, 32, dtype=torch.float32, device=device, seed=5)
    blocks = torch.full((1, 1, 8, 4), -1, dtype=torch.int32)
    blocks[..., 0] = 5
    padded = blocks.clone()
    blocks[..., 1] = 2**26  # 2**26 * 64 wraps to 0 in int32
    blocks[..., 2] = 2**26 + 7
    blocks[..., 3] = 64  # the first block past 4096 keys
    tokens = torch.full((1, 1, 8, 3), -1, dtype=torch.int32)
    tokens[..., 0] = 100
    tokens_padded = tokens.clone()
    tokens[..., 1] = 4096
    tokens[..., 2] = 2**31 - 1
    with overrides(topk_attention_route=route):
        for sel, ref, bs in ((blocks, padded, 64), (tokens, tokens_padded, None)):
            got = sparse_attn.topk_attention(q, k, v, indices=sel.to(device), block_size=bs)
            want = sparse_attn.topk_attention(q, k, v, indices=ref.to(device), block_size=bs)
            torch.testing.assert_close(got, want, atol=0, rtol=0)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_token_topk_with_sinks(causal, device):
    # The first keys always selected (counting towards k), the rest the best of the other keys.
    q, k, v = make_qkv(2, 2, 1, 40, 100, 32, dtype=torch.float32, device=device, seed=21)
    out, idx = sparse_attn.topk_attention(q, k, v, 10, causal=causal, sinks=3, return_indices=True)
    assert idx.shape == (2, 2, 40, 10)
    q, k, v = q.cpu(), k.cpu(), v.cpu()
    i, j = torch.arange(40)[:, None] + 60, torch.arange(100)[None, :]
    visible = (j <= i) if causal else torch.ones(40, 100, dtype=torch.bool)
    scores = (q.double() @ k.double().transpose(-1, -2)).masked_fill(~visible, float("-inf"))
    rest = scores.clone()
    rest[..., :3] = float("-inf")
    top = rest.topk(7, -1)
    chosen = torch.zeros_like(scores, dtype=torch.bool)
    chosen.scatter_(-1, top.indices, top.values > float("-inf"))
    chosen[..., :3] |= visible[:, :3]
    gold, _ = reference.attention(q, k, v, mask=chosen)
    torch.testing.assert_close(out.cpu().double(), gold, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="sinks must be a non-negative int"):
        sparse_attn.topk_attention(q, k, v, 10, sinks=-1)
    with pytest.raises(NotImplementedError, match="block mode"):
        sparse_attn.topk_attention(q, k, v, 2, block_size=64, sinks=1)
