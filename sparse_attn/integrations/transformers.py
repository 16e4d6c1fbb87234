"""Hugging Face transformers: ``attn_implementation="sparse_attn"``.

    import sparse_attn.integrations.transformers as sa_hf
    sa_hf.register()                                          # once per process
    model = AutoModelForCausalLM.from_pretrained(name, attn_implementation="sparse_attn")
    sa_hf.configure(model, mode="sliding_window", window=256)  # switchable at run time
    sa_hf.configure(model, mode="topk", k=256, layers={0: {"mode": "dense"}})  # per layer

Each attention layer of the model then calls :func:`attention_forward`, which runs the layer's
mode (:class:`LayerConfig`) with sparse_attn's ops: GQA without repeating K/V, bottom-right causal
(so prefill and KV-cache decode both work), the output already in the (B, L, H, D) layout the
layer's projection reads. A padding-free (packed) batch runs each sequence alone, as transformers'
flash_attention_2 does: the ``cu_seq_lens_q`` / ``cu_seq_lens_k`` it is given
(``DataCollatorWithFlattening(return_flash_attn_kwargs=True)``), or the sequence starts in one row's
``position_ids`` (through the ``*_varlen`` ops; ``flash_attention_varlen`` runs many short sequences
as one launch). A padding or other boolean mask from the model is honoured exactly
(a block-sparse mask of its elements, converted once per forward; in mode ``topk`` a right-padded
batch's mask, read as per-sequence key lengths, and no other); an additive float mask
(e.g. a position bias) goes to ``dense_attention``. Dropout is not supported (inference and
dropout-free training only).
"""

from __future__ import annotations

import weakref
from dataclasses import asdict, dataclass, replace

import torch

from .. import ops, patterns
from ..masks import BlockSparseMask

__all__ = ["LayerConfig", "attention_forward", "configure", "register"]

NAME = "sparse_attn"  # transformers rejects implementation names containing "flash"
_MODES = ("dense", "sliding_window", "topk", "block_topk", "pattern")
# Builders of sparse_attn.patterns a layer may name (mode="pattern").
_PATTERNS = ("sliding_window", "longformer", "bigbird", "dilated", "strided", "dilated_2d", "global_tokens")


@dataclass(frozen=True)
class LayerConfig:
    """What one attention layer runs.

    - ``mode="dense"``: ``flash_attention`` (causal when the layer is);
    - ``"sliding_window"``: each query sees its ``window`` most recent keys, itself included
      (``flash_attention(window=(window - 1, 0))``, the convention of Mistral's ``sliding_window``);
    - ``"topk"``: ``topk_attention`` over the ``k`` best keys per query and head;
    - ``"block_topk"``: ``topk_attention`` over the ``k`` best key blocks of ``block_size``;
    - ``"pattern"``: ``block_sparse_attention`` over the pattern builder ``pattern`` of
      ``sparse_attn.patterns`` with the keyword arguments ``pattern_args`` (plain values, so the
      setting saves with the model's config), as a length-agnostic :class:`~sparse_attn.patterns.Pattern`
      resolved for each call's lengths (prefill, decode), within causal when the layer is; e.g.
      ``pattern="longformer", pattern_args={"window": 256, "global_idx": [0, 1, 2, 3]}``.

    ``dense_below``: keys below this count run dense whatever the mode (short prompts gain nothing
    from sparsity). ``sinks`` (sliding_window, topk): the first ``sinks`` keys stay visible to every
    query (StreamingLLM's attention sinks): with a window as an exact block-sparse mask, with
    top-k always selected (counting towards k).
    """

    mode: str = "dense"
    window: int = 256
    k: int = 256
    block_size: int = 64
    dense_below: int = 0
    sinks: int = 0
    pattern: str = ""
    pattern_args: dict | None = None

    def __post_init__(self):
        if self.mode not in _MODES:
            raise ValueError(f"mode must be one of {_MODES}, got {self.mode!r}")
        if self.mode == "pattern" and self.pattern not in _PATTERNS:
            raise ValueError(f"mode='pattern' needs pattern= one of {_PATTERNS}, got {self.pattern!r}")
        for name in ("window", "k", "block_size"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"{name} must be a positive int, got {getattr(self, name)!r}")
        if not isinstance(self.sinks, int) or self.sinks < 0:
            raise ValueError(f"sinks must be a non-negative int, got {self.sinks!r}")


def register() -> None:
    """Add ``attn_implementation="sparse_attn"`` to transformers (and its mask interface, which
    gives the layers a boolean mask only where one is needed: padding, or a pattern of the model)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(NAME, attention_forward)
    AttentionMaskInterface.register(NAME, sdpa_mask)


def configure(model, layers: dict[int, dict] | None = None, **config) -> None:
    """Set the layers' mode on a loaded model: ``config`` (the fields of :class:`LayerConfig`) for
    every layer, ``layers`` {layer index: fields} on top of it. Takes effect at the next forward."""
    base = LayerConfig(**config)
    per_layer = {str(int(i)): asdict(replace(base, **c)) for i, c in (layers or {}).items()}
    # Plain dicts on the model's config, so save_pretrained writes them with it.
    model.config.sparse_attn = {"base": asdict(base), "layers": per_layer}


def _layer_config(module) -> LayerConfig:
    settings = getattr(getattr(module, "config", None), "sparse_attn", None)
    if settings is None:
        return LayerConfig()
    return LayerConfig(**settings["layers"].get(str(getattr(module, "layer_idx", None)), settings["base"]))


# What was made from boolean masks so far: transformers hands every layer the same mask tensor in
# a forward, so each is converted once. By (tensor id, kind), checked against a weak reference (a
# tensor is no dictionary key: == compares elements) and its version counter (an in-place change
# converts again); entries whose tensor is gone are dropped as new ones come.
_CONVERTED: dict[tuple[int, str], tuple[weakref.ref, int, object]] = {}


def _per_mask(mask: torch.Tensor, kind: str, make):
    """make(mask), kept per (mask tensor, kind) while the tensor lives and is not changed."""
    hit = _CONVERTED.get((id(mask), kind))
    if hit is not None and hit[0]() is mask and hit[1] == mask._version:
        return hit[2]
    for key in [k for k, v in _CONVERTED.items() if v[0]() is None]:
        del _CONVERTED[key]
    made = make(mask)
    _CONVERTED[(id(mask), kind)] = (weakref.ref(mask), mask._version, made)
    return made


def _block_mask(mask: torch.Tensor) -> BlockSparseMask:
    return _per_mask(
        mask,
        "blocks",
        lambda m: BlockSparseMask.from_element_mask(m.expand(m.shape[0], 1, *m.shape[2:]), block_size=64),
    )


def _right_padding(mask: torch.Tensor):
    """(key lengths (B,) int32, causal) when the model's boolean mask (B, 1|H, Lq, Lk) is exactly
    causal attention (bottom-right aligned) or full attention, with each sequence's keys cut at a
    length (a right-padded batch); None for any other mask (left padding, holes, patterns)."""

    def detect(m):
        lq, lk = m.shape[-2:]
        lens = m[:, 0, -1].sum(-1)  # the last row sees every key below its sequence's length
        j = torch.arange(lk, device=m.device)
        keys = j < lens[:, None, None]  # (B, 1, Lk)
        for causal in (True, False):
            expect = keys & (j <= torch.arange(lq, device=m.device)[:, None] + (lk - lq)) if causal else keys
            if torch.equal(m, expect[:, None].expand(m.shape)):
                return lens.to(torch.int32), causal
        return None

    return _per_mask(mask, "right padding", detect)


def _window_mask(lq: int, lk: int, config: LayerConfig, device) -> torch.Tensor:
    """(Lq, Lk) bool: the sliding window (bottom-right aligned) and the sink keys, to intersect with
    the model's own mask (which holds its causality)."""
    i = torch.arange(lq, device=device)[:, None] + (lk - lq)
    j = torch.arange(lk, device=device)[None, :]
    return ((i - j).abs() < config.window) | (j < config.sinks)


_PATTERN_OBJECTS: dict[str, patterns.Pattern] = {}


def _pattern(name: str, args: dict) -> patterns.Pattern:
    """One Pattern object per setting (so that its resolved masks are reused by every layer of a
    forward and across calls), on 64-blocks like the padding masks it may meet."""
    args = {"block_size": 64, **args}
    key = repr((name, sorted(args.items())))
    if key not in _PATTERN_OBJECTS:
        _PATTERN_OBJECTS[key] = patterns.Pattern(getattr(patterns, name), **args)
    return _PATTERN_OBJECTS[key]


def _layer_pattern(config: LayerConfig) -> patterns.Pattern:
    if config.mode == "sliding_window":  # |i - j| < window or j < sinks (causality from the call)
        return _pattern("sliding_window", {"window": config.window, "sinks": config.sinks})
    return _pattern(config.pattern, config.pattern_args or {})


def _window(config: LayerConfig, causal: bool) -> tuple[int, int]:
    """Mode sliding_window's (left, right) window: the ``window`` most recent keys, itself included;
    a bidirectional layer sees the window on both sides."""
    return config.window - 1, 0 if causal else config.window - 1


def _packed_sequences(query, key, attention_mask, kwargs):
    """(cu_seqlens_q, cu_seqlens_k, max_q, max_k) of a padding-free (packed) batch, as transformers'
    flash_attention_2 reads it: the ``cu_seq_lens_q`` / ``cu_seq_lens_k`` it is given
    (``DataCollatorWithFlattening(return_flash_attn_kwargs=True)``), or, for one packed row without
    a mask, the starts of ``position_ids`` (a 0 after the first token starts a sequence; read once
    per position_ids tensor, one synchronisation; not under torch.compile); None for an ordinary
    batch."""
    b, lq, lk = query.shape[0], query.shape[2], key.shape[2]
    cu_q = kwargs.get("cu_seq_lens_q")
    if cu_q is not None:
        cu_k = kwargs.get("cu_seq_lens_k")
        cu_k = cu_q if cu_k is None else cu_k
        # On the host once per forward (every layer gets the same tensors): the varlen ops read
        # them there, and a CPU copy spares each layer a synchronisation.
        host = lambda t: _per_mask(t, "host", lambda x: x.to("cpu", torch.int32))  # noqa: E731
        return (
            host(cu_q),
            host(cu_k),
            int(kwargs.get("max_length_q") or b * lq),
            int(kwargs.get("max_length_k") or b * lk),
        )
    pos = kwargs.get("position_ids")
    if attention_mask is not None or pos is None or b != 1 or lq != lk or pos.shape != (1, lq) or lq < 2:
        return None
    if torch.compiler.is_compiling():  # the starts are read on the host: traced models take cu_seq_lens only
        return None

    def starts(p):
        zeros = (p[0] == 0).nonzero().flatten().tolist()
        if len(zeros) < 2 or zeros[0] != 0:
            return None
        return torch.tensor([*zeros, lq], dtype=torch.int32)

    cu = _per_mask(pos, "packed", starts)
    return None if cu is None else (cu, cu, lq, lq)


def _packed_forward(query, key, value, packed, config: LayerConfig, mode: str, causal: bool, scaling):
    """The layer's mode over each packed sequence alone (the ``*_varlen`` ops), causal per sequence;
    returns (B, Lq, H, Dv)."""
    cu_q, cu_k, max_q, max_k = packed
    b, h, lq, _ = query.shape
    q = query.transpose(1, 2).reshape(b * lq, h, -1)
    k = key.transpose(1, 2).reshape(b * key.shape[2], key.shape[1], -1)
    v = value.transpose(1, 2).reshape(b * value.shape[2], value.shape[1], -1)
    args = (q, k, v, cu_q, cu_k, max_q, max_k)
    if mode == "dense":
        out = ops.flash_attention_varlen(*args, causal=causal, scale=scaling)
    elif mode == "sliding_window" and not config.sinks:
        out = ops.flash_attention_varlen(*args, window=_window(config, causal), scale=scaling)
    elif mode in ("sliding_window", "pattern"):
        pattern = _layer_pattern(config)
        out = ops.block_sparse_attention_varlen(
            *args, lambda sq, sk: pattern.resolve(sq, sk, device=q.device), causal=causal, scale=scaling
        )
    elif config.sinks:
        raise NotImplementedError("sparse_attn mode 'topk' with sinks does not take packed sequences yet")
    else:
        block = config.block_size if mode == "block_topk" else None
        out = ops.topk_attention_varlen(*args, config.k, block_size=block, causal=causal, scale=scaling)
    return out.reshape(b, lq, h, -1)


def attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers' attention interface: query (B, H, Lq, D), key and value (B, Hkv, Lk, D)
    (K/V not repeated for GQA), the layer's mask or None; returns ((B, Lq, H, D), None)."""
    if dropout and module.training:
        raise NotImplementedError("sparse_attn attention has no dropout; set the model's attention_dropout to 0")
    if kwargs.get("softcap") is not None:
        raise NotImplementedError("sparse_attn attention does not take softcap")
    config = _layer_config(module)
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    lq, lk = query.shape[2], key.shape[2]
    mode = config.mode if lk >= config.dense_below else "dense"
    packed = _packed_sequences(query, key, attention_mask, kwargs)
    if packed is not None:
        return _packed_forward(query, key, value, packed, config, mode, causal, scaling), None
    if attention_mask is not None:
        if attention_mask.dtype != torch.bool:  # an additive bias: the naive path takes it as is
            out = ops.dense_attention(query, key, value, attn_mask=attention_mask, scale=scaling)
            return out.transpose(1, 2), None
        if mode == "sliding_window":  # the window (and sinks) within the model's mask
            attention_mask = attention_mask & _window_mask(lq, lk, config, query.device)
        elif mode == "pattern":  # the pattern within the model's mask (which holds its causality)
            mask = _block_mask(attention_mask) & _layer_pattern(config).resolve(lq, lk, device=query.device)
            return ops.block_sparse_attention(query, key, value, mask, scale=scaling).transpose(1, 2), None
        elif mode == "topk" and (padding := _right_padding(attention_mask)) is not None:
            lens, causal = padding  # a right-padded batch: each sequence's top-k among its own keys
            out = ops.topk_attention(
                query, key, value, config.k, causal=causal, scale=scaling, sinks=config.sinks, key_lengths=lens
            )
            return out.transpose(1, 2), None
        elif mode != "dense":
            raise NotImplementedError(
                f"sparse_attn mode {mode!r} does not take this attention mask (padding) yet: mode 'topk' takes "
                "right-padded batches; use unpadded batches, or mode='dense' / 'sliding_window' / 'pattern'"
            )
        out = ops.block_sparse_attention(query, key, value, _block_mask(attention_mask), scale=scaling)
    elif mode == "dense":
        out = ops.flash_attention(query, key, value, causal=causal, scale=scaling)
    elif mode == "sliding_window" and config.sinks:
        out = ops.block_sparse_attention(query, key, value, _layer_pattern(config), causal=causal, scale=scaling)
    elif mode == "sliding_window":
        out = ops.flash_attention(query, key, value, window=_window(config, causal), scale=scaling)
    elif mode == "pattern":
        out = ops.block_sparse_attention(query, key, value, _layer_pattern(config), causal=causal, scale=scaling)
    elif mode == "topk":
        out = ops.topk_attention(query, key, value, config.k, causal=causal, scale=scaling, sinks=config.sinks)
    else:
        out = ops.topk_attention(
            query, key, value, config.k, block_size=config.block_size, causal=causal, scale=scaling
        )
    return out.transpose(1, 2), None
