"""attention_with_kvcache's Python side: the decode mask's checks, the host check of the lengths
and page table, and the composite path (CPU tensors, fp32, Dv != D, unaligned caches): the
cache gathered per sequence and ``dense_fwd`` with the element mask the kernel applies."""

from __future__ import annotations

import torch

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
    """The reference semantics with PyTorch ops and ``dense_fwd`` (validate() must have passed)."""
    b, h, lq, _ = query.shape
    cap = capacity(key_cache, block_table)
    dev = query.device
    seqlens = cache_seqlens.long()
    if key is not None:
        pos = seqlens[:, None] + torch.arange(lq, device=dev)  # (B, Lq)
        if block_table is None:
            rows = torch.arange(b, device=dev)[:, None].expand(b, lq)
            key_cache[rows, :, pos] = key.transpose(1, 2)
            value_cache[rows, :, pos] = value.transpose(1, 2)
        else:
            page_size = key_cache.shape[1]
            page = block_table.long().gather(1, pos // page_size)
            key_cache[page, pos % page_size] = key.transpose(1, 2)
            value_cache[page, pos % page_size] = value.transpose(1, 2)
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
    keep = exists[:, None, :, None]
    k = torch.where(keep, _cache_view(key_cache, block_table), 0)
    v = torch.where(keep, _cache_view(value_cache, block_table), 0)
    return _ops.dense_fwd.default(query, k, v, vis, scale, False)
