"""Per-sequence key lengths (``key_lengths=``) on flash_attention and block_sparse_attention: key j
of batch element b hidden iff j >= key_lengths[b], on top of causal, windows and masks (whose
alignment stays that of the tensors), against the fp64 reference under the same element mask;
rows left with no key give 0 and LSE -inf; gradients; bad lengths."""

from __future__ import annotations

import pytest
import torch
from utils import check_attention, make_qkv

import sparse_attn
from sparse_attn import patterns, reference

LENS = [300, 129, 0, 64]


def _band(lq, lk, causal=False, window=None):
    i = torch.arange(lq)[:, None] + (lk - lq)
    j = torch.arange(lk)[None, :]
    m = torch.ones(lq, lk, dtype=torch.bool)
    if causal:
        m &= j <= i
    if window is not None:
        left, right = window
        if left is not None:
            m &= j >= i - left
        if right is not None:
            m &= j <= i + right
    return m


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
    mask = _with_lengths(_band(lq, 300, kw.get("causal", False), kw.get("window"))[None, None], LENS, 300)
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
        full = _with_lengths(dense.to_dense().cpu() & _band(300, 300, causal=True), LENS, 300)
        check_attention(out.cpu(), lse.cpu(), q.cpu(), k.cpu(), v.cpu(), mask=full)


def test_key_lengths_gradients(device):
    q, k, v = make_qkv(2, 2, 1, 150, 150, 32, dtype=torch.float32, device=device, seed=5)
    q, k, v = (t.requires_grad_(True) for t in (q, k, v))
    lens = torch.tensor([150, 70])
    out = sparse_attn.flash_attention(q, k, v, causal=True, key_lengths=lens.to(device))
    grads = torch.autograd.grad(out.sum(), (q, k, v))
    mask = _with_lengths(_band(150, 150, causal=True)[None, None], [150, 70], 150)
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
