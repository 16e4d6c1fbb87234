"""The Hopper (sm_90a) core against the references and against the portable core, and the
block-sparse CTA schedule (q_block_order). On a GPU of compute capability 9.0 the public ops run
the Hopper core by default (sparse_attn.explain names it); the plan overrides
(sparse_attn._plan.overrides) select the portable core, a tile shape, one CTA per tile or the
merged tile boundary."""

import pytest
import torch
from conftest import HAS_CUDA
from utils import block_kernel_mask, check_attention, make_qkv

import sparse_attn
from sparse_attn import patterns
from sparse_attn._plan import overrides

IS_SM90 = HAS_CUDA and torch.cuda.get_device_capability() == (9, 0)
hopper = pytest.mark.skipif(not IS_SM90, reason="needs a compute capability 9.0 GPU")

SHAPES = [(1, 1), (17, 129), (129, 17), (300, 1000), (1000, 1000), (1100, 3000), (4224, 4224)]


@pytest.mark.cuda
@hopper
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("d", [64, 128, 40, 96])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("lq,lk", SHAPES)
def test_flash_hopper_matches_reference(dtype, d, causal, lq, lk):
    q, k, v = make_qkv(2, 4, 2, lq, lk, d, dtype=dtype, device="cuda", seed=lq + lk + d)
    assert sparse_attn.explain(sparse_attn.flash_attention, q, k, v, causal=causal).launches[0].core == "hopper"
    out, lse = sparse_attn.flash_attention(q, k, v, causal=causal, return_lse=True)
    check_attention(out, lse, q, k, v, causal=causal, name="hopper")


@pytest.mark.cuda
@hopper
@pytest.mark.parametrize("layout", ["bhld", "blhd"])
@pytest.mark.parametrize("window", [None, (100, 0), (300, 40)])
def test_flash_hopper_agrees_with_portable(layout, window):
    q, k, v = make_qkv(2, 8, 2, 1500, 2100, 128, device="cuda", layout=layout)
    ours = sparse_attn.flash_attention(q, k, v, window=window)
    with overrides(portable_only=True):
        assert sparse_attn.explain(sparse_attn.flash_attention, q, k, v, window=window).launches[0].core == "portable"
        portable = sparse_attn.flash_attention(q, k, v, window=window)
    # Both are within the reference tolerance (checked elsewhere); here they must also agree with
    # each other to bf16 rounding of the output.
    torch.testing.assert_close(ours.float(), portable.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.cuda
@hopper
@pytest.mark.parametrize("core", ["hopper", "portable"])
@pytest.mark.parametrize("d,hkv,lk", [(128, 4, 12000), (128, 2, 18000), (64, 4, 24000)])
def test_causal_order_in_l2_groups_covers_every_tile(core, d, hkv, lk):
    # Causal tiles run heaviest first within groups of (batch, head)s whose K/V fit in 32 MiB
    # of L2 (tile_of_cta). These shapes (K/V 6-9 MB per head) give groups of 5 of 8 heads
    # (crossing the batch boundary; GQA 2: 6 of 8) and a shorter last group; a tile that the
    # order skipped or repeated would leave rows unwritten.
    q, k, v = make_qkv(2, 4, hkv, 640, lk, d, device="cuda", seed=lk + d)
    with overrides(portable_only=core == "portable"):
        out, lse = sparse_attn.flash_attention(q, k, v, causal=True, return_lse=True)
    check_attention(out, lse, q, k, v, causal=True, name=f"causal L2 groups {core}")


@pytest.mark.cuda
@hopper
@pytest.mark.parametrize(
    "name",
    ["random", "longformer", "bigbird", "dilated", "window", "empty_rows"],
)
@pytest.mark.parametrize("d", [64, 128])
def test_block_sparse_hopper(name, d):
    L = 2000
    q, k, v = make_qkv(1, 4, 2, L, L, d, device="cuda", seed=d)
    mask = {
        "random": lambda: patterns.random_blocks(L, 0.3, seed=3, heads=4, device="cuda"),
        "longformer": lambda: patterns.longformer(L, 200, [0, 7, 1500], device="cuda"),
        "bigbird": lambda: patterns.bigbird(L, 128, 64, 2, seed=1, device="cuda"),
        "dilated": lambda: block_kernel_mask(patterns.dilated(L, 500, 3, device="cuda")),
        "window": lambda: block_kernel_mask(patterns.sliding_window(L, 300, causal=True, device="cuda")),
        "empty_rows": lambda: block_kernel_mask(patterns.dilated_2d(L, 512, 3, device="cuda")),
    }[name]()
    out, lse = sparse_attn.block_sparse_attention(q, k, v, mask, return_lse=True)
    check_attention(out, lse, q, k, v, mask=mask.to_dense(), name=f"hopper block-sparse {name}")


@pytest.mark.cuda
@hopper
def test_hopper_deterministic_and_nan_skipped():
    L = 3000
    q, k, v = make_qkv(2, 4, 4, L, L, 128, device="cuda")
    mask = block_kernel_mask(patterns.sliding_window(L, 256, device="cuda"))
    k[:, :, 1024:] = float("nan")  # rows < 512 see keys < 768: blocks from key 1024 on are skipped
    first = sparse_attn.block_sparse_attention(q, k, v, mask)
    assert torch.isfinite(first[:, :, :512]).all()
    for _ in range(20):
        again = sparse_attn.block_sparse_attention(q, k, v, mask)
        torch.testing.assert_close(again, first, rtol=0, atol=0, equal_nan=True)  # bitwise, NaN rows too


@pytest.mark.cuda
@hopper
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("case", ["full", "causal", "window", "random_empty_rows", "longformer", "random_per_head"])
def test_hopper_persistent_schedule(d, case):
    # Several query tiles per persistent CTA (12 heads x 33 tiles > 132 SMs): static round-robin
    # (full) or the dynamic counter (the rest), with tiles that have no key block in between.
    # Every tile is computed by one CTA with the same arithmetic whichever CTA takes it, so the
    # result must equal one CTA per tile (the per_tile_grid override) bit for bit, and the
    # reference within tolerance (a skipped or doubled tile would leave uninitialised rows).
    L = 4224
    q, k, v = make_qkv(1, 12, 4, L, L, d, device="cuda", seed=d + len(case))
    mask = {
        "random_empty_rows": lambda: patterns.random_blocks(L, 0.08, seed=5, device="cuda"),
        "longformer": lambda: patterns.longformer(L, 256, [0, 9, 3000], device="cuda"),
        "random_per_head": lambda: patterns.random_blocks(L, 0.2, seed=6, heads=12, device="cuda"),
    }.get(case)
    causal = case == "causal"
    window = (700, 50) if case == "window" else None

    def args():
        if mask is None:
            return sparse_attn.flash_attention, (q, k, v), {"causal": causal, "window": window}
        return sparse_attn.block_sparse_attention, (q, k, v, mask()), {}

    def run():
        op, a, kw = args()
        return op(*a, **kw, return_lse=True)

    op, a, kw = args()
    want = "round_robin" if case == "full" else "dynamic"
    assert sparse_attn.explain(op, *a, **kw).launches[0].schedule == want
    out, lse = run()
    with overrides(per_tile_grid=True):
        assert sparse_attn.explain(op, *a, **kw).launches[0].schedule == "per_tile"
        out_grid, lse_grid = run()
    torch.testing.assert_close(out, out_grid, rtol=0, atol=0)
    torch.testing.assert_close(lse, lse_grid, rtol=0, atol=0)
    if case == "window":  # key j visible from query i iff i - 700 <= j <= i + 50
        dense = torch.ones(L, L, dtype=torch.bool, device="cuda").tril(50).triu(-700)
    else:
        dense = None if mask is None else mask().to_dense()
    check_attention(out, lse, q, k, v, mask=dense, causal=causal, name=f"persistent {case}")


@pytest.mark.cuda
@hopper
@pytest.mark.parametrize("tile", [(128, 128), (128, 192), (192, 128)])
@pytest.mark.parametrize("window", [None, "causal", (300, 40)])
@pytest.mark.parametrize("lq,lk", [(17, 129), (1000, 1000), (2100, 1500)])
def test_flash_hopper_d64_tiles(tile, window, lq, lk):
    # Head dim 64 runs 128- or 192-row tiles depending on how they fill the SMs, and the 128-row
    # kernel 128- or 192-key tiles (ragged last tiles at every length here); all are exact.
    q, k, v = make_qkv(2, 8, 2, lq, lk, 64, device="cuda", seed=lq)
    causal = window == "causal"
    w = window if isinstance(window, tuple) else None
    with overrides(tile=tile):
        plan = sparse_attn.explain(sparse_attn.flash_attention, q, k, v, causal=causal, window=w)
        assert plan.launches[0].tile == tile
        out, lse = sparse_attn.flash_attention(q, k, v, causal=causal, window=w, return_lse=True)
    if w is None:
        check_attention(out, lse, q, k, v, causal=causal, name=f"d64 tile={tile}")
    else:  # key j visible from query i iff i + (lk - lq) - 300 <= j <= i + (lk - lq) + 40
        off = lk - lq
        dense = torch.ones(lq, lk, dtype=torch.bool, device="cuda").tril(off + 40).triu(off - 300)
        check_attention(out, lse, q, k, v, mask=dense, name=f"d64 tile={tile} window")


@pytest.mark.cuda
@hopper
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("scale", [None, -0.3, 0.0])
def test_hopper_softmax_fast_and_guarded_paths(d, causal, scale):
    # The online softmax folds the scale into one FFMA per score when the scale is positive and
    # every row max of the warp is below 2^20 in log2 units; otherwise (a negative or zero scale,
    # or a huge score) the warp scales first. Rows 3 and 700 meet a huge score only at key 600
    # (the fifth 128-key tile), so their warps switch paths mid-row, next to ordinary rows.
    L = 1000
    q, k, v = make_qkv(1, 2, 2, L, L, d, device="cuda", seed=d)
    q[:, :, [3, 700]] *= 1000
    k[:, :, 600] = q[:, :, 700]
    out, lse = sparse_attn.flash_attention(q, k, v, causal=causal, scale=scale, return_lse=True)
    check_attention(out, lse, q, k, v, causal=causal, scale=scale, name=f"softmax paths scale={scale}")
    if scale is None:  # row 700 puts (nearly) all its weight on key 600
        torch.testing.assert_close(out[:, :, 700].float(), v[:, :, 600].float(), atol=1e-2, rtol=1e-2)


@pytest.mark.cuda
@hopper
@pytest.mark.parametrize("d", [64, 128])
def test_hopper_lazy_rescale_keeps_and_moves_the_running_max(d):
    # Head dim 128 keeps each row's running max until a tile's max exceeds it by more than 8
    # (log2 units) and skips O's rescale in tiles where no row of the warp moved it. Rows 5, 6 and
    # 900 meet planted keys whose log2 scores rise by 7.6 (kept: terms up to 2^7.6) and by 16.1
    # (moved) in the order the tiles are visited (last key tile first for dense attention, first
    # first for a block-sparse list); every other row is ordinary. Compared with the fp64 reference;
    # head dim 64 rescales eagerly and runs the same planted rows through its folded softmax.
    L = 1024
    q, k, v = make_qkv(1, 2, 2, L, L, d, device="cuda", seed=7)
    u = torch.zeros(d, device="cuda", dtype=q.dtype)
    u[0] = 1
    c = 8.0
    per_log2 = c * d**-0.5 * 1.4426950408889634  # log2-unit score of u * t against c * u, per unit t
    rows = [5, 6, 900]
    q[:, :, rows] = (c * u).to(q.dtype)
    for key, log2_score in ((1000, 2.0), (700, 9.6), (450, 25.7), (200, 33.3)):
        k[:, :, key] = (u * (log2_score / per_log2)).to(k.dtype)
    out, lse = sparse_attn.flash_attention(q, k, v, return_lse=True)
    check_attention(out, lse, q, k, v, name=f"lazy rescale d={d} flash")
    mask = sparse_attn.BlockSparseMask.from_block_matrix(
        torch.ones(8, 8, dtype=torch.bool, device="cuda"), seq_lengths=(L, L)
    )
    out, lse = sparse_attn.block_sparse_attention(q, k, v, mask, return_lse=True)
    check_attention(out, lse, q, k, v, name=f"lazy rescale d={d} block-sparse")


@pytest.mark.cuda
@hopper
@pytest.mark.parametrize(
    "d,rows,case",
    [
        (d, rows, case)
        for d, rows in ((128, None), (64, "128"))
        for case in ("causal", "random_empty_rows", "one_block_per_row", "window", "causal_window")
    ]
    + [(64, "192", "causal")],  # 192-row tiles serve the dense family only
)
def test_hopper_merged_tile_boundary_changes_no_bit(d, rows, case):
    # A tile's last P V goes in the same turn as the next tile's first Q K^T (merge_boundary on,
    # the plan's choice for block-sparse masks and bands of at most 1024 keys per row), or in a
    # turn of its own (off, its choice for the rest of the dense family): the same GEMMs on the
    # same operands, so bit for bit the same output, across tiles with no key block (pending P V
    # retired alone) and tiles of a single key block (the merged turn is also the tile's last);
    # the default equals both. The three-consumer kernel (head dim 64, 192-row tiles) never
    # merges: its case checks that the override leaves it alone.
    tile = {None: None, "128": (128, 128), "192": (192, 128)}[rows]
    L = 4224  # 33 query tiles x 12 heads: several tiles per persistent CTA
    q, k, v = make_qkv(1, 12, 4, L, L, d, device="cuda", seed=d + len(case))
    nb = L // 128
    blocks = {
        "random_empty_rows": lambda: patterns.random_blocks(L, 0.08, seed=5, device="cuda"),
        "one_block_per_row": lambda: sparse_attn.BlockSparseMask.from_block_matrix(
            torch.eye(nb, dtype=torch.bool, device="cuda").roll(3, dims=1), seq_lengths=(L, L)
        ),
    }
    mask = blocks[case]() if case in blocks else None
    # Bands of 256 keys per row, symmetric and causal, through flash_attention (the window routes'
    # kernel), which merges the boundary by default at this width.
    window = {"window": (127, 128), "causal_window": (255, 0)}.get(case)
    dense_mask = mask.to_dense() if mask is not None else None
    if window is not None:
        i, j = torch.arange(L, device="cuda")[:, None], torch.arange(L, device="cuda")[None, :]
        dense_mask = (i - j <= window[0]) & (j - i <= window[1])

    def args():
        if window is not None:
            return sparse_attn.flash_attention, (q, k, v), {"window": window}
        if mask is None:
            return sparse_attn.flash_attention, (q, k, v), {"causal": True}
        return sparse_attn.block_sparse_attention, (q, k, v, mask), {}

    def run(merge):
        op, a, kw = args()
        with overrides(tile=tile, merge_boundary=merge):
            planned = sparse_attn.explain(op, *a, **kw).launches[0].options["merge_boundary"]
            assert planned == (0 if rows == "192" else {None: planned, True: 1, False: 0}[merge])
            return op(*a, **kw, return_lse=True)

    out_default, lse_default = run(None)
    out, lse = run(True)
    out_apart, lse_apart = run(False)
    for o, x in ((out_apart, lse_apart), (out_default, lse_default)):
        torch.testing.assert_close(out, o, rtol=0, atol=0)
        torch.testing.assert_close(lse, x, rtol=0, atol=0)
    check_attention(
        out,
        lse,
        q,
        k,
        v,
        mask=dense_mask,
        causal=case == "causal",
        name=f"merged boundary {case} d={d}",
    )


def _raw_block_sparse(q, k, v, mask, order):
    return torch.ops.sparse_attn.block_sparse_fwd(
        q,
        k,
        v,
        mask.kv_num_blocks,
        mask.kv_indices,
        mask.kv_partial,
        mask.partial_masks,
        mask.q_block,
        mask.kv_block,
        None,
        order,
    )


@pytest.mark.parametrize("heavy", [0, 1, 3, 8])
def test_q_block_order_any_heavy_count_gives_the_same_output(device, heavy):
    # The schedule changes which CTA runs which tile, never the result.
    L = 1024
    q, k, v = make_qkv(1, 3, 3, L, L, 64, device=device)
    mask = patterns.longformer(L, 100, [0, 600], device=device)
    order = torch.arange(mask.num_q_blocks - 1, -1, -1, dtype=torch.int32, device=device)
    order = torch.cat([order, torch.tensor([heavy], dtype=torch.int32, device=device)])
    out, lse = _raw_block_sparse(q, k, v, mask, order)
    check_attention(out, lse, q, k, v, mask=mask.to_dense(), name=f"heavy={heavy}")


def test_q_block_order_shape_is_checked(device):
    L = 512
    q, k, v = make_qkv(1, 2, 2, L, L, 64, device=device)
    mask = patterns.causal(L, L, device=device)
    bad = torch.arange(mask.num_q_blocks, dtype=torch.int32, device=device)  # missing the count
    with pytest.raises(RuntimeError, match=r"q_block_order must have shape \(5,\)"):
        _raw_block_sparse(q, k, v, mask, bad)


def test_misaligned_partial_mask_words_give_the_same_output(device):
    # The Hopper core reads a row of mask words as one 16-byte load; words that start off a 16-byte
    # boundary (a view into a larger tensor) are copied before the launch, never read misaligned.
    L = 1000
    q, k, v = make_qkv(1, 2, 2, L, L, 128, device=device, seed=5)
    mask = block_kernel_mask(patterns.sliding_window(L, 300, device=device))
    assert mask.partial_masks.shape[0] > 0
    words = torch.zeros(mask.partial_masks.numel() + 1, dtype=torch.int32, device=device)[1:]
    words = words.view_as(mask.partial_masks).copy_(mask.partial_masks)
    assert words.data_ptr() % 16 != 0
    shifted = sparse_attn.BlockSparseMask(
        mask.kv_num_blocks, mask.kv_indices, mask.kv_partial, words, seq_lengths=(L, L), block_size=mask.block_size
    )
    expected = sparse_attn.block_sparse_attention(q, k, v, mask)
    torch.testing.assert_close(sparse_attn.block_sparse_attention(q, k, v, shifted), expected, rtol=0, atol=0)


@pytest.mark.cuda
@hopper
def test_hopper_invalid_list_entries_add_nothing():
    # The raw op takes the mask tensors unvalidated: an entry whose key block or partial id is out
    # of range must add nothing (the kernel re-checks each entry before it reads mask words).
    L = 384
    q, k, v = make_qkv(1, 2, 2, L, L, 128, device="cuda", seed=11)
    words = torch.randint(0, 1 << 30, (1, 128, 4), generator=torch.Generator().manual_seed(0), dtype=torch.int64)
    words = words.to(torch.int32).cuda()
    # Query block 0: key block 0 (full) and 7 (out of range); 1: key block 1 with partial id 5
    # (out of range); 2: key block 1 (full) and 2 (partial 0).
    cnt = torch.tensor([[[2, 1, 2]]], dtype=torch.int32, device="cuda")
    idx = torch.tensor([[[[0, 7], [1, 0], [1, 2]]]], dtype=torch.int32, device="cuda")
    part = torch.tensor([[[[-1, -1], [5, -1], [-1, 0]]]], dtype=torch.int32, device="cuda")
    out, lse = torch.ops.sparse_attn.block_sparse_fwd(q, k, v, cnt, idx, part, words, 128, 128, None, None)
    dense = torch.zeros(L, L, dtype=torch.bool, device="cuda")
    dense[:128, :128] = True
    dense[256:, 128:256] = True
    dense[256:, 256:] = ((words[0].unsqueeze(-1) >> torch.arange(32, device="cuda")) & 1).flatten(1).bool()
    check_attention(out, lse, q, k, v, mask=dense, name="invalid entries")
