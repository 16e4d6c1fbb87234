"""The pattern library against brute-force element predicates written from each pattern's definition
(the predicate its docstring states), composition, seeded randomness, run-time switching and argument
checks."""

from __future__ import annotations

import math

import pytest
import torch
from utils import check_attention, make_qkv

import sparse_attn
from sparse_attn import BlockSparseMask, patterns, reference
from sparse_attn.masks import ExactForm

NONE, FULL = -2, -1
LENGTHS = [1, 17, 200, 257, 640]
BLOCK_SIZES = [64, 128, (64, 128), (128, 64)]


def _pair(bs):
    return (bs, bs) if isinstance(bs, int) else tuple(bs)


def grid(lq, lk=None):
    lk = lq if lk is None else lk
    return torch.arange(lq)[:, None], torch.arange(lk)[None, :]


def expected_states(dense, block_size):
    """-2 where a block holds no allowed pair, -1 where every in-range pair is allowed, 0 partial."""
    bq, bk = _pair(block_size)
    lq, lk = dense.shape[-2:]
    nq, nk = math.ceil(lq / bq), math.ceil(lk / bk)
    allowed = torch.zeros(nq * bq, nk * bk, dtype=torch.bool)
    inside = torch.zeros(nq * bq, nk * bk, dtype=torch.bool)
    allowed[:lq, :lk] = dense
    inside[:lq, :lk] = True

    def blocks(x):
        return x.reshape(nq, bq, nk, bk).transpose(1, 2).flatten(2)

    some = blocks(allowed).any(-1)
    full = (blocks(allowed) | ~blocks(inside)).all(-1)
    return torch.where(~some, NONE, torch.where(full, FULL, 0))


def states(mask):
    t = mask.block_table()
    return torch.where(t >= 0, 0, t)


def check_pattern(mask, want, block_size):
    """The pattern's element mask is the predicate's, and its blocks are classified exactly."""
    lq, lk = want.shape
    assert mask.seq_lengths == (lq, lk) and mask.block_size == _pair(block_size)
    dense = mask.to_dense()
    assert dense.shape == (1, 1, lq, lk)
    if not torch.equal(dense[0, 0], want):
        bad = (dense[0, 0] != want).nonzero()[:5].tolist()
        raise AssertionError(f"element mask differs from the predicate at (i, j) = {bad}")
    assert torch.equal(states(mask)[0, 0], expected_states(want, block_size)), (
        "block table: a block is listed iff it holds an allowed pair, full iff all its in-range pairs are"
    )
    mask.validate()


# ------------------------------------------------------------------------------------ predicates (as documented)
def pred_causal(lq, lk):
    i, j = grid(lq, lk)
    return j <= i + (lk - lq)


def pred_sliding_window(length, w, causal=False):
    i, j = grid(length)
    return ((i - j) >= 0) & ((i - j) < w) if causal else (i - j).abs() < w


def pred_dilated(length, w, r):
    i, j = grid(length)
    return ((i - j).abs() < w) & ((i - j).abs() % r == 0)


def pred_dilated_2d(length, segment, r):
    i, j = grid(length)
    return (i // segment == j // segment) & ((i % segment) % r == 0) & ((j % segment) % r == 0)


def pred_strided(length, stride, local):
    i, j = grid(length)
    return ((i - j).abs() < local) | ((i - j) % stride == 0)


def pred_global(length, idx):
    i, j = grid(length)
    g = torch.tensor(sorted(idx), dtype=torch.long)
    return torch.isin(i, g) | torch.isin(j, g)


# ------------------------------------------------------------------------------------ each pattern
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize(
    "lengths",
    [
        (1, 1),
        (17, 17),
        (200, 200),
        (640, 640),
        (1, 257),
        (257, 1),
        (200, 300),
        (300, 200),
        (17, 640),
        (640, 129),
    ],
)
def test_causal(lengths, block_size):
    lq, lk = lengths
    check_pattern(patterns.causal(lq, lk, block_size=block_size), pred_causal(lq, lk), block_size)


def test_causal_with_lq_gt_lk_has_empty_rows():
    dense = patterns.causal(300, 200, block_size=64).to_dense()[0, 0]
    assert not dense[:100].any() and bool(dense[100:].any(-1).all())


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("length", LENGTHS)
@pytest.mark.parametrize("window", [1, 37, 128, 1000])
@pytest.mark.parametrize("causal", [False, True])
def test_sliding_window(causal, window, length, block_size):
    mask = patterns.sliding_window(length, window, causal=causal, block_size=block_size)
    check_pattern(mask, pred_sliding_window(length, window, causal), block_size)


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("length", LENGTHS)
@pytest.mark.parametrize("window, dilation", [(100, 3), (300, 64), (5, 1), (1, 7), (129, 2)])
def test_dilated(window, dilation, length, block_size):
    mask = patterns.dilated(length, window, dilation, block_size=block_size)
    check_pattern(mask, pred_dilated(length, window, dilation), block_size)


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("length", LENGTHS)
@pytest.mark.parametrize("segment, dilation", [(96, 4), (128, 1), (1000, 7), (1, 1), (100, 3), (64, 64)])
def test_dilated_2d(segment, dilation, length, block_size):
    mask = patterns.dilated_2d(length, segment, dilation, block_size=block_size)
    check_pattern(mask, pred_dilated_2d(length, segment, dilation), block_size)


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("length", LENGTHS)
@pytest.mark.parametrize("stride, local", [(50, 10), (300, 1), (64, 64), (1, 1), (129, 200), (7, 3)])
def test_strided(stride, local, length, block_size):
    mask = patterns.strided(length, stride, local, block_size=block_size)
    check_pattern(mask, pred_strided(length, stride, local), block_size)


def _global_sets(length):
    return {
        "first": [0],
        "ends": sorted({0, length - 1}),
        "every_37": list(range(0, length, 37)),
        "block_edges": sorted({i for i in (63, 64, 127, 128, 255, 256) if i < length}) or [0],
        "none": [],
    }


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("length", LENGTHS)
@pytest.mark.parametrize("which", ["first", "ends", "every_37", "block_edges", "none"])
def test_global_tokens(which, length, block_size):
    idx = _global_sets(length)[which]
    mask = patterns.global_tokens(length, idx, block_size=block_size)
    check_pattern(mask, pred_global(length, idx), block_size)


def test_global_tokens_accepts_a_tensor_and_duplicates():
    idx = torch.tensor([5, 5, 130])
    mask = patterns.global_tokens(200, idx, block_size=64)
    check_pattern(mask, pred_global(200, [5, 130]), 64)


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("length", LENGTHS)
@pytest.mark.parametrize("window, idx", [(32, [0]), (1, [0, 1, 2, 3]), (200, [100, 199]), (5, [])])
def test_longformer(window, idx, length, block_size):
    idx = [g for g in idx if g < length]
    mask = patterns.longformer(length, window, idx, block_size=block_size)
    want = pred_sliding_window(length, window) | pred_global(length, idx)
    check_pattern(mask, want, block_size)


@pytest.mark.parametrize(
    "make",
    [
        lambda: patterns.causal(0, 5),
        lambda: patterns.causal(5, 0),
        lambda: patterns.sliding_window(0, 3),
        lambda: patterns.dilated(0, 3, 2),
        lambda: patterns.dilated_2d(0, 4, 2),
        lambda: patterns.strided(0, 4, 2),
        lambda: patterns.global_tokens(0, []),
        lambda: patterns.longformer(0, 3, []),
        lambda: patterns.bigbird(0, 3, 1, 1),
        lambda: patterns.random_blocks(0, 0.5),
    ],
)
def test_zero_length_patterns_are_empty(make):
    mask = make()
    lq, lk = mask.seq_lengths
    assert lq * lk == 0 and mask.to_dense().shape == (1, 1, lq, lk)
    assert mask.density() == 0.0 and int(mask.kv_num_blocks.sum()) == 0
    mask.validate()


# ------------------------------------------------------------------------------------ random patterns
def _random_part(mask, deterministic, block_size):
    """Blocks of ``mask`` beyond the deterministic predicate: each must be entirely on."""
    bq, bk = _pair(block_size)
    lq, lk = mask.seq_lengths
    dense = mask.to_dense()
    assert bool((dense >= deterministic).all()), "the window and global tokens must be kept"
    full = (mask.block_table() == FULL).repeat_interleave(bq, -2).repeat_interleave(bk, -1)[..., :lq, :lk]
    extra = dense & ~deterministic
    assert not bool((extra & ~full).any()), "pairs beyond window and globals must come from whole random blocks"


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("length", LENGTHS)
@pytest.mark.parametrize("window, num_global, num_random", [(16, 2, 2), (1, 0, 1), (100, 5, 0), (64, 1, 50)])
def test_bigbird(window, num_global, num_random, length, block_size):
    mask = patterns.bigbird(length, window, num_global, num_random, seed=3, block_size=block_size)
    deterministic = pred_sliding_window(length, window) | pred_global(length, range(min(num_global, length)))
    _random_part(mask, deterministic, block_size)
    mask.validate()
    if num_random == 0:
        check_pattern(mask, deterministic, block_size)


@pytest.mark.parametrize("block_size", [64, 128])
@pytest.mark.parametrize("num_random", [1, 3, 7])
def test_bigbird_draws_the_requested_number_of_random_blocks(num_random, block_size):
    # Window 1 (the diagonal) has no full block when L is a multiple of the block size: the full
    # blocks are then exactly the random ones, a random block on the diagonal included.
    length = 640
    mask = patterns.bigbird(length, 1, 0, num_random, seed=11, block_size=block_size)
    n = length // block_size
    full = mask.block_table()[0, 0] == FULL
    assert full.sum(-1).tolist() == [min(num_random, n)] * n
    want = pred_sliding_window(length, 1) | full.repeat_interleave(block_size, 0).repeat_interleave(block_size, 1)
    check_pattern(mask, want, block_size)


def test_bigbird_more_random_blocks_than_exist_is_everything():
    mask = patterns.bigbird(300, 1, 0, 50, seed=0, block_size=64)
    assert bool(mask.to_dense().all())


def test_bigbird_seeded_reproducible_and_per_head():
    a = patterns.bigbird(2048, 8, 2, 3, seed=5, heads=4, block_size=64)
    b = patterns.bigbird(2048, 8, 2, 3, seed=5, heads=4, block_size=64)
    c = patterns.bigbird(2048, 8, 2, 3, seed=6, heads=4, block_size=64)
    assert a.shape[:2] == (1, 4)
    assert torch.equal(a.block_table(), b.block_table()) and torch.equal(a.to_dense(), b.to_dense())
    assert not torch.equal(a.to_dense(), c.to_dense()), "a different seed must draw different blocks"
    heads = a.to_dense()[0]
    assert not torch.equal(heads[0], heads[1]), "each head draws its own random blocks"
    assert bool(heads.diagonal(dim1=-2, dim2=-1).all()), "the diagonal is always on"
    single = patterns.bigbird(2048, 8, 2, 3, seed=5, block_size=64)
    assert single.shape[:2] == (1, 1)


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("length", LENGTHS)
@pytest.mark.parametrize("density", [0.0, 0.3, 1.0])
def test_random_blocks(density, length, block_size):
    mask = patterns.random_blocks(length, density, seed=2, block_size=block_size)
    dense = mask.to_dense()[0, 0]
    assert bool(dense.diagonal().all()), "every diagonal pair (i, i) is always on"
    table = mask.block_table()[0, 0]
    assert bool((table != NONE).eq(table == FULL).all()), "random blocks are whole blocks"
    assert mask.partial_masks.shape[0] == 0
    bq, bk = _pair(block_size)
    diag_blocks = torch.zeros_like(table, dtype=torch.bool)
    diag_blocks[torch.arange(length) // bq, torch.arange(length) // bk] = True
    if density == 0.0:
        assert torch.equal(table == FULL, diag_blocks), "density 0 keeps exactly the blocks on the diagonal"
    if density == 1.0:
        assert bool(dense.all())
    mask.validate()


def test_random_blocks_density_seeded_and_per_head():
    a = patterns.random_blocks(4096, 0.3, seed=7, heads=3, block_size=64)
    b = patterns.random_blocks(4096, 0.3, seed=7, heads=3, block_size=64)
    c = patterns.random_blocks(4096, 0.3, seed=8, heads=3, block_size=64)
    assert a.shape == (1, 3, 64, 64)
    assert torch.equal(a.block_table(), b.block_table())
    assert not torch.equal(a.block_table(), c.block_table())
    on = (a.block_table() == FULL)[0]
    assert not torch.equal(on[0], on[1])
    off_diag = ~torch.eye(64, dtype=torch.bool)
    frac = on[:, off_diag].double().mean().item()
    assert 0.27 < frac < 0.33, f"off-diagonal block fraction {frac} for density 0.3 (seed 7, 3 x 4032 draws)"


# ------------------------------------------------------------------------------------ composition
_COMPOSITIONS = {
    "causal_and_window": (
        lambda n, bs: patterns.causal(n, n, block_size=bs) & patterns.sliding_window(n, 50, block_size=bs),
        lambda n: pred_causal(n, n) & pred_sliding_window(n, 50),
    ),
    "window_or_global": (
        lambda n, bs: (
            patterns.sliding_window(n, 20, block_size=bs) | patterns.global_tokens(n, [0, n // 2], block_size=bs)
        ),
        lambda n: pred_sliding_window(n, 20) | pred_global(n, sorted({0, n // 2})),
    ),
    "dilated_and_strided": (
        lambda n, bs: patterns.dilated(n, 150, 2, block_size=bs) & patterns.strided(n, 6, 4, block_size=bs),
        lambda n: pred_dilated(n, 150, 2) & pred_strided(n, 6, 4),
    ),
    "dilated_2d_or_causal_window": (
        lambda n, bs: (
            patterns.dilated_2d(n, 96, 4, block_size=bs) | patterns.sliding_window(n, 8, causal=True, block_size=bs)
        ),
        lambda n: pred_dilated_2d(n, 96, 4) | pred_sliding_window(n, 8, causal=True),
    ),
    "strided_and_causal": (
        lambda n, bs: patterns.strided(n, 300, 1, block_size=bs) & patterns.causal(n, n, block_size=bs),
        lambda n: pred_strided(n, 300, 1) & pred_causal(n, n),
    ),
    "diagonal_and_globals_and_dilated": (
        lambda n, bs: (
            patterns.sliding_window(n, 1, block_size=bs)
            & (patterns.global_tokens(n, [0], block_size=bs) & patterns.dilated(n, n, 2, block_size=bs))
        ),
        lambda n: pred_sliding_window(n, 1) & pred_global(n, [0]) & pred_dilated(n, n, 2),
    ),
    "three_way": (
        lambda n, bs: (
            (patterns.causal(n, n, block_size=bs) | patterns.global_tokens(n, [3], block_size=bs))
            & patterns.dilated(n, 1000, 3, block_size=bs)
        ),
        lambda n: (pred_causal(n, n) | pred_global(n, [3])) & pred_dilated(n, 1000, 3),
    ),
}


@pytest.mark.parametrize("block_size", [64, 128, (64, 128)])
@pytest.mark.parametrize("length", [17, 200, 257, 640])
@pytest.mark.parametrize("case", list(_COMPOSITIONS), ids=list(_COMPOSITIONS))
def test_composition_equals_predicate_logic(case, length, block_size):
    make, pred = _COMPOSITIONS[case]
    mask = make(length, block_size)
    want = pred(length)
    dense = mask.to_dense()[0, 0]
    assert torch.equal(dense, want)
    # Listed exactly where a pair is allowed (intersections that empty a block drop it).
    assert torch.equal(states(mask)[0, 0] != NONE, expected_states(want, block_size) != NONE)
    mask.validate()


# ------------------------------------------------------------------------------------ run-time switching
def test_switching_patterns_at_run_time():
    length, d = 257, 64
    q, k, v = make_qkv(1, 4, 2, length, length, d, dtype=torch.bfloat16, seed=17)
    masks = [
        patterns.causal(length, length),
        patterns.sliding_window(length, 32),
        patterns.sliding_window(length, 32, causal=True),
        patterns.dilated(length, 100, 4),
        patterns.dilated_2d(length, 64, 4),
        patterns.strided(length, 50, 8),
        patterns.global_tokens(length, [0, 256]),
        patterns.longformer(length, 16, [1]),
        patterns.bigbird(length, 16, 2, 1, seed=1, heads=4),
        patterns.random_blocks(length, 0.4, seed=1, heads=4),
        patterns.causal(length, length) & patterns.strided(length, 300, 1),
    ]
    outs = []
    for mask in masks:
        out, lse = sparse_attn.block_sparse_attention(q, k, v, mask, return_lse=True)
        check_attention(out, lse, q, k, v, mask=mask.to_dense(), name=repr(mask))
        outs.append(out)
    assert not torch.equal(outs[0], outs[1]), "different patterns give different outputs"


def test_patterns_on_device(device):
    for make in (
        lambda dev: patterns.causal(200, 300, block_size=64, device=dev),
        lambda dev: patterns.longformer(257, 16, [0, 100], device=dev),
        lambda dev: patterns.dilated_2d(257, 64, 4, device=dev),
        lambda dev: patterns.bigbird(257, 16, 2, 1, seed=1, heads=2, device=dev),
        lambda dev: patterns.random_blocks(257, 0.5, seed=1, device=dev),
    ):
        on_device, on_cpu = make(device), make(None)
        assert on_device.device.type == device
        assert torch.equal(on_device.to_dense().cpu(), on_cpu.to_dense())


# ------------------------------------------------------------------------------------ bad arguments
_BAD = {
    "causal_lq": (lambda: patterns.causal(-1, 5), "lq", lambda: patterns.causal(0, 5)),
    "causal_lk": (lambda: patterns.causal(5, -1), "lk", lambda: patterns.causal(5, 0)),
    "causal_lq_float": (lambda: patterns.causal(5.0, 5), "lq", lambda: patterns.causal(5, 5)),
    "window_zero": (
        lambda: patterns.sliding_window(100, 0),
        "window",
        lambda: patterns.sliding_window(100, 1),
    ),
    "window_bool": (
        lambda: patterns.sliding_window(100, True),
        "window",
        lambda: patterns.sliding_window(100, 1),
    ),
    "seq_len_negative": (
        lambda: patterns.sliding_window(-1, 4),
        "seq_len",
        lambda: patterns.sliding_window(0, 4),
    ),
    "dilation_zero": (lambda: patterns.dilated(100, 10, 0), "dilation", lambda: patterns.dilated(100, 10, 1)),
    "dilated_window": (lambda: patterns.dilated(100, 0, 2), "window", lambda: patterns.dilated(100, 1, 2)),
    "segment_zero": (
        lambda: patterns.dilated_2d(100, 0, 1),
        "segment",
        lambda: patterns.dilated_2d(100, 1, 1),
    ),
    "dilation_2d_zero": (
        lambda: patterns.dilated_2d(100, 8, 0),
        "dilation",
        lambda: patterns.dilated_2d(100, 8, 1),
    ),
    "stride_zero": (lambda: patterns.strided(100, 0, 1), "stride", lambda: patterns.strided(100, 1, 1)),
    "local_zero": (lambda: patterns.strided(100, 4, 0), "local", lambda: patterns.strided(100, 4, 1)),
    "global_past_end": (
        lambda: patterns.global_tokens(100, [100]),
        "global_idx",
        lambda: patterns.global_tokens(100, [99]),
    ),
    "global_negative": (
        lambda: patterns.global_tokens(100, [-1]),
        "global_idx",
        lambda: patterns.global_tokens(100, [0]),
    ),
    "global_range_past_end": (
        lambda: patterns.global_tokens(100, range(101)),
        "global_idx",
        lambda: patterns.global_tokens(100, range(100)),
    ),
    "global_range_negative": (
        lambda: patterns.global_tokens(100, range(50, -2, -1)),
        "global_idx",
        lambda: patterns.global_tokens(100, range(50, -1, -1)),
    ),
    "longformer_global": (
        lambda: patterns.longformer(100, 4, [100]),
        "global_idx",
        lambda: patterns.longformer(100, 4, [99]),
    ),
    "num_global": (
        lambda: patterns.bigbird(100, 4, -1, 1),
        "num_global",
        lambda: patterns.bigbird(100, 4, 0, 1),
    ),
    "num_random": (
        lambda: patterns.bigbird(100, 4, 1, -1),
        "num_random",
        lambda: patterns.bigbird(100, 4, 1, 0),
    ),
    "bigbird_heads": (
        lambda: patterns.bigbird(100, 4, 1, 1, heads=0),
        "heads",
        lambda: patterns.bigbird(100, 4, 1, 1, heads=1),
    ),
    "bigbird_window": (
        lambda: patterns.bigbird(100, 0, 1, 1),
        "window",
        lambda: patterns.bigbird(100, 1, 1, 1),
    ),
    "density_high": (
        lambda: patterns.random_blocks(100, 1.5),
        "density",
        lambda: patterns.random_blocks(100, 1.0),
    ),
    "density_low": (
        lambda: patterns.random_blocks(100, -0.1),
        "density",
        lambda: patterns.random_blocks(100, 0.0),
    ),
    "density_nan": (
        lambda: patterns.random_blocks(100, float("nan")),
        "density",
        lambda: patterns.random_blocks(100, 0.5),
    ),
    "random_heads": (
        lambda: patterns.random_blocks(100, 0.5, heads=0),
        "heads",
        lambda: patterns.random_blocks(100, 0.5, heads=2),
    ),
    "q_block": (
        lambda: patterns.causal(100, 100, block_size=32),
        "q_block",
        lambda: patterns.causal(100, 100, block_size=64),
    ),
    "kv_block": (
        lambda: patterns.sliding_window(100, 4, block_size=(64, 256)),
        "kv_block",
        lambda: patterns.sliding_window(100, 4, block_size=(64, 128)),
    ),
    "global_block": (
        lambda: patterns.global_tokens(100, [0], block_size=96),
        "q_block",
        lambda: patterns.global_tokens(100, [0], block_size=128),
    ),
}


@pytest.mark.parametrize("case", list(_BAD), ids=list(_BAD))
def test_bad_arguments_raise_value_error_naming_them(case):
    bad, name, good = _BAD[case]
    with pytest.raises(ValueError, match=name):
        bad()
    assert isinstance(good(), BlockSparseMask)


# ---- length-agnostic patterns (patterns.Pattern)
@pytest.mark.parametrize(
    "make",
    [
        lambda: patterns.sliding_window(40),
        lambda: patterns.sliding_window(window=(30, 0), sinks=3, causal=True),
        lambda: patterns.longformer(window=33, global_idx=[0, 70], sinks=2, block_size=64),
        lambda: patterns.bigbird(window=20, num_global=3, num_random=2, heads=2, block_size=64),
        lambda: patterns.dilated(window=90, dilation=3),
        lambda: patterns.strided(stride=50, local=10),
        lambda: patterns.dilated_2d(segment=64, dilation=2),
        lambda: patterns.sliding_window(16) | patterns.global_tokens(global_idx=[5]),
        lambda: patterns.sliding_window(100) & patterns.random_blocks(density=0.5, seed=3),
    ],
    ids=[
        "window",
        "causal-window-sinks",
        "longformer-sinks",
        "bigbird-heads",
        "dilated",
        "strided",
        "dilated2d",
        "union",
        "intersection",
    ],
)
@pytest.mark.parametrize("lq,lk", [(257, 257), (1, 257), (40, 257), (130, 200), (300, 200)])
def test_pattern_resolves_to_the_bottom_rows_of_its_square(make, lq, lk):
    pattern = make()
    assert isinstance(pattern, patterns.Pattern)
    mask = pattern.resolve(lq, lk)
    assert mask.seq_lengths == (lq, lk)
    mask.validate()
    got = mask.to_dense()
    square = pattern.resolve(lk, lk).to_dense()
    if lq <= lk:
        assert torch.equal(got, square[..., lk - lq :, :].expand_as(got))
    else:
        assert not got[..., : lq - lk, :].any()
        assert torch.equal(got[..., lq - lk :, :], square.expand_as(got[..., lq - lk :, :]))
    assert pattern.resolve(lq, lk) is mask  # kept


def test_pattern_through_block_sparse_attention_and_its_routes():
    q = torch.randn(1, 2, 33, 32)
    k, v = torch.randn(1, 2, 300, 32), torch.randn(1, 2, 300, 32)
    window = patterns.sliding_window(64)
    mask = window.resolve(33, 300)
    assert mask.exact_form == ExactForm("window", 63, 63)  # decode keeps the flash route
    out = sparse_attn.block_sparse_attention(q, k, v, window, causal=True)
    gold, _ = reference.attention(q, k, v, mask=mask.to_dense() & patterns.causal(33, 300).to_dense())
    torch.testing.assert_close(out.double(), gold, atol=1e-5, rtol=1e-5)
    assert patterns.sliding_window(64).resolve(300, 200).exact_form is None  # rows above Lk - Lq: empty
    sinks = patterns.sliding_window(300, 16, sinks=4).to_dense()[0, 0]
    i, j = torch.arange(300)[:, None], torch.arange(300)[None, :]
    assert torch.equal(sinks, ((i - j).abs() < 16) | (j < 4))
    with pytest.raises(ValueError, match="sinks"):
        patterns.sliding_window(300, 16, sinks=-1)
    with pytest.raises(TypeError, match="patterns.Pattern"):
        sparse_attn.block_sparse_attention(q, k, v, "window")
