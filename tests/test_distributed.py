"""Context parallelism on CPU process groups (gloo, 2 and 4 ranks): every rank's output shard and
its gradients equal the single-process flash_attention on the whole sequence, for the ring and
all-gather schedules, both layouts, causal, dense and windowed masks, GQA and lengths the world
size does not divide."""

from __future__ import annotations

import os
import socket
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import sparse_attn
from sparse_attn import distributed as cp

CASES = [
    # (seq_len, H, Hkv, causal, window, layout, method)
    (96, 2, 2, True, None, "zigzag", "ring"),
    (203, 4, 2, True, None, "zigzag", "ring"),
    (131, 2, 1, False, None, "contiguous", "ring"),
    (200, 2, 2, True, None, "contiguous", "ring"),
    (150, 4, 2, True, (17, 0), "zigzag", "allgather"),
    (97, 2, 2, False, (9, 30), "contiguous", "allgather"),
    (120, 2, 2, True, None, "zigzag", "allgather"),
    (77, 2, 1, False, (None, 5), "zigzag", None),
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, errors, backend: str = "gloo"):
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    dist.init_process_group(backend, rank=rank, world_size=world)
    torch.set_num_threads(1)
    # CPU: fp32, exact up to summation order. CUDA (NCCL): bf16, against the same op on one GPU.
    device, dtype, tol = ("cuda", torch.bfloat16, 3e-2) if backend == "nccl" else ("cpu", torch.float32, 1e-4)
    if device == "cuda":
        torch.cuda.set_device(rank)
    try:
        for case in CASES:
            length, h, hkv, causal, window, layout, method = case
            if device == "cuda":
                length *= 16
            g = torch.Generator().manual_seed(length)
            q, k, v = (torch.randn(1, heads, length, 64, generator=g).to(device, dtype) for heads in (h, hkv, hkv))
            dout = torch.randn(1, h, length, 64, generator=g).to(device, dtype)
            full = [t.clone().requires_grad_() for t in (q, k, v)]
            ref, ref_lse = sparse_attn.flash_attention(*full, causal=causal, window=window, return_lse=True)
            ref_grads = torch.autograd.grad(ref, full, dout)
            local = [cp.shard_sequence(t, layout=layout).requires_grad_() for t in (q, k, v)]
            out, lse = cp.context_parallel_attention(
                *local, causal=causal, window=window, layout=layout, method=method, return_lse=True
            )
            grads = torch.autograd.grad(out, local, cp.shard_sequence(dout, layout=layout))
            want = [cp.shard_sequence(t, layout=layout) for t in (ref.detach(), *ref_grads)]
            for name, got, exp in zip(("out", "dq", "dk", "dv"), (out, *grads), want, strict=True):
                err = (got.float() - exp.float()).abs().max().item()
                if not err <= tol * max(1.0, exp.float().abs().max().item()):
                    errors.put(f"rank {rank} {case}: {name} max error {err:.2e}")
            lse_want = cp.shard_sequence(ref_lse, layout=layout)
            if not torch.allclose(lse, lse_want, atol=tol):
                errors.put(f"rank {rank} {case}: lse differs")
            # The whole sequence back from the shards.
            whole = cp.gather_sequence(out.detach(), length, layout=layout)
            if not torch.allclose(whole.float(), ref.detach().float(), atol=tol):
                errors.put(f"rank {rank} {case}: gather_sequence differs")
        if device == "cpu":
            _block_sparse_case(rank, world, errors)
    except Exception:  # noqa: BLE001  (reported to the test process)
        errors.put(f"rank {rank}: {traceback.format_exc()}")
    finally:
        dist.destroy_process_group()


def _block_sparse_case(rank, world, errors):
    """A global Longformer-style mask (window + global tokens) over 2P * 64-token chunks."""
    from sparse_attn import patterns

    length = 2 * world * 64 * 2
    g = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(1, 2, length, 32, generator=g) for _ in range(3))
    dout = torch.randn(1, 2, length, 32, generator=g)
    mask = patterns.longformer(length, 48, range(8), block_size=64)
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = sparse_attn.block_sparse_attention(*full, mask)
    ref_grads = torch.autograd.grad(ref, full, dout)
    for method in ("alltoall", "allgather", None):
        local = [cp.shard_sequence(t).requires_grad_() for t in (q, k, v)]
        out = cp.context_parallel_block_sparse_attention(*local, mask, method=method)
        grads = torch.autograd.grad(out, local, cp.shard_sequence(dout))
        for name, got, exp in zip(("out", "dq", "dk", "dv"), (out, *grads), (ref, *ref_grads), strict=True):
            err = (got - cp.shard_sequence(exp.detach())).abs().max().item()
            if not err <= 1e-4:
                errors.put(f"rank {rank} block-sparse {method}: {name} max error {err:.2e}")


@pytest.mark.parametrize("world", [2, 4])
def test_context_parallel_matches_one_process(world):
    ctx = mp.get_context("spawn")
    errors = ctx.SimpleQueue()
    mp.start_processes(_worker, args=(world, _free_port(), errors), nprocs=world, start_method="spawn")
    found = []
    while not errors.empty():
        found.append(errors.get())
    assert not found, "\n".join(found)


@pytest.mark.cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_context_parallel_nccl_two_gpus():
    ctx = mp.get_context("spawn")
    errors = ctx.SimpleQueue()
    mp.start_processes(_worker, args=(2, _free_port(), errors, "nccl"), nprocs=2, start_method="spawn")
    found = []
    while not errors.empty():
        found.append(errors.get())
    assert not found, "\n".join(found)


def test_chunk_bounds():
    # Zigzag: 2P chunks, rank r holds r and 2P - 1 - r; sizes differ by at most one.
    b = cp.chunk_bounds(10, 2, "zigzag")
    assert b == [[(0, 3), (8, 2)], [(3, 3), (6, 2)]]
    assert cp.chunk_bounds(7, 3, "contiguous") == [[(0, 3)], [(3, 2)], [(5, 2)]]
    with pytest.raises(ValueError, match="layout"):
        cp.chunk_bounds(10, 2, "striped")


def test_plan():
    assert cp.plan_context_parallel(causal=True).method == "ring"
    assert cp.plan_context_parallel(causal=True, window=(64, 0)).method == "allgather"
    with pytest.raises(ValueError, match="window needs method='allgather'"):
        cp.plan_context_parallel(causal=False, window=8, method="ring")


def test_needs_a_process_group():
    q = torch.randn(1, 2, 8, 32)
    with pytest.raises(RuntimeError, match="process group"):
        cp.context_parallel_attention(q, q, q)
