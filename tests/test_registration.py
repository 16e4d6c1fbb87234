"""Op-registration hygiene: schemas, fake kernels and autograd
registrations pass torch.library.opcheck; the public ops trace under torch.compile(fullgraph=True)
and match eager; the backward ops pass opcheck with inputs that require grad."""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from utils import make_qkv

import sparse_attn
from sparse_attn import patterns

# opcheck's schema test goes through TorchScript, which warns that it is deprecated.
pytestmark = pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")

OPS = torch.ops.sparse_attn
OP_NAMES = ["dense_fwd", "flash_fwd", "block_sparse_fwd", "gather_fwd", "topk_select", "indexer_select"]
ATTENTION_OPS = ["dense_fwd", "flash_fwd", "block_sparse_fwd", "gather_fwd"]


def _qkv(dtype=torch.float32, requires_grad=False, lq=40, lk=56):
    q, k, v = make_qkv(1, 4, 2, lq, lk, 64, dtype=dtype, seed=0)
    return tuple(t.detach().requires_grad_(requires_grad) for t in (q, k, v))


def _indexer(lq=40, lk=56, dtype=torch.float32):
    g = torch.Generator().manual_seed(1)
    return (
        torch.randn(1, lq, 2, 32, generator=g).to(dtype),
        torch.randn(1, lk, 32, generator=g).to(dtype),
        torch.randn(1, lq, 2, generator=g).to(dtype),
    )


def _block_args(m):
    return (m.kv_num_blocks, m.kv_indices, m.kv_partial, m.partial_masks, m.q_block, m.kv_block)


def _samples(name, dtype=torch.float32, requires_grad=False):
    """A few argument tuples per op, covering its optional arguments."""
    q, k, v = _qkv(dtype, requires_grad)
    lq, lk = q.shape[2], k.shape[2]
    if name == "dense_fwd":
        bool_mask = torch.rand(lq, lk, generator=torch.Generator().manual_seed(2)) < 0.5
        return [
            (q, k, v, None, None, False),
            (q, k, v, bool_mask, 0.3, True),
            (q, k, v, torch.randn(1, 1, lq, lk).to(dtype), None, False),
        ]
    if name == "flash_fwd":
        return [(q, k, v, None, False, -1, -1), (q, k, v, 0.2, True, 8, -1), (q, k, v, None, False, 3, 5)]
    if name == "block_sparse_fwd":
        masks = (patterns.causal(lq, lk, block_size=64), patterns.causal(lq, lk, block_size=128))
        return [(q, k, v, *_block_args(m), None) for m in masks]
    if name == "gather_fwd":
        idx = OPS.topk_select(q.detach(), k.detach(), 8, True)
        return [(q, k, v, idx, None), (q, k, v, idx[:, :1].contiguous(), 0.5)]
    if name == "topk_select":
        return [(q, k, 8, False), (q, k, 8, True), (q, k, 1000, False)]
    if name == "indexer_select":
        iq, ik, iw = _indexer(lq, lk, dtype)
        return [(iq, ik, iw, 8, False), (iq, ik, iw, 8, True)]
    raise AssertionError(name)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", OP_NAMES)
def test_opcheck(name, dtype):
    op = getattr(OPS, name).default
    for args in _samples(name, dtype):
        result = torch.library.opcheck(op, args)
        assert set(result.values()) == {"SUCCESS"}, result


@pytest.mark.parametrize("name", ATTENTION_OPS)
def test_opcheck_with_grad_inputs(name):
    # With inputs that require grad: the autograd registration, and the backward traced and run
    # through AOT dispatch (test_aot_dispatch_dynamic compares it with eager).
    op = getattr(OPS, name).default
    for args in _samples(name, requires_grad=True):
        result = torch.library.opcheck(op, args)
        assert set(result.values()) == {"SUCCESS"}, result


@pytest.mark.cuda
def test_opcheck_flash_fwd_out():
    # The in-place flash forward of varlen's packed output (CUDA only): schema (out and lse
    # mutated), fake kernel, dispatch.
    q, k, v = (t.cuda() for t in _qkv(torch.bfloat16))
    out = torch.empty(q.shape[0], q.shape[2], q.shape[1], v.shape[3], device="cuda", dtype=q.dtype).transpose(1, 2)
    lse = torch.empty(q.shape[:3], device="cuda")
    for extra in ((None, False, -1, -1), (0.2, True, 8, -1)):
        result = torch.library.opcheck(OPS._flash_fwd_out.default, (q, k, v, out, lse, *extra))
        assert set(result.values()) == {"SUCCESS"}, result
        OPS._flash_fwd_out(q, k, v, out, lse, *extra)  # (opcheck runs on copies)
        ref, ref_lse = OPS.flash_fwd(q, k, v, *extra)
        assert torch.equal(out, ref) and torch.equal(lse, ref_lse)


def test_every_op_is_registered():
    for name in OP_NAMES:
        assert torch._C._dispatch_has_kernel_for_dispatch_key(f"sparse_attn::{name}", "CPU"), name
    schema = str(OPS.flash_fwd.default._schema)
    assert "float? scale=None" in schema and "int window_left=-1" in schema
    assert str(OPS.topk_select.default._schema).endswith("-> Tensor")


@pytest.mark.parametrize("name", ["topk_select", "indexer_select"])
def test_fake_selection_clamps_k(name):
    # The fake kernels give the real output shapes, k clamped to Lk.
    args = _samples(name)[0]
    args = (*args[:-2], 1000, args[-1])
    real = getattr(OPS, name)(*args)
    with FakeTensorMode() as mode:
        fake_args = [mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args]
        fake = getattr(OPS, name)(*fake_args)
    assert fake.shape == real.shape and fake.dtype == real.dtype == torch.int32


# ---------------------------------------------------------------------------------------------
# torch.compile


def _public_calls():
    lq, lk = 40, 56
    mask = patterns.causal(lq, lk, block_size=64)
    blocks = torch.tensor([[True]])
    iq, ik, iw = _indexer(lq, lk)
    return {
        "dense": lambda q, k, v: sparse_attn.dense_attention(
            q,
            k,
            v,
            attn_mask=torch.ones(lq, lk, dtype=torch.bool).tril(lk - lq + 5),
            causal=True,
            return_lse=True,
        ),
        "flash": lambda q, k, v: sparse_attn.flash_attention(q, k, v, causal=True, window=(8, None), return_lse=True),
        "block_sparse": lambda q, k, v: (
            sparse_attn.block_sparse_attention(q, k, v, mask, return_lse=True),
            sparse_attn.block_sparse_attention(q, k, v, blocks, scale=0.1),
        ),
        "topk": lambda q, k, v: (
            sparse_attn.topk_attention(q, k, v, 8, causal=True, return_indices=True, return_lse=True),
            sparse_attn.topk_attention(q, k, v, 8, index_query=iq, index_key=ik, index_weights=iw, return_indices=True),
            sparse_attn.topk_attention(q, k, v, 1, block_size=64, return_indices=True),
        ),
    }


def _flat(x):
    if isinstance(x, torch.Tensor):
        return [x]
    return [t for item in x for t in _flat(item)]


class _GraphRecorder:
    """A torch.compile backend that keeps each captured graph and runs it eagerly."""

    def __init__(self):
        self.graphs = []

    def __call__(self, gm, example_inputs):
        self.graphs.append(gm)
        return gm.forward


@pytest.mark.parametrize("name", ["dense", "flash", "block_sparse", "topk"])
def test_compile_fullgraph_matches_eager(name):
    torch._dynamo.reset()
    fn = _public_calls()[name]
    q, k, v = _qkv()
    eager = _flat(fn(q, k, v))
    recorder = _GraphRecorder()
    traced = _flat(torch.compile(fn, fullgraph=True, backend=recorder)(q, k, v))
    assert len(recorder.graphs) == 1
    targets = {str(n.target) for n in recorder.graphs[0].graph.nodes if n.op == "call_function"}
    assert any(t.startswith("sparse_attn.") for t in targets), targets
    compiled = _flat(torch.compile(fn, fullgraph=True)(q, k, v))
    for a, b, c in zip(eager, traced, compiled, strict=True):
        assert torch.equal(a, b) and torch.equal(a, c)


@pytest.mark.parametrize("lq,lk", [(40, 56), (200, 200), (150, 330)])
@pytest.mark.parametrize("causal", [False, True])
def test_compile_topk_block_mode(lq, lk, causal):
    # Several 64-blocks: the causal selection builds patterns.causal's mask inside the graph.
    torch._dynamo.reset()

    def fn(q, k, v):
        return sparse_attn.topk_attention(q, k, v, 2, block_size=64, causal=causal, return_indices=True)

    q, k, v = _qkv(lq=lq, lk=lk)
    for a, b in zip(fn(q, k, v), torch.compile(fn, fullgraph=True)(q, k, v), strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("length", [64, 129, 512, 1000])
@pytest.mark.parametrize("block_size", [64, 128])
def test_compile_pattern_construction(length, block_size):
    # Patterns built inside a compiled function (the band builder is one op of its own there): the
    # same mask as eager (without merged partial blocks), and the same attention through it, at
    # lengths of one and of many blocks.
    q, k, v = _qkv(lq=length, lk=length)
    builders = {
        "causal": (lambda: patterns.causal(length, length, block_size=block_size, compact=False), length),
        "causal_compact": (lambda: patterns.causal(length - 7, length, block_size=block_size), length - 7),
        "window": (lambda: patterns.sliding_window(length, 100, block_size=block_size), length),
        "causal_window": (lambda: patterns.sliding_window(length, 300, causal=True, block_size=block_size), length),
    }
    for name, (build, lq) in builders.items():
        torch._dynamo.reset()
        traced = torch.compile(lambda build=build: build().to_dense(), fullgraph=True)()
        assert torch.equal(traced, build().to_dense()), name

        def fn(q, k, v, build=build):
            return sparse_attn.block_sparse_attention(q, k, v, build())

        assert torch.equal(torch.compile(fn, fullgraph=True)(q[:, :, :lq], k, v), fn(q[:, :, :lq], k, v)), name


def test_compile_dynamic_shapes():
    torch._dynamo.reset()

    def fn(q, k, v):
        out, lse = sparse_attn.flash_attention(q, k, v, causal=True, return_lse=True)
        top, idx = sparse_attn.topk_attention(q, k, v, 16, return_indices=True)
        return out, lse, top, idx

    compiled = torch.compile(fn, fullgraph=True, dynamic=True)
    for lq, lk in ((40, 56), (33, 90), (8, 8)):
        q, k, v = _qkv(lq=lq, lk=lk)
        for a, b in zip(fn(q, k, v), compiled(q, k, v), strict=True):
            assert a.shape == b.shape and torch.equal(a, b)


class Attention(torch.nn.Module):
    """A transformer attention layer: projections in (B, L, H * D), flash attention between."""

    def __init__(self, dim=128, heads=4, kv_heads=2, head_dim=32):
        super().__init__()
        self.h, self.hkv, self.d = heads, kv_heads, head_dim
        self.q = torch.nn.Linear(dim, heads * head_dim, bias=False)
        self.kv = torch.nn.Linear(dim, 2 * kv_heads * head_dim, bias=False)
        self.o = torch.nn.Linear(heads * head_dim, dim, bias=False)

    def forward(self, x):
        b, l, _ = x.shape
        q = self.q(x).view(b, l, self.h, self.d).transpose(1, 2)
        k, v = self.kv(x).view(b, l, 2, self.hkv, self.d).unbind(2)
        out = sparse_attn.flash_attention(q, k.transpose(1, 2), v.transpose(1, 2), causal=True)
        return self.o(out.transpose(1, 2).reshape(b, l, self.h * self.d))


def test_compile_attention_module():
    torch._dynamo.reset()
    torch.manual_seed(0)
    layer = Attention().eval()
    x = torch.randn(2, 77, 128)
    with torch.no_grad():
        eager = layer(x)
        recorder = _GraphRecorder()
        traced = torch.compile(layer, fullgraph=True, backend=recorder)(x)
        compiled = torch.compile(layer, fullgraph=True)(x)
    assert len(recorder.graphs) == 1
    assert torch.equal(traced, eager)
    torch.testing.assert_close(compiled, eager, atol=1e-5, rtol=1e-5)
    # The reference layer: the same projections around SDPA.
    q = layer.q(x).view(2, 77, 4, 32).transpose(1, 2)
    k, v = layer.kv(x).view(2, 77, 2, 2, 32).unbind(2)
    ref = torch.nn.functional.scaled_dot_product_attention(
        q, k.transpose(1, 2), v.transpose(1, 2), is_causal=True, enable_gqa=True
    )
    torch.testing.assert_close(eager, layer.o(ref.transpose(1, 2).reshape(2, 77, 128)), atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------------------------------------
# Backward


@pytest.mark.parametrize("name", ["dense", "flash", "block_sparse", "topk"])
def test_backward_of_every_public_call(name):
    # Each public call trains on the CPU: finite gradients for query, key and value (their values
    # are checked against the reference in test_backward.py); under no_grad a plain forward.
    q, k, v = _qkv(requires_grad=True)
    out = _flat(_public_calls()[name](q, k, v))[0]
    grads = torch.autograd.grad(out.square().sum(), (q, k, v), allow_unused=True)
    assert any(g is not None and g.abs().sum() > 0 for g in grads)
    assert all(g is None or torch.isfinite(g).all() for g in grads)
    with torch.no_grad():
        assert not _flat(_public_calls()[name](q, k, v))[0].requires_grad


@pytest.mark.parametrize(
    "case,match",
    [
        ("devices", r"query and key must be on the same device"),
        ("heads", r"number of query heads \(3\) must be a multiple"),
        ("dtype", r"query and value must have the same dtype"),
        ("head_dim", r"head dimension of query and key must be a multiple of 8"),
        ("mask_device", r"kv_num_blocks must be on the same device as query"),
    ],
)
def test_fake_kernels_check_like_the_real_ones(case, match):
    # Meta tensors reach the fake kernels: they refuse what the real kernels refuse (a meta query
    # with a CPU key used to return an uninitialised output), in the same words.
    meta = lambda *shape, dtype=torch.float32: torch.empty(*shape, device="meta", dtype=dtype)  # noqa: E731
    q, k, v = meta(1, 4, 8, 64), meta(1, 2, 8, 64), meta(1, 2, 8, 64)
    if case == "devices":
        k = torch.empty(1, 2, 8, 64)
    elif case == "heads":
        q = meta(1, 3, 8, 64)
    elif case == "dtype":
        v = meta(1, 2, 8, 64, dtype=torch.float16)
    elif case == "head_dim":
        q, k = meta(1, 4, 8, 60), meta(1, 2, 8, 60)
    if case == "mask_device":
        mask = patterns.causal(8, 8, block_size=64)
        with pytest.raises(RuntimeError, match=match):
            OPS.block_sparse_fwd(q, k, v, *mask._tensors(), 64, 64)
        return
    with pytest.raises(RuntimeError, match=match):
        OPS.flash_fwd(q, k, v)
    out, lse = OPS.flash_fwd(meta(1, 4, 8, 64), meta(1, 2, 8, 64), meta(1, 2, 8, 64))
    assert out.shape == (1, 4, 8, 64) and lse.shape == (1, 4, 8)


@pytest.mark.parametrize("grad_mode", ["no_grad", "inputs_without_grad", "inference_mode"])
def test_calls_that_need_no_gradient_skip_the_autograd_wrapper(grad_mode, monkeypatch):
    """Where no gradient can be needed the public ops dispatch below autograd (_meta.forward): the
    Python wrapper of register_autograd (which redispatches the op below itself) does not run, the
    results equal those of a differentiable call, and a call that needs gradients still gets them."""
    q, k, v = make_qkv(1, 2, 1, 70, 90, 32, seed=5)
    redispatched = []
    original = torch._ops.OpOverload.redispatch
    monkeypatch.setattr(
        torch._ops.OpOverload, "redispatch", lambda self, *a, **kw: redispatched.append(1) or original(self, *a, **kw)
    )
    qg, kg, vg = (t.clone().requires_grad_(True) for t in (q, k, v))
    want = sparse_attn.flash_attention(qg, kg, vg, causal=True)
    assert len(redispatched) == 1 and want.requires_grad
    if grad_mode == "no_grad":
        with torch.no_grad():
            got = sparse_attn.flash_attention(qg, kg, vg, causal=True)
    elif grad_mode == "inference_mode":
        with torch.inference_mode():
            got = sparse_attn.flash_attention(q, k, v, causal=True)
    else:
        got = sparse_attn.flash_attention(q, k, v, causal=True)
    assert len(redispatched) == 1, "the autograd wrapper ran for a call that needs no gradient"
    assert not got.requires_grad
    assert torch.equal(got, want.detach())
    want.sum().backward()
    assert qg.grad is not None and torch.isfinite(qg.grad).all()
