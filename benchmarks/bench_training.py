"""End-to-end training on the GPU: a GPT-style block stack (default 12 layers, width 1024, 16
heads, L = 8192, bf16 weights and activations, AdamW) with SDPA's cuDNN backend, our flash
attention, and a sparse pattern (our causal sliding window of 1024 keys), timed in one run.

    python benchmarks/bench_training.py                 # steps per second, tokens per second
    python benchmarks/bench_training.py --layers 4 --length 4096
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch

import sparse_attn
from sparse_attn._gpt import GPT
from sparse_attn.bench import require_cuda, run_sdpa, sdpa_backends


def step(model, opt, tokens):
    """One training step: forward, next-token loss, backward, AdamW."""
    logits = model(tokens[:, :-1])
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
    return loss


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--length", type=int, default=8192)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--window", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args(argv)
    if not require_cuda("bench_training"):
        return 0
    dev = torch.device("cuda")
    cudnn = sdpa_backends(dev)["sdpa-cudnn"]
    w = args.window
    variants = {
        "sdpa-cudnn causal": lambda q, k, v: run_sdpa(q, k, v, cudnn, causal=True),
        "ours flash causal": lambda q, k, v: sparse_attn.flash_attention(q, k, v, causal=True),
        f"ours window {w} causal": lambda q, k, v: sparse_attn.flash_attention(q, k, v, window=(w - 1, 0)),
    }
    tokens = torch.randint(0, 32000, (args.batch, args.length + 1), device=dev)
    print(
        f"# {torch.cuda.get_device_name(dev)}, torch {torch.__version__}: {args.layers} layers, width "
        f"{args.width}, {args.heads} heads, B={args.batch}, L={args.length}, bf16, AdamW"
    )
    rows = []
    for name, attention in variants.items():
        torch.manual_seed(0)
        model = GPT(32000, args.width, args.heads, args.layers, attention).to(dev, torch.bfloat16)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

        for _ in range(3):
            step(model, opt, tokens)
        torch.cuda.synchronize()
        times = []
        for _ in range(args.steps):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            loss = step(model, opt, tokens)
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b))
        ms = statistics.median(times)
        rows.append((name, ms, float(loss.detach())))
        del model, opt
        torch.cuda.empty_cache()
    base = rows[0][1]
    print("| attention | step ms | steps/s | tokens/s | vs sdpa-cudnn | loss after warm-up + steps |")
    print("|---|---|---|---|---|---|")
    for name, ms, loss in rows:
        print(
            f"| {name} | {ms:.1f} | {1e3 / ms:.2f} | {args.batch * args.length * 1e3 / ms:,.0f} | "
            f"{base / ms:.2f} | {loss:.3f} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
