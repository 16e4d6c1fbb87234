"""Backward passes on the GPU against SDPA (cuDNN, FlashAttention-2), FlexAttention and our own
forward, each table measured in one run (bf16, backward time only).

Backward time: one forward builds the graph, then ``torch.autograd.grad(out, (q, k, v), dO,
retain_graph=True)`` is timed (median, triton's do_bench). TFLOP/s counts 2.5x the forward's
FLOPs (4·D per computed pair): the backward's five matrix products against the forward's two.
Ratios (`vs cudnn`, `vs flex`, ...) are the other's time over ours from the same round.

    python benchmarks/bench_backward.py                       # every table at the default sizes
    python benchmarks/bench_backward.py --tables flash --lengths 4096 8192
    python benchmarks/bench_backward.py --tables gqa          # GQA / MQA shapes of real models
    python benchmarks/bench_backward.py --tables gqa_block_sparse   # block-sparse masks with GQA / MQA
"""

from __future__ import annotations

import argparse
import math
import sys

import torch

import sparse_attn
from sparse_attn import BlockSparseMask
from sparse_attn.bench import flex_fn, ratio_median, require_cuda, run_sdpa, sdpa_backends, time_rounds


def backward_fn(forward, q, k, v):
    """A callable timing only the backward of forward(q, k, v) (graph built once)."""
    q, k, v = (t.detach().requires_grad_(True) for t in (q, k, v))
    out = forward(q, k, v)
    g = torch.randn_like(out)
    return lambda: torch.autograd.grad(out, (q, k, v), g, retain_graph=True)


def ours_and_sdpa(q, k, v, causal, backends):
    """Backward callables of our flash_attention and SDPA's cuDNN and FA2 backends on (q, k, v)."""
    return {
        "ours": backward_fn(lambda a, b, c: sparse_attn.flash_attention(a, b, c, causal=causal), q, k, v),
        "cudnn": backward_fn(lambda a, b, c: run_sdpa(a, b, c, backends["sdpa-cudnn"], causal=causal), q, k, v),
        "fa2": backward_fn(lambda a, b, c: run_sdpa(a, b, c, backends["sdpa-flash"], causal=causal), q, k, v),
    }


def portable(fn):
    """fn() with the plan held to the portable (mma.sync) kernels."""
    with sparse_attn._plan.overrides(portable_only=True):
        return fn()


def deterministic(fn):
    """fn() under torch.use_deterministic_algorithms(True)."""
    torch.use_deterministic_algorithms(True)
    try:
        return fn()
    finally:
        torch.use_deterministic_algorithms(False)


def qkv(b, h, hkv, length, d, dev, seed=0):
    gen = torch.Generator().manual_seed(seed)
    mk = lambda heads: torch.randn(b, length, heads, d, generator=gen).to(torch.bfloat16).to(dev).transpose(1, 2)  # noqa: E731
    return mk(h), mk(hkv), mk(hkv)


def tflops_bwd(pairs: float, d: int, ms: float) -> float:
    return 2.5 * 4.0 * pairs * d / (ms * 1e-3) / 1e12


def flash_table(args, dev) -> list[str]:
    flex = flex_fn(dev)
    from torch.nn.attention.flex_attention import create_block_mask

    backends = sdpa_backends(dev)
    lines = [
        "| D | L | causal | ours ms | ours TFLOP/s | portable TFLOP/s | deterministic / ours | cudnn TFLOP/s "
        "| fa2 TFLOP/s | flex TFLOP/s | vs cudnn | vs fa2 | vs flex |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    worst = {}
    for d in args.head_dims:
        h = args.heads * 128 // d if args.scale_heads else args.heads
        for length in args.lengths:
            for causal in (False, True):
                q, k, v = qkv(args.batch, h, h, length, d, dev, seed=length)
                pairs = args.batch * h * length * length * (0.5 if causal else 1.0)
                fns = ours_and_sdpa(q, k, v, causal, backends)
                ours_portable = backward_fn(
                    lambda a, b, c, causal=causal: sparse_attn.flash_attention(a, b, c, causal=causal), q, k, v
                )
                fns["portable"] = lambda f=ours_portable: portable(f)
                fns["deterministic"] = lambda f=ours_portable: deterministic(f)
                if not args.no_flex:
                    bm = (
                        create_block_mask(lambda b, h, qi, kv: qi >= kv, None, None, length, length, device=dev)
                        if causal
                        else None
                    )
                    fns["flex"] = backward_fn(lambda a, b, c, bm=bm: flex(a, b, c, block_mask=bm), q, k, v)
                t = time_rounds(fns, dev, rounds=args.rounds)
                ms = {n: sorted(x)[len(x) // 2] for n, x in t.items()}
                r = {n: ratio_median(t[n], t["ours"]) for n in fns if n not in ("ours", "portable", "deterministic")}
                tf = {n: tflops_bwd(pairs, d, m) for n, m in ms.items()}
                lines.append(
                    f"| {d} | {length} | {causal} | {ms['ours']:.3f} | {tf['ours']:.0f} | {tf['portable']:.0f} | "
                    f"{ratio_median(t['deterministic'], t['ours']):.2f} | {tf['cudnn']:.0f} | "
                    f"{tf['fa2']:.0f} | {tf.get('flex', float('nan')):.0f} | {r['cudnn']:.2f} | {r['fa2']:.2f} | "
                    f"{r.get('flex', float('nan')):.2f} |"
                )
                if length >= 4096:
                    for n, x in r.items():
                        worst[n] = min(worst.get(n, math.inf), x)
                print(lines[-1], flush=True)
    lines.append("")
    lines.append("worst ratio at L >= 4k (their time / ours): " + ", ".join(f"{n} {x:.2f}" for n, x in worst.items()))
    return lines


# GQA and MQA shapes of real models (B, H, Hkv, L, D): Llama-style 32/8 and 64/8, 16/2, MQA 16/1.
GQA_SHAPES = [
    (1, 32, 8, 8192, 128),
    (1, 32, 8, 16384, 128),
    (2, 16, 2, 8192, 128),
    (1, 16, 2, 16384, 128),
    (1, 64, 8, 16384, 128),
    (1, 16, 1, 8192, 128),
    (1, 32, 8, 8192, 64),
    (1, 16, 2, 8192, 64),
]


def gqa_table(args, dev) -> list[str]:
    """GQA / MQA backward, causal and not, against cuDNN and FA2 (SDPA with enable_gqa)."""
    backends = sdpa_backends(dev)
    lines = [
        "| B | H | Hkv | L | D | causal | ours ms | ours TFLOP/s | cudnn TFLOP/s | fa2 TFLOP/s | vs cudnn | vs fa2 |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    worst = {}
    for b, h, hkv, length, d in GQA_SHAPES:
        for causal in (True, False):
            q, k, v = qkv(b, h, hkv, length, d, dev, seed=length + h)
            pairs = b * h * length * length * (0.5 if causal else 1.0)
            fns = ours_and_sdpa(q, k, v, causal, backends)
            t = time_rounds(fns, dev, rounds=args.rounds)
            ms = {n: sorted(x)[len(x) // 2] for n, x in t.items()}
            r = {n: ratio_median(t[n], t["ours"]) for n in ("cudnn", "fa2")}
            tf = {n: tflops_bwd(pairs, d, m) for n, m in ms.items()}
            lines.append(
                f"| {b} | {h} | {hkv} | {length} | {d} | {causal} | {ms['ours']:.3f} | {tf['ours']:.0f} | "
                f"{tf['cudnn']:.0f} | {tf['fa2']:.0f} | {r['cudnn']:.2f} | {r['fa2']:.2f} |"
            )
            for n, x in r.items():
                worst[n] = min(worst.get(n, math.inf), x)
            print(lines[-1], flush=True)
            del q, k, v, fns
    lines.append("")
    lines.append("worst ratio (their time / ours): " + ", ".join(f"{n} {x:.2f}" for n, x in worst.items()))
    return lines


def flex_mask_mods(length: int, dev, percents=(5, 10, 25, 50)) -> dict:
    """The block-sparse tables' masks as Flex mask_mods: random blocks, windows, Longformer."""
    nb = length // 128
    gen = torch.Generator().manual_seed(0)
    mods = {}
    for pct in percents:
        blocks = (torch.rand(nb, nb, generator=gen) < pct / 100) | torch.eye(nb, dtype=torch.bool)
        blocks = blocks.to(dev)
        mods[f"random {pct}%"] = lambda b_, h_, qi, kv, blocks=blocks: blocks[qi // 128, kv // 128]
    mods["window 1024"] = lambda b_, h_, qi, kv: (qi - kv).abs() < 1024
    mods["window 1024 causal"] = lambda b_, h_, qi, kv: (qi >= kv) & (qi - kv < 1024)
    mods["longformer w=512 g=64"] = lambda b_, h_, qi, kv: ((qi - kv).abs() < 512) | (qi < 64) | (kv < 64)
    return mods


def block_sparse_table(args, dev) -> list[str]:
    flex = flex_fn(dev)
    from torch.nn.attention.flex_attention import create_block_mask

    length, h = args.sparse_length, args.heads
    mods = flex_mask_mods(length, dev)
    lines = []
    for d in args.sparse_head_dims:
        q, k, v = qkv(args.batch, h, h, length, d, dev, seed=1)
        dense_bwd = backward_fn(lambda a, b, c: sparse_attn.flash_attention(a, b, c), q, k, v)
        lines += [
            f"B={args.batch} H={h} L={length} D={d} bf16",
            "",
            "| pattern | density | ours ms | flex ms | vs flex | ours / (density x our dense) |",
            "|---|---|---|---|---|---|",
        ]
        for name, mod in mods.items():
            fbm = create_block_mask(mod, None, None, length, length, device=dev)
            mask = BlockSparseMask.from_flex(fbm)
            density = float(mask.to_dense().float().mean()) if length <= 16384 else float("nan")
            fns = {
                "ours": backward_fn(
                    lambda a, b, c, mask=mask: sparse_attn.block_sparse_attention(a, b, c, mask), q, k, v
                ),
                "flex": backward_fn(lambda a, b, c, fbm=fbm: flex(a, b, c, block_mask=fbm), q, k, v),
                "dense": dense_bwd,
            }
            t = time_rounds(fns, dev, rounds=args.rounds)
            ms = {n: sorted(x)[len(x) // 2] for n, x in t.items()}
            prop = ms["ours"] / (density * ms["dense"])
            vs_flex = ratio_median(t["flex"], t["ours"])
            lines.append(
                f"| {name} | {density:.3f} | {ms['ours']:.3f} | {ms['flex']:.3f} | {vs_flex:.2f} | {prop:.2f} |"
            )
            print(lines[-1], flush=True)
        lines.append("")
    return lines


GQA_SPARSE_SHAPES = [(2, 16, 2, 128), (1, 16, 1, 128), (2, 16, 2, 64), (2, 32, 8, 128)]


def gqa_block_sparse_table(args, dev) -> list[str]:
    """Block-sparse backward with GQA / MQA: the plan's head splits against one CTA per key block
    (the bwd_head_splits override at 1) and Flex (enable_gqa) on the identical mask."""
    flex = flex_fn(dev)
    from torch.nn.attention.flex_attention import create_block_mask

    length = args.sparse_length
    mods = flex_mask_mods(length, dev, percents=(10,))
    mods["documents of 2048, causal"] = lambda b_, h_, qi, kv: (qi >= kv) & (qi // 2048 == kv // 2048)
    lines = [
        f"L={length} bf16; `1 CTA` = every key block's whole group walked by one CTA (the override at 1)",
        "",
        "| B | H | Hkv | D | pattern | splits | ours ms | 1 CTA ms | flex ms | vs 1 CTA | vs flex |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    splits = torch.ops.sparse_attn._bwd_head_splits
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    for b, h, hkv, d in GQA_SPARSE_SHAPES:
        q, k, v = qkv(b, h, hkv, length, d, dev, seed=h + hkv)
        planned = splits(b, h, hkv, length, length, -1, -1, d, sms, 64, block_sparse=True)
        for name, mod in mods.items():
            fbm = create_block_mask(mod, None, None, length, length, device=dev)
            mask = BlockSparseMask.from_flex(fbm)
            ours = backward_fn(lambda a, b_, c, mask=mask: sparse_attn.block_sparse_attention(a, b_, c, mask), q, k, v)

            def one_cta(fn=ours):
                with sparse_attn._plan.overrides(bwd_head_splits=1):
                    return fn()

            fns = {"ours": ours, "one": one_cta}
            if not args.no_flex:
                fns["flex"] = backward_fn(
                    lambda a, b_, c, fbm=fbm: flex(a, b_, c, block_mask=fbm, enable_gqa=True), q, k, v
                )
            t = time_rounds(fns, dev, rounds=args.rounds)
            ms = {n: sorted(x)[len(x) // 2] for n, x in t.items()}
            vs_flex = f"{ratio_median(t['flex'], t['ours']):.2f}" if "flex" in t else "-"
            flex_ms = f"{ms['flex']:.3f}" if "flex" in ms else "-"
            lines.append(
                f"| {b} | {h} | {hkv} | {d} | {name} | {planned} | {ms['ours']:.3f} | {ms['one']:.3f} | {flex_ms} | "
                f"{ratio_median(t['one'], t['ours']):.2f} | {vs_flex} |"
            )
            print(lines[-1], flush=True)
        del q, k, v
    return lines


def memory_table(args, dev) -> list[str]:
    """Peak memory a backward allocates beyond its three gradients (the fp32 dQ accumulator and
    the rows' statistics for ours), against SDPA cuDNN's, in one run."""
    backends = sdpa_backends(dev)
    lines = ["| L | D | ours extra MiB | cudnn extra MiB | B·H·L·D·4 bytes MiB |", "|---|---|---|---|---|"]
    for length in args.lengths:
        for d in args.head_dims:
            q, k, v = qkv(args.batch, args.heads, args.heads, length, d, dev, seed=5)
            extra = {}
            for name, fwd in (
                ("ours", lambda a, b, c: sparse_attn.flash_attention(a, b, c, causal=True)),
                ("cudnn", lambda a, b, c: run_sdpa(a, b, c, backends["sdpa-cudnn"], causal=True)),
            ):
                run = backward_fn(fwd, q, k, v)
                run()
                torch.cuda.synchronize()
                base = torch.cuda.memory_allocated()
                torch.cuda.reset_peak_memory_stats()
                grads = run()
                torch.cuda.synchronize()
                extra[name] = (
                    torch.cuda.max_memory_allocated() - base - sum(x.numel() * x.element_size() for x in grads)
                )
                del grads, run
            acc = args.batch * args.heads * length * d * 4
            lines.append(
                f"| {length} | {d} | {extra['ours'] / 2**20:.0f} | {extra['cudnn'] / 2**20:.0f} | {acc / 2**20:.0f} |"
            )
            print(lines[-1], flush=True)
    return lines


def atomic_table(dev) -> list[str]:
    """What the GPU sums with atomics: index_add_ of 256-float rows into random rows of a K/V-sized
    fp32 buffer (what top-k's backward does per selected key), in GB/s of added data."""
    rows, width, target = 1 << 20, 256, 65536
    src = torch.randn(rows, width, device=dev)
    idx = torch.randint(0, target, (rows,), device=dev)
    out = torch.zeros(target, width, device=dev)
    t = time_rounds({"index_add": lambda: out.index_add_(0, idx, src)}, dev, rounds=2)["index_add"]
    ms = sorted(t)[len(t) // 2]
    return [f"index_add_ of {rows} rows of {width} fp32 into {target} rows: {src.numel() * 4 / ms / 1e6:.0f} GB/s"]


def topk_table(args, dev) -> list[str]:
    """Backward of gathered attention given the selection, against its forward (MQA)."""
    length, kk, h, d = args.topk_length, 2048, args.topk_heads, 128
    q, k, v = qkv(1, h, 1, length, d, dev, seed=2)
    gen = torch.Generator(device=dev).manual_seed(0)
    # A causal random selection of k keys per query (what the selection kernels emit: ascending, -1 padded).
    rows = torch.arange(length, device=dev)[:, None]
    idx = (torch.rand(1, 1, length, kk, generator=gen, device=dev) * (rows + 1)).long()
    idx = torch.where(rows < kk, torch.arange(kk, device=dev).expand(length, kk), idx)
    idx = torch.where(idx <= rows, idx, -1).sort(-1).values.int()
    fwd = lambda: torch.ops.sparse_attn.gather_fwd(q, k, v, idx)  # noqa: E731
    out, lse = fwd()
    g = torch.randn_like(out)
    bwd = lambda: torch.ops.sparse_attn.gather_bwd(g, q, k, v, out, lse, None, idx)  # noqa: E731
    t = time_rounds({"fwd": fwd, "bwd": bwd}, dev, rounds=args.rounds)
    f, b = (sorted(t[n])[len(t[n]) // 2] for n in ("fwd", "bwd"))
    return [
        f"B=1 H={h} Hkv=1 L={length} k={kk} D={d} bf16",
        "",
        "| forward ms | backward ms | backward / forward |",
        "|---|---|---|",
        f"| {f:.3f} | {b:.3f} | {ratio_median(t['bwd'], t['fwd']):.2f} |",
    ]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--tables", nargs="+", default=["flash", "gqa", "block_sparse", "gqa_block_sparse", "topk", "memory"]
    )
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096, 8192, 16384])
    parser.add_argument("--head-dims", type=int, nargs="+", default=[128, 64])
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--scale-heads", action="store_true", help="H = heads * 128 / D (constant model width)")
    parser.add_argument("--sparse-length", type=int, default=16384)
    parser.add_argument("--sparse-head-dims", type=int, nargs="+", default=[128, 64])
    parser.add_argument("--topk-length", type=int, default=65536)
    parser.add_argument("--topk-heads", type=int, default=16, help="top-k table: query heads on one K/V head")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--no-flex", action="store_true")
    args = parser.parse_args(argv)
    if not require_cuda("bench_backward"):
        return 0
    dev = torch.device("cuda")
    print(f"# {torch.cuda.get_device_name(dev)}, torch {torch.__version__}")
    out = []
    if "flash" in args.tables:
        out += ["## flash backward", ""] + flash_table(args, dev) + [""]
    if "gqa" in args.tables:
        out += ["## flash backward, GQA and MQA (B, H, Hkv as given)", ""] + gqa_table(args, dev) + [""]
    if "block_sparse" in args.tables:
        out += ["## block-sparse backward", ""] + block_sparse_table(args, dev) + [""]
    if "gqa_block_sparse" in args.tables:
        out += ["## block-sparse backward, GQA and MQA", ""] + gqa_block_sparse_table(args, dev) + [""]
    if "topk" in args.tables:
        out += ["## top-k backward", ""] + topk_table(args, dev) + [""] + atomic_table(dev) + [""]
    if "memory" in args.tables:
        out += ["## memory beyond the gradients (causal)", ""] + memory_table(args, dev) + [""]
    print("\n".join(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
