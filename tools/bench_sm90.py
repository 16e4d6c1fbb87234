"""Hopper core A/B timing in one process: ours with the Hopper core as planned, with plan
overrides (tile shapes, one CTA per tile) and with the portable core, against SDPA cuDNN, SDPA
FlashAttention-2 and compiled FlexAttention, same inputs, same run: every variant and reference
is timed once per round (--rounds), and the ratios are medians of the per-round ratios (the clock
drifts by several per cent over a run).

    python tools/bench_sm90.py --lengths 4096 16384 --head-dims 128 64
"""

import argparse
import statistics
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import sparse_attn
from sparse_attn._plan import overrides
from sparse_attn.bench import flex_fn, ratio_median, require_cuda, time_rounds


def with_options(fn, **options):
    """fn run with these plan overrides in force (sparse_attn._plan.overrides)."""

    def run():
        with overrides(**options):
            return fn()

    return run


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths", type=int, nargs="+", default=[4096, 16384])
    ap.add_argument("--head-dims", type=int, nargs="+", default=[128, 64])
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--variants", nargs="+", default=["hopper", "portable"])
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    ap.add_argument("--rounds", type=int, default=3, help="rounds in which every variant and reference is timed once")
    args = ap.parse_args()
    if not require_cuda("tools/bench_sm90.py"):
        return 2
    dev = torch.device("cuda")
    torch._dynamo.config.cache_size_limit = 64  # one compile per shape; never fall back to eager
    flex = flex_fn(dev)

    dtype = getattr(torch, args.dtype)
    print(f"{torch.cuda.get_device_name()} | torch {torch.__version__} | B={args.batch} H={args.heads} {args.dtype}")
    refs = " | cudnn | sdpa-flash | flex | ours/cudnn | ours/sdpa-flash | ours/flex |"
    print("| D | mask | L | " + " | ".join(args.variants) + refs)
    print("|---" * (len(args.variants) + 9) + "|")
    for d in args.head_dims:
        for causal in (False, True):
            for L in args.lengths:
                run_case(args, dtype, d, causal, L, flex, dev)


def run_case(args, dtype, d, causal, L, flex, dev):
    from torch.nn.attention.flex_attention import create_block_mask

    q, k, v = (torch.randn(args.batch, args.heads, L, d, device=dev, dtype=dtype) for _ in range(3))
    pairs = args.batch * args.heads * L * (L + 1) / 2 if causal else args.batch * args.heads * L * L
    tf = lambda ms: 4 * pairs * d / ms / 1e9  # noqa: E731
    # Each variant: our flash_attention with these plan overrides in force while it runs.
    variants = {
        "hopper": {},
        "portable": {"portable_only": True},
        "d64-rows128": {"tile": (128, 128)},
        "d64-rows192": {"tile": (192, 128)},
        "d64-keys192": {"tile": (128, 192)},
        "per-tile-grid": {"per_tile_grid": True},
    }
    ours = {
        name: with_options(lambda: sparse_attn.flash_attention(q, k, v, causal=causal), **options)
        for name, options in variants.items()
    }

    def cudnn():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

    def fa2():
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

    if causal:
        bm = create_block_mask(lambda b, h, i, j: i >= j, None, None, L, L, device=dev)
    else:
        bm = create_block_mask(lambda b, h, i, j: i >= 0, None, None, L, L, device=dev)
    fns = {name: ours[name] for name in args.variants} | {"cudnn": cudnn, "fa2": fa2}
    try:
        flex(q, k, v, block_mask=bm)
        fns["flex"] = lambda: flex(q, k, v, block_mask=bm)
    except Exception as e:  # noqa: BLE001
        print(f"flex failed: {type(e).__name__}", flush=True)
    # Every variant and reference once per round; ratios are medians of per-round ratios.
    t = time_rounds(fns, dev, args.rounds)
    med = {n: tf(statistics.median(x)) for n, x in t.items()}
    first = t[args.variants[0]]
    ratios = [ratio_median(t[r], first) if r in t else float("nan") for r in ("cudnn", "fa2", "flex")]
    cells = " | ".join(f"{med[n]:.1f}" for n in args.variants)
    refs = " | ".join(f"{med.get(n, float('nan')):.1f}" for n in ("cudnn", "fa2", "flex"))
    print(
        f"| {d} | {'causal' if causal else 'full'} | {L} | {cells} | {refs} | "
        + " | ".join(f"{x:.3f}" for x in ratios)
        + " |",
        flush=True,
    )


if __name__ == "__main__":
    sys.exit(main())
