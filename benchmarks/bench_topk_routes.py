"""Attention over a given top-k selection: gathered rows against the masked-block route, and what
topk_attention's cost model picks, beside dense causal attention on the same inputs.

    python benchmarks/bench_topk_routes.py                       # GPU: L = 16k, 64k; k = 256, 2048
    python benchmarks/bench_topk_routes.py --lengths 65536 --ks 2048 --hkv 1 16 --data random spans

B = 1, H = 16, D = 128, causal (bf16 on a GPU, fp32 on the CPU). A selection is (1, G, L, k)
distinct visible keys per query, ascending: G = 1 (one set for every head, as the lightning
indexer gives) or G = Hkv (a set per K/V head). Selections (``--data``):

- ``random``: each row k keys uniform over the keys it sees (stratified) — the worst case for any
  reuse across queries;
- ``spans``: what a real model's selections look like (benchmarks/selection_overlap.py measures
  SmolLM2's): 16 sink keys, the newest k/4 keys, and the rest from spans of 32 consecutive keys
  that a query tile's rows share (each row takes a random half of its tile's spans' keys).

Columns: ``union`` = key blocks the masked route computes over the causal block pairs (1.0 = as
much as dense); ``mask ms`` = building its lists and bits; ``gather`` / ``masked`` = attention given
the selection by each route (the mask included); ``auto`` = the route the cost model picks;
``given ms`` = the whole user call, ``topk_attention(q, k, v, indices=sel, causal=True)``: the
selection's repeats dropped (a sort of every row on the GPU; on the CPU a selection already
ascending is used as given), the route chosen, the attention; ``dense`` = our causal
flash_attention; ``best vs dense`` = dense / the faster route; ``auto vs dense`` = dense / auto
(the target: >= 1.0 at every shape).
"""

from __future__ import annotations

import argparse
import datetime
import sys

import torch

import sparse_attn
from sparse_attn import _plan, _routes
from sparse_attn._plan import overrides
from sparse_attn.bench import time_ms

_ops = torch.ops.sparse_attn


def random_selection(g, lq, lk, k, gen, device):
    """Each row: k distinct keys uniform over its visible ones (one per stratum of visible / k
    keys; all of them, -1 padded, when it sees fewer)."""

    def rows(r0, r1):
        vis = (torch.arange(r0, r1, device=device) + (lk - lq) + 1).clamp(0, lk)
        j = torch.arange(k, device=device)
        lo, hi = j * vis[:, None] // k, (j + 1) * vis[:, None] // k  # strata of at least one key
        u = torch.rand(g, r1 - r0, k, generator=gen, device=device)
        strat = (lo + (u * (hi - lo)).long()).int()
        return torch.where(vis[:, None] >= k, strat, torch.where(j < vis[:, None], j, -1).int())

    return _by_rows(rows, g, lq, k, device)


def span_selection(g, lq, lk, k, gen, device, *, sinks=16, span=32, q_tile=128):
    """Sinks, the newest k / 4 keys, and the rest from spans of `span` keys shared by a query tile:
    each tile draws 2 * rest / span span starts among its visible keys, each row takes each span key
    with probability 1/2 (then the row's first `rest` of them), ascending, duplicates dropped."""
    recent = k // 4
    rest = k - sinks - recent
    n_spans = max(1, 2 * rest // span)

    def rows(r0, r1):  # r0, r1 multiples of q_tile (or r1 = lq)
        vis = (torch.arange(r0, r1, device=device) + (lk - lq) + 1).clamp(0, lk)
        tiles = -(-(r1 - r0) // q_tile)
        tile_vis = vis[torch.arange(tiles, device=device) * q_tile]  # the tile's first row's keys
        starts = torch.rand(g, tiles, n_spans, generator=gen, device=device) * (tile_vis[:, None] - span).clamp(min=1)
        keys = (starts.long()[..., None] + torch.arange(span, device=device)).flatten(-2)
        keys = keys.repeat_interleave(q_tile, dim=1)[:, : r1 - r0]  # (g, rows, pool)
        take = torch.rand(keys.shape, generator=gen, device=device) < 0.5
        pool = torch.where(take, keys, lk).sort(-1).values[..., :rest]
        sink = torch.arange(sinks, device=device).expand(g, r1 - r0, sinks)
        newest = (vis[:, None] - recent + torch.arange(recent, device=device)).expand(g, r1 - r0, recent)
        idx = torch.cat([sink, pool, newest], -1)
        idx = torch.where((idx >= 0) & (idx < vis[:, None]), idx, lk).sort(-1).values
        dup = torch.zeros_like(idx, dtype=torch.bool)
        dup[..., 1:] = idx[..., 1:] == idx[..., :-1]
        idx = torch.where(dup, lk, idx).sort(-1).values
        return torch.where(idx < lk, idx, -1).int()

    return _by_rows(rows, g, lq, k, device)


def _by_rows(rows, g, lq, k, device, chunk=2048):
    out = torch.empty(1, g, lq, k, dtype=torch.int32, device=device)
    for r0 in range(0, lq, chunk):
        out[0, :, r0 : min(lq, r0 + chunk)] = rows(r0, min(lq, r0 + chunk))
    return out


def block_selection(g, lq, lk, k, gen, device, *, share, block=128):
    """Per token and group, k key blocks of `block` tokens (distinct, visible): the first block, the
    two newest, and k - 3 others; with `share` = "tile" every row of a 128-token query tile takes
    its tile's others, "row" each row draws its own (uniform), "mixed" the tile's but two of the
    row's own."""
    rows = torch.arange(lq, device=device)
    nvis = ((rows + (lk - lq)) // block + 1).clamp(min=1)  # visible key blocks per row
    tile_n = nvis[(torch.arange(-(-lq // 128), device=device) * 128 + 127).clamp(max=lq - 1)]
    u_tile = torch.rand(g, tile_n.numel(), k, generator=gen, device=device)
    tile_pick = (u_tile * tile_n[:, None]).long().repeat_interleave(128, dim=1)[:, :lq]
    row_pick = (torch.rand(g, lq, k, generator=gen, device=device) * nvis[:, None]).long()
    others = {"tile": tile_pick, "row": row_pick}.get(share)
    if others is None:  # mixed
        others = tile_pick.clone()
        others[..., :2] = row_pick[..., :2]
    fixed = torch.stack([torch.zeros_like(nvis), nvis - 1, nvis - 2], -1).expand(g, lq, 3)
    idx = torch.cat([fixed, others.clamp(max=nvis[:, None] - 1)], -1)[..., :k].clamp(min=0)
    return idx.to(torch.int32)[None].contiguous()  # repeats allowed: topk_attention drops them


def measure_cell(q, kk, v, idx, k_tokens, device, entry_block=None):
    """(mask ms, gather ms, masked ms, auto route, auto ms): attention given the selection."""
    h, lq, lk = q.shape[1], q.shape[2], kk.shape[2]
    eb = entry_block or 1
    mask = time_ms(lambda: _ops._selection_mask(idx, lk, h, 128, 128, True, lk - lq, eb), device)
    t = {}
    for route in ("gather", "masked_block", None):
        with overrides(topk_attention_route=route):
            t[route] = time_ms(lambda: _attend(q, kk, v, idx, k_tokens, entry_block), device)  # noqa: B023
    auto = _auto_route(q, kk, v, idx, k_tokens, entry_block)
    return mask, t["gather"], t["masked_block"], auto, t[None]


def _attend(q, k, v, idx, k_tokens, entry_block):
    if entry_block is not None:  # a user selection of key blocks
        return sparse_attn.topk_attention(q, k, v, indices=idx, block_size=entry_block, causal=True)
    from sparse_attn.ops import _attend_selection

    return _attend_selection(q, k, v, idx, None, k_tokens, True)


def _auto_route(q, k, v, idx, k_tokens, entry_block):
    entries = idx if entry_block is None else _routes.user_selection(q, k, idx, None, entry_block)
    return _plan.measured_selection_route(q, k, v, entries, k_tokens, True, entry_block or 1).kind


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", type=int, nargs="+", default=None)
    ap.add_argument("--ks", type=int, nargs="+", default=None)
    ap.add_argument("--hkv", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--data", nargs="+", default=["random", "spans"], choices=["random", "spans"])
    ap.add_argument("--tables", nargs="+", default=["tokens", "blocks"], choices=["tokens", "blocks"])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--markdown", default=None)
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    lengths = args.lengths or ([16384, 65536] if cuda else [1024])
    ks = args.ks or ([256, 2048] if cuda else [64])
    dtype = torch.bfloat16 if cuda else torch.float32
    gen = torch.Generator(device=device).manual_seed(0)
    name = torch.cuda.get_device_name(device) if cuda else "cpu"
    lines: list[str] = []

    def emit(line: str) -> None:
        print(line, flush=True)
        lines.append(line)

    def rnd(*shape):
        return torch.randn(*shape, generator=gen, device=device, dtype=dtype)

    emit(
        f"# top-k attention given the selection: gather vs masked block ({datetime.date.today()}, {name}, "
        f"torch {torch.__version__}, {dtype}, D={args.dim}, causal)"
    )
    worst = None
    if "tokens" in args.tables:
        emit(f"\n## token selections, B=1 H={args.heads}\n")
        emit(
            "| L | Hkv | G | k | data | union | mask ms | gather ms | masked ms | auto | auto ms | given ms "
            "| dense ms | best vs dense | auto vs dense |"
        )
        emit("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
        for lq in lengths:
            for hkv in args.hkv:
                q, kk, v = rnd(1, args.heads, lq, args.dim), rnd(1, hkv, lq, args.dim), rnd(1, hkv, lq, args.dim)
                dense = time_ms(lambda: sparse_attn.flash_attention(q, kk, v, causal=True), device)  # noqa: B023
                for k in ks:
                    for g in sorted({1, hkv}):
                        for data in args.data:
                            make = random_selection if data == "random" else span_selection
                            idx = make(g, lq, lq, k, gen, device)
                            union = _routes.selection_union(idx, lq, lq, 1, True)
                            mask, gather, masked, auto, auto_ms = measure_cell(q, kk, v, idx, k, device)
                            given = time_ms(
                                lambda: sparse_attn.topk_attention(q, kk, v, indices=idx, causal=True),  # noqa: B023
                                device,
                            )
                            emit(
                                f"| {lq} | {hkv} | {g} | {k} | {data} | {union:.3f} | {mask:.2f} | {gather:.2f} | "
                                f"{masked:.2f} | {auto} | {auto_ms:.2f} | {given:.2f} | {dense:.2f} | "
                                f"{dense / min(gather, masked):.2f} | {dense / auto_ms:.2f} |"
                            )
                            if worst is None or dense / auto_ms < worst[0]:
                                worst = (dense / auto_ms, lines[-1])
    if "blocks" in args.tables:
        # MiniMax-M3's shape: 64 query heads, 4 K/V heads, top-16 blocks of 128 per token and K/V head.
        h, hkv, kb = 64, 4, 16
        emit(f"\n## key-block selections given (indices=, block_size=128), B=1 H={h} Hkv={hkv}, G={hkv}, top-{kb}\n")
        emit("| L | data | union | mask ms | gather ms | masked ms | auto | auto ms | dense ms | auto vs dense |")
        emit("|---|---|---|---|---|---|---|---|---|---|")
        for lq in lengths:
            q, kk, v = rnd(1, h, lq, args.dim), rnd(1, hkv, lq, args.dim), rnd(1, hkv, lq, args.dim)
            dense = time_ms(lambda: sparse_attn.flash_attention(q, kk, v, causal=True), device)  # noqa: B023
            for share in ("tile", "mixed", "row"):
                idx = block_selection(hkv, lq, lq, kb, gen, device, share=share)
                entries = _routes.user_selection(q, kk, idx, None, 128)
                union = _routes.selection_union(entries, lq, lq, 128, True)
                mask, gather, masked, auto, auto_ms = measure_cell(q, kk, v, idx, kb * 128, device, 128)
                emit(
                    f"| {lq} | {share} | {union:.3f} | {mask:.2f} | {gather:.2f} | {masked:.2f} | {auto} | "
                    f"{auto_ms:.2f} | {dense:.2f} | {dense / auto_ms:.2f} |"
                )
    if worst is not None:
        emit(f"\nworst auto vs dense (token selections): {worst[0]:.2f} at {worst[1]}")
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
