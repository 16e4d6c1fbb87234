"""Bad inputs (docs/ARCHITECTURE.md, "Testing rules"): every public op raises a Python exception whose
message names the argument, before any kernel runs. Each raise has a positive control at the
boundary, and a valid call in the same test afterwards still gives a correct result (no sticky
error state)."""

from __future__ import annotations

import pytest
import torch
from utils import block_kernel_mask, check_attention, check_close, make_qkv

import sparse_attn
from sparse_attn import BlockSparseMask, patterns, reference

ERRORS = (RuntimeError, ValueError, TypeError)
# "topk_block" is topk_attention's block mode: its selection runs in Python before the kernel,
# so it gets its own row.
OPS = ["dense", "flash", "block_sparse", "topk", "topk_block"]
B, H, HKV, L, D = 2, 4, 2, 64, 64
DTYPE = torch.bfloat16



def _table(rows):
    """parametrize rows (name, *values...) with the name as the test id."""
    return [pytest.param(*row, id=row[0]) for row in rows]


def _call(op, q, k, v, *, lengths=(L, L), **kwargs):
    """Call a public op; block_sparse gets a causal mask built for ``lengths``, as a plain mask
    (the block-sparse kernel's checks; patterns.causal's own mask runs as flash_attention)."""
    if op == "dense":
        return sparse_attn.dense_attention(q, k, v, **kwargs)
    if op == "flash":
        return sparse_attn.flash_attention(q, k, v, **kwargs)
    if op == "block_sparse":
        return sparse_attn.block_sparse_attention(
            q, k, v, block_kernel_mask(patterns.causal(*lengths, device=q.device)), **kwargs
        )
    if op == "topk":
        return sparse_attn.topk_attention(q, k, v, kwargs.pop("k", 8), **kwargs)
    if op == "topk_block":
        return sparse_attn.topk_attention(q, k, v, kwargs.pop("k", 1), block_size=64, **kwargs)
    raise AssertionError(op)


def _check_valid(op, q, k, v, **kwargs):
    """Run ``op`` on valid inputs and check the result against the reference."""
    if op == "topk":
        out, lse, idx = _call(op, q, k, v, return_lse=True, return_indices=True, **kwargs)
        assert idx.dtype == torch.int32 and idx.shape[:3] == (q.shape[0], q.shape[1], q.shape[2])
        gold, _ = reference.gather_attention(q, k, v, idx, scale=kwargs.get("scale"))
        lp, _ = reference.gather_attention(q, k, v, idx, scale=kwargs.get("scale"), dtype=q.dtype)
        check_close("topk", out, gold, lp, dtype=q.dtype)
        return out
    out, lse = _call(op, q, k, v, return_lse=True, **kwargs)
    # block_sparse runs a causal mask; topk_block with k >= the number of key blocks is dense.
    check_attention(out, lse, q, k, v, causal=op == "block_sparse", scale=kwargs.get("scale"), name=op)
    return out


def _valid(op, device, *, h=H, hkv=HKV, d=D, dtype=DTYPE):
    """A valid call on fresh inputs after a rejected one: the process is still in a good state."""
    q, k, v = make_qkv(B, h, hkv, L, L, d, dtype=dtype, device=device, seed=123)
    return _check_valid(op, q, k, v)


def _qkv(device, q=(B, H, L, D), k=(B, HKV, L, D), v=(B, HKV, L, D), dtypes=(DTYPE,) * 3):
    g = torch.Generator().manual_seed(0)

    def make(shape, dtype):
        if not dtype.is_floating_point:
            return torch.randint(-3, 3, shape, generator=g).to(dtype).to(device)
        return torch.randn(shape, generator=g).to(dtype).to(device)

    return make(q, dtypes[0]), make(k, dtypes[1]), make(v, dtypes[2])


# ---------------------------------------------------------------------------------------------
# query / key / value shapes

RANK_CASES = {
    "q1d": ({"q": (D,)}, r"query must be 4-D"),
    "q3d": ({"q": (B * H, L, D)}, r"query must be 4-D"),
    "k1d": ({"k": (D,)}, r"key must be 4-D"),
    "k3d": ({"k": (B * HKV, L, D)}, r"key must be 4-D"),
    "v3d": ({"v": (B * HKV, L, D)}, r"value must be 4-D"),
    "v5d": ({"v": (1, B, HKV, L, D)}, r"value must be 4-D"),
}


@pytest.mark.parametrize("case", list(RANK_CASES))
@pytest.mark.parametrize("op", OPS)
def test_wrong_rank(op, case, device):
    match = RANK_CASES[case][1]
    q, k, v = _qkv(device, **RANK_CASES[case][0])
    with pytest.raises(ERRORS, match=match):
        _call(op, q, k, v)
    _valid(op, device)


SHAPE_CASES = {
    "batch-k": ({"k": (B + 1, HKV, L, D)}, r"same batch size"),
    "batch-v": ({"v": (1, HKV, L, D)}, r"same batch size"),
    "kv-length": ({"v": (B, HKV, L - 8, D)}, r"key and value must have the same sequence length"),
    "kv-heads": ({"v": (B, 1, L, D)}, r"key and value must have the same number of heads"),
    "qk-head-dim": ({"k": (B, HKV, L, D // 2)}, r"query and key must have the same head dimension"),
    "h-not-multiple": (
        {"q": (B, 3, L, D)},
        r"number of query heads \(3\) must be a multiple of .*key/value heads \(2\)",
    ),
}


@pytest.mark.parametrize("case", list(SHAPE_CASES))
@pytest.mark.parametrize("op", OPS)
def test_mismatched_shapes(op, case, device):
    q, k, v = _qkv(device, **SHAPE_CASES[case][0])
    with pytest.raises(ERRORS, match=SHAPE_CASES[case][1]):
        _call(op, q, k, v)
    _valid(op, device)


@pytest.mark.parametrize("op", OPS)
def test_gqa_boundary(op, device):
    # H a multiple of Hkv works (MQA and GQA); 6 query heads over 4 key heads does not.
    _valid(op, device, h=6, hkv=1)
    _valid(op, device, h=6, hkv=3)
    q, k, v = _qkv(device, q=(1, 6, L, D), k=(1, 4, L, D), v=(1, 4, L, D))
    with pytest.raises(ERRORS, match=r"must be a multiple of the number of key/value heads"):
        _call(op, q, k, v)
    _valid(op, device)


@pytest.mark.parametrize("d", [0, 4, 59, 111, 264, 512])
@pytest.mark.parametrize("op", OPS)
def test_head_dim_not_supported(op, d, device):
    for good in (8, 256):  # the boundaries work
        _valid(op, device, d=good)
    q, k, v = _qkv(device, q=(B, H, L, d), k=(B, HKV, L, d), v=(B, HKV, L, d))
    with pytest.raises(
        ERRORS, match=r"head dimension of query and key must be a multiple of 8 in \[8, 256\]"
    ):
        _call(op, q, k, v)
    _valid(op, device)


@pytest.mark.parametrize("dv", [59, 264])
@pytest.mark.parametrize("op", OPS)
def test_value_head_dim_not_supported(op, dv, device):
    q, k, v = _qkv(device, v=(B, HKV, L, dv))
    # The CUDA kernels may also require Dv == D; either way the message names the value.
    with pytest.raises(ERRORS, match=r"value"):
        _call(op, q, k, v)
    _valid(op, device)


# ---------------------------------------------------------------------------------------------
# dtypes, strides


@pytest.mark.parametrize(
    "dtype", [torch.float64, torch.int32, torch.int64, torch.bool], ids=["fp64", "int32", "int64", "bool"]
)
@pytest.mark.parametrize("op", OPS)
def test_unsupported_dtype(op, dtype, device):
    q, k, v = _qkv(device, dtypes=(dtype,) * 3)
    with pytest.raises(ERRORS, match=r"query dtype must be float32, bfloat16 or float16"):
        _call(op, q, k, v)
    for good in (torch.float32, torch.float16):
        _valid(op, device, dtype=good)


@pytest.mark.parametrize(
    "dtypes,match",
    [
        ((torch.bfloat16, torch.float16, torch.bfloat16), r"query and key must have the same dtype"),
        ((torch.float16, torch.float32, torch.float32), r"query and key must have the same dtype"),
        ((torch.bfloat16, torch.bfloat16, torch.float16), r"query and value must have the same dtype"),
        ((torch.float32, torch.float32, torch.bfloat16), r"query and value must have the same dtype"),
    ],
    ids=["q-bf16-k-fp16", "q-fp16-k-fp32", "v-fp16", "v-bf16"],
)
@pytest.mark.parametrize("op", OPS)
def test_mixed_dtypes(op, dtypes, match, device):
    q, k, v = _qkv(device, dtypes=dtypes)
    with pytest.raises(ERRORS, match=match):
        _call(op, q, k, v)
    _valid(op, device)


@pytest.mark.parametrize("which", ["query", "key", "value"])
@pytest.mark.parametrize("op", OPS)
def test_last_dim_stride_not_one(op, which, device):
    q, k, v = _qkv(device)  # L == D: the transpose of a (..., L, D) tensor has the same shape
    tensors = {"query": q, "key": k, "value": v}
    bad = dict(tensors)
    bad[which] = tensors[which].transpose(-1, -2)
    assert bad[which].shape == tensors[which].shape and bad[which].stride(-1) != 1
    with pytest.raises(ERRORS, match=rf"{which} must have stride 1 in its last dimension"):
        _call(op, bad["query"], bad["key"], bad["value"])
    # The same values with a unit last stride are accepted and correct.
    fixed = dict(tensors)
    fixed[which] = bad[which].contiguous()
    _check_valid(op, fixed["query"], fixed["key"], fixed["value"])


# ---------------------------------------------------------------------------------------------
# Per-op options


BAD_WINDOWS = {
    "-2": (-2, ValueError, r"window left bound must be a non-negative int or None"),
    "(1,-3)": ((1, -3), ValueError, r"window right bound must be a non-negative int or None"),
    "(-5,None)": ((-5, None), ValueError, r"window left bound"),
    "(True,1)": ((True, 1), ValueError, r"window left bound"),
    "(1.0,2)": ((1.0, 2), ValueError, r"window left bound"),
    "(2,0.5)": ((2, 0.5), ValueError, r"window right bound"),
    "1.5": (1.5, TypeError, r"window must be None, an int or a \(left, right\) pair"),
    "(1,2,3)": ((1, 2, 3), TypeError, r"window must be None, an int or a \(left, right\) pair"),
    "(4,)": ((4,), TypeError, r"window must be None, an int or a \(left, right\) pair"),
}


@pytest.mark.parametrize("case", list(BAD_WINDOWS))
def test_bad_window(case, device):
    window, exc, match = BAD_WINDOWS[case]
    lq, lk = 40, 50
    q, k, v = make_qkv(1, 2, 1, lq, lk, D, device=device, seed=1)
    with pytest.raises(exc, match=match):
        sparse_attn.flash_attention(q, k, v, window=window)
    # Boundary: a zero-width window (the diagonal only) and a one-sided window work.
    i = torch.arange(lq, device=device)[:, None] + (lk - lq)
    j = torch.arange(lk, device=device)[None, :]
    for good, mask in ((0, j == i), ((0, None), j >= i)):
        out, lse = sparse_attn.flash_attention(q, k, v, window=good, return_lse=True)
        check_attention(out, lse, q, k, v, mask=mask, name=f"window={good}")


@pytest.mark.parametrize("arg", ["window_left", "window_right"])
def test_bad_window_raw_op(arg, device):
    q, k, v = make_qkv(1, 2, 2, 16, 16, D, device=device)
    bounds = {"window_left": -1, "window_right": -1, arg: -2}
    with pytest.raises(RuntimeError, match=rf"{arg} must be -1 \(unbounded\) or >= 0"):
        torch.ops.sparse_attn.flash_fwd(q, k, v, None, False, bounds["window_left"], bounds["window_right"])
    out, lse = torch.ops.sparse_attn.flash_fwd(q, k, v, None, False, -1, -1)
    check_attention(out, lse, q, k, v)


BAD_K = {
    "0": (0, ValueError, r"k must be positive, got 0"),
    "-3": (-3, ValueError, r"k must be positive, got -3"),
    "2.0": (2.0, TypeError, r"k must be an int, got float"),
    "True": (True, TypeError, r"k must be an int, got bool"),
    "None": (None, TypeError, r"k must be an int, got NoneType"),
    "'4'": ("4", TypeError, r"k must be an int, got str"),
}


@pytest.mark.parametrize("case", list(BAD_K))
@pytest.mark.parametrize("mode", ["token", "block"])
def test_bad_k(mode, case, device):
    k, exc, match = BAD_K[case]
    q, kk, v = make_qkv(B, H, HKV, L, L, D, device=device, seed=2)
    extra = {"block_size": 64} if mode == "block" else {}
    with pytest.raises(exc, match=match):
        sparse_attn.topk_attention(q, kk, v, k, **extra)
    # k = 1 (the boundary) works: token mode attends to exactly the best key, so out is its value.
    out, idx = sparse_attn.topk_attention(q, kk, v, 1, return_indices=True, **extra)
    if mode == "token":
        assert idx.shape == (B, H, L, 1)
        kv_idx = idx[..., 0].long()
        picked = torch.gather(
            v.repeat_interleave(H // HKV, dim=1), 2, kv_idx[..., None].expand(-1, -1, -1, D)
        )
        assert torch.equal(out, picked)
    # k beyond the number of keys (or key blocks) is clamped: dense attention over all keys.
    out, lse = sparse_attn.topk_attention(q, kk, v, 10 * L, return_lse=True, **extra)
    check_attention(out, lse, q, kk, v, name=f"topk {mode} k > Lk")


def test_bad_k_raw_ops(device):
    q, k, _ = make_qkv(1, 2, 2, 16, 16, D, device=device)
    with pytest.raises(RuntimeError, match=r"k must be positive"):
        torch.ops.sparse_attn.topk_select(q, k, 0, False)
    iq, ik, iw = _indexer_inputs(device, 1, 16, 16)
    with pytest.raises(RuntimeError, match=r"k must be positive"):
        torch.ops.sparse_attn.indexer_select(iq, ik, iw, 0, False)
    assert torch.ops.sparse_attn.topk_select(q, k, 1, False).shape == (1, 2, 16, 1)
    assert torch.ops.sparse_attn.indexer_select(iq, ik, iw, 1, False).shape == (1, 1, 16, 1)


def _indexer_inputs(device, b=B, lq=L, lk=L, hi=2, di=32, dtype=DTYPE):
    g = torch.Generator().manual_seed(3)
    return (
        torch.randn(b, lq, hi, di, generator=g).to(dtype).to(device),
        torch.randn(b, lk, di, generator=g).to(dtype).to(device),
        torch.randn(b, lq, hi, generator=g).to(dtype).to(device),
    )


def _check_indexer_call(device, q, k, v, iq, ik, iw):
    out, lse, idx = sparse_attn.topk_attention(
        q, k, v, 8, index_query=iq, index_key=ik, index_weights=iw, return_lse=True, return_indices=True
    )
    assert idx.shape == (q.shape[0], 1, q.shape[2], 8)
    gold, _ = reference.gather_attention(q, k, v, idx)
    lp, _ = reference.gather_attention(q, k, v, idx, dtype=q.dtype)
    check_close("indexer", out, gold, lp, dtype=q.dtype)


@pytest.mark.parametrize(
    "given,extra,match",
    [
        (("index_query",), {}, r"index_query, index_key and index_weights must be given together"),
        (("index_key",), {}, r"index_query, index_key and index_weights must be given together"),
        (
            ("index_query", "index_key"),
            {},
            r"index_query, index_key and index_weights must be given together",
        ),
        (
            ("index_key", "index_weights"),
            {},
            r"index_query, index_key and index_weights must be given together",
        ),
        (
            ("index_query", "index_key", "index_weights"),
            {"block_size": 64},
            r"cannot be combined with block_size",
        ),
        ((), {"block_size": 32}, r"block_size must be 64 or 128, got 32"),
        ((), {"block_size": 96}, r"block_size must be 64 or 128, got 96"),
    ],
    ids=["q", "k", "q+k", "k+w", "indexer+block_size", "block_size=32", "block_size=96"],
)
def test_mixed_index_arguments(given, extra, match, device):
    q, k, v = make_qkv(B, H, HKV, L, L, D, device=device, seed=4)
    iq, ik, iw = _indexer_inputs(device)
    names = {"index_query": iq, "index_key": ik, "index_weights": iw}
    with pytest.raises(ValueError, match=match):
        sparse_attn.topk_attention(q, k, v, 8, **{n: names[n] for n in given}, **extra)
    _check_indexer_call(device, q, k, v, iq, ik, iw)


@pytest.mark.parametrize(
    "case,match",
    _table(
        [
            ("iq-batch", r"index_query must be \(B, Lq, HI, DI\) with B=2, Lq=64"),
            ("iq-length", r"index_query must be \(B, Lq, HI, DI\) with B=2, Lq=64"),
            ("iq-3d", r"index_query must be 4-D"),
            ("ik-length", r"index_key must be \(B, Lk, DI\) with Lk=64"),
            ("ik-batch", r"index_key must have shape"),
            ("ik-dim", r"index_key must have shape"),
            ("iw-heads", r"index_weights must have shape"),
            ("iw-dtype", r"index_query, index_key and index_weights must have the same dtype"),
            ("float64", r"index_query dtype must be float32, bfloat16 or float16"),
            ("head-dim-20", r"head dimension of index_query and index_key must be a multiple of 8"),
            ("iq-stride", r"index_query must have stride 1 in its last dimension"),
            ("no-heads", r"index_query needs at least one indexer head"),
        ]
    ),
)
def test_bad_indexer_inputs(case, match, device):
    q, k, v = make_qkv(B, H, HKV, L, L, D, device=device, seed=5)
    iq, ik, iw = _indexer_inputs(device)
    bad = {
        "iq-batch": lambda: (_indexer_inputs(device, b=B + 1)[0], ik, iw),
        "iq-length": lambda: (_indexer_inputs(device, lq=L - 1)[0], ik, iw),
        "iq-3d": lambda: (iq[0], ik, iw),
        "ik-length": lambda: (iq, _indexer_inputs(device, lk=L + 1)[1], iw),
        "ik-batch": lambda: (iq, torch.cat([ik, ik]), iw),
        "ik-dim": lambda: (iq, ik[..., :24], iw),
        "iw-heads": lambda: (iq, ik, torch.cat([iw, iw], -1)),
        "iw-dtype": lambda: (iq, ik, iw.half()),
        "float64": lambda: (iq.double(), ik.double(), iw.double()),
        "head-dim-20": lambda: (iq[..., :20], ik[..., :20], iw),
        "iq-stride": lambda: (_strided_index_query(iq), ik, iw),
        "no-heads": lambda: (iq[:, :, :0], ik, iw[:, :, :0]),
    }[case]()
    with pytest.raises(ERRORS, match=match):
        sparse_attn.topk_attention(q, k, v, 8, index_query=bad[0], index_key=bad[1], index_weights=bad[2])
    _check_indexer_call(device, q, k, v, iq, ik, iw)


def _strided_index_query(iq):
    """The values of ``iq`` in a tensor whose last dimension has stride 2."""
    wide = torch.zeros(*iq.shape[:-1], 2 * iq.shape[-1], dtype=iq.dtype, device=iq.device)
    wide[..., ::2] = iq
    return wide[..., ::2]


# ---------------------------------------------------------------------------------------------
# dense_attention's attn_mask


@pytest.mark.parametrize(
    "case,match",
    _table(
        [
            ("int32", r"attn_mask must be bool \(True = attend\) or floating point"),
            ("uint8", r"attn_mask must be bool \(True = attend\) or floating point"),
            ("complex", r"attn_mask must be bool \(True = attend\) or floating point"),
            ("rows+1", r"attn_mask of shape \[65, 64\] cannot be broadcast to \(B, H, Lq, Lk\)"),
            ("cols-1", r"attn_mask of shape \[64, 63\] cannot be broadcast"),
            ("5d", r"attn_mask of shape \[1, 1, 1, 64, 64\] cannot be broadcast"),
            ("batch3", r"attn_mask of shape \[3, 1, 64, 64\] cannot be broadcast"),
            ("heads3", r"attn_mask of shape \[1, 3, 64, 64\] cannot be broadcast"),
        ]
    ),
)
def test_bad_attn_mask(case, match, device):
    q, k, v = make_qkv(B, H, HKV, L, L, D, device=device, seed=6)
    ones = {
        "int32": ((L, L), torch.int32),
        "uint8": ((L, L), torch.uint8),
        "complex": ((L, L), torch.complex64),
        "rows+1": ((L + 1, L), torch.bool),
        "cols-1": ((L, L - 1), torch.bool),
        "5d": ((1, 1, 1, L, L), torch.bool),
        "batch3": ((3, 1, L, L), torch.bool),
        "heads3": ((1, 3, L, L), torch.bool),
    }[case]
    with pytest.raises(RuntimeError, match=match):
        sparse_attn.dense_attention(q, k, v, attn_mask=torch.ones(ones[0], dtype=ones[1], device=device))
    # Boundary: every broadcastable shape works, bool and additive.
    g = torch.Generator().manual_seed(7)
    for shape in ((L, L), (L,), (B, 1, 1, L), (1, H, L, 1), (B, H, L, L)):
        mask = (torch.rand(shape, generator=g) < 0.7).to(device)
        mask[..., 0] = True
        out, lse = sparse_attn.dense_attention(q, k, v, attn_mask=mask, return_lse=True)
        check_attention(out, lse, q, k, v, mask=mask, name=f"attn_mask {shape}")
        bias = torch.where(mask, 0.0, float("-inf"))
        out_bias = sparse_attn.dense_attention(q, k, v, attn_mask=bias)
        assert torch.equal(out_bias, out)


# ---------------------------------------------------------------------------------------------
# block_sparse_attention's mask

LB = 256  # two 128-blocks or four 64-blocks


@pytest.mark.parametrize(
    "case,exc,match",
    _table(
        [
            (
                "longer",
                ValueError,
                r"mask was built for seq_lengths \(257, 257\) but query/key have Lq=256, Lk=256",
            ),
            ("shorter", ValueError, r"mask was built for seq_lengths \(255, 255\)"),
            ("same-blocks", ValueError, r"mask was built for seq_lengths \(200, 200\)"),
            ("rectangular", ValueError, r"mask was built for seq_lengths \(256, 128\)"),
            ("matrix-3x3", ValueError, r"block matrix of shape \(3, 3\) matches neither 64 nor 128 blocks"),
            ("matrix-2x3", ValueError, r"block matrix of shape \(2, 3\) matches neither"),
            ("matrix-float", TypeError, r"a tensor mask must be a bool block matrix"),
            ("matrix-heads", RuntimeError, r"the mask's head dimension must be 1 or H=4, got 3"),
            ("matrix-batch", RuntimeError, r"the mask's batch dimension must be 1 or B=2, got 3"),
            (
                "list",
                TypeError,
                r"mask must be a BlockSparseMask, a patterns.Pattern, a FlexAttention BlockMask or a bool block",
            ),
            ("none", TypeError, r"mask must be a BlockSparseMask"),
        ]
    ),
)
def test_bad_block_mask(case, exc, match, device):
    q, k, v = make_qkv(B, H, HKV, LB, LB, D, device=device, seed=8)
    bool_ones = {"dtype": torch.bool, "device": device}
    mask = {
        "longer": lambda: patterns.causal(LB + 1, LB + 1, device=device),
        "shorter": lambda: patterns.causal(LB - 1, LB - 1, device=device),
        "same-blocks": lambda: patterns.causal(200, 200, device=device),
        "rectangular": lambda: patterns.causal(LB, LB // 2, device=device),
        "matrix-3x3": lambda: torch.ones(3, 3, **bool_ones),
        "matrix-2x3": lambda: torch.ones(2, 3, **bool_ones),
        "matrix-float": lambda: torch.ones(2, 2, device=device),
        "matrix-heads": lambda: torch.ones(1, 3, 2, 2, **bool_ones),
        "matrix-batch": lambda: torch.ones(3, 1, 2, 2, **bool_ones),
        "list": lambda: [[True, True], [True, True]],
        "none": lambda: None,
    }[case]()
    with pytest.raises(exc, match=match):
        sparse_attn.block_sparse_attention(q, k, v, mask)
    # Boundary: block matrices for 128 and 64 blocks (all True = dense), and a causal mask.
    for blocks in (torch.ones(2, 2, **bool_ones), torch.ones(1, H, 4, 4, **bool_ones)):
        out, lse = sparse_attn.block_sparse_attention(q, k, v, blocks, return_lse=True)
        check_attention(out, lse, q, k, v, name=f"block matrix {tuple(blocks.shape)}")
    out, lse = sparse_attn.block_sparse_attention(
        q, k, v, patterns.causal(LB, LB, device=device), return_lse=True
    )
    check_attention(out, lse, q, k, v, causal=True, name="causal pattern")


def _mask_tensors(cnt, idx, part, device):
    cnt = torch.tensor(cnt, dtype=torch.int32, device=device).view(1, 1, -1)
    idx = torch.tensor(idx, dtype=torch.int32, device=device).view(1, 1, cnt.shape[-1], -1)
    part = torch.tensor(part, dtype=torch.int32, device=device).view_as(idx)
    return cnt, idx, part, torch.zeros(0, 128, 4, dtype=torch.int32, device=device)


# Two query blocks over two key blocks (L = 256, 128-blocks); the valid mask is block-diagonal
# plus (1, 0): [[0], [0, 1]]. Each bad case differs from it in one entry.
MALFORMED = {
    "out-of-range": (([1, 2], [[0, 0], [0, 2]], [[-1, -1], [-1, -1]]), r"kv_indices out of range"),
    "negative": (([1, 2], [[0, 0], [-1, 1]], [[-1, -1], [-1, -1]]), r"kv_indices out of range"),
    "unsorted": (([1, 2], [[0, 0], [1, 0]], [[-1, -1], [-1, -1]]), r"kv_indices must be strictly increasing"),
    "duplicate": (
        ([1, 2], [[0, 0], [1, 1]], [[-1, -1], [-1, -1]]),
        r"kv_indices must be strictly increasing",
    ),
    "count>capacity": (
        ([1, 3], [[0, 0], [0, 1]], [[-1, -1], [-1, -1]]),
        r"kv_num_blocks must lie in \[0, 2\]",
    ),
    "count<0": (([-1, 2], [[0, 0], [0, 1]], [[-1, -1], [-1, -1]]), r"kv_num_blocks must lie in \[0, 2\]"),
    "partial-row": (
        ([1, 2], [[0, 0], [0, 1]], [[-1, -1], [-1, 0]]),
        r"kv_partial entries must be -1 \(full\)",
    ),
}


@pytest.mark.parametrize("case", list(MALFORMED))
def test_malformed_block_indices(case, device):
    args, match = MALFORMED[case]
    with pytest.raises(ValueError, match=match):
        BlockSparseMask(*_mask_tensors(*args, device), seq_lengths=(LB, LB))
    valid = BlockSparseMask(
        *_mask_tensors([1, 2], [[0, 0], [0, 1]], [[-1, -1], [-1, -1]], device), seq_lengths=(LB, LB)
    )
    q, k, v = make_qkv(1, 2, 2, LB, LB, D, device=device, seed=9)
    out, lse = sparse_attn.block_sparse_attention(q, k, v, valid, return_lse=True)
    check_attention(out, lse, q, k, v, mask=valid.to_dense(), name="valid block mask")


@pytest.mark.parametrize(
    "case,match",
    _table(
        [
            ("int64-counts", r"kv_num_blocks must be int32"),
            ("int64-indices", r"kv_indices must be int32"),
            ("q_block=32", r"q_block must be 64 or 128, got 32"),
            ("kv_block=256", r"kv_block must be 64 or 128, got 256"),
            ("query-blocks", r"the mask has 1 query blocks but Lq=256 with q_block=128 needs 2"),
            ("indices-shape", r"kv_indices must have shape \(1, 1, 2, max_kv_blocks\)"),
            ("partial-shape", r"kv_partial must have the shape of kv_indices"),
            ("bits-shape", r"partial_masks must have shape \(P, 128, 2\)"),
        ]
    ),
)
def test_bad_block_sparse_raw_op(case, match, device):
    q, k, v = make_qkv(1, 2, 2, LB, LB, D, device=device, seed=10)
    m = patterns.causal(LB, LB, device=device)
    args = {
        "cnt": m.kv_num_blocks,
        "idx": m.kv_indices,
        "part": m.kv_partial,
        "bits": m.partial_masks,
        "qb": 128,
        "kb": 128,
    }
    args.update(
        {
            "int64-counts": {"cnt": m.kv_num_blocks.long()},
            "int64-indices": {"idx": m.kv_indices.long()},
            "q_block=32": {"qb": 32},
            "kv_block=256": {"kb": 256},
            "query-blocks": {
                "cnt": m.kv_num_blocks[..., :1],
                "idx": m.kv_indices[:, :, :1],
                "part": m.kv_partial[:, :, :1],
            },
            "indices-shape": {"idx": m.kv_indices[..., None]},
            "partial-shape": {"part": m.kv_partial[..., :1]},
            "bits-shape": {"kb": 64},
        }[case]
    )
    op = torch.ops.sparse_attn.block_sparse_fwd
    with pytest.raises(RuntimeError, match=match):
        op(q, k, v, args["cnt"], args["idx"], args["part"], args["bits"], args["qb"], args["kb"], None)
    out, lse = op(q, k, v, m.kv_num_blocks, m.kv_indices, m.kv_partial, m.partial_masks, 128, 128, None)
    check_attention(out, lse, q, k, v, causal=True, name="raw block_sparse_fwd")


@pytest.mark.parametrize(
    "case,match",
    _table(
        [
            ("int64", r"indices must be int32"),
            ("batch", r"indices must have shape \(B=2, Hi, Lq=64, k\)"),
            ("length", r"indices must have shape \(B=2, Hi, Lq=64, k\)"),
            ("heads", r"indices must have shape .* with H=4 a multiple of Hi"),
            ("3d", r"indices must be 4-D"),
        ]
    ),
)
def test_bad_gather_indices(case, match, device):
    q, k, v = make_qkv(B, H, HKV, L, L, D, device=device, seed=11)
    good = torch.ops.sparse_attn.topk_select(q, k, 8, False)
    bad = {
        "int64": lambda: good.long(),
        "batch": lambda: good[:1],
        "length": lambda: good[:, :, :-1],
        "heads": lambda: good[:, :3],
        "3d": lambda: good[0],
    }[case]()
    with pytest.raises(RuntimeError, match=match):
        torch.ops.sparse_attn.gather_fwd(q, k, v, bad, None)
    out, _ = torch.ops.sparse_attn.gather_fwd(q, k, v, good, None)
    gold, _ = reference.gather_attention(q, k, v, good)
    lp, _ = reference.gather_attention(q, k, v, good, dtype=q.dtype)
    check_close("gather_fwd", out, gold, lp, dtype=q.dtype)


# ---------------------------------------------------------------------------------------------
# scale


@pytest.mark.parametrize(
    "scale", ["0.5", torch.tensor(0.5), [0.5], 1j], ids=["str", "tensor", "list", "complex"]
)
@pytest.mark.parametrize("op", OPS)
def test_bad_scale_type(op, scale, device):
    q, k, v = make_qkv(B, H, HKV, L, L, D, device=device, seed=12)
    with pytest.raises(TypeError, match=r"scale must be a float or None"):
        _call(op, q, k, v, scale=scale)
    for good in (0.5, 2):  # float and int scales both work
        _check_valid(op, q, k, v, scale=good)


@pytest.mark.parametrize("scale", [float("nan"), float("inf"), -float("inf")], ids=["nan", "inf", "-inf"])
@pytest.mark.parametrize("op", OPS)
def test_non_finite_scale(op, scale, device):
    q, k, v = make_qkv(B, H, HKV, L, L, D, device=device, seed=12)
    with pytest.raises(ValueError, match=r"scale must be finite"):
        _call(op, q, k, v, scale=scale)


# ---------------------------------------------------------------------------------------------
# Sizes: empty inputs are not errors (an empty output, or 0 and LSE -inf without keys).

EMPTY = {
    "B=0": (0, H, HKV, L, L),
    "H=0": (B, 0, 0, L, L),
    "Lq=0": (B, H, HKV, 0, L),
    "Lk=0": (B, H, HKV, L, 0),
}


@pytest.mark.parametrize("case", list(EMPTY))
@pytest.mark.parametrize("op", OPS + ["topk_indexer"])
def test_empty_sizes(op, case, device):
    b, h, hkv, lq, lk = EMPTY[case]
    q, k, v = make_qkv(b, h, hkv, lq, lk, D, device=device, seed=13)
    if op == "topk_indexer":
        iq, ik, iw = _indexer_inputs(device, b=b, lq=lq, lk=lk)
        out, lse = sparse_attn.topk_attention(
            q, k, v, 8, index_query=iq, index_key=ik, index_weights=iw, return_lse=True
        )
    else:
        out, lse = _call(op, q, k, v, lengths=(lq, lk), return_lse=True)
    assert out.shape == (b, h, lq, D) and lse.shape == (b, h, lq)
    if case == "Lk=0":
        assert (out == 0).all() and torch.isneginf(lse).all()
    else:
        assert out.numel() == 0 and lse.numel() == 0


@pytest.mark.parametrize("op", OPS)
def test_empty_keys_backward(op, device):
    # No keys: zero gradients for the queries, empty ones for the keys and values, on every op.
    q, k, v = make_qkv(B, H, HKV, L, 0, D, device=device, seed=14)
    q, k, v = (t.requires_grad_(True) for t in (q, k, v))
    _call(op, q, k, v, lengths=(L, 0)).sum().backward()
    assert (q.grad == 0).all() and k.grad.shape == k.shape and v.grad.shape == v.shape


def test_argument_types_named():
    q = torch.randn(1, 2, 16, 32)
    for op in (sparse_attn.flash_attention, sparse_attn.dense_attention):
        with pytest.raises(TypeError, match="query must be a torch.Tensor, got list"):
            op([1.0], q, q)
    rows = (torch.ones(1, 1, 2, dtype=torch.int32), torch.zeros(1, 1, 2, 1, dtype=torch.int32))
    parts = (-torch.ones(1, 1, 2, 1, dtype=torch.int32), torch.zeros(0, 128, 4, dtype=torch.int32))
    for kw, match in (
        ({"seq_lengths": (256, 256), "block_size": (128, 128, 128)}, "block_size must be an int or a pair"),
        ({"seq_lengths": (256, 256), "block_size": "128"}, "block_size must be an int or a pair"),
        ({"seq_lengths": (256,)}, r"seq_lengths must be a pair \(Lq, Lk\)"),
        ({"seq_lengths": (255.5, 256)}, "seq_lengths must be an int or a pair of ints"),
    ):
        with pytest.raises(TypeError, match=match):
            BlockSparseMask(*rows, *parts, **kw)
    packed, cu = torch.randn(20, 2, 32), torch.tensor([0, 10, 20], dtype=torch.int32)
    with pytest.raises(TypeError, match="max_seqlen_q must be an int, got None"):
        sparse_attn.flash_attention_varlen(packed, packed, packed, cu, cu, None, 10)
    with pytest.raises(TypeError, match="masks must be a list of masks"):
        sparse_attn.block_sparse_attention_varlen(packed, packed, packed, cu, cu, 10, 10, 5)


# ---------------------------------------------------------------------------------------------
# Devices (need a GPU)


@pytest.mark.cuda
@pytest.mark.parametrize("op", OPS)
def test_qkv_on_different_devices(op):
    q, k, v = _qkv("cpu")
    for bad, match in (
        ((q, k.cuda(), v.cuda()), r"query and key must be on the same device"),
        ((q, k, v.cuda()), r"query and value must be on the same device"),
        ((q.cuda(), k, v), r"query and key must be on the same device"),
    ):
        with pytest.raises(ERRORS, match=match):
            _call(op, *bad)
    _valid(op, "cpu")
    _valid(op, "cuda")


@pytest.mark.cuda
@pytest.mark.parametrize("op", OPS)
def test_qkv_on_two_gpus(op):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    q, k, v = _qkv("cuda:0")
    with pytest.raises(ERRORS, match=r"query and key must be on the same device"):
        _call(op, q, k.to("cuda:1"), v.to("cuda:1"))
    _valid(op, "cuda:1")


@pytest.mark.cuda
@pytest.mark.parametrize("query_device,mask_device", [("cpu", "cuda"), ("cuda", "cpu")])
def test_mask_on_another_device_than_query(query_device, mask_device):
    q, k, v = make_qkv(B, H, HKV, LB, LB, D, device=query_device, seed=14)
    with pytest.raises(RuntimeError, match=r"attn_mask.*device|device.*attn_mask"):
        sparse_attn.dense_attention(
            q, k, v, attn_mask=torch.ones(LB, LB, dtype=torch.bool, device=mask_device)
        )
    # Every route of block_sparse_attention checks it: the block kernel, and the patterns that run
    # as flash attention (causal, sliding window, dilated, dilated 2-D).
    for mask in (
        block_kernel_mask(patterns.causal(LB, LB, device=mask_device)),
        patterns.causal(LB, LB, device=mask_device),
        patterns.sliding_window(LB, 40, device=mask_device),
        patterns.dilated(LB, 40, 2, device=mask_device),
        patterns.dilated_2d(LB, 64, 2, device=mask_device),
    ):
        with pytest.raises(RuntimeError, match=r"mask.*device"):
            sparse_attn.block_sparse_attention(q, k, v, mask)
    iq, ik, iw = _indexer_inputs(mask_device, lq=LB, lk=LB)
    with pytest.raises(ValueError, match=r"index_query must be on query's device"):
        sparse_attn.topk_attention(q, k, v, 8, index_query=iq, index_key=ik, index_weights=iw)
    indices = torch.zeros(B, H, LB, 4, dtype=torch.int32, device=mask_device)
    with pytest.raises(RuntimeError, match=r"indices.*device"):
        torch.ops.sparse_attn.gather_fwd(q, k, v, indices, None)
    # The same calls with everything on the query's device work.
    out, lse = sparse_attn.block_sparse_attention(
        q, k, v, patterns.causal(LB, LB, device=query_device), return_lse=True
    )
    check_attention(out, lse, q, k, v, causal=True, name="block_sparse")
    mask = torch.ones(LB, LB, dtype=torch.bool, device=query_device).tril()
    out, lse = sparse_attn.dense_attention(q, k, v, attn_mask=mask, return_lse=True)
    check_attention(out, lse, q, k, v, mask=mask, name="dense attn_mask")
