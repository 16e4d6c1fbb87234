"""Gradients of every op (CPU kernels, and the CUDA kernels where a GPU is present) against fp64
autograd of the reference under the same mask, with the tolerance rule applied to dQ, dK, dV
(factor 3, as FlashAttention's tests); empty rows give zero gradients, never NaN; the LSE's
gradient is honoured; the CPU backward is bit-identical run to run (the CUDA one says it is not
under torch.use_deterministic_algorithms); compiled training steps equal eager ones."""

import itertools
import random

import pytest
import torch
from utils import band_mask, check_close, make_qkv

import sparse_attn
from sparse_attn import patterns, reference


def _grads(fn, q, k, v, g, glse=None):
    q, k, v = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
    out, lse = fn(q, k, v)
    loss = (out.float() * g.float()).sum()
    if glse is not None:
        loss = loss + (torch.where(torch.isneginf(lse), 0.0, lse) * glse).sum()
    loss.backward()
    return q.grad, k.grad, v.grad


def _check(name, fn, ref_mask_fn, q, k, v, *, scale=None, with_lse=False, device="cpu"):
    """fn(q, k, v) -> (out, lse) of ours (run on `device`); ref_mask_fn() -> the bool mask of the
    same attention (the references run on the CPU)."""
    g = torch.randn(q.shape[:3] + (v.shape[-1],), generator=torch.Generator().manual_seed(5))
    glse = torch.randn(q.shape[:3], generator=torch.Generator().manual_seed(6)) if with_lse else None
    mask = ref_mask_fn()

    def ref(dtype):
        return lambda q_, k_, v_: reference.attention(q_, k_, v_, mask=mask, scale=scale, dtype=dtype)

    moved = (t.to(device) if t is not None else None for t in (q, k, v, g, glse))
    ours = tuple(x.cpu() for x in _grads(fn, *moved))
    gold = _grads(ref(torch.float64), q.double(), k.double(), v.double(), g.double(), glse)
    lp = _grads(ref(q.dtype), q, k, v, g, glse)
    for what, a, b, c in zip(("dq", "dk", "dv"), ours, gold, lp, strict=True):
        assert a.dtype == q.dtype and torch.isfinite(a).all(), f"{name} {what}"
        check_close(f"{name} {what}", a, b, c, dtype=q.dtype, c_max=3.0, c_mean=3.0)
    return ours


def _tri(lq, lk):
    return torch.ones(lq, lk, dtype=torch.bool).tril(lk - lq)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize(
    "shape",
    [
        (1, 2, 2, 64, 64, 32),
        (2, 4, 2, 97, 130, 64),
        (1, 4, 1, 130, 70, 64),
        (1, 2, 2, 1, 50, 40),
        (1, 4, 2, 200, 300, 128),
        (1, 2, 1, 70, 90, 256),
    ],
)
@pytest.mark.parametrize("mode", ["full", "causal", "window"])
def test_flash_gradients(dtype, shape, mode, device):
    b, h, hkv, lq, lk, d = shape
    q, k, v = make_qkv(b, h, hkv, lq, lk, d, dtype=dtype, seed=lq + lk)
    causal = mode == "causal"
    window = (20, 7) if mode == "window" else None

    def mask():
        if causal:
            return _tri(lq, lk)
        if window:
            i = torch.arange(lq)[:, None] + (lk - lq)
            j = torch.arange(lk)[None, :]
            return (j >= i - 20) & (j <= i + 7)
        return None

    fn = lambda q_, k_, v_: sparse_attn.flash_attention(q_, k_, v_, causal=causal, window=window, return_lse=True)  # noqa: E731
    _check(f"flash {mode} {shape}", fn, mask, q, k, v, with_lse=mode == "full", device=device)


def _flex_mask(length, device="cpu"):
    from torch.nn.attention.flex_attention import create_block_mask

    def mod(b, h, q, kv):  # a causal band of 100 keys and a global first token
        return ((q - kv < 100) & (kv <= q)) | (kv == 0)

    return create_block_mask(mod, None, None, length, length, device=device, BLOCK_SIZE=64)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize(
    "name", ["random", "longformer", "dilated", "causal_plain", "window", "empty_rows", "flex", "flex_block"]
)
def test_block_sparse_gradients(name, dtype, device):
    L = 300
    q, k, v = make_qkv(1, 4, 2, L, L, 64, dtype=dtype, seed=len(name))
    mask = {
        "random": lambda: patterns.random_blocks(L, 0.4, seed=1, heads=4, block_size=64),
        "longformer": lambda: patterns.longformer(L, 50, [0, 200]),
        "dilated": lambda: patterns.dilated(L, 90, 3),  # its route: flash over strided views
        "causal_plain": lambda: sparse_attn.BlockSparseMask(
            *patterns.causal(L, L)._tensors(), seq_lengths=(L, L)
        ),  # the block kernel
        "window": lambda: patterns.sliding_window(L, 40, causal=True),  # its route: flash with a window
        "empty_rows": lambda: patterns.dilated_2d(L, 128, 3),  # rows that see no key
        # A FlexAttention BlockMask converted (partial blocks get exact bits), and one passed as is.
        "flex": lambda: sparse_attn.BlockSparseMask.from_flex(_flex_mask(L)),
        "flex_block": lambda: _flex_mask(L),
    }[name]()
    fn = lambda q_, k_, v_: sparse_attn.block_sparse_attention(q_, k_, v_, mask, return_lse=True)  # noqa: E731
    if name == "flex_block":  # Flex's BlockMask itself per call; the reference reads its converted form
        converted = sparse_attn.BlockSparseMask.from_flex(mask)
        dense = lambda: converted.to_dense()  # noqa: E731
        if device != "cpu":
            mask = _flex_mask(L, device)
    else:
        if device != "cpu":
            mask = mask.to(device)
        dense = lambda: mask.to_dense().cpu()  # noqa: E731
    dq, dk, dv = _check(f"block-sparse {name}", fn, dense, q, k, v, with_lse=True, device=device)
    if name == "empty_rows":
        empty = ~dense()[0, 0].any(-1)
        assert empty.any() and (dq[:, :, empty] == 0).all()


@pytest.mark.parametrize("d", [64, 128])
def test_block_sparse_gradients_with_heavy_key_blocks(d, device):
    # Global tokens: key block 0 is visited by every query block (more than twice the mean), so the
    # Hopper key-major kernel runs it first over every (batch, kv head) (bwd_tile_of_cta's order).
    L = 1600
    q, k, v = make_qkv(2, 4, 2, L, L, d, dtype=torch.bfloat16, seed=d)
    mask = patterns.longformer(L, 100, [0, 5, 900])
    on_device = mask.to(device)
    fn = lambda q_, k_, v_: sparse_attn.block_sparse_attention(q_, k_, v_, on_device, return_lse=True)  # noqa: E731
    _check("heavy key blocks", fn, lambda: mask.to_dense(), q, k, v, with_lse=True, device=device)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize(
    "indexer,h,hkv,d", [(False, 4, 2, 64), (True, 4, 2, 64), (True, 64, 1, 64), (True, 64, 1, 128)]
)
def test_topk_gradients_given_the_selection(indexer, h, hkv, d, dtype, device):
    """h = 64: 64 heads share the indexer's selection and the kv head: on an H100 the forward is the
    wgmma gather (gather_wgmma.cuh), the backward the mma.sync one whose four warps of a token share
    K/V stages and reduce dK, dV once for all 64 heads (gather_bwd.cuh, kShared)."""
    q, k, v = make_qkv(2, h, hkv, 120, 150, d, dtype=dtype, seed=3)
    extra = {}
    if indexer:
        g = torch.Generator().manual_seed(4)
        extra = {
            "index_query": torch.randn(2, 120, 2, 32, generator=g).to(dtype),
            "index_key": torch.randn(2, 150, 32, generator=g).to(dtype),
            "index_weights": torch.randn(2, 120, 2, generator=g).to(dtype),
        }
    extra = {name: t.to(device) for name, t in extra.items()}
    _, idx = sparse_attn.topk_attention(
        *(t.to(device) for t in (q, k, v)), 24, causal=True, return_indices=True, **extra
    )
    idx = idx.cpu()

    def fn(q_, k_, v_):
        return sparse_attn.topk_attention(q_, k_, v_, 24, causal=True, return_lse=True, **extra)

    def mask():
        m = torch.zeros(2, idx.shape[1], 120, 151, dtype=torch.bool)
        m.scatter_(-1, torch.where(idx >= 0, idx, 150).long(), True)
        return m[..., :150].repeat_interleave(h // idx.shape[1], dim=1)

    _check(f"topk indexer={indexer}", fn, mask, q, k, v, device=device)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_block_topk_and_dense_gradients(dtype, device):
    q, k, v = make_qkv(1, 2, 2, 200, 200, 32, dtype=dtype, seed=9)
    on = [t.to(device) for t in (q, k, v)]
    _, blocks = sparse_attn.topk_attention(*on, 2, block_size=64, causal=True, return_indices=True)
    mask = sparse_attn.analysis.mask_from_block_indices(blocks.cpu(), (200, 200), 64, causal=True).to_dense()

    def block(q_, k_, v_):
        return sparse_attn.topk_attention(q_, k_, v_, 2, block_size=64, causal=True, return_lse=True)

    _check("block top-k", block, lambda: mask, q, k, v, device=device)

    def dense(q_, k_, v_):
        return sparse_attn.dense_attention(q_, k_, v_, attn_mask=_tri(200, 200).to(device), return_lse=True)

    _check("dense", dense, lambda: _tri(200, 200), q, k, v, with_lse=True, device=device)


@pytest.mark.parametrize("shape", [(2, 2, 16, 20), (1, 2, 1, 20), (16, 20)], ids=str)
def test_dense_additive_mask_gradient(shape, device):
    # A float attn_mask that requires grad (a learned bias) gets its gradient, as in SDPA, summed
    # over the dims it broadcasts along; also when only the mask requires it.
    q, k, v = make_qkv(2, 2, 2, 16, 20, 32, dtype=torch.float64, seed=17)
    bias = torch.randn(*shape, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    weight = torch.arange(32, dtype=torch.float64)
    gold = bias.clone().requires_grad_(True)
    (torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=gold) * weight).sum().backward()
    on = [t.float().to(device) for t in (q, k, v)]
    got = bias.float().to(device).requires_grad_(True)
    (sparse_attn.dense_attention(*on, attn_mask=got) * weight.float().to(device)).sum().backward()
    assert got.grad.shape == bias.shape
    torch.testing.assert_close(got.grad.double().cpu(), gold.grad, atol=2e-4, rtol=2e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_rows_with_no_key_get_zero_gradients_and_nan_propagates(dtype, device):
    q, k, v = make_qkv(1, 2, 2, 64, 64, 32, dtype=dtype, device=device, seed=11)
    q, k, v = (t.requires_grad_(True) for t in (q, k, v))
    out = sparse_attn.flash_attention(q, k, v, window=(0, 0))  # each row sees its own key
    out.sum().backward()
    assert torch.isfinite(q.grad).all() and torch.isfinite(v.grad).all()
    # Lq > Lk under causal: the first rows see no key: exactly zero gradient.
    q2 = torch.randn(1, 2, 80, 32, dtype=dtype, device=device, requires_grad=True)
    k2, v2 = (torch.randn(1, 2, 40, 32, dtype=dtype, device=device, requires_grad=True) for _ in range(2))
    sparse_attn.flash_attention(q2, k2, v2, causal=True).sum().backward()
    assert (q2.grad[:, :, :40] == 0).all() and torch.isfinite(k2.grad).all()
    # NaN in a visible value reaches the gradients of the rows that see it, and no row whose keys
    # lie in other key tiles. (Within the NaN's own 64- or 128-key tile, the GPU kernels multiply
    # hidden values by P = 0, as FlashAttention does, so only the CPU keeps those rows clean.)
    q3, k3, v3 = make_qkv(1, 2, 2, 300, 300, 32, dtype=dtype, device=device, seed=12)
    v3[0, 0, 200] = float("nan")
    q3.requires_grad_(True)
    sparse_attn.flash_attention(q3, k3, v3, causal=True).sum().backward()
    assert q3.grad[0, 0, 200:].isnan().any() and not q3.grad[0, 0, :128].isnan().any()
    if device == "cpu":
        assert not q3.grad[0, 0, :200].isnan().any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_strided_inputs_and_output_gradient(dtype):
    # (B, L, H, D) storage viewed as (B, H, L, D) for Q, K, V and the output's gradient: the CPU
    # backward reads the bf16 rows of Q and dO in place for its matrix-unit products, so the
    # strides must give the contiguous inputs' gradients bit for bit; long rows: 128-row forward tiles.
    q, k, v = make_qkv(1, 4, 2, 1100, 1100, 64, dtype=dtype, seed=31, layout="blhd")
    g = torch.randn(1, 1100, 4, 64, generator=torch.Generator().manual_seed(32)).to(dtype).transpose(1, 2)
    assert not q.is_contiguous() and not g.is_contiguous()
    fn = lambda q_, k_, v_: sparse_attn.flash_attention(q_, k_, v_, causal=True)  # noqa: E731
    strided = torch.autograd.grad(fn(*(x.requires_grad_() for x in (q, k, v))), (q, k, v), g)
    flat = [x.detach().contiguous().requires_grad_() for x in (q, k, v)]
    contiguous = torch.autograd.grad(fn(*flat), flat, g.contiguous())
    for a, b in zip(strided, contiguous, strict=True):
        assert torch.equal(a, b)
    _check(
        "flash causal blhd",
        lambda *x: (fn(*x), None),
        lambda: _tri(1100, 1100),
        q.detach(),
        k.detach(),
        v.detach(),
        device="cpu",
    )


def test_backward_is_deterministic():
    q, k, v = make_qkv(2, 8, 2, 150, 150, 64, dtype=torch.bfloat16, seed=2)
    mask = patterns.longformer(150, 30, [0])
    runs = [
        _grads(
            lambda a, b, c: sparse_attn.block_sparse_attention(a, b, c, mask, return_lse=True),
            q,
            k,
            v,
            torch.ones(2, 8, 150, 64),
        )
        for _ in range(3)
    ]
    for other in runs[1:]:
        for a, b in zip(runs[0], other, strict=True):
            assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_cpu_backward_splits_query_tiles_over_threads(dtype):
    """With fewer (batch, kv head)s than threads (here MQA, B = 1, 4 threads) the CPU backward splits
    each one's query tiles (top-k: rows) over the threads and sums their dK, dV partials in split
    order: the gradients of one thread up to the sums' rounding, and bit-identical run to run."""
    q, k, v = make_qkv(1, 4, 1, 300, 300, 64, dtype=dtype, seed=7)
    g = torch.randn(1, 4, 300, 64, generator=torch.Generator().manual_seed(8)).to(dtype)
    for fn in (  # the tiled kernels' path and top-k's row by row one
        lambda a, b, c: sparse_attn.flash_attention(a, b, c, causal=True, return_lse=True),
        lambda a, b, c: sparse_attn.topk_attention(a, b, c, 40, causal=True, return_lse=True),
    ):
        threads = torch.get_num_threads()
        try:
            torch.set_num_threads(1)
            one = _grads(fn, q, k, v, g)
            torch.set_num_threads(4)
            split = [_grads(fn, q, k, v, g) for _ in range(2)]
        finally:
            torch.set_num_threads(threads)
        tol = 1e-5 if dtype == torch.float32 else 1e-2
        for a, b, c in zip(one, *split, strict=True):
            assert torch.equal(b, c)
            torch.testing.assert_close(b.float(), a.float(), atol=tol, rtol=tol)


def test_compiled_training_step_equals_eager(device):
    torch.manual_seed(0)
    layer = torch.nn.Linear(64, 3 * 64).to(device)

    def step(x):
        qkv = layer(x).view(1, 96, 3, 2, 32).permute(2, 0, 3, 1, 4)
        out = sparse_attn.flash_attention(qkv[0], qkv[1], qkv[2], causal=True)
        return out.square().mean()

    x = torch.randn(1, 96, 64, device=device)
    eager = torch.autograd.grad(step(x), layer.weight)[0]
    torch._dynamo.reset()
    compiled = torch.autograd.grad(torch.compile(step, fullgraph=True)(x), layer.weight)[0]
    torch.testing.assert_close(compiled, eager, atol=1e-6, rtol=1e-5)


@pytest.mark.cuda
@pytest.mark.parametrize("portable", [False, True], ids=["planned", "portable"])
@pytest.mark.parametrize("d", [64, 128])
def test_cuda_deterministic_mode_is_bitwise_repeatable(d, portable):
    """Under torch.use_deterministic_algorithms(True) flash and block-sparse gradients are
    bit-identical over 100 runs (flash's dQ reductions in a fixed order on Hopper, elsewhere dQ from
    its own kernel with no atomics) and agree with the default
    path's; top-k runs through the block kernel there (repeatable too), and its gather route, whose
    dK and dV are summed with atomics, raises PyTorch's error."""
    q, k, v = make_qkv(2, 8, 2, 700, 700, d, device="cuda", seed=4)
    g = torch.randn(2, 8, 700, d, generator=torch.Generator().manual_seed(3)).bfloat16().cuda()
    mask = patterns.random_blocks(700, 0.3, seed=1, heads=8, block_size=128).to("cuda")
    for fn in (
        lambda a, b, c: sparse_attn.flash_attention(a, b, c, causal=True, return_lse=True),
        lambda a, b, c: sparse_attn.block_sparse_attention(a, b, c, mask, return_lse=True),
    ):
        default = _grads(fn, q, k, v, g)
        with sparse_attn._plan.overrides(portable_only=portable):
            torch.use_deterministic_algorithms(True)
            try:
                first = _grads(fn, q, k, v, g)
                for _ in range(99):
                    for a, b in zip(first, _grads(fn, q, k, v, g), strict=True):
                        assert torch.equal(a, b)
                # top-k takes the masked block route there (its backward is the block kernel's)
                topk = lambda a, b, c: sparse_attn.topk_attention(a, b, c, 64, return_lse=True)  # noqa: E731
                once = _grads(topk, q, k, v, g)
                for a, b in zip(once, _grads(topk, q, k, v, g), strict=True):
                    assert torch.equal(a, b)
                with sparse_attn._plan.overrides(topk_attention_route="gather"):
                    with pytest.raises(RuntimeError, match="does not have a deterministic implementation"):
                        sparse_attn.topk_attention(q.requires_grad_(True), k, v, 64).sum().backward()
            finally:
                torch.use_deterministic_algorithms(False)
                q.requires_grad_(False)
        for a, b in zip(first, default, strict=True):
            torch.testing.assert_close(a.float(), b.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.cuda
@pytest.mark.parametrize("portable", [False, True], ids=["planned", "portable"])
@pytest.mark.parametrize("d", [64, 128, 96])
@pytest.mark.parametrize("length", [333, 256])
def test_cuda_backward_matches_the_cpu_kernels(d, portable, length):
    """GQA, causal, ragged lengths, per-head block-sparse masks of 64- and 128-blocks: the CUDA
    backward (the planned kernel: Hopper's on an H100; and the portable one) against the CPU
    backward on the same bf16 inputs (both fp32 inside)."""
    q, k, v = make_qkv(2, 8, 2, length, length, d, dtype=torch.bfloat16, seed=d)
    g = torch.randn(2, 8, length, d, generator=torch.Generator().manual_seed(1)).bfloat16()

    def sparse(block):
        mask = patterns.random_blocks(length, 0.3, seed=2, heads=8, block_size=block)
        return lambda a, b, c: sparse_attn.block_sparse_attention(a, b, c, mask.to(a.device), return_lse=True)

    for fn in (
        lambda a, b, c: sparse_attn.flash_attention(a, b, c, causal=True, return_lse=True),
        lambda a, b, c: sparse_attn.flash_attention(a, b, c, window=(100, 30), return_lse=True),
        lambda a, b, c: sparse_attn.flash_attention(a, b, c, return_lse=True),
        sparse(64),
        sparse(128),
    ):
        cpu = _grads(fn, q, k, v, g)
        with sparse_attn._plan.overrides(portable_only=portable):
            gpu = _grads(fn, q.cuda(), k.cuda(), v.cuda(), g.cuda())
        for a, b in zip(cpu, gpu, strict=True):
            torch.testing.assert_close(b.cpu().float(), a.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.cuda
@pytest.mark.parametrize("portable", [False, True], ids=["planned", "portable"])
def test_cuda_causal_backward_over_head_groups_and_long_walks(portable):
    """Causal rows at 2k (32 query tiles per key block, walked from a rotated start) with GQA 8:1
    over B * Hkv = 6, which the key-major kernels run in groups of 4 and 2 (batch, kv head)s, key
    block by key block (bwd_tile_of_cta): every gradient against fp32 autograd of the reference on
    the GPU, with Lq < Lk as well."""
    for lq, lk in ((2048, 2048), (1900, 2048)):
        q, k, v = make_qkv(2, 24, 3, lq, lk, 64, dtype=torch.bfloat16, seed=lq, device="cuda")
        g = torch.randn(2, 24, lq, 64, generator=torch.Generator().manual_seed(2)).bfloat16().cuda()
        fn = lambda a, b, c: sparse_attn.flash_attention(a, b, c, causal=True, return_lse=True)  # noqa: E731
        with sparse_attn._plan.overrides(portable_only=portable):
            ours = _grads(fn, q, k, v, g)
        gold = _grads(lambda a, b, c: reference.attention(a, b, c, causal=True, dtype=torch.float32), q, k, v, g)
        for what, a, b in zip(("dq", "dk", "dv"), ours, gold, strict=True):
            assert torch.isfinite(a).all(), what
            torch.testing.assert_close(a.float(), b.float(), atol=2e-2, rtol=2e-2, msg=lambda m, w=what: f"{w}: {m}")


def _check_head_splits(fn, ref, q, k, v, g, portable):
    """fn's gradients with bwd_head_splits forced to 1, 2, 4, 8 and the plan's (0) against fp32
    autograd of ref (the 2e-2 rule), and against each other to fp32 summation order."""
    gold = _grads(ref, q, k, v, g)
    first = None
    for splits in (0, 1, 2, 4, 8):
        with sparse_attn._plan.overrides(bwd_head_splits=splits, portable_only=portable):
            ours = _grads(fn, q, k, v, g)
        for what, a, r in zip(("dq", "dk", "dv"), ours, gold, strict=True):
            assert torch.isfinite(a).all(), (splits, what)
            torch.testing.assert_close(
                a.float(), r.float(), atol=2e-2, rtol=2e-2, msg=lambda m, w=what, s_=splits: f"{s_} {w}: {m}"
            )
        if first is None:
            first = ours
        else:
            for a, f in zip(ours, first, strict=True):
                torch.testing.assert_close(a.float(), f.float(), atol=1e-2, rtol=1e-2)


@pytest.mark.cuda
@pytest.mark.parametrize("portable", [False, True], ids=["plan", "portable"])
@pytest.mark.parametrize("d", [64, 128])
def test_cuda_backward_with_head_splits(d, portable):
    """GQA 8:1 (and 4:1 with Lq != Lk), causal, a window and dense: the backward (the Hopper kernel,
    or the portable one) with each key block's group of query heads shared by 1, 2, 4 or 8 CTAs
    (bwd_head_splits; dK and dV then summed in fp32 across them), and the plan's own choice, against
    fp32 autograd of the reference; the split counts agree with each other to fp32 summation order."""
    for b, h, hkv, lq, lk in ((2, 16, 2, 700, 700), (1, 8, 2, 500, 640)):
        q, k, v = make_qkv(b, h, hkv, lq, lk, d, dtype=torch.bfloat16, seed=lq + d, device="cuda")
        g = torch.randn(b, h, lq, d, generator=torch.Generator().manual_seed(7)).bfloat16().cuda()
        for kwargs in ({"causal": True}, {"window": (150, 20)}, {}):
            fn = lambda a, b_, c, kw=kwargs: sparse_attn.flash_attention(a, b_, c, return_lse=True, **kw)  # noqa: E731
            mask = band_mask(lq, lk, kwargs.get("causal", False), kwargs.get("window")).cuda()
            ref = lambda a, b_, c, m=mask: reference.attention(a, b_, c, mask=m, dtype=torch.float32)  # noqa: E731
            _check_head_splits(fn, ref, q, k, v, g, portable)


@pytest.mark.cuda
@pytest.mark.parametrize("portable", [False, True], ids=["plan", "portable"])
@pytest.mark.parametrize("d", [64, 128])
def test_cuda_block_sparse_backward_with_head_splits(d, portable):
    """GQA 8:1 and 4:1 (Lq != Lk) block-sparse masks of 128-key blocks, one mask for all heads and
    one per head, with global tokens (a heavy key block), partial blocks and ragged ends: the
    backward (Hopper or portable kernel) with each key block's query heads shared by 1, 2, 4 or 8
    CTAs (bwd_head_splits) and the plan's choice, against fp32 autograd of the reference on the
    mask's elements."""
    for b, h, hkv, lq, lk in ((2, 16, 2, 900, 900), (1, 8, 2, 700, 1000)):
        q, k, v = make_qkv(b, h, hkv, lq, lk, d, dtype=torch.bfloat16, seed=lq + d, device="cuda")
        g = torch.randn(b, h, lq, d, generator=torch.Generator().manual_seed(9)).bfloat16().cuda()
        if lq == lk:
            masks = [
                patterns.random_blocks(lq, 0.3, seed=3, heads=h, block_size=128),
                patterns.longformer(lq, 70, [0, 3, 500]),
            ]
        else:  # an element mask per head: partial blocks, rows that see nothing
            gen = torch.Generator().manual_seed(5)
            elements = torch.rand(1, h, lq, lk, generator=gen) < 0.02
            elements[..., :, :40] = True  # global keys
            elements[:, :, 300:340] = False
            masks = [sparse_attn.BlockSparseMask.from_element_mask(elements)]
        for mask in masks:
            on_device = mask.to("cuda")
            dense = mask.to_dense().cuda()
            fn = lambda a, b_, c, m=on_device: sparse_attn.block_sparse_attention(a, b_, c, m, return_lse=True)  # noqa: E731
            ref = lambda a, b_, c, m=dense: reference.attention(a, b_, c, mask=m, dtype=torch.float32)  # noqa: E731
            _check_head_splits(fn, ref, q, k, v, g, portable)


def test_backward_head_splits_plan():
    """plan_bwd_head_splits (run on the host by a private op, a 132-SM Hopper): one CTA per key block
    for MHA, non-causal grids and many (batch, kv head)s; a causal MQA or few-K/V-head grid at 8k
    shares each key block's heads over several CTAs (a divisor of the group), as does a causal group
    whose Q and dO pass 32 MiB at 16k; the bwd_head_splits override wins (capped at a divisor of
    the group); asking again gives the same answer (the per-shape cache). The block-sparse rule
    (plan_bwd_block_sparse_head_splits) by group size and grid."""
    splits = torch.ops.sparse_attn._bwd_head_splits

    def plan(b, h, hkv, length, d=128, causal=True, sms=132):
        bm = 128 if d == 64 else 64
        return splits(b, h, hkv, length, length, -1, 0 if causal else -1, d, sms, bm)

    assert plan(2, 16, 16, 8192) == 1  # MHA
    assert plan(2, 16, 2, 8192, causal=False) == 1
    assert plan(16, 32, 8, 8192) == 1  # many (batch, kv head)s
    for args in ((1, 16, 1, 8192), (2, 16, 2, 8192), (1, 32, 8, 8192), (1, 16, 2, 16384), (1, 64, 8, 16384)):
        s = plan(*args)
        assert s > 1 and (args[1] // args[2]) % s == 0, (args, s)
        assert plan(*args) == s
    assert plan(1, 16, 1, 8192) >= 4  # MQA: the first key blocks walk 16 heads
    with sparse_attn._plan.overrides(bwd_head_splits=3):
        assert plan(1, 16, 2, 8192) == 2  # 3 does not divide 8
        assert plan(2, 16, 16, 8192) == 1
    with sparse_attn._plan.overrides(bwd_head_splits=64):
        assert plan(1, 16, 1, 8192) == 16

    def block_plan(b, h, hkv, length, sms=132):
        return splits(b, h, hkv, length, length, -1, -1, 128, sms, 64, block_sparse=True)

    # Block-sparse masks: groups of 8+ heads on grids of at most ~4 waves of key blocks walk two
    # heads per CTA (at most 8 CTAs per group); smaller groups and larger grids keep one CTA.
    assert block_plan(2, 16, 2, 16384) == 4
    assert block_plan(1, 16, 1, 16384) == 8 and block_plan(1, 64, 1, 16384) == 8
    assert block_plan(2, 32, 8, 16384) == 1  # groups of 4
    assert block_plan(8, 16, 2, 16384) == 1  # 16 waves of key blocks
    assert block_plan(2, 16, 16, 16384) == 1  # MHA
    with sparse_attn._plan.overrides(bwd_head_splits=2):
        assert block_plan(8, 32, 8, 16384) == 2


def test_ordered_backward_walks_visit_each_tile_once_in_key_order():
    """The deterministic mode's walks (OrderedWindowQTiles over the Hopper backward's 64-row query
    tiles, 128-row ones at head dim 64, and 128-key tiles, run on the host by a private op) against
    the band itself: key tile n visits exactly the (head, query tile)s whose block_m x 128 rectangle
    holds a visible pair, each once;
    at each, the visitors' ranks are 0, 1, ... in ascending key order (the counter reaches every
    rank: no CTA waits out its timeout), and key tile n - 1 gets there no later in its walk than n
    (a CTA waits only for one started before it). Causal, bands, one-sided bounds, Lq != Lk, GQA."""
    rng = random.Random(0)
    cases = [(700, 700, -1, 0, 1), (1900, 2048, -1, 0, 3), (1500, 1000, -1, 0, 1), (2048, 1900, 300, 50, 2)]
    cases += [(777, 1333, -1, 200, 1), (1333, 777, 0, -1, 2), (640, 640, -1, -1, 2), (64, 1, -1, 0, 1)]
    for _ in range(40):
        left, right = rng.choice([-1, 0, rng.randrange(1, 600)]), rng.choice([-1, 0, rng.randrange(1, 600)])
        cases.append((rng.randrange(1, 900), rng.randrange(1, 900), left, right, rng.randrange(1, 4)))
    for (lq, lk, left, right, heads), bm in itertools.product(cases, (64, 128)):
        walks = torch.ops.sparse_attn._ordered_bwd_walk(lq, lk, left, right, heads, bm)
        window = (None if left < 0 else left, None if right < 0 else right)
        nq, nk = -(-lq // bm), -(-lk // 128)
        visible = torch.zeros(nq * bm, nk * 128, dtype=torch.bool)
        visible[:lq, :lk] = band_mask(lq, lk, window=window)
        rect = visible.view(nq, bm, nk, 128).any(3).any(1)
        visitors = {}
        for n in range(nk):
            steps = [tuple(x) for x in walks[n].tolist() if x[0] >= 0]
            seen = [(h, m) for h, m, _ in steps]
            expected = {(h, m) for m in range(nq) if rect[m, n] for h in range(heads)}
            assert len(seen) == len(set(seen)) and set(seen) == expected, (lq, lk, left, right, n)
            for step, (h, m, rank) in enumerate(steps):
                visitors.setdefault((h, m), []).append((n, rank, step))
        for at, found in visitors.items():
            assert [rank for _, rank, _ in sorted(found)] == list(range(len(found))), (lq, lk, left, right, at)
            steps = [step for _, _, step in sorted(found)]
            assert steps == sorted(steps), (lq, lk, left, right, at)


def test_block_sparse_backward_visibility_bits_match_the_elements():
    """The Hopper block-sparse backward's per-thread visibility words (BlockSparseQTiles::
    visible_bits_t, run on the host by a private op for all 256 consumer threads of a 64-query x
    128-key tile) equal the bits visible() gives element by element: full blocks (all set but past
    Lk), partial blocks of random masks at both query-block sizes, both query tiles of a 128-row
    block, and a key block cut by Lk. A wrong bit, word or shift (the two keys of a thread share one
    32-bit word) fails it; a full block reads no mask word."""
    gen = torch.Generator().manual_seed(0)
    checked = 0
    for q_block in (64, 128):
        masks = torch.randint(-(2**31), 2**31 - 1, (3, q_block, 4), generator=gen, dtype=torch.int64).int()
        masks[2] = 0  # a partial row that hides everything
        for lk, n_block in ((4096, 5), (1000, 7), (901, 7), (129, 1)):
            for pid in (-1, 0, 1, 2):
                for m0 in range(0, q_block, 64):
                    bits, ref = torch.ops.sparse_attn._block_bwd_visible_bits(masks, q_block, lk, n_block, pid, 0, m0)
                    assert torch.equal(bits, ref), (q_block, lk, n_block, pid, m0)
                    if pid < 0 and (n_block + 1) * 128 <= lk:
                        assert bool((bits == 0xFFFFFFFF).all())
                    checked += int((ref != 0).any())
    assert checked > 0
    with pytest.raises(RuntimeError, match="pid out of range"):
        torch.ops.sparse_attn._block_bwd_visible_bits(masks, 128, 4096, 5, 3, 0, 0)


@pytest.mark.cuda
@pytest.mark.parametrize("d", [64, 128])
def test_cuda_ordered_dq_over_the_dense_family(d):
    """The deterministic mode's ordered dQ reductions (Hopper; elsewhere the dQ kernel): causal,
    bands with either bound or both, dense rows, Lq != Lk either way (rows with no key), GQA 8:1
    walked head-innermost, and more CTAs than SMs (4k keys x 16 (batch, kv head)s): gradients
    against fp32 autograd of the reference on the GPU, and bit-identical over three runs."""
    cases = (
        (2, 24, 3, 2048, 2048, {"causal": True}),
        (2, 24, 3, 1900, 2048, {"causal": True}),
        (1, 8, 2, 1500, 1000, {"causal": True}),
        (2, 8, 2, 2048, 1900, {"window": (300, 50)}),
        (1, 8, 8, 777, 1333, {"window": (None, 200)}),
        (1, 8, 8, 1333, 777, {"window": (0, None)}),
        (2, 8, 8, 4096, 4096, {}),
    )
    torch.use_deterministic_algorithms(True)
    try:
        for b, h, hkv, lq, lk, kw in cases:
            q, k, v = make_qkv(b, h, hkv, lq, lk, d, dtype=torch.bfloat16, seed=lq + lk, device="cuda")
            g = torch.randn(b, h, lq, d, generator=torch.Generator().manual_seed(2)).bfloat16().cuda()
            fn = lambda a, b_, c, kw=kw: sparse_attn.flash_attention(a, b_, c, return_lse=True, **kw)  # noqa: E731
            first = _grads(fn, q, k, v, g)
            for _ in range(2):
                for a, again in zip(first, _grads(fn, q, k, v, g), strict=True):
                    assert torch.equal(a, again), kw
            mask = band_mask(lq, lk, kw.get("causal", False), kw.get("window")).cuda()
            gold = _grads(
                lambda a, b_, c, m=mask: reference.attention(a, b_, c, mask=m, dtype=torch.float32), q, k, v, g
            )
            for what, a, ref in zip(("dq", "dk", "dv"), first, gold, strict=True):
                assert torch.isfinite(a).all(), (what, kw)
                torch.testing.assert_close(
                    a.float(), ref.float(), atol=2e-2, rtol=2e-2, msg=lambda m, w=what, kw=kw: f"{w} {kw}: {m}"
                )
    finally:
        torch.use_deterministic_algorithms(False)


def test_gradcheck_fp32():
    """torch.autograd.gradcheck against finite differences. The ops take no fp64, so in fp32 with
    the step and tolerances fp32 allows (a wrong formula misses by orders of magnitude more)."""
    q, k, v = (t.requires_grad_(True) for t in make_qkv(1, 2, 1, 11, 11, 8, dtype=torch.float32, seed=21))
    mask = patterns.longformer(11, 3, [0])
    for fn in (
        lambda a, b, c: sparse_attn.flash_attention(a, b, c, causal=True),
        lambda a, b, c: sparse_attn.flash_attention(a, b, c, window=(3, 1)),
        lambda a, b, c: sparse_attn.block_sparse_attention(a, b, c, mask),
    ):
        assert torch.autograd.gradcheck(fn, (q, k, v), eps=1e-2, atol=2e-3, rtol=2e-2, fast_mode=True)


def test_exported_program_trains(device):
    """torch.export of a layer with our op: the exported module's gradients equal eager's."""

    class Layer(torch.nn.Module):
        def forward(self, q, k, v):
            return sparse_attn.flash_attention(q, k, v, causal=True)

    q, k, v = make_qkv(1, 4, 2, 70, 70, 64, dtype=torch.bfloat16, device=device, seed=22)
    exported = torch.export.export(Layer(), (q, k, v)).module()
    grads = []
    for run in (Layer(), exported):
        args = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
        run(*args).float().square().sum().backward()
        grads.append([a.grad for a in args])
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(a, b, atol=0, rtol=0)
