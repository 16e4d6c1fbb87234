"""block_sparse_attention against the fp64 reference and SDPA (MATH backend),
the defined empty rows, NaN canaries, metamorphic properties and seeded random-mask fuzzing."""

from __future__ import annotations

import gc
import math
import random

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.flex_attention import create_block_mask, create_mask
from utils import block_kernel_mask, check_attention, check_close, make_qkv

import sparse_attn
from sparse_attn import BlockSparseMask, patterns, reference

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _pair(bs):
    return (bs, bs) if isinstance(bs, int) else tuple(bs)


def random_element_mask(shape, lq, lk, block_size, seed, density=None):
    """Bool (*shape, Lq, Lk) whose blocks are drawn empty, full or partial."""
    g = torch.Generator().manual_seed(seed)
    bq, bk = _pair(block_size)
    nq, nk = math.ceil(lq / bq), math.ceil(lk / bk)

    def expand(t):
        return t.repeat_interleave(bq, -2).repeat_interleave(bk, -1)[..., :lq, :lk]

    kind = expand(torch.randint(0, 3, (*shape, nq, nk), generator=g))
    dens = expand(torch.rand(*shape, nq, nk, generator=g)) if density is None else density
    noise = torch.rand(*shape, lq, lk, generator=g)
    return (kind == 1) | ((kind == 2) & (noise < dens))


def sdpa_check(out, q, k, v, dense, *, scale=None, name="vs SDPA"):
    """The op against SDPA (MATH backend): fp64 SDPA is the gold, SDPA in the input dtype the peer."""
    with sdpa_kernel(SDPBackend.MATH):
        gold = F.scaled_dot_product_attention(
            q.double(), k.double(), v.double(), attn_mask=dense, scale=scale, enable_gqa=True
        )
        lp = F.scaled_dot_product_attention(q, k, v, attn_mask=dense, scale=scale, enable_gqa=True)
    ours, _ = reference.attention(q, k, v, mask=dense, scale=scale)
    defined = dense.expand(q.shape[0], q.shape[1], -1, -1).any(-1)
    # The reference itself agrees with SDPA (empty rows are 0 in both).
    assert torch.allclose(ours, gold, atol=1e-10, rtol=1e-10), f"{name}: reference disagrees with SDPA"
    check_close(name, out, gold, lp, dtype=q.dtype, defined=defined.unsqueeze(-1).expand_as(gold))


# ------------------------------------------------------------------------------------ matrix of shapes
# name: (B, H, Hkv, Lq, Lk, block_size, layout, mask maker (lq, lk, block_size, b, h) -> BlockSparseMask)
_CASES = {
    "mha_square_128": (1, 2, 2, 256, 256, 128, "bhld", "elem_11"),
    "gqa_ragged_per_head": (2, 4, 2, 200, 300, 64, "bhld", "elem_bh"),
    "mqa_lq_gt_lk_mixed": (1, 3, 1, 300, 129, (64, 128), "bhld", "elem_1h"),
    "strided_blhd_per_batch": (2, 2, 2, 257, 257, (128, 64), "blhd", "elem_b1"),
    "decode_row": (2, 2, 1, 1, 257, 64, "bhld", "elem_bh"),
    "single_key": (1, 2, 2, 129, 1, 128, "blhd", "elem_1h"),
    "longformer_blhd_gqa": (1, 4, 2, 300, 300, 64, "blhd", "longformer"),
    "causal_lq_lt_lk": (2, 2, 2, 200, 300, (64, 128), "bhld", "causal"),
    "causal_lq_gt_lk": (1, 2, 1, 300, 200, 128, "bhld", "causal"),
}


def _make_mask(kind, lq, lk, block_size, b, h, seed):
    shape = {"elem_11": (1, 1), "elem_bh": (b, h), "elem_1h": (1, h), "elem_b1": (b, 1)}.get(kind)
    if shape is not None:
        dense = random_element_mask(shape, lq, lk, block_size, seed)
        return BlockSparseMask.from_element_mask(dense, block_size=block_size)
    if kind == "longformer":
        return patterns.longformer(lq, 24, [0, 150], block_size=block_size)
    return block_kernel_mask(patterns.causal(lq, lk, block_size=block_size))  # not the causal route


@pytest.mark.parametrize("case", list(_CASES), ids=list(_CASES))
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_matches_reference_and_sdpa(dtype, d, case, device):
    b, h, hkv, lq, lk, block_size, layout, kind = _CASES[case]
    seed = sum(map(ord, case)) + d
    q, k, v = make_qkv(b, h, hkv, lq, lk, d, dtype=dtype, device=device, seed=seed, layout=layout)
    if layout == "blhd":
        assert not q.is_contiguous()
    mask = _make_mask(kind, lq, lk, block_size, b, h, seed).to(device)
    if kind in ("elem_bh", "elem_1h") and h > 1:
        per_head = mask.to_dense()
        assert not torch.equal(per_head[:, 0], per_head[:, 1]), "heads must have distinct masks"
    out, lse = sparse_attn.block_sparse_attention(q, k, v, mask, return_lse=True)
    assert out.shape == (b, h, lq, d) and out.dtype == dtype and out.device.type == device
    assert lse.shape == (b, h, lq) and lse.dtype == torch.float32
    assert out.transpose(1, 2).is_contiguous(), "output is stored (B, Lq, H, Dv)-contiguous"
    dense = mask.to_dense()
    gold = check_attention(out, lse, q, k, v, mask=dense, name=f"{case} {dtype} d={d}")
    sdpa_check(out, q, k, v, dense, name=f"{case} {dtype} d={d} vs SDPA")
    # Reading the strided views in place gives what the contiguous copies give.
    if layout == "blhd":
        again = sparse_attn.block_sparse_attention(q.contiguous(), k.contiguous(), v.contiguous(), mask)
        check_close("contiguous copy", again, gold, out, dtype=dtype)


@pytest.mark.parametrize("scale", [0.0, -0.5, 0.3])
def test_custom_scale(scale, device):
    q, k, v = make_qkv(1, 2, 2, 200, 200, 64, dtype=torch.bfloat16, device=device, seed=5)
    mask = block_kernel_mask(patterns.sliding_window(200, 40, block_size=64)).to(device)
    out, lse = sparse_attn.block_sparse_attention(q, k, v, mask, scale=scale, return_lse=True)
    check_attention(out, lse, q, k, v, mask=mask.to_dense(), scale=scale)
    sdpa_check(out, q, k, v, mask.to_dense(), scale=scale)


# ------------------------------------------------------------------------------------ mask types
def test_accepts_block_sparse_mask_flex_block_mask_and_bool_block_matrix(device):
    b, h, lq, lk = 2, 2, 200, 300
    q, k, v = make_qkv(b, h, h, lq, lk, 64, dtype=torch.float16, device=device, seed=7)

    def mask_mod(b_, h_, q_idx, kv_idx):
        return (kv_idx <= q_idx + 100) & ((q_idx - kv_idx + 100 < 64 + 32 * h_) | (kv_idx < 8 * (b_ + 1)))

    block_mask = create_block_mask(mask_mod, b, h, lq, lk, device=device, BLOCK_SIZE=64)
    dense = create_mask(mask_mod, b, h, lq, lk, device=device)
    from_flex = sparse_attn.block_sparse_attention(q, k, v, block_mask)
    check_attention(from_flex, None, q, k, v, mask=dense, name="FlexAttention BlockMask")
    converted = sparse_attn.block_sparse_attention(q, k, v, BlockSparseMask.from_flex(block_mask))
    assert torch.equal(from_flex, converted)

    g = torch.Generator().manual_seed(0)
    for block_size in (128, 64):
        nq, nk = math.ceil(lq / block_size), math.ceil(lk / block_size)
        blocks = (torch.rand(b, 1, nq, nk, generator=g) < 0.5).to(device)
        # (nQb, nKb) picks the block size that matches the lengths: 128 first, else 64.
        out = sparse_attn.block_sparse_attention(q, k, v, blocks)
        mask = BlockSparseMask.from_block_matrix(blocks, seq_lengths=(lq, lk), block_size=block_size)
        assert torch.equal(out, sparse_attn.block_sparse_attention(q, k, v, mask))
        check_attention(out, None, q, k, v, mask=mask.to_dense(), name=f"bool block matrix {block_size}")
    two_d = (torch.rand(2, 3, generator=g) < 0.5).to(device)
    out = sparse_attn.block_sparse_attention(q, k, v, two_d)
    mask = BlockSparseMask.from_block_matrix(two_d, seq_lengths=(lq, lk))
    check_attention(out, None, q, k, v, mask=mask.to_dense(), name="2-D bool block matrix")


def test_flex_block_mask_is_converted_once_per_mask(monkeypatch, device):
    # Flex users pass their BlockMask at every step: the conversion (mask_mod over the partial
    # blocks) runs on the first call and is kept with the mask object; block tensors changed in
    # place, or another BlockMask, convert again; the output is the converted-once mask's.
    from sparse_attn import _args

    calls = []
    real = BlockSparseMask.from_flex
    monkeypatch.setattr(BlockSparseMask, "from_flex", staticmethod(lambda bm: calls.append(bm) or real(bm)))
    L = 320
    q, k, v = make_qkv(1, 2, 2, L, L, 64, device=device, seed=3)
    block_mask = create_block_mask(lambda b, h, i, j: (i - j < 100) & (j <= i), None, None, L, L, device=device)
    want = sparse_attn.block_sparse_attention(q, k, v, real(block_mask))
    for _ in range(3):
        assert torch.equal(sparse_attn.block_sparse_attention(q, k, v, block_mask), want)
    assert len(calls) == 1
    block_mask.kv_num_blocks[..., 0] = 0  # query block 0 now lists no key block: converted again
    out = sparse_attn.block_sparse_attention(q, k, v, block_mask)
    assert len(calls) == 2 and (out[:, :, :128] == 0).all() and torch.equal(out[:, :, 128:], want[:, :, 128:])
    other = create_block_mask(lambda b, h, i, j: j <= i, None, None, L, L, device=device)
    sparse_attn.block_sparse_attention(q, k, v, other)
    assert len(calls) == 3
    assert block_mask in _args._FLEX_CONVERTED and other in _args._FLEX_CONVERTED
    held = len(_args._FLEX_CONVERTED)
    del block_mask, other
    calls.clear()
    gc.collect()
    assert len(_args._FLEX_CONVERTED) == held - 2  # entries go with their BlockMask


def test_rejects_mask_for_other_lengths_or_of_wrong_type():
    q, k, v = make_qkv(1, 2, 2, 200, 300, 64, dtype=torch.bfloat16, seed=8)
    with pytest.raises(ValueError, match="seq_lengths"):
        sparse_attn.block_sparse_attention(q, k, v, patterns.causal(200, 200))
    with pytest.raises(ValueError, match="block matrix"):
        sparse_attn.block_sparse_attention(q, k, v, torch.ones(3, 3, dtype=torch.bool))
    with pytest.raises(TypeError, match="bool"):
        sparse_attn.block_sparse_attention(q, k, v, torch.ones(2, 3, dtype=torch.int32))
    with pytest.raises(TypeError, match="mask"):
        sparse_attn.block_sparse_attention(q, k, v, "causal")
    out = sparse_attn.block_sparse_attention(q, k, v, patterns.causal(200, 300))  # positive control
    check_attention(out, None, q, k, v, causal=True)


# ------------------------------------------------------------------------------------ empty rows
def _poison_allocator(numel=1 << 22):
    junk = torch.full((numel,), float("nan"))
    del junk


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_empty_rows_are_exactly_zero_with_lse_minus_inf(dtype, device):
    b, h, lq, lk, bs = 2, 2, 257, 300, 64
    dense = random_element_mask((b, h), lq, lk, bs, seed=9)
    dense[:, :, 64:128] = False  # a whole query block with no key block (kv_num_blocks 0)
    dense[0, 1, 130:140] = False  # rows of partial blocks with no allowed pair
    dense[1, 0, 256] = False  # the ragged last row
    dense[:, :, 150:160, :] = False
    dense[:, :, 150:160, 250] = True  # rows whose first key blocks are empty and one later pair is on
    mask = BlockSparseMask.from_element_mask(dense, block_size=bs)
    assert (mask.kv_num_blocks[..., 1] == 0).all()
    q, k, v = make_qkv(b, h, h, lq, lk, 64, dtype=dtype, device=device, seed=9)
    _poison_allocator()
    out, lse = sparse_attn.block_sparse_attention(q, k, v, mask.to(device), return_lse=True)
    empty = ~dense.any(-1)
    assert empty.sum() >= 2 * 2 * 64 + 10 + 1
    assert (out[empty.to(device)] == 0).all(), "a row with no visible key is exactly 0"
    assert torch.equal(torch.isneginf(lse).cpu(), empty), "LSE is -inf exactly on the empty rows"
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    check_attention(out, lse, q, k, v, mask=dense.to(device))


def test_all_empty_mask(device):
    q, k, v = make_qkv(1, 2, 2, 200, 300, 64, dtype=torch.bfloat16, device=device, seed=10)
    blocks = torch.zeros(2, 3, dtype=torch.bool, device=device)
    out, lse = sparse_attn.block_sparse_attention(q, k, v, blocks, return_lse=True)
    assert torch.equal(out, torch.zeros_like(out)) and bool(torch.isneginf(lse).all())


# ------------------------------------------------------------------------------------ NaN canaries
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_nan_in_skipped_key_blocks_and_past_the_end_does_not_reach_the_output(dtype, device):
    b, h, lq, lk, bs, pad = 2, 3, 200, 300, 64, 17
    nq, nk = math.ceil(lq / bs), math.ceil(lk / bs)
    g = torch.Generator().manual_seed(12)
    blocks = torch.rand(b, h, nq, nk, generator=g) < 0.6
    skipped = torch.rand(b, h, nk, generator=g) < 0.4  # key blocks no query block of (b, h) visits
    skipped[:, :, nk - 1] = False  # keep the ragged tail block in use: the padding past Lk must be skipped
    blocks &= ~skipped[:, :, None, :]
    dense = BlockSparseMask.from_block_matrix(blocks, seq_lengths=(lq, lk), block_size=bs).to_dense()
    dense &= random_element_mask((b, h), lq, lk, bs, seed=12, density=0.7)
    dense[..., :bs, lk - 1] = True  # every (b, h) reads the ragged tail block
    mask = BlockSparseMask.from_element_mask(dense, block_size=bs).to(device)
    q, k, v = make_qkv(b, h, h, lq, lk, 64, dtype=dtype, device=device, seed=12)
    clean = sparse_attn.block_sparse_attention(q, k, v, mask, return_lse=True)

    def poisoned(x):
        # Storage longer than Lk, NaN past the end and in every skipped block; read through a view.
        big = torch.full((b, h, lk + pad, x.shape[-1]), float("nan"), dtype=dtype, device=device)
        big[:, :, :lk] = x
        col = skipped.repeat_interleave(bs, -1)[..., :lk].to(device)
        big[:, :, :lk][col] = float("nan")
        return big[:, :, :lk]

    pk, pv = poisoned(k), poisoned(v)
    assert torch.isnan(pk).any() and pk.stride(2) == pk.shape[-1]
    out, lse = sparse_attn.block_sparse_attention(q, pk, pv, mask, return_lse=True)
    assert not torch.isnan(out).any(), "NaN from skipped blocks or past Lk reached the output"
    assert torch.equal(out, clean[0]) and torch.equal(lse, clean[1])


def test_nan_in_a_visible_key_propagates():
    length = 128
    q, k, v = make_qkv(1, 1, 1, length, length, 64, dtype=torch.float32, seed=13)
    k[0, 0, 7, 0] = float("nan")
    dense = torch.zeros(length, length, dtype=torch.bool)
    dense[0, [3, 7]] = True  # key 7 is the last visible key of row 0
    dense[1, [7, 9]] = True
    dense[2:] = True
    out, lse = sparse_attn.block_sparse_attention(q, k, v, BlockSparseMask.from_element_mask(dense), return_lse=True)
    assert bool(torch.isnan(out[0, 0]).all(-1).all()), f"rows without NaN: {(~torch.isnan(out[0, 0, :, 0])).nonzero()}"
    assert bool(torch.isnan(lse).all())


def test_nan_in_a_visible_query_propagates_to_its_row_only():
    q, k, v = make_qkv(1, 2, 2, 200, 200, 64, dtype=torch.float32, seed=14)
    q[0, 1, 150, 3] = float("nan")
    mask = block_kernel_mask(patterns.causal(200, 200))
    out = sparse_attn.block_sparse_attention(q, k, v, mask)
    gold, _ = reference.block_sparse_attention(q, k, v, mask)
    nan_rows = torch.isnan(out).any(-1)
    assert nan_rows.sum() == 1 and nan_rows[0, 1, 150]
    assert torch.equal(torch.isnan(gold).any(-1), nan_rows)


# ------------------------------------------------------------------------------------ metamorphic
@pytest.mark.parametrize("block_size", [64, 128, (64, 128)])
@pytest.mark.parametrize("lengths", [(256, 256), (200, 300), (300, 200), (1, 257)])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_all_ones_equals_flash_and_causal_equals_flash_causal(dtype, lengths, block_size, device):
    lq, lk = lengths
    bq, bk = _pair(block_size)
    q, k, v = make_qkv(2, 4, 2, lq, lk, 64, dtype=dtype, device=device, seed=15)
    ones = torch.ones(math.ceil(lq / bq), math.ceil(lk / bk), dtype=torch.bool)
    for name, mask, causal in (
        (
            "all-ones",
            BlockSparseMask.from_block_matrix(ones, seq_lengths=(lq, lk), block_size=block_size),
            False,
        ),
        ("causal", block_kernel_mask(patterns.causal(lq, lk, block_size=block_size)), True),
    ):
        out, lse = sparse_attn.block_sparse_attention(q, k, v, mask.to(device), return_lse=True)
        ref_out, ref_lse = sparse_attn.flash_attention(q, k, v, causal=causal, return_lse=True)
        gold = check_attention(out, lse, q, k, v, causal=causal, name=name)
        # Within the tolerance rule with flash_attention as the peer, and the same LSE.
        check_close(f"{name} vs flash", out, gold, ref_out, dtype=dtype)
        assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse))
        finite = torch.isfinite(ref_lse)
        assert torch.allclose(lse[finite], ref_lse[finite], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("block_size", [64, 128, (128, 64)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_permuting_kv_blocks_with_mask_columns(dtype, block_size, device):
    b, h, lq, lk = 2, 2, 200, 300
    bq, bk = _pair(block_size)
    nk = math.ceil(lk / bk)
    dense = random_element_mask((b, h), lq, lk, block_size, seed=16)
    q, k, v = make_qkv(b, h, h, lq, lk, 64, dtype=dtype, device=device, seed=16)
    # Permute the whole key blocks, keeping the ragged tail block last (block boundaries stay put).
    perm_blocks = torch.cat(
        [torch.randperm(nk - 1, generator=torch.Generator().manual_seed(16)), torch.tensor([nk - 1])]
    )
    cols = (perm_blocks[:, None] * bk + torch.arange(bk)).flatten()
    cols = cols[cols < lk]
    assert not torch.equal(cols, torch.arange(lk))
    mask = BlockSparseMask.from_element_mask(dense, block_size=block_size)
    permuted = BlockSparseMask.from_element_mask(dense[..., cols], block_size=block_size)
    out, lse = sparse_attn.block_sparse_attention(q, k, v, mask.to(device), return_lse=True)
    dcols = cols.to(device)
    out_p, lse_p = sparse_attn.block_sparse_attention(
        q, k[:, :, dcols], v[:, :, dcols], permuted.to(device), return_lse=True
    )
    gold = check_attention(out, lse, q, k, v, mask=dense.to(device))
    check_close("permuted kv blocks", out_p, gold, out, dtype=dtype, defined=None)
    assert torch.equal(torch.isneginf(lse), torch.isneginf(lse_p))
    finite = torch.isfinite(lse)
    assert torch.allclose(lse_p[finite], lse[finite], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("mask_batch", [1, 4])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_batch_invariance(dtype, mask_batch, device):
    b, h, hkv, lq, lk, bs = 4, 4, 2, 257, 200, 64
    dense = random_element_mask((mask_batch, h), lq, lk, bs, seed=17)
    mask = BlockSparseMask.from_element_mask(dense, block_size=bs).to(device)
    q, k, v = make_qkv(b, h, hkv, lq, lk, 128, dtype=dtype, device=device, seed=17)
    out, lse = sparse_attn.block_sparse_attention(q, k, v, mask, return_lse=True)
    for i in range(b):
        alone_mask = mask if mask_batch == 1 else BlockSparseMask.from_element_mask(dense[i : i + 1], block_size=bs)
        o, l = sparse_attn.block_sparse_attention(
            q[i : i + 1], k[i : i + 1], v[i : i + 1], alone_mask.to(device), return_lse=True
        )
        assert torch.equal(o[0], out[i]), f"batch element {i} differs when computed alone"
        assert torch.equal(l[0], lse[i])
    again, lse_again = sparse_attn.block_sparse_attention(q, k, v, mask, return_lse=True)
    assert torch.equal(again, out) and torch.equal(lse_again, lse), "forward must be deterministic"


# ------------------------------------------------------------------------------------ fuzzing
_NEAR_TILES = [1, 2, 17, 63, 64, 65, 127, 128, 129, 191, 200, 255, 256, 257, 300, 383, 385]


def _fuzz_case(seed, max_len):
    rng = random.Random(seed)
    lengths = [n for n in _NEAR_TILES if n <= max_len]
    lq = rng.choice(lengths)
    lk = rng.choice(lengths) if rng.random() < 0.7 else lq
    if rng.random() < 0.6:  # bias towards ragged lengths
        lq = lq + rng.choice([0, 1, -1]) if lq > 1 else lq
        lk = lk + rng.choice([0, 1, -1]) if lk > 1 else lk
    block_size = rng.choice([64, 128, (64, 128), (128, 64)])
    bq, bk = _pair(block_size)
    nq, nk = math.ceil(lq / bq), math.ceil(lk / bk)
    hkv = rng.choice([1, 2])
    h = hkv * rng.choice([1, 2, 3])
    b = rng.choice([1, 2])
    mb, mh = rng.choice([(1, 1), (b, 1), (1, h), (b, h)])
    d = rng.choice([64, 128])
    dtype = rng.choice(DTYPES)
    kind = rng.choice(["density0", "density1", "blocks", "elements", "single", "single_tail", "row_extremes"])
    g = torch.Generator().manual_seed(seed)
    shape = (mb, mh, nq, nk)
    if kind == "density0":
        blocks = torch.zeros(shape, dtype=torch.bool)
    elif kind == "density1":
        blocks = torch.ones(shape, dtype=torch.bool)
    elif kind == "blocks":
        blocks = torch.rand(shape, generator=g) < rng.random()
    elif kind in ("single", "single_tail"):
        blocks = torch.zeros(shape, dtype=torch.bool)
        qi = nq - 1 if kind == "single_tail" else rng.randrange(nq)
        ki = nk - 1 if kind == "single_tail" else rng.randrange(nk)
        blocks[..., qi, ki] = True
    elif kind == "row_extremes":
        blocks = torch.rand(shape, generator=g) < 0.5
        blocks[..., rng.randrange(nq), :] = True
        blocks[..., rng.randrange(nq), :] = False
    if kind == "elements":
        dense = random_element_mask((mb, mh), lq, lk, block_size, seed)
        mask = BlockSparseMask.from_element_mask(dense, block_size=block_size)
    else:
        mask = BlockSparseMask.from_block_matrix(blocks, seq_lengths=(lq, lk), block_size=block_size)
        if rng.random() < 0.3:  # partial blocks on top: intersect with a causal or banded pattern
            mask = mask & patterns.causal(lq, lk, block_size=block_size)
    desc = f"B={b} H={h} Hkv={hkv} Lq={lq} Lk={lk} D={d} {dtype} block={block_size} mask={kind} ({mb},{mh})"
    return (b, h, hkv, lq, lk, d, dtype), mask, desc


def _run_fuzz(seed, device, max_len):
    (b, h, hkv, lq, lk, d, dtype), mask, desc = _fuzz_case(seed, max_len)
    q, k, v = make_qkv(b, h, hkv, lq, lk, d, dtype=dtype, device=device, seed=seed)
    _poison_allocator()
    out, lse = sparse_attn.block_sparse_attention(q, k, v, mask.to(device), return_lse=True)
    replay = f"replay: pytest tests/test_block_sparse.py -k 'fuzz and {device}-{seed}]'"
    check_attention(out, lse, q, k, v, mask=mask.to_dense().to(device), name=f"fuzz seed={seed} {desc}; {replay}")


@pytest.mark.parametrize("seed", range(40))
def test_random_mask_fuzz(seed, device):
    _run_fuzz(seed, device, max_len=300)


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(1000, 1060))
def test_random_mask_fuzz_longer(seed, device):
    _run_fuzz(seed, device, max_len=385)


def _spy(monkeypatch, name, record):
    """Calls that block_sparse_attention makes of the route runner _routes.<name>, each as
    record(its arguments): what ran, next to what sparse_attn.explain said would run."""
    from sparse_attn import _routes

    calls, real = [], getattr(_routes, name)
    monkeypatch.setattr(_routes, name, lambda *args: calls.append(record(args)) or real(*args))
    return calls


def _route(q, k, v, mask):
    return sparse_attn.explain(sparse_attn.block_sparse_attention, q, k, v, mask).route


def _spy_dilated(monkeypatch, route="dilated"):
    """Calls of a dilated route of block_sparse_attention (_routes.dilated: one window per residue
    class; _routes.dilated_2d: dense attention per segment), as their (window or segment, dilation)."""
    return _spy(monkeypatch, route, lambda args: args[3:5])


@pytest.mark.parametrize(
    "length,window,dilation,hkv",
    [(1000, 300, 3, 2), (257, 64, 2, 4), (512, 5, 4, 4), (130, 1000, 7, 1), (3, 2, 2, 4)],
)
@pytest.mark.parametrize("dtype", DTYPES)
def test_dilated_pattern_runs_as_residue_windows(monkeypatch, device, length, window, dilation, hkv, dtype):
    # patterns.dilated's mask runs as one sliding window per residue class (_routes.dilated), with
    # the attention of the fp64 reference on the expanded mask: lengths not divisible by the
    # dilation, windows narrower than it or longer than the sequence, GQA, LSE.
    calls = _spy_dilated(monkeypatch)
    q, k, v = make_qkv(2, 4, hkv, length, length, 64, device=device, dtype=dtype, seed=length + dilation)
    mask = patterns.dilated(length, window, dilation, device=device)
    out, lse = sparse_attn.block_sparse_attention(q, k, v, mask, return_lse=True)
    assert calls == [(window, dilation)] and _route(q, k, v, mask) == "dilated"
    check_attention(out, lse, q, k, v, mask=mask.to_dense(), name=f"dilated {length} {window} {dilation}")


def test_combined_dilated_mask_takes_the_generic_path(monkeypatch, device):
    # A dilated band joined with global tokens is no longer one dilation: the generic kernel runs it.
    calls = _spy_dilated(monkeypatch)
    mask = patterns.dilated(512, 100, 2, device=device) | patterns.global_tokens(512, [0, 300], device=device)
    q, k, v = make_qkv(1, 2, 2, 512, 512, 64, device=device, seed=4)
    out, lse = sparse_attn.block_sparse_attention(q, k, v, mask, return_lse=True)
    assert calls == [] and _route(q, k, v, mask) == "block_kernel"
    check_attention(out, lse, q, k, v, mask=mask.to_dense(), name="dilated | global")


def _spy_block_kernel(monkeypatch):
    """Masks that block_sparse_attention hands to the block-sparse kernel (_routes.block_kernel)."""
    return _spy(monkeypatch, "block_kernel", lambda args: args[3])


@pytest.mark.parametrize("block_size", [64, 128, (64, 128)])
@pytest.mark.parametrize("lengths,hkv", [((256, 256), 2), ((200, 300), 4), ((300, 200), 1), ((1, 257), 2)])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_causal_pattern_runs_as_flash_causal(monkeypatch, device, dtype, lengths, hkv, block_size):
    # patterns.causal's mask (also after .to()) runs as flash_attention(causal=True): no block
    # kernel call, the same output and LSE bit for bit (Lq > Lk: rows that see no key get 0 and LSE
    # -inf), for every block size the pattern takes, GQA and a custom scale; the fp64 reference on
    # the expanded mask agrees.
    calls = _spy_block_kernel(monkeypatch)
    lq, lk = lengths
    q, k, v = make_qkv(2, 4, hkv, lq, lk, 64, dtype=dtype, device=device, seed=lq + lk)
    mask = patterns.causal(lq, lk, block_size=block_size).to(device)
    for scale in (None, 0.3):
        out, lse = sparse_attn.block_sparse_attention(q, k, v, mask, scale=scale, return_lse=True)
        ref_out, ref_lse = sparse_attn.flash_attention(q, k, v, causal=True, scale=scale, return_lse=True)
        assert torch.equal(out, ref_out) and torch.equal(lse, ref_lse)
        check_attention(out, lse, q, k, v, mask=mask.to_dense(), scale=scale, name=f"causal route {lengths}")
    assert calls == [] and _route(q, k, v, mask) == "flash_causal"
    # The same blocks as a plain mask, or joined with global tokens, take the block kernel.
    plain = block_kernel_mask(mask)
    joined = mask | patterns.global_tokens(lq, [0], block_size=block_size, device=device) if lq == lk else plain
    for other in (plain, joined):
        sparse_attn.block_sparse_attention(q, k, v, other)
        assert calls.pop() is other and _route(q, k, v, other) == "block_kernel"


@pytest.mark.parametrize("block_size", [64, 128, (128, 64)])
@pytest.mark.parametrize(
    "build,window",
    [
        (lambda n, bs: patterns.sliding_window(n, 40, block_size=bs), (39, 39)),
        (lambda n, bs: patterns.sliding_window(n, 300, causal=True, block_size=bs), (299, 0)),
        (lambda n, bs: patterns.sliding_window(n, 1000, block_size=bs), (999, 999)),
        (lambda n, bs: patterns.dilated(n, 70, 1, block_size=bs), (69, 69)),
    ],
    ids=["w40", "causal_w300", "w1000", "dilation1"],
)
def test_window_patterns_run_as_flash_window(monkeypatch, device, build, window, block_size):
    # patterns.sliding_window's mask (and dilated with dilation 1) runs as flash_attention with the
    # same window at every block size: no block kernel call, bitwise flash's output and LSE, and the
    # fp64 reference on the expanded mask agrees (GQA, a ragged length, a window past the ends).
    calls = _spy_block_kernel(monkeypatch)
    q, k, v = make_qkv(2, 4, 2, 333, 333, 64, device=device, seed=window[0])
    mask = build(333, block_size).to(device)
    out, lse = sparse_attn.block_sparse_attention(q, k, v, mask, return_lse=True)
    assert calls == []
    plan = sparse_attn.explain(sparse_attn.block_sparse_attention, q, k, v, mask)
    assert plan.route == "flash_window" and f"window={window}" in plan.why
    ref_out, ref_lse = sparse_attn.flash_attention(q, k, v, window=window, return_lse=True)
    assert torch.equal(out, ref_out) and torch.equal(lse, ref_lse)
    check_attention(out, lse, q, k, v, mask=mask.to_dense(), name=f"window route {window}")
    sparse_attn.block_sparse_attention(q, k, v, block_kernel_mask(mask))
    assert len(calls) == 1


@pytest.mark.parametrize(
    "length,segment,dilation,hkv",
    [(1024, 256, 2, 2), (1000, 300, 3, 4), (700, 1000, 4, 1), (257, 64, 5, 4), (3, 2, 2, 4)],
)
@pytest.mark.parametrize("dtype", DTYPES)
def test_dilated_2d_pattern_runs_as_dense_segments(monkeypatch, device, length, segment, dilation, hkv, dtype):
    # patterns.dilated_2d's mask runs as dense attention over each segment's attending positions
    # (_routes.dilated_2d): whole segments batched, a ragged last one, a segment longer than the
    # sequence, segments not divisible by the dilation, GQA; rows at other positions see no key.
    calls = _spy_dilated(monkeypatch, "dilated_2d")
    q, k, v = make_qkv(2, 4, hkv, length, length, 64, device=device, dtype=dtype, seed=length + segment)
    mask = patterns.dilated_2d(length, segment, dilation, device=device)
    out, lse = sparse_attn.block_sparse_attention(q, k, v, mask, return_lse=True)
    assert calls == [(segment, dilation)] and _route(q, k, v, mask) == "dilated_2d"
    check_attention(out, lse, q, k, v, mask=mask.to_dense(), name=f"dilated_2d {length} {segment} {dilation}")


@pytest.mark.parametrize(
    "name",
    ["random", "window", "window_pair", "longformer", "dilated", "dilated_2d", "causal", "matrix"],
)
def test_causal_argument_intersects_the_mask(name, device):
    # causal=True hides the keys after each query (bottom-right) from any mask: exact against the
    # reference on mask & causal; windows keep their flash route (window capped at the diagonal).
    L = 300
    q, k, v = make_qkv(1, 2, 2, L, L, 64, device=device, seed=len(name))
    mask = {
        "random": lambda: patterns.random_blocks(L, 0.4, seed=2, block_size=64, device=device),
        "window": lambda: patterns.sliding_window(L, 50, device=device),
        "window_pair": lambda: patterns.sliding_window(L, (30, 70), device=device),
        "longformer": lambda: patterns.longformer(L, 40, [0, 200], device=device),
        "dilated": lambda: patterns.dilated(L, 120, 3, device=device),
        "dilated_2d": lambda: patterns.dilated_2d(L, 128, 2, device=device),
        "causal": lambda: patterns.causal(L, L, device=device),
        "matrix": lambda: torch.ones(3, 3, dtype=torch.bool, device=device),
    }[name]()
    out, lse = sparse_attn.block_sparse_attention(q, k, v, mask, causal=True, return_lse=True)
    dense = mask.to_dense() if isinstance(mask, BlockSparseMask) else torch.ones(L, L, dtype=torch.bool, device=device)
    allowed = dense & torch.ones(L, L, dtype=torch.bool, device=device).tril()
    check_attention(out, lse, q, k, v, mask=allowed, name=f"causal {name}")
    route = sparse_attn.explain(sparse_attn.block_sparse_attention, q, k, v, mask, causal=True).route
    assert route == {"window": "flash_window", "window_pair": "flash_window", "causal": "flash_causal"}.get(
        name, "block_kernel"
    )
    again = sparse_attn.block_sparse_attention(q, k, v, mask, causal=True, return_lse=True)
    assert torch.equal(again[0], out)  # the intersection kept on the mask gives the same output
