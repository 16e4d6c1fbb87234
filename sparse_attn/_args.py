"""Argument normalisation shared by the public ops and ``sparse_attn.explain``: what the user
passed, turned into what the routes and kernels take. Value checks of the tensors themselves are
the C++ glue's (one set of messages, csrc/api/common.cpp)."""

from __future__ import annotations

import math
import weakref

import torch

from .masks import _FULL, _NONE, BlockSparseMask, pack_bits

_ops = torch.ops.sparse_attn

_LAYOUT = {"query": "(B, H, Lq, D)", "key": "(B, Hkv, Lk, D)", "value": "(B, Hkv, Lk, Dv)"}


def check_4d(**tensors) -> None:
    """Each argument is a 4-D tensor (before Python reads its shape)."""
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name} must be 4-D {_LAYOUT[name]}, got {t.dim()}-D")


def at_least(name: str, value, minimum: int) -> int:
    """``value`` if it is an int (not a bool) of at least ``minimum``; else ValueError naming it."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return value


def check_inputs(query, key, value) -> None:
    """The kernels' checks of query, key and value, run before Python code that reads them
    (block top-k's pooling): the glue's check_qkv, through sparse_attn::_check_inputs."""
    check_4d(query=query, key=key, value=value)
    _ops._check_inputs.default(query, key, value)


def scale(value) -> float | None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
        raise TypeError(f"scale must be a float or None, got {type(value).__name__}")
    if value is not None and not math.isfinite(value):
        raise ValueError(f"scale must be finite, got {value}")
    return None if value is None else float(value)


def window_bounds(window) -> tuple[int, int]:
    """``flash_attention``'s window as the kernels' (left, right) bounds, -1 = unbounded."""
    if window is None:
        return -1, -1
    if isinstance(window, (str, bytes)):
        raise TypeError(f"window must be None, an int or a (left, right) pair, got {window!r}")
    if isinstance(window, int):
        window = (window, window)
    try:
        left, right = window
    except (TypeError, ValueError):
        raise TypeError(f"window must be None, an int or a (left, right) pair, got {window!r}") from None
    bounds = []
    for name, w in (("left", left), ("right", right)):
        if w is None or (isinstance(w, int) and w == -1):
            bounds.append(-1)
        elif isinstance(w, int) and not isinstance(w, bool) and w >= 0:
            bounds.append(w)
        else:
            raise ValueError(f"window {name} bound must be a non-negative int or None (unbounded), got {w!r}")
    return bounds[0], bounds[1]


def matrix_block_size(mask: torch.Tensor, lq: int, lk: int) -> int:
    """The block size (128, else 64) whose grid a bool block matrix has for (Lq, Lk)."""
    if mask.dtype != torch.bool:
        raise TypeError(f"a tensor mask must be a bool block matrix, got dtype {mask.dtype}")
    nq, nk = mask.shape[-2:]
    sizes = [b for b in (128, 64) if math.ceil(lq / b) == nq and math.ceil(lk / b) == nk]
    if not sizes:
        raise ValueError(
            f"block matrix of shape {tuple(mask.shape)} matches neither 64 nor 128 blocks for Lq={lq}, Lk={lk}"
        )
    return sizes[0]


def is_flex_block_mask(mask) -> bool:
    return type(mask).__name__ == "BlockMask"


def check_mask_kind(mask) -> None:
    from .patterns import Pattern

    if not (isinstance(mask, (BlockSparseMask, torch.Tensor, Pattern)) or is_flex_block_mask(mask)):
        raise TypeError(
            "mask must be a BlockSparseMask, a patterns.Pattern, a FlexAttention BlockMask or a bool block "
            f"matrix, got {type(mask).__name__}"
        )


def check_mask_lengths(seq_lengths, lq: int, lk: int) -> None:
    if tuple(seq_lengths) != (lq, lk):
        raise ValueError(
            f"mask was built for seq_lengths {tuple(seq_lengths)} but query/key have Lq={lq}, Lk={lk}; "
            "build the mask for these lengths"
        )


# FlexAttention BlockMasks converted so far, by mask object: Flex's users pass the same BlockMask
# at every step, and converting it (its mask_mod evaluated on every partial block) costs more than
# the attention. An entry holds the converted mask and what it was converted from (the identity and
# version counter of each block tensor, the mask_mod, the sizes): a tensor changed in place, or
# replaced, converts again. Entries go with their BlockMask.
_FLEX_CONVERTED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _flex_signature(block_mask) -> tuple:
    tensors = (
        block_mask.kv_num_blocks,
        block_mask.kv_indices,
        block_mask.full_kv_num_blocks,
        block_mask.full_kv_indices,
    )
    ids = tuple((id(t), t._version) if t is not None else None for t in tensors)
    return ids, id(block_mask.mask_mod), tuple(block_mask.seq_lengths), block_mask.BLOCK_SIZE


def from_flex_cached(block_mask) -> BlockSparseMask:
    """BlockSparseMask.from_flex(block_mask), converted once per BlockMask (see _FLEX_CONVERTED);
    under torch.compile it converts in the graph."""
    if torch.compiler.is_compiling():
        return BlockSparseMask.from_flex(block_mask)
    signature = _flex_signature(block_mask)
    hit = _FLEX_CONVERTED.get(block_mask)
    if hit is not None and hit[0] == signature:
        return hit[1]
    converted = BlockSparseMask.from_flex(block_mask)
    _FLEX_CONVERTED[block_mask] = (signature, converted)
    return converted


def block_sparse_mask(mask, query: torch.Tensor, key: torch.Tensor) -> BlockSparseMask:
    """``block_sparse_attention``'s mask argument as a BlockSparseMask for (Lq, Lk) on the query's
    device (a FlexAttention BlockMask is converted once per mask object, see from_flex_cached; a
    Pattern resolved for these lengths)."""
    check_4d(query=query, key=key)
    check_mask_kind(mask)
    from .patterns import Pattern

    lq, lk = query.shape[-2], key.shape[-2]
    if isinstance(mask, BlockSparseMask):
        result = mask
    elif isinstance(mask, Pattern):
        result = mask.resolve(lq, lk, device=query.device)
    elif isinstance(mask, torch.Tensor):
        size = matrix_block_size(mask, lq, lk)
        result = BlockSparseMask.from_block_matrix(mask, seq_lengths=(lq, lk), block_size=size)
    else:
        result = from_flex_cached(mask)
    check_mask_lengths(result.seq_lengths, lq, lk)
    if result.device != query.device:  # checked here for every route, not only by the block kernel
        raise RuntimeError(f"mask must be on the same device as query ({query.device}), got {result.device}")
    return result


def with_causal(mask: BlockSparseMask) -> BlockSparseMask:
    """The mask intersected with the bottom-right causal pattern of its lengths, made once per mask
    (kept on it; under torch.compile made in the graph)."""
    if mask._causal is not None:
        return mask._causal
    from .patterns import causal

    lq, lk = mask.seq_lengths
    combined = mask & causal(lq, lk, block_size=mask.block_size, device=mask.device, compact=False)
    if not torch.compiler.is_compiling():
        mask._causal = combined
    return combined


def key_lengths_on(key_lengths, query: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    """key_lengths checked (a 1-D integer tensor, one per batch element; a CPU tensor's values in
    [0, Lk]) as int64 on the query's device, clamped to [0, Lk]."""
    if not isinstance(key_lengths, torch.Tensor) or key_lengths.dim() != 1:
        raise TypeError(f"key_lengths must be a 1-D integer tensor (B,), got {type(key_lengths).__name__}")
    if key_lengths.dtype.is_floating_point or key_lengths.dtype == torch.bool or key_lengths.is_complex():
        raise TypeError(f"key_lengths must hold integers, got {key_lengths.dtype}")
    b, lk = query.shape[0], key.shape[-2]
    if key_lengths.shape[0] != b:
        raise ValueError(f"key_lengths must have one entry per batch element ({b}), got {key_lengths.shape[0]}")
    if key_lengths.device.type == "cpu" and key_lengths.numel():
        lo, hi = int(key_lengths.min()), int(key_lengths.max())
        if lo < 0 or hi > lk:
            raise ValueError(f"key_lengths must lie in [0, Lk={lk}], got values in [{lo}, {hi}]")
    return key_lengths.to(query.device, torch.int64).clamp(0, lk)


def key_length_mask(
    key_lengths, query: torch.Tensor, key: torch.Tensor, block_size: tuple[int, int]
) -> BlockSparseMask:
    """(B, 1, nQb, nKb) mask hiding key j of batch b iff j >= key_lengths[b], for (Lq, Lk) on the
    query's device: the blocks below a length full, the one it cuts partial, none after; built
    from torch operations (no host synchronisation). A CPU tensor is checked (values in [0, Lk]);
    a device tensor is clamped to [0, Lk] instead of read back."""
    check_4d(query=query, key=key)
    b, lq, lk = query.shape[0], query.shape[-2], key.shape[-2]
    dev = query.device
    bq, bk = block_size
    nq, nk = math.ceil(lq / bq), math.ceil(lk / bk)
    lens = key_lengths_on(key_lengths, query, key)[:, None]  # (B, 1)
    kb = torch.arange(nk, device=dev)
    end = ((kb + 1) * bk).clamp(max=lk)
    full = end <= lens
    partial = (kb * bk < lens) & ~full
    row = torch.where(full, _FULL, torch.where(partial, torch.arange(b, device=dev)[:, None], _NONE))
    table = row.to(torch.int32)[:, None, None, :].expand(b, 1, nq, nk).contiguous()
    cols = (lens % bk)[:, :, None] > torch.arange(bk, device=dev)  # (B, 1, KB): the cut block's keys
    bits = pack_bits(cols.expand(b, bq, bk).contiguous())
    return BlockSparseMask._from_table(table, bits, (lq, lk), block_size, max_kv_blocks=nk, compact=False)
