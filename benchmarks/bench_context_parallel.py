"""Context parallelism on the GPUs of one host: sparse_attn.distributed.context_parallel_attention (the
schedule its plan picks, and the K/V ring in the "ring" columns; zigzag layout) against one GPU's
flash_attention and SDPA cuDNN on the whole sequence, and against PyTorch's context-parallel SDPA
(torch.distributed.tensor.experimental.context_parallel) on the same GPUs, in one run (bf16, B = 1,
H = Hkv = 16, D = 128, causal); then block-sparse masks (context_parallel_block_sparse_attention)
and indexer top-k (context_parallel_topk_attention, one K/V head, k = 2048) against one GPU on the
same inputs (``--tables`` picks).

Times: median of --reps calls, each the slowest rank's (CUDA events, barrier before each call).
Memory: peak bytes allocated during a forward call on the largest rank (inputs included), against one
GPU's; "fb mem" the same for a forward and backward (the output's gradient among the inputs).
The projection to more GPUs uses the measured per-step compute and the measured link bandwidth.

    torchrun --nproc_per_node 2 benchmarks/bench_context_parallel.py --lengths 131072 262144
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys

import torch
import torch.distributed as dist

import sparse_attn
from sparse_attn import distributed as cp

B, H, D = 1, 16, 128
DT = torch.bfloat16


def timed(fn, reps: int) -> float:
    """Median over reps of the slowest rank's milliseconds for fn()."""
    fn()
    times = []
    for _ in range(reps):
        dist.barrier()
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        t = torch.tensor([a.elapsed_time(b)], device="cuda")
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        times.append(t.item())
    return statistics.median(times)


def peak_bytes(fn) -> int:
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


def link_bandwidth(world: int) -> float:
    """GB/s of a 256 MiB ring exchange (each rank sends to the next, receives from the previous)."""
    rank = dist.get_rank()
    x = torch.empty(128 << 20, dtype=torch.bfloat16, device="cuda")
    y = torch.empty_like(x)

    def step():
        ops = [dist.P2POp(dist.isend, x, (rank + 1) % world), dist.P2POp(dist.irecv, y, (rank - 1) % world)]
        for req in dist.batch_isend_irecv(ops):
            req.wait()

    ms = timed(step, 5)
    return x.numel() * 2 / (ms * 1e-3) / 1e9


def torch_cp(q, k, v, mesh):
    """PyTorch's context-parallel SDPA on the whole-sequence tensors (sharded inside the context)."""
    from torch.distributed.tensor.experimental import context_parallel
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def run():
        with context_parallel(mesh, buffers=[q, k, v], buffer_seq_dims=[2, 2, 2]):
            with sdpa_kernel([SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION]):
                return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)

    return run


def measure(length: int, reps: int, mesh, world: int, bw: float) -> dict:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    g = torch.Generator(device="cuda").manual_seed(length)
    q, k, v = (torch.randn(B, H, length, D, device="cuda", dtype=DT, generator=g) for _ in range(3))

    def cudnn():
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)

    def ours_one():
        return sparse_attn.flash_attention(q, k, v, causal=True)

    ql, kl, vl = (cp.shard_sequence(t) for t in (q, k, v))

    def ours_cp(method=None):
        return cp.context_parallel_attention(ql, kl, vl, causal=True, seq_len=length, method=method)

    def ours_ring():
        return ours_cp("ring")

    one, one_cudnn, ours, ring = (timed(f, reps) for f in (ours_one, cudnn, ours_cp, ours_ring))
    mem_one = peak_bytes(ours_one) + 3 * q.numel() * 2  # inputs included
    # the largest rank's peak (the ranks' buffers differ with their slices)
    mems = torch.tensor([float(peak_bytes(f) + 3 * ql.numel() * 2) for f in (ours_cp, ours_ring)], device="cuda")
    dist.all_reduce(mems, op=dist.ReduceOp.MAX)
    mem_cp, mem_ring = mems.tolist()
    try:
        theirs = timed(torch_cp(q.clone(), k.clone(), v.clone(), mesh), reps)
    except Exception as e:  # noqa: BLE001  (an API this torch lacks)
        if dist.get_rank() == 0:
            print(f"  torch context_parallel failed: {str(e).splitlines()[0][:120]}")
        theirs = float("nan")
    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
    dout = torch.randn_like(q)
    qlg, klg, vlg = (t.clone().requires_grad_() for t in (ql, kl, vl))
    dl = cp.shard_sequence(dout)

    def fb_one_fn():
        return torch.autograd.grad(sparse_attn.flash_attention(qg, kg, vg, causal=True), (qg, kg, vg), dout)

    def fb_cp_fn(method=None):
        out = cp.context_parallel_attention(qlg, klg, vlg, causal=True, seq_len=length, method=method)
        return torch.autograd.grad(out, (qlg, klg, vlg), dl)

    fb_one, fb_cp, fb_ring = (timed(f, reps) for f in (fb_one_fn, fb_cp_fn, lambda: fb_cp_fn("ring")))
    fb_mem_one = peak_bytes(fb_one_fn) + 4 * q.nbytes  # q, k, v and the output's gradient
    fb_mems = [float(peak_bytes(f) + 4 * ql.nbytes) for f in (fb_cp_fn, lambda: fb_cp_fn("ring"))]
    fb_mems = torch.tensor(fb_mems, device="cuda")
    dist.all_reduce(fb_mems, op=dist.ReduceOp.MAX)
    fb_mem_cp, fb_mem_ring = fb_mems.tolist()
    return dict(
        length=length,
        world=world,
        one_ms=one,
        one_cudnn_ms=one_cudnn,
        cp_ms=ours,
        torch_cp_ms=theirs,
        speedup=one / ours,
        vs_torch_cp=theirs / ours,
        fwd_bwd_one_ms=fb_one,
        fwd_bwd_cp_ms=fb_cp,
        fwd_bwd_speedup=fb_one / fb_cp,
        fwd_bwd_mem_ratio=fb_mem_cp / fb_mem_one,
        ring_fwd_bwd_ms=fb_ring,
        ring_fwd_bwd_mem_ratio=fb_mem_ring / fb_mem_one,
        mem_ratio=mem_cp / mem_one,
        method=cp.plan_context_parallel(True, heads=(H, H), world=world).method,
        ring_ms=ring,
        ring_mem_ratio=mem_ring / mem_one,
        link_gbs=bw,
    )


def _train(op, inputs, mask, grad):
    """Forward and backward of op(q, k, v, mask) (the gradients of q, k and v)."""
    leaves = [t.detach().requires_grad_() for t in inputs]
    torch.autograd.grad(op(*leaves, mask), leaves, grad)


def measure_sparse(length: int, reps: int) -> list[tuple[str, float, float, float | None]]:
    """One GPU's block_sparse_attention against context_parallel_block_sparse_attention on the same
    mask (128-token blocks, both run by the block kernel): Longformer (window 2048, 64 global
    tokens), a plain band of 2048, BigBird (window 2048, 2 global tokens, 3 random blocks per row)
    and random blocks at 5 %; (name, one GPU ms, CP ms, CP peak memory / one GPU's) per schedule,
    forward (peaks with the inputs, the largest rank's), then forward + backward (no memory; the
    schedule that method=None picks is marked)."""
    from sparse_attn import BlockSparseMask, patterns

    g = torch.Generator(device="cuda").manual_seed(length)
    q, k, v = (torch.randn(B, H, length, D, device="cuda", dtype=DT, generator=g) for _ in range(3))
    band = patterns.sliding_window(length, 2048, device="cuda")
    masks = {
        "longformer": patterns.longformer(length, 2048, range(64), device="cuda"),
        # The band without its exact form, so that one GPU runs it by the block kernel too.
        "band": BlockSparseMask._trusted(
            band.kv_num_blocks, band.kv_indices, band.kv_partial, band.partial_masks, band.seq_lengths, band.block_size
        ),
        "bigbird": patterns.bigbird(length, 2048, 2, 3, device="cuda"),
        "random 5%": patterns.random_blocks(length, 0.05, seed=1, device="cuda"),
    }
    ql, kl, vl = (cp.shard_sequence(t) for t in (q, k, v))
    dout = torch.randn_like(q)
    dout_l = cp.shard_sequence(dout)
    out = []
    for name, mask in masks.items():
        one = timed(lambda mask=mask: sparse_attn.block_sparse_attention(q, k, v, mask), reps)
        mem_one = peak_bytes(lambda mask=mask: sparse_attn.block_sparse_attention(q, k, v, mask)) + 3 * q.nbytes
        for method in ("alltoall", "allgather"):

            def ours(mask=mask, method=method):
                return cp.context_parallel_block_sparse_attention(ql, kl, vl, mask, method=method)

            t = timed(ours, reps)
            mem = torch.tensor(float(peak_bytes(ours) + 3 * ql.nbytes), device="cuda")
            dist.all_reduce(mem, op=dist.ReduceOp.MAX)
            out.append((f"{name} {method}", one, t, mem.item() / mem_one))

        one_fb = timed(lambda mask=mask: _train(sparse_attn.block_sparse_attention, (q, k, v), mask, dout), reps)
        picked = cp.plan_context_parallel_block_sparse(mask, dist.get_world_size(), dist.get_rank()).method
        for method in ("alltoall", "allgather"):
            train = functools.partial(cp.context_parallel_block_sparse_attention, method=method)
            cp_fb = timed(lambda mask=mask, train=train: _train(train, (ql, kl, vl), mask, dout_l), reps)
            out.append((f"{name} fwd+bwd {method}{' (picked)' if method == picked else ''}", one_fb, cp_fb, None))
    return out


def measure_topk(length: int, reps: int, k: int = 2048) -> list[tuple[str, float, float, float]]:
    """One GPU's topk_attention with the lightning indexer (HI = 4, DI = 64; one K/V head, 16 query
    heads, as DeepSeek's sparse attention) against context_parallel_topk_attention on the same
    inputs, both exchanges; (name, one GPU ms, CP ms, CP peak memory / one GPU's)."""
    g = torch.Generator(device="cuda").manual_seed(length)
    q = torch.randn(B, H, length, D, device="cuda", dtype=DT, generator=g)
    k_, v = (torch.randn(B, 1, length, D, device="cuda", dtype=DT, generator=g) for _ in range(2))
    iq = torch.randn(B, length, 4, 64, device="cuda", dtype=DT, generator=g)
    ik = torch.randn(B, length, 64, device="cuda", dtype=DT, generator=g)
    iw = torch.rand(B, length, 4, device="cuda", dtype=DT, generator=g)

    def one():
        return sparse_attn.topk_attention(q, k_, v, k, causal=True, index_query=iq, index_key=ik, index_weights=iw)

    ql, kl, vl = (cp.shard_sequence(t) for t in (q, k_, v))
    iql, ikl, iwl = (cp.shard_sequence(t, dim=1) for t in (iq, ik, iw))
    t_one = timed(one, reps)
    mem_one = peak_bytes(one) + sum(t.numel() * 2 for t in (q, k_, v, iq, ik, iw))
    out = []
    for method in ("alltoall", "allgather"):

        def ours(method=method):
            return cp.context_parallel_topk_attention(
                ql, kl, vl, k, causal=True, index_query=iql, index_key=ikl, index_weights=iwl, method=method
            )

        mem = peak_bytes(ours) + sum(t.numel() * 2 for t in (ql, kl, vl, iql, ikl, iwl))
        out.append((f"top-k {method}", t_one, timed(ours, reps), mem / mem_one))
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=int, nargs="+", default=[131072, 262144])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--json")
    parser.add_argument("--tables", nargs="+", default=["flash", "sparse", "topk"], choices=["flash", "sparse", "topk"])
    args = parser.parse_args(argv)
    if "RANK" not in os.environ:
        print("run under torchrun: torchrun --nproc_per_node 2 benchmarks/bench_context_parallel.py", file=sys.stderr)
        return 1
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(rank)
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cuda", (world,))
    bw = link_bandwidth(world)
    rows = []
    if rank == 0:
        print(f"{world} x {torch.cuda.get_device_name()}; ring exchange {bw:.0f} GB/s per direction")
        print(
            f"{'L':>8} {'1 GPU ours':>10} {'1 GPU cuDNN':>11} {'CP ours':>8} {'torch CP':>8} "
            f"{'speedup':>7} {'vs torch':>8} {'fwd+bwd 1':>9} {'fwd+bwd CP':>10} {'mem':>5} "
            f"{'ring ms':>8} {'ring mem':>8} {'fb mem':>6} {'ring fb ms':>10} {'ring fb mem':>11}"
        )
    for length in args.lengths if "flash" in args.tables else ():
        row = measure(length, args.reps, mesh, world, bw)
        rows.append(row)
        if rank == 0:
            print(
                f"{length:>8} {row['one_ms']:>10.2f} {row['one_cudnn_ms']:>11.2f} {row['cp_ms']:>8.2f} "
                f"{row['torch_cp_ms']:>8.2f} {row['speedup']:>7.2f} {row['vs_torch_cp']:>8.2f} "
                f"{row['fwd_bwd_one_ms']:>9.2f} {row['fwd_bwd_cp_ms']:>10.2f} {row['mem_ratio']:>5.2f} "
                f"{row['ring_ms']:>8.2f} {row['ring_mem_ratio']:>8.2f} {row['fwd_bwd_mem_ratio']:>6.2f} "
                f"{row['ring_fwd_bwd_ms']:>10.2f} {row['ring_fwd_bwd_mem_ratio']:>11.2f}"
            )
        torch.cuda.empty_cache()
    for length in args.lengths if "sparse" in args.tables else ():
        for name, one, ours, mem in measure_sparse(length, args.reps):
            rows.append(
                dict(length=length, world=world, table=name, one_ms=one, cp_ms=ours, speedup=one / ours, mem_ratio=mem)
            )
            if rank == 0:
                note = "" if mem is None else f", memory {mem:.2f}"
                print(f"{name} {length}: one GPU {one:.2f} ms, CP {ours:.2f} ms: {one / ours:.2f}x{note}")
        torch.cuda.empty_cache()
    for length in args.lengths if "topk" in args.tables else ():
        for name, one, ours, mem in measure_topk(length, args.reps):
            rows.append(
                dict(length=length, world=world, table=name, one_ms=one, cp_ms=ours, speedup=one / ours, mem_ratio=mem)
            )
            if rank == 0:
                print(f"{name} {length}: one GPU {one:.2f} ms, CP {ours:.2f} ms: {one / ours:.2f}x, memory {mem:.2f}")
        torch.cuda.empty_cache()
    if rank == 0 and any("one_cudnn_ms" in r for r in rows):
        # Projection: P ranks, zigzag causal: P ring steps of (measured compute per step) overlapped with
        # one K/V shard transfer each.
        last = [r for r in rows if "one_cudnn_ms" in r][-1]
        length = last["length"]
        flops_rate = 4 * D * H * length * length / 2 / (last["one_ms"] * 1e-3)  # one GPU's causal rate
        for p in (2, 4, 8):
            for big in (length, 1 << 20):
                step = 4 * D * H * big * big / 2 / p / p / flops_rate
                xfer = 2 * B * H * (big / p) * D * 2 / (bw * 1e9)
                total = p * max(step, xfer)
                one = 4 * D * H * big * big / 2 / flops_rate
                print(
                    f"projection P={p} L={big}: step compute {step * 1e3:.1f} ms, K/V transfer {xfer * 1e3:.1f} ms "
                    f"-> {one / total:.2f}x one GPU"
                )
    if rank == 0 and args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
