"""Per-sequence key lengths (``key_lengths=``) on flash_attention and block_sparse_attention: key j
of batch element b hidden iff j >= key_lengths[b], on top of causal, windows and masks (whose
alignment stays that of the tensors), against the fp64 reference under the same element mask;
rows left with no key give 0 and LSE -inf; gradients; bad lengths."""

from __future__ import annotations

import pytest
import torch
from utils import band_mask, check_attention, make_qkv

import sparse_attn
from sparse_attn import patterns, reference

LENS = [300, 129, 0, 64]


def _with_lengths(mask, lens, lk):
    return mask & (torch.arange(lk)[None, None, None, :] < torch.tensor(lens)[:, None, None, None])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(
    "kw",
    [{}, {"causal": True}, {"window": (40, 10)}, {"window": (40, None), "causal": True}],
    ids=["full", "causal", "window", "window-causal"],
)
@pytest.mark.parametrize("lq", [300, 37])
def test_flash_with_key_lengths(kw, lq, dtype, device):
    q, k, v = make_qkv(4, 4, 2, lq, 300, 64, dtype=dtype, device=device, seed=lq)
    lens = torch.tensor(LENS)
    out, lse = sparse_attn.flash_attention(q, k, v, key_lengths=lens.to(device), return_lse=True, **kw)
    mask = _with_lengths(band_mask(lq, 300, kw.get("causal", False), kw.get("window"))[None, None], LENS, 300)
    check_attention(out.cpu(), lse.cpu(), q.cpu(), k.cpu(), v.cpu(), mask=mask)
    assert (out[2] == 0).all() and torch.isneginf(lse[2]).all()  # no key at all


def test_block_sparse_and_patterns_with_key_lengths(device):
    q, k, v = make_qkv(4, 2, 2, 300, 300, 64, dtype=torch.bfloat16, device=device, seed=3)
    lens = torch.tensor(LENS)
    for mask in (patterns.longformer(300, 40, [0, 200]), patterns.sliding_window(64)):
        out, lse = sparse_attn.block_sparse_attention(
            q,
            k,
            v,
            mask if isinstance(mask, patterns.Pattern) else mask.to(device),
            causal=True,
            key_lengths=lens.to(device),
            return_lse=True,
        )
        dense = mask.resolve(300, 300) if isinstance(mask, patterns.Pattern) else mask
        full = _with_lengths(dense.to_dense().cpu() & band_mask(300, 300, causal=True), LENS, 300)
        check_attention(out.cpu(), lse.cpu(), q.cpu(), k.cpu(), v.cpu(), mask=full)


def test_key_lengths_gradients(device):
    q, k, v = make_qkv(2, 2, 1, 150, 150, 32, dtype=torch.float32, device=device, seed=5)
    q, k, v = (t.requires_grad_(True) for t in (q, k, v))
    lens = torch.tensor([150, 70])
    out = sparse_attn.flash_attention(q, k, v, causal=True, key_lengths=lens.to(device))
    grads = torch.autograd.grad(out.sum(), (q, k, v))
    mask = _with_lengths(band_mask(150, 150, causal=True)[None, None], [150, 70], 150)
    q2, k2, v2 = (t.detach().cpu().double().requires_grad_(True) for t in (q, k, v))
    gold, _ = reference.attention(q2, k2, v2, mask=mask)
    expected = torch.autograd.grad(gold.sum(), (q2, k2, v2))
    for a, b in zip(grads, expected, strict=True):
        torch.testing.assert_close(a.cpu().double(), b, atol=2e-4, rtol=2e-4)
    assert (grads[1][1, :, 70:] == 0).all() and (grads[2][1, :, 70:] == 0).all()  # hidden keys


def test_bad_key_lengths_raise():
    q = k = v = torch.randn(2, 1, 16, 32)
    with pytest.raises(TypeError, match="key_lengths must hold integers"):
        sparse_attn.flash_attention(q, k, v, key_lengths=torch.tensor([1.0, 2.0]))
    with pytest.raises(ValueError, match="one entry per batch element"):
        sparse_attn.flash_attention(q, k, v, key_lengths=torch.tensor([3]))
    with pytest.raises(ValueError, match=r"must lie in \[0, Lk=16\]"):
        sparse_attn.flash_attention(q, k, v, key_lengths=torch.tensor([3, 17]))
    with pytest.raises(TypeError, match="1-D integer tensor"):
        sparse_attn.flash_attention(q, k, v, key_lengths=[3, 4])


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("lq", [200, 37])
def test_topk_with_key_lengths_selects_among_the_keys_left(causal, lq, device):
    # Token mode against the fp64 reference over each row's k best visible keys (ties cannot occur
    # with random fp32 scores), and the selection itself: no index at or past a length.
    q, k, v = make_qkv(4, 2, 2, lq, 200, 32, dtype=torch.float32, device=device, seed=lq)
    lens = torch.tensor([200, 77, 0, 150])
    out, lse, idx = sparse_attn.topk_attention(
        q, k, v, 24, causal=causal, key_lengths=lens, return_lse=True, return_indices=True
    )
    assert idx.shape == (4, 2, lq, 24)
    visible = _with_lengths(band_mask(lq, 200, causal)[None, None], lens.tolist(), 200)
    scores = (q.cpu().double() @ k.cpu().double().transpose(-1, -2)).masked_fill(~visible, float("-inf"))
    top = scores.topk(24, dim=-1)
    chosen = torch.zeros_like(visible.expand_as(scores))
    chosen.scatter_(-1, top.indices, top.values > float("-inf"))
    gold, gold_lse = reference.attention(q.cpu(), k.cpu(), v.cpu(), mask=chosen)
    torch.testing.assert_close(out.cpu().double(), gold, atol=1e-5, rtol=1e-5)
    got = idx.cpu()
    assert ((got < lens[:, None, None, None]) | (got == -1)).all()
    assert (out[2] == 0).all() and torch.isneginf(lse[2]).all()
    # A selection given with indices: listed keys past a length are dropped.
    out2 = sparse_attn.topk_attention(q, k, v, indices=idx.to(device), causal=causal, key_lengths=lens.to(device))
    torch.testing.assert_close(out2.cpu(), out.cpu())
    with pytest.raises(NotImplementedError, match="block mode"):
        sparse_attn.topk_attention(q, k, v, 2, block_size=64, key_lengths=lens)


def test_indexer_topk_with_key_lengths(device):
    # Non-causal: batch element b is the op on its first key_lengths[b] keys (index keys too).
    q, k, v = make_qkv(2, 2, 1, 50, 120, 32, dtype=torch.float32, device=device, seed=8)
    g = torch.Generator().manual_seed(9)
    iq, ik, iw = (torch.randn(*s, generator=g).to(device) for s in ((2, 50, 2, 16), (2, 120, 16), (2, 50, 2)))
    lens = torch.tensor([120, 41])
    out, idx = sparse_attn.topk_attention(
        q, k, v, 16, index_query=iq, index_key=ik, index_weights=iw, key_lengths=lens, return_indices=True
    )
    assert idx.shape == (2, 1, 50, 16) and (idx[1] < 41).all()
    alone = sparse_attn.topk_attention(
        q[1:], k[1:, :, :41], v[1:, :, :41], 16, index_query=iq[1:], index_key=ik[1:, :41], index_weights=iw[1:]
    )
    torch.testing.assert_close(out[1:], alone)


def test_explain_names_the_routes_of_patterns_and_key_lengths():
    q = k = v = torch.randn(2, 2, 300, 64)
    lens = torch.tensor([300, 100])
    plan = sparse_attn.explain(sparse_attn.flash_attention, q, k, v, key_lengths=lens)
    assert plan.route == "block_kernel" and "key_lengths" in plan.why
    plan = sparse_attn.explain(sparse_attn.block_sparse_attention, q[:, :, -1:], k, v, patterns.sliding_window(64))
    assert plan.route == "flash_window" and "Pattern resolved for (Lq=1, Lk=300)" in plan.why
    plan = sparse_attn.explain(
        sparse_attn.block_sparse_attention, q, k, v, patterns.longformer(window=64, global_idx=[0]), key_lengths=lens
    )
    assert plan.route == "block_kernel" and "key lengths" in plan.why
