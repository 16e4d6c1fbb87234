"""Filtered top-k selection on CUDA (plan_select's filter_stride): each row keeps only the keys
at or above a threshold taken from a sample of its scores, selects among them, and hands the rows
whose candidates cannot decide to the unfiltered select. On integer-valued inputs the scores are
exact, so the selection must equal the fp64 reference bit for bit, ties (many here) included."""

from __future__ import annotations

import pytest
import torch
from test_topk import head_scores, small_ints

import sparse_attn
from sparse_attn import reference
from sparse_attn._plan import overrides

pytestmark = pytest.mark.cuda


def _select(inputs, k, causal, **opts):
    with overrides(**opts):
        if len(inputs) == 3:
            return torch.ops.sparse_attn.indexer_select(*inputs, k, causal)
        return torch.ops.sparse_attn.topk_select(*inputs, k, causal)


def _scores(inputs):
    if len(inputs) == 3:
        return reference.indexer_scores(*(t.cpu() for t in inputs)).unsqueeze(1)
    return head_scores(*inputs).cpu()


def _plan(inputs, k, causal, **opts):
    q = inputs[0]
    with overrides(**opts):
        if len(inputs) == 3:
            text = torch.ops.sparse_attn._plan_indexer_select(*inputs, k, causal)
        else:
            text = torch.ops.sparse_attn._plan_select(q, inputs[1], k, causal)
    return dict(line.split("=", 1) for line in text.splitlines())


def _indexer(b, lq, lk, heads, seed):
    return (
        small_ints((b, lq, heads, 64), seed, torch.bfloat16, "cuda"),
        small_ints((b, lk, 64), seed + 1, torch.bfloat16, "cuda"),
        small_ints((b, lq, heads), seed + 2, torch.bfloat16, "cuda", lo=0, hi=3),
    )


def _exact(b, h, hkv, lq, lk, seed, d=64):
    return (
        small_ints((b, h, lq, d), seed, torch.float16, "cuda"),
        small_ints((b, hkv, lk, d), seed + 1, torch.float16, "cuda"),
    )


def _check(idx, inputs, k, causal):
    want = reference.topk_indices(_scores(inputs), k, causal=causal)
    bad = (idx.cpu() != want).nonzero()
    assert bad.numel() == 0, f"{len(bad)} entries differ, first at {bad[:4].tolist()}"


@pytest.mark.parametrize("stride", [1, 2, 4])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize(
    "case",
    [
        ("indexer", 2, 1, 1, 300, 3000, 33, 64),
        ("indexer", 1, 1, 1, 2100, 2100, 200, 64),
        ("exact", 2, 2, 1, 130, 4000, 64, 64),
        ("exact", 1, 3, 3, 64, 2500, 300, 64),
        ("exact", 1, 2, 1, 100, 3000, 64, 128),
    ],
    ids=[
        "indexer_lq300_lk3000_k33",
        "indexer_square2100_k200",
        "exact_gqa_lk4000_k64",
        "exact_mha_lk2500_k300",
        "exact_d128_lk3000_k64",
    ],
)
def test_filtered_selection_equals_the_reference(case, causal, stride):
    """Dimension 64 scores on the wgmma scorer on sm_90a, 128 on the mma.sync one."""
    mode, b, h, hkv, lq, lk, k, d = case
    if mode == "indexer":
        inputs = _indexer(b, lq, lk, 3, seed=lk + k)
    else:
        inputs = _exact(b, h, hkv, lq, lk, seed=lk + k, d=d)
    plan = _plan(inputs, k, causal, select_filter_stride=stride)
    target = max(3 * min(k, lk) // 2, min(2048, lk // 8))
    assert int(plan["filter_stride"]) == stride and int(plan["candidates"]) == (5 * target + 2) // 3 + 1024
    _check(_select(inputs, k, causal, select_filter_stride=stride), inputs, k, causal)


@pytest.mark.parametrize("causal", [False, True])
def test_every_row_tied_goes_to_the_fallback(causal):
    """All scores 0: every key reaches the threshold, no row's candidates fit; the fallback takes
    the k lowest keys of every row (over chunks, fewer fallback CTAs than rows)."""
    iq, ik, iw = _indexer(2, 200, 3000, 2, seed=7)
    inputs = (iq, ik, torch.zeros_like(iw))
    idx = _select(inputs, 40, causal, select_filter_stride=2, select_workspace_bytes=3 << 20)
    plan = _plan(inputs, 40, causal, select_filter_stride=2, select_workspace_bytes=3 << 20)
    assert int(plan["chunks"]) > 1
    _check(idx, inputs, 40, causal)


def test_a_misleading_sample_goes_to_the_fallback():
    """Only the sampled tiles (every second tile, starting at the second) score above 0, each key
    differently: the threshold lets about 1.5 k x (sampled / visible) = 225 keys through, fewer
    than k = 300, and the fallback must still find the exact top-k."""
    b, lq, lk, k = 1, 256, 4096, 300
    iq = torch.ones(b, lq, 1, 64, dtype=torch.bfloat16, device="cuda")
    ik = torch.zeros(b, lk, 64, dtype=torch.bfloat16, device="cuda")
    j = torch.arange(lk, device="cuda")
    odd = (j // 64) % 2 == 1
    ik[:, odd, 0] = (128 * (j[odd] // 64 + 1)).to(torch.bfloat16)
    ik[:, odd, 1] = (j[odd] % 64).to(torch.bfloat16)
    iw = torch.ones(b, lq, 1, dtype=torch.bfloat16, device="cuda")
    inputs = (iq, ik, iw)
    _check(_select(inputs, k, False, select_filter_stride=2), inputs, k, False)


def test_kth_key_far_above_the_threshold():
    """The k-th largest score far above the row's threshold (k + 16 keys score ~2^20, the rest
    0-60, so the sample puts the threshold near 50): the candidates hold hundreds of low keys
    under the ones selected."""
    b, lq, lk, k = 1, 64, 4096, 64
    g = torch.Generator().manual_seed(3)
    q = torch.zeros(b, 1, lq, 64, dtype=torch.float16)
    q[..., 0] = 1.0
    q[..., 1] = 1024.0
    key = torch.zeros(b, 1, lk, 64, dtype=torch.float16)
    key[0, 0, :, 0] = torch.randint(0, 61, (lk,), generator=g).to(torch.float16)
    big = torch.randperm(lk, generator=g)[: k + 16]
    key[0, 0, big, 0] = 2048.0 + torch.arange(k + 16, dtype=torch.float16) * 8
    key[0, 0, big, 1] = 1024.0
    inputs = (q.cuda(), key.cuda())
    for stride in (1, 4):
        _check(_select(inputs, k, False, select_filter_stride=stride), inputs, k, False)


def test_nan_scores_filtered_like_unfiltered():
    """NaN scores (exact mode: a NaN key) rank above every number: they always pass the threshold."""
    q, k = _exact(1, 2, 1, 128, 3000, seed=11)
    k[:, :, 100] = float("nan")
    k[:, :, 2500] = float("nan")
    filtered = _select((q, k), 50, True, select_filter_stride=4)
    unfiltered = _select((q, k), 50, True, select_filter_stride=-1)
    assert torch.equal(filtered, unfiltered)
    last = filtered[0, :, -1]
    assert bool((last == 100).any(-1).all()) and bool((last == 2500).any(-1).all())


def test_topk_attention_with_the_filter_default():
    """The plan's own choice at a length where it filters (Lk >= 4 x the candidates' room):
    topk_attention's indices equal the unfiltered selection's."""
    b, h, lq, lk, d, k = 1, 2, 256, 20480, 64, 512
    iq, ik, iw = _indexer(b, lq, lk, 4, seed=21)
    q = torch.randn(b, h, lq, d, dtype=torch.bfloat16, device="cuda")
    kv = torch.randn(b, 1, lk, d, dtype=torch.bfloat16, device="cuda")
    args = dict(index_query=iq, index_key=ik, index_weights=iw, return_indices=True)
    assert int(_plan((iq, ik, iw), k, False)["filter_stride"]) == 8  # 2048 candidates, 192 of them sampled
    _, idx = sparse_attn.topk_attention(q, kv, kv, k, **args)
    with overrides(select_filter_stride=-1):
        _, want = sparse_attn.topk_attention(q, kv, kv, k, **args)
    assert torch.equal(idx, want)
    _check(idx, (iq, ik, iw), k, False)
