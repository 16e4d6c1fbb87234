"""Padding-free training through the transformers integration, on the GPU: a Llama-style model
(default 8 layers, width 1024, 16 query / 4 K/V heads, bf16) trained on a batch of documents of
random lengths, packed into one row (``DataCollatorWithFlattening``: each document attends only
to itself, through ``flash_attention_varlen``'s one-launch document route) against the same
documents as a right-padded batch with SDPA (and with our integration), timed in one run: step
time (forward + backward), tokens per second (real tokens, not padding) and peak memory.

    python benchmarks/bench_packed_training.py                          # 64 documents of 64-1024 tokens
    python benchmarks/bench_packed_training.py --docs 32 --min 256 --max 4096
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from sparse_attn.bench import require_cuda


def batches(docs: int, lo: int, hi: int, vocab: int, seed: int = 1):
    """The documents packed (the collator's dict, on the GPU) and right-padded."""
    import transformers

    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(lo, hi + 1, (docs,), generator=g).tolist()
    seqs = [torch.randint(0, vocab, (n,), generator=g) for n in lens]
    collator = transformers.DataCollatorWithFlattening(return_flash_attn_kwargs=True)
    packed = collator([{"input_ids": s.tolist()} for s in seqs])
    packed = {k: v.cuda() if torch.is_tensor(v) else v for k, v in packed.items()}
    ids = torch.zeros(docs, max(lens), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, s in enumerate(seqs):
        ids[i, : len(s)], mask[i, : len(s)] = s, 1
    padded = dict(input_ids=ids.cuda(), attention_mask=mask.cuda(), labels=ids.masked_fill(mask == 0, -100).cuda())
    return lens, packed, padded


def time_steps(config, impl: str, batch: dict, steps: int) -> tuple[float, float, float]:
    """(ms per step, last loss, peak GiB) of forward + backward steps of a fresh model."""
    import transformers

    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).to("cuda", torch.bfloat16)
    model.set_attn_implementation(impl)
    model.train()
    for _ in range(2):
        model(**batch).loss.backward()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    for _ in range(steps):
        loss = model(**batch).loss
        loss.backward()
    torch.cuda.synchronize()
    ms = (time.perf_counter() - start) / steps * 1e3
    peak = torch.cuda.max_memory_allocated() / 2**30
    del model
    torch.cuda.empty_cache()
    return ms, loss.item(), peak


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--docs", type=int, default=64)
    parser.add_argument("--min", type=int, default=64)
    parser.add_argument("--max", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args(argv)
    if not require_cuda("bench_packed_training.py"):
        return 1
    import transformers

    import sparse_attn.integrations.transformers as sa_hf

    sa_hf.register()
    config = transformers.LlamaConfig(
        vocab_size=32000,
        hidden_size=args.width,
        intermediate_size=int(args.width * 2.75),
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        max_position_embeddings=max(4096, args.max),
    )
    lens, packed, padded = batches(args.docs, args.min, args.max, config.vocab_size)
    tokens = sum(lens)
    print(f"device: {torch.cuda.get_device_name()}; {args.docs} documents of {args.min}-{args.max} tokens: {tokens}")
    print(f"tokens, padded to {args.docs} x {max(lens)} = {args.docs * max(lens)}")
    print(f"{'run':<22} {'step ms':>8} {'tokens/s':>9} {'loss':>8} {'peak GiB':>8}")
    for name, impl, batch in (
        ("sparse_attn packed", "sparse_attn", packed),
        ("sdpa padded", "sdpa", padded),
        ("sparse_attn padded", "sparse_attn", padded),
    ):
        ms, loss, peak = time_steps(config, impl, batch, args.steps)
        print(f"{name:<22} {ms:>8.1f} {tokens / ms * 1e3:>9.0f} {loss:>8.4f} {peak:>8.1f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
