"""Context parallelism: one attention over a sequence sharded along its length across the ranks of a
``torch.distributed`` process group (NCCL on GPUs, gloo on CPUs), forward and backward.

Each rank holds a shard of ``query``, ``key`` and ``value`` (B, H, L_local, D) and gets its shard of the
output. The sequence of length L is cut into chunks (``layout``):

- ``"zigzag"`` (default): 2P chunks, rank r holds chunks r and 2P - 1 - r, concatenated: with a causal
  mask every rank then has the same work (the head-tail balancing of ring attention);
- ``"contiguous"``: P chunks, rank r holds chunk r.

Chunk sizes differ by at most one token when P (or 2P) does not divide L. :func:`shard_sequence` and
:func:`gather_sequence` convert between a whole sequence and the shards.

Three schedules (``method``), chosen by :func:`plan_context_parallel` unless given:

- ``"queries"`` (the default on two ranks with as many K/V heads as query heads; any world size when
  forced): each rank attends its shard to its own K/V in one call; then, slice by slice (~32 per
  shard, of equal work), every rank sends its query slice to the ranks whose keys it can see,
  attends the slices it receives to its own K/V and returns those partial outputs with their LSEs
  (P2P, posted two rounds ahead of the compute); the owner merges a slice's partials in fp32 and
  rounds once. The bytes of a K/V ring when H = Hkv, and per rank only its shards plus ~18 slices
  (no second K/V shard, no fp32 output). The backward runs the same exchange in 4 rounds: a
  slice's queries, output gradient, output and LSE travel, its dQ comes back, and dK and dV stay
  with their owner, accumulated in fp32 there.
- ``"ring"``: P steps; the K/V shards travel around the ring (P2P send/recv, issued before each
  step's compute so they overlap it) and every rank attends its queries to the shard at hand,
  merging the partial outputs through their LSEs in fp32. Memory: two K/V shards per rank. The
  backward runs the same ring, the K/V gradients travelling with their shard back to its owner.
  Dense and causal attention (no window).
- ``"allgather"``: K and V gathered whole (one all-gather each), then each local query chunk attends
  to the key prefix it can see; the backward reduces the K/V gradients back to their owners. Memory:
  the whole K and V per rank; any window.

Every step runs ``flash_attention``'s kernels on views of the chunks (bottom-right alignment and
window bounds computed per pair of chunks, so no element mask is needed).

:func:`context_parallel_block_sparse_attention` takes a global mask (each rank its rows, the key
blocks they touch fetched by an all-to-all), :func:`context_parallel_topk_attention` top-k over the
whole sequence (selection against every key, the named K/V rows fetched from their owners).
``group`` may be a one-dimensional ``DeviceMesh``, and the three ops take DTensors sharded along the
sequence and return DTensors.
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import math
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from . import _args, _meta

if TYPE_CHECKING:
    from .masks import BlockSparseMask

__all__ = [
    "context_parallel_attention",
    "context_parallel_block_sparse_attention",
    "context_parallel_topk_attention",
    "gather_sequence",
    "plan_context_parallel",
    "plan_context_parallel_block_sparse",
    "shard_sequence",
]

_ops = torch.ops.sparse_attn
_LAYOUTS = ("zigzag", "contiguous")


# ------------------------------------------------------------------------------------------- layout
def chunk_bounds(seq_len: int, world: int, layout: str = "zigzag") -> list[list[tuple[int, int]]]:
    """Per rank, its chunks' (global offset, length), in the order they sit in its local shard."""
    if layout not in _LAYOUTS:
        raise ValueError(f"layout must be one of {_LAYOUTS}, got {layout!r}")
    n = 2 * world if layout == "zigzag" else world
    sizes = [seq_len // n + (1 if i < seq_len % n else 0) for i in range(n)]
    offsets = [sum(sizes[:i]) for i in range(n)]
    if layout == "contiguous":
        return [[(offsets[r], sizes[r])] for r in range(world)]
    return [[(offsets[r], sizes[r]), (offsets[n - 1 - r], sizes[n - 1 - r])] for r in range(world)]


def _group_info(group) -> tuple[int, int]:
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("context parallelism needs an initialised torch.distributed process group")
    rank = dist.get_rank(group)
    if rank < 0:  # torch's answer for a group that does not hold this process
        raise ValueError(f"group does not include this process (global rank {dist.get_rank()})")
    return rank, dist.get_world_size(group)


def _nccl_for_cuda(group) -> bool:
    """Whether the group's collectives on CUDA tensors run on NCCL: an "nccl" group, or one with
    NCCL for CUDA beside gloo ("cpu:gloo,cuda:nccl", what ``init_process_group()`` without a
    backend and ``init_device_mesh`` create)."""
    backend = str(dist.get_backend(group))
    return backend == "nccl" or "cuda:nccl" in backend


_AGREED_FIELDS = 24  # the most arguments _agree compares (fields), a fixed size for the all-gather


def _digest(value) -> int:
    """An argument as one int64 for comparing it across ranks (its repr hashed: exact for ints,
    floats, bools, strings, dtypes, tuples of them)."""
    return int.from_bytes(hashlib.blake2b(repr(value).encode(), digest_size=8).digest(), "little", signed=True)


def _agree(
    group, rank: int, world: int, tensors: tuple, length: int, fields: dict, failed: Exception | None
) -> list[int]:
    """Before any other collective of a call: one all-gather of each rank's shard length, whether its
    own argument checks passed (``failed``: the exception they raised) and ``fields`` (the
    arguments the ranks must share), so that every rank raises when one rank's arguments are bad
    or the ranks' arguments differ, instead of some ranks waiting in a collective the others never
    join, or all of them running a schedule they disagree on (wrong K/V gradients, no error).
    ``tensors``: this rank's (query, key, value), for the device. Returns every rank's shard
    length. One host synchronisation."""
    # One rule on every rank, whatever its (possibly bad) arguments: this rank's CUDA device (the
    # first CUDA tensor's, or the current one) where the group has NCCL for CUDA tensors, also beside
    # gloo ("cpu:gloo,cuda:nccl"; measured on two H200s: NCCL's exchange ~100 us, gloo's ~220-460),
    # else the host.
    device = torch.device("cpu")
    if _nccl_for_cuda(group):
        on_cuda = [t.device for t in tensors if isinstance(t, torch.Tensor) and t.is_cuda]
        device = on_cuda[0] if on_cuda else torch.device("cuda", torch.cuda.current_device())
    if len(fields) > _AGREED_FIELDS:
        raise AssertionError(f"{len(fields)} arguments to agree on; the all-gather holds {_AGREED_FIELDS}")
    digests = [] if failed is not None else [_digest(v) for v in fields.values()]
    digests += [0] * (_AGREED_FIELDS - len(digests))  # one size on every rank, failed or not
    mine = torch.tensor([int(failed is not None), length, *digests], dtype=torch.int64, device=device)
    table = torch.empty(world * mine.numel(), dtype=torch.int64, device=device)
    dist.all_gather_into_tensor(table, mine, group=group)  # one flat buffer: a third of a list's time
    table = table.view(world, -1).cpu()
    if failed is not None:
        raise failed
    if bool(table[:, 0].any()):
        others = table[:, 0].nonzero().flatten().tolist()
        raise ValueError(
            f"rank(s) {others} of the group rejected their arguments (their own error names which); this rank "
            "stops too instead of waiting for them in a collective"
        )
    for i, (name, value) in enumerate(fields.items()):
        column = table[:, 2 + i]
        differ = (column != column[rank]).nonzero().flatten().tolist()
        if differ:
            raise ValueError(
                f"{name} must be the same on every rank of the group: rank {rank} has {value!r}, rank(s) {differ} "
                "another value"
            )
    return table[:, 1].tolist()


def _call_fields(query, key, value, **arguments) -> dict:
    """What the ranks of a call must share, by name (``_agree``): the shards' shapes but their
    length, dtype, device kind, whether autograd records the call (a backward on some ranks only
    waits forever), and ``arguments``."""
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value))
    return {
        "query's batch size": query.shape[0],
        "query's heads": query.shape[1],
        "key's heads": key.shape[1],
        "query's head dim": query.shape[3],
        "value's head dim": value.shape[3],
        "query's dtype": query.dtype,
        "query's device type": query.device.type,
        "whether autograd records the call (requires_grad under grad mode)": grad,
        **arguments,
    }


def _mask_fingerprint(mask) -> int:
    """A digest of a BlockSparseMask's lists and words (kept with the mask: masks are not modified)."""
    if "_cp_fingerprint" not in mask.__dict__:
        h = hashlib.blake2b(repr((mask.seq_lengths, mask.block_size)).encode(), digest_size=8)
        for t in (mask.kv_num_blocks, mask.kv_indices, mask.kv_partial, mask.partial_masks):
            h.update(repr(tuple(t.shape)).encode())
            h.update(t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
        mask.__dict__["_cp_fingerprint"] = int.from_bytes(h.digest(), "little", signed=True)
    return mask.__dict__["_cp_fingerprint"]


def _shard_lengths_fit(lengths: list[int], seq_len: int, layout: str) -> list[list[tuple[int, int]]]:
    """The layout's bounds of ``seq_len`` over the ranks, every rank's shard length checked against
    them (on every rank: the same error everywhere)."""
    bounds = chunk_bounds(seq_len, len(lengths), layout)
    wants = [sum(c for _, c in chunks) for chunks in bounds]
    if lengths != wants:
        raise ValueError(
            f"the ranks' shards have {lengths} tokens, but the {layout} layout of {seq_len} tokens over "
            f"{len(lengths)} ranks gives them {wants}"
        )
    return bounds


def _process_group(group):
    """``group`` as a ProcessGroup: None (the world), a ProcessGroup, or a one-dimensional
    ``DeviceMesh`` (e.g. ``mesh["cp"]`` of a larger mesh)."""
    if group is None or not hasattr(group, "get_group"):
        return group
    if group.ndim != 1:
        raise ValueError(
            f"group must be a one-dimensional DeviceMesh (e.g. mesh['cp']), got one of {group.ndim} dimensions"
        )
    return group.get_group()


def _local_call(query, key, value, kwargs: dict):
    """A call's arguments as the shards see them: a DeviceMesh ``group`` as its ProcessGroup; DTensors
    sharded along the sequence (``Shard(2)`` on a one-dimensional mesh, ``Shard(1)`` for the
    indexer's (B, L, ...) tensors) as their local shards, with the mesh's group and the contiguous
    layout (DTensor's). Returns (query, key, value, kwargs, mesh): mesh None for plain tensors."""
    kwargs = dict(kwargs)
    if "group" in kwargs:
        kwargs["group"] = _process_group(kwargs["group"])
    try:
        from torch.distributed.tensor import DTensor, Shard
    except ImportError:  # a torch without DTensor
        return query, key, value, kwargs, None
    if not isinstance(query, DTensor):
        return query, key, value, kwargs, None
    mesh = query.device_mesh
    if mesh.ndim != 1:
        raise ValueError(f"query: a DTensor on a one-dimensional mesh, got a mesh of {mesh.ndim} dimensions")
    if kwargs.get("layout", "contiguous") != "contiguous":
        raise ValueError("DTensors are sharded in contiguous chunks: layout must be 'contiguous' for them")
    world = mesh.size()

    def local(name, t, dim):
        if not isinstance(t, DTensor) or t.device_mesh != mesh or tuple(t.placements) != (Shard(dim),):
            raise ValueError(f"{name} must be a DTensor on query's mesh with placements (Shard({dim}),)")
        if t.shape[dim] % world:
            raise ValueError(
                f"{name}: a sequence of {t.shape[dim]} tokens over {world} ranks: DTensor's uneven shards differ "
                "from this module's layouts; use a length divisible by the mesh size"
            )
        return t.to_local()

    q, k, v = (local(n, t, 2) for n, t in (("query", query), ("key", key), ("value", value)))
    for name in ("index_query", "index_key", "index_weights"):
        if kwargs.get(name) is not None:
            kwargs[name] = local(name, kwargs[name], 1)
    kwargs.update(group=mesh.get_group(), layout="contiguous")
    return q, k, v, kwargs, mesh


def _with_dtensors(fn):
    """Lets ``fn(query, key, value, ...)`` take DTensors sharded along the sequence and a DeviceMesh
    ``group`` (_local_call); every tensor it returns for DTensors comes back as a DTensor sharded
    along dim 2."""

    @functools.wraps(fn)
    def wrapper(query, key, value, *args, **kwargs):
        q, k, v, kwargs, mesh = _local_call(query, key, value, kwargs)
        result = fn(q, k, v, *args, **kwargs)
        if mesh is None:
            return result
        from torch.distributed.tensor import DTensor, Shard

        def wrap(t):
            return DTensor.from_local(t, mesh, [Shard(2)], run_check=False)

        return tuple(wrap(t) for t in result) if isinstance(result, tuple) else wrap(result)

    return wrapper


def shard_sequence(x: torch.Tensor, *, group=None, layout: str = "zigzag", dim: int = 2) -> torch.Tensor:
    """This rank's shard of a whole sequence ``x`` (the same tensor on every rank), along ``dim``."""
    group = _process_group(group)
    rank, world = _group_info(group)
    _check_dim(x, dim)
    parts = [x.narrow(dim, off, n) for off, n in chunk_bounds(x.shape[dim], world, layout)[rank]]
    return torch.cat(parts, dim=dim) if len(parts) > 1 else parts[0].contiguous()


def gather_sequence(x: torch.Tensor, seq_len: int, *, group=None, layout: str = "zigzag", dim: int = 2) -> torch.Tensor:
    """The whole sequence from every rank's shard ``x`` (an all-gather; differentiable)."""
    group = _process_group(group)
    rank, world = _group_info(group)
    _check_dim(x, dim)
    _args.at_least("seq_len", seq_len, 0)
    return _gather(x, _own_shard_fits(x.shape[dim], seq_len, rank, world, layout), group, dim)


def _own_shard_fits(length: int, seq_len: int, rank: int, world: int, layout: str) -> list[list[tuple[int, int]]]:
    """The layout's bounds of ``seq_len`` over ``world`` ranks, this rank's shard length checked
    against them (``_shard_lengths_fit`` checks every rank's, given them all)."""
    bounds = chunk_bounds(seq_len, world, layout)
    mine = sum(n for _, n in bounds[rank])
    if length != mine:
        raise ValueError(
            f"rank {rank}'s shard has {length} tokens, but the {layout} layout of seq_len={seq_len} over "
            f"{world} ranks gives it {mine}"
        )
    return bounds


def _check_dim(x: torch.Tensor, dim: int) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if isinstance(dim, bool) or not isinstance(dim, int) or not -x.dim() <= dim < x.dim():
        raise ValueError(f"dim must be an int in [{-x.dim()}, {x.dim()}) for a {x.dim()}-D tensor, got {dim!r}")


def _gather(x: torch.Tensor, bounds, group, dim: int) -> torch.Tensor:
    """The whole sequence (along ``dim``) from every rank's shard x: one all-gather (_AllShards),
    then the chunks put in sequence order (no copy where the shards are the sequence already)."""
    longest = max(sum(n for _, n in chunks) for chunks in bounds)
    shards = _AllShards.apply(x, longest, group, dim).movedim(dim, 0)
    pieces = sorted(
        (off, r * longest + at, n) for r, chunks in enumerate(bounds) for off, at, n in _local_chunks(chunks)
    )
    if all(off == at for off, at, _ in pieces):
        whole = shards[: sum(n for _, _, n in pieces)]
    else:
        whole = torch.cat([shards[at : at + n] for _, at, n in pieces], dim=0)
    return whole.movedim(0, dim)


# --------------------------------------------------------------------------------------------- plan
@dataclass(frozen=True)
class ContextParallelPlan:
    method: str
    layout: str
    why: str

    def __str__(self) -> str:
        return f"context_parallel_attention: {self.method} ({self.layout} layout)\n  why: {self.why}"


def plan_context_parallel(
    causal: bool = False,
    window=None,
    *,
    layout: str = "zigzag",
    method: str | None = None,
    heads: tuple[int, int] | None = None,
    world: int = 2,
):
    """The schedule a call would take, and why (``method`` forces one where it applies; ``heads``
    = (H, Hkv) of the call, default equal; ``world`` the group's size)."""
    left, right = _args.window_bounds(window)
    windowed = left >= 0 or (right >= 0 and not causal)
    if method not in (None, "queries", "ring", "allgather"):
        raise ValueError(f"method must be None, 'queries', 'ring' or 'allgather', got {method!r}")
    if method in ("queries", "ring") and windowed:
        raise ValueError(f"the {method} schedule takes dense or causal attention; a window needs method='allgather'")
    if method is not None:
        return ContextParallelPlan(method, layout, "forced by method=")
    if windowed:
        return ContextParallelPlan(
            "allgather", layout, "a window: each query chunk attends to the key prefix it can see of the gathered K/V"
        )
    balance = "; the zigzag layout gives every rank the same causal work" if causal and layout == "zigzag" else ""
    h, hkv = heads or (1, 1)
    if hkv >= h and world == 2:
        return ContextParallelPlan(
            "queries",
            layout,
            "dense or causal on two ranks, as many K/V heads as query heads: query slices travel to the other rank "
            "and partial outputs come back (the bytes of a K/V ring), merged in fp32 slice by slice, so a rank "
            "holds its shards and a few slices, not a second K/V shard and an fp32 output (the backward: the "
            "same exchange, dQ coming back and dK/dV accumulated by their owner)" + balance,
        )
    why = f"{h} query heads over {hkv} K/V heads: K/V shards are the fewer bytes" if hkv < h else f"{world} ranks"
    return ContextParallelPlan(
        "ring",
        layout,
        f"dense or causal, {why}: K/V shards travel the ring while each rank computes on the one at hand (two "
        "K/V shards and an fp32 output accumulator per rank, the transfers hidden behind the compute; on more than "
        "two ranks the query slices measured slower: their rounds are not even per receiving rank)" + balance,
    )


# ---------------------------------------------------------------------------------------- the pairs
def _pair(qo: int, lq: int, ko: int, lk: int, causal: bool):
    """How query chunk [qo, qo + lq) attends to key chunk [ko, ko + lk) of one sequence: None (no key
    visible), or (keys to keep, window_right for flash on them: -1 = every kept key visible)."""
    if lq == 0 or lk == 0:
        return None
    if not causal:
        return lk, -1
    keep = min(lk, qo - ko + lq)  # keys past the last query's position are never visible
    if keep <= 0:
        return None
    if qo - ko >= keep - 1:  # even the first query sees every kept key
        return keep, -1
    # Key j visible from query i iff ko + j <= qo + i, i.e. j <= i + (keep - lq) + right.
    return keep, qo - ko - keep + lq


def _merge(acc_o, acc_lse, o, lse):
    """acc <- the softmax-weighted union of acc and a partial (o, lse), in fp32, in place."""
    new = torch.logaddexp(acc_lse, lse)
    finite = torch.isfinite(new)
    w_old = torch.where(finite, torch.exp(acc_lse - new), 0.0)
    w_new = torch.where(finite, torch.exp(lse - new), 0.0)
    acc_o.mul_(w_old.unsqueeze(-1)).addcmul_(o, w_new.unsqueeze(-1))  # o read in place, no fp32 copy
    acc_lse.copy_(new)


def _rotate(tensors, group, rank, world):
    """Starts sending ``tensors`` to the next rank and receiving the previous rank's; returns the
    receive buffers and the requests to wait on."""

    def peer(r):
        return r if group is None else dist.get_global_rank(group, r)

    bufs = [torch.empty_like(t) for t in tensors]
    ops = [dist.P2POp(dist.isend, t, peer((rank + 1) % world), group) for t in tensors]
    ops += [dist.P2POp(dist.irecv, b, peer((rank - 1) % world), group) for b in bufs]
    return bufs, dist.batch_isend_irecv(ops)


def _pad_shard(x: torch.Tensor, bounds) -> torch.Tensor:
    """A K or V shard, contiguous, padded along the sequence to the longest shard: what travels the
    ring (every rank's receive buffer has one shape; each step reads only the sender's tokens)."""
    longest = max(sum(n for _, n in chunks) for chunks in bounds)
    if x.shape[2] == longest:
        return x.contiguous()
    padded = x.new_zeros(*x.shape[:2], longest, x.shape[3])
    padded[:, :, : x.shape[2]] = x
    return padded


def _local_chunks(bounds_rank):
    """(global offset, offset in the local shard, length) of a rank's chunks."""
    start, out = 0, []
    for off, n in bounds_rank:
        out.append((off, start, n))
        start += n
    return out


# --------------------------------------------------------------------------------------------- ring
class _DenseContextParallel(torch.autograd.Function):
    """Dense or causal attention over the ranks' shards by ``schedule``, "queries"
    (_query_slices_forward / _query_slices_backward) or "ring" (_ring_forward / _ring_backward)."""

    @staticmethod
    def forward(ctx, q, k, v, bounds, scale, causal, group, schedule):
        forward = _query_slices_forward if schedule == "queries" else _ring_forward
        out, lse = forward(q, k, v, bounds, scale, causal, group)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.bounds, ctx.scale, ctx.causal, ctx.group, ctx.schedule = bounds, scale, causal, group, schedule
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, grad_out, _grad_lse):
        _meta.first_order()
        q, k, v, out, lse = ctx.saved_tensors
        if ctx.schedule == "queries":
            grads = _query_slices_backward(ctx, grad_out, q, k, v, out, lse)
        else:
            grads = _ring_backward(ctx, grad_out, q, _pad_shard(k, ctx.bounds), _pad_shard(v, ctx.bounds), out, lse)
        return (*grads, None, None, None, None, None)


def _ring_forward(q, k, v, bounds, scale, causal, group):
    """The ring's forward: P steps, the K/V shards travelling while each rank attends its query chunks
    to the shard at hand, the partials merged in an fp32 accumulator."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    k, v = _pad_shard(k, bounds), _pad_shard(v, bounds)
    b, h, lq_local, _ = q.shape
    acc_o = torch.zeros(b, h, lq_local, v.shape[-1], dtype=torch.float32, device=q.device)
    acc_lse = torch.full((b, h, lq_local), -math.inf, dtype=torch.float32, device=q.device)
    q_chunks = _local_chunks(bounds[rank])
    touched = set()  # query chunks with a partial result in the accumulators
    cur, src, bufs = (k, v), rank, None
    for step in range(world):
        pending = _rotate(cur, group, rank, world) if step + 1 < world else None
        for ko, ks, lk in _local_chunks(bounds[src]):
            for qo, qs, lq in q_chunks:
                pair = _pair(qo, lq, ko, lk, causal)
                if pair is None:
                    continue
                keep, right = pair
                rows, keys = slice(qs, qs + lq), slice(ks, ks + keep)
                o, lse = _ops.flash_fwd.default(
                    q[:, :, rows], cur[0][:, :, keys], cur[1][:, :, keys], scale, False, -1, right
                )
                if qs in touched:
                    _merge(acc_o[:, :, rows], acc_lse[:, :, rows], o, lse)
                else:  # the first partial of these rows: no merge
                    acc_o[:, :, rows] = o
                    acc_lse[:, :, rows] = lse
                    touched.add(qs)
        if pending is not None:
            bufs, reqs = pending
            for req in reqs:
                req.wait()
            cur, src = tuple(bufs), (src - 1) % world
    del cur, bufs, pending  # the last received K/V shard, before the output's copy is made
    out = acc_o.to(q.dtype)
    del acc_o
    return out, acc_lse


def _ring_backward(ctx, grad_out, q, k, v, out, lse):
    """dq, dk, dv of a rank's shards by the ring (k, v padded to the longest shard): the K/V shards
    travel as in the forward, their gradients with them, one more hop bringing each home."""
    group, bounds = ctx.group, ctx.bounds
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    grad_out = grad_out.contiguous()
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    q_chunks = _local_chunks(bounds[rank])
    cur, src = (k, v), rank
    dk = torch.zeros(k.shape, dtype=torch.float32, device=k.device)
    dv = torch.zeros(v.shape, dtype=torch.float32, device=v.device)
    for step in range(world):
        pending = _rotate(cur, group, rank, world) if step + 1 < world else None
        for ko, ks, lk in _local_chunks(bounds[src]):
            for qo, qs, lq in q_chunks:
                pair = _pair(qo, lq, ko, lk, ctx.causal)
                if pair is None:
                    continue
                keep, right = pair
                rows, keys = slice(qs, qs + lq), slice(ks, ks + keep)
                gq, gk, gv = _ops.flash_bwd.default(
                    grad_out[:, :, rows],
                    q[:, :, rows],
                    cur[0][:, :, keys],
                    cur[1][:, :, keys],
                    out[:, :, rows],
                    lse[:, :, rows],
                    None,
                    ctx.scale,
                    False,
                    -1,
                    right,
                )
                dq[:, :, rows] += gq
                dk[:, :, keys] += gk
                dv[:, :, keys] += gv
        # The gradients travel with their K/V shard; after the last step one more hop brings
        # each shard's gradients home.
        grads, reqs = _rotate((dk, dv), group, rank, world)
        for req in reqs:
            req.wait()
        dk, dv = grads
        if pending is not None:
            bufs, reqs = pending
            for req in reqs:
                req.wait()
            cur, src = tuple(bufs), (src - 1) % world
    mine = sum(n for _, n in bounds[rank])
    return dq.to(q.dtype), dk[:, :, :mine].to(k.dtype), dv[:, :, :mine].to(v.dtype)


# ---------------------------------------------------------------------------------- query slices
# The "queries" schedule: each rank attends its whole shard to its own K/V (one call), then, slice
# by slice of every rank's queries, sends its query slice to the ranks whose K/V it can see, attends
# the slices it receives to its own K/V, and returns those partial outputs (with their LSEs); the
# owner merges a slice's partials with its own in fp32, one rounding. Nothing of the size of a shard
# is allocated besides the output: per rank the shards plus a few slices.
_QUERY_SLICES = 32  # slices per rank's shard: ~18 of them in flight (0.53 of one GPU's memory at two ranks)
_MIN_SLICE = 1024  # tokens: shorter slices would leave the kernel's grid short of the SMs
# The backward's slices: each slice's call writes dK and dV over every key it sees, added into fp32
# accumulators (~3 K/V shards of bytes per round whatever the slice's length), so fewer, longer
# slices. Two H100s, B1 H16 D128 causal, forward + backward against the ring's backward in one
# process: 4 rounds 0.98 / 1.00 of its time (128k / 256k), 8 rounds 1.00 / 1.00, 16 rounds 1.06 /
# 1.02; extra memory 0.72, 0.63, 0.59 of the ring's (docs/PERF_LOG.md).
_BACKWARD_SLICES = 4


def _slices(bounds, causal: bool, count: int = _QUERY_SLICES) -> list[list[tuple[int, int, int]]]:
    """Per rank, the query slices that travel (global offset, offset in the local shard, length):
    the rows that see some other rank's keys, cut into about ``count`` pieces of equal work
    (rows x keys seen on the other ranks; constant within a chunk, as another rank's chunks are
    wholly visible or not), so that in round t every rank computes the same amount for the others."""
    shards = [_local_chunks(chunks) for chunks in bounds]

    def remote_keys(r, off, n):  # keys a row of this chunk of rank r sees on the other ranks
        calls = (_shard_call(off, n, shards[p], causal) for p in range(len(bounds)) if p != r)
        return sum(c[0] for c in calls if c is not None)

    work = [[(off, start, n, n * remote_keys(r, off, n)) for off, start, n in shards[r]] for r in range(len(bounds))]
    # The work of one slice: a rank's work over ``count``, or more where a chunk would be cut into
    # slices shorter than _MIN_SLICE (every chunk's slices then longer, so the rounds stay even).
    target = max(sum(w for *_, w in chunks) for chunks in work) / count
    for chunks in work:
        target = max([target, 1] + [w / max(1, n // _MIN_SLICE) for _, _, n, w in chunks if w])
    out = []
    for chunks in work:
        mine = []
        for off, start, n, w in chunks:
            if w == 0:
                continue
            pieces = max(1, min(round(w / target), n))
            at = 0
            for i in range(pieces):
                m = n // pieces + (1 if i < n % pieces else 0)
                mine.append((off + at, start + at, m))
                at += m
        out.append(mine)
    return out


def _shard_call(qo: int, lq: int, key_chunks, causal: bool):
    """How query rows [qo, qo + lq) attend to a shard whose chunks (global offset, local offset,
    length) lie one after another: None (no key visible), or (keys, window_right) for one flash call
    over the shard's first ``keys`` keys (every chunk before the last kept one wholly visible)."""
    keys, right = 0, -1
    for ko, ks, lk in key_chunks:
        pair = _pair(qo, lq, ko, lk, causal)
        if pair is None:
            if lk:
                break  # causal: the chunks after it lie further right
            continue
        keep, r = pair
        keys = ks + keep
        if keep < lk or r != -1:
            right = r
            break
    return None if keys == 0 else (keys, right)


_ROUND_STREAMS = 2  # CUDA streams the forward's rounds alternate on (1: all on the caller's stream)
_side_streams: dict = {}


def _round_streams(x: torch.Tensor):
    """The side streams the forward's rounds alternate on where x is on a GPU (None elsewhere, or
    with _ROUND_STREAMS < 2): a round's kernel starts once its slices are here, on the SMs the
    previous round's last tiles leave free, instead of after that kernel's tail. Kept per device."""
    if not x.is_cuda or _ROUND_STREAMS < 2:
        return None
    key = (x.device, _ROUND_STREAMS)
    if key not in _side_streams:
        _side_streams[key] = [torch.cuda.Stream(x.device) for _ in range(_ROUND_STREAMS)]
    return _side_streams[key]


def _slice_rounds(bounds, causal, group, count, *, send, receive, attend, returned, absorb, own, streams=None):
    """The query slices' exchange, for the forward and the backward alike: round t, every rank sends
    its query slice t (``send(start, n)``: tensors (B, ·, n, ·) of its rows [start, start + n)) to the
    ranks whose keys it sees, receives the slices of the ranks that see its keys (``receive(n)``:
    empty tensors laid out as send's), computes on each (``attend(tensors, keys, right)``: its keys
    [0, keys) and window bound, returning the tensors that go back), and gets its own slice's
    results back (``returned(n)``: empty tensors laid out as attend's), which ``absorb(start, n,
    [results of each rank])`` folds in. ``own()``, this rank's shard against its own K/V, runs
    under round 0's exchange with round 1's posted behind it. Round t waits for the exchange posted
    in round t - 2 and posts round t + 2's slices with the results of round t - 1: an exchange that
    NCCL can only start once a round's kernel leaves the SMs still lands before it is needed.

    ``streams`` (CUDA; attend and own writing only tensors of their own, own returning them): own
    and the rounds run on these side streams in turn, each round after its slices arrived and not
    after the previous round's kernel, and the caller's stream (exchanges, absorb) waits for a
    kernel only where it sends or merges that kernel's results."""

    def peer(r):
        return r if group is None else dist.get_global_rank(group, r)

    rank, world = dist.get_rank(group), dist.get_world_size(group)
    slices = _slices(bounds, causal, count)
    rounds = max(len(mine) for mine in slices)
    shards = [_local_chunks(chunks) for chunks in bounds]
    others = [p for p in range(world) if p != rank]

    def call(p, t, keys_of):  # slice t of rank p against rank keys_of's shard (None: no such slice or no key)
        if not 0 <= t < len(slices[p]):
            return None
        return _shard_call(slices[p][t][0], slices[p][t][2], shards[keys_of], causal)

    def ops(op, tensors, p):  # each tensor sent or received in its memory order (a view where it is dense)
        return [dist.P2POp(op, _wire(x, _memory_order(x)), peer(p), group) for x in tensors]

    def queries(t):  # round t's query slices: (ops, {peer: received tensors})
        posted, got, mine = [], {}, None
        for p in others:
            if call(rank, t, p) is not None:
                mine = mine or send(*slices[rank][t][1:])
                posted += ops(dist.isend, mine, p)
            if call(p, t, rank) is not None:
                got[p] = receive(slices[p][t][2])
                posted += ops(dist.irecv, got[p], p)
        return posted, got

    def results(t, computed):  # round t's results back to their owners: (ops, {peer: received results})
        posted, got = [], {}
        for p in others:
            if p in computed:
                posted += ops(dist.isend, computed[p], p)
            if call(rank, t, p) is not None:
                got[p] = returned(slices[rank][t][2])
                posted += ops(dist.irecv, got[p], p)
        return posted, got

    pending, received = [], {}  # exchanges posted and not yet waited for; query slices by round
    main = torch.cuda.current_stream() if streams else None
    own_done = []  # own's event, until absorb first waits for it

    def post(t, q_round, r_round, computed):
        ops_q, received[q_round] = queries(q_round)
        ops_r, parts = results(r_round, computed)
        reqs = dist.batch_isend_irecv(ops_q + ops_r) if ops_q or ops_r else []
        pending.append((t, reqs, r_round, parts))

    def settle(upto):  # wait for the exchanges posted up to round ``upto``; absorb the results they returned
        while pending and pending[0][0] <= upto:
            _, reqs, r_round, parts = pending.pop(0)
            for req in reqs:
                req.wait()
            if parts:
                if own_done:
                    main.wait_event(own_done.pop())
                absorb(*slices[rank][r_round][1:], list(parts.values()))

    def on_side(i, fn, inputs=()):  # fn() on side stream i once the caller's stream is where it is now
        side = streams[i % len(streams)]
        side.wait_stream(main)
        with torch.cuda.stream(side):
            result = fn()
        for x in inputs:
            x.record_stream(side)  # allocated on the caller's stream, read on this one
        return result, side.record_event()

    post(-2, 0, -1, {})
    if streams:
        outputs, done = on_side(len(streams) - 1, own)
        for x in outputs or ():
            x.record_stream(main)  # allocated on the side stream, merged into and returned on the caller's
        own_done.append(done)
    else:
        own()
    post(-1, 1, -1, {})

    def attend_round(t, got):  # round t's slices {peer: tensors} -> {peer: results}
        return {p: attend(tensors, *call(p, t, rank)) for p, tensors in got.items()}

    computed, done = {}, None
    for t in range(rounds + 1):
        settle(t - 2)
        got = received.pop(t, {})
        if not streams:
            post(t, t + 2, t - 1, computed)
            computed = attend_round(t, got)
            continue
        computed_t, done_t = on_side(
            t, functools.partial(attend_round, t, got), [x for tensors in got.values() for x in tensors]
        )
        if done is not None:
            main.wait_event(done)  # round t - 1's results are sent from here
        post(t, t + 2, t - 1, computed)
        computed, done = computed_t, done_t
    settle(rounds)
    if own_done:  # no result came back to merge into own's output
        main.wait_event(own_done.pop())


def _query_slices_forward(q, k, v, bounds, scale, causal, group):
    """The query slices' forward (_slice_rounds): a slice's queries travel, its partial output and
    LSE come back and are merged into this rank's output in fp32, rounded once. The first call,
    this rank's queries against its own K/V, has Lq = Lk, so the causal diagonal of the shard's own
    chunks is the kernel's (a zigzag shard's second chunk sees its first whole)."""
    res = {}
    b, h, _, d = q.shape

    def own():
        res["out"], res["lse"] = _ops.flash_fwd.default(q, k, v, scale, causal, -1, -1)
        return res["out"], res["lse"]

    def absorb(start, n, parts):
        rows = slice(start, start + n)
        _merge_slice(res["out"][:, :, rows], res["lse"][:, :, rows], parts)

    _slice_rounds(
        bounds,
        causal,
        group,
        _QUERY_SLICES,
        send=lambda start, n: [q[:, :, start : start + n].contiguous()],
        receive=lambda n: [q.new_empty(b, h, n, d)],
        attend=lambda t, keys, right: _ops.flash_fwd.default(
            t[0], k[:, :, :keys], v[:, :, :keys], scale, False, -1, right
        ),
        returned=lambda n: (_empty_along(res["out"], n), res["lse"].new_empty(b, h, n)),
        absorb=absorb,
        own=own,
        streams=_round_streams(q),
    )
    return res["out"], res["lse"]


def _query_slices_backward(ctx, grad_out, q, k, v, out, lse):
    """The query slices' backward (_slice_rounds, _BACKWARD_SLICES rounds): a slice's queries,
    output gradient, output and LSE travel to the ranks whose keys it sees; each computes the
    slice's gradient against its own K/V, adds dK and dV into its own fp32 accumulators (so the K/V
    gradients never travel) and returns dQ, which the owner sums with its own part in fp32 and
    rounds once (each part the kernel's 16-bit output, as on the ring). Per rank: its shards, fp32
    dK and dV, and a few slices."""
    group, bounds, scale, causal = ctx.group, ctx.bounds, ctx.scale, ctx.causal
    b, h, _, d = q.shape
    dvo = v.shape[-1]
    grad_out = grad_out.contiguous()
    res = {}

    def own():
        res["dq"], dk, dv = _ops.flash_bwd.default(grad_out, q, k, v, out, lse, None, scale, causal, -1, -1)
        res["dk"] = dk.float()
        del dk  # one 16-bit gradient less at the peak
        res["dv"] = dv.float()

    def send(start, n):
        rows = slice(start, start + n)
        return [x[:, :, rows].contiguous() for x in (q, grad_out, out, lse)]

    def receive(n):
        return [
            q.new_empty(b, h, n, d),
            grad_out.new_empty(b, h, n, dvo),
            out.new_empty(b, h, n, dvo),
            lse.new_empty(b, h, n),
        ]

    def attend(t, keys, right):
        qp, gp, op, lp = t
        gq, gk, gv = _ops.flash_bwd.default(
            gp, qp, k[:, :, :keys], v[:, :, :keys], op, lp, None, scale, False, -1, right
        )
        res["dk"][:, :, :keys] += gk
        res["dv"][:, :, :keys] += gv
        return [gq.contiguous()]

    def absorb(start, n, parts):
        mine = res["dq"][:, :, start : start + n]
        total = mine.float()
        for (gq,) in parts:
            total += gq
        mine.copy_(total)

    _slice_rounds(
        bounds,
        causal,
        group,
        _BACKWARD_SLICES,
        send=send,
        receive=receive,
        attend=attend,
        returned=lambda n: [q.new_empty(b, h, n, d)],
        absorb=absorb,
        own=own,
    )
    return res["dq"], res["dk"].to(k.dtype), res["dv"].to(v.dtype)


def _wire(x: torch.Tensor, order: list[int]) -> torch.Tensor:
    """x with its dimensions permuted to ``order`` (outermost first), contiguous: a view where x
    lies that way in memory, else a copy; what a P2P op sends or receives into."""
    x = x.permute(order)
    return x if x.is_contiguous() else x.contiguous()


def _merge_slice(out, lse, parts) -> None:
    """out / lse (views of a slice of this rank's rows) merged in place with partials over other
    keys [(o, lse)]: the softmax-weighted sum in fp32, rounded once (one fused kernel on CUDA for a
    single part, else _merge_partials)."""
    if out.is_cuda and len(parts) == 1 and out.stride(-1) == parts[0][0].stride(-1) == 1:
        _ops._merge_partial_.default(out, lse, *parts[0])
        return
    merged, new = _merge_partials(
        torch.stack([out, *(o for o, _ in parts)]), torch.stack([lse, *(l for _, l in parts)]), 0
    )
    out.copy_(merged)
    lse.copy_(new)


# ------------------------------------------------------------------------------------------ allgather
def _allgather_calls(bounds_rank, seq_len: int, left: int, right: int):
    """Per local query chunk, its call against the gathered K/V: (offset in the shard, length, keys
    [0, end) it attends to, window left and right under flash's bottom-right alignment)."""
    for qo, qs, lq in _local_chunks(bounds_rank):
        end = seq_len if right < 0 else min(seq_len, qo + lq + right)
        w_right = -1 if right < 0 else qo + right - end + lq
        w_left = -1 if left < 0 else end - lq - qo + left
        yield qs, lq, end, w_left, w_right


def _allgather_attention(q, k, v, bounds, rank, seq_len, scale, left, right, group):
    """Each local query chunk [qo, qo + lq) against keys [0, end) of the gathered K/V, end the first
    key no query of the chunk can see: flash's bottom-right alignment then puts query i at global
    position qo + i, and the window's bounds shift by that alignment (both stay >= 0)."""
    k_all = _gather(k, bounds, group, 2)
    v_all = _gather(v, bounds, group, 2)
    outs, lses = [], []
    for qs, lq, end, w_left, w_right in _allgather_calls(bounds[rank], seq_len, left, right):
        o, lse = _ops.flash_fwd.default(
            q[:, :, qs : qs + lq], k_all[:, :, :end], v_all[:, :, :end], scale, False, w_left, w_right
        )
        outs.append(o)
        lses.append(lse)
    return torch.cat(outs, dim=2), torch.cat(lses, dim=2)


# ---------------------------------------------------------------------------------------------- API
@_with_dtensors
def context_parallel_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    group=None,
    causal: bool = False,
    window: int | tuple[int | None, int | None] | None = None,
    scale: float | None = None,
    seq_len: int | None = None,
    layout: str = "zigzag",
    method: str | None = None,
    return_lse: bool = False,
    validate: bool = True,
):
    """``flash_attention`` over a sequence sharded along its length across ``group``.

    Parameters
    ----------
    query, key, value : Tensor
        This rank's shards, (B, H, L_r, D), (B, Hkv, L_r, D), (B, Hkv, L_r, Dv): chunks of one
        sequence laid out by ``layout`` (:func:`shard_sequence` makes them from a whole sequence).
    group : ProcessGroup, optional
        The ranks that share the sequence (default: the world).
    causal, window, scale
        As ``flash_attention``, over the whole sequence.
    seq_len : int, optional
        The whole sequence's length; default: the sum of the ranks' shard lengths (the all-gather
        of ``validate``).
    layout : {"zigzag", "contiguous"}
        How the sequence is cut into the ranks' shards (module docstring).
    method : {None, "queries", "ring", "allgather"}
        The schedule; None lets :func:`plan_context_parallel` choose.
    return_lse : bool
        Also return this rank's LSE shard, fp32 (B, H, L_r) (not differentiable on the ring and
        the query slices).
    validate : bool
        Check the ranks' arguments against each other before the first exchange (one all-gather of
        a few integers and a host synchronisation): every rank raises, naming the argument, when
        one rank's arguments are bad or the ranks' differ (shapes but the length, dtype, causal,
        window, scale, seq_len, layout, schedule, whether autograd records the call), where a
        mismatch would otherwise leave ranks waiting in a collective or give wrong gradients. The
        check is always made when ``seq_len`` is not given (the all-gather sums the shards);
        ``validate=False`` with ``seq_len`` skips it (on every rank alike: a rank that checks waits
        for the others; and for CUDA-graph capture, which allows no host synchronisation).

    Returns
    -------
    Tensor (B, H, L_r, Dv): this rank's shard of the output, or (out, lse).
    """
    rank, world = _group_info(group)
    failed, fields = None, {}
    try:  # this rank's checks; their error is raised after the ranks agree (_agree)
        _args.check_inputs(query, key, value)
        if key.shape[2] != query.shape[2]:
            raise ValueError(
                f"query and key shards must have the same length (self-attention over one sequence), got "
                f"{query.shape[2]} and {key.shape[2]}"
            )
        if seq_len is not None:
            _args.at_least("seq_len", seq_len, 0)
        left, right = _args.window_bounds(window)
        if causal:
            right = 0
        plan = plan_context_parallel(
            causal, window, layout=layout, method=method, heads=(query.shape[1], key.shape[1]), world=world
        )
        scale = _args.scale(scale)
        fields = _call_fields(
            query,
            key,
            value,
            causal=bool(causal),
            window=(left, right),
            scale=scale,
            seq_len=seq_len,
            layout=layout,
            method=plan.method,
        )
    except Exception as error:  # noqa: BLE001  (raised below, on every rank)
        failed = error
    if seq_len is None or validate:
        lengths = _agree(group, rank, world, (query, key, value), 0 if failed else query.shape[2], fields, failed)
        bounds = _shard_lengths_fit(lengths, sum(lengths) if seq_len is None else seq_len, layout)
        seq_len = sum(lengths) if seq_len is None else seq_len
    else:
        if failed is not None:
            raise failed
        bounds = _own_shard_fits(query.shape[2], seq_len, rank, world, layout)
    if plan.method in ("queries", "ring"):
        out, lse = _DenseContextParallel.apply(query, key, value, bounds, scale, bool(causal), group, plan.method)
    else:
        out, lse = _allgather_attention(query, key, value, bounds, rank, seq_len, scale, left, right, group)
    return (out, lse) if return_lse else out


def _memory_order(x: torch.Tensor) -> list[int]:
    """x's dimensions in the order they lie in memory, outermost first."""
    return sorted(range(x.dim()), key=lambda d: -x.stride(d))


def _empty_along(x: torch.Tensor, length: int) -> torch.Tensor:
    """An empty tensor of x's shape but ``length`` along dim 2, its dimensions in memory in x's
    order (so that copying x into it moves whole rows, whether x is head- or sequence-major)."""
    order = _memory_order(x)
    shape = [*x.shape[:2], length, *x.shape[3:]]
    return x.new_empty([shape[d] for d in order]).permute([order.index(d) for d in range(x.dim())])


class _WithRowsOfOthers(torch.autograd.Function):
    """K or V of this rank's shard x (B, Hkv, L_r, D) with rows of the other ranks after it along
    the sequence, as one tensor in x's memory layout: the shard copied in once, the received rows
    from one all-to-all of variable sizes (this shard's rows ``send_rows`` going out in the order
    of ``send_sizes``), straight into place when the sequence is x's outermost dimension.
    Backward: the shard's gradient, plus the gradients of the rows it sent, returned by their
    receivers."""

    @staticmethod
    def forward(ctx, x, send_rows, send_sizes, recv_sizes, group):
        ctx.save_for_backward(send_rows)
        ctx.sizes, ctx.group, ctx.lr = (send_sizes, recv_sizes), group, x.shape[2]
        return _with_rows_of_others(x, send_rows, send_sizes, recv_sizes, group)

    @staticmethod
    def backward(ctx, grad):
        (send_rows,) = ctx.saved_tensors
        send_sizes, recv_sizes = ctx.sizes
        mine = grad[:, :, : ctx.lr].clone()
        return (
            _rows_back(mine, grad[:, :, ctx.lr :], send_rows, send_sizes, recv_sizes, ctx.group),
            None,
            None,
            None,
            None,
        )


def _with_rows_of_others(x, send_rows, send_sizes, recv_sizes, group):
    """_WithRowsOfOthers' forward (no autograd)."""
    lr = x.shape[2]
    buf = _empty_along(x, lr + sum(recv_sizes))
    buf[:, :, :lr].copy_(x)
    send = x.movedim(2, 0).index_select(0, send_rows)
    tail = buf[:, :, lr:].movedim(2, 0)
    if tail.is_contiguous():
        dist.all_to_all_single(tail, send, recv_sizes, send_sizes, group=group)
    else:
        got = torch.empty_like(tail, memory_format=torch.contiguous_format)
        dist.all_to_all_single(got, send, recv_sizes, send_sizes, group=group)
        tail.copy_(got)
    return buf


def _rows_back(mine, received, send_rows, send_sizes, recv_sizes, group):
    """A shard's gradient ``mine`` (B, H, L_r, D), to which the gradients of the rows it sent are
    added in place, returned by their receivers (``received``: this rank's gradients of the rows it
    got, (B, H, n, D)) through the reverse all-to-all."""
    back = _exchange(received.movedim(2, 0), recv_sizes, send_sizes, group)
    return mine.index_add_(2, send_rows, back.movedim(0, 2))


class _AllShards(torch.autograd.Function):
    """Every rank's shard x (the sequence along ``dim``, e.g. K or V (B, Hkv, L_r, D) along 2) in
    one tensor of P * L_longest along ``dim``, laid out sequence-first, rank by rank (shard r at
    r * L_longest; a shorter shard's tail is zero): one all-gather into place. Backward: each
    shard's gradients summed over the ranks and delivered to its owner."""

    @staticmethod
    def forward(ctx, x, longest, group, dim):
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        lr = x.shape[dim]
        seq = x.movedim(dim, 0)
        buf = x.new_empty((world * longest, *seq.shape[1:]))
        slot = buf[rank * longest : (rank + 1) * longest]
        slot[:lr].copy_(seq)
        if lr < longest:
            slot[lr:].zero_()
        # NCCL gathers in place (the input is the own slot); gloo wants an input apart from buf.
        dist.all_gather_into_tensor(buf, slot if x.is_cuda and _nccl_for_cuda(group) else slot.clone(), group=group)
        ctx.group, ctx.lr, ctx.longest, ctx.dim = group, lr, longest, dim
        return buf.movedim(0, dim)

    @staticmethod
    def backward(ctx, grad):
        rank = dist.get_rank(ctx.group)
        g = grad.movedim(ctx.dim, 0).contiguous()
        if g.is_cuda and _nccl_for_cuda(ctx.group):
            mine = g.new_empty((ctx.longest, *g.shape[1:]))
            dist.reduce_scatter_tensor(mine, g, group=ctx.group)
        else:
            dist.all_reduce(g, group=ctx.group)
            mine = g[rank * ctx.longest : (rank + 1) * ctx.longest]
        return mine[: ctx.lr].movedim(0, ctx.dim), None, None, None


def _exchange(x: torch.Tensor, send_sizes: list[int], recv_sizes: list[int], group) -> torch.Tensor:
    """Rows (dim 0) of x out to the ranks in pieces of ``send_sizes``, rows in from them in pieces of
    ``recv_sizes``: one all-to-all (no autograd: the callers' backward runs the reverse)."""
    out = x.new_empty((sum(recv_sizes), *x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), recv_sizes, send_sizes, group=group)
    return out


def _block_fwd(q, k, v, m: BlockSparseMask, scale):
    """The block kernel's (out, lse) over the pairs of m (q, k, v laid out (B, H, L, D), any strides)."""
    from ._routes import block_kernel

    return block_kernel(q, k, v, m, _args.scale(scale))


def _block_bwd(g, q, k, v, out, lse, gl, m: BlockSparseMask, scale):
    """(dq, dk, dv) of the pairs of m given the merged out and lse of the rows."""
    from ._routes import block_kernel_backward

    return block_kernel_backward(g, q, k, v, out, lse, gl, m, _args.scale(scale))


def _merge_partials(o: torch.Tensor, lse: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Partial outputs o (..., D) and their LSEs over the keys' parts along ``dim`` merged into one
    (fp32): the softmax-weighted sum; a row no part has a key for is 0 with LSE -inf."""
    top = lse.amax(dim, keepdim=True)
    top = torch.where(torch.isfinite(top), top, 0.0)
    w = torch.exp(lse - top)
    total = w.sum(dim, keepdim=True)
    some = total > 0
    safe = torch.where(some, total, 1.0)
    merged = ((w / safe).unsqueeze(-1) * o.float()).sum(dim)
    return merged, torch.where(some, top + torch.log(safe), -math.inf).squeeze(dim)


def _merge_rows(out, lse, rows, parts_o, parts_lse):
    """out / lse (B, H, L, D) / (B, H, L) of this rank's rows merged in place, at ``rows``, with
    partials over other keys (P, n, B, H, D) / (P, n, B, H) (sequence-major)."""
    o_all = torch.cat([out.index_select(2, rows).movedim(2, 0)[None].float(), parts_o.float()])
    lse_all = torch.cat([lse.index_select(2, rows).movedim(2, 0)[None], parts_lse])
    merged, merged_lse = _merge_partials(o_all, lse_all, 0)
    out.index_copy_(2, rows, merged.to(out.dtype).movedim(0, 2))
    lse.index_copy_(2, rows, merged_lse.movedim(0, 2))


def _split_rows(rows: BlockSparseMask, splits: int) -> BlockSparseMask:
    """Each row block of ``rows`` as ``splits`` consecutive row blocks, replica s keeping entries
    s, s + splits, ... of the list (ascending still): one long row's keys over several CTAs."""
    from .masks import BlockSparseMask

    cnt, idx, part = rows.kv_num_blocks, rows.kv_indices, rows.kv_partial
    e = torch.arange(idx.shape[-1], device=idx.device)
    keep = (e < cnt[..., None, None]) & (e % splits == torch.arange(splits, device=idx.device)[:, None])
    order = torch.where(keep, e, e + idx.shape[-1]).argsort(-1)[..., : -(-idx.shape[-1] // splits)]
    wide = (*idx.shape[:-1], splits, idx.shape[-1])
    new = idx.unsqueeze(-2).expand(wide).gather(-1, order)
    kept = keep.gather(-1, order)
    return BlockSparseMask._trusted(
        keep.sum(-1, dtype=torch.int32).flatten(2).contiguous(),
        torch.where(kept, new, 0).flatten(2, 3).contiguous(),
        part.unsqueeze(-2).expand(wide).gather(-1, order).flatten(2, 3).contiguous(),
        rows.partial_masks,
        (rows.seq_lengths[0] * splits, rows.seq_lengths[1]),
        rows.block_size,
    )


@dataclass(frozen=True)
class _Guests:
    """Rows of the mask that touch most of the other ranks' key blocks (a global token's row):
    their queries travel instead of the keys. Each rank sends the queries of its own such rows
    (``own_rows`` of its shard) to every other rank, attends the rows it receives to its own shard
    (``rows``: those query blocks, in rank order, against this shard's key blocks; each block's
    keys split over several CTAs, the splits merged here) and returns the partial outputs (fp32)
    and LSEs to their owners, who merge them into their own shard's partial in fp32.
    ``send_sizes`` / ``recv_sizes``: query rows per rank (this rank's piece empty both ways)."""

    own_rows: torch.Tensor  # (n,) int64, rows of this shard
    rows: BlockSparseMask  # the other ranks' such rows against this shard
    send_sizes: list[int]  # queries out (this rank's rows to every other rank)
    recv_sizes: list[int]  # queries in (the other ranks' rows)
    split_rows: dict = field(default_factory=dict)  # splits -> rows split that many ways (made once)

    def split(self, query) -> tuple[int, BlockSparseMask]:
        """How many ways each received row block's keys are split: about two CTAs per SM over the
        blocks and heads (64 on the CPU), at least two key blocks each."""
        blocks = self.rows.seq_lengths[0] // self.rows.q_block
        slots = 2 * torch.cuda.get_device_properties(query.device).multi_processor_count if query.is_cuda else 64
        want = -(-slots // max(1, blocks * query.shape[0] * query.shape[1]))
        splits = max(1, min(want, self.rows.kv_indices.shape[-1] // 2)) if blocks else 1
        if splits not in self.split_rows:
            self.split_rows[splits] = _split_rows(self.rows, splits) if splits > 1 else self.rows
        return splits, self.split_rows[splits]

    def out_to_others(self, x, group):
        """This rank's guest rows of x (sequence along dim 2) to every other rank: (rows in, ...)."""
        world = len(self.send_sizes)
        sent = x.movedim(2, 0).index_select(0, self.own_rows.repeat(world - 1))
        return _exchange(sent, self.send_sizes, self.recv_sizes, group)

    def back_to_owners(self, x, group):
        """Rows computed for the other ranks' guests back to them: (P - 1, own guest rows, ...)."""
        got = _exchange(x, self.recv_sizes, self.send_sizes, group)
        return got.unflatten(0, (len(self.send_sizes) - 1, self.own_rows.numel()))

    def replicate(self, x, splits):
        """Received rows (n, ...) as the split mask's rows: each query block ``splits`` times, then
        laid out (B, H, rows, ...)."""
        qb = self.rows.q_block
        return x.unflatten(0, (-1, 1, qb)).expand(-1, splits, -1, *x.shape[1:]).flatten(0, 2).movedim(0, 2)

    def fold(self, x, splits):
        """(B, H, rows * splits, ...) of the split mask back to (n blocks, splits, q_block, B, H, ...)."""
        return x.movedim(2, 0).unflatten(0, (-1, splits, self.rows.q_block))


@dataclass(frozen=True)
class _SparseExchange:
    """How one rank gets the K/V blocks its rows of a mask touch, for one schedule, and its rows of
    the mask renumbered to match (built once, kept with the mask: every call reuses their tensors
    and the block kernel's CTA schedule). ``"allgather"``: ``rows`` against every rank's shard,
    laid out rank by rank (``longest`` tokens each). ``"alltoall"``: the other ranks' key blocks
    its rows touch come in one all-to-all of K and one of V (``send_rows`` of this shard go out,
    ``send_sizes`` / ``recv_sizes`` rows per rank), in one of two forms: with ``edge``, ``rows``
    are against this rank's shard as the caller holds it (no copy) and ``edge`` holds the rows
    that touch received blocks (``edge_rows`` of this shard, at most _EDGE_SHARE of its query
    blocks) against those blocks alone, merged into their output by the LSEs; without, ``rows``
    are against this shard followed by the received blocks (one copy of the shard). ``guests``:
    the rows that touch most blocks."""

    rows: BlockSparseMask
    longest: int = 0  # allgather: tokens of the longest shard
    send_rows: torch.Tensor | None = None  # (n,) int64
    send_sizes: list[int] | None = None
    recv_sizes: list[int] | None = None
    edge_rows: torch.Tensor | None = None  # (n,) int64
    edge: BlockSparseMask | None = None
    guests: _Guests | None = None


class _SparseAllToAll(torch.autograd.Function):
    """The all-to-all schedule of a block-sparse mask on one rank: its rows against its own shard,
    the edge rows against the received key blocks, the guests' partials; every partial merged in
    place, in fp32, into the first call's output. Backward: each call's backward given the merged
    output and LSE (the softmax over all of a row's keys), the received blocks' K/V gradients and
    the guests' query gradients sent back to their owners."""

    @staticmethod
    def forward(ctx, q, k, v, ex: _SparseExchange, scale, group):
        # The guests' call (small) first, the big call, then the edge rows' call (small). Every
        # exchange completes before the big call starts or runs after it: an all-to-all left to
        # run under the big call raced its persistent CTAs for the SMs, and where it lost, a rank
        # that waits for it idled through the other rank's big call (Longformer forward at 128k
        # measured 5.2 ms in one run and 8.3 in another). Every rank issues the same collectives
        # in the same order: guest queries, K, V, guest outputs, guest LSEs.
        gs = ex.guests
        q_guest = gs.out_to_others(q, group) if gs is not None else None
        moves = (ex.send_rows, ex.send_sizes, ex.recv_sizes, group)
        if ex.edge is None:  # K and V: this shard followed by the received blocks, one call
            k_in, v_in = (_with_rows_of_others(x, *moves) for x in (k, v))
        else:  # this shard as it is; the received blocks for a second call over the edge rows
            k_in, v_in = (
                _exchange(x.movedim(2, 0).index_select(0, ex.send_rows), *moves[1:]).movedim(0, 2) for x in (k, v)
            )
        if gs is not None:
            splits, rows = gs.split(q)
            o_g, lse_g = _block_fwd(gs.replicate(q_guest, splits), k, v, rows, scale)
            o_g, lse_g = _merge_partials(gs.fold(o_g, splits), gs.fold(lse_g, splits), 1)
        if ex.edge is None:
            out, lse = _block_fwd(q, k_in, v_in, ex.rows, scale)
            q_edge = None
        else:
            out, lse = _block_fwd(q, k, v, ex.rows, scale)
            q_edge = q.index_select(2, ex.edge_rows)
            if ex.edge_rows.numel():
                o_e, lse_e = _block_fwd(q_edge, k_in, v_in, ex.edge, scale)
                _merge_rows(out, lse, ex.edge_rows, o_e.movedim(2, 0)[None], lse_e.movedim(2, 0)[None])
        if gs is not None:
            _merge_rows(out, lse, gs.own_rows, *(gs.back_to_owners(x.flatten(0, 1), group) for x in (o_g, lse_g)))
        ctx.save_for_backward(q, k, v, k_in, v_in, q_edge, q_guest, out, lse)
        ctx.ex, ctx.scale, ctx.group = ex, scale, group
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(ctx, g, gl):
        _meta.first_order()
        q, k, v, k_in, v_in, q_edge, q_guest, out, lse = ctx.saved_tensors
        ex, scale, group = ctx.ex, ctx.scale, ctx.group
        if g is None:
            g = torch.zeros_like(out)
        gs = ex.guests
        if gs is not None:
            # The guests' gradient, output and LSE (and the LSE's gradient: zeros when unused) out
            # to the ranks that hold their keys; their query gradients back after the big call.
            gl_all = torch.zeros_like(lse) if gl is None else gl
            g_in, o_in, lse_in, gl_in = (gs.out_to_others(x, group) for x in (g, out, lse, gl_all))
            splits, rows_g = gs.split(q)
            g_r, q_r, o_r, lse_r, gl_r = (gs.replicate(x, splits) for x in (g_in, q_guest, o_in, lse_in, gl_in))
            dq_g, dk_g, dv_g = _block_bwd(g_r, q_r, k, v, o_r, lse_r, gl_r, rows_g, scale)
            dq_g = gs.fold(dq_g, splits).sum(1).flatten(0, 1)
        moves = (ex.send_rows, ex.send_sizes, ex.recv_sizes, group)
        if ex.edge is None:
            dq, dk_in, dv_in = _block_bwd(g, q, k_in, v_in, out, lse, gl, ex.rows, scale)
            lr = k.shape[2]
            dk, dv = (_rows_back(d[:, :, :lr].clone(), d[:, :, lr:], *moves) for d in (dk_in, dv_in))
        else:
            dq, dk, dv = _block_bwd(g, q, k, v, out, lse, gl, ex.rows, scale)
            rows = ex.edge_rows
            if rows.numel():
                sub = [x.index_select(2, rows) for x in (g, out, lse)]
                gl_e = None if gl is None else gl.index_select(2, rows)
                dq_e, dk_in, dv_in = _block_bwd(sub[0], q_edge, k_in, v_in, sub[1], sub[2], gl_e, ex.edge, scale)
                dq.index_add_(2, rows, dq_e)
            else:
                dk_in, dv_in = torch.zeros_like(k_in), torch.zeros_like(v_in)
            dk, dv = (_rows_back(d, d_in, *moves) for d, d_in in ((dk, dk_in), (dv, dv_in)))
        if gs is not None:
            dk.add_(dk_g)
            dv.add_(dv_g)
            dq.index_add_(2, gs.own_rows, gs.back_to_owners(dq_g, group).sum(0).movedim(0, 2))
        return dq, dk, dv, None, None, None


def _owned_blocks(bounds, kv_block: int) -> list[list[int]]:
    """Each rank's key blocks, in its shard's order."""
    return [[j for off, n in chunks for j in range(off // kv_block, (off + n) // kv_block)] for chunks in bounds]


def _query_blocks(chunks, q_block: int) -> list[int]:
    """A rank's query blocks, in its shard's order."""
    return [j for off, n in chunks for j in range(off // q_block, -(-(off + n) // q_block))]


@dataclass(frozen=True)
class _Needs:
    """Read from the mask once on the host (cached on it) for a sharding: per rank, its guest query
    blocks (full blocks whose rows touch more than half of the other ranks' key blocks), the other
    ranks' key blocks its other rows touch, and the largest share of the others' blocks any rank's
    other rows need."""

    guests: list[list[int]]
    need: list[list[int]]
    busiest: float


_GUEST_SHARE = 0.5  # a query block whose rows touch more of the other ranks' key blocks is a guest
# More of a rank's query blocks touching received key blocks than this share: the received blocks
# join a copy of the shard (one call) instead of a second call for those rows and a merge.
_EDGE_SHARE = 0.25


def _needs(mask, bounds, kv_block: int) -> _Needs:
    cache = mask.__dict__.setdefault("_cp_needs", {})
    key = tuple(map(tuple, bounds))
    if key in cache:
        return cache[key]
    qb, nkb, seq_len = mask.q_block, mask.num_kv_blocks, mask.seq_lengths[0]
    counts, idx = mask.kv_num_blocks.cpu(), mask.kv_indices.cpu().long()
    owned = _owned_blocks(bounds, kv_block)
    guests, need, busiest = [], [], 0.0
    for r, chunks in enumerate(bounds):
        blocks = torch.tensor(_query_blocks(chunks, qb), dtype=torch.long)
        c, ix = counts[:, :, blocks], idx[:, :, blocks]
        live = torch.arange(ix.shape[-1])[None, None, None, :] < c[..., None]
        # touched[i, j]: some row of query block blocks[i] (any batch element or head) sees key block j
        touched = torch.zeros(len(blocks), nkb, dtype=torch.bool)
        rows = torch.arange(len(blocks))[None, None, :, None].expand_as(ix)
        touched[rows[live], ix[live]] = True
        foreign = touched.clone()
        foreign[:, owned[r]] = False
        n_foreign = max(1, nkb - len(owned[r]))
        full = (blocks + 1) * qb <= seq_len
        guest = full & (foreign.sum(1) > _GUEST_SHARE * n_foreign)
        guests.append(blocks[guest].tolist())
        mine = foreign[~guest].any(0).nonzero().flatten().tolist()
        need.append(mine)
        busiest = max(busiest, len(mine) / n_foreign)
    cache[key] = _Needs(guests, need, busiest)
    return cache[key]


def _sparse_method(needs: _Needs) -> str:
    """The schedule method=None takes: the all-to-all unless some rank's rows (guests aside) need
    more than half of the other ranks' key blocks."""
    return "allgather" if needs.busiest > 0.5 else "alltoall"


def _shard_rows(chunks, q_blocks: list[int], q_block: int, seq_len: int) -> torch.Tensor:
    """Rows of a rank's shard holding its query blocks ``q_blocks``, in order (the sequence's last
    block may be short)."""
    at = {}
    for off, start, n in _local_chunks(chunks):
        for j in range(off // q_block, -(-(off + n) // q_block)):
            at[j] = start + j * q_block - off
    rows = [torch.arange(at[j], at[j] + min(q_block, seq_len - j * q_block)) for j in q_blocks]
    return torch.cat(rows) if rows else torch.zeros(0, dtype=torch.long)


def _sparse_exchange(mask, bounds, rank: int, method: str, dev) -> _SparseExchange:
    """The exchange of ``method`` for this rank (cached on the mask: masks are not modified)."""
    kb, qb, seq_len = mask.kv_block, mask.q_block, mask.seq_lengths[0]
    key = (tuple(map(tuple, bounds)), rank, method)
    cache = mask.__dict__.setdefault("_cp_exchange", {})
    if key in cache:
        return cache[key]
    world = len(bounds)
    owned = _owned_blocks(bounds, kb)
    lengths = [sum(n for _, n in chunks) for chunks in bounds]
    mine = _query_blocks(bounds[rank], qb)

    def layout(order: list[int]) -> torch.Tensor:  # the position of each global key block in a K/V tensor
        compact = torch.full((mask.num_kv_blocks,), -1, dtype=torch.int32)
        compact[torch.tensor(order, dtype=torch.long)] = torch.arange(len(order), dtype=torch.int32)
        return compact.to(dev)

    if method == "allgather":
        longest = max(lengths)
        compact = torch.full((mask.num_kv_blocks,), -1, dtype=torch.int32)
        for r in range(world):
            at = torch.arange(len(owned[r]), dtype=torch.int32) + r * (longest // kb)
            compact[torch.tensor(owned[r], dtype=torch.long)] = at
        ex = _SparseExchange(_rows_of(mask, mine, compact.to(dev), world * longest), longest=longest)
        cache[key] = ex
        return ex
    needs = _needs(mask, bounds, kb)
    need = needs.need
    owner_of = {j: r for r in range(world) for j in owned[r]}
    send = [[j for j in need[r] if owner_of[j] == rank] for r in range(world)]
    recv = [j for s in range(world) for j in need[rank] if owner_of[j] == s]
    first = {j: i * kb for i, j in enumerate(owned[rank])}  # a block of this shard -> its first row
    firsts = torch.tensor([first[j] for r in range(world) for j in send[r]], dtype=torch.long)
    own_layout, recv_layout = layout(owned[rank]), layout(recv)
    guest_set = set(needs.guests[rank])
    edge = _edge_blocks(mask, mine, recv, guest_set)
    if len(edge) > _EDGE_SHARE * len(mine):
        # Most rows touch received blocks (global key blocks, random blocks): one call against K
        # and V laid out as this shard followed by the blocks received (a copy of the shard), the
        # guest rows' lists cut to this shard's blocks.
        full = layout(owned[rank] + recv)
        which = torch.tensor([int(j in guest_set) for j in mine], dtype=torch.long, device=dev)
        rows = _rows_of(mask, mine, torch.stack([full, own_layout]), lengths[rank] + len(recv) * kb, which)
        edge_rows, edge_mask = None, None
    else:
        rows = _rows_of(mask, mine, own_layout, lengths[rank])
        edge_rows = _shard_rows(bounds[rank], edge, qb, seq_len).to(dev)
        edge_mask = _rows_of(mask, edge, recv_layout, len(recv) * kb)
    guests = None
    if any(needs.guests):
        others = [j for s in range(world) if s != rank for j in needs.guests[s]]
        n_guest = [len(g) * qb for g in needs.guests]
        guests = _Guests(
            own_rows=_shard_rows(bounds[rank], needs.guests[rank], qb, seq_len).to(dev),
            rows=_rows_of(mask, others, own_layout, lengths[rank]),
            send_sizes=[0 if s == rank else n_guest[rank] for s in range(world)],
            recv_sizes=[0 if s == rank else n_guest[s] for s in range(world)],
        )
    ex = _SparseExchange(
        rows,
        send_rows=(firsts[:, None] + torch.arange(kb)).flatten().to(dev),
        send_sizes=[len(send[r]) * kb for r in range(world)],
        recv_sizes=[sum(owner_of[j] == s for j in recv) * kb for s in range(world)],
        edge_rows=edge_rows,
        edge=edge_mask,
        guests=guests,
    )
    cache[key] = ex
    return ex


def _edge_blocks(mask, mine: list[int], recv: list[int], guests: set[int]) -> list[int]:
    """This rank's query blocks ``mine`` (not guests) whose lists hold a received key block."""
    if not recv:
        return []
    cnt = mask.kv_num_blocks.cpu()[:, :, mine]
    idx = mask.kv_indices.cpu()[:, :, mine].long()
    live = torch.arange(idx.shape[-1]) < cnt[..., None]
    hit = (live & torch.isin(idx, torch.tensor(recv))).flatten(0, 1).any(0).any(-1)
    return [j for j, h in zip(mine, hit.tolist(), strict=True) if h and j not in guests]


def _rows_of(mask, q_blocks: list[int], compact: torch.Tensor, length: int, which: torch.Tensor | None = None):
    """Query blocks ``q_blocks`` of the mask (in that order) against a K/V tensor of ``length``
    tokens laid out as ``compact`` says (the position of each global key block in it, -1: not
    there; with ``which``, row block i takes layout ``compact[which[i]]``): key blocks renumbered,
    those not there dropped, each row's list re-sorted ascending with its partial-mask entries
    moved along. Rows: the blocks' rows (the sequence's last block may be short)."""
    from .masks import BlockSparseMask

    blocks = torch.tensor(q_blocks, dtype=torch.long, device=mask.kv_indices.device)
    cnt = mask.kv_num_blocks.index_select(2, blocks)
    idx = mask.kv_indices.index_select(2, blocks).long()
    part = mask.kv_partial.index_select(2, blocks)
    new = compact[idx] if which is None else compact.flatten()[which[:, None] * compact.shape[1] + idx]
    live = (torch.arange(idx.shape[-1], device=idx.device) < cnt[..., None]) & (new >= 0)
    big = torch.iinfo(torch.int32).max
    new, order = torch.where(live, new, big).sort(-1)
    part = part.gather(-1, order)
    new = torch.where(new == big, 0, new).to(torch.int32)
    qb, lq = mask.q_block, mask.seq_lengths[0]
    rows = sum(min(qb, lq - j * qb) for j in q_blocks)
    return BlockSparseMask._trusted(
        live.sum(-1, dtype=torch.int32).contiguous(),
        new.contiguous(),
        part.contiguous(),
        mask.partial_masks,
        (rows, length),
        mask.block_size,
    )


@_with_dtensors
def context_parallel_block_sparse_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask,
    *,
    group=None,
    scale: float | None = None,
    layout: str = "zigzag",
    method: str | None = None,
    return_lse: bool = False,
    validate: bool = True,
):
    """``block_sparse_attention`` under a global ``mask`` (a ``BlockSparseMask`` of the whole
    sequence, the same on every rank) over a sequence sharded across ``group``. Each rank computes
    only its query chunks' rows of the mask. ``method="alltoall"``: each rank receives only the key
    blocks its rows touch (one all-to-all of K and one of V, differentiable): communication
    proportional to the blocks touched. Where few rows touch received blocks (a band: the rows next
    to a chunk's ends) one kernel call runs all of this rank's rows against its shard in place and a
    second one those rows against the received blocks, the two merged by their LSEs in fp32 (no
    copy of K or V); otherwise one call runs against this shard followed by the received blocks.
    The queries of rows that touch more than half of the other ranks' blocks (global tokens' rows)
    travel instead of the keys: each rank attends them to its own shard (their keys split over
    several CTAs) and sends the partial outputs back to be merged in fp32 (three more all-to-alls, of
    a few rows each). ``"allgather"``: K and V gathered whole, cheaper in copies when the other rows
    of some rank need most blocks anyway. None: all-to-all unless some rank's other rows need more
    than half of the others' blocks. Which blocks go where, and this rank's rows of the mask
    renumbered to match, are made on the host once and kept with the mask (a mask is not modified).
    The backward runs the same calls' backward passes given the merged output and LSE, the K/V
    gradients of received blocks and the guests' query gradients going back to their owners.
    The chunks of ``layout`` must start at multiples of the mask's blocks and L be a multiple of
    the key block (e.g. L a multiple of 2P * 128 for the zigzag layout and 128-token blocks).
    ``validate`` (default True): the ranks' arguments checked against each other first, as in
    :func:`context_parallel_attention`, the mask by a digest of its lists (taken once per mask, on
    the host); False skips the check and its host synchronisation.

    Returns this rank's output shard (B, H, L_r, Dv), or (out, lse).
    """
    from .masks import BlockSparseMask
    from .ops import block_sparse_attention

    rank, world = _group_info(group)
    failed, fields = None, {}
    try:  # this rank's checks; their error is raised after the ranks agree (_agree)
        if not isinstance(mask, BlockSparseMask):
            raise TypeError(f"mask must be a BlockSparseMask of the whole sequence, got {type(mask).__name__}")
        _args.check_inputs(query, key, value)
        seq_len = mask.seq_lengths[1]
        if mask.seq_lengths[0] != seq_len:
            raise ValueError(f"the mask must be square over the whole sequence, got seq_lengths={mask.seq_lengths}")
        bounds = chunk_bounds(seq_len, world, layout)
        mine = sum(n for _, n in bounds[rank])
        if query.shape[2] != mine or key.shape[2] != mine:
            raise ValueError(
                f"rank {rank}'s shards have {query.shape[2]} / {key.shape[2]} tokens; the {layout} layout of the "
                f"mask's {seq_len} tokens over {world} ranks gives it {mine}"
            )
        starts = [off for chunks in bounds for off, _ in chunks]
        if any(off % max(mask.block_size) for off in starts):
            raise ValueError(
                f"every chunk must start at a multiple of the mask's blocks ({max(mask.block_size)}): "
                f"the {layout} layout of {seq_len} tokens over {world} ranks starts chunks at {sorted(starts)}"
            )
        kb = mask.kv_block
        if seq_len % kb:
            raise ValueError(f"the sequence length ({seq_len}) must be a multiple of the mask's key block ({kb})")
        if method not in (None, "alltoall", "allgather"):
            raise ValueError(f"method must be None, 'alltoall' or 'allgather', got {method!r}")
        scale = _args.scale(scale)
        if validate:
            fields = _call_fields(
                query, key, value, mask=_mask_fingerprint(mask), scale=scale, layout=layout, method=method
            )
    except Exception as error:  # noqa: BLE001  (raised below, on every rank)
        failed = error
    if validate:
        _agree(group, rank, world, (query, key, value), 0, fields, failed)
    elif failed is not None:
        raise failed
    if method is None:
        method = _sparse_method(_needs(mask, bounds, kb))
    # One call over all of this rank's rows: K and V laid out as the exchange says (this shard,
    # then the blocks received; or every shard), the mask's rows renumbered to that layout. Rows
    # that touch most of the sequence (all-to-all) see only this shard there; their queries go to
    # the other ranks, whose partials come back and are merged in.
    ex = _sparse_exchange(mask, bounds, rank, method, query.device)
    if method == "allgather":
        k_all, v_all = (_AllShards.apply(x, ex.longest, group, 2) for x in (key, value))
        out, lse = block_sparse_attention(query, k_all, v_all, ex.rows, scale=scale, return_lse=True)
    else:
        out, lse = _SparseAllToAll.apply(query, key, value, ex, scale, group)
    return (out, lse) if return_lse else out


@dataclass(frozen=True)
class BlockSparseContextParallelPlan:
    """What ``context_parallel_block_sparse_attention`` does on one rank for a mask (see its
    docstring): the schedule, the all-to-all's form, and the blocks behind them."""

    method: str  # "alltoall" or "allgather"
    form: str  # alltoall: "in place" (K/V read as held, a second call for the edge rows) or "copy"
    received_blocks: int  # key blocks this rank receives (alltoall) or gathers (allgather)
    edge_blocks: int  # alltoall, in place: query blocks merged from a second call
    guest_blocks: int  # this rank's query blocks whose queries travel to the other ranks
    guest_blocks_in: int  # the other ranks' such blocks this rank attends to its shard
    why: str

    def __str__(self) -> str:
        form = f", {self.form}" if self.form else ""
        return (
            f"context_parallel_block_sparse_attention: {self.method}{form}; receives {self.received_blocks} key blocks"
            f", {self.edge_blocks} edge query blocks, {self.guest_blocks} guest query blocks out, "
            f"{self.guest_blocks_in} in\n  why: {self.why}"
        )


def plan_context_parallel_block_sparse(
    mask, world: int, rank: int = 0, *, layout: str = "zigzag", method: str | None = None
) -> BlockSparseContextParallelPlan:
    """The schedule ``context_parallel_block_sparse_attention`` takes on ``rank`` of ``world`` for
    a global ``mask``, and why (read from the mask on the host; no process group needed)."""
    if method not in (None, "alltoall", "allgather"):
        raise ValueError(f"method must be None, 'alltoall' or 'allgather', got {method!r}")
    if not 0 <= rank < world:
        raise ValueError(f"rank must be in [0, world), got rank={rank}, world={world}")
    bounds = chunk_bounds(mask.seq_lengths[1], world, layout)
    kb = mask.kv_block
    needs = _needs(mask, bounds, kb)
    chosen = method or _sparse_method(needs)
    forced = "forced by method=; " if method else ""
    if chosen == "allgather":
        n = mask.num_kv_blocks - len(_owned_blocks(bounds, kb)[rank])
        why = (
            f"{forced}the busiest rank's rows need {needs.busiest:.0%} of the other ranks' key blocks: "
            "K and V gathered whole"
        )
        return BlockSparseContextParallelPlan("allgather", "", n, 0, 0, 0, why)
    mine = _query_blocks(bounds[rank], mask.q_block)
    guests = set(needs.guests[rank])
    edge = _edge_blocks(mask, mine, needs.need[rank], guests)
    in_place = len(edge) <= _EDGE_SHARE * len(mine)
    guests_in = sum(len(g) for r, g in enumerate(needs.guests) if r != rank)
    why = (
        f"{forced}the busiest rank's rows need {needs.busiest:.0%} of the other ranks' key blocks: only those travel; "
        + (
            f"{len(edge)} of {len(mine)} query blocks touch them: K/V read in place, a second call for those rows"
            if in_place
            else f"{len(edge)} of {len(mine)} query blocks touch them: one call on K/V copied with the received blocks"
        )
        + (f"; {len(guests)} query blocks touch most of the sequence: their queries travel" if guests else "")
    )
    return BlockSparseContextParallelPlan(
        "alltoall",
        "in place" if in_place else "copy",
        len(needs.need[rank]),
        len(edge) if in_place else 0,
        len(guests),
        guests_in,
        why,
    )


# ---------------------------------------------------------------------------------------- explain
def _assumed_seq_len(local: int, world: int, rank: int, layout: str) -> int:
    """A sequence length whose ``layout`` gives ``rank`` a shard of ``local`` tokens (explain takes
    no collective, so it cannot sum the shards as the op does when ``seq_len`` is not given; the
    ranks' shards of a few lengths have one size, so pass ``seq_len`` for exact counts)."""
    even = local * world  # first the even split, where every rank of either layout holds `local`
    for n in (even, *range(max(0, (local - 1) * world), (local + 1) * world + 1)):
        if sum(c for _, c in chunk_bounds(n, world, layout)[rank]) == local:
            return n
    return local * world


def _explain(name: str, args, kwargs, tgt):
    """sparse_attn.explain for the context-parallel ops: this rank's schedule, why, and its launches
    (a group of similar calls as one launch with a count, planned on the first of them), for the
    arguments as the call would pass them (DTensors, a DeviceMesh group). Reads the process group's
    rank and size; no collective, no kernel."""
    from ._plan import Launch, Plan, _backward, _backward_launches, _flash_launch, _launch

    signature = inspect.signature(globals()[name])
    given = dict(signature.bind(*args, **kwargs).arguments)
    q, k, v, given, _ = _local_call(given.pop("query"), given.pop("key"), given.pop("value"), given)
    bound = signature.bind(q, k, v, **given)
    bound.apply_defaults()
    a = bound.arguments
    rank, world = _group_info(a["group"])
    _args.check_inputs(q, k, v)
    if name == "context_parallel_topk_attention":
        why = (
            "selection against every key of the sequence (the indexer's keys gathered, a few bytes per token; the "
            "exact mode gathers K), then the K/V rows the selections name fetched from their owners by an "
            "all-to-all, or K/V gathered whole where some rank needs more than half of the other ranks' rows "
            "(decided at run time from the selection, one all-reduce of the counts)"
        )
        return Plan(name, "context_parallel_topk", why, ())
    if name == "context_parallel_block_sparse_attention":
        from .masks import BlockSparseMask

        if not isinstance(a["mask"], BlockSparseMask):
            raise TypeError(f"mask must be a BlockSparseMask of the whole sequence, got {type(a['mask']).__name__}")
        plan = plan_context_parallel_block_sparse(a["mask"], world, rank, layout=a["layout"], method=a["method"])
        blocks = a["mask"].block_size
        launches = [
            _launch("block_sparse_fwd", _ops._plan_block_sparse.default(q, k, v, *blocks, *tgt), 1, "this rank's rows")
        ]
        if plan.edge_blocks:
            launches.append(
                replace(launches[0], role=f"{plan.edge_blocks} edge query blocks against the received key blocks")
            )
        if plan.guest_blocks_in:
            launches.append(replace(launches[0], role=f"{plan.guest_blocks_in} other ranks' guest query blocks"))
        backward = (
            "block_sparse_bwd of each call given the merged output and LSE; the received blocks' K/V gradients "
            "back to their owners"
        )
        return Plan(name, f"context_parallel_{plan.method}", plan.why, tuple(launches), backward)
    layout, causal = a["layout"], bool(a["causal"])
    seq_len = a["seq_len"]
    assumed = "" if seq_len is not None else " (seq_len not given: assumed from this shard's length)"
    if seq_len is None:
        seq_len = _assumed_seq_len(q.shape[2], world, rank, layout)
    bounds = chunk_bounds(seq_len, world, layout)
    left, right = _args.window_bounds(a["window"])
    plan = plan_context_parallel(
        causal, a["window"], layout=layout, method=a["method"], heads=(q.shape[1], k.shape[1]), world=world
    )
    why = plan.why + assumed
    if plan.method == "allgather":
        right = 0 if causal else right
        launches = []
        for qs, lq, end, w_left, w_right in _allgather_calls(bounds[rank], seq_len, left, right):
            k_all, v_all = (x[:, :, :1].expand(*x.shape[:2], end, x.shape[3]) for x in (k, v))  # the gathered shape
            launches.append(
                _flash_launch(
                    q[:, :, qs : qs + lq],
                    k_all,
                    v_all,
                    False,
                    w_left,
                    w_right,
                    tgt,
                    role=f"this shard's rows {qs}-{qs + lq - 1}",
                )
            )
        bwd = _backward_launches(launches)
        backward = _backward("flash_bwd", bwd) + "; K/V gradients reduced to their owners"
        return Plan(name, "context_parallel_allgather", why, tuple(launches), backward, bwd)
    shards = [_local_chunks(chunks) for chunks in bounds]
    if plan.method == "ring":
        pairs = [
            (qs, lq, ks, pair)
            for src in range(world)
            for ko, ks, lk in shards[src]
            for qo, qs, lq in shards[rank]
            if (pair := _pair(qo, lq, ko, lk, causal)) is not None
        ]
        if not pairs:  # an empty shard
            return Plan(name, "context_parallel_ring", why, (), "the ring")
        qs, lq, ks, (keep, r) = pairs[0]
        launch = _flash_launch(
            q[:, :, qs : qs + lq],
            k[:, :, ks : ks + keep],
            v[:, :, ks : ks + keep],
            False,
            -1,
            r,
            tgt,
            len(pairs),
            "pairs of chunks, over the ring's steps",
        )
        backward = "the ring: flash_bwd per pair of chunks, K/V and their fp32 gradients travelling"
        return Plan(name, "context_parallel_ring", why, (launch,), backward)
    own = _flash_launch(q, k, v, causal, -1, -1, tgt, role="this rank's shard against its own K/V")
    slices = _slices(bounds, causal)
    guests = [
        (sl[2], call)
        for p in range(world)
        if p != rank
        for sl in slices[p]
        if (call := _shard_call(sl[0], sl[2], shards[rank], causal)) is not None
    ]
    launches = [own]
    if guests:
        n, (keys, r) = guests[0]
        launches.append(
            _flash_launch(
                q[:, :, :n],
                k[:, :, :keys],
                v[:, :, :keys],
                False,
                -1,
                r,
                tgt,
                len(guests),
                "other ranks' query slices against this K/V",
            )
        )
    merges = len(slices[rank])
    if merges:
        core = "cuda_cores" if q.is_cuda or tgt[0] > 0 else "cpu"
        launches.append(
            Launch(
                "merge_partial",
                core,
                why=("a slice's partials merged by their LSEs in fp32, rounded once",),
                count=merges,
                role="this rank's slices",
            )
        )
    bwd = _backward_launches(launches)
    backward = (
        _backward("flash_bwd", bwd)
        + f"; the query slices' exchange in {_BACKWARD_SLICES} rounds, dK/dV accumulated in fp32 by their owner, "
        "dQ returned"
    )
    return Plan(name, "context_parallel_queries", why, tuple(launches), backward, bwd)


# -------------------------------------------------------------------------------------------- top-k
def _owners(bounds, seq_len: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(L,) owner rank and (L,) row in the owner's shard of every position of the sequence."""
    owner = torch.empty(seq_len, dtype=torch.int64, device=device)  # made where used: no L-long copies
    row = torch.empty(seq_len, dtype=torch.int64, device=device)
    for r, chunks in enumerate(bounds):
        for off, at, n in _local_chunks(chunks):
            owner[off : off + n] = r
            row[off : off + n] = torch.arange(at, at + n, device=device)
    return owner, row


def _fetch_rows(needed: torch.Tensor, owner, row, rank: int, world: int, group):
    """The rows of other ranks' shards at global positions ``needed`` (ascending, none of them this
    rank's): which rows each rank sends whom (one all-to-all of counts, one of row numbers), as
    (rows of this shard to send, send sizes, receive sizes, positions received in order)."""
    dev = needed.device
    src = owner[needed]
    need_counts = torch.bincount(src, minlength=world)
    recv_sizes = need_counts.tolist()
    send_counts = torch.empty_like(need_counts)
    dist.all_to_all_single(send_counts, need_counts, group=group)
    send_sizes = send_counts.tolist()
    order = torch.argsort(src, stable=True)
    wanted = row[needed[order]]  # rows in their owners' shards, grouped by owner
    to_send = torch.empty(sum(send_sizes), dtype=torch.int64, device=dev)
    dist.all_to_all_single(to_send, wanted, send_sizes, recv_sizes, group=group)
    return to_send, send_sizes, recv_sizes, needed[order]


@_with_dtensors
def context_parallel_topk_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    k: int,
    *,
    group=None,
    causal: bool = False,
    scale: float | None = None,
    index_query: torch.Tensor | None = None,
    index_key: torch.Tensor | None = None,
    index_weights: torch.Tensor | None = None,
    layout: str = "zigzag",
    method: str | None = None,
    return_lse: bool = False,
    return_indices: bool = False,
):
    """``topk_attention`` (token mode, exact per head or with the lightning indexer) over a sequence
    sharded along its length across ``group``: each query selects among the keys of the whole
    sequence, as on one GPU.

    Selection needs every key's score: the exact mode gathers K whole (and V: the attention then
    reads them in place), the indexer only ``index_key`` (B, L_r, DI) shards, a few bytes per
    token. Then each rank fetches the K/V rows its selections name from the ranks that hold them
    (``method="alltoall"``: one all-to-all of row numbers, one of K, one of V; differentiable, the
    K/V gradients going back to their owners), or K/V whole (``"allgather"``). None: the
    all-to-all unless some rank needs more than half of the other ranks' rows (the same decision on
    every rank: one all-reduce of the counts). The exact mode always takes the all-gather (its K is
    whole already). Before any exchange the ranks' arguments are checked against each other (as
    ``validate`` does in :func:`context_parallel_attention`; here always: its all-gather sums the
    shards' lengths).

    Parameters
    ----------
    query, key, value : Tensor
        This rank's shards, as in :func:`context_parallel_attention`.
    k, causal, scale, index_query, index_key, index_weights
        As ``topk_attention`` (``index_query`` / ``index_weights`` this rank's (B, L_r, ...) shards
        of the sequence, ``index_key`` too).
    layout : {"zigzag", "contiguous"}
    method : {None, "alltoall", "allgather"}
    return_lse, return_indices
        Also return this rank's LSE shard and its selection (global key positions, as
        ``topk_attention`` returns them for the whole sequence).

    Returns
    -------
    out, or a tuple in the order (out, lse, indices) keeping the parts asked for.
    """
    from .ops import _attend_selection, _result

    rank, world = _group_info(group)
    failed, fields = None, {}
    indexer = [t is not None for t in (index_query, index_key, index_weights)]
    try:  # this rank's checks; their error is raised after the ranks agree (_agree)
        _args.check_inputs(query, key, value)
        if isinstance(k, bool) or not isinstance(k, int) or k <= 0:
            raise ValueError(f"k must be a positive int, got {k!r}")
        if method not in (None, "alltoall", "allgather"):
            raise ValueError(f"method must be None, 'alltoall' or 'allgather', got {method!r}")
        if any(indexer) and not all(indexer):
            raise ValueError("index_query, index_key and index_weights must be given together")
        if key.shape[2] != query.shape[2]:
            raise ValueError(f"query and key shards must have the same length, got {query.shape[2]} and {key.shape[2]}")
        index_shapes = None
        if all(indexer):  # the indexer's shards: this rank's tokens too ((B, L_r, HI, DI), (B, L_r, DI), (B, L_r, HI))
            for name, t in (("index_query", index_query), ("index_key", index_key), ("index_weights", index_weights)):
                if not isinstance(t, torch.Tensor) or t.dim() < 2 or t.shape[1] != query.shape[2]:
                    got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
                    raise ValueError(f"{name} must hold this rank's {query.shape[2]} tokens in dim 1, got {got}")
            index_shapes = tuple((t.shape[2:], t.dtype) for t in (index_query, index_key, index_weights))
        scale = _args.scale(scale)
        fields = _call_fields(
            query,
            key,
            value,
            k=k,
            causal=bool(causal),
            scale=scale,
            layout=layout,
            method=method,
            **{"the indexer's shapes but B and L, and dtypes (None: exact scores)": index_shapes},
        )
    except Exception as error:  # noqa: BLE001  (raised below, on every rank)
        failed = error
    lengths = _agree(group, rank, world, (query, key, value), 0 if failed else query.shape[2], fields, failed)
    seq_len = sum(lengths)
    bounds = _shard_lengths_fit(lengths, seq_len, layout)

    # 1. Selection, per local chunk [qo, qo + lq) against the keys [0, end) it may see (bottom-right
    #    alignment of lq queries on the prefix puts query i at position qo + i).
    chunks = _local_chunks(bounds[rank])
    ends = [qo + lq if causal else seq_len for qo, _, lq in chunks]
    k_all = v_all = None
    with torch.no_grad():
        if all(indexer):
            ik_all = _gather(index_key, bounds, group, 1)
            picks = [
                _ops.indexer_select.default(
                    index_query[:, qs : qs + lq], ik_all[:, :end], index_weights[:, qs : qs + lq], k, causal
                )
                for (qo, qs, lq), end in zip(chunks, ends, strict=True)
            ]
            del ik_all
    if not all(indexer):  # the scores need every key: K (and V, read by most selections) gathered whole
        k_all, v_all = _gather(key, bounds, group, 2), _gather(value, bounds, group, 2)
        with torch.no_grad():
            picks = [
                _ops.topk_select.default(query[:, :, qs : qs + lq].detach(), k_all[:, :, :end].detach(), k, causal)
                for (qo, qs, lq), end in zip(chunks, ends, strict=True)
            ]
    kk = min(k, seq_len)  # the width topk_attention gives on the whole sequence
    picks = [torch.nn.functional.pad(p, (0, kk - p.shape[-1]), value=-1) for p in picks]
    indices = torch.cat(picks, dim=2)  # (B, G, L_r, kk) global key positions, -1 padded

    # 2. The K/V rows the selections name: this rank's own, the rest fetched (or everything gathered).
    owner, row = _owners(bounds, seq_len, query.device)
    named = torch.zeros(seq_len + 1, dtype=torch.bool, device=query.device)  # the last slot: -1 entries
    named[torch.where(indices >= 0, indices, seq_len).flatten()] = True  # int32 indices: no int64 copy
    needed = (named[:seq_len] & (owner != rank)).nonzero().flatten()
    counts = torch.zeros(world, dtype=torch.int64, device=query.device)
    counts[rank] = needed.numel()
    dist.all_reduce(counts, group=group)
    others = [seq_len - sum(n for _, n in bounds[r]) for r in range(world)]
    busiest = max(int(c) / max(1, o) for c, o in zip(counts.tolist(), others, strict=True))
    if k_all is not None or method == "allgather" or (method is None and busiest > 0.5):
        if k_all is None:
            k_all, v_all = _gather(key, bounds, group, 2), _gather(value, bounds, group, 2)
        position = indices  # global positions index the gathered K/V directly
    else:
        to_send, send_sizes, recv_sizes, got_pos = _fetch_rows(needed, owner, row, rank, world, group)

        k_all, v_all = (_WithRowsOfOthers.apply(x, to_send, send_sizes, recv_sizes, group) for x in (key, value))
        # Compact position of every global position this rank now holds: its shard's rows, then the
        # received rows in arrival order.
        compact = torch.full((seq_len,), -1, dtype=torch.int64, device=query.device)
        mine = owner == rank
        compact[mine] = row[mine]
        compact[got_pos] = query.shape[2] + torch.arange(got_pos.numel(), device=query.device)
        compact = torch.cat([compact, compact.new_full((1,), -1)]).to(torch.int32)  # -1 entries stay -1
        flat = torch.where(indices >= 0, indices, seq_len).flatten()
        position = compact.index_select(0, flat).view(indices.shape)

    # 3. Attention over the named rows, by the route topk_attention would take for its own
    #    selection (distinct keys per row; no causal test: the selection is causal already).
    out, lse = _attend_selection(query, k_all, v_all, position.contiguous(), scale, kk, False)
    return _result(out, lse, indices, return_lse, return_indices)
