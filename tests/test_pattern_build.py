"""The pattern builders against brute-force element predicates on a dense (L, L) grid, over lengths,
block sizes, windows, dilations, segments and global sets around the block size; plus the random
block draw of bigbird, and that building on a device needs no host-device synchronisation (meta
tensors hold no data, so any data-dependent step raises there; on CUDA, sync debug mode "error")."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from sparse_attn import BlockSparseMask, patterns
from sparse_attn import _mask_compiler as compiler

NONE, FULL = -2, -1
LENGTHS = [0, 1, 64, 129, 1000]
SQUARE = [64, 128]
MIXED = [(64, 128), (128, 64)]
# Equal query and key blocks (the fast builders) over every length; mixed ones (the generic path)
# over a few.
SHAPES = [(n, bs) for n in LENGTHS for bs in SQUARE] + [(n, bs) for n in (0, 64, 129, 1000) for bs in MIXED]


def _pair(bs):
    return (bs, bs) if isinstance(bs, int) else tuple(bs)


# ------------------------------------------------------------------------------------ predicates
def grid(length):
    return torch.arange(length)[:, None], torch.arange(length)[None, :]


def band(length, w, causal=False):
    i, j = grid(length)
    return (i - j >= 0) & (i - j < w) if causal else (i - j).abs() < w


def dilated(length, w, r):
    i, j = grid(length)
    return ((i - j).abs() < w) & ((i - j).abs() % r == 0)


def dilated_2d(length, segment, r):
    i, j = grid(length)
    return (i // segment == j // segment) & ((i % segment) % r == 0) & ((j % segment) % r == 0)


def strided(length, stride, local):
    i, j = grid(length)
    return ((i - j).abs() < local) | ((i - j) % stride == 0)


def global_(length, idx):
    i, j = grid(length)
    g = torch.zeros(length, dtype=torch.bool)
    g[torch.as_tensor(list(idx), dtype=torch.long)] = True
    return g[i] | g[j]


def random_blocks(length, blocks, block_size):
    """(H, L, L) bool: the whole of every block in ``blocks`` (H, nQb, k)."""
    bq, bk = _pair(block_size)
    h, nq, _ = blocks.shape
    nk = math.ceil(length / bk)
    on = torch.zeros(h, nq, nk, dtype=torch.bool).scatter_(-1, torch.as_tensor(blocks), True)
    return on.repeat_interleave(bq, 1).repeat_interleave(bk, 2)[:, :length, :length]


def check(mask, want, block_size):
    """Element mask equals the predicate (broadcast over heads); a block is listed iff it holds an
    allowed pair and (equal blocks) full iff all its in-range pairs are allowed; layout valid;
    kv_indices as wide as the widest row. (With mixed blocks, unions go through ``|``, which
    leaves a partial | partial block partial even when it covers the block.)"""
    want = want if want.dim() == 3 else want[None]
    length = want.shape[-1]
    bq, bk = _pair(block_size)
    assert mask.seq_lengths == (length, length) and mask.block_size == (bq, bk)
    dense = mask.to_dense()[0]
    assert dense.shape[0] == want.shape[0] or want.shape[0] == 1
    want = want.expand_as(dense)
    if not torch.equal(dense, want):
        bad = (dense != want).nonzero()[:5].tolist()
        raise AssertionError(f"element mask differs from the predicate at (h, i, j) = {bad}")
    nq, nk = math.ceil(length / bq), math.ceil(length / bk)
    padded = torch.zeros(want.shape[0], nq * bq, nk * bk, dtype=torch.bool)
    inside = torch.zeros_like(padded)
    padded[:, :length, :length] = want
    inside[:, :length, :length] = True

    def blocks(x):
        return x.reshape(x.shape[0], nq, bq, nk, bk).transpose(2, 3).flatten(3)

    some = blocks(padded).any(-1)
    full = (blocks(padded) | ~blocks(inside)).all(-1)
    table = mask.block_table()[0].expand(want.shape[0], nq, nk)
    assert torch.equal(table != NONE, some), "a block is listed iff it holds an allowed pair"
    if bq == bk:
        assert torch.equal(table == FULL, full & some), "a block is full iff all its in-range pairs are allowed"
    else:
        assert not (table == FULL)[~full].any(), "a full block has all its in-range pairs allowed"
    mask.validate()
    width = mask.kv_indices.shape[-1]
    assert width == (int(mask.kv_num_blocks.max()) if mask.kv_num_blocks.numel() else 0), (
        "kv_indices is as wide as the widest row"
    )


# ------------------------------------------------------------------------------------ each builder
WINDOWS = [1, 63, 65, 129, 300, 5000]


@pytest.mark.parametrize("length, block_size", SHAPES)
@pytest.mark.parametrize("causal", [False, True])
def test_sliding_window(causal, length, block_size):
    for w in WINDOWS:
        mask = patterns.sliding_window(length, w, causal=causal, block_size=block_size)
        check(mask, band(length, w, causal), block_size)


@pytest.mark.parametrize("block_size", SQUARE + MIXED)
@pytest.mark.parametrize(
    "lengths", [(0, 5), (5, 0), (1, 1), (63, 64), (64, 63), (129, 1000), (1000, 129), (1000, 1000)]
)
def test_causal(lengths, block_size):
    lq, lk = lengths
    for compact in (True, False):
        mask = patterns.causal(lq, lk, block_size=block_size, compact=compact)
        i, j = torch.arange(lq)[:, None], torch.arange(lk)[None, :]
        dense = mask.to_dense()[0, 0]
        assert torch.equal(dense, j <= i + (lk - lq))
        mask.validate()


@pytest.mark.parametrize("length, block_size", SHAPES)
@pytest.mark.parametrize("dilation", [1, 3, 128, 200, 1001])
def test_dilated(dilation, length, block_size):
    for w in WINDOWS:
        check(patterns.dilated(length, w, dilation, block_size=block_size), dilated(length, w, dilation), block_size)


@pytest.mark.parametrize("length, block_size", SHAPES)
@pytest.mark.parametrize("dilation", [1, 3, 100, 129])
def test_dilated_2d(dilation, length, block_size):
    for segment in [1, 2, 5, 63, 64, 65, 96, 128, 129, 200, 256, 1000, 5000]:
        mask = patterns.dilated_2d(length, segment, dilation, block_size=block_size)
        check(mask, dilated_2d(length, segment, dilation), block_size)


@pytest.mark.parametrize("length, block_size", SHAPES)
@pytest.mark.parametrize("stride", [1, 3, 128, 300, 2000])
def test_strided(stride, length, block_size):
    for local in [1, 5, 64, 128, 200, 5000]:
        check(
            patterns.strided(length, stride, local, block_size=block_size), strided(length, stride, local), block_size
        )


def _global_sets(length):
    """Global token sets: start, middle, end, around block edges, duplicates, dense, none."""
    sets = [[], [0], [length // 2], [length - 1], [0, length - 1], [5, 5, 5, 70, 70]]
    sets += [[63, 64, 127, 128, 129], list(range(0, length, 37)), list(range(100)), list(range(length))]
    return [[g for g in s if 0 <= g < length] for s in sets] if length else [[]]


@pytest.mark.parametrize("length, block_size", SHAPES)
def test_global_tokens(length, block_size):
    for idx in _global_sets(length):
        check(patterns.global_tokens(length, idx, block_size=block_size), global_(length, idx), block_size)
    if length:  # a tensor, unsorted, with duplicates
        idx = torch.tensor([length - 1, 0, length // 3, 0])
        check(patterns.global_tokens(length, idx, block_size=block_size), global_(length, idx.tolist()), block_size)
        for idx in (range(length // 3, length, 50), range(length - 1, -1, -37), range(5, 5)):  # ranges, descending
            check(patterns.global_tokens(length, idx, block_size=block_size), global_(length, list(idx)), block_size)


@pytest.mark.parametrize("length, block_size", SHAPES)
@pytest.mark.parametrize("window", [1, 64, 65, 5000])
def test_longformer(window, length, block_size):
    for idx in _global_sets(length):
        mask = patterns.longformer(length, window, idx, block_size=block_size)
        check(mask, band(length, window) | global_(length, idx), block_size)


@pytest.mark.parametrize("length, block_size", SHAPES)
@pytest.mark.parametrize("heads", [1, 3])
def test_bigbird(heads, length, block_size):
    for window, num_global, num_random in [(1, 0, 1), (64, 3, 2), (100, 64, 3), (200, 130, 1), (5000, 1, 4), (7, 0, 0)]:
        mask = patterns.bigbird(
            length, window, num_global, num_random, seed=length + window, heads=heads, block_size=block_size
        )
        want = band(length, window) | global_(length, range(min(num_global, length)))
        if num_random:
            drawn = compiler._bigbird_random_blocks(length, num_random, length + window, heads, _pair(block_size))
            want = want | random_blocks(length, drawn, block_size)
        assert mask.shape[:2] == (1, heads if num_random else 1)
        check(mask, want, block_size)


@pytest.mark.parametrize(
    "make, want",
    [
        (lambda bs: patterns.sliding_window(4133, 300, block_size=bs), lambda: band(4133, 300)),
        (lambda bs: patterns.sliding_window(4133, 1000, causal=True, block_size=bs), lambda: band(4133, 1000, True)),
        (lambda bs: patterns.dilated(4133, 700, 3, block_size=bs), lambda: dilated(4133, 700, 3)),
        (lambda bs: patterns.dilated_2d(4133, 1000, 7, block_size=bs), lambda: dilated_2d(4133, 1000, 7)),
        (lambda bs: patterns.strided(4133, 129, 40, block_size=bs), lambda: strided(4133, 129, 40)),
        (
            lambda bs: patterns.longformer(4133, 200, [0, 1, 2000, 4132], block_size=bs),
            lambda: band(4133, 200) | global_(4133, [0, 1, 2000, 4132]),
        ),
    ],
)
@pytest.mark.parametrize("block_size", SQUARE)
def test_long_ragged(make, want, block_size):
    check(make(block_size), want(), block_size)


@pytest.fixture
def fresh_plans():
    """Host plans are cached by arguments: start and end with none, so a test's settings apply."""
    compiler._clear_plans()
    yield
    compiler._clear_plans()


def test_two_step_lookup(monkeypatch, fresh_plans):
    """Tables too big for one lookup step take two; same masks."""
    monkeypatch.setattr(compiler, "_LUT_MAX", 0)
    check(patterns.sliding_window(1000, 100, block_size=64), band(1000, 100), 64)
    check(patterns.dilated(1000, 300, 3, block_size=64), dilated(1000, 300, 3), 64)
    check(patterns.dilated_2d(1000, 5, 2, block_size=64), dilated_2d(1000, 5, 2), 64)
    check(patterns.longformer(1000, 65, [0, 999], block_size=128), band(1000, 65) | global_(1000, [0, 999]), 128)


@pytest.mark.parametrize("block_size", SQUARE)
@pytest.mark.parametrize(
    "make",
    [
        lambda bs: patterns.dilated(4133, 700, 3, block_size=bs),
        lambda bs: patterns.dilated(1000, 5000, 200, block_size=bs),  # blocks of the run with no pair
        lambda bs: patterns.dilated_2d(4133, 1000, 7, block_size=bs),
        lambda bs: patterns.dilated_2d(1000, 96, 129, block_size=bs),  # rows and blocks with no pair
        lambda bs: patterns.dilated_2d(1000, 5, 2, block_size=bs),
        lambda bs: patterns.sliding_window(1000, 300, block_size=bs),
    ],
)
def test_row_lists_and_device_table_agree(monkeypatch, fresh_plans, make, block_size):
    """Dilated patterns list their rows' key blocks on the host, dropping the blocks of a row's run
    that hold no allowed pair, unless the runs are much wider than the lists (then the device
    builds the block table): both give the same tensors."""
    monkeypatch.setattr(compiler, "_RUN_SLACK", 1 << 30)
    lists = make(block_size)
    compiler._clear_plans()
    monkeypatch.setattr(compiler, "_RUN_SLACK", 0)
    table = make(block_size)
    for a, b in zip(lists._tensors() + (lists._order,), table._tensors() + (table._order,), strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("block_size", SQUARE)
@pytest.mark.parametrize("lengths", [(1, 1), (63, 64), (129, 129), (1000, 1000), (300, 1000), (1000, 300)])
def test_traceable_band_form_agrees(lengths, block_size):
    """Under torch.compile or CUDA graph capture causal and sliding windows take a form built from
    torch ops alone; it gives the same masks."""
    lq, lk = lengths
    cpu = torch.device("cpu")
    for lo, hi in [(-(lk - lq), None), (0, None), (-99, 99), (0, 63), (-64, 0), (5, 300), (-5000, 5000)]:
        fast = compiler.compile_mask(compiler.Interval(lo, hi), (lq, lk), (block_size, block_size), cpu)
        traced = compiler._band_square(lq, lk, block_size, compiler.Interval(lo, hi), cpu)
        assert torch.equal(fast.to_dense(), traced.to_dense())


@pytest.mark.cuda
def test_causal_and_window_under_cuda_graph_capture():
    want = [patterns.causal(1000, 1200, compact=False).to_dense(), patterns.sliding_window(1000, 100).to_dense()]
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        patterns.causal(1000, 1200, compact=False, device="cuda")
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        masks = [
            patterns.causal(1000, 1200, compact=False, device="cuda"),
            patterns.sliding_window(1000, 100, device="cuda"),
        ]
    graph.replay()
    torch.cuda.synchronize()
    for mask, dense in zip(masks, want, strict=True):
        assert torch.equal(mask.to_dense().cpu(), dense)


@pytest.mark.cuda
@pytest.mark.parametrize("warm", [True, False])
def test_copied_patterns_under_cuda_graph_capture(warm):
    """The other patterns copy their host plan from page-locked memory: a captured graph replays
    that copy, so the memory must outlive the plan cache (cleared, then page-locked memory churned,
    before the replay)."""
    builders = [
        lambda d: patterns.longformer(1000, 100, [0, 500], device=d),
        lambda d: patterns.bigbird(1000, 64, 3, 2, seed=1, heads=2, device=d),
        lambda d: patterns.dilated(1000, 300, 3, device=d),
        lambda d: patterns.dilated_2d(1000, 200, 2, device=d),
        lambda d: patterns.strided(1000, 129, 40, device=d),
        lambda d: patterns.global_tokens(1000, [3, 999], device=d),
    ]
    want = [make("cpu").to_dense() for make in builders]
    compiler._clear_plans()
    side = torch.cuda.Stream()
    if warm:
        with torch.cuda.stream(side):
            for make in builders:
                make("cuda")
        torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        masks = [make("cuda") for make in builders]
    sizes = [buffer.size for buffer, _ in compiler._PINNED.values()]
    compiler._clear_plans()
    churn = [torch.full((n,), -7, dtype=torch.int32).pin_memory() for n in sizes * 3]
    graph.replay()
    torch.cuda.synchronize()
    del churn
    for mask, dense in zip(masks, want, strict=True):
        assert torch.equal(mask.to_dense().cpu(), dense)


# ------------------------------------------------------------------------------------ bigbird's draw
def test_random_draw_is_distinct_uniform_and_seeded():
    draw = compiler._random_key_blocks(24000, 10, 3, torch.Generator().manual_seed(0))
    assert draw.shape == (24000, 3) and draw.min() >= 0 and draw.max() < 10
    sets = np.sort(draw, 1)
    assert (sets[:, 1:] != sets[:, :-1]).all(), "distinct blocks in each row"
    freq = np.bincount(draw.ravel(), minlength=10) / draw.size
    assert np.abs(freq - 0.1).max() < 0.01, f"each block drawn 1/10 of the time, got {freq}"
    _, per_set = np.unique(sets @ [100, 10, 1], return_counts=True)
    assert per_set.size == 120 and 130 < per_set.min() and per_set.max() < 270, "each 3-subset ~200 times"
    assert np.array_equal(draw, compiler._random_key_blocks(24000, 10, 3, torch.Generator().manual_seed(0)))
    assert not np.array_equal(draw, compiler._random_key_blocks(24000, 10, 3, torch.Generator().manual_seed(1)))
    everything = compiler._random_key_blocks(4, 5, 9, torch.Generator().manual_seed(0))
    assert np.array_equal(everything, np.tile(np.arange(5), (4, 1)))


def test_random_draw_scan_and_bitmap_agree(monkeypatch):
    bitmap = compiler._random_key_blocks(300, 100, 40, torch.Generator().manual_seed(3))
    monkeypatch.setattr(compiler, "_SCAN_MAX", 1000)
    scan = compiler._random_key_blocks(300, 100, 40, torch.Generator().manual_seed(3))
    assert np.array_equal(scan, bitmap)


def test_bigbird_random_blocks_are_per_head_and_seed():
    a = compiler._bigbird_random_blocks(4096, 3, 5, 4, (128, 128))
    assert a.shape == (4, 32, 3)
    assert not np.array_equal(a[0], a[1])
    assert np.array_equal(a, compiler._bigbird_random_blocks(4096, 3, 5, 4, (128, 128)))
    assert not np.array_equal(a, compiler._bigbird_random_blocks(4096, 3, 6, 4, (128, 128)))


# ------------------------------------------------------------------------------------ no synchronisation
def _builders(length):
    """Every pattern with equal query and key blocks: these must build without synchronising."""
    return {
        "causal": lambda d: patterns.causal(length, length, device=d, compact=False),
        "causal_lq_lt_lk": lambda d: patterns.causal(length - 77, length, device=d, compact=False),
        "sliding_window": lambda d: patterns.sliding_window(length, 1024, device=d),
        "sliding_window_causal": lambda d: patterns.sliding_window(length, 333, causal=True, device=d, block_size=64),
        "dilated": lambda d: patterns.dilated(length, 2048, 2, device=d),
        "dilated_odd": lambda d: patterns.dilated(length - 5, 700, 3, device=d, block_size=64),
        "dilated_2d": lambda d: patterns.dilated_2d(length, 2048, 2, device=d),
        "dilated_2d_odd": lambda d: patterns.dilated_2d(length - 5, 1000, 7, device=d),
        "strided": lambda d: patterns.strided(length, 1000, 128, device=d),
        "global_tokens": lambda d: patterns.global_tokens(length, range(64), device=d),
        "global_tokens_spread": lambda d: patterns.global_tokens(length, [0, 7, length // 2, length - 1], device=d),
        "longformer": lambda d: patterns.longformer(length, 512, range(64), device=d),
        "longformer_ragged": lambda d: patterns.longformer(length - 3, 300, [1, length // 3], device=d, block_size=64),
        "bigbird": lambda d: patterns.bigbird(length, 256, 64, 3, seed=0, device=d),
        "bigbird_heads": lambda d: patterns.bigbird(length - 1, 100, 5, 2, seed=1, heads=3, device=d, block_size=64),
    }


@pytest.mark.parametrize("name", list(_builders(1)))
def test_builders_attach_the_attention_schedule(name):
    """Builders hand the mask the CTA schedule from their host plan; it must be the one the
    attention would compute from the mask's own tables."""
    from sparse_attn._routes import schedule as _schedule

    mask = _builders(8192)[name]("cpu")
    assert mask._order is not None
    fresh = BlockSparseMask(*mask._tensors(), seq_lengths=mask.seq_lengths, block_size=mask.block_size)
    assert torch.equal(mask._order, _schedule(fresh))


@pytest.mark.parametrize("name", list(_builders(1)))
def test_builds_on_meta_without_data(name):
    """Meta tensors have no data: any step that reads device data (.item(), nonzero, unique,
    boolean indexing, a width taken from the table) raises, so passing here means no sync."""
    mask = _builders(8192)[name]("meta")
    assert mask.device.type == "meta"
    ref = _builders(8192)[name](None)
    for got, want in zip(mask._tensors(), ref._tensors(), strict=True):
        assert got.shape == want.shape and got.dtype == want.dtype


@pytest.mark.parametrize("name", list(_builders(1)))
def test_cpu_and_device_builds_agree(name, device):
    """The same layout on any device (small length: element masks compared too)."""
    small, ref = _builders(1000)[name](device), _builders(1000)[name](None)
    assert small.device.type == device
    assert torch.equal(small.to_dense().cpu(), ref.to_dense())


@pytest.mark.cuda
@pytest.mark.parametrize("name", list(_builders(1)))
def test_cuda_build_does_not_synchronise(name):
    build = _builders(32768)[name]
    build("cuda")  # warm-up: first-use allocations and lazy initialisation
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        mask = build("cuda")
    finally:
        torch.cuda.set_sync_debug_mode(0)
    ref = build(None)
    for got, want in zip(mask._tensors(), ref._tensors(), strict=True):
        assert torch.equal(got.cpu(), want), "the CUDA build's layout is the CPU build's"


def test_device_global_idx_tensor_is_accepted(device):
    idx = torch.tensor([3, 100], device=device)
    mask = patterns.longformer(300, 8, idx, block_size=64, device=device)
    check(mask.to("cpu"), band(300, 8) | global_(300, [3, 100]), 64)
    assert isinstance(mask, BlockSparseMask)
