"""The CPU main loop's tile products (csrc/cpu/attention_cpu.cpp): groups of up to 8 consecutive
key tiles run as one softmax step and one P V product, bf16 on the matrix unit where the CPU has
one (head dims that are multiples of 16) and fp32 otherwise. These cases reach every branch of
it: long rows (full groups plus a ragged tail), groups broken by a block-sparse list, head dims on
and off the matrix unit's layout, hidden values that are NaN inside a group, scores so large that
the exponent's rounding matters, strided inputs read in place, and the 128- and 256-row query
tiles of long dense and causal rows."""

from __future__ import annotations

import pytest
import torch
from utils import check_attention, make_qkv

import sparse_attn
from sparse_attn import patterns

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
IDS = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS.get)
@pytest.mark.parametrize("d,dv", [(64, 64), (128, 128), (40, 40), (48, 80), (256, 256)], ids=str)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_long_rows_every_head_dim(dtype, d, dv, causal):
    # 700 keys: one full group of 8 tiles (one K^T block of the fp32 products), then 3 tiles, the
    # last ragged (700 = 10 * 64 + 60).
    q, k, v = make_qkv(1, 4, 2, 193, 700, d, dv, dtype=dtype, seed=d + dv)
    out, lse = sparse_attn.flash_attention(q, k, v, causal=causal, return_lse=True)
    check_attention(out, lse, q, k, v, causal=causal)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=IDS.get)
def test_windows_and_block_lists_break_groups(dtype):
    q, k, v = make_qkv(2, 2, 2, 1000, 1000, 64, dtype=dtype, seed=5)
    out, lse = sparse_attn.flash_attention(q, k, v, window=(300, 77), return_lse=True)
    i = torch.arange(1000)
    band = ((i[:, None] - i[None, :]) <= 300) & ((i[None, :] - i[:, None]) <= 77)
    check_attention(out, lse, q, k, v, mask=band, name="window")
    # Random 64-blocks: runs of adjacent key blocks of every length, some partial (Longformer's
    # global rows and columns).
    mask = patterns.random_blocks(1000, 0.4, seed=1, block_size=64) | patterns.longformer(
        1000, 100, [0, 513], block_size=64
    )
    out, lse = sparse_attn.block_sparse_attention(q, k, v, mask, return_lse=True)
    check_attention(out, lse, q, k, v, mask=mask.to_dense(), name="block-sparse")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=IDS.get)
def test_hidden_nan_inside_a_group_stays_hidden(dtype):
    q, k, v = make_qkv(1, 1, 1, 512, 512, 64, dtype=dtype, seed=7)
    v[0, 0, 300] = float("nan")  # key 300: tile 4 of the first group of every row that reaches it
    k[0, 0, 301] = float("inf")
    out = sparse_attn.flash_attention(q, k, v, causal=True)
    assert not out[0, 0, :300].isnan().any()
    assert out[0, 0, 300:].isnan().all()


def test_large_scores_keep_p_of_the_max_at_one():
    # 1000^2 * 64 * scale: the exponent must reuse the max's rounding of s * scale, or every P is
    # off by up to 2^(ulp / 2) (an fused multiply-subtract gave 996 instead of 1000 here, NaN at 133120).
    for value in (1000.0, 133120.0):
        q = torch.full((1, 2, 200, 64), value, dtype=torch.bfloat16)
        out = sparse_attn.flash_attention(q, q, q)
        assert (out == value).all(), value


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=IDS.get)
def test_strided_queries_read_in_place(dtype):
    # (B, L, H, D) storage viewed as (B, H, L, D): Q's rows are read with their row stride.
    q, k, v = make_qkv(2, 4, 4, 300, 300, 64, dtype=dtype, seed=9, layout="blhd")
    assert not q.is_contiguous()
    out, lse = sparse_attn.flash_attention(q, k, v, causal=True, return_lse=True)
    check_attention(out, lse, q, k, v, causal=True)


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS.get)
@pytest.mark.parametrize("lq,lk", [(1100, 1100), (1030, 1500), (1500, 1030)], ids=str)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_wide_query_tiles(dtype, lq, lk, causal):
    # From 1024 queries on, dense and causal rows run as 128-row tiles (the plan's CPU tile): a
    # ragged last tile, causal rows bottom-right aligned for Lq != Lk, GQA.
    q, k, v = make_qkv(1, 4, 2, lq, lk, 64, 80, dtype=dtype, seed=lq + lk)
    assert _tile_rows(q, k, v, causal=causal) == 128
    out, lse = sparse_attn.flash_attention(q, k, v, causal=causal, return_lse=True)
    check_attention(out, lse, q, k, v, causal=causal)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=IDS.get)
def test_wide_query_tiles_keep_hidden_nan_hidden(dtype):
    q, k, v = make_qkv(1, 2, 2, 1100, 1100, 64, dtype=dtype, seed=3)
    v[0, 1, 1000] = float("nan")  # inside the diagonal tile of the 128 rows 896-1023
    out = sparse_attn.flash_attention(q, k, v, causal=True)
    assert not out[0, 1, :1000].isnan().any() and not out[0, 0].isnan().any()
    assert out[0, 1, 1000:].isnan().all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=IDS.get)
@pytest.mark.parametrize("lq,lk", [(4100, 4100), (4096, 4500), (4300, 4096)], ids=str)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_widest_query_tiles(dtype, lq, lk, causal):
    # From 4096 queries on, fp32 products take 256-row tiles (bf16 inputs too, unless the CPU has
    # bf16 matrix instructions: then 128): a ragged last tile, Lq != Lk both ways, GQA, Dv != D,
    # and a NaN in a value row that only the last rows see.
    q, k, v = make_qkv(1, 2, 1, lq, lk, 64, 80, dtype=dtype, seed=lq + lk)
    rows = _tile_rows(q, k, v, causal=causal)
    assert rows == 256 if dtype == torch.float32 else rows in (128, 256)
    out, lse = sparse_attn.flash_attention(q, k, v, causal=causal, return_lse=True)
    check_attention(out, lse, q, k, v, causal=causal)
    if causal:
        v[0, 0, lk - 50] = float("nan")  # inside the last diagonal tile
        out = sparse_attn.flash_attention(q, k, v, causal=True)
        seen = lq - 50  # the first row that sees key lk - 50 (bottom-right aligned)
        assert not out[0, :, :seen].isnan().any() and out[0, :, seen:].isnan().all()


def _tile_rows(q, k, v, **kw):
    launches = sparse_attn.explain(sparse_attn.flash_attention, q, k, v, **kw).launches
    return launches[0].tile[0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=IDS.get)
@pytest.mark.parametrize("d,dv", [(64, 64), (48, 80)], ids=str)
def test_odd_row_strides_of_keys_and_values(dtype, d, dv):
    # Keys and values whose rows start at odd element offsets (slices of wider rows): the key tile's
    # transposition and the value pairs read each row from its own address, not in 32-bit steps of
    # a contiguous block; 300 keys end in a ragged tile.
    q, _, _ = make_qkv(1, 4, 2, 130, 300, d, dv, dtype=dtype, seed=11)
    gen = torch.Generator().manual_seed(12)
    k = torch.randn(1, 2, 300, d + 1, generator=gen).to(dtype)[..., 1:]
    v = torch.randn(1, 2, 300, dv + 3, generator=gen).to(dtype)[..., 3:]
    assert k.stride(2) % 2 == 1 and v.stride(2) % 2 == 1
    out, lse = sparse_attn.flash_attention(q, k, v, causal=True, return_lse=True)
    check_attention(out, lse, q, k, v, causal=True)
    assert torch.equal(out, sparse_attn.flash_attention(q, k.contiguous(), v.contiguous(), causal=True))


@pytest.mark.parametrize("layout", ["blhd", "expanded"])
def test_fp32_values_read_in_place_or_copied(layout):
    # fp32 values feed the P V product where they lie (row stride H * Dv in a (B, L, H, D) tensor);
    # a row stride below Dv (values expanded along L) takes the copied path. Both equal the
    # contiguous call bit for bit, and a NaN value stays with the rows that see it.
    q, k, v = make_qkv(1, 4, 2, 300, 333, 64, 80, dtype=torch.float32, seed=21, layout="blhd")
    if layout == "expanded":
        v = v[:, :, :1].expand(-1, -1, 333, -1)
        assert v.stride(2) == 0
    else:
        assert v.stride(2) == 2 * 80
    out, lse = sparse_attn.flash_attention(q, k, v, causal=True, return_lse=True)
    check_attention(out, lse, q, k, v, causal=True)
    assert torch.equal(out, sparse_attn.flash_attention(q, k, v.contiguous(), causal=True))
    v = v.clone() if layout == "expanded" else v
    v[0, 1, 200, 5] = float("nan")
    out = sparse_attn.flash_attention(q, k, v, causal=True)
    seen = 300 - 133  # the first row that sees key 200 (bottom-right aligned)
    assert not out[0, 2:4, :seen].isnan().any() and out[0, 2:4, seen:, 5].isnan().all()
    assert not out[0, :2].isnan().any() and not out[..., [4, 6]].isnan().any()


_GENERIC_SCRIPT = """
import sys, torch, sparse_attn
torch.manual_seed(0)
q, k = torch.randn(2, 3, 300, 64), torch.randn(2, 3, 700, 64)
k[..., :50, :] = k[..., 50:100, :]  # equal scores: ties between keys 0-49 and 50-99
q[0, 0, 5] = float('nan')
k[1, 2, 7] = float('inf')
idx = torch.ops.sparse_attn.topk_select(q, k, 37, True)
qb, kb, vb = (torch.randn(1, 2, 600, 64).bfloat16() for _ in range(3))
out = sparse_attn.flash_attention(qb, kb, vb, causal=True)
# fp32 key tiles transposed (16 x 16 words, then a ragged tile) from rows of odd stride, head dims
# 48 and 80, a NaN value
qf = torch.randn(1, 2, 200, 48)
kf = torch.randn(1, 2, 333, 49)[..., 1:]
vf = torch.randn(1, 2, 333, 81)[..., 1:]
vf[0, 1, 100, 3] = float('nan')
outf = sparse_attn.flash_attention(qf, kf, vf, causal=True)
torch.save((idx, out, outf), sys.argv[1])
"""


def test_avx512_and_generic_loops_agree(tmp_path):
    """The AVX-512 loops (selection, bf16 softmax, key tile transposition and value packing) and the
    portable ones (SPARSE_ATTN_CPU_GENERIC=1, as on a CPU without AVX-512) give the same selection,
    ties and NaN included, and the same attention up to rounding (bf16 and fp32)."""
    import os
    import subprocess
    import sys

    results = []
    for generic in ("0", "1"):
        path = tmp_path / f"r{generic}.pt"
        env = dict(os.environ, SPARSE_ATTN_CPU_GENERIC=generic)
        subprocess.run([sys.executable, "-c", _GENERIC_SCRIPT, str(path)], check=True, env=env)
        results.append(torch.load(path))
    (idx_a, out_a, f32_a), (idx_b, out_b, f32_b) = results
    assert torch.equal(idx_a, idx_b)
    assert (out_a.float() - out_b.float()).abs().max().item() <= 2e-2
    assert torch.equal(f32_a.isnan(), f32_b.isnan()) and f32_a.isnan().any()
    assert (f32_a.nan_to_num() - f32_b.nan_to_num()).abs().max().item() <= 1e-5
