"""dense_attention and flash_attention against the fp64 reference (the tolerance rule of
docs/ARCHITECTURE.md, "Testing rules"), plus the edge cases, canaries and CUDA stress tests listed there."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from utils import check_attention, check_close, make_qkv

import sparse_attn
from sparse_attn import reference

OPS = {"dense": sparse_attn.dense_attention, "flash": sparse_attn.flash_attention}
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# (B, H, Hkv)
HEADS = {"1x1": (1, 1, 1), "2x3-mha": (2, 3, 3), "2x4-gqa": (2, 4, 2), "2x3-mqa": (2, 3, 1)}
SHAPES = [(1, 1), (1, 17), (17, 1), (127, 129), (129, 127)]
DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


def _case_id(value):
    if isinstance(value, torch.dtype):
        return DTYPE_NAMES[value]
    if isinstance(value, bool):
        return "causal" if value else "full"
    if isinstance(value, tuple):
        return "x".join(str(x) for x in value)
    return str(value)


def _tiered(axes, inner):
    """The full product of ``axes`` (a dict name -> values) as pytest params. The smoke tier keeps,
    for each combination of the outer axes, one combination of the ``inner`` trailing axes, rotating
    through them from one outer combination to the next; the rest is marked ``slow``
    (``-m "not slow"`` leaves it out)."""
    names = list(axes)
    outer = [axes[n] for n in names[: len(names) - inner]]
    inner_values = list(itertools.product(*(axes[n] for n in names[len(names) - inner :])))
    params = []
    for j, head in enumerate(itertools.product(*outer)):
        for i, tail in enumerate(inner_values):
            row = head + tail
            marks = () if i == j % len(inner_values) else (pytest.mark.slow,)
            ids = [f"d{x}" if n == "d" else _case_id(x) for n, x in zip(names, row, strict=True)]
            params.append(pytest.param(*row, marks=marks, id="-".join(ids)))
    return params


def _run(op, q, k, v, **kwargs):
    """Call the op with return_lse=True and check the output contract (shape, dtype, layout)."""
    out, lse = OPS[op](q, k, v, return_lse=True, **kwargs)
    b, h, lq, _ = q.shape
    assert out.shape == (b, h, lq, v.shape[-1])
    assert out.dtype == q.dtype and out.device == q.device
    assert out.transpose(1, 2).is_contiguous(), "out must be stored (B, Lq, H, Dv)-contiguous"
    assert lse.shape == (b, h, lq) and lse.dtype == torch.float32 and lse.device == q.device
    return out, lse


def _window_mask(lq, lk, left, right, device):
    """Element mask of the window predicate i + off - left <= j <= i + off + right, off = Lk - Lq."""
    off = lk - lq
    i = torch.arange(lq, device=device)[:, None]
    j = torch.arange(lk, device=device)[None, :]
    mask = torch.ones(lq, lk, dtype=torch.bool, device=device)
    if left is not None:
        mask &= i + off - left <= j
    if right is not None:
        mask &= j <= i + off + right
    return mask


# ---------------------------------------------------------------------------------------------
# The main matrix


@pytest.mark.parametrize(
    "op,dtype,d,causal,shape,heads",
    _tiered(
        {
            "op": list(OPS),
            "dtype": DTYPES,
            "d": [64, 128, 256],
            "causal": [False, True],
            "shape": SHAPES,
            "heads": list(HEADS),
        },
        inner=1,
    ),
)
def test_matches_reference(op, dtype, d, causal, shape, heads, device):
    lq, lk = shape
    b, h, hkv = HEADS[heads]
    q, k, v = make_qkv(b, h, hkv, lq, lk, d, dtype=dtype, device=device, seed=lq * 1000 + lk + d)
    out, lse = _run(op, q, k, v, causal=causal)
    check_attention(out, lse, q, k, v, causal=causal, name=f"{op} out")


@pytest.mark.parametrize(
    "op,dtype,d,causal,shape",
    _tiered(
        {
            "op": list(OPS),
            "dtype": DTYPES,
            "d": [40, 96],
            "causal": [False, True],
            "shape": [(17, 1), (127, 129), (129, 127)],
        },
        inner=1,
    ),
)
def test_unaligned_head_dims(op, dtype, d, causal, shape, device):
    lq, lk = shape
    q, k, v = make_qkv(2, 4, 2, lq, lk, d, dtype=dtype, device=device, seed=d)
    out, lse = _run(op, q, k, v, causal=causal)
    check_attention(out, lse, q, k, v, causal=causal, name=f"{op} d={d}")


@pytest.mark.parametrize(
    "op,dtype,causal",
    _tiered({"op": list(OPS), "dtype": [torch.bfloat16, torch.float32], "causal": [True, False]}, inner=2),
)
def test_long_square(op, dtype, causal, device):
    q, k, v = make_qkv(1, 2, 1, 1000, 1000, 64, dtype=dtype, device=device, seed=1000)
    out, lse = _run(op, q, k, v, causal=causal)
    check_attention(out, lse, q, k, v, causal=causal, name=f"{op} 1000x1000")


@pytest.mark.parametrize("heads", ["1x1", "2x4-gqa"])
@pytest.mark.parametrize("dtype", DTYPES, ids=_case_id)
@pytest.mark.parametrize("op", list(OPS))
def test_causal_more_queries_than_keys_gives_empty_rows(op, dtype, heads, device):
    # Lq=300, Lk=100, bottom-right causal: queries 0..199 see no key (0, LSE -inf).
    b, h, hkv = HEADS[heads]
    q, k, v = make_qkv(b, h, hkv, 300, 100, 64, dtype=dtype, device=device, seed=300)
    out, lse = _run(op, q, k, v, causal=True)
    check_attention(out, lse, q, k, v, causal=True, name=f"{op} 300x100")
    assert (out[:, :, :200] == 0).all()
    assert torch.isneginf(lse[:, :, :200]).all()
    assert torch.isfinite(lse[:, :, 200:]).all()


# ---------------------------------------------------------------------------------------------
# Strides


@pytest.mark.parametrize("strides", ["blhd", "seq-slice", "blhd+seq-slice"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=_case_id)
@pytest.mark.parametrize("op", list(OPS))
def test_strided_inputs(op, dtype, causal, strides, device):
    lq, lk = 77, 93
    layout = "blhd" if strides.startswith("blhd") else "bhld"
    sliced = strides.endswith("seq-slice")
    n_q, n_k = (2 * lq, 2 * lk) if sliced else (lq, lk)
    q, k, v = make_qkv(2, 4, 2, n_q, n_k, 64, dtype=dtype, device=device, seed=5, layout=layout)
    if sliced:  # every other position, starting at 1: a storage offset and a row stride of 2 rows
        q, k, v = q[:, :, 1::2], k[:, :, 1::2], v[:, :, 1::2]
    assert not q.is_contiguous() and q.stride(-1) == 1
    out, lse = _run(op, q, k, v, causal=causal)
    check_attention(out, lse, q, k, v, causal=causal, name=f"{op} {strides}")


@pytest.mark.parametrize("op", list(OPS))
def test_batch_offsets_past_2_31_elements(op, device):
    # Batch 1 starts 2^31 + 64 elements into the storage, so its offset needs 64-bit index math.
    # The storage is allocated but only the two slices in use are written (q, k and v share them).
    d, lq = 64, 8
    stride_b = 2**31 + 64
    base = torch.empty(stride_b + lq * d, dtype=torch.bfloat16, device=device)
    q = base.as_strided((2, 1, lq, d), (stride_b, lq * d, d, 1))
    q.copy_(make_qkv(2, 1, 1, lq, lq, d, dtype=torch.bfloat16, device=device, seed=31)[0])
    out, lse = _run(op, q, q, q)
    check_attention(out, lse, q, q, q, name=f"{op} 2^31 offset")


# ---------------------------------------------------------------------------------------------
# Windows (flash_attention)

WINDOWS = [0, 7, (0, 0), (3, 5), (None, 2), (4, None), (0, None), (None, 0), (None, None), (200, 200)]
WINDOW_SHAPES = [(1, 17), (37, 53), (53, 37), (129, 127), (200, 200)]


@pytest.mark.parametrize(
    "shape,window,dtype,causal",
    _tiered(
        {
            "shape": WINDOW_SHAPES,
            "window": WINDOWS,
            "dtype": [torch.bfloat16, torch.float32],
            "causal": [False, True],
        },
        inner=2,
    ),
)
def test_window(dtype, causal, shape, window, device):
    lq, lk = shape
    left, right = (window, window) if isinstance(window, int) else window
    q, k, v = make_qkv(1, 4, 2, lq, lk, 64, dtype=dtype, device=device, seed=lq + lk)
    out, lse = _run("flash", q, k, v, causal=causal, window=window)
    mask = _window_mask(lq, lk, left, right, device)
    check_attention(out, lse, q, k, v, mask=mask, causal=causal, name=f"flash window={window}")


def test_window_rows_whose_first_tiles_are_empty(device):
    # A narrow band far from the diagonal: every row's visible keys sit in one late tile, so the
    # online softmax starts from tiles that are empty for the row (a finite sentinel max would
    # turn them into exp(huge) * 0 = NaN).
    lq, lk = 64, 1000
    q, k, v = make_qkv(1, 2, 2, lq, lk, 64, dtype=torch.bfloat16, device=device, seed=24)
    out, lse = _run("flash", q, k, v, window=(3, 1))
    mask = _window_mask(lq, lk, 3, 1, device)
    check_attention(out, lse, q, k, v, mask=mask, name="flash narrow window")


# ---------------------------------------------------------------------------------------------
# dense_attention's attn_mask


def _mask_shape(kind, b, h, lq, lk):
    return {
        "lq_lk": (lq, lk),
        "1_1_lq_lk": (1, 1, lq, lk),
        "b_1_1_lk": (b, 1, 1, lk),
        "b_h_lq_lk": (b, h, lq, lk),
    }[kind]


def _additive_reference(q, k, v, bias, dtype):
    """softmax(scale * Q K^T + bias) V in ``dtype`` (bias broadcast to (B, H, Lq, Lk)); returns (out, lse)."""
    q, k, v = (t.to(dtype) for t in (q, k, v))
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
    s = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5 + bias.to(dtype)
    lse = torch.logsumexp(s, dim=-1)
    return torch.exp(s - lse.unsqueeze(-1)).nan_to_num(0.0) @ v, lse


@pytest.mark.parametrize("kind", ["lq_lk", "1_1_lq_lk", "b_1_1_lk", "b_h_lq_lk"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", DTYPES, ids=_case_id)
def test_dense_bool_mask(dtype, causal, kind, device):
    b, h, hkv, lq, lk = 2, 4, 2, 33, 70
    q, k, v = make_qkv(b, h, hkv, lq, lk, 64, dtype=dtype, device=device, seed=41)
    g = torch.Generator().manual_seed(42)
    mask = (torch.rand(_mask_shape(kind, b, h, lq, lk), generator=g) < 0.5).to(device)
    if mask.shape[-2] == lq:
        mask[..., 3, :] = False  # one fully masked query row
    out, lse = _run("dense", q, k, v, attn_mask=mask, causal=causal)
    check_attention(out, lse, q, k, v, mask=mask, causal=causal, name=f"dense bool mask {kind}")


@pytest.mark.parametrize("kind", ["lq_lk", "1_1_lq_lk", "b_1_1_lk", "b_h_lq_lk"])
@pytest.mark.parametrize("dtype", DTYPES, ids=_case_id)
def test_dense_additive_mask(dtype, kind, device):
    b, h, hkv, lq, lk = 2, 4, 2, 33, 70
    q, k, v = make_qkv(b, h, hkv, lq, lk, 64, dtype=dtype, device=device, seed=43)
    g = torch.Generator().manual_seed(44)
    bias = (2 * torch.randn(_mask_shape(kind, b, h, lq, lk), generator=g)).to(dtype).to(device)
    gold, gold_lse = _additive_reference(q, k, v, bias, torch.float64)
    with sdpa_kernel(SDPBackend.MATH):  # the reference itself, checked against SDPA
        sdpa = F.scaled_dot_product_attention(
            q.double(), k.double(), v.double(), attn_mask=bias.double(), enable_gqa=True
        )
    torch.testing.assert_close(gold, sdpa, atol=1e-12, rtol=1e-10)
    lp, _ = _additive_reference(q, k, v, bias, dtype)
    out, lse = _run("dense", q, k, v, attn_mask=bias)
    check_close(f"dense additive mask {kind}", out, gold, lp, dtype=dtype)
    torch.testing.assert_close(lse.double(), gold_lse, atol=2e-3, rtol=2e-3)


def test_dense_additive_mask_with_neg_inf(device):
    # -inf entries hide keys; a row of -inf is fully masked: 0 and LSE -inf, no NaN.
    q, k, v = make_qkv(1, 2, 2, 9, 12, 64, dtype=torch.bfloat16, device=device, seed=45)
    bias = torch.zeros(9, 12, device=device)
    bias[:, 5:] = float("-inf")
    bias[4] = float("-inf")
    out, lse = _run("dense", q, k, v, attn_mask=bias)
    check_attention(out, lse, q, k, v, mask=torch.isfinite(bias), name="dense -inf bias")
    assert (out[:, :, 4] == 0).all() and torch.isneginf(lse[:, :, 4]).all()


# ---------------------------------------------------------------------------------------------
# Scale, LSE, empty and degenerate sizes


@pytest.mark.parametrize("scale", [0.0, -0.5, 0.3])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", DTYPES, ids=_case_id)
@pytest.mark.parametrize("op", list(OPS))
def test_custom_scale(op, dtype, causal, scale, device):
    q, k, v = make_qkv(2, 4, 2, 45, 61, 64, dtype=dtype, device=device, seed=28)
    out, lse = _run(op, q, k, v, causal=causal, scale=scale)
    check_attention(out, lse, q, k, v, causal=causal, scale=scale, name=f"{op} scale={scale}")


@pytest.mark.parametrize("op", list(OPS))
def test_scale_zero_is_uniform_attention(op, device):
    lq, lk = 5, 9
    q, k, v = make_qkv(1, 1, 1, lq, lk, 64, dtype=torch.float32, device=device, seed=29)
    out, lse = _run(op, q, k, v, causal=True, scale=0.0)
    visible = torch.arange(lq, device=device) + (lk - lq) + 1
    torch.testing.assert_close(lse[0, 0], visible.float().log())
    means = torch.stack([v[0, 0, :n].mean(0) for n in visible.tolist()])
    torch.testing.assert_close(out[0, 0], means)


@pytest.mark.parametrize("op", list(OPS))
def test_default_scale_is_inverse_sqrt_d(op, device):
    q, k, v = make_qkv(1, 2, 2, 20, 30, 96, dtype=torch.float32, device=device, seed=30)
    assert torch.equal(OPS[op](q, k, v), OPS[op](q, k, v, scale=1 / math.sqrt(96)))


@pytest.mark.parametrize(
    "b,h,hkv,lq,lk",
    [(0, 2, 2, 5, 7), (2, 0, 0, 5, 7), (2, 2, 1, 0, 7), (2, 2, 1, 0, 0)],
    ids=["B=0", "H=0", "Lq=0", "Lq=Lk=0"],
)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("op", list(OPS))
def test_empty_sizes(op, causal, b, h, hkv, lq, lk, device):
    q, k, v = make_qkv(b, h, hkv, lq, lk, 64, dtype=torch.bfloat16, device=device)
    out, lse = _run(op, q, k, v, causal=causal)
    assert out.numel() == 0 and lse.numel() == 0


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", DTYPES, ids=_case_id)
@pytest.mark.parametrize("op", list(OPS))
def test_no_keys_gives_zeros_and_neg_inf(op, dtype, causal, device):
    q, k, v = make_qkv(2, 4, 2, 5, 0, 64, dtype=dtype, device=device)
    out, lse = _run(op, q, k, v, causal=causal)
    assert (out == 0).all() and not torch.isnan(out).any()
    assert torch.isneginf(lse).all()


@pytest.mark.parametrize("d,dv", [(64, 32), (32, 64), (128, 40)])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", DTYPES, ids=_case_id)
@pytest.mark.parametrize("op", list(OPS))
def test_value_head_dim_differs_cpu(op, dtype, causal, d, dv):
    # The CUDA tensor-core kernels require Dv == D; the CPU path must not.
    q, k, v = make_qkv(2, 4, 2, 70, 90, d, dv, dtype=dtype, seed=d + dv)
    out, lse = _run(op, q, k, v, causal=causal)
    check_attention(out, lse, q, k, v, causal=causal, name=f"{op} D={d} Dv={dv}")


# ---------------------------------------------------------------------------------------------
# Canaries and numeric definitions




def _poison_allocator(device, *shapes):
    """Leave NaN-filled freed memory behind for the next allocations (fla #892)."""
    if device == "cpu":
        # Freeing a 16 MiB mmapped block raises glibc's mmap threshold, so the NaN blocks below
        # come from (and return to) the heap, where the op's outputs are then carved from.
        torch.empty(1 << 22)
    for shape in (*shapes, (1 << 20,)):
        torch.full(shape, float("nan"), dtype=torch.float32, device=device)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=_case_id)
@pytest.mark.parametrize("op", list(OPS))
def test_allocator_poison_canary(op, dtype, device):
    # Lq > Lk causal: 200 of the 300 rows see no key, and must still be written (0 / -inf).
    b, h, hkv, lq, lk, d = 2, 4, 2, 300, 100, 64
    q, k, v = make_qkv(b, h, hkv, lq, lk, d, dtype=dtype, device=device, seed=29)
    _poison_allocator(device, (b * h * lq * d,), (b * h * lq,), (b * h * lq * lk,))
    out, lse = _run(op, q, k, v, causal=True)
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    check_attention(out, lse, q, k, v, causal=True, name=f"{op} after poison")


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("op", list(OPS))
def test_nan_query_row_propagates_to_that_row_only(op, causal, device, request):
    q, k, v = make_qkv(2, 4, 2, 37, 53, 64, dtype=torch.bfloat16, device=device, seed=25)
    clean_out, clean_lse = _run(op, q, k, v, causal=causal)
    q = q.clone()
    q[1, 2, 20, 5] = float("nan")
    out, lse = _run(op, q, k, v, causal=causal)
    assert torch.isnan(out[1, 2, 20]).all() and torch.isnan(lse[1, 2, 20])
    others = torch.ones(out.shape[:3], dtype=torch.bool, device=device)
    others[1, 2, 20] = False
    assert torch.equal(out[others], clean_out[others])
    assert torch.equal(lse[others], clean_lse[others])


@pytest.mark.parametrize("op", list(OPS))
def test_nan_key_propagates_to_the_heads_that_read_it(op, device):
    q, k, v = make_qkv(1, 4, 2, 20, 30, 64, dtype=torch.float32, device=device, seed=26)
    clean_out = OPS[op](q, k, v)
    k = k.clone()
    k[0, 1, 11, 0] = float("nan")  # kv head 1 serves query heads 2 and 3
    out = OPS[op](q, k, v)
    assert torch.isnan(out[:, 2:]).all()
    assert torch.equal(out[:, :2], clean_out[:, :2])


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize(
    "dtype,mult", [(torch.bfloat16, 100.0), (torch.float16, 256.0)], ids=["bf16x100", "fp16x256"]
)
@pytest.mark.parametrize("op", list(OPS))
def test_large_magnitudes_stay_finite(op, dtype, mult, causal, device):
    # Q K^T far beyond fp16's range: scores and softmax must be fp32.
    q, k, v = make_qkv(2, 4, 2, 65, 65, 64, dtype=dtype, device=device, seed=27)
    q, k = q * mult, k * mult
    out, lse = _run(op, q, k, v, causal=causal)
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    check_attention(out, lse, q, k, v, causal=causal, name=f"{op} x{mult}")


@pytest.mark.parametrize("op", list(OPS))
def test_large_constant_bf16(op, device, request):
    # PyTorch's test_flash_attention_large_bf16_nan_values: every input 133120 gives exactly 133120.
    q = torch.full((1, 2, 32, 64), 133120.0, dtype=torch.bfloat16, device=device)
    out, lse = _run(op, q, q, q)
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    assert (out == 133120.0).all()


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", DTYPES, ids=_case_id)
@pytest.mark.parametrize("op", list(OPS))
def test_forward_is_deterministic(op, dtype, causal, device):
    q, k, v = make_qkv(2, 4, 2, 129, 127, 64, dtype=dtype, device=device, seed=30)
    out1, lse1 = _run(op, q, k, v, causal=causal)
    out2, lse2 = _run(op, q, k, v, causal=causal)
    assert torch.equal(out1, out2) and torch.equal(lse1, lse2)


@pytest.mark.parametrize("lq,lk", [(1, 1), (17, 1), (127, 129), (300, 100)])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", DTYPES, ids=_case_id)
def test_dense_equals_flash(dtype, causal, lq, lk, device):
    q, k, v = make_qkv(2, 4, 2, lq, lk, 64, dtype=dtype, device=device, seed=lq + lk)
    dense, dense_lse = _run("dense", q, k, v, causal=causal)
    flash, flash_lse = _run("flash", q, k, v, causal=causal)
    # Measured against dense (as the gold), flash may err at most twice what the same math in
    # `dtype` errs: the two agree to within the low-precision rounding.
    lp, _ = reference.attention(q, k, v, causal=causal, dtype=dtype)
    check_close("flash vs dense", flash, dense, lp, dtype=dtype)
    assert torch.equal(torch.isneginf(dense_lse), torch.isneginf(flash_lse))
    finite = torch.isfinite(dense_lse)
    torch.testing.assert_close(flash_lse[finite], dense_lse[finite], atol=1e-3, rtol=1e-3)


# ---------------------------------------------------------------------------------------------
# CUDA only


@pytest.mark.cuda
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("op", list(OPS))
def test_cuda_repeat_100_is_bitwise_deterministic(op, causal):
    q, k, v = make_qkv(64, 4, 2, 96, 96, 64, dtype=torch.bfloat16, device="cuda", seed=100)
    out0, lse0 = _run(op, q, k, v, causal=causal)
    for _ in range(100):
        out, lse = OPS[op](q, k, v, causal=causal, return_lse=True)
        assert torch.equal(out, out0) and torch.equal(lse, lse0)


@pytest.mark.cuda
@pytest.mark.parametrize("op", list(OPS))
def test_cuda_graph_capture_and_replay(op):
    q, k, v = make_qkv(2, 4, 2, 200, 200, 64, dtype=torch.bfloat16, device="cuda", seed=6)

    def call():
        return OPS[op](q, k, v, causal=True, return_lse=True)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            call()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, lse = call()
    for new_seed in (None, 7):
        if new_seed is not None:  # new inputs, written in place into the captured buffers
            nq, nk, nv = make_qkv(2, 4, 2, 200, 200, 64, dtype=torch.bfloat16, device="cuda", seed=new_seed)
            q.copy_(nq)
            k.copy_(nk)
            v.copy_(nv)
        out.fill_(float("nan"))
        lse.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        eager_out, eager_lse = call()
        assert torch.equal(out, eager_out) and torch.equal(lse, eager_lse)
        check_attention(out, lse, q, k, v, causal=True, name=f"{op} graph replay")


@pytest.mark.cuda
@pytest.mark.parametrize("op", list(OPS))
def test_cuda_runs_on_the_current_stream(op):
    src = make_qkv(4, 4, 2, 256, 256, 64, dtype=torch.bfloat16, device="cuda", seed=8)
    dst = [torch.zeros_like(t) for t in src]
    producer, consumer = torch.cuda.Stream(), torch.cuda.Stream()
    torch.cuda.synchronize()
    with torch.cuda.stream(producer):
        torch.cuda._sleep(50_000_000)  # the copies land long after the op would run unordered
        for d, s in zip(dst, src, strict=True):
            d.copy_(s)
    consumer.wait_stream(producer)
    with torch.cuda.stream(consumer):
        out, lse = OPS[op](*dst, return_lse=True)
    torch.cuda.synchronize()
    check_attention(out, lse, *src, name=f"{op} two streams")


@pytest.mark.cuda
@pytest.mark.parametrize("op", list(OPS))
def test_cuda_no_memory_leak(op):
    q, k, v = make_qkv(2, 4, 2, 300, 300, 64, dtype=torch.bfloat16, device="cuda", seed=9)
    OPS[op](q, k, v, causal=True, return_lse=True)
    torch.cuda.synchronize()
    baseline = torch.cuda.memory_allocated()
    for _ in range(100):
        out, lse = OPS[op](q, k, v, causal=True, return_lse=True)
        del out, lse
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() == baseline


@pytest.mark.cuda
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_cuda_flash_peak_memory_is_linear(causal):
    b, h, l, d = 1, 8, 8192, 128
    q, k, v = make_qkv(b, h, h, l, l, d, dtype=torch.bfloat16, device="cuda", seed=10)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    out, lse = sparse_attn.flash_attention(q, k, v, causal=causal, return_lse=True)
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - before
    needed = out.numel() * out.element_size() + lse.numel() * lse.element_size()
    # An (L, L) score matrix would be 8 * 8192^2 * 4 bytes = 2 GiB; output + LSE is ~16 MiB.
    assert extra <= 1.25 * needed, f"peak extra memory {extra} bytes, output + LSE {needed} bytes"
    assert torch.isfinite(out).all()


@pytest.mark.cuda
@pytest.mark.parametrize("op", list(OPS))
def test_cuda_second_device(op):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    # The current device stays cuda:0: the op must guard the device of its inputs.
    q, k, v = make_qkv(2, 4, 2, 130, 130, 64, dtype=torch.bfloat16, device="cuda:1", seed=11)
    out, lse = _run(op, q, k, v, causal=True)
    assert out.device == torch.device("cuda:1") and lse.device == torch.device("cuda:1")
    torch.cuda.synchronize(1)
    check_attention(out, lse, q, k, v, causal=True, name=f"{op} cuda:1")
