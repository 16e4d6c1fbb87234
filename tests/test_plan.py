"""sparse_attn.explain and the plan layer: the route of every op and pattern, the kernel plans of
csrc/plan/plan.cpp (planned here for an H100 or an A100 from CPU tensors, so CI checks the GPU
decisions without a GPU), the overrides, and that explaining runs no attention kernel."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from utils import block_kernel_mask, make_qkv

import sparse_attn
from sparse_attn import patterns
from sparse_attn._plan import overrides

OPS = {
    "dense": sparse_attn.dense_attention,
    "flash": sparse_attn.flash_attention,
    "block_sparse": sparse_attn.block_sparse_attention,
    "topk": sparse_attn.topk_attention,
}


class _KernelCalls(TorchDispatchMode):
    """Names of the sparse_attn ops dispatched inside the block."""

    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "sparse_attn":
            self.names.append(func._opname)
        return func(*args, **(kwargs or {}))


def _qkv(h=4, hkv=2, lq=1024, lk=1024, d=128, dtype=torch.bfloat16, layout="bhld"):
    return make_qkv(2, h, hkv, lq, lk, d, dtype=dtype, layout=layout)


def _only(plan):
    assert len(plan.launches) == 1, plan
    return plan.launches[0]


@pytest.mark.parametrize(
    "name,extra",
    [
        ("dense", {}),
        ("flash", {"causal": True}),
        ("block_sparse", {"mask": "window"}),
        ("block_sparse", {"mask": "random"}),
        ("topk", {"k": 16}),
        ("topk", {"k": 2, "block_size": 64}),
    ],
)
def test_explain_runs_no_attention_kernel(name, extra):
    q, k, v = _qkv(lq=512, lk=512)
    args = [q, k, v]
    if "mask" in extra:
        mask = {"window": lambda: patterns.sliding_window(512, 100), "random": lambda: patterns.random_blocks(512, 0.3)}
        args.append(mask[extra.pop("mask")]())
    if "k" in extra:
        args.append(extra.pop("k"))
    with _KernelCalls() as calls:
        plan = sparse_attn.explain(OPS[name], *args, **extra)
    assert all(n.startswith("_plan_") or n == "_check_inputs" for n in calls.names), calls.names
    assert plan.op == OPS[name].__name__ and plan.launches and plan.why
    assert str(plan).startswith(f"{plan.op}: route {plan.route}")


def test_explain_takes_the_op_or_its_name_and_checks_arguments():
    q, k, v = _qkv()
    by_name = sparse_attn.explain("flash_attention", q, k, v, causal=True, target="sm90")
    assert by_name == sparse_attn.explain(sparse_attn.flash_attention, q, k, v, causal=True, target="sm90")
    with pytest.raises(ValueError, match="op must be one of"):
        sparse_attn.explain("softmax", q, k, v)
    with pytest.raises(ValueError, match="target must be None or one of"):
        sparse_attn.explain("flash_attention", q, k, v, target="sm75")
    with pytest.raises(TypeError):
        sparse_attn.explain("flash_attention", q, k, v, causl=True)  # as the op would
    with pytest.raises(RuntimeError, match="number of query heads"):
        sparse_attn.explain("flash_attention", q[:, :3], k, v)  # the kernels' own checks


# ------------------------------------------------------------------------------------ routes
def test_block_sparse_routes_of_the_patterns():
    L = 1000
    q, k, v = _qkv(lq=L, lk=L, d=64)
    route = lambda m: sparse_attn.explain(sparse_attn.block_sparse_attention, q, k, v, m)  # noqa: E731
    assert route(patterns.causal(L, L)).route == "flash_causal"
    plan = route(patterns.sliding_window(L, 256))
    assert plan.route == "flash_window" and "window=(255, 255)" in plan.why
    assert route(patterns.sliding_window(L, 256, causal=True)).route == "flash_window"
    plan = route(patterns.dilated(L, 300, 3))
    assert plan.route == "dilated" and _only(plan).count == 3
    plan = route(patterns.dilated_2d(L, 256, 2))
    assert plan.route == "dilated_2d" and len(plan.launches) == 2  # whole segments, then the ragged tail
    q2, k2, v2 = _qkv(lq=1024, lk=1024, d=64)
    plan = sparse_attn.explain(sparse_attn.block_sparse_attention, q2, k2, v2, patterns.dilated_2d(1024, 256, 2))
    assert len(plan.launches) == 1  # whole segments only
    for plain in (
        patterns.longformer(L, 128, [0]),
        patterns.random_blocks(L, 0.2),
        patterns.sliding_window(L, 256) | patterns.global_tokens(L, [3]),
        block_kernel_mask(patterns.causal(L, L)),
    ):
        plan = route(plain)
        assert plan.route == "block_kernel" and _only(plan).kernel == "block_sparse_fwd"


def test_block_matrix_and_flex_masks_take_the_block_kernel():
    flex = pytest.importorskip("torch.nn.attention.flex_attention")
    L = 512
    q, k, v = _qkv(lq=L, lk=L)
    blocks = torch.ones(4, 4, dtype=torch.bool).tril()
    plan = sparse_attn.explain(sparse_attn.block_sparse_attention, q, k, v, blocks)
    assert plan.route == "block_kernel" and "block matrix" in plan.why
    bm = flex.create_block_mask(lambda b, h, i, j: i >= j, None, None, L, L, device="cpu")
    plan = sparse_attn.explain(sparse_attn.block_sparse_attention, q, k, v, bm)
    assert plan.route == "block_kernel" and "converted to a BlockSparseMask on its first call" in plan.why


def test_topk_routes():
    q, k, v = _qkv(lq=300, lk=300, d=64)
    with overrides(topk_attention_route="gather"):
        plan = sparse_attn.explain(sparse_attn.topk_attention, q, k, v, 32, causal=True)
    assert plan.route == "token_topk" and [x.kernel for x in plan.launches] == ["topk_select", "gather_fwd"]
    with overrides(topk_attention_route="masked_block"):
        plan = sparse_attn.explain(sparse_attn.topk_attention, q, k, v, 32, causal=True)
    assert [x.kernel for x in plan.launches] == ["topk_select", "selection_mask", "block_sparse_fwd"]
    iq, ik, iw = torch.randn(2, 300, 4, 64), torch.randn(2, 300, 64), torch.randn(2, 300, 4)
    with overrides(topk_attention_route="gather"):
        plan = sparse_attn.explain(
            sparse_attn.topk_attention, q, k, v, 32, index_query=iq, index_key=ik, index_weights=iw
        )
    assert plan.route == "indexer_topk" and [x.kernel for x in plan.launches] == ["indexer_select", "gather_fwd"]
    plan = sparse_attn.explain(sparse_attn.topk_attention, q, k, v, 2, block_size=128)
    assert plan.route == "block_topk" and plan.launches[1].kernel == "block_sparse_fwd"
    assert plan.launches[1].tile is not None


# ------------------------------------------------------------------------------------ kernel plans
def test_cpu_plans():
    q, k, v = _qkv(d=64, dtype=torch.float32)
    plan = sparse_attn.explain(sparse_attn.flash_attention, q, k, v)
    # dense and causal rows from 1024 queries on: 128-row tiles; banded or short: 64
    assert (_only(plan).core, _only(plan).tile) == ("cpu", (128, 64))
    causal = sparse_attn.explain(sparse_attn.flash_attention, q, k, v, causal=True)
    assert _only(causal).tile == (128, 64)
    banded = sparse_attn.explain(sparse_attn.flash_attention, q, k, v, window=(256, 0))
    assert _only(banded).tile == (64, 64)
    short = sparse_attn.explain(sparse_attn.flash_attention, q[:, :, :1000], k, v)
    assert _only(short).tile == (64, 64)
    mask = patterns.random_blocks(1024, 0.3, seed=0, block_size=128)
    blocks = sparse_attn.explain(sparse_attn.block_sparse_attention, q, k, v, mask)
    assert _only(blocks).kernel == "block_sparse_fwd" and _only(blocks).tile == (64, 64)
    assert plan.backward.startswith("flash_bwd (CPU kernels")
    gpu = sparse_attn.explain(sparse_attn.topk_attention, q, k, v, 8, target="sm90")
    assert gpu.backward.startswith("gather_bwd (CUDA-core kernel")
    half = _qkv(d=128, dtype=torch.bfloat16)
    gpu = sparse_attn.explain(sparse_attn.flash_attention, *half, causal=True, target="sm90")
    assert gpu.backward.startswith("flash_bwd (CUDA Hopper kernel")
    sm80 = sparse_attn.explain(sparse_attn.flash_attention, *half, causal=True, target="sm80")
    assert sm80.backward.startswith("flash_bwd (CUDA portable mma.sync kernel")
    mask = patterns.random_blocks(1024, 0.3, seed=0, block_size=128)
    torch.use_deterministic_algorithms(True)
    try:  # the dense family's dQ in a fixed order on Hopper; block-sparse masks' dQ in its own kernel
        ordered = sparse_attn.explain(sparse_attn.flash_attention, *half, causal=True, target="sm90")
        assert "ascending key-tile order" in ordered.backward
        separate = sparse_attn.explain(sparse_attn.block_sparse_attention, *half, mask, target="sm90")
        assert "dQ in a kernel of its own" in separate.backward
        portable = sparse_attn.explain(sparse_attn.flash_attention, *half, causal=True, target="sm80")
        assert "dQ in a kernel of its own" in portable.backward
    finally:
        torch.use_deterministic_algorithms(False)


def _bwd(plan):
    assert len(plan.backward_launches) == 1, plan
    return plan.backward_launches[0]


def test_backward_plans():
    """explain shows the backward the plan layer picks (plan_bwd, which the CUDA glue runs): core,
    tile, head splits and groups, the dQ mode; planned for a GPU this machine need not have."""
    ex = sparse_attn.explain
    gqa = _qkv(h=16, hkv=2, lq=8192, lk=8192)
    bwd = _bwd(ex(sparse_attn.flash_attention, *gqa, causal=True, target="sm90"))
    assert (bwd.kernel, bwd.core, bwd.tile, bwd.options["dq"]) == ("flash_bwd", "hopper", (64, 128), "atomic")
    # the head splits are plan_bwd_head_splits' (GQA 16/2, few (batch, kv head)s: > 1)
    splits = torch.ops.sparse_attn._bwd_head_splits(2, 16, 2, 8192, 8192, -1, 0, 128, 132, 64)
    assert bwd.options["head_splits"] == splits > 1 and bwd.options["head_group"] >= 1
    assert "flash_bwd  core=hopper  tile=64x128" in str(ex(sparse_attn.flash_attention, *gqa, target="sm90"))
    with sparse_attn._plan.overrides(bwd_head_splits=2):
        assert _bwd(ex(sparse_attn.flash_attention, *gqa, causal=True, target="sm90")).options["head_splits"] == 2
    # head dim 64: the dense family's 128-row query tiles; MHA: one CTA per key block's group
    d64 = _bwd(ex(sparse_attn.flash_attention, *_qkv(h=4, hkv=4, d=64), target="sm90"))
    assert (d64.tile, d64.options["head_splits"], d64.options["head_group"]) == ((128, 128), 1, 0)
    # block-sparse masks: 128-key blocks on the Hopper kernel, 64-key blocks on the portable one
    q, k, v = _qkv(h=16, hkv=2, lq=2048, lk=2048)
    for size, core, tile in ((128, "hopper", (64, 128)), (64, "portable", (64, 64))):
        mask = patterns.random_blocks(2048, 0.3, seed=0, block_size=size)
        bwd = _bwd(ex(sparse_attn.block_sparse_attention, q, k, v, mask, target="sm90"))
        assert (bwd.kernel, bwd.core, bwd.tile) == ("block_sparse_bwd", core, tile)
    assert _bwd(ex(sparse_attn.flash_attention, *gqa, causal=True, target="sm80")).core == "portable"
    # deterministic mode: Hopper's ordered dQ (no splits), a separate dQ kernel elsewhere
    torch.use_deterministic_algorithms(True)
    try:
        ordered = _bwd(ex(sparse_attn.flash_attention, *gqa, causal=True, target="sm90"))
        assert (ordered.options["dq"], ordered.options["head_splits"]) == ("ordered", 1)
        mask = patterns.random_blocks(2048, 0.3, seed=0, block_size=128)
        assert _bwd(ex(sparse_attn.block_sparse_attention, q, k, v, mask, target="sm90")).options["dq"] == "separate"
        assert _bwd(ex(sparse_attn.flash_attention, *gqa, target="sm80")).options["dq"] == "separate"
    finally:
        torch.use_deterministic_algorithms(False)
    # top-k: the gathered attention's backward (plan_gather_bwd) on the mma.sync layout, the
    # Hopper forward's too; four warps of a DeepSeek-like token sharing its K/V stages
    q, k, v = _qkv(h=64, hkv=1, lq=4096, lk=4096)
    index = dict(
        index_query=torch.randn(2, 4096, 4, 64, dtype=q.dtype),
        index_key=torch.randn(2, 4096, 64, dtype=q.dtype),
        index_weights=torch.rand(2, 4096, 4, dtype=q.dtype),
    )
    for target, forward in (("sm90", "hopper"), ("sm80", "portable")):
        plan = ex(sparse_attn.topk_attention, q, k, v, 64, causal=True, **index, target=target)
        assert [launch.core for launch in plan.launches if launch.kernel == "gather_fwd"] == [forward]
        bwd = _bwd(plan)
        assert (bwd.kernel, bwd.core, bwd.options["heads_per_warp"], bwd.options["shared_stages"]) == (
            "gather_bwd",
            "portable",
            16,
            1,
        )
    assert _bwd(ex(sparse_attn.topk_attention, q.float(), k.float(), v.float(), 64, target="sm90")).core == "cuda_cores"
    assert _bwd(ex(sparse_attn.topk_attention, q, k, v, 64)).core == "cpu"
    # fp32 (or Dv != D): the CUDA-core kernel; CPU tensors: the CPU kernels
    fp32 = _bwd(ex(sparse_attn.flash_attention, *_qkv(dtype=torch.float32), target="sm90"))
    assert fp32.core == "cuda_cores" and "head_splits" not in fp32.options
    assert _bwd(ex(sparse_attn.flash_attention, *_qkv())).core == "cpu"


@pytest.mark.parametrize("d", [64, 128, 40, 96])
def test_hopper_takes_head_dims_up_to_128(d):
    q, k, v = _qkv(d=d)
    launch = _only(sparse_attn.explain(sparse_attn.flash_attention, q, k, v, causal=True, target="sm90"))
    assert launch.core == "hopper" and launch.schedule == "dynamic"


def test_portable_core_and_why():
    q, k, v = _qkv(d=256)
    launch = _only(sparse_attn.explain(sparse_attn.flash_attention, q, k, v, target="sm90"))
    assert launch.core == "portable" and "head dims up to 128" in launch.why[0]
    q, k, v = _qkv()
    launch = _only(sparse_attn.explain(sparse_attn.flash_attention, q, k, v, target="sm80"))
    assert launch.core == "portable" and "not compute capability 9.0" in launch.why[0]
    launch = _only(sparse_attn.explain(sparse_attn.flash_attention, q.float(), k.float(), v.float(), target="sm90"))
    assert (launch.core, launch.tile) == ("cuda_cores", (16, 32))
    with overrides(portable_only=True):
        launch = _only(sparse_attn.explain(sparse_attn.flash_attention, q, k, v, target="sm90"))
        assert launch.core == "portable" and "forced by the plan options" in launch.why[0]
    assert _only(sparse_attn.explain(sparse_attn.flash_attention, q, k, v, target="sm90")).core == "hopper"


def test_misaligned_inputs_are_planned_on_their_aligned_copy():
    # The glue copies a misaligned tensor before the plan is made; explain plans on that layout.
    q, k, v = _qkv(d=64)
    base = torch.randn(2 * 4 * 1024 * 64 + 1, dtype=torch.bfloat16)
    q_off = base[1:].view(2, 4, 1024, 64)
    assert q_off.data_ptr() % 16 != 0
    assert _only(sparse_attn.explain(sparse_attn.flash_attention, q_off, k, v, target="sm90")).core == "hopper"


def test_block_sparse_kernel_plans():
    L = 2048
    q, k, v = _qkv(lq=L, lk=L)
    mask = patterns.random_blocks(L, 0.3)
    launch = _only(sparse_attn.explain(sparse_attn.block_sparse_attention, q, k, v, mask, target="sm90"))
    assert (launch.core, launch.tile, launch.schedule) == ("hopper", (128, 128), "dynamic")
    assert launch.options["merge_boundary"] == 1
    m64 = patterns.random_blocks(L, 0.3, block_size=64)
    launch = _only(sparse_attn.explain(sparse_attn.block_sparse_attention, q, k, v, m64, target="sm90"))
    assert (launch.core, launch.tile) == ("portable", (64, 64)) and "128 x 128 blocks" in launch.why[0]
    mixed = patterns.random_blocks(L, 0.3, block_size=(128, 64))
    launch = _only(sparse_attn.explain(sparse_attn.block_sparse_attention, q, k, v, mixed, target="sm90"))
    assert (launch.core, launch.tile) == ("portable", (128, 64))


@pytest.mark.parametrize(
    "lq,window,causal,tile",
    [
        (4096, None, False, (128, 192)),  # 4096 keys pad to 4224 with 192-key tiles: within 5 %
        (1000, None, False, (128, 128)),  # 1000 keys: 1152 vs 1024, beyond 5 %
        (4096, None, True, (128, 128)),  # causal keeps 128 keys
        (4096, (255, 255), False, (128, 128)),  # a band of <= 4096 keys per row: 128 rows
        (32768, (8191, 8191), False, (192, 128)),  # a wide band, many tiles per SM: three consumers
    ],
)
def test_head_dim_64_tiles(lq, window, causal, tile):
    q, k, v = make_qkv(2, 16, 16, lq, lq, 64)
    launch = _only(
        sparse_attn.explain(sparse_attn.flash_attention, q, k, v, causal=causal, window=window, target="sm90")
    )
    assert launch.tile == tile, launch
    assert launch.options["merge_boundary"] == int(window == (255, 255))  # bands of <= 1024 keys per row


def test_schedules_and_tile_overrides():
    q, k, v = _qkv(d=64)
    flash = lambda **kw: _only(sparse_attn.explain(sparse_attn.flash_attention, q, k, v, target="sm90", **kw))  # noqa: E731
    assert flash().schedule == "round_robin"
    assert flash(window=(100, 0)).schedule == "dynamic"
    with overrides(per_tile_grid=True):
        assert flash().schedule == "per_tile"
    with overrides(tile=(192, 128)):
        assert flash().tile == (192, 128)
        assert flash().options["merge_boundary"] == 0  # three consumers never merge
        with overrides(merge_boundary=True):  # nested: the tile stays forced
            assert flash().tile == (192, 128) and flash().options["merge_boundary"] == 0
    with overrides(tile=(128, 128), merge_boundary=True):
        assert flash().options["merge_boundary"] == 1
    with overrides(tile=(64, 64)):  # not in the table: the plan's own tile
        assert flash().tile in ((128, 128), (128, 192), (192, 128))
    with pytest.raises(TypeError, match="unknown plan options"):
        with overrides(pingpong=False):
            pass


@pytest.mark.parametrize(
    "h,hkv,heads_per_warp,shared",
    [
        (16, 1, 16, 0),
        (32, 1, 16, 0),
        (8, 2, 4, 0),
        (6, 6, 1, 0),
        (12, 4, 3, 0),
        (64, 1, 16, 1),
        (128, 2, 16, 1),
        (96, 3, 16, 0),
    ],
)
def test_gather_heads_per_warp(h, hkv, heads_per_warp, shared):
    """Heads per warp: the run sharing a kv head and the index set, cut to <= 16; a CTA's four warps
    share K/V stages where the run holds whole blocks of four groups (sm80: sm90 sends runs of 64 to
    the wgmma gather)."""
    q, k, v = make_qkv(1, h, hkv, 256, 256, 128)
    iq, ik, iw = torch.randn(1, 256, 2, 32), torch.randn(1, 256, 32), torch.randn(1, 256, 2)
    with overrides(topk_attention_route="gather"):
        extra = {"index_query": iq, "index_key": ik, "index_weights": iw}
        plan = sparse_attn.explain(sparse_attn.topk_attention, q, k, v, 16, **extra, target="sm80")
        gather = plan.launches[1]
        assert gather.core == "portable" and gather.options["heads_per_warp"] == heads_per_warp
        assert gather.options["shared_stages"] == shared
        plan = sparse_attn.explain(sparse_attn.topk_attention, q, k, v, 16, target="sm90")  # per-head selection
        assert plan.launches[1].options["heads_per_warp"] == 1
        assert plan.launches[1].options["shared_stages"] == 0


@pytest.mark.parametrize(
    "h,hkv,hi,d,core",
    [(64, 1, 4, 128, "hopper"), (128, 2, 2, 64, "hopper"), (64, 1, 0, 128, "portable"), (64, 1, 1, 96, "portable")],
)
def test_gather_of_64_heads_on_hopper(h, hkv, hi, d, core):
    """Runs of 64 heads sharing a kv head and an index set (the lightning indexer's one set) take
    the wgmma gather on sm_90 (head dims 64 and 128), and only there; hi = 0: a set per head."""
    q, k, v = make_qkv(1, h, hkv, 256, 256, d)
    args = (sparse_attn.topk_attention, q, k, v, 16)
    extra = {}
    if hi:
        iq, ik, iw = torch.randn(1, 256, hi, 32), torch.randn(1, 256, 32), torch.randn(1, 256, hi)
        extra = {"index_query": iq, "index_key": ik, "index_weights": iw}
    with overrides(topk_attention_route="gather"):
        gather = sparse_attn.explain(*args, **extra, target="sm90").launches[1]
        assert gather.core == core
        if core == "hopper":
            assert gather.options["heads_per_cta"] == 64 and gather.options["head_dim"] == d
            assert sparse_attn.explain(*args, **extra, target="sm80").launches[1].core == "portable"
            with overrides(portable_only=True):
                assert sparse_attn.explain(*args, **extra, target="sm90").launches[1].core == "portable"


def test_select_plans():
    q, k, v = make_qkv(1, 4, 1, 4096, 4096, 128)
    plan = sparse_attn.explain(sparse_attn.topk_attention, q, k, v, 64, causal=True, target="sm90")
    select = plan.launches[0]
    assert select.core == "portable" and select.options["chunks"] == 1
    with overrides(select_workspace_bytes=64 * 4096 * 4 * 3):
        select = sparse_attn.explain(sparse_attn.topk_attention, q, k, v, 64, target="sm90").launches[0]
        assert select.options["chunks"] == 86 and select.options["workspace_bytes"] == 64 * 4096 * 4 * 3
    # Room for 200 of the 256 query tiles: two even chunks of 128, not 200 + 56 (a small last
    # chunk's launches leave most of the GPU idle).
    with overrides(select_workspace_bytes=64 * 4096 * 4 * 200):
        select = sparse_attn.explain(sparse_attn.topk_attention, q, k, v, 64, target="sm90").launches[0]
        assert select.options["chunks"] == 2 and select.options["workspace_bytes"] == 64 * 4096 * 4 * 128
    plan = sparse_attn.explain(sparse_attn.topk_attention, q.float(), k.float(), v.float(), 64, target="sm90")
    assert [x.core for x in plan.launches] == ["cuda_cores", "cuda_cores"]


def test_select_filters_long_rows():
    """The filtered selection (scores kept on chip): taken where rows are long against k, with the
    sample stride and the candidates' room of the plan's rule; off by override, and unfiltered at
    lengths under 4x the room."""
    g = torch.Generator().manual_seed(0)

    def indexer(length, k):
        iq = torch.randn(1, length, 4, 64, generator=g).to(torch.bfloat16)
        ik = torch.randn(1, length, 64, generator=g).to(torch.bfloat16)
        iw = torch.rand(1, length, 4, generator=g).to(torch.bfloat16)
        q = torch.zeros(1, 2, length, 128, dtype=torch.bfloat16)
        kv = torch.zeros(1, 1, length, 128, dtype=torch.bfloat16)
        args = dict(causal=True, index_query=iq, index_key=ik, index_weights=iw, target="sm90")
        return sparse_attn.explain(sparse_attn.topk_attention, q, kv, kv, k, **args).launches[0]

    select = indexer(65536, 2048)  # 3072 candidates aimed at, room 6144, 192 of them in a 1/16 sample
    assert select.options["filter_stride"] == 16 and select.options["candidates"] == 6144
    select = indexer(65536, 256)  # k small: 2048 candidates aimed at, a 1/8 sample
    assert select.options["filter_stride"] == 8 and select.options["candidates"] == 4438
    assert indexer(16384, 2048).options["filter_stride"] == 0  # 16k < 4 x 6144
    with overrides(select_filter_stride=-1):
        assert indexer(65536, 2048).options["filter_stride"] == 0
    with overrides(select_filter_stride=2):
        assert indexer(65536, 2048).options["filter_stride"] == 2


def test_nothing_to_compute():
    q, k, v = _qkv(lq=0)
    assert _only(sparse_attn.explain(sparse_attn.flash_attention, q, k, v, target="sm90")).core == "none"
