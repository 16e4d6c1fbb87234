"""Dense attention on the GPU: ours (flash, dense baseline) against SDPA's backends,
FlexAttention (compiled) and naive PyTorch, measured in one run.

    python benchmarks/bench_flash.py                       # full sweep (B=2, H=16)
    python benchmarks/bench_flash.py --lengths 4096 8192 --head-dims 128 --dtypes bfloat16
    python benchmarks/bench_flash.py --markdown benchmarks/results_flash.md

TFLOP/s counts 4 * D FLOPs per computed (query, key) pair (the causal triangle exactly).
Ratios are ours / reference; > 1 means we are faster. Peak MiB is the memory an op allocates
beyond its inputs (output included).
"""

from __future__ import annotations

import argparse
import datetime
import sys

import torch

import sparse_attn
from sparse_attn.bench import (
    flex_fn,
    naive_attention,
    peak_extra_bytes,
    require_cuda,
    run_sdpa,
    sdpa_backends,
    tflops,
    time_ms,
)

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}


def causal_pairs(lq: int, lk: int) -> int:
    off = lk - lq
    return sum(min(lk, max(0, i + off + 1)) for i in range(lq))


def bench_config(b, h, length, d, causal, dtype, device, *, flex: bool, naive_limit: int, dense_limit: int):
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(b, length, h, d, generator=gen).to(dtype).to(device).transpose(1, 2) for _ in range(3))
    pairs = b * h * (causal_pairs(length, length) if causal else length * length)
    impls = {"ours-flash": lambda: sparse_attn.flash_attention(q, k, v, causal=causal)}
    if length <= dense_limit:
        impls["ours-dense"] = lambda: sparse_attn.dense_attention(q, k, v, causal=causal)
    for name, backend in sdpa_backends(device).items():
        impls[name] = (lambda be: lambda: run_sdpa(q, k, v, be, causal=causal))(backend)
    if flex:
        flex_call = flex_fn(device)
        if causal:
            # Flex's own causal mask_mod, as its users write it (our bitmask-lookup conversion,
            # to_flex_block_mask, made Flex's compile fail: "No valid triton configs").
            from torch.nn.attention.flex_attention import create_block_mask

            bm = create_block_mask(lambda b, h, qi, ki: qi >= ki, None, None, length, length, device=device)
            impls["flex"] = lambda: flex_call(q, k, v, block_mask=bm)
        else:
            impls["flex"] = lambda: flex_call(q, k, v)
    if length <= naive_limit:
        impls["naive-pytorch"] = lambda: naive_attention(q, k, v, causal=causal)
    ref = sparse_attn.flash_attention(q, k, v, causal=causal)
    results = {}
    for name, fn in impls.items():
        try:
            out = fn()
            err = float((out.float() - ref.float()).abs().max()) if name != "ours-flash" else 0.0
            ms = time_ms(fn, device)
            mem = peak_extra_bytes(fn, device) / 2**20
        except (RuntimeError, torch.OutOfMemoryError) as e:
            results[name] = (float("nan"), float("nan"), float("nan"), f"skipped ({str(e).splitlines()[0][:50]})")
            continue
        results[name] = (ms, tflops(pairs, d, ms), mem, f"{err:.1e}")
    return results


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384, 32768])
    parser.add_argument("--head-dims", type=int, nargs="+", default=[64, 128])
    parser.add_argument("--dtypes", nargs="+", default=["bfloat16", "float16"], choices=sorted(DTYPES))
    parser.add_argument("--causal", choices=["both", "yes", "no"], default="both")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument(
        "--flex-lengths",
        type=int,
        nargs="*",
        default=[4096, 16384],
        help="lengths at which FlexAttention is compiled and timed (bf16 only)",
    )
    parser.add_argument("--naive-limit", type=int, default=8192)
    parser.add_argument("--dense-limit", type=int, default=8192)
    parser.add_argument("--markdown", default=None, help="also write the table as markdown to this file")
    args = parser.parse_args(argv)
    if not require_cuda("bench_flash.py"):
        return 2
    device = torch.device("cuda")
    torch.backends.cuda.matmul.allow_tf32 = False
    header = (
        f"{datetime.date.today()} | {torch.cuda.get_device_name()} | torch {torch.__version__} | "
        f"B={args.batch} H={args.heads}"
    )
    print(header, flush=True)
    causals = {"both": [False, True], "yes": [True], "no": [False]}[args.causal]
    lines = []
    for dname in args.dtypes:
        for d in args.head_dims:
            for causal in causals:
                for length in args.lengths:
                    flex = dname == "bfloat16" and length in args.flex_lengths
                    res = bench_config(
                        args.batch,
                        args.heads,
                        length,
                        d,
                        causal,
                        DTYPES[dname],
                        device,
                        flex=flex,
                        naive_limit=args.naive_limit,
                        dense_limit=args.dense_limit,
                    )
                    ours = res["ours-flash"][1]
                    for name, (ms, tf, mem, note) in res.items():
                        ratio = ours / tf if tf == tf and tf > 0 else float("nan")
                        line = (
                            f"| {dname} | {d} | {'causal' if causal else 'full'} | {length} | {name} | {ms:.3f} | "
                            f"{tf:.1f} | {ratio:.2f} | {mem:.0f} | {note} |"
                        )
                        lines.append(line)
                        print(line, flush=True)
    table = [
        "| dtype | D | mask | L | impl | ms | TFLOP/s | ours-flash / impl | peak MiB | max err vs ours |",
        "|---|---|---|---|---|---|---|---|---|---|",
        *lines,
    ]
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(header + "\n\n" + "\n".join(table) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
