"""BlockSparseMask (per query block, its key blocks and their element bits): compressed layout,
conversions, composition, validation, FlexAttention interop in both directions and the kernel's
CTA schedule."""

from __future__ import annotations

import inspect
import math

import numpy as np
import pytest
import torch
from torch.nn.attention.flex_attention import AuxRequest, create_block_mask, create_mask, flex_attention
from utils import check_attention, check_close, make_qkv

import sparse_attn
from sparse_attn import BlockSparseMask, patterns, reference
from sparse_attn.masks import cta_schedule, unpack_bits

NONE, FULL = -2, -1

LENGTHS = [(1, 1), (17, 17), (200, 300), (300, 200), (256, 256), (257, 129)]
BLOCK_SIZES = [64, 128, (64, 128), (128, 64)]


def _pair(bs):
    return (bs, bs) if isinstance(bs, int) else tuple(bs)


def _blocks_of(x, lq, lk, block_size, fill):
    """(..., Lq, Lk) -> (..., nQb, nKb, bq, bk), padded with ``fill`` past the sequence ends."""
    bq, bk = _pair(block_size)
    nq, nk = math.ceil(lq / bq), math.ceil(lk / bk)
    padded = torch.full((*x.shape[:-2], nq * bq, nk * bk), fill, dtype=x.dtype)
    padded[..., :lq, :lk] = x
    return padded.unflatten(-1, (nk, bk)).unflatten(-3, (nq, bq)).transpose(-3, -2)


def expected_states(dense, block_size):
    """Brute force: -2 where a block holds no allowed pair, -1 where every in-range pair is allowed,
    0 where it is partial."""
    lq, lk = dense.shape[-2:]
    allowed = _blocks_of(dense, lq, lk, block_size, False)
    inside = _blocks_of(torch.ones_like(dense), lq, lk, block_size, False)
    some = allowed.flatten(-2).any(-1)
    full = (allowed | ~inside).flatten(-2).all(-1)
    return torch.where(~some, NONE, torch.where(full, FULL, 0))


def states(mask):
    """The mask's block table with every partial block's row number replaced by 0."""
    t = mask.block_table()
    return torch.where(t >= 0, 0, t)


def expand_blocks(blocks, lq, lk, block_size):
    bq, bk = _pair(block_size)
    return blocks.repeat_interleave(bq, -2).repeat_interleave(bk, -1)[..., :lq, :lk]


def random_element_mask(shape, lq, lk, block_size, seed):
    """Bool (*shape, Lq, Lk) whose blocks are drawn empty, full or partial (random density)."""
    g = torch.Generator().manual_seed(seed)
    bq, bk = _pair(block_size)
    nq, nk = math.ceil(lq / bq), math.ceil(lk / bk)
    kind = expand_blocks(torch.randint(0, 3, (*shape, nq, nk), generator=g), lq, lk, block_size)
    dens = expand_blocks(torch.rand(*shape, nq, nk, generator=g), lq, lk, block_size)
    noise = torch.rand(*shape, lq, lk, generator=g)
    return (kind == 1) | ((kind == 2) & (noise < dens))


def computed_pairs_fraction(mask):
    """Pairs inside the visited blocks (clipped to the lengths) over Lq * Lk, averaged over B, H."""
    lq, lk = mask.seq_lengths
    visited = expand_blocks(mask.block_table() != NONE, lq, lk, mask.block_size)
    return visited.double().mean().item()


# ---------------------------------------------------------------------------------------- round trips
@pytest.mark.parametrize("shape", [(1, 1), (2, 3)])
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("lengths", LENGTHS)
def test_from_element_mask_round_trip(lengths, block_size, shape):
    lq, lk = lengths
    seed = 1000 * lq + lk
    dense = random_element_mask(shape, lq, lk, block_size, seed)
    mask = BlockSparseMask.from_element_mask(dense, block_size=block_size)
    assert mask.block_size == _pair(block_size)
    assert mask.seq_lengths == (lq, lk)
    assert mask.shape == (*shape, math.ceil(lq / mask.q_block), math.ceil(lk / mask.kv_block))
    assert torch.equal(mask.to_dense(), dense), f"seed {seed}"
    # Exact block classification: listed iff some pair is allowed, full iff every in-range pair is.
    assert torch.equal(states(mask), expected_states(dense, block_size)), f"seed {seed}"
    mask.validate()
    # Rebuilding from to_dense() lists the same partial blocks and gives the same pairs.
    again = BlockSparseMask.from_element_mask(mask.to_dense(), block_size=block_size)
    assert torch.equal(again.block_table() >= 0, mask.block_table() >= 0)
    assert torch.equal(again.to_dense(), dense)


def test_from_element_mask_2d_gives_broadcast_mask():
    dense = random_element_mask((), 200, 300, 64, seed=3)
    mask = BlockSparseMask.from_element_mask(dense, block_size=64)
    assert mask.kv_num_blocks.shape == (1, 1, 4)
    assert torch.equal(mask.to_dense(), dense[None, None])


@pytest.mark.parametrize("shape", [(1, 1), (1, 3), (2, 1), (2, 3)])
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("lengths", [(1, 1), (200, 300), (257, 129), (640, 640)])
def test_from_block_matrix_round_trip(lengths, block_size, shape):
    lq, lk = lengths
    bq, bk = _pair(block_size)
    g = torch.Generator().manual_seed(lq + 7 * lk)
    blocks = torch.rand(*shape, math.ceil(lq / bq), math.ceil(lk / bk), generator=g) < 0.5
    mask = BlockSparseMask.from_block_matrix(blocks, seq_lengths=(lq, lk), block_size=block_size)
    assert torch.equal(mask.block_table(), torch.where(blocks, FULL, NONE).to(torch.int32))
    assert torch.equal(mask.to_dense(), expand_blocks(blocks, lq, lk, block_size))
    assert mask.partial_masks.shape[0] == 0
    assert torch.equal(mask.kv_num_blocks, blocks.sum(-1, dtype=torch.int32))
    # All blocks are full, so the computed fraction is the element density.
    assert mask.density() == pytest.approx(mask.to_dense().double().mean().item(), abs=1e-12)
    back = BlockSparseMask.from_element_mask(mask.to_dense(), block_size=block_size)
    assert torch.equal(back.block_table(), mask.block_table())


def test_from_block_matrix_2d_and_kv_indices_layout():
    blocks = torch.tensor([[1, 0, 1], [0, 0, 0], [1, 1, 1]], dtype=torch.bool)
    mask = BlockSparseMask.from_block_matrix(blocks, seq_lengths=(300, 257), block_size=128)
    assert mask.kv_num_blocks.tolist() == [[[2, 0, 3]]]
    assert mask.kv_indices.dtype == torch.int32 and mask.kv_indices.shape == (1, 1, 3, 3)
    assert mask.kv_indices[0, 0, 0, :2].tolist() == [0, 2]
    assert mask.kv_indices[0, 0, 2].tolist() == [0, 1, 2]
    assert mask.kv_partial[0, 0, 0, :2].tolist() == [FULL, FULL]


# ---------------------------------------------------------------------------------------- block table
def test_block_table_states_by_hand():
    # Lq=200, Lk=300 with 128 blocks: a 2 x 3 grid whose last row and column are ragged.
    lq, lk = 200, 300
    dense = torch.zeros(lq, lk, dtype=torch.bool)
    dense[:128, :128] = True  # (0, 0) full
    dense[:128, 128:256] = (
        torch.arange(128)[:, None] + torch.arange(128)[None, :]
    ) % 2 == 0  # (0, 1) partial
    # (0, 2) empty
    dense[128:, :128] = True  # (1, 0) full in range: the tail rows past Lq do not count
    dense[150, 200] = True  # (1, 1) partial: one pair
    dense[128:, 256:] = True  # (1, 2) full: both ragged
    mask = BlockSparseMask.from_element_mask(dense, block_size=128)
    table = mask.block_table()[0, 0]
    assert table.dtype == torch.int32
    assert table[0, 0] == FULL and table[0, 1] >= 0 and table[0, 2] == NONE
    assert table[1, 0] == FULL and table[1, 1] >= 0 and table[1, 2] == FULL
    assert mask.kv_num_blocks.tolist() == [[[2, 3]]]
    bits = unpack_bits(mask.partial_masks, 128)
    assert torch.equal(bits[table[0, 1]], dense[:128, 128:256])
    one = torch.zeros(128, 128, dtype=torch.bool)
    one[150 - 128, 200 - 128] = True
    assert torch.equal(bits[table[1, 1]], one)


def test_identical_partial_blocks_share_a_row():
    dense = torch.ones(512, 512, dtype=torch.bool).tril()
    mask = BlockSparseMask.from_element_mask(dense, block_size=128)
    table = mask.block_table()[0, 0]
    assert mask.partial_masks.shape[0] == 1
    assert table.diagonal().tolist() == [0, 0, 0, 0]
    assert torch.equal(mask.to_dense()[0, 0], dense)


def test_empty_and_full_masks():
    empty = BlockSparseMask.from_element_mask(torch.zeros(200, 300, dtype=torch.bool), block_size=64)
    assert empty.kv_num_blocks.sum() == 0 and empty.density() == 0.0
    assert not empty.to_dense().any()
    full = BlockSparseMask.from_element_mask(torch.ones(200, 300, dtype=torch.bool), block_size=64)
    assert bool((full.block_table() == FULL).all()) and full.density() == 1.0
    assert full.partial_masks.shape[0] == 0


# ---------------------------------------------------------------------------------------- density
@pytest.mark.parametrize(
    "make",
    [
        lambda: BlockSparseMask.from_element_mask(
            random_element_mask((2, 3), 200, 300, 64, 5), block_size=64
        ),
        lambda: BlockSparseMask.from_element_mask(
            random_element_mask((1, 1), 257, 129, 128, 6), block_size=128
        ),
        lambda: BlockSparseMask.from_element_mask(
            random_element_mask((1, 2), 300, 200, (64, 128), 7), block_size=(64, 128)
        ),
        lambda: patterns.causal(1000, 1000),
        lambda: patterns.causal(200, 300, block_size=64),
        lambda: (
            patterns.sliding_window(640, 100, block_size=(128, 64))
            | patterns.global_tokens(640, [5], block_size=(128, 64))
        ),
        lambda: patterns.random_blocks(640, 0.3, seed=1, heads=3, block_size=64),
    ],
    ids=["elem_2x3", "elem_ragged", "elem_mixed", "causal", "causal_lq_lt_lk", "longformer", "random_heads"],
)
def test_density_is_computed_pairs_over_lq_lk(make):
    mask = make()
    expected = computed_pairs_fraction(mask)
    assert mask.density() == pytest.approx(expected, rel=1e-12, abs=1e-12)
    # Computed pairs cover every allowed pair.
    assert mask.density() >= mask.to_dense().double().mean().item() - 1e-12


def test_density_docstring_value():
    blocks = torch.tensor([[1, 0], [1, 1]], dtype=torch.bool)
    assert BlockSparseMask.from_block_matrix(blocks, seq_lengths=(256, 256)).density() == 0.75
    assert BlockSparseMask.from_block_matrix(blocks, seq_lengths=(200, 200)).density() == pytest.approx(
        (128 * 128 + 72 * 200) / (200 * 200)
    )


# ---------------------------------------------------------------------------------------- composition
@pytest.mark.parametrize(
    "shapes", [((1, 1), (1, 1)), ((1, 1), (1, 3)), ((1, 3), (1, 1)), ((2, 1), (1, 3)), ((2, 3), (2, 3))]
)
@pytest.mark.parametrize("block_size", [64, 128, (64, 128)])
@pytest.mark.parametrize("lengths", [(200, 300), (257, 129), (256, 256)])
def test_union_and_intersection_equal_elementwise_or_and(lengths, block_size, shapes):
    lq, lk = lengths
    da = random_element_mask(shapes[0], lq, lk, block_size, seed=11 + lq)
    db = random_element_mask(shapes[1], lq, lk, block_size, seed=13 + lk)
    a = BlockSparseMask.from_element_mask(da, block_size=block_size)
    b = BlockSparseMask.from_element_mask(db, block_size=block_size)
    for name, got, want in (("|", a | b, da | db), ("&", a & b, da & db)):
        assert torch.equal(got.to_dense(), want), name
        got.validate()
        # Listed exactly where some pair is allowed: an intersection that empties a block drops it.
        assert torch.equal(got.block_table() != NONE, expected_states(want, block_size) != NONE), name
        assert got.density() == pytest.approx(computed_pairs_fraction(got), abs=1e-12)


def test_intersection_that_empties_a_partial_block():
    lq = lk = 256
    top = torch.zeros(lq, lk, dtype=torch.bool)
    top[:64, :128] = True  # block (0, 0): first half of its rows
    top[128:, 128:] = True
    bottom = torch.zeros(lq, lk, dtype=torch.bool)
    bottom[64:128, :128] = True  # block (0, 0): second half of its rows
    bottom[128:, 128:] = True
    a = BlockSparseMask.from_element_mask(top)
    b = BlockSparseMask.from_element_mask(bottom)
    both = a & b
    assert both.block_table()[0, 0].tolist() == [[NONE, NONE], [NONE, FULL]]
    assert both.kv_num_blocks.tolist() == [[[0, 1]]]
    assert torch.equal(both.to_dense()[0, 0], top & bottom)
    assert bool((a | b).to_dense()[0, 0, :128, :128].all())


def test_intersection_of_partial_blocks_that_meet_nowhere():
    # The diagonal and the strictly lower triangle: every candidate pair of partial blocks is disjoint.
    lq = 257
    i, j = torch.arange(lq)[:, None], torch.arange(lq)[None, :]
    diagonal = patterns.sliding_window(lq, 1, block_size=64)
    strict = diagonal & BlockSparseMask.from_element_mask(j < i, block_size=64)
    assert strict.kv_num_blocks.sum() == 0, "an empty intersection must list no block"
    assert not strict.to_dense().any()
    lower = diagonal & patterns.causal(lq, lq, block_size=64)
    assert torch.equal(lower.to_dense()[0, 0], i == j)


def test_intersection_of_full_only_masks():
    # Masks with no partial block at all (block matrices) must intersect too.
    g = torch.Generator().manual_seed(0)
    ba = torch.rand(1, 2, 3, 4, generator=g) < 0.6
    bb = torch.rand(1, 1, 3, 4, generator=g) < 0.6
    a = BlockSparseMask.from_block_matrix(ba, seq_lengths=(300, 400), block_size=128)
    b = BlockSparseMask.from_block_matrix(bb, seq_lengths=(300, 400), block_size=128)
    assert torch.equal((a & b).block_table(), torch.where(ba & bb, FULL, NONE).to(torch.int32))
    assert torch.equal((a & a).to_dense(), a.to_dense())
    assert torch.equal((a | b).block_table(), torch.where(ba | bb, FULL, NONE).to(torch.int32))


def test_union_and_intersection_with_full_and_empty():
    dense = random_element_mask((1, 2), 200, 300, 64, seed=21)
    m = BlockSparseMask.from_element_mask(dense, block_size=64)
    ones = BlockSparseMask.from_block_matrix(
        torch.ones(4, 5, dtype=torch.bool), seq_lengths=(200, 300), block_size=64
    )
    zeros = BlockSparseMask.from_block_matrix(
        torch.zeros(4, 5, dtype=torch.bool), seq_lengths=(200, 300), block_size=64
    )
    assert torch.equal((m & ones).to_dense(), dense)
    assert torch.equal((m | zeros).to_dense(), dense)
    assert bool((m | ones).to_dense().all()) and bool(((m | ones).block_table() == FULL).all())
    assert (m & zeros).kv_num_blocks.sum() == 0


def test_combining_incompatible_masks_raises():
    a = patterns.causal(256, 256)
    with pytest.raises(ValueError, match="seq_lengths"):
        a | patterns.causal(256, 300)
    with pytest.raises(ValueError, match="block_size"):
        a & patterns.causal(256, 256, block_size=64)
    with pytest.raises(TypeError, match="BlockSparseMask"):
        a | torch.ones(2, 2, dtype=torch.bool)
    assert torch.equal((a | patterns.causal(256, 256)).to_dense(), a.to_dense())  # positive control


# ---------------------------------------------------------------------------------------- validation
# Lq=200, Lk=300 with 64 blocks: 4 query blocks, 5 key blocks, width 3, two partial rows.
# Padding entries (past kv_num_blocks) hold garbage on purpose: they are never read.
_PAD = 99


def _layout():
    cnt = torch.tensor([[[2, 1, 0, 3]]], dtype=torch.int32)
    idx = torch.tensor([[[[0, 4, _PAD], [2, -7, _PAD], [_PAD, _PAD, -1], [1, 2, 3]]]], dtype=torch.int32)
    part = torch.tensor([[[[-1, 0, -5], [-1, 7, 7], [-9, 3, 3], [0, -1, 1]]]], dtype=torch.int32)
    g = torch.Generator().manual_seed(0)
    bits = torch.randint(-(2**31), 2**31 - 1, (2, 64, 2), generator=g, dtype=torch.int64).to(torch.int32)
    return {"kv_num_blocks": cnt, "kv_indices": idx, "kv_partial": part, "partial_masks": bits}


def _build(layout, validate=True):
    return BlockSparseMask(
        layout["kv_num_blocks"],
        layout["kv_indices"],
        layout["kv_partial"],
        layout["partial_masks"],
        seq_lengths=(200, 300),
        block_size=64,
        validate=validate,
    )


def test_valid_layout_with_garbage_padding_is_accepted():
    mask = _build(_layout())
    mask.validate()
    table = mask.block_table()[0, 0]
    assert table[0].tolist() == [FULL, NONE, NONE, NONE, 0]
    assert table[2].tolist() == [NONE] * 5
    assert table[3].tolist() == [NONE, 0, FULL, 1, NONE]
    # Nothing reads the padding: density, conversions and the kernel.
    assert mask.density() == pytest.approx(computed_pairs_fraction(mask), abs=1e-12)
    assert torch.equal(BlockSparseMask.from_flex(mask.to_flex_block_mask()).to_dense(), mask.to_dense())
    q, k, v = make_qkv(2, 2, 1, 200, 300, 64, dtype=torch.bfloat16, seed=44)
    out, lse = sparse_attn.block_sparse_attention(q, k, v, mask, return_lse=True)
    check_attention(out, lse, q, k, v, mask=mask.to_dense())


# (tensor, position, bad value, boundary value that is fine, message)
_CORRUPTIONS = {
    "index_past_end": ("kv_indices", (0, 0, 0, 1), 5, 4, "out of range"),
    "index_negative": ("kv_indices", (0, 0, 1, 0), -1, 0, "out of range"),
    "unsorted": ("kv_indices", (0, 0, 3, 2), 1, 4, "strictly increasing"),
    "duplicate": ("kv_indices", (0, 0, 3, 1), 1, 2, "strictly increasing"),
    "duplicate_last": ("kv_indices", (0, 0, 3, 2), 2, 3, "strictly increasing"),
    "count_above_capacity": ("kv_num_blocks", (0, 0, 3), 4, 3, "kv_num_blocks"),
    "count_negative": ("kv_num_blocks", (0, 0, 2), -1, 0, "kv_num_blocks"),
    "partial_id_too_large": ("kv_partial", (0, 0, 3, 2), 2, 1, "kv_partial"),
    "partial_id_below_full": ("kv_partial", (0, 0, 0, 0), -2, -1, "kv_partial"),
}


@pytest.mark.parametrize("case", list(_CORRUPTIONS), ids=list(_CORRUPTIONS))
def test_validate_rejects_malformed_layout(case):
    name, pos, bad, good, match = _CORRUPTIONS[case]
    ok = _layout()
    ok[name][pos] = good
    _build(ok).validate()  # positive control at the boundary
    broken = _layout()
    broken[name][pos] = bad
    with pytest.raises(ValueError, match=match):
        _build(broken)
    unchecked = _build(broken, validate=False)
    with pytest.raises(ValueError, match=match):
        unchecked.validate()


@pytest.mark.parametrize("name", ["kv_num_blocks", "kv_indices", "kv_partial", "partial_masks"])
@pytest.mark.parametrize("dtype", [torch.int64, torch.int16, torch.float32, torch.bool])
def test_construction_rejects_wrong_dtype(name, dtype):
    layout = _layout()
    layout[name] = layout[name].to(dtype)
    with pytest.raises(TypeError, match=f"{name} must be int32"):
        _build(layout)
    _build(_layout())


def test_construction_rejects_non_tensor():
    layout = _layout()
    layout["kv_indices"] = layout["kv_indices"].tolist()
    with pytest.raises(TypeError, match="kv_indices must be a torch.Tensor"):
        _build(layout)


_BAD_SHAPES = {
    "counts_2d": ("kv_num_blocks", lambda t: t[0], "kv_num_blocks"),
    "counts_wrong_nqb": ("kv_num_blocks", lambda t: t[..., :3], "query blocks"),
    "indices_3d": ("kv_indices", lambda t: t[..., 0], "kv_indices"),
    "indices_wrong_nqb": ("kv_indices", lambda t: t[:, :, :3], "kv_indices"),
    "partial_wrong_width": ("kv_partial", lambda t: t[..., :2], "kv_partial"),
    "bits_wrong_words": ("partial_masks", lambda t: torch.cat([t, t], -1), "partial_masks"),
    "bits_wrong_rows": ("partial_masks", lambda t: t[:, :32], "partial_masks"),
    "bits_2d": ("partial_masks", lambda t: t[0], "partial_masks"),
}


@pytest.mark.parametrize("case", list(_BAD_SHAPES), ids=list(_BAD_SHAPES))
def test_construction_rejects_wrong_shape(case):
    name, edit, match = _BAD_SHAPES[case]
    layout = _layout()
    layout[name] = edit(layout[name]).contiguous()
    with pytest.raises(ValueError, match=match):
        _build(layout, validate=False)
    _build(_layout(), validate=False)


@pytest.mark.parametrize("block_size, match", [(32, "q_block"), ((64, 96), "kv_block"), (256, "q_block")])
def test_construction_rejects_bad_block_size(block_size, match):
    with pytest.raises(ValueError, match=match):
        BlockSparseMask.from_block_matrix(
            torch.ones(1, 1, dtype=torch.bool), seq_lengths=(8, 8), block_size=block_size
        )
    with pytest.raises(ValueError, match=match):
        BlockSparseMask.from_element_mask(torch.ones(8, 8, dtype=torch.bool), block_size=block_size)
    BlockSparseMask.from_block_matrix(torch.ones(1, 1, dtype=torch.bool), seq_lengths=(8, 8), block_size=64)


def test_from_block_matrix_rejects_bad_input():
    with pytest.raises(TypeError, match="bool"):
        BlockSparseMask.from_block_matrix(torch.ones(2, 3, dtype=torch.int32), seq_lengths=(200, 300))
    with pytest.raises(ValueError, match=r"\(B\|1, H\|1, 2, 3\)"):
        BlockSparseMask.from_block_matrix(torch.ones(2, 2, dtype=torch.bool), seq_lengths=(200, 300))
    with pytest.raises(ValueError, match="blocks must have shape"):
        BlockSparseMask.from_block_matrix(torch.ones(1, 2, 3, dtype=torch.bool), seq_lengths=(200, 300))
    assert (
        BlockSparseMask.from_block_matrix(
            torch.ones(2, 3, dtype=torch.bool), seq_lengths=(200, 300)
        ).density()
        == 1
    )


def test_from_element_mask_rejects_bad_input():
    with pytest.raises(TypeError, match="bool"):
        BlockSparseMask.from_element_mask(torch.ones(20, 30))
    with pytest.raises(ValueError, match="Lq, Lk"):
        BlockSparseMask.from_element_mask(torch.ones(2, 20, 30, dtype=torch.bool))
    assert BlockSparseMask.from_element_mask(torch.ones(20, 30, dtype=torch.bool)).density() == 1


# ---------------------------------------------------------------------------------------- FlexAttention
def _doc_ids(b, length, seed):
    """(b, length) document ids: sorted random segment starts, different per batch element."""
    g = torch.Generator().manual_seed(seed)
    starts = torch.rand(b, length, generator=g) < 0.02
    starts[:, 0] = True
    return starts.cumsum(-1) - 1


def _mask_mods(b, h, lq, lk):
    off = lk - lq
    doc_q, doc_k = _doc_ids(b, lq, 1), _doc_ids(b, lk, 1)
    prefix = torch.tensor([17, 64, 150, 0, 90][:h])

    def causal(b_, h_, q, k):
        return k <= q + off

    def sliding(b_, h_, q, k):
        return (q + off - k).abs() < 50

    def document(b_, h_, q, k):
        return (doc_q[b_, q] == doc_k[b_, k]) & (k <= q + off)

    def prefix_lm(b_, h_, q, k):
        return (k < prefix[h_]) | (k <= q + off)

    def batch_head(b_, h_, q, k):
        return ((q + k + b_) % (h_ + 2) == 0) | (q // 64 == k // 64 + b_)

    return {
        "causal": causal,
        "sliding": sliding,
        "document": document,
        "prefix_lm": prefix_lm,
        "batch_head": batch_head,
    }


# Older torch (2.11, on the lent GPU machines) always separates full blocks and has no such argument.
_HAS_SEPARATE_FULL_BLOCKS = "separate_full_blocks" in inspect.signature(create_block_mask).parameters


@pytest.mark.parametrize("separate_full_blocks", [True, False])
@pytest.mark.parametrize("block_size", [64, 128, (64, 128)])
@pytest.mark.parametrize("lengths", [(200, 200), (200, 300), (300, 257), (64, 64)])
@pytest.mark.parametrize("mod", ["causal", "sliding", "document", "prefix_lm", "batch_head"])
def test_from_flex_matches_create_mask(mod, lengths, block_size, separate_full_blocks):
    lq, lk = lengths
    b, h = 2, 3
    mask_mod = _mask_mods(b, h, lq, lk)[mod]
    kwargs = {}
    if _HAS_SEPARATE_FULL_BLOCKS:
        kwargs["separate_full_blocks"] = separate_full_blocks
    elif not separate_full_blocks:
        pytest.skip(f"torch {torch.__version__}: create_block_mask cannot merge full blocks into partial ones")
    block_mask = create_block_mask(mask_mod, b, h, lq, lk, device="cpu", BLOCK_SIZE=block_size, **kwargs)
    want = create_mask(mask_mod, b, h, lq, lk, device="cpu")
    mask = BlockSparseMask.from_flex(block_mask)
    assert mask.block_size == _pair(block_size) and mask.seq_lengths == (lq, lk)
    assert torch.equal(mask.to_dense().expand(b, h, lq, lk), want)
    assert torch.equal(states(mask).expand(b, h, -1, -1), expected_states(want, block_size))
    mask.validate()


def test_from_flex_broadcast_block_mask():
    block_mask = create_block_mask(
        lambda b, h, q, k: k <= q, None, None, 300, 300, device="cpu", BLOCK_SIZE=64
    )
    mask = BlockSparseMask.from_flex(block_mask)
    assert mask.shape[:2] == (1, 1)
    assert torch.equal(mask.to_dense()[0, 0], reference.causal_mask(300, 300))


def test_from_flex_rejects_unsupported_block_size():
    block_mask = create_block_mask(lambda b, h, q, k: k <= q, 1, 1, 64, 64, device="cpu", BLOCK_SIZE=32)
    with pytest.raises(ValueError, match="q_block"):
        BlockSparseMask.from_flex(block_mask)


_FLEX_MASKS = {
    "causal_200_300": lambda: patterns.causal(200, 300, block_size=64),
    "causal_300_200": lambda: patterns.causal(300, 200),
    "longformer_257": lambda: patterns.sliding_window(257, 40) | patterns.global_tokens(257, [0, 200]),
    "per_head_mixed": lambda: BlockSparseMask.from_element_mask(
        random_element_mask((2, 3), 200, 300, (64, 128), seed=31), block_size=(64, 128)
    ),
    "per_batch_empty_rows": lambda: BlockSparseMask.from_element_mask(
        random_element_mask((2, 1), 257, 129, 64, seed=32) & (torch.arange(257) % 5 != 0)[:, None],
        block_size=64,
    ),
}


@pytest.mark.parametrize("case", list(_FLEX_MASKS), ids=list(_FLEX_MASKS))
def test_to_flex_block_mask_round_trip_and_lists(case):
    mask = _FLEX_MASKS[case]()
    block_mask = mask.to_flex_block_mask()
    assert block_mask.seq_lengths == mask.seq_lengths
    assert tuple(block_mask.BLOCK_SIZE) == mask.block_size
    # Flex's lists: partial and full blocks kept apart, together the visited blocks.
    table = mask.block_table()
    assert torch.equal(block_mask.to_dense().bool(), table != NONE)
    assert torch.equal(block_mask.full_kv_num_blocks, (table == FULL).sum(-1, dtype=torch.int32))
    assert torch.equal(block_mask.kv_num_blocks, (table >= 0).sum(-1, dtype=torch.int32))
    back = BlockSparseMask.from_flex(block_mask)
    assert torch.equal(back.to_dense(), mask.to_dense())
    assert torch.equal(states(back), states(mask))


@pytest.mark.parametrize("case", list(_FLEX_MASKS), ids=list(_FLEX_MASKS))
def test_to_flex_block_mask_in_flex_attention_matches_block_sparse(case):
    mask = _FLEX_MASKS[case]()
    lq, lk = mask.seq_lengths
    q, k, v = make_qkv(2, 3, 3, lq, lk, 64, dtype=torch.float32, seed=41)
    dense = mask.to_dense()
    flex_out, aux = flex_attention(
        q, k, v, block_mask=mask.to_flex_block_mask(), return_aux=AuxRequest(lse=True)
    )
    flex_lse = aux.lse
    out, lse = sparse_attn.block_sparse_attention(q, k, v, mask, return_lse=True)
    gold = check_attention(out, lse, q, k, v, mask=dense, name="block_sparse")
    check_attention(flex_out, flex_lse, q, k, v, mask=dense, name="flex")
    # The op within the tolerance rule with FlexAttention as the peer.
    check_close("block_sparse vs flex", out, gold, flex_out, dtype=torch.float32)


def test_to_device_keeps_the_mask(device):
    mask = patterns.sliding_window(257, 40, block_size=64) | patterns.global_tokens(257, [3], block_size=64)
    moved = mask.to(device)
    assert moved.device.type == device
    assert torch.equal(moved.to_dense().cpu(), mask.to_dense())
    assert torch.equal(moved.block_table().cpu(), mask.block_table())
    moved.validate()
    q, k, v = make_qkv(1, 2, 2, 257, 257, 64, dtype=torch.float32, device=device, seed=43)
    out, lse = sparse_attn.block_sparse_attention(q, k, v, moved, return_lse=True)
    check_attention(out, lse, q, k, v, mask=moved.to_dense())


# ---------------------------------------------------------------------------------------- CTA schedule
@pytest.mark.parametrize(
    "weights, want",
    [
        ([], [0]),
        ([3], [0, 0]),
        ([2, 9, 2, 1], [1, 0, 2, 3, 1]),  # ties keep block order; 9 > 2 x 3.5
        ([1, 1, 4], [2, 0, 1, 0]),  # 4 is exactly twice the mean: not heavier
        ([1, 1, 5], [2, 0, 1, 1]),
        ([0, 0, 0], [0, 1, 2, 0]),
        ([7, 7, 1, 1, 1, 1, 1, 1, 1, 1], [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 2]),
    ],
)
def test_cta_schedule_by_hand(weights, want):
    """Query blocks heaviest first (stable), then how many weigh more than twice the mean: the same
    for a tensor (the attention's) and a numpy array (the pattern builders' host plans)."""
    device_form = cta_schedule(torch.tensor(weights, dtype=torch.int32))
    host_form = cta_schedule(np.array(weights, dtype=np.int64))
    assert device_form.dtype == torch.int32 and host_form.dtype == np.int32
    assert device_form.tolist() == want and host_form.tolist() == want


def test_cta_schedule_host_and_device_forms_agree():
    gen = torch.Generator().manual_seed(0)
    for n, top in [(1, 3), (17, 4), (300, 40), (4096, 1000)]:
        weights = torch.randint(0, top, (n,), generator=gen, dtype=torch.int32)
        weights[: n // 50] = top * 3  # a few global-token rows
        assert np.array_equal(cta_schedule(weights).numpy(), cta_schedule(weights.numpy()))
