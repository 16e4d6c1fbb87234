"""A Hugging Face model on sparse_attn, with its attention switched at run time.

    python examples/06_transformers.py                       # a tiny randomly initialised Llama
    python examples/06_transformers.py --model PATH_OR_NAME  # any causal LM transformers loads

Registers attn_implementation="sparse_attn", then generates from one prompt with every layer
dense, with a sliding window, and with token top-k, and checks the dense run against SDPA. For each
mode it prints how many generated tokens equal SDPA's dense model's (greedy: one differing token
changes every later one) and how often the prompt's next-token predictions agree (each position
on its own). A randomly initialised model has no learned locality, so the sparse modes agree only
where they see every earlier token; a trained model agrees far more (benchmarks/ACCURACY_LM.md).
"""

import argparse

import torch
import transformers

import sparse_attn.integrations.transformers as sa_hf


def load(name: str | None, attn: str):
    if name:
        return transformers.AutoModelForCausalLM.from_pretrained(name, attn_implementation=attn).eval()
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=1000,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=2,
        max_position_embeddings=4096,
    )
    model = transformers.LlamaForCausalLM(config)
    model.set_attn_implementation(attn)
    return model.eval()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--prompt-length", type=int, default=512)
    parser.add_argument("--new-tokens", type=int, default=16)
    args = parser.parse_args()
    sa_hf.register()
    ours, ref = load(args.model, "sparse_attn"), load(args.model, "sdpa")
    ref.load_state_dict(ours.state_dict())
    vocab = ours.config.vocab_size
    ids = torch.randint(0, vocab, (1, args.prompt_length), generator=torch.Generator().manual_seed(1))
    gen = dict(max_new_tokens=args.new_tokens, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        want = ref.generate(ids, **gen)
        predicted = ref(ids).logits.argmax(-1)
        for mode in ({"mode": "dense"}, {"mode": "sliding_window", "window": 128}, {"mode": "topk", "k": 64}):
            sa_hf.configure(ours, **mode)
            out = ours.generate(ids, **gen)
            same = int((out[0, args.prompt_length :] == want[0, args.prompt_length :]).sum())
            agree = (ours(ids).logits.argmax(-1) == predicted).float().mean().item()
            print(
                f"{mode}: {same} of {args.new_tokens} generated tokens as SDPA's dense model; "
                f"next-token predictions over the prompt agree at {agree:.0%} of positions"
            )
        sa_hf.configure(ours, mode="dense")
        assert torch.equal(ours.generate(ids, **gen), want), "dense sparse_attn differs from SDPA"
    print("dense run equals SDPA's")


if __name__ == "__main__":
    main()
