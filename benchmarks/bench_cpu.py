"""CPU speed against PyTorch SDPA's CPU path, measured in the same process (issue 32's targets).

    python benchmarks/bench_cpu.py                              # flash and block-sparse tables
    python benchmarks/bench_cpu.py --lengths 256 1024 --dtypes float32 --tables flash
    python benchmarks/bench_cpu.py --backward                   # also the backward of flash

Tables:
- `flash`: `flash_attention` (causal and not) against SDPA on the same inputs (SDPA picks its CPU
  flash kernel); target >= 1.0x SDPA at L = 256-8k in fp32 and bf16.
- `block_sparse`: `block_sparse_attention` on random block masks and a window at the given
  densities against SDPA's *dense* non-causal attention; target >= 3x at 10 % density.

Every pair (ours, SDPA) is timed in rotated rounds (sparse_attn.bench.time_rounds) and the ratio
is the median of the per-round ratios; `ratio` = SDPA time / ours (> 1: we are faster). GFLOP/s
count 4 * D FLOPs per computed (query, key) pair (the masked pairs of causal and sparse masks not
counted). Threads: torch's (torch.get_num_threads(); ours use OpenMP with the same count).
"""

from __future__ import annotations

import argparse
import platform
import sys

import torch
import torch.nn.functional as F

import sparse_attn
from sparse_attn import patterns
from sparse_attn.bench import ratio_median, time_rounds

CPU = torch.device("cpu")


def _inputs(b, h, lq, d, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(b, h, lq, d, generator=g).to(dtype) for _ in range(3)]


def _gflops(pairs: float, d: int, ms: float) -> float:
    return 4.0 * d * pairs / (ms * 1e-3) / 1e9


def _flash_fns(q, k, v, causal: bool, backward: bool):
    """(ours, SDPA): the forward, or forward and backward, of flash_attention and SDPA on q, k, v."""
    if not backward:
        return (
            lambda: sparse_attn.flash_attention(q, k, v, causal=causal),
            lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal),
        )
    q, k, v = (t.detach().requires_grad_(True) for t in (q, k, v))
    go = torch.randn_like(q)

    def grads(fn):
        return lambda: torch.autograd.grad(fn(), (q, k, v), go)

    return (
        grads(lambda: sparse_attn.flash_attention(q, k, v, causal=causal)),
        grads(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal)),
    )


def flash_table(args) -> list[str]:
    lines = [
        "| dtype | L | causal | ours ms | SDPA ms | ratio | ours GFLOP/s |",
        "|---|---|---|---|---|---|---|",
    ]
    worst = float("inf")
    for dtype in args.dtypes:
        dt = getattr(torch, dtype)
        for L in args.lengths:
            for causal in (False, True):
                q, k, v = _inputs(args.batch, args.heads, L, args.head_dim, dt)
                ours, sdpa = _flash_fns(q, k, v, causal, args.backward)
                t = time_rounds({"ours": ours, "sdpa": sdpa}, CPU, rounds=args.rounds)
                ms_o, ms_s = sorted(t["ours"])[len(t["ours"]) // 2], sorted(t["sdpa"])[len(t["sdpa"]) // 2]
                r = ratio_median(t["sdpa"], t["ours"])
                worst = min(worst, r)
                pairs = args.batch * args.heads * (L * (L + 1) / 2 if causal else L * L)
                flops_mult = 3.5 if args.backward else 1.0  # forward + backward = 3.5x the forward
                lines.append(
                    f"| {dtype} | {L} | {causal} | {ms_o:.2f} | {ms_s:.2f} | {r:.2f} | "
                    f"{_gflops(pairs * flops_mult, args.head_dim, ms_o):.0f} |"
                )
                print(lines[-1], flush=True)
    lines.append("")
    lines.append(f"worst ratio (SDPA / ours): {worst:.2f}")
    return lines


def block_sparse_table(args) -> list[str]:
    lines = [
        "| dtype | L | mask | density | ours ms | SDPA dense ms | ratio | ours GFLOP/s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for dtype in args.dtypes:
        dt = getattr(torch, dtype)
        for L in args.lengths:
            if L < 1024:
                continue  # a 10 % mask needs at least 10 blocks a row
            q, k, v = _inputs(args.batch, args.heads, L, args.head_dim, dt)
            masks = {f"random {int(d * 100)} %": patterns.random_blocks(L, d, seed=0) for d in args.densities}
            masks["window L/10"] = patterns.sliding_window(L, max(1, L // 20))
            for name, mask in masks.items():
                fns = {
                    "ours": lambda q=q, k=k, v=v, mask=mask: sparse_attn.block_sparse_attention(q, k, v, mask),
                    "sdpa": lambda q=q, k=k, v=v: F.scaled_dot_product_attention(q, k, v),
                }
                t = time_rounds(fns, CPU, rounds=args.rounds)
                ms_o, ms_s = sorted(t["ours"])[len(t["ours"]) // 2], sorted(t["sdpa"])[len(t["sdpa"]) // 2]
                dens = mask.density()
                pairs = args.batch * args.heads * L * L * dens
                lines.append(
                    f"| {dtype} | {L} | {name} | {dens:.3f} | {ms_o:.2f} | {ms_s:.2f} | "
                    f"{ratio_median(t['sdpa'], t['ours']):.2f} | {_gflops(pairs, args.head_dim, ms_o):.0f} |"
                )
                print(lines[-1], flush=True)
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", type=int, nargs="+", default=[256, 1024, 4096, 8192])
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--tables", nargs="+", default=["flash", "block_sparse"], choices=["flash", "block_sparse"])
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--densities", type=float, nargs="+", default=[0.05, 0.1, 0.25])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--backward", action="store_true", help="flash: time forward + backward")
    args = ap.parse_args(argv)
    print(
        f"# CPU: {platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, "
        f"torch {torch.__version__}; B={args.batch} H={args.heads} D={args.head_dim}",
        flush=True,
    )
    out: list[str] = []
    if "flash" in args.tables:
        out += ["", "flash" + (" forward + backward" if args.backward else "")] + flash_table(args)
    if "block_sparse" in args.tables:
        out += ["", "block-sparse vs SDPA dense"] + block_sparse_table(args)
    print("\n".join(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
