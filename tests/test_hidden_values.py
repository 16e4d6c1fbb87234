"""A row's output depends only on the keys it can see (docs: DESIGN "a row's output depends only on
the keys it can see"): NaN or Inf in the key or value of a key that a row cannot see never reaches
that row, while a row that sees one propagates it. The poisoned keys sit inside the tiles the
kernels compute (causal diagonals, window edges, partial blocks, key lengths), where the tensor
cores would otherwise form 0 x NaN; on the GPU this covers the Hopper kernel (head dims 64 and 128,
128-blocks) and the mma.sync kernel (head dim 256, 64-blocks).

The kernels find the rows whose output came out non-finite and compute those again over the keys
they see (csrc/include/sparse_attn/cuda/hidden_values.cuh): the mma.sync kernel (head dim 256,
64-blocks, every 16-bit case before Hopper) in its epilogue, the Hopper kernel (head dims 64 and
128) after a persistent CTA's last tile. These cases exercise that path, including rows that see
nothing and many rows of a CTA's tiles (key-length padding)."""

from __future__ import annotations

import pytest
import torch
from utils import band_mask, make_qkv

import sparse_attn
from sparse_attn import BlockSparseMask

POISONS = {"nan": float("nan"), "inf": float("inf"), "-inf": float("-inf")}


def _poison_keys(visible: torch.Tensor, seed: int, n: int = 3) -> torch.Tensor:
    """n keys, each seen by some rows of every (batch, head) but by at most half of them."""
    share = visible.flatten(0, -2).float().mean(0)  # (Lk,): the share of all rows that see the key
    seen_by_all = visible.flatten(0, 1).any(1).all(0)
    candidates = ((share <= 0.5) & seen_by_all).nonzero().flatten()
    g = torch.Generator().manual_seed(seed)
    return candidates[torch.randperm(candidates.numel(), generator=g)[:n]].sort().values


def _check(run, q, k, v, visible, keys, value, *, tensor="value"):
    """run(q, k, v) -> (out, lse). visible: (B|1, H|1, Lq, Lk) bool. Poisons `keys` of `tensor`
    with `value`; rows that see none of them must equal the clean run, rows that see one must not
    be finite (NaN everywhere for a NaN value)."""
    clean, clean_lse = run(q, k, v)
    k2, v2 = k.clone(), v.clone()
    target = v2 if tensor == "value" else k2
    target[:, :, keys.to(target.device)] = value
    out, lse = run(q, k2, v2)
    b, h, lq, _ = out.shape
    sees = visible[..., keys].any(-1).expand(b, h, lq).to(out.device)
    safe = ~sees
    assert sees.any() and safe.any(), "the case must have rows of both kinds"
    o, c = out.float(), clean.float()
    assert torch.isfinite(o[safe]).all(), f"a hidden {tensor} {value} reached a row that cannot see it"
    tol = 1e-5 if q.dtype == torch.float32 else 4 * torch.finfo(q.dtype).eps  # a few ulps: other sum orders
    torch.testing.assert_close(o[safe], c[safe], atol=tol, rtol=tol)
    torch.testing.assert_close(lse[safe], clean_lse[safe], atol=1e-4, rtol=1e-4)
    if tensor == "value":
        if value != value:  # NaN
            assert torch.isnan(o[sees]).all(), "a visible NaN value did not propagate to every column"
        else:
            assert (~torch.isfinite(o[sees])).all(-1).all(), "a visible Inf value did not propagate"
    else:
        assert (~torch.isfinite(o[sees])).any(-1).all(), "a visible non-finite key did not propagate"


FLASH_CASES = [
    ("causal", 300, 300, {"causal": True}),
    ("causal_lq_lt_lk", 100, 300, {"causal": True}),
    ("window", 300, 300, {"window": (40, 10)}),
    ("window_causal", 260, 260, {"window": (70, None), "causal": True}),
]


@pytest.mark.parametrize("poison", list(POISONS), ids=list(POISONS))
@pytest.mark.parametrize("case", FLASH_CASES, ids=[c[0] for c in FLASH_CASES])
@pytest.mark.parametrize("d", [64, 128, 256])
def test_flash_hidden_values_stay_hidden(case, d, poison, device):
    _, lq, lk, kw = case
    q, k, v = make_qkv(2, 4, 2, lq, lk, d, dtype=torch.bfloat16, device=device, seed=d + lq)
    visible = band_mask(lq, lk, kw.get("causal", False), kw.get("window"))[None, None]
    keys = _poison_keys(visible, seed=lk + d)

    def run(q_, k_, v_):
        return sparse_attn.flash_attention(q_, k_, v_, return_lse=True, **kw)

    _check(run, q, k, v, visible, keys, POISONS[poison])


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=["fp16", "fp32"])
def test_flash_hidden_values_other_dtypes(dtype, device):
    q, k, v = make_qkv(1, 2, 1, 200, 200, 64, dtype=dtype, device=device, seed=5)
    visible = band_mask(200, 200, True)[None, None]
    _check(
        lambda a, b, c: sparse_attn.flash_attention(a, b, c, causal=True, return_lse=True),
        q,
        k,
        v,
        visible,
        _poison_keys(visible, seed=5),
        float("nan"),
    )


@pytest.mark.parametrize("d", [64, 128])
def test_flash_hidden_keys_stay_hidden(d, device):
    q, k, v = make_qkv(1, 4, 4, 300, 300, d, dtype=torch.bfloat16, device=device, seed=9)
    visible = band_mask(300, 300, False, (30, 30))[None, None]
    _check(
        lambda a, b, c: sparse_attn.flash_attention(a, b, c, window=(30, 30), return_lse=True),
        q,
        k,
        v,
        visible,
        _poison_keys(visible, seed=9),
        float("nan"),
        tensor="key",
    )


def _partial_mask(b, h, lq, lk, bs, seed):
    """An element mask whose blocks are mostly partial, with one row left empty."""
    g = torch.Generator().manual_seed(seed)
    blocks = torch.rand(b, h, -(-lq // bs), -(-lk // bs), generator=g) < 0.5
    dense = blocks.repeat_interleave(bs, -2).repeat_interleave(bs, -1)[..., :lq, :lk]
    dense &= torch.rand(b, h, lq, lk, generator=g) < 0.6
    dense[:, :, 5] = False  # a row that sees nothing
    return dense


@pytest.mark.parametrize("poison", ["nan", "inf"])
@pytest.mark.parametrize("bs,d", [(128, 64), (128, 128), (64, 128), (64, 256)], ids=lambda x: str(x))
def test_block_sparse_partial_blocks_hide_their_values(bs, d, poison, device):
    b, h, lq, lk = 2, 2, 300, 330
    dense = _partial_mask(b, h, lq, lk, bs, seed=bs + d)
    mask = BlockSparseMask.from_element_mask(dense, block_size=bs).to(device)
    q, k, v = make_qkv(b, h, h, lq, lk, d, dtype=torch.bfloat16, device=device, seed=bs + d)

    def run(q_, k_, v_):
        return sparse_attn.block_sparse_attention(q_, k_, v_, mask, return_lse=True)

    _check(run, q, k, v, dense, _poison_keys(dense, seed=d), POISONS[poison])
    k2, v2 = k.clone(), v.clone()
    v2[:, :, :bs] = float("nan")  # every key the empty row's first tile holds
    out, lse = run(q, k2, v2)
    assert torch.equal(out[:, :, 5], torch.zeros_like(out[:, :, 5])) and torch.isneginf(lse[:, :, 5]).all()


@pytest.mark.parametrize("kw", [{}, {"causal": True}], ids=["full", "causal"])
@pytest.mark.parametrize("d", [64, 128, 256])
def test_garbage_past_key_lengths_stays_hidden(kw, d, device):
    """A right-padded batch whose padding holds garbage (NaN, as uninitialised memory may)."""
    lens = [300, 129, 64]
    q, k, v = make_qkv(3, 4, 4, 300, 300, d, dtype=torch.bfloat16, device=device, seed=d)
    lengths = torch.tensor(lens, device=device)
    clean, clean_lse = sparse_attn.flash_attention(q, k, v, key_lengths=lengths, return_lse=True, **kw)
    k2, v2 = k.clone(), v.clone()
    for i, n in enumerate(lens):
        k2[i, :, n:] = float("nan")
        v2[i, :, n:] = float("nan")
    out, lse = sparse_attn.flash_attention(q, k2, v2, key_lengths=lengths, return_lse=True, **kw)
    defined = torch.isfinite(clean_lse)
    assert torch.isfinite(out.float()).all()
    tol = 4 * torch.finfo(q.dtype).eps
    torch.testing.assert_close(out.float(), clean.float(), atol=tol, rtol=tol)
    assert torch.equal(torch.isfinite(lse), defined)


@pytest.mark.parametrize("d", [64, 128, 256])
def test_one_visible_nan_column_stays_in_its_column(d, device):
    """A NaN in one column of a value that rows see: those rows are NaN in that column only and
    exact in the others (the kernels compute such rows again; the other columns must not change)."""
    q, k, v = make_qkv(1, 4, 2, 260, 260, d, dtype=torch.bfloat16, device=device, seed=d + 1)
    clean = sparse_attn.flash_attention(q, k, v, causal=True)
    v2 = v.clone()
    v2[:, :, 100, 7] = float("nan")
    out = sparse_attn.flash_attention(q, k, v2, causal=True).float()
    cols = torch.arange(d, device=device) != 7
    assert torch.isnan(out[:, :, 100:, 7]).all() and torch.isfinite(out[:, :, :, cols]).all()
    assert torch.isfinite(out[:, :, :100]).all()
    tol = 4 * torch.finfo(q.dtype).eps
    torch.testing.assert_close(out[..., cols], clean.float()[..., cols], atol=tol, rtol=tol)
