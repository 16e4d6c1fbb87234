"""Context parallelism on CPU process groups (gloo, 2 and 4 ranks): every rank's output shard and
its gradients equal the single-process flash_attention on the whole sequence, for the ring and
all-gather schedules, both layouts, causal, dense and windowed masks, GQA and lengths the world
size does not divide; block-sparse masks; top-k (exact and indexer selection, both exchanges)."""

from __future__ import annotations

import datetime
import itertools
import math
import os
import socket
import traceback
import types

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import sparse_attn
from sparse_attn import distributed as cp

CASES = [
    # (seq_len, H, Hkv, causal, window, layout, method)
    (96, 2, 2, True, None, "zigzag", "ring"),
    (203, 4, 2, True, None, "zigzag", "ring"),
    (131, 2, 1, False, None, "contiguous", "ring"),
    (200, 2, 2, True, None, "contiguous", "ring"),
    (150, 4, 2, True, (17, 0), "zigzag", "allgather"),
    (97, 2, 2, False, (9, 30), "contiguous", "allgather"),
    (120, 2, 2, True, None, "zigzag", "allgather"),
    (77, 2, 1, False, (None, 5), "zigzag", None),
    # the query slices (several per chunk: _MIN_SLICE is lowered in the workers)
    (96, 2, 2, True, None, "zigzag", None),
    (203, 4, 2, True, None, "zigzag", "queries"),
    (131, 2, 2, False, None, "contiguous", "queries"),
    (200, 2, 2, True, None, "contiguous", "queries"),
    (17, 2, 2, True, None, "zigzag", "queries"),  # chunks of 2-3 tokens (one slice each)
]


def _compare_shards(errors, where: str, got, whole, layout: str, tol: float) -> None:
    """This rank's (out, dq, dk, dv, lse) against its shards of the whole sequence's."""
    for name, mine, ref in zip(("out", "dq", "dk", "dv", "lse"), got, whole, strict=True):
        exp = cp.shard_sequence(ref.detach(), layout=layout).float()
        if name == "lse":
            if not torch.allclose(mine, exp, atol=tol, equal_nan=True):
                errors.put(f"{where}: lse differs")
            continue
        err = (mine.float() - exp).abs().max().item()
        if not err <= tol * max(1.0, exp.abs().max().item()):
            errors.put(f"{where}: {name} max error {err:.2e}")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _CountingOps:
    """torch.ops.sparse_attn with its flash_fwd calls counted (what explain's launches add up to)."""

    def __init__(self, ops):
        self._ops, self.flash_fwd_calls = ops, 0

    def __getattr__(self, name):
        if name == "flash_fwd":
            return types.SimpleNamespace(default=self._flash_fwd)
        return getattr(self._ops, name)

    def _flash_fwd(self, *args):
        self.flash_fwd_calls += 1
        return self._ops.flash_fwd.default(*args)


def _worker(rank: int, world: int, port: int, errors, backend: str = "gloo"):
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    # A short timeout: a rank that failed waits at the final barrier instead of hanging the others.
    dist.init_process_group(backend, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=120))
    torch.set_num_threads(1)
    # CPU: fp32, exact up to summation order. CUDA (NCCL): bf16, against the same op on one GPU.
    device, dtype, tol = ("cuda", torch.bfloat16, 3e-2) if backend == "nccl" else ("cpu", torch.float32, 1e-4)
    cp._MIN_SLICE = 64 if backend == "nccl" else 4  # several query slices per chunk at these lengths
    if device == "cuda":
        torch.cuda.set_device(rank)
    ring_backward, ring_calls = cp._ring_backward, []  # which backward each dense case took

    def counted(*args):
        ring_calls.append(1)
        return ring_backward(*args)

    cp._ring_backward = counted
    cp._ops = counting = _CountingOps(cp._ops)
    try:
        for case in CASES:
            length, h, hkv, causal, window, layout, method = case
            if device == "cuda":
                length *= 16
            g = torch.Generator().manual_seed(length)
            q, k, v = (torch.randn(1, heads, length, 64, generator=g).to(device, dtype) for heads in (h, hkv, hkv))
            dout = torch.randn(1, h, length, 64, generator=g).to(device, dtype)
            full = [t.clone().requires_grad_() for t in (q, k, v)]
            ref, ref_lse = sparse_attn.flash_attention(*full, causal=causal, window=window, return_lse=True)
            ref_grads = torch.autograd.grad(ref, full, dout)
            local = [cp.shard_sequence(t, layout=layout).requires_grad_() for t in (q, k, v)]
            fwd_before = counting.flash_fwd_calls
            out, lse = cp.context_parallel_attention(
                *local, causal=causal, window=window, layout=layout, method=method, return_lse=True
            )
            # explain names this rank's schedule and as many forward calls as ran (without seq_len
            # where the shards are even: it then assumes the even split)
            ran = counting.flash_fwd_calls - fwd_before
            given = [{"seq_len": length}] + ([{}] if length % (2 * world) == 0 else [])
            for extra in given:
                said = sparse_attn.explain(
                    cp.context_parallel_attention,
                    *local,
                    causal=causal,
                    window=window,
                    layout=layout,
                    method=method,
                    **extra,
                )
                launched = sum(launch.count for launch in said.launches if launch.kernel == "flash_fwd")
                if launched != ran:
                    errors.put(f"rank {rank} {case} {extra}: explain says {launched} flash calls, {ran} ran")
            if device == "cuda":  # the rounds on side streams: bit for bit the result of one stream
                streams, cp._ROUND_STREAMS = cp._ROUND_STREAMS, 1
                try:
                    plain = cp.context_parallel_attention(
                        *(t.detach() for t in local), causal=causal, window=window, layout=layout, method=method
                    )
                finally:
                    cp._ROUND_STREAMS = streams
                if not torch.equal(plain, out.detach()):
                    errors.put(f"rank {rank} {case}: {streams} round streams differ from one")
            # seq_len given and the ranks' check skipped: the same result
            unchecked = cp.context_parallel_attention(
                *(t.detach() for t in local),
                causal=causal,
                window=window,
                layout=layout,
                method=method,
                seq_len=length,
                validate=False,
            )
            if not torch.equal(unchecked, out.detach()):
                errors.put(f"rank {rank} {case}: validate=False gives another result")
            before = len(ring_calls)
            grads = torch.autograd.grad(out, local, cp.shard_sequence(dout, layout=layout))
            _compare_shards(errors, f"rank {rank} {case}", (out, *grads, lse), (ref, *ref_grads, ref_lse), layout, tol)
            plan = cp.plan_context_parallel(causal, window, layout=layout, method=method, heads=(h, hkv), world=world)
            if said.route != f"context_parallel_{plan.method}":
                errors.put(f"rank {rank} {case}: explain says {said.route}, the plan {plan.method}")
            if (len(ring_calls) > before) != (plan.method == "ring"):  # the query slices have their own backward
                took = "the ring's" if len(ring_calls) > before else "not the ring's"
                errors.put(f"rank {rank} {case}: the {plan.method} schedule's backward was {took}")
            # The whole sequence back from the shards.
            whole = cp.gather_sequence(out.detach(), length, layout=layout)
            if not torch.allclose(whole.float(), ref.detach().float(), atol=tol):
                errors.put(f"rank {rank} {case}: gather_sequence differs")
        if device == "cpu":
            _block_sparse_case(rank, world, errors)
            _topk_cases(rank, world, errors)
            _mesh_cases(rank, world, errors)
            _bad_input_cases(rank, world, errors)
        else:
            _block_sparse_case(rank, world, errors, device, dtype, tol, scale_len=16)
            _topk_cases(rank, world, errors, device, dtype, tol, scale_len=16)
    except Exception:  # noqa: BLE001  (reported to the test process)
        errors.put(f"rank {rank}: {traceback.format_exc()}")
    finally:
        # No rank tears its connections down while another still reads from them (DTensor's
        # collectives complete asynchronously; gloo aborts the process on a closed pair).
        dist.barrier()
        dist.destroy_process_group()
    # Leave without the interpreter's teardown: with a DeviceMesh made, a gloo thread's destructor
    # aborted about 1 exit in 8 ("terminate called without an active exception"); the errors are in
    # the queue already.
    os._exit(0)


def _block_sparse_case(rank, world, errors, device="cpu", dtype=torch.float32, tol=1e-4, scale_len=1):
    """Global masks over 2P chunks: Longformer-style (window + global tokens, 64-token blocks), a
    causal band of 128-token blocks, and random blocks with 64-row query blocks against 128-key
    blocks; every schedule, the all-to-all in both of its forms (received key blocks in a copy of
    the shard, or a second call for the edge rows), each called twice (the second reuses the
    layout and rows kept with the mask), outputs, LSEs and gradients against the single-process
    op."""
    from sparse_attn import patterns

    g = torch.Generator().manual_seed(7)
    cases = [
        ("longformer", 2 * world * 128, lambda n: patterns.longformer(n, 48, range(8), block_size=64)),
        # global tokens in the first chunk and in the middle one: guest rows on two ranks
        ("globals", 2 * world * 128, lambda n: patterns.longformer(n, 48, [*range(4), n // 2 + 3], block_size=64)),
        ("band", 2 * world * 256, lambda n: patterns.sliding_window(n, (200, 0), block_size=128)),
        ("random", 2 * world * 256, lambda n: patterns.random_blocks(n, 0.3, seed=3, block_size=(64, 128))),
    ]
    d = 32 if device == "cpu" else 64
    for name, length, build in cases:
        length *= scale_len
        q, k, v = (torch.randn(1, 2, length, d, generator=g).to(device, dtype) for _ in range(3))
        dout = torch.randn(1, 2, length, d, generator=g).to(device, dtype)
        mask = build(length).to(device)
        full = [t.clone().requires_grad_() for t in (q, k, v)]
        ref, ref_lse = sparse_attn.block_sparse_attention(*full, mask, return_lse=True)
        ref_grads = torch.autograd.grad(ref, full, dout)
        forms = [("alltoall", 1.0), ("alltoall", 0.0), ("allgather", 0.25), (None, 0.25), ("alltoall", 0.25)]
        for method, edge_share in forms + forms[-1:]:
            if edge_share != cp._EDGE_SHARE:  # the exchange of the other form, made again
                cp._EDGE_SHARE = edge_share
                mask.__dict__.pop("_cp_exchange", None)
            local = [cp.shard_sequence(t).requires_grad_() for t in (q, k, v)]
            out, lse = cp.context_parallel_block_sparse_attention(*local, mask, method=method, return_lse=True)
            said = sparse_attn.explain(cp.context_parallel_block_sparse_attention, *local, mask, method=method)
            told = cp.plan_context_parallel_block_sparse(mask, world, rank, method=method)
            edge_launch = any("edge" in launch.role for launch in said.launches)
            if (said.route, said.why, edge_launch) != (
                f"context_parallel_{told.method}",
                told.why,
                told.edge_blocks > 0,
            ):
                errors.put(f"rank {rank} block-sparse {name} {method}: explain says {said.route}: {said.why}")
            if method == "alltoall":
                edge = cp._sparse_exchange(mask, cp.chunk_bounds(length, world), rank, method, q.device).edge
                if (edge is None) != (edge_share == 0.0) and edge_share != 0.25:
                    errors.put(f"rank {rank} {name}: edge share {edge_share} gave the other form")
                plan = cp.plan_context_parallel_block_sparse(mask, world, rank, method=method)
                if plan.form != ("copy" if edge is None else "in place"):
                    errors.put(f"rank {rank} {name}: the plan says {plan.form}, the call took the other form")
            grads = torch.autograd.grad(out, local, cp.shard_sequence(dout))
            if method == "alltoall" and name in ("longformer", "globals"):
                # the global tokens' query blocks (and only they) travel as guests
                needs = cp._needs(mask, cp.chunk_bounds(length, world), mask.kv_block)
                want = [[0], [0, length // 2 // 64]][name == "globals"]
                got = sorted(j for g in needs.guests for j in g)
                if got != want:
                    errors.put(f"rank {rank} {name}: guest blocks {got}, want {want}")
            pairs = zip(("out", "dq", "dk", "dv", "lse"), (out, *grads, lse), (ref, *ref_grads, ref_lse), strict=True)
            for what, got, exp in pairs:
                exp = cp.shard_sequence(exp.detach()).float()
                got = got.float()
                err = torch.where(got == exp, 0.0, got - exp).abs().max().item()  # a row of no key: -inf both
                if not err <= tol * max(1.0, exp.nan_to_num(0, 0, 0).abs().max().item()):
                    errors.put(f"rank {rank} block-sparse {name} {method} {edge_share}: {what} max error {err:.2e}")


@pytest.mark.parametrize("world", [2, 4])
def test_context_parallel_matches_one_process(world):
    ctx = mp.get_context("spawn")
    errors = ctx.SimpleQueue()
    mp.start_processes(_worker, args=(world, _free_port(), errors), nprocs=world, start_method="spawn")
    found = []
    while not errors.empty():
        found.append(errors.get())
    assert not found, "\n".join(found)


@pytest.mark.cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_context_parallel_nccl_two_gpus():
    ctx = mp.get_context("spawn")
    errors = ctx.SimpleQueue()
    mp.start_processes(_worker, args=(2, _free_port(), errors, "nccl"), nprocs=2, start_method="spawn")
    found = []
    while not errors.empty():
        found.append(errors.get())
    assert not found, "\n".join(found)


def test_split_rows_partition_each_list_and_merge_back():
    """_split_rows (a guest row block's keys over several CTAs): replica s of a row keeps entries
    s, s + S, ... of its list, ascending, with their partial-mask entries; together the replicas
    hold each entry exactly once; and attention over the replicated queries, merged by the LSEs
    (_merge_partials), equals the unsplit row's, including a row with no key."""
    from sparse_attn import patterns

    n = 1024
    mask = patterns.random_blocks(n, 0.4, seed=5, block_size=(64, 128))
    mask.kv_num_blocks[0, 0, 3] = 0  # a row that sees nothing
    rows = cp._rows_of(mask, [0, 3, 7, 12], torch.arange(mask.num_kv_blocks, dtype=torch.int32), n)
    g = torch.Generator().manual_seed(1)
    q = torch.randn(1, 1, rows.seq_lengths[0], 32, generator=g)
    k, v = (torch.randn(1, 1, n, 32, generator=g) for _ in range(2))
    ref, ref_lse = sparse_attn.block_sparse_attention(q, k, v, rows, return_lse=True)
    for splits in (1, 2, 3, 8):
        split = cp._split_rows(rows, splits)
        for r in range(4):
            whole = rows.kv_indices[0, 0, r, : rows.kv_num_blocks[0, 0, r]].tolist()
            pid = rows.kv_partial[0, 0, r, : rows.kv_num_blocks[0, 0, r]].tolist()
            got, got_pid = [], []
            for s in range(splits):
                c = int(split.kv_num_blocks[0, 0, r * splits + s])
                part = split.kv_indices[0, 0, r * splits + s, :c].tolist()
                assert part == whole[s::splits], (splits, r, s)
                got += part
                got_pid += split.kv_partial[0, 0, r * splits + s, :c].tolist()
            assert sorted(got) == whole and sorted(zip(got, got_pid, strict=True)) == list(zip(whole, pid, strict=True))
        qb = rows.q_block
        q_rep = q.movedim(2, 0).unflatten(0, (-1, 1, qb)).expand(-1, splits, -1, 1, 1, 32).flatten(0, 2).movedim(0, 2)
        o, lse = sparse_attn.block_sparse_attention(q_rep, k, v, split, return_lse=True)
        o, lse = cp._merge_partials(
            o.movedim(2, 0).unflatten(0, (-1, splits, qb)), lse.movedim(2, 0).unflatten(0, (-1, splits, qb)), 1
        )
        torch.testing.assert_close(o.flatten(0, 1).movedim(0, 2), ref, atol=1e-5, rtol=1e-5)
        assert torch.equal(torch.isinf(lse.flatten(0, 1).movedim(0, 2)), torch.isinf(ref_lse))
        finite = torch.isfinite(ref_lse)
        torch.testing.assert_close(lse.flatten(0, 1).movedim(0, 2)[finite], ref_lse[finite], atol=1e-5, rtol=1e-5)


def test_block_sparse_plan_names_the_schedule():
    """plan_context_parallel_block_sparse (no process group): a band takes the all-to-all with K/V
    in place and a second call for the few rows next to a chunk's ends; Longformer's global row
    block travels as a guest from rank 0 and is attended on rank 1, whose every row touches the
    global key block (so its K/V are copied with the received blocks); dense random blocks take the
    all-gather; method= forces; bad arguments raise."""
    from sparse_attn import patterns

    band = cp.plan_context_parallel_block_sparse(patterns.sliding_window(4096, (200, 0), block_size=128), 2)
    assert (band.method, band.form, band.guest_blocks) == ("alltoall", "in place", 0), str(band)
    assert 0 < band.edge_blocks <= 4 and band.received_blocks > 0, str(band)
    lf = patterns.longformer(4096, 48, range(8), block_size=64)
    r0, r1 = (cp.plan_context_parallel_block_sparse(lf, 2, r) for r in (0, 1))
    assert (r0.method, r0.form, r0.guest_blocks, r0.guest_blocks_in) == ("alltoall", "in place", 1, 0), str(r0)
    assert (r1.method, r1.form, r1.guest_blocks, r1.guest_blocks_in) == ("alltoall", "copy", 0, 1), str(r1)
    assert "queries travel" in r0.why
    rnd = cp.plan_context_parallel_block_sparse(patterns.random_blocks(4096, 0.3, seed=3, block_size=128), 2)
    assert rnd.method == "allgather" and rnd.received_blocks == 16, str(rnd)
    forced = cp.plan_context_parallel_block_sparse(patterns.random_blocks(4096, 0.3, seed=3), 4, 3, method="alltoall")
    assert forced.method == "alltoall" and forced.why.startswith("forced"), str(forced)
    with pytest.raises(ValueError, match="method"):
        cp.plan_context_parallel_block_sparse(lf, 2, method="ring")
    with pytest.raises(ValueError, match="rank"):
        cp.plan_context_parallel_block_sparse(lf, 2, 2)


def test_chunk_bounds():
    # Zigzag: 2P chunks, rank r holds r and 2P - 1 - r; sizes differ by at most one.
    b = cp.chunk_bounds(10, 2, "zigzag")
    assert b == [[(0, 3), (8, 2)], [(3, 3), (6, 2)]]
    assert cp.chunk_bounds(7, 3, "contiguous") == [[(0, 3)], [(3, 2)], [(5, 2)]]
    with pytest.raises(ValueError, match="layout"):
        cp.chunk_bounds(10, 2, "striped")


def test_plan():
    assert cp.plan_context_parallel(causal=True).method == "queries"
    assert cp.plan_context_parallel(causal=True, heads=(16, 16)).method == "queries"
    assert cp.plan_context_parallel(causal=False, heads=(16, 2)).method == "ring"
    assert cp.plan_context_parallel(causal=True, heads=(16, 16), world=4).method == "ring"
    assert cp.plan_context_parallel(causal=True, window=(64, 0)).method == "allgather"
    for method in ("ring", "queries"):
        with pytest.raises(ValueError, match="window needs method='allgather'"):
            cp.plan_context_parallel(causal=False, window=8, method=method)
    with pytest.raises(ValueError, match="method must be"):
        cp.plan_context_parallel(method="alltoall")


@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
@pytest.mark.parametrize("causal", [True, False])
def test_query_slices_cover_each_shard_exactly(layout, causal, monkeypatch):
    """The query slices of each rank are exactly its rows that see another rank's keys, in shard
    order, of equal work (rows x other ranks' keys seen) across ranks; and the one flash call per
    (slice, shard) that _shard_call names (a key prefix, a right window bound under bottom-right
    alignment) sees exactly the keys of that shard the mask lets the slice see."""
    monkeypatch.setattr(cp, "_MIN_SLICE", 3)
    # the forward's slices and the backward's fewer, longer ones
    for world, seq_len, count in itertools.product((2, 3, 4), (5, 29, 64, 203, 4096), (32, 4)):
        bounds = cp.chunk_bounds(seq_len, world, layout)
        slices = cp._slices(bounds, causal, count)
        keys_of = [torch.tensor([off + i for off, n in chunks for i in range(n)]) for chunks in bounds]
        works = []
        for r, mine in enumerate(slices):
            rows = torch.tensor([off + i for off, n in bounds[r] for i in range(n)], dtype=torch.long)
            others = torch.cat([keys_of[p] for p in range(world) if p != r])
            seen = (
                (others[None, :] <= rows[:, None]) if causal else torch.ones(len(rows), len(others), dtype=torch.bool)
            )
            want = rows[seen.any(1)].tolist()
            assert [off + i for off, _, n in mine for i in range(n)] == want, (world, seq_len, r)
            local = {off: at for (off, _), at in zip(bounds[r], [0, bounds[r][0][1]], strict=False)}
            for off, qs, _ in mine:  # the offset in the shard matches the global offset
                chunk = max(o for o in local if o <= off)
                assert qs == local[chunk] + off - chunk
            works += [int(seen[rows.tolist().index(off)].sum()) * n for off, _, n in mine]
        # long enough for the cuts to be even (4 slices over 3-4 ranks' uneven chunks: whole pieces are coarse)
        if seq_len == 4096 and works and (count == 32 or world == 2):
            assert max(works) <= 1.5 * min(works), (world, layout, works)
        for mine in slices:
            for qo, _, lq in mine:
                for chunks, key_pos in zip(bounds, keys_of, strict=True):
                    q_pos = torch.arange(qo, qo + lq)
                    want = torch.ones(lq, len(key_pos), dtype=torch.bool)
                    if causal:
                        want = key_pos[None, :] <= q_pos[:, None]
                    call = cp._shard_call(qo, lq, cp._local_chunks(chunks), causal)
                    have = torch.zeros_like(want)
                    if call is not None:
                        keys, right = call
                        j, i = torch.arange(len(key_pos))[None, :], torch.arange(lq)[:, None]
                        have = (j < keys) & ((right < 0) | (j <= i + keys - lq + right))
                    assert torch.equal(have, want), (world, seq_len, qo, lq, chunks)


def test_needs_a_process_group():
    q = torch.randn(1, 2, 8, 32)
    with pytest.raises(RuntimeError, match="process group"):
        cp.context_parallel_attention(q, q, q)


@pytest.mark.parametrize(
    "backend,nccl",
    [("nccl", True), ("cpu:gloo,cuda:nccl", True), ("cuda:nccl", True), ("gloo", False), ("mpi", False)],
)
def test_collectives_on_cuda_tensors_use_nccl_where_the_group_has_it(backend, nccl, monkeypatch):
    # Groups that init_process_group() without a backend and init_device_mesh create hold gloo and
    # NCCL: CUDA tensors take the in-place all-gather, reduce-scatter and the argument check's NCCL
    # exchange there too, not the host forms.
    monkeypatch.setattr(
        cp.dist, "get_backend", lambda group=None: dist.Backend(backend) if ":" not in backend else backend
    )
    assert cp._nccl_for_cuda(None) is nccl


TOPK_CASES = [
    # (seq_len, H, Hkv, k, causal, indexer, layout, method)
    (150, 2, 1, 12, True, True, "zigzag", "alltoall"),
    (150, 2, 1, 12, True, True, "zigzag", "allgather"),
    (131, 4, 2, 7, False, True, "contiguous", None),
    (97, 2, 2, 9, True, False, "zigzag", None),
    (120, 2, 1, 200, True, True, "zigzag", None),  # k past every row's visible keys: dense
]


def _topk_cases(rank: int, world: int, errors, device="cpu", dtype=torch.float32, tol=1e-4, scale_len=1) -> None:
    """context_parallel_topk_attention against topk_attention on the whole sequence: the same
    selection (global positions), output, LSE and gradients."""
    for case in TOPK_CASES:
        length, h, hkv, k_sel, causal, indexer, layout, method = case
        length *= scale_len
        g = torch.Generator().manual_seed(length + k_sel)

        def rnd(*shape, fn=torch.randn, g=g):
            return fn(*shape, generator=g).to(device, dtype)

        q, k, v = (rnd(1, heads, length, 64) for heads in (h, hkv, hkv))
        extra = {}
        if indexer:
            extra = dict(
                index_query=rnd(1, length, 2, 64),
                index_key=rnd(1, length, 64),
                index_weights=rnd(1, length, 2, fn=torch.rand),
            )
        dout = rnd(1, h, length, 64)
        full = [t.clone().requires_grad_() for t in (q, k, v)]
        ref, ref_lse, ref_idx = sparse_attn.topk_attention(
            *full, k_sel, causal=causal, return_lse=True, return_indices=True, **extra
        )
        ref_grads = torch.autograd.grad(ref, full, dout)
        local = [cp.shard_sequence(t, layout=layout).requires_grad_() for t in (q, k, v)]
        shards = {n: cp.shard_sequence(t, layout=layout, dim=1) for n, t in extra.items()}
        out, lse, idx = cp.context_parallel_topk_attention(
            *local, k_sel, causal=causal, layout=layout, method=method, return_lse=True, return_indices=True, **shards
        )
        grads = torch.autograd.grad(out, local, cp.shard_sequence(dout, layout=layout))
        want_idx = cp.shard_sequence(ref_idx, layout=layout)
        if not torch.equal(idx[..., : want_idx.shape[-1]], want_idx):
            errors.put(f"rank {rank} {case}: selection differs")
        _compare_shards(errors, f"rank {rank} {case}", (out, *grads, lse), (ref, *ref_grads, ref_lse), layout, tol)


def _bad_input_cases(rank: int, world: int, errors) -> None:
    """The same bad argument on every rank: every rank raises the error naming it (no hang, no
    silent result)."""
    g = torch.Generator().manual_seed(5)
    q = torch.randn(1, 2, 64, 32, generator=g)
    local = [cp.shard_sequence(q, layout="zigzag").requires_grad_() for _ in range(3)]
    iq, ik, iw = torch.randn(1, 64, 2, 32), torch.randn(1, 64, 32), torch.rand(1, 64, 2)
    shards = [cp.shard_sequence(t, dim=1) for t in (iq, ik, iw)]
    short = shards[0][:, 1:]  # one token short of this rank's shard
    # A group that does not hold this process (new_group is collective: every rank makes it).
    only_first = dist.new_group([0])
    cases = [
        ("gather_sequence seq_len", ValueError, "layout of seq_len=70", lambda: cp.gather_sequence(local[0], 70)),
        ("gather_sequence dim", ValueError, "dim must be an int", lambda: cp.gather_sequence(local[0], 64, dim=5)),
        (
            "float seq_len",
            ValueError,
            "seq_len must be an integer >= 0",
            lambda: cp.context_parallel_attention(*local, seq_len=64.0),
        ),
        (
            "string window",
            TypeError,
            "window must be None, an int",
            lambda: cp.context_parallel_attention(*local, window="16"),
        ),
        (
            "short index_query",
            ValueError,
            "index_query must hold this rank's",
            lambda: cp.context_parallel_topk_attention(
                *local, 8, index_query=short, index_key=shards[1], index_weights=shards[2]
            ),
        ),
    ]
    if rank != 0:
        cases.append(
            (
                "group without this rank",
                ValueError,
                "group does not include this process",
                lambda: cp.context_parallel_attention(*local, group=only_first),
            )
        )
    # Arguments that differ between the ranks, or bad on one rank only: every rank raises (no rank
    # left waiting in a collective, no schedule run on arguments the ranks disagree on).
    last = world - 1
    n = 2 * world * 64  # chunks of whole 64-token blocks
    blocks = [cp.shard_sequence(torch.randn(1, 2, n, 32, generator=g)) for _ in range(3)]
    mask = sparse_attn.patterns.sliding_window(n, (100, 0), block_size=64)
    other = sparse_attn.patterns.sliding_window(n, (200, 0), block_size=64)
    bad_dtype = [local[0].double() if rank == last else local[0], *local[1:]]
    cut = [t[:, :, : t.shape[2] - (rank == last)] for t in local]  # the last rank one token short
    rejected = f"rank(s) [{last}] of the group rejected their arguments"
    cases += [
        (
            "causal on one rank only",
            ValueError,
            "causal must be the same on every rank",
            lambda: cp.context_parallel_attention(*local, causal=rank == 0),
        ),
        (
            "seq_len given with another value on one rank",
            ValueError,
            "seq_len must be the same on every rank",
            lambda: cp.context_parallel_attention(*local, seq_len=64 + (rank == last)),
        ),
        (
            "a dtype one rank's checks reject",
            (ValueError, RuntimeError),
            "dtype" if rank == last else rejected,
            lambda: cp.context_parallel_attention(*bad_dtype),
        ),
        (
            "a query that is not a tensor on one rank",
            (TypeError, ValueError),
            "query" if rank == last else rejected,
            lambda: cp.context_parallel_attention(None if rank == last else local[0], *local[1:]),
        ),
        (
            "a shard one token short on one rank",
            ValueError,
            "the ranks' shards have",
            lambda: cp.context_parallel_attention(*cut, causal=True),
        ),
        (
            "gradients recorded on one rank only",
            ValueError,
            "whether autograd records the call",
            lambda: cp.context_parallel_attention(*(t if rank == 0 else t.detach() for t in local)),
        ),
        (
            "another mask on one rank",
            ValueError,
            "mask must be the same on every rank",
            lambda: cp.context_parallel_block_sparse_attention(*blocks, other if rank == last else mask),
        ),
        (
            "another k on one rank",
            ValueError,
            "k must be the same on every rank",
            lambda: cp.context_parallel_topk_attention(*local, 8 + (rank == last)),
        ),
        (
            "a bad k on one rank",
            ValueError,
            "k must be a positive int" if rank == last else rejected,
            lambda: cp.context_parallel_topk_attention(*local, 0 if rank == last else 8),
        ),
    ]
    for name, exc, match, call in cases:
        try:
            call()
            errors.put(f"rank {rank} {name}: no error")
        except exc as e:
            if match not in str(e):
                errors.put(f"rank {rank} {name}: {type(e).__name__}: {e}")
    out = cp.context_parallel_attention(*local, causal=True)
    try:  # a double backward raises instead of giving wrong second-order gradients
        torch.autograd.grad(out.sum(), local, create_graph=True)
        errors.put(f"rank {rank} double backward: no error")
    except NotImplementedError as e:
        if "first-order only" not in str(e):
            errors.put(f"rank {rank} double backward: {e}")


def _mesh_cases(rank: int, world: int, errors) -> None:
    """A one-dimensional DeviceMesh as ``group``, and DTensors sharded along the sequence (Shard(2),
    DTensor's contiguous chunks) in and out, gradients included. The DTensors are made from each
    rank's own copy and read back as local shards, so that no DTensor collective runs (their
    asynchronous work, left in flight at teardown, aborted gloo processes)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    length = 48 * world
    g = torch.Generator().manual_seed(world)
    q, k, v, dout = (torch.randn(1, 2, length, 32, generator=g) for _ in range(4))
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = sparse_attn.flash_attention(*full, causal=True)
    ref_grads = torch.autograd.grad(ref, full, dout)

    def mine(t, dim=2):  # this rank's contiguous shard of a whole-sequence tensor
        return cp.shard_sequence(t.detach(), group=mesh, layout="contiguous", dim=dim)

    def sharded(t, dim=2):
        return distribute_tensor(t, mesh, [Shard(dim)], src_data_rank=None)

    # a mesh as the group, plain local shards
    out = cp.context_parallel_attention(*(mine(t) for t in (q, k, v)), group=mesh, causal=True, layout="contiguous")
    if not torch.allclose(out, mine(ref), atol=1e-4):
        errors.put(f"rank {rank}: mesh as group: output differs")
    # DTensors in and out
    leaves = [sharded(t).requires_grad_() for t in (q, k, v)]
    # explain takes what the op takes: a mesh as the group, DTensors (their shards, contiguous layout)
    for said in (
        sparse_attn.explain(cp.context_parallel_attention, *leaves, causal=True),
        sparse_attn.explain(
            cp.context_parallel_attention, *(mine(t) for t in (q, k, v)), group=mesh, causal=True, layout="contiguous"
        ),
    ):
        want = cp.plan_context_parallel(True, layout="contiguous", heads=(2, 2), world=world).method
        if said.route != f"context_parallel_{want}" or not said.launches:
            errors.put(f"rank {rank}: explain of a DTensor / mesh call says {said.route}: {said.why}")
    out = cp.context_parallel_attention(*leaves, causal=True)
    if not isinstance(out, DTensor) or tuple(out.placements) != (Shard(2),):
        errors.put(f"rank {rank}: DTensor in, {type(out).__name__} out")
        return
    (out * sharded(dout)).sum().backward()
    if not torch.allclose(out.to_local(), mine(ref), atol=1e-4):
        errors.put(f"rank {rank}: DTensor output differs")
    for name, leaf, want in zip("qkv", leaves, ref_grads, strict=True):
        if not torch.allclose(leaf.grad.to_local(), mine(want), atol=1e-4):
            errors.put(f"rank {rank}: DTensor d{name} differs")
    # top-k with the indexer's tensors as DTensors too
    iq, ik, iw = (
        torch.randn(1, length, 2, 16, generator=g),
        torch.randn(1, length, 16, generator=g),
        torch.rand(1, length, 2, generator=g),
    )
    ref_top = sparse_attn.topk_attention(q, k, v, 9, causal=True, index_query=iq, index_key=ik, index_weights=iw)
    top = cp.context_parallel_topk_attention(
        *(sharded(t) for t in (q, k, v)),
        9,
        causal=True,
        **{n: sharded(t, 1) for n, t in (("index_query", iq), ("index_key", ik), ("index_weights", iw))},
    )
    if not torch.allclose(top.to_local(), mine(ref_top), atol=1e-4):
        errors.put(f"rank {rank}: DTensor top-k output differs")
    with pytest.raises(ValueError, match="layout must be 'contiguous'"):
        cp.context_parallel_attention(*leaves, causal=True, layout="zigzag")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the fused merge is a CUDA kernel")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("d", [36, 64, 128])  # 36: 16-bit rows not 16-byte aligned (element by element)
def test_merge_partial_kernel(dtype, d):
    """The fused LSE merge (context parallelism's query slices) on strided views: each row the fp32
    softmax-weighted sum rounded once, rows where both LSEs are -inf kept as they were, rows outside
    the view untouched."""
    g = torch.Generator().manual_seed(d)
    b, h, length = 2, 3, 41
    whole = torch.randn(b, length, h, d, generator=g).to("cuda", dtype).transpose(1, 2)  # sequence-major
    whole_lse = (3 * torch.randn(b, h, length, generator=g)).cuda()
    rows = slice(5, 33)
    part = torch.randn(b, h, 28, d, generator=g).to("cuda", dtype)
    part_lse = (3 * torch.randn(b, h, 28, generator=g)).cuda()
    whole_lse[0, 0, 7], part_lse[0, 1, 2] = -math.inf, -math.inf  # one side empty: the other side's row
    whole_lse[1, 2, 9], part_lse[1, 2, 4] = -math.inf, -math.inf  # both empty: kept
    before, before_lse = whole.clone(), whole_lse.clone()
    o, lse = before[:, :, rows].double(), before_lse[:, :, rows].double()
    new = torch.logaddexp(lse, part_lse.double())
    w0 = torch.nan_to_num(torch.exp(lse - new)).unsqueeze(-1)
    w1 = torch.nan_to_num(torch.exp(part_lse.double() - new)).unsqueeze(-1)
    want = w0 * o + w1 * part.double()
    want[1, 2, 4], new[1, 2, 4] = o[1, 2, 4], -math.inf
    torch.ops.sparse_attn._merge_partial_.default(whole[:, :, rows], whole_lse[:, :, rows], part, part_lse)
    ulp = torch.finfo(dtype).eps
    err = (whole[:, :, rows].double() - want).abs()
    assert (err <= ulp * want.abs() + 1e-6).all(), err.max().item()
    assert torch.allclose(whole_lse[:, :, rows].double(), new, atol=1e-5, rtol=1e-6)
    for sl in (slice(0, 5), slice(33, length)):
        assert torch.equal(whole[:, :, sl], before[:, :, sl]) and torch.equal(whole_lse[:, :, sl], before_lse[:, :, sl])
