"""The Hugging Face transformers integration (attn_implementation="sparse_attn") against the same
tiny randomly initialised models run with SDPA: prefill, padded batches, KV-cache generation, GQA,
Mistral's sliding window, each mode and per-layer settings. The real-model accuracy study is a
benchmark, not a test."""

import pytest
import torch

transformers = pytest.importorskip("transformers")

import sparse_attn.integrations.transformers as sa_hf  # noqa: E402

sa_hf.register()


def _model(kind="llama", attn="sparse_attn", seed=0, **extra):
    torch.manual_seed(seed)
    common = dict(
        vocab_size=97,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        attention_dropout=0.0,
        **extra,
    )
    if kind == "llama":
        config = transformers.LlamaConfig(**common)
        model = transformers.LlamaForCausalLM(config)
    else:
        config = transformers.MistralConfig(**common)
        model = transformers.MistralForCausalLM(config)
    model.set_attn_implementation(attn)
    return model.eval()


def _pair(kind="llama", **extra):
    ours = _model(kind, "sparse_attn", **extra)
    ref = _model(kind, "sdpa", **extra)
    ref.load_state_dict(ours.state_dict())
    return ours, ref


def _ids(b=2, length=48, seed=1):
    return torch.randint(0, 97, (b, length), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def test_prefill_equals_sdpa():
    ours, ref = _pair()
    ids = _ids()
    torch.testing.assert_close(ours(ids).logits, ref(ids).logits, atol=2e-5, rtol=2e-5)


@torch.no_grad()
def test_padded_batch_equals_sdpa_on_the_tokens():
    # Left padding: the model's mask (padding and causal) is honoured exactly, not ignored.
    ours, ref = _pair()
    ids = _ids(length=40)
    attention = torch.ones_like(ids)
    attention[0, :13] = 0
    attention[1, :3] = 0
    a, b = ours(ids, attention_mask=attention).logits, ref(ids, attention_mask=attention).logits
    keep = attention.bool()
    torch.testing.assert_close(a[keep], b[keep], atol=2e-5, rtol=2e-5)
    # Without the mask the outputs differ: the mask was used, not dropped.
    assert not torch.allclose(ours(ids).logits[0, 13:], a[0, 13:], atol=1e-3)


@torch.no_grad()
def test_generation_with_kv_cache_equals_sdpa():
    # Decode steps have Lq = 1 < Lk: bottom-right causal, the cache read in place.
    ours, ref = _pair()
    ids = _ids(b=1, length=20)
    kwargs = dict(max_new_tokens=12, do_sample=False, pad_token_id=0)
    assert torch.equal(ours.generate(ids, **kwargs), ref.generate(ids, **kwargs))


@torch.no_grad()
def test_mistral_sliding_window_equals_sdpa():
    # The model's own sliding window arrives as its mask and is honoured.
    ours, ref = _pair("mistral", sliding_window=16)
    ids = _ids(length=60)
    torch.testing.assert_close(ours(ids).logits, ref(ids).logits, atol=2e-5, rtol=2e-5)


@torch.no_grad()
def test_sliding_window_mode_equals_a_windowed_model():
    # mode="sliding_window" on a plain model = the same weights with Mistral's window of that size.
    ours = _model("mistral", "sparse_attn")
    ref = _model("mistral", "sdpa", sliding_window=12)
    ref.load_state_dict(ours.state_dict())
    sa_hf.configure(ours, mode="sliding_window", window=12)
    ids = _ids(length=50)
    torch.testing.assert_close(ours(ids).logits, ref(ids).logits, atol=2e-5, rtol=2e-5)
    # Generation with the cache in that mode (decode: the window of the last key).
    kwargs = dict(max_new_tokens=8, do_sample=False, pad_token_id=0)
    assert torch.equal(ours.generate(ids[:1], **kwargs), ref.generate(ids[:1], **kwargs))


@torch.no_grad()
@pytest.mark.parametrize("mode", [{"mode": "topk", "k": 4096}, {"mode": "block_topk", "k": 64, "block_size": 64}])
def test_topk_modes_with_every_key_equal_dense(mode):
    ours, ref = _pair()
    sa_hf.configure(ours, **mode)
    ids = _ids(length=70)
    torch.testing.assert_close(ours(ids).logits, ref(ids).logits, atol=2e-5, rtol=2e-5)


@torch.no_grad()
def test_topk_mode_on_a_right_padded_batch_equals_each_sequence_alone():
    """mode='topk' with the model's padding mask (right padding): each sequence's rows select among
    its own keys (key_lengths), so its logits equal the sequence run alone, unpadded."""
    ours = _model()
    sa_hf.configure(ours, mode="topk", k=6, sinks=1)
    ids = _ids(b=3, length=40)
    lengths = [40, 23, 9]
    attention = torch.zeros_like(ids)
    for b, n in enumerate(lengths):
        attention[b, :n] = 1
    batch = ours(ids, attention_mask=attention).logits
    for b, n in enumerate(lengths):
        alone = ours(ids[b : b + 1, :n]).logits[0]
        torch.testing.assert_close(batch[b, :n], alone, atol=2e-5, rtol=2e-5)
    # The padding is used: without the mask the rows past a sequence's end would see the pad keys.
    assert not torch.allclose(ours(ids).logits[2, 9:], batch[2, 9:], atol=1e-3)


def test_right_padding_is_read_from_the_mask_exactly():
    lens = torch.tensor([6, 3])
    j = torch.arange(6)
    keys = j < lens[:, None, None]  # (B, 1, Lk)
    causal = (keys & (j <= torch.arange(4)[:, None] + 2))[:, None]  # Lq = 4 rows, bottom-right
    got, is_causal = sa_hf._right_padding(causal)
    assert got.tolist() == [6, 3] and is_causal
    got, is_causal = sa_hf._right_padding(keys[:, None].expand(2, 1, 4, 6).clone())  # bidirectional
    assert got.tolist() == [6, 3] and not is_causal
    left = causal.clone()
    left[1, 0, :, 0] = False  # a hidden first key: left padding, not representable by lengths
    assert sa_hf._right_padding(left) is None


@torch.no_grad()
def test_per_layer_modes_and_switching_at_run_time():
    ours, ref = _pair()
    ids = _ids(length=64)
    dense = ref(ids).logits
    sa_hf.configure(ours, mode="topk", k=8, layers={0: {"mode": "dense"}, 1: {"k": 4096}})
    torch.testing.assert_close(ours(ids).logits, dense, atol=2e-5, rtol=2e-5)  # layer 1 keeps every key
    sa_hf.configure(ours, mode="topk", k=8, layers={0: {"mode": "dense"}})
    assert not torch.allclose(ours(ids).logits, dense, atol=1e-3)  # now layer 1 drops keys
    sa_hf.configure(ours, mode="sliding_window", window=8, dense_below=1000)
    torch.testing.assert_close(ours(ids).logits, dense, atol=2e-5, rtol=2e-5)  # short: dense
    assert ours.config.to_dict()["sparse_attn"]["base"]["mode"] == "sliding_window"  # saved with the config


@torch.no_grad()
def test_compiled_model_equals_eager():
    """torch.compile of a model on the integration gives the eager model's logits, dense (= SDPA's)
    and after switching to a sliding window at run time (which must not reuse the dense graph)."""
    ours, ref = _pair()
    ids = _ids()
    compiled = torch.compile(ours)
    for mode in ({"mode": "dense"}, {"mode": "sliding_window", "window": 16}):
        sa_hf.configure(ours, **mode)
        eager = ours(ids).logits
        torch.testing.assert_close(compiled(ids).logits, eager, atol=1e-5, rtol=1e-5)
        if mode["mode"] == "dense":
            torch.testing.assert_close(eager, ref(ids).logits, atol=1e-5, rtol=1e-5)
        else:
            assert (eager - ref(ids).logits).abs().max() > 1e-3  # the window does change the logits


def test_bad_settings_and_unsupported_inputs_raise():
    with pytest.raises(ValueError, match="mode must be one of"):
        sa_hf.LayerConfig(mode="strided")
    with pytest.raises(ValueError, match="window must be a positive int"):
        sa_hf.LayerConfig(window=0)
    ours = _model()
    sa_hf.configure(ours, mode="topk", k=8)
    ids = _ids(length=20)
    attention = torch.ones_like(ids)
    attention[0, :4] = 0
    with torch.no_grad(), pytest.raises(NotImplementedError, match="does not take this attention mask"):
        ours(ids, attention_mask=attention)  # left padding: top-k takes right-padded batches only


@pytest.mark.parametrize("lq,lk", [(70, 70), (1, 90), (5, 130)])
def test_sliding_window_with_sinks_is_exact(lq, lk):
    # The first keys stay visible to every query beside the window (prefill and decode shapes).
    from types import SimpleNamespace

    from sparse_attn import reference

    module = SimpleNamespace(config=SimpleNamespace(), layer_idx=0, is_causal=True, training=False)
    sa_hf.configure(module, mode="sliding_window", window=16, sinks=4)
    g = torch.Generator().manual_seed(lq + lk)
    q, k, v = (
        torch.randn(1, 4, lq, 32, generator=g),
        torch.randn(1, 2, lk, 32, generator=g),
        torch.randn(1, 2, lk, 32, generator=g),
    )
    out, _ = sa_hf.attention_forward(module, q, k, v, None)
    i = torch.arange(lq)[:, None] + (lk - lq)
    j = torch.arange(lk)[None, :]
    mask = (((i - j) < 16) | (j < 4)) & (j <= i)
    gold, _ = reference.attention(q, k, v, mask=mask)
    torch.testing.assert_close(out.transpose(1, 2).double(), gold, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("padded", [False, True], ids=["full", "left_padded"])
def test_training_step_gradients_equal_sdpa(padded, device):
    """A training step through the integration: the loss and every parameter's gradient equal the
    SDPA model's (a padded batch goes through the block-sparse mask of its padding)."""
    ours, ref = _pair()
    ours, ref = ours.to(device).train(), ref.to(device).train()
    ids = _ids().to(device)
    mask = torch.ones_like(ids)
    if padded:
        mask[0, :7] = 0
    for model in (ours, ref):
        out = model(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100))
        out.loss.backward()
    for (name, a), (_, b) in zip(ours.named_parameters(), ref.named_parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad, atol=2e-5, rtol=1e-3, msg=name)


@pytest.mark.parametrize("lq,lk", [(70, 70), (1, 90), (5, 130)])
def test_pattern_mode_is_the_bottom_rows_of_the_square_pattern(lq, lk):
    # mode="pattern": Longformer with sinks, resolved for prefill and decode shapes alike.
    from types import SimpleNamespace

    from sparse_attn import patterns, reference

    module = SimpleNamespace(config=SimpleNamespace(), layer_idx=0, is_causal=True, training=False)
    args = {"window": 9, "global_idx": [3], "sinks": 2}
    sa_hf.configure(module, mode="pattern", pattern="longformer", pattern_args=args)
    g = torch.Generator().manual_seed(lq * lk)
    q, k, v = (
        torch.randn(1, 4, lq, 32, generator=g),
        torch.randn(1, 2, lk, 32, generator=g),
        torch.randn(1, 2, lk, 32, generator=g),
    )
    out, _ = sa_hf.attention_forward(module, q, k, v, None)
    square = patterns.longformer(lk, **args, block_size=64).to_dense()[0, 0]
    i = torch.arange(lq)[:, None] + (lk - lq)
    mask = square[lk - lq :] & (torch.arange(lk)[None, :] <= i)
    gold, _ = reference.attention(q, k, v, mask=mask)
    torch.testing.assert_close(out.transpose(1, 2).double(), gold, atol=1e-5, rtol=1e-5)


@torch.no_grad()
def test_pattern_mode_generation_with_cache_equals_without():
    # Decode steps resolve the pattern for (1, Lk): the same rows a full recomputation sees.
    ours = _model()
    sa_hf.configure(
        ours, mode="pattern", pattern="bigbird", pattern_args={"window": 8, "num_global": 2, "num_random": 1}
    )
    ids = _ids(b=1, length=70)
    kwargs = dict(max_new_tokens=10, do_sample=False, pad_token_id=0)
    cached = ours.generate(ids, use_cache=True, **kwargs)
    assert torch.equal(cached, ours.generate(ids, use_cache=False, **kwargs))
    # and a padded batch runs the pattern within the model's mask
    ids2 = _ids(b=2, length=70)
    attention = torch.ones_like(ids2)
    attention[0, :5] = 0
    ours(ids2, attention_mask=attention)


def _packed_batch(lens, seed=3):
    """Sequences of these lengths, alone and packed into one row (transformers'
    DataCollatorWithFlattening, with its flash-attention kwargs)."""
    g = torch.Generator().manual_seed(seed)
    seqs = [torch.randint(0, 97, (n,), generator=g).tolist() for n in lens]
    batch = transformers.DataCollatorWithFlattening(return_flash_attn_kwargs=True)([{"input_ids": s} for s in seqs])
    return [torch.tensor([s]) for s in seqs], batch


@pytest.mark.parametrize("given", ["cu_seq_lens", "position_ids"])
@pytest.mark.parametrize("mode", [{}, {"mode": "sliding_window", "window": 8}, {"mode": "topk", "k": 6}])
@torch.no_grad()
def test_packed_sequences_run_each_sequence_alone(given, mode, device):
    # A padding-free batch (flash_attention_2's packing): each sequence attends only to itself,
    # whether the cu_seq_lens kwargs are given or only the position_ids restart; the packed logits
    # equal each sequence run alone (the SDPA model's too, in dense mode). On a GPU the packed
    # dense layers take flash_attention_varlen's document route (four sequences, one launch).
    ours, ref = _pair()
    ours, ref = ours.to(device), ref.to(device)
    sa_hf.configure(ours, **mode)
    seqs, batch = _packed_batch([11, 1, 30, 7])
    seqs = [s.to(device) for s in seqs]
    batch = {k: v.to(device) if torch.is_tensor(v) else v for k, v in batch.items()}
    kw = dict(input_ids=batch["input_ids"], position_ids=batch["position_ids"])
    if given == "cu_seq_lens":
        kw.update({k: batch[k] for k in ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")})
    packed = ours(**kw).logits[0]
    alone = torch.cat([ours(s).logits[0] for s in seqs])
    torch.testing.assert_close(packed, alone, atol=2e-5, rtol=2e-5)
    if not mode:
        torch.testing.assert_close(packed, torch.cat([ref(s).logits[0] for s in seqs]), atol=2e-5, rtol=2e-5)


def test_packed_training_step_equals_each_sequence_alone(device):
    # A padding-free training step: the loss and gradients of the packed row equal those of the
    # sequences run one by one (their tokens' losses summed the same way).
    ours, _ = _pair()
    ours.to(device).train()
    seqs, batch = _packed_batch([9, 25, 14])
    seqs = [s.to(device) for s in seqs]
    batch = {k: v.to(device) if torch.is_tensor(v) else v for k, v in batch.items()}
    out = ours(**{k: v for k, v in batch.items() if k != "labels"}).logits[0]
    labels = batch["labels"][0]
    loss = torch.nn.functional.cross_entropy(out[:-1], labels[1:], ignore_index=-100, reduction="sum")
    grads = torch.autograd.grad(loss, list(ours.parameters()))
    total = 0
    for s in seqs:
        logits = ours(s).logits[0]
        total = total + torch.nn.functional.cross_entropy(logits[:-1], s[0, 1:], reduction="sum")
    refs = torch.autograd.grad(total, list(ours.parameters()))
    torch.testing.assert_close(loss, total, atol=1e-4, rtol=1e-5)
    for a, b in zip(grads, refs, strict=True):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-3)
