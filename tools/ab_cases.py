"""A fixed set of GPU timings for A/B comparisons of two builds (e.g. a change against the commit
before it, built side by side): each process prints one JSON line {case: median ms}; run the two
builds' processes alternately and compare medians with --compare.

    PYTHONPATH=build_a python tools/ab_cases.py >> a.jsonl      # alternate with build b, 3+ times
    python tools/ab_cases.py --compare a.jsonl b.jsonl         # b / a per case (< 1: b faster)

Cases: B = 2, H = 16, bf16, D = 128 unless named; an SDPA cuDNN control shows the machine's drift.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys


def cases():
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import sparse_attn
    from sparse_attn import patterns

    dev, dt = "cuda", torch.bfloat16

    def qkv(L, d, hkv=16):
        g = torch.Generator(device=dev).manual_seed(L + d)
        q = torch.randn(2, 16, L, d, device=dev, dtype=dt, generator=g)
        k, v = (torch.randn(2, hkv, L, d, device=dev, dtype=dt, generator=g) for _ in range(2))
        return q, k, v

    def flash(L, d, **kw):
        q, k, v = qkv(L, d)
        return lambda: sparse_attn.flash_attention(q, k, v, **kw)

    def block(L, build, d=128):
        q, k, v = qkv(L, d)
        mask = build(L)
        # The same mask without its pattern tag, so that the block-sparse kernel runs it (as
        # tests/utils.py block_kernel_mask).
        plain = sparse_attn.BlockSparseMask(*mask._tensors(), seq_lengths=mask.seq_lengths, block_size=mask.block_size)
        return lambda: sparse_attn.block_sparse_attention(q, k, v, plain)

    def cudnn(L):
        q, k, v = qkv(L, 128)

        def run():
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                return F.scaled_dot_product_attention(q, k, v)

        return run

    def topk(L):
        g = torch.Generator(device=dev).manual_seed(L)
        q = torch.randn(1, 16, L, 128, device=dev, dtype=dt, generator=g)
        k, v = (torch.randn(1, 1, L, 128, device=dev, dtype=dt, generator=g) for _ in range(2))
        iq = torch.randn(1, L, 4, 64, device=dev, dtype=dt, generator=g)
        ik = torch.randn(1, L, 64, device=dev, dtype=dt, generator=g)
        iw = torch.randn(1, L, 4, device=dev, dtype=dt, generator=g)
        return lambda: sparse_attn.topk_attention(
            q, k, v, 2048, causal=True, index_query=iq, index_key=ik, index_weights=iw
        )

    return {
        "cudnn full 8k": cudnn(8192),
        "flash full 4k": flash(4096, 128),
        "flash full 16k": flash(16384, 128),
        "flash causal 8k": flash(8192, 128, causal=True),
        "flash d64 full 4k": flash(4096, 64),
        "flash d64 causal 4k": flash(4096, 64, causal=True),
        "flash window 256 16k": flash(16384, 128, window=(255, 255)),
        "flash d64 window 256 16k": flash(16384, 64, window=(255, 255)),
        "block random 10% 16k": block(16384, lambda L: patterns.random_blocks(L, 0.1, seed=1, device=dev)),
        "block window 256 16k": block(16384, lambda L: patterns.sliding_window(L, 256, device=dev)),
        "block longformer 16k": block(16384, lambda L: patterns.longformer(L, 512, range(0, L, 4096), device=dev)),
        "block bigbird 16k": block(16384, lambda L: patterns.bigbird(L, 512, 128, 3, device=dev)),
        "block d64 random 25% 16k": block(16384, lambda L: patterns.random_blocks(L, 0.25, device=dev), d=64),
        "topk indexer 16k k2048": topk(16384),
        # Short causal rows (the diagonal tile is a large share) and the mma.sync kernel on Hopper
        # (head dim 256, 64-blocks).
        "flash causal 1k": flash(1024, 128, causal=True),
        "flash d64 causal 1k": flash(1024, 64, causal=True),
        "flash d256 causal 4k": flash(4096, 256, causal=True),
        "block 64-blocks window 256 16k": block(
            16384, lambda L: patterns.sliding_window(L, 256, block_size=64, device=dev)
        ),
        "block d256 random 10% 8k": block(8192, lambda L: patterns.random_blocks(L, 0.1, seed=1, device=dev), d=256),
        "block 64-blocks random 10% 16k": block(
            16384, lambda L: patterns.random_blocks(L, 0.1, seed=1, block_size=64, device=dev)
        ),
    }


def measure(rounds: int) -> dict[str, float]:
    import torch
    from triton.testing import do_bench

    fns = cases()
    times = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            times[name].append(do_bench(fn, warmup=25, rep=100, return_mode="median"))
    torch.cuda.synchronize()
    return {name: statistics.median(t) for name, t in times.items()}


def compare(a_path: str, b_path: str) -> None:
    def load(path):
        runs = [json.loads(line) for line in open(path) if line.strip()]
        return {k: statistics.median(r[k] for r in runs) for k in runs[0]}, len(runs)

    a, na = load(a_path)
    b, nb = load(b_path)
    print(f"| case | {a_path} ms ({na} runs) | {b_path} ms ({nb} runs) | b / a |")
    print("|---|---|---|---|")
    for k in a:
        print(f"| {k} | {a[k]:.3f} | {b[k]:.3f} | {b[k] / a[k]:.3f} |")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--compare", nargs=2, metavar=("A", "B"))
    args = ap.parse_args()
    if args.compare:
        compare(*args.compare)
        return 0
    print(json.dumps(measure(args.rounds)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
