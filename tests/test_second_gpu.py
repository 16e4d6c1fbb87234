"""Every op on the second GPU while the current device stays cuda:0 (the device-guard bug class of
FlashInfer #452 / #924: kernels launched on the current device with another device's pointers).
Each call runs on cuda:0 and on cuda:1 from the same CPU inputs; the results must be equal (the
same kernels on the same kind of GPU: bitwise for forwards, within a bf16 rounding for gradients,
whose fp32 reductions may land in another order). Needs two GPUs; skips cleanly otherwise."""

from __future__ import annotations

import contextlib

import pytest
import torch

import sparse_attn
from sparse_attn import patterns
from sparse_attn._plan import overrides

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs two GPUs"),
]

B, H, HKV, L, D = 2, 8, 2, 384, 128
DEVICES = ("cuda:0", "cuda:1")
DT = torch.bfloat16


def _inputs(seed, *shapes, dtype=DT):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g).to(dtype) for s in shapes]


def _on(x, device):
    """CPU inputs (tensors, lists, tuples, dicts of them) moved to ``device``."""
    if isinstance(x, torch.Tensor):
        return x.to(device)
    if isinstance(x, (list, tuple)):
        return type(x)(_on(t, device) for t in x)
    if isinstance(x, dict):
        return {k: _on(v, device) for k, v in x.items()}
    return x


def _both(fn, cpu_args, *, grads=False):
    """fn(*args) on cuda:0 and on cuda:1 (the current device kept at cuda:0): its outputs equal,
    and with ``grads`` the gradients of the floating inputs close (a weighted sum of the floating
    outputs is the loss)."""
    assert torch.cuda.current_device() == 0
    outs, grads_of = [], []
    for device in DEVICES:
        args = _on(cpu_args, device)
        leaves = [a for a in args if grads and isinstance(a, torch.Tensor) and a.is_floating_point()]
        for a in leaves:
            a.requires_grad_()
        out = fn(*args)
        out = list(out) if isinstance(out, (tuple, list)) else [out]
        for o in out:
            assert o.device == torch.device(device), f"an output on {o.device}, the inputs on {device}"
        if leaves:
            floating = [o for o in out if o.is_floating_point()]
            loss = sum((o.float() * torch.linspace(-1, 1, o.shape[-1], device=device)).sum() for o in floating)
            loss.backward()
        torch.cuda.synchronize(device)
        assert torch.cuda.current_device() == 0, "an op changed the current device"
        outs.append([o.detach().cpu() for o in out])
        grads_of.append([a.grad.cpu() for a in leaves])
    for i, (a, b) in enumerate(zip(*outs, strict=True)):
        assert torch.equal(a, b), f"output {i} differs between cuda:0 and cuda:1"
    for a, b in zip(*grads_of, strict=True):
        torch.testing.assert_close(a.float(), b.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("window", [None, (100, 0)])
def test_flash_train(window):
    q, k, v = _inputs(1, (B, H, L, D), (B, HKV, L, D), (B, HKV, L, D))
    _both(lambda q, k, v: sparse_attn.flash_attention(q, k, v, causal=True, window=window), (q, k, v), grads=True)


def test_block_sparse_train():
    q, k, v = _inputs(2, (B, H, L, D), (B, HKV, L, D), (B, HKV, L, D))

    def run(q, k, v):
        mask = patterns.longformer(L, 64, [0, 200], block_size=64, device=q.device) | patterns.random_blocks(
            L, 0.3, 3, block_size=64, device=q.device
        )
        return sparse_attn.block_sparse_attention(q, k, v, mask)

    _both(run, (q, k, v), grads=True)


@pytest.mark.parametrize("block_size", [None, 64])
def test_topk_train(block_size):
    q, k, v = _inputs(3, (B, H, L, D), (B, HKV, L, D), (B, HKV, L, D))
    _both(
        lambda q, k, v: sparse_attn.topk_attention(
            q, k, v, 2 if block_size else 48, block_size=block_size, causal=True, return_indices=True
        ),
        (q, k, v),
        grads=True,
    )


@pytest.mark.parametrize("route", ["gather", "masked_block", None])
def test_topk_given_selection(route):
    # A user's selection per K/V head: its canonical form, the selection mask, the union measure.
    q, k, v = _inputs(4, (B, H, L, D), (B, HKV, L, D), (B, HKV, L, D))
    g = torch.Generator().manual_seed(5)
    idx = torch.randint(-1, L, (B, HKV, L, 40), generator=g, dtype=torch.int32)

    def run(q, k, v, idx):
        if route is None:
            return sparse_attn.topk_attention(q, k, v, indices=idx, causal=True, return_lse=True)
        with overrides(topk_attention_route=route):
            return sparse_attn.topk_attention(q, k, v, indices=idx, causal=True, return_lse=True)

    _both(run, (q, k, v, idx))


def test_topk_indexer():
    q, k, v = _inputs(6, (B, H, L, D), (B, 1, L, D), (B, 1, L, D))
    iq, ik, iw = _inputs(7, (B, L, 4, 64), (B, L, 64), (B, L, 4))
    _both(
        lambda q, k, v, iq, ik, iw: sparse_attn.topk_attention(
            q, k, v, 64, causal=True, index_query=iq, index_key=ik, index_weights=iw, return_indices=True
        ),
        (q, k, v, iq, ik, iw),
    )


@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("splits", [None, 3])
def test_kvcache_decode(paged, splits):
    cap, page = 1024, 64
    lens = torch.tensor([700, 1000], dtype=torch.int32)
    q, kn, vn = _inputs(8, (B, H, 2, D), (B, HKV, 2, D), (B, HKV, 2, D))
    if paged:
        kc, vc = _inputs(9, (B * cap // page, page, HKV, D), (B * cap // page, page, HKV, D))
        table = torch.randperm(B * cap // page, generator=torch.Generator().manual_seed(10)).to(torch.int32)
        table = table.view(B, cap // page)
    else:
        kc, vc = _inputs(9, (B, HKV, cap, D), (B, HKV, cap, D))
        table = None

    def run(q, kc, vc, lens, kn, vn, table):
        with overrides(decode_splits=splits) if splits else contextlib.nullcontext():
            out, lse = sparse_attn.attention_with_kvcache(
                q, kc, vc, lens, key=kn, value=vn, block_table=table, return_lse=True
            )
        return out, lse, kc, vc  # the appended rows land in the second device's cache

    _both(run, (q, kc, vc, lens, kn, vn, table))


def test_kvcache_topk_decode():
    cap = 1024
    lens = torch.tensor([700, 1024], dtype=torch.int32)
    q, kc, vc = _inputs(11, (B, H, 1, D), (B, HKV, cap, D), (B, HKV, cap, D))
    iq, iw, ik = _inputs(12, (B, 1, 4, 64), (B, 1, 4), (B, cap, 64))

    def run(q, kc, vc, lens, iq, iw, ik):
        mask = sparse_attn.kvcache_topk_mask(iq, iw, ik, lens, 3)
        return sparse_attn.attention_with_kvcache(q, kc, vc, lens, mask=mask, return_lse=True)

    _both(run, (q, kc, vc, lens, iq, iw, ik))


def test_varlen():
    lens = [37, 1, 300, 64]
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    n = sum(lens)
    q, k, v = _inputs(13, (n, H, D), (n, HKV, D), (n, HKV, D))
    _both(
        lambda q, k, v, cu: sparse_attn.flash_attention_varlen(
            q, k, v, cu, cu, max(lens), max(lens), causal=True, return_lse=True
        ),
        (q, k, v, cu),
    )
    _both(
        lambda q, k, v, cu: sparse_attn.topk_attention_varlen(
            q, k, v, cu, cu, max(lens), max(lens), 16, causal=True, return_lse=True
        ),
        (q, k, v, cu),
    )
