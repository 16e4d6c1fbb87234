"""Block-sparse attention on the GPU against FlexAttention on the identical mask, measured in one run.

    python benchmarks/bench_block_sparse.py                         # L = 16k and 64k, every pattern
    python benchmarks/bench_block_sparse.py --lengths 4096 --patterns random window
    python benchmarks/bench_block_sparse.py --build-lengths 131072  # mask construction time only

Each pattern is written once as a FlexAttention ``mask_mod`` (how Flex users write it);
``create_block_mask`` gives Flex's BlockMask and ``BlockSparseMask.from_flex`` ours, so both
kernels compute exactly the same (query, key) pairs. Mask creation is excluded from the timings.
Columns: effective TFLOP/s counts only computed pairs (4·D per pair); `vs flex` = Flex time /
our time (> 1: we are faster); `vs d·flash` = our time / (density × our dense flash time);
`prop` = our time / (density × dense time + 20 us / 1.15), the "time proportional to density" check
(<= 1.15 means time <= 1.15 × d × dense + 20 us); `eff/dense` = our effective TFLOP/s / our dense
TFLOP/s (>= 0.85: within 15 % of dense). Ours, Flex and our dense flash are timed in turn over
`--rounds` rounds for every pattern, and each ratio is the median of the per-round ratios (the GPU's
clock drifts by several per cent over a run; a dense time taken once at the start moved the 16k ratios
by up to 10 %). The construction table times building each pattern with `sparse_attn.patterns` on
the GPU against Flex's `create_block_mask`, and relates it to our attention time at that length
(each the median of 20 calls after a warm-up; Flex's create_block_mask under torch.compile, as
recommended for long sequences; its eager form materialises L x L and runs out of memory at 128k).
"""

from __future__ import annotations

import argparse
import datetime
import math
import os
import statistics
import sys
from functools import partial

# Flex's eager create_block_mask at 64k asks for 32 GB blocks; after the 16k rounds the caching
# allocator's fragments could not hold one (seen with --patterns dilated). Set before torch loads.
os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")

import torch  # noqa: E402

import sparse_attn
from sparse_attn import BlockSparseMask, patterns
from sparse_attn.bench import flex_fn, ratio_median, require_cuda, tflops, time_ms, time_rounds

BLOCK = 128


def flex_mask_mods(length: int, device):
    """name -> (mask_mod, our pattern builder) for the benchmark's patterns at this length."""
    gen = torch.Generator().manual_seed(0)
    nb = math.ceil(length / BLOCK)

    def random_mod(density):
        blocks = torch.rand(nb, nb, generator=gen) < density
        blocks |= torch.eye(nb, dtype=torch.bool)
        blocks = blocks.to(device)
        return (lambda b, h, q, kv: blocks[q // BLOCK, kv // BLOCK]), (
            lambda: BlockSparseMask.from_block_matrix(blocks, seq_lengths=(length, length))
        )

    mods = {}
    for pct in (1, 3, 5, 10, 25, 50, 75):
        mods[f"random {pct}%"] = random_mod(pct / 100)

    def window_mod(w, b, h, q, kv):
        return (q - kv).abs() < w

    for w in (256, 1024, 4096):
        mods[f"window {w}"] = (partial(window_mod, w), partial(patterns.sliding_window, length, w, device=device))

    def causal_window_mod(w, b, h, q, kv):
        return (q >= kv) & (q - kv < w)

    # The causal sliding window of Mistral- and Gemma-style layers (DESIGN's Flex reference: w = 1024).
    mods["window 1024 causal"] = (
        partial(causal_window_mod, 1024),
        partial(patterns.sliding_window, length, 1024, causal=True, device=device),
    )
    gtok = 64
    mods["longformer w=512 g=64"] = (
        lambda b, h, q, kv: ((q - kv).abs() < 512) | (q < gtok) | (kv < gtok),
        lambda: patterns.longformer(length, 512, range(gtok), device=device),
    )
    rnd = torch.rand(nb, nb, generator=gen).topk(3, dim=-1).indices
    rblocks = torch.zeros(nb, nb, dtype=torch.bool).scatter_(-1, rnd, True).to(device)
    mods["bigbird w=256 g=64 r=3"] = (
        lambda b, h, q, kv: ((q - kv).abs() < 256) | (q < gtok) | (kv < gtok) | rblocks[q // BLOCK, kv // BLOCK],
        lambda: patterns.bigbird(length, 256, gtok, 3, seed=0, device=device),
    )
    mods["dilated w=2048 r=2"] = (
        lambda b, h, q, kv: ((q - kv).abs() < 2048) & ((q - kv).abs() % 2 == 0),
        lambda: patterns.dilated(length, 2048, 2, device=device),
    )
    seg = 4096
    mods["dilated2d seg=4096 r=2"] = (
        lambda b, h, q, kv: (q // seg == kv // seg) & ((q % seg) % 2 == 0) & ((kv % seg) % 2 == 0),
        lambda: patterns.dilated_2d(length, seg, 2, device=device),
    )
    return mods


def balanced_like(mask: BlockSparseMask, length: int, device) -> BlockSparseMask:
    """The same number of blocks as `mask`, spread evenly over the query blocks (a block band)."""
    nb = mask.num_q_blocks
    per_row = max(1, round(float(mask.kv_num_blocks.double().mean())))
    qb = torch.arange(nb, device=device)[:, None]
    kb = torch.arange(nb, device=device)[None, :]
    start = (qb - per_row // 2).clamp(min=0, max=max(0, nb - per_row))
    blocks = (kb >= start) & (kb < start + per_row)
    return BlockSparseMask.from_block_matrix(blocks, seq_lengths=(length, length))


def sync_time_ms(fn, reps=20) -> float:
    """Median wall time of fn() including its host synchronisations (for mask construction), over
    `reps` calls after a warm-up. Building a pattern is bound by the host's cost per op, which
    varies between calls on the lent machines (best and median of 5 differed by up to 2x)."""
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(reps):
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def make_qkv(b, h, length, d, dev):
    gen = torch.Generator().manual_seed(length)
    shape = (b, length, h, d)
    return [torch.randn(*shape, generator=gen).to(torch.bfloat16).to(dev).transpose(1, 2) for _ in range(3)]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=int, nargs="*", default=[16384, 65536])
    parser.add_argument("--build-lengths", type=int, nargs="*", default=[131072])
    parser.add_argument("--patterns", nargs="*", default=None, help="substrings of pattern names to run")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--no-flex", action="store_true")
    parser.add_argument("--rounds", type=int, default=3, help="timing rounds per pattern (ours, Flex, dense)")
    parser.add_argument("--markdown", default=None)
    args = parser.parse_args(argv)
    if not require_cuda("bench_block_sparse.py"):
        return 2
    dev = torch.device("cuda")
    from torch.nn.attention.flex_attention import create_block_mask

    header = (
        f"{datetime.date.today()} | {torch.cuda.get_device_name()} | torch {torch.__version__} | "
        f"B={args.batch} H={args.heads} D={args.head_dim} bf16 | blocks {BLOCK}x{BLOCK}"
    )
    print(header, flush=True)
    lines = [
        "| L | pattern | density | ours ms | ours TFLOP/s | flex ms | vs flex | vs d·flash | prop | eff/dense |",
        "|" + "---|" * 10,
    ]
    extra = []
    flex = flex_fn(dev)
    for length in args.lengths:
        qkv = make_qkv(args.batch, args.heads, length, args.head_dim, dev)
        dense = partial(sparse_attn.flash_attention, *qkv)
        dense_pairs = args.batch * args.heads * length * length
        dense_all = []
        for name, (mod, build) in flex_mask_mods(length, dev).items():
            if args.patterns and not any(p in name for p in args.patterns):
                continue
            fbm = create_block_mask(mod, None, None, length, length, device=dev, BLOCK_SIZE=BLOCK)
            ours = BlockSparseMask.from_flex(fbm)
            density = ours.density()
            pairs = float(ours.computed_pairs().double().mean()) * args.batch * args.heads
            fns = {"ours": partial(sparse_attn.block_sparse_attention, *qkv, ours), "dense": dense}
            if not args.no_flex:
                try:
                    out_f = flex(*qkv, block_mask=fbm)
                    out_o = sparse_attn.block_sparse_attention(*qkv, ours)
                    err = float((out_f.float() - out_o.float()).abs().max())
                    assert err < 5e-2, f"{name}: ours and Flex disagree by {err}"
                    fns["flex"] = partial(flex, *qkv, block_mask=fbm)
                    # Flex's BlockMask itself passed at every call, as Flex's users do (converted
                    # on the first call, the conversion kept with the mask object).
                    fns["ours_flex_mask"] = partial(sparse_attn.block_sparse_attention, *qkv, fbm)
                except (RuntimeError, torch.OutOfMemoryError) as e:  # noqa: PERF203
                    print(f"flex failed on {name}: {str(e).splitlines()[0][:100]}", flush=True)
            if name.startswith(("dilated", "window")):
                # The same mask from patterns.dilated / dilated_2d / sliding_window, which
                # block_sparse_attention runs as dense attention over the positions it connects (no
                # masked pairs computed) or as flash_attention with the window.
                routed = partial(sparse_attn.block_sparse_attention, *qkv, build())
                err = float((routed().float() - fns["ours"]().float()).abs().max())
                assert err < 5e-2, f"{name}: the pattern route and the block kernel disagree by {err}"
                fns["ours_pattern"] = routed
            t = time_rounds(fns, dev, args.rounds)
            dense_all += t["dense"]
            ours_ms = statistics.median(t["ours"])
            flex_ms, vs_flex = float("nan"), float("nan")
            if "flex" in t:
                flex_ms, vs_flex = statistics.median(t["flex"]), ratio_median(t["flex"], t["ours"])
            vs_d = ratio_median(t["ours"], [density * x for x in t["dense"]])
            prop = ratio_median(t["ours"], [density * x + 0.020 / 1.15 for x in t["dense"]])
            eff = ratio_median([x / dense_pairs for x in t["dense"]], [x / pairs for x in t["ours"]])
            lines.append(
                f"| {length} | {name} | {density:.3f} | {ours_ms:.3f} | {tflops(pairs, args.head_dim, ours_ms):.1f} | "
                f"{flex_ms:.3f} | {vs_flex:.2f} | {vs_d:.2f} | {prop:.2f} | {eff:.2f} |"
            )
            print(lines[-1], flush=True)
            if "ours_flex_mask" in t:
                tf = t["ours_flex_mask"]
                extra.append(
                    f"- L={length}: {name} with Flex's BlockMask passed per call: {statistics.median(tf):.3f} ms, "
                    f"vs flex {ratio_median(t['flex'], tf):.2f} (converted once: {ours_ms:.3f} ms)"
                )
                print(extra[-1], flush=True)
            if "ours_pattern" in t:
                tp = t["ours_pattern"]
                p_flex = ratio_median(t["flex"], tp) if "flex" in t else float("nan")
                p_prop = ratio_median(tp, [density * x + 0.020 / 1.15 for x in t["dense"]])
                p_eff = ratio_median([x / dense_pairs for x in t["dense"]], [x / pairs for x in tp])
                extra.append(
                    f"- L={length}: {name} built by `patterns` (its route): "
                    f"{statistics.median(tp):.3f} ms vs {ours_ms:.3f} ms on the Flex-built mask; "
                    f"vs flex {p_flex:.2f}, prop {p_prop:.2f}, eff/dense {p_eff:.2f} (pairs of the block mask)"
                )
                print(extra[-1], flush=True)
            if name.startswith("longformer"):
                bal = balanced_like(ours, length, dev)
                tb = time_rounds(
                    {"ours": fns["ours"], "bal": partial(sparse_attn.block_sparse_attention, *qkv, bal)},
                    dev,
                    args.rounds,
                )
                extra.append(
                    f"- L={length}: longformer with 64 global tokens (density {density:.3f}) "
                    f"{statistics.median(tb['ours']):.3f} ms vs a balanced band of the same block count (density "
                    f"{bal.density():.3f}) {statistics.median(tb['bal']):.3f} ms: ratio "
                    f"{ratio_median(tb['ours'], tb['bal']):.2f} (target <= 1.3)"
                )
                print(extra[-1], flush=True)
        if dense_all:
            dense_ms = statistics.median(dense_all)
            lines.append(
                f"| {length} | dense flash_attention (median of all rounds) | 1.000 | {dense_ms:.3f} | "
                f"{tflops(dense_pairs, args.head_dim, dense_ms):.1f} | | | | | |"
            )
            print(lines[-1], flush=True)
        del qkv
        torch.cuda.empty_cache()

    build = [
        "| L | pattern | ours build ms | flex create_block_mask ms | our attention ms | build / attention |",
        "|" + "---|" * 6,
    ]
    # Compiled: Flex's eager create_block_mask materialises L x L (OOM at 128k). (Its _compile=True
    # flag does the same and is deprecated.)
    compiled_create_block_mask = torch.compile(create_block_mask)
    for length in args.build_lengths:
        qkv = make_qkv(args.batch, args.heads, length, args.head_dim, dev)
        for name, (mod, builder) in flex_mask_mods(length, dev).items():
            if args.patterns and not any(p in name for p in args.patterns):
                continue
            if name.startswith("random") and name != "random 10%":
                continue
            ours_build = sync_time_ms(builder)
            flex_build = float("nan")
            if not args.no_flex:
                flex_build = sync_time_ms(
                    partial(compiled_create_block_mask, mod, None, None, length, length, device=dev)
                )
            attn = time_ms(partial(sparse_attn.block_sparse_attention, *qkv, builder()), dev)
            build.append(
                f"| {length} | {name} | {ours_build:.3f} | {flex_build:.3f} | {attn:.3f} | {ours_build / attn:.3f} |"
            )
            print(build[-1], flush=True)
        del qkv
        torch.cuda.empty_cache()

    # The construction table only when it has rows (`--build-lengths` with no length turns it off).
    tables = [lines, extra] + ([build] if len(build) > 2 else [])
    text = header + "\n\n" + "\n\n".join("\n".join(t) for t in tables) + "\n"
    print(text)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
