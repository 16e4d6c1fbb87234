"""attention_with_kvcache's Python side: the decode mask's checks, the host check of the lengths
and page table, and the composite path (CPU tensors, fp32, Dv != D, unaligned caches): the
cache gathered per sequence and ``dense_fwd`` with the element mask the kernel applies."""

from __future__ import annotations

import math

import torch

from . import _args, _meta
from .masks import BlockSparseMask

_ops = torch.ops.sparse_attn


def capacity(key_cache: torch.Tensor, block_table: torch.Tensor | None) -> int:
    """Tokens one sequence's cache holds: Lmax, or max_pages * page_size (0 for shapes the op's
    checks refuse)."""
    if key_cache.dim() != 4 or (block_table is not None and block_table.dim() != 2):
        return 0
    if block_table is None:
        return int(key_cache.shape[2])
    return int(block_table.shape[1]) * int(key_cache.shape[1])


def mask_tensors(mask, query: torch.Tensor, key_cache: torch.Tensor, block_table, cap: int):
    """(kv_num_blocks, kv_indices, kv_block) of a decode mask, or (None, None, 0)."""
    if mask is None:
        return None, None, 0
    if not isinstance(mask, BlockSparseMask):
        raise TypeError(f"mask must be a BlockSparseMask over the cache's blocks, got {type(mask).__name__}")
    h = query.shape[1]
    hkv = key_cache.shape[2] if block_table is not None else key_cache.shape[1]
    if mask.seq_lengths[1] != cap:
        raise ValueError(
            f"mask must be built for Lk = the cache's capacity ({cap} tokens), got seq_lengths={mask.seq_lengths}"
        )
    if mask.kv_num_blocks.shape[2] != 1:
        raise ValueError(
            "a decode mask has one query block (seq_lengths[0] <= its query block size), got "
            f"{mask.kv_num_blocks.shape[2]} query blocks"
        )
    if mask.partial_masks.shape[0] != 0:
        raise ValueError(
            "a decode mask selects whole cache blocks (BlockSparseMask.from_block_matrix); this one has partial blocks"
        )
    cnt, idx = mask.kv_num_blocks, mask.kv_indices
    hm = cnt.shape[1]
    if hm == h and h != hkv:
        raise ValueError(
            f"a decode mask selects per K/V head (1 or Hkv={hkv} heads), got one per query head ({h}); "
            "the query heads of a group share each cache load"
        )
    return cnt, idx, int(mask.block_size[1])


def validate(query, key_cache, cache_seqlens, key, block_table) -> None:
    """The values the shape checks cannot see: lengths within the cache, the block table's used
    entries within its pages. Reads them on the host (one synchronisation for CUDA tensors)."""
    lq = query.shape[2]
    cap = capacity(key_cache, block_table)
    seqlens = cache_seqlens.detach().to("cpu", torch.int64)
    new = lq if key is not None else 0
    for b, n in enumerate(seqlens.tolist()):
        if n < 0 or n + new > cap:
            raise ValueError(
                f"cache_seqlens[{b}] = {n}"
                + (f" plus {new} new tokens" if new else "")
                + f" does not fit the cache's {cap} tokens"
            )
    if block_table is not None:
        page_size, num_pages = key_cache.shape[1], key_cache.shape[0]
        table = block_table.detach().to("cpu", torch.int64)
        used = -(-(seqlens + new) // page_size)
        for b in range(table.shape[0]):
            row = table[b, : int(used[b])]
            bad = ((row < 0) | (row >= num_pages)).nonzero()
            if bad.numel():
                p = int(bad[0, 0])
                raise ValueError(f"block_table[{b}, {p}] = {int(row[p])} points outside the cache's {num_pages} pages")


def _cache_view(cache: torch.Tensor, block_table) -> torch.Tensor:
    """The cache as (B, Hkv, capacity, D): the cache itself, or its pages gathered per sequence."""
    if block_table is None:
        return cache
    pages = cache[block_table.long().clamp(0, cache.shape[0] - 1)]  # (B, P, page_size, Hkv, D)
    return pages.flatten(1, 2).transpose(1, 2)


def composite(
    query,
    key_cache,
    value_cache,
    cache_seqlens,
    key,
    value,
    block_table,
    kv_num_blocks,
    kv_indices,
    kv_block: int,
    scale,
    left: int,
    right: int,
):
    """The reference semantics with PyTorch ops and ``dense_fwd``, unchecked values handled as the
    kernel handles them: lengths clamped to [0, capacity], new tokens past the cache or in a page
    outside it dropped, a page outside the cache read as zeros."""
    b, h, lq, _ = query.shape
    cap = capacity(key_cache, block_table)
    dev = query.device
    seqlens = cache_seqlens.long().clamp(0, cap)
    page_ok = None  # (B, cap): the position's page lies in the cache (paged caches)
    if block_table is not None:
        num_pages, page_size = key_cache.shape[0], key_cache.shape[1]
        table = block_table.long()
        page_ok = ((table >= 0) & (table < num_pages)).repeat_interleave(page_size, dim=1)[:, :cap]
    if key is not None and cap > 0:
        pos = seqlens[:, None] + torch.arange(lq, device=dev)  # (B, Lq)
        kept = pos < cap
        if block_table is None:  # a dropped token goes to a spare position past the cache
            rows = torch.arange(b, device=dev)[:, None].expand(b, lq)
            at = (rows, slice(None), torch.where(kept, pos, cap))
            spare = 2
        else:  # ... or to a spare page
            page = table.gather(1, pos.clamp(max=cap - 1) // page_size)
            kept = kept & (page >= 0) & (page < num_pages)
            at = (torch.where(kept, page, num_pages), pos % page_size)
            spare = 0
        # The usual case, every token kept, written in place; checked on the host for CPU tensors
        # only (on CUDA the check would synchronise: the spare-slot path instead).
        every = dev.type == "cpu" and not torch.compiler.is_compiling() and bool(kept.all())
        for cache, new_rows in ((key_cache, key), (value_cache, value)):
            if every:
                cache[at] = new_rows.transpose(1, 2)
                continue
            padded = torch.cat([cache, cache.narrow(spare, 0, 1)], spare)
            padded[at] = new_rows.transpose(1, 2)
            cache.copy_(padded.narrow(spare, 0, cache.shape[spare]))
    new = lq if key is not None else 0
    total = (seqlens + new).clamp(max=cap)  # keys of each sequence
    off = seqlens + new - lq  # query i sits at position off + i
    j = torch.arange(cap, device=dev)
    exists = j[None, :] < total[:, None]  # (B, cap)
    vis = exists[:, None, :].expand(b, lq, cap)
    qpos = off[:, None] + torch.arange(lq, device=dev)[None, :]  # (B, Lq)
    if left >= 0:
        vis = vis & (j[None, None, :] >= (qpos - left)[..., None])
    if right >= 0:
        vis = vis & (j[None, None, :] <= (qpos + right)[..., None])
    vis = vis[:, None]  # (B, 1, Lq, cap)
    if kv_num_blocks is not None:
        nkb = -(-cap // kv_block)
        bm, hm, _, mk = kv_indices.shape
        listed = torch.arange(mk, device=dev)[None, None, :] < kv_num_blocks[:, :, 0, None]
        idx = torch.where(listed & (kv_indices[:, :, 0] >= 0) & (kv_indices[:, :, 0] < nkb), kv_indices[:, :, 0], nkb)
        blocks = torch.zeros(bm, hm, nkb + 1, dtype=torch.bool, device=dev)
        blocks.scatter_(2, idx.long(), True)
        sel = blocks[..., :nkb].repeat_interleave(kv_block, dim=2)[..., :cap]  # (Bm, Hm, cap)
        if hm > 1:
            sel = sel.repeat_interleave(h // hm, dim=1)
        vis = vis & sel[:, :, None, :]
    # Rows past a sequence's length may hold anything (uninitialised memory): zero them so that
    # 0 * NaN never reaches a sum.
    keep = (exists if page_ok is None else exists & page_ok)[:, None, :, None]
    k = torch.where(keep, _cache_view(key_cache, block_table), 0)
    v = torch.where(keep, _cache_view(value_cache, block_table), 0)
    return _meta.forward(_ops.dense_fwd.default, query, k, v, vis, scale, False)


def topk_mask(
    index_query,
    index_weights,
    index_key_cache,
    cache_seqlens,
    k: int,
    *,
    block_size: int = 128,
    sinks: int = 1,
    recent: int = 1,
):
    """The decode mask of the k cache blocks a lightning indexer scores highest, per sequence
    (``kvcache_topk_mask``'s work; no host synchronisation)."""
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size not in (64, 128):
        raise ValueError(f"block_size must be 64 or 128, got {block_size!r}")
    if isinstance(k, bool) or not isinstance(k, int) or k <= 0:
        raise ValueError(f"k must be a positive int, got {k!r}")
    _args.at_least("sinks", sinks, 0)
    _args.at_least("recent", recent, 0)
    named = (
        ("index_query", index_query),
        ("index_weights", index_weights),
        ("index_key_cache", index_key_cache),
        ("cache_seqlens", cache_seqlens),
    )
    for name, t in named:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a tensor, got {type(t).__name__}")
        if t.device != index_query.device:
            raise ValueError(f"{name} must be on index_query's device ({index_query.device}), got {t.device}")
    for name, t in named[:3]:
        if t.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise ValueError(f"{name} must be float32, bfloat16 or float16, got {t.dtype}")
    if index_key_cache.dtype != index_query.dtype:
        raise ValueError(
            f"index_key_cache must have index_query's dtype ({index_query.dtype}), got {index_key_cache.dtype}"
        )
    if index_query.dim() != 4 or index_weights.dim() != 3 or index_key_cache.dim() != 3:
        raise ValueError(
            "index_query must be (B, Lq, HI, DI), index_weights (B, Lq, HI) and index_key_cache (B, Lmax, DI), got "
            f"{tuple(index_query.shape)}, {tuple(index_weights.shape)}, {tuple(index_key_cache.shape)}"
        )
    b, lq, hi, di = index_query.shape
    lmax = index_key_cache.shape[1]
    if index_weights.shape != (b, lq, hi) or index_key_cache.shape[0] != b or index_key_cache.shape[2] != di:
        raise ValueError("index_query, index_weights and index_key_cache disagree in B, Lq, HI or DI")
    if min(lq, hi, di) < 1:
        raise ValueError(
            f"index_query must have at least one token, indexer head and channel, got {tuple(index_query.shape)}"
        )
    if lq > 128:
        raise ValueError(f"a decode mask serves at most 128 new tokens, got {lq}")
    if cache_seqlens.dtype != torch.int32 or cache_seqlens.shape != (b,):
        raise ValueError(
            f"cache_seqlens must be int32 (B={b},), got {cache_seqlens.dtype} {tuple(cache_seqlens.shape)}"
        )
    dev = index_query.device
    # score(t) = sum_j w[j] relu(q_j . k_t), the max over the new tokens; past the length: -inf.
    # Two batched GEMMs (the index keys read in place): q . k for every (token, head), then the
    # weighted sum over the heads.
    s = torch.matmul(index_query.reshape(b, lq * hi, di), index_key_cache.transpose(1, 2)).relu_()
    s = torch.matmul(index_weights.reshape(b * lq, 1, hi).to(s.dtype), s.view(b * lq, hi, lmax))
    s = s.view(b, lq, lmax).amax(1).float()  # (B, Lmax)
    lens = cache_seqlens.long().clamp(0, lmax)
    pos = torch.arange(lmax, device=dev)
    s = torch.where(pos[None, :] < lens[:, None], s, -math.inf)
    nkb = -(-lmax // block_size)
    s = torch.nn.functional.pad(s, (0, nkb * block_size - lmax), value=-math.inf)
    block = s.view(b, nkb, block_size).amax(-1)
    if block.is_cuda:  # one kernel: the forced blocks, the selection, the lists (decode_select.cu)
        count, kv_indices = _ops._decode_block_select.default(block, cache_seqlens, k, block_size, sinks, recent)
    else:  # the same with PyTorch ops
        ids = torch.arange(nkb, device=dev)
        last = (lens - 1).clamp(min=0) // block_size
        forced = (ids[None, :] < sinks) | ((ids[None, :] <= last[:, None]) & (ids[None, :] > last[:, None] - recent))
        block = torch.where(forced & (block > -math.inf), math.inf, block)
        # Ties to the lower block (as the CUDA selection): a stable sort, not topk.
        values, order = block.sort(dim=-1, descending=True, stable=True)
        values, order = values[:, : min(k, nkb)], order[:, : min(k, nkb)]
        chosen = values > -math.inf
        picked = torch.where(chosen, order, nkb).sort(-1).values  # ascending, unused at the end
        count = chosen.sum(-1, dtype=torch.int32)
        kv_indices = torch.where(picked < nkb, picked, 0).to(torch.int32)
    kk = kv_indices.shape[1]
    return BlockSparseMask._trusted(
        count.view(b, 1, 1).contiguous(),
        kv_indices.view(b, 1, 1, kk).contiguous(),
        torch.full((b, 1, 1, kk), -1, dtype=torch.int32, device=dev),
        torch.zeros(0, 128, block_size // 32, dtype=torch.int32, device=dev),
        (lq, lmax),
        (128, block_size),
    )


def traced_route(query, key_cache, value_cache, block_table, kv_block: int) -> bool:
    """The route decision of ``sparse_attn::_kvcache_route`` from shapes, dtypes, strides and the
    device alone, for torch.compile (which cannot trace an op returning an int): the same
    conditions as plan_decode and kvcache_aligned (csrc), base addresses taken as aligned (every
    PyTorch allocation is). tests/test_kvcache.py checks the two agree."""
    if query.device.type != "cuda" or query.dtype not in (torch.bfloat16, torch.float16):
        return False
    d, dv = query.shape[-1], value_cache.shape[-1]
    if d != dv or min(query.shape[0], query.shape[1], query.shape[2]) == 0:
        return False
    major, minor = torch.cuda.get_device_capability(query.device)
    cc = 10 * major + minor
    if cc < 80:
        return False
    if d > 128 and cc not in (80, 87) and cc < 90:  # the head dim 256 stages need 160 KiB per SM
        return False
    return all(t.shape[i] <= 1 or t.stride(i) % 8 == 0 for t in (key_cache, value_cache) for i in range(t.dim() - 1))
