"""The references are right first: sparse_attn.reference against PyTorch's SDPA (MATH backend).

Everything else in the suite is measured against ``reference.attention``, so it is checked here
against ``torch.nn.functional.scaled_dot_product_attention`` in float64 (where both must agree to
rounding), including the masking conventions of the contract (docs/ARCHITECTURE.md): bool masks, bottom-right causal
alignment, GQA, and fully masked rows (0 and LSE -inf).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import causal_lower_right
from utils import make_qkv

from sparse_attn import patterns, reference

# SDPA warns that its lower-right causal bias gives NaN rows when Lq > Lk; ours gives 0 there.
pytestmark = pytest.mark.filterwarnings("ignore:Lower right causal bias will produce NaNs")

F64 = {"dtype": torch.float64}
TIGHT = {"atol": 1e-12, "rtol": 1e-10}


def _sdpa(q, k, v, **kwargs):
    with sdpa_kernel(SDPBackend.MATH):
        return F.scaled_dot_product_attention(q, k, v, **kwargs)


def _qkv64(b, h, hkv, lq, lk, d, dv=None, seed=0):
    return make_qkv(b, h, hkv, lq, lk, d, dv, dtype=torch.float64, seed=seed)


def _random_mask(shape, seed, p=0.6):
    """Bool mask with at least one True per row (SDPA's convention for those rows is not ours)."""
    g = torch.Generator().manual_seed(seed)
    m = torch.rand(shape, generator=g) < p
    m[..., 0] = True
    return m


SHAPES = [(1, 1), (1, 17), (17, 1), (33, 33), (65, 31), (31, 65)]


@pytest.mark.parametrize("lq,lk", SHAPES)
@pytest.mark.parametrize("scale", [None, 0.3])
def test_attention_matches_sdpa(lq, lk, scale):
    q, k, v = _qkv64(2, 3, 3, lq, lk, 16, seed=lq * 100 + lk)
    out, lse = reference.attention(q, k, v, scale=scale)
    torch.testing.assert_close(out, _sdpa(q, k, v, scale=scale), **TIGHT)
    s = (q @ k.transpose(-1, -2)) * (q.shape[-1] ** -0.5 if scale is None else scale)
    torch.testing.assert_close(lse, torch.logsumexp(s, -1), **TIGHT)
    assert out.dtype == torch.float64 and lse.shape == (2, 3, lq)


@pytest.mark.parametrize("mask_shape", ["lq_lk", "b1lk", "bhlqlk"])
@pytest.mark.parametrize("lq,lk", [(17, 17), (9, 40), (40, 9)])
def test_bool_mask_matches_sdpa(mask_shape, lq, lk):
    b, h = 2, 3
    q, k, v = _qkv64(b, h, h, lq, lk, 16, seed=7)
    shape = {"lq_lk": (lq, lk), "b1lk": (b, 1, 1, lk), "bhlqlk": (b, h, lq, lk)}[mask_shape]
    mask = _random_mask(shape, seed=lq + lk)
    out, lse = reference.attention(q, k, v, mask=mask)
    torch.testing.assert_close(out, _sdpa(q, k, v, attn_mask=mask), **TIGHT)
    s = (q @ k.transpose(-1, -2)) / math.sqrt(16)
    torch.testing.assert_close(lse, torch.logsumexp(s.masked_fill(~mask, float("-inf")), -1), **TIGHT)


@pytest.mark.parametrize("l", [1, 16, 37])
def test_causal_square_matches_sdpa_is_causal(l):
    q, k, v = _qkv64(1, 2, 2, l, l, 32, seed=l)
    out, _ = reference.attention(q, k, v, causal=True)
    torch.testing.assert_close(out, _sdpa(q, k, v, is_causal=True), **TIGHT)


@pytest.mark.parametrize("lq,lk", [(5, 12), (1, 9), (12, 5), (9, 1), (13, 13)])
def test_causal_mask_is_bottom_right(lq, lk):
    expected = causal_lower_right(lq, lk)._materialize()
    got = reference.causal_mask(lq, lk)
    assert got.dtype == torch.bool and got.shape == (lq, lk)
    assert torch.equal(got, expected)
    i = torch.arange(lq)[:, None]
    j = torch.arange(lk)[None, :]
    assert torch.equal(got, j <= i + (lk - lq))


@pytest.mark.parametrize("lq,lk", [(5, 12), (1, 9), (12, 5), (9, 1)])
def test_causal_rectangular_matches_sdpa_lower_right(lq, lk):
    q, k, v = _qkv64(2, 2, 2, lq, lk, 16, seed=lq * lk)
    out, lse = reference.attention(q, k, v, causal=True)
    sdpa = _sdpa(q, k, v, attn_mask=causal_lower_right(lq, lk))
    rows = torch.arange(lq) + (lk - lq) >= 0  # rows that see at least one key
    torch.testing.assert_close(out[:, :, rows], sdpa[:, :, rows], **TIGHT)
    # Rows with no visible key (Lq > Lk): defined as 0 and LSE -inf, whatever SDPA does.
    assert (out[:, :, ~rows] == 0).all()
    assert torch.isneginf(lse[:, :, ~rows]).all()
    assert torch.isfinite(lse[:, :, rows]).all()


@pytest.mark.parametrize("h,hkv", [(4, 2), (6, 1), (4, 4)])
@pytest.mark.parametrize("causal", [False, True])
def test_gqa_matches_sdpa_enable_gqa(h, hkv, causal):
    q, k, v = _qkv64(2, h, hkv, 19, 19, 16, seed=h * 10 + hkv)
    out, _ = reference.attention(q, k, v, causal=causal)
    torch.testing.assert_close(out, _sdpa(q, k, v, is_causal=causal, enable_gqa=True), **TIGHT)
    # Query head j reads key head j // (H // Hkv): check one head by hand.
    j = h - 1
    one, _ = reference.attention(
        q[:, j : j + 1], k[:, j // (h // hkv)].unsqueeze(1), v[:, j // (h // hkv)].unsqueeze(1), causal=causal
    )
    torch.testing.assert_close(out[:, j : j + 1], one, **TIGHT)


def test_value_head_dim_may_differ():
    q, k, v = _qkv64(1, 2, 2, 8, 11, 16, dv=24)
    out, _ = reference.attention(q, k, v)
    assert out.shape == (1, 2, 8, 24)
    torch.testing.assert_close(out, _sdpa(q, k, v), **TIGHT)


def test_fully_masked_rows_are_zero_with_lse_neg_inf():
    q, k, v = _qkv64(2, 2, 2, 6, 9, 16, seed=3)
    mask = _random_mask((2, 2, 6, 9), seed=4)
    mask[0, 1, 2] = False
    mask[1, 0, 5] = False
    out, lse = reference.attention(q, k, v, mask=mask)
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    assert (out[0, 1, 2] == 0).all() and (out[1, 0, 5] == 0).all()
    assert torch.isneginf(lse[0, 1, 2]) and torch.isneginf(lse[1, 0, 5])
    assert torch.isfinite(lse).sum() == lse.numel() - 2
    keep = mask.any(-1)
    torch.testing.assert_close(out[keep], _sdpa(q, k, v, attn_mask=mask)[keep], **TIGHT)
    # An all-False mask: every row is empty.
    out, lse = reference.attention(q, k, v, mask=torch.zeros(6, 9, dtype=torch.bool))
    assert (out == 0).all() and torch.isneginf(lse).all()


def test_lse_analytic():
    # q = 0 makes every visible score 0, so LSE = log(number of visible keys) and out = mean(v).
    lq, lk = 7, 10
    _, k, v = _qkv64(1, 1, 1, lq, lk, 16, seed=5)
    q = torch.zeros(1, 1, lq, 16, **F64)
    out, lse = reference.attention(q, k, v, causal=True)
    visible = torch.arange(lq) + (lk - lq) + 1
    torch.testing.assert_close(lse[0, 0], visible.double().log(), **TIGHT)
    means = torch.stack([v[0, 0, :n].mean(0) for n in visible.tolist()])
    torch.testing.assert_close(out[0, 0], means, **TIGHT)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_reference_is_a_sane_peer(dtype):
    # check_close measures the op against the reference run in `dtype`; that peer must be a
    # real low-precision computation: close to SDPA MATH in `dtype`, and not exact.
    q, k, v = make_qkv(2, 4, 4, 129, 127, 64, dtype=dtype, seed=11)
    gold, _ = reference.attention(q, k, v)
    lp, lp_lse = reference.attention(q, k, v, dtype=dtype)
    assert lp.dtype == dtype and lp_lse.dtype == dtype
    sdpa = _sdpa(q, k, v)
    eps = torch.finfo(dtype).eps
    bound = 8 * eps * v.abs().max().item()
    assert (lp.double() - sdpa.double()).abs().max().item() <= bound
    assert 0 < (lp.double() - gold).abs().max().item() <= bound


def test_block_sparse_reference_expands_the_mask():
    lq = lk = 200
    q, k, v = _qkv64(1, 2, 2, lq, lk, 16, seed=9)
    mask = patterns.causal(lq, lk, block_size=64)
    out, lse = reference.block_sparse_attention(q, k, v, mask)
    gold, gold_lse = reference.attention(q, k, v, causal=True)
    torch.testing.assert_close(out, gold, **TIGHT)
    torch.testing.assert_close(lse, gold_lse, **TIGHT)


def test_gather_reference_over_all_keys_is_dense():
    q, k, v = _qkv64(1, 4, 2, 6, 9, 16, seed=12)
    every = torch.arange(9, dtype=torch.int32).expand(1, 1, 6, 9)
    out, _ = reference.gather_attention(q, k, v, every)
    torch.testing.assert_close(out, reference.attention(q, k, v)[0], **TIGHT)
    # -1 entries select nothing; a row of -1 is empty.
    idx = torch.full((1, 1, 6, 3), -1, dtype=torch.int32)
    idx[0, 0, 1:, 0] = 2
    out, lse = reference.gather_attention(q, k, v, idx)
    assert (out[:, :, 0] == 0).all() and torch.isneginf(lse[:, :, 0]).all()
    torch.testing.assert_close(out[0, 0, 1:], v[0, 0, 2].expand(5, 16), **TIGHT)


def test_topk_indices_ties_go_to_the_lower_index():
    scores = torch.tensor([[1.0, 3.0, 3.0, 2.0, 3.0]])
    assert reference.topk_indices(scores, 2).tolist() == [[1, 2]]
    assert reference.topk_indices(scores, 4).tolist() == [[1, 2, 3, 4]]
    # Causal with Lq=3 > Lk=2: row 0 sees no key, row 1 one key; missing picks are -1.
    causal = reference.topk_indices(torch.zeros(3, 2), 2, causal=True)
    assert causal.tolist() == [[-1, -1], [0, -1], [0, 1]]
