"""The plan of a call: the route it takes (decided here, once per call, by one function per op)
and, for each kernel launch of the route, the core, tile, schedule and options (decided in C++ by
csrc/plan/plan.cpp and reported by the ``sparse_attn::_plan_*`` ops). :func:`explain` puts both
together without running anything; :func:`overrides` sets the C++ plan's test and benchmark
overrides."""

from __future__ import annotations

import contextlib
import inspect
from dataclasses import dataclass, field, replace

import torch

from . import _args, _meta
from .masks import BlockSparseMask

__all__ = ["Launch", "Plan", "Route", "explain", "overrides"]

_ops = torch.ops.sparse_attn


# ------------------------------------------------------------------------------------ routes
@dataclass(frozen=True)
class Route:
    """What a call runs as: ``kind`` with its parameters ``args``, and why."""

    kind: str
    args: tuple = ()
    why: str = ""


def block_sparse_route(mask: BlockSparseMask, key: torch.Tensor, value: torch.Tensor, causal: bool = False) -> Route:
    """A mask exactly as a pattern built it runs as that pattern's attention (masks.ExactForm);
    any other mask through the block-sparse kernel (with causal=True: the mask intersected with
    the causal pattern). (With a value that does not match the key the kernel's checks report
    it.)"""
    form = mask.exact_form
    if form is not None and causal and form.kind in ("dilated", "dilated_2d"):
        form = None  # no exact form of their causal half: the block kernel on the intersection
    if form is not None and value.dim() == 4 and value.shape[-2] == key.shape[-2]:
        if form.kind == "window" and causal:
            return Route(
                "flash_window",
                (form.a, 0),
                f"the mask is patterns.sliding_window's, causal: flash_attention(window=({form.a}, 0)), no block lists",
            )
        if form.kind == "causal":
            return Route(
                "flash_causal", (), "the mask is patterns.causal's: flash_attention(causal=True), no block lists"
            )
        if form.kind == "window":
            return Route(
                "flash_window",
                (form.a, form.b),
                f"the mask is patterns.sliding_window's: flash_attention(window=({form.a}, {form.b})), no block lists",
            )
        if form.kind == "dilated":
            return Route(
                "dilated",
                (form.a, form.b),
                f"the mask is patterns.dilated's: one sliding window per residue class mod {form.b} "
                "(strided views, no masked pairs)",
            )
        return Route(
            "dilated_2d",
            (form.a, form.b),
            f"the mask is patterns.dilated_2d's: dense attention over the positions of each segment of {form.a} "
            f"that are multiples of {form.b} (no masked pairs)",
        )
    why = "a block mask" + (" intersected with causal (made once per mask)" if causal else "")
    why += ": the block-sparse kernel over its lists (full blocks unmasked, partial blocks bit-masked)"
    return Route("block_kernel", (mask.q_block, mask.kv_block), why)


def topk_route(block_size: int | None, indexer: bool) -> Route:
    if block_size is not None:
        return Route(
            "block_topk",
            (block_size,),
            "block mode: top-k key blocks per query block by a bound of q.k over each block (Quest), the diagonal "
            "and sink blocks kept under causal, then the block-sparse kernel",
        )
    if indexer:
        return Route(
            "indexer_topk",
            (),
            "token mode with the lightning indexer: one index set per token for every head",
        )
    return Route("token_topk", (), "token mode: the k largest q.k per query head among visible keys")


def _sum_clamped(n: int, start: int, lo: int, hi: int) -> int:
    """sum over i < n of min(max(start + i, lo), hi), for lo <= hi (closed form: per call, no loop)."""
    a = min(n, max(0, lo - start))  # rows clamped to lo
    e = min(n, max(a, hi - start))  # rows before the first clamped to hi
    return a * lo + (e - a) * start + (a + e - 1) * (e - a) // 2 + (n - e) * hi


# The selection cost model's rates (measured: docs/PERF_LOG.md, "top-k's masked-block route").
# CUDA (H100): gathered rows stream at about the L2's random-row bandwidth (bytes/s); the block
# kernel computes pairs at about dense attention's rate (FLOP/s), a partial block taking
# _PARTIAL_COST times a full one's time; the mask's build moves the indices once and its words
# about four times at _CUDA_MASK_BYTES_PER_S, and takes at least one CTA's pass over a query
# block's entries (_CUDA_MASK_CTA_ENTRIES_PER_S; both scaled by the shift builder's gain over the
# previous one, measured on an H200 in one run). CPU (this kernel set): seconds per (query head,
# selected key, head-dim element) for the gather and per (query head, visible pair, element) for
# the block kernel, the build included.
_CUDA_GATHER_BYTES_PER_S = 6.4e12
_CUDA_PAIR_FLOPS_PER_S = {torch.float32: 2.0e13, torch.bfloat16: 6.0e14, torch.float16: 6.0e14}
_CUDA_MASK_BYTES_PER_S = 3.6e12
_CUDA_MASK_CTA_ENTRIES_PER_S = 0.68e9
_CPU_GATHER_S = {torch.float32: 0.23e-9, torch.bfloat16: 0.20e-9, torch.float16: 0.20e-9}
_CPU_PAIR_S = {torch.float32: 0.017e-9, torch.bfloat16: 0.008e-9, torch.float16: 0.017e-9}
_PARTIAL_COST = {64: 1.45, 128: 1.25}  # CUDA, by head dim: at 64 the softmax (and the masking) weighs more
_CPU_PARTIAL_COST = 1.3


def selection_route(
    query,
    key,
    value,
    groups: int,
    k: int,
    causal: bool,
    cuda: bool | None = None,
    union: float | None = None,
    union_how: str = "measured",
) -> Route:
    """How topk_attention attends over a selection of its own making (distinct keys per row):
    ``gather`` (each query loads its k rows; a row serves the query heads that share it) or
    ``masked_block`` (the union of a query block's selections through the block-sparse kernel,
    partial blocks masked to each row's selection: every row loaded once per query tile). Chosen
    by shapes alone (no synchronisation): gather when its bytes take less time than the block
    kernel would over every visible pair (the union covering everything, its worst case), so the
    choice is never much slower than dense attention; selections with locality make the block
    route faster still. Under torch.use_deterministic_algorithms(True), for a call that needs
    gradients, the block route (its backward is deterministic). ``overrides(topk_attention_route=...)``
    forces one. ``cuda``: the model of
    that device kind instead of the query's (explain's target). ``union``: the share of the block
    pairs the selection touches, when measured (selection_union), instead of 1; ``union_how``: how
    it was (for the reason given)."""
    forced = _current["topk_attention_route"]
    if forced in ("gather", "masked_block"):
        return Route(forced, (), f"forced by overrides(topk_attention_route={forced!r})")
    if torch.are_deterministic_algorithms_enabled() and query.requires_grad | key.requires_grad | value.requires_grad:
        return Route(
            "masked_block",
            (),
            "deterministic algorithms requested: the block kernel's backward is deterministic, the gather's "
            "(dK, dV summed by atomics) is not",
        )
    b, h, lq, d = query.shape
    hkv, lk, dv = key.shape[1], key.shape[2], value.shape[-1]
    start = lk - lq + 1 if causal else lk  # keys visible to row 0 (causal: bottom-right)
    visible = _sum_clamped(lq, start, 0, lk) if causal else lq * lk
    selected = _sum_clamped(lq, start, 0, min(k, lk)) if causal else lq * min(k, lk)
    share = 1.0 if union is None else union  # of the visible pairs the block kernel computes
    if query.device.type == "cuda" if cuda is None else cuda:
        streams = h if groups == h else hkv  # (index set, K/V head) pairs each loading its rows
        gather = b * streams * selected * 2 * dv * query.element_size() / _CUDA_GATHER_BYTES_PER_S
        partial = _PARTIAL_COST[64 if d <= 64 else 128]
        block = share * partial * b * h * visible * 2 * (d + dv) / _CUDA_PAIR_FLOPS_PER_S.get(query.dtype, 2.0e13)
        # The lists' build: its bytes, plus one CTA's pass over a query block's entries (the whole
        # build where few query blocks leave the GPU half idle).
        block += b * groups * (4 * lq * min(k, lk) + 4 * visible // 8) / _CUDA_MASK_BYTES_PER_S
        block += 128 * min(k, lk) / _CUDA_MASK_CTA_ENTRIES_PER_S
    else:
        gather = b * h * selected * (d + dv) / 2 * _CPU_GATHER_S.get(query.dtype, 0.23e-9)
        block = share * _CPU_PARTIAL_COST * b * h * visible * (d + dv) / 2 * _CPU_PAIR_S.get(query.dtype, 0.017e-9)
    estimate = "estimated while tracing"  # symbolic shapes: no numbers to print
    if not torch.compiler.is_compiling():
        pairs = "every visible pair" if union is None else f"the union ({union_how}: {union:.3f} of the pairs)"
        estimate = f"estimated gather {gather * 1e3:.3g} ms, block kernel over {pairs} {block * 1e3:.3g} ms"
    if gather <= block:
        return Route("gather", (gather,), f"gathered rows cost less than the block kernel ({estimate})")
    return Route(
        "masked_block",
        (),
        f"the union of each query block's selections through the block-sparse kernel, partial blocks masked to "
        f"each row's keys: rows loaded once per query tile ({estimate})",
    )


# Measuring a selection's union costs about one pass over its entries (bytes/s below); an eager
# call measures it when that is at most _UNION_MEASURE_SHARE of the gather it may replace, or
# estimates it on evenly spaced query blocks that fit that share (at least
# _UNION_MIN_SAMPLE_BLOCKS of them: 64k rows of 2048 entries for 4 K/V heads, 0.54 G entries,
# take 37 of their 512 blocks).
_UNION_MEASURE_SHARE = 0.05
_UNION_MIN_SAMPLE_BLOCKS = 8
_UNION_MEASURE_BYTES_PER_S = {"cuda": 2.4e12, "cpu": 5.0e9}  # 8 bytes an entry: 300 G entries/s on CUDA
# ... plus a fixed cost: on CUDA the host read stalls the launches, so the GPU idles while the
# host chooses and launches the attention (H100: gather 0.37 -> 1.03 ms at 16k, k = 256, when
# measured; docs/PERF_LOG.md); on the CPU the op's own overhead (2-core Xeon: 0.19 ms for 0.13 M
# entries, 12.5 ms for 8.4 M).
_UNION_MEASURE_FIXED_S = {"cuda": 0.7e-3, "cpu": 0.05e-3}


def union_measure(route: Route, query, entries_shape, cuda: bool | None = None) -> tuple[int, int, int] | None:
    """Whether an eager call measures a selection's union before choosing again: None where shapes
    decide (the route is not the gather, or measuring would cost more than its share of it), else
    (entries measurable, query blocks measured, the selection's query blocks). ``entries_shape``:
    (B, G, Lq, k)."""
    if route.kind != "gather" or not route.args:
        return None
    kind = "cuda" if (query.device.type == "cuda" if cuda is None else cuda) else "cpu"
    spare = _UNION_MEASURE_SHARE * route.args[0] - _UNION_MEASURE_FIXED_S[kind]  # the share, less the fixed cost
    budget = int(spare * _UNION_MEASURE_BYTES_PER_S[kind] / 8)  # entries measurable in it
    from . import _routes

    b, g, lq, k = entries_shape
    if budget < min(b * g * lq * k, _UNION_MIN_SAMPLE_BLOCKS * b * g * 128 * k):
        return None
    return budget, _routes.union_sample_blocks(entries_shape, budget), -(-lq // 128)


def measured_selection_route(query, key, value, entries, k_tokens: int, causal: bool, entry_block: int = 1) -> Route:
    """selection_route; then, where it chose the gather and a selection's union could beat it, in an
    eager call (no tracing, no graph capture), the union measured (_routes.selection_union: one pass
    over the entries, or over those of evenly spaced query blocks where the whole would cost too
    much, and one host read) and the choice made again with it. Clustered selections (sinks, local windows,
    blocks a query tile shares) touch few key blocks; shapes cannot tell."""
    from . import _routes

    route = selection_route(query, key, value, entries.shape[1], k_tokens, causal)
    measure = union_measure(route, query, tuple(entries.shape))
    if measure is None or not _routes.can_synchronize(query):
        return route
    budget, blocks, nqb = measure
    union = _routes.selection_union(entries, query.shape[2], key.shape[2], entry_block, causal, max_entries=budget)
    how = "measured" if blocks >= nqb else f"estimated on {blocks} of {nqb} query blocks"
    return selection_route(query, key, value, entries.shape[1], k_tokens, causal, union=union, union_how=how)


# ------------------------------------------------------------------------------------ plans
@dataclass(frozen=True)
class Launch:
    """One kernel (``count`` launches of it) of a plan, as csrc/plan/plan.cpp decides it."""

    kernel: str
    core: str
    tile: tuple[int, int] | None = None
    schedule: str | None = None
    options: dict[str, int | str] = field(default_factory=dict)
    why: tuple[str, ...] = ()
    count: int = 1
    role: str = ""  # what this launch covers, where a route has several
    backward: Launch | None = None  # the backward kernel of this forward launch (autograd), as planned

    def __str__(self) -> str:
        name = self.kernel + (f" x{self.count}" if self.count != 1 else "") + (f" ({self.role})" if self.role else "")
        head = [name, f"core={self.core}"]
        if self.tile is not None:
            head.append(f"tile={self.tile[0]}x{self.tile[1]}")
        if self.schedule is not None:
            head.append(f"schedule={self.schedule}")
        head += [f"{k}={v}" for k, v in self.options.items()]
        return "  ".join(head) + "".join(f"\n    - {w}" for w in self.why)


@dataclass(frozen=True)
class Plan:
    """What a call of ``op`` would run: its route, why, and its kernel launches in order."""

    op: str
    route: str
    why: str
    launches: tuple[Launch, ...]
    backward: str = ""  # what a backward through this call runs
    backward_launches: tuple[Launch, ...] = ()  # its kernels where the plan layer decides them

    def __str__(self) -> str:
        lines = [f"{self.op}: route {self.route}", f"  why: {self.why}"]
        lines += [f"  {launch}" for launch in self.launches]
        if self.backward:
            lines.append(f"  backward: {self.backward}")
            lines += [f"  {launch}" for launch in self.backward_launches]
        return "\n".join(lines)


def _backward(kernels: str, launches: tuple[Launch, ...]) -> str:
    """The backward of a call: its ops' backward kernels and where they run (the plan layer's
    choice, ``launches``: plan_bwd's for flash and block-sparse kernels, plan_gather_bwd's for
    top-k's gathered attention)."""
    if launches:
        first = launches[0]
        dq = first.options.get("dq")
        if first.core == "none":
            return f"{kernels} (nothing to compute)"
        if first.core == "cpu":
            return f"{kernels} (CPU kernels: P recomputed from the LSE)"
        if first.core == "cuda_cores":
            return f"{kernels} (CUDA-core kernel: one query row per warp, dK and dV summed in fp32 with atomics)"
        if first.kernel == "gather_bwd":
            return (
                f"{kernels} (CUDA tensor-core kernel: a token's heads per warp, dQ in registers, dK and dV "
                "reduced into fp32 accumulators)"
            )
        name = "Hopper" if first.core == "hopper" else "portable mma.sync"
        if dq == "ordered":
            return (
                f"{kernels} (deterministic: the Hopper kernel adds each query tile's dQ in ascending key-tile "
                "order, each CTA waiting for the one before it)"
            )
        if dq == "separate":
            return (
                f"{kernels} (deterministic: the {name} kernel computes dK and dV, then dQ in a kernel of its own, "
                "without atomics)"
            )
        if first.core == "hopper":
            return f"{kernels} (CUDA Hopper kernel: dK and dV in registers, dQ added by vector reductions)"
        return f"{kernels} (CUDA portable mma.sync kernel: dK and dV in registers, dQ by fp32 atomics)"
    return kernels


def _launch(kernel: str, text: str, count: int = 1, role: str = "") -> Launch:
    """A Launch from a _plan_* op's "key=value" lines."""
    fields = dict(line.split("=", 1) for line in text.splitlines())
    why = tuple(fields.pop(k) for k in ("why_core", "why_tile", "why_schedule") if fields.get(k))
    core = fields.pop("core")
    tile = fields.pop("tile", None)
    schedule = fields.pop("schedule", None)
    options = {k: int(v) if v.lstrip("-").isdigit() else v for k, v in fields.items()}
    shape = tuple(int(x) for x in tile.split("x")) if tile is not None else None
    return Launch(kernel, core, shape, schedule, options, why, count, role)


# Targets of explain(..., target=...): compute capability and SMs.
_TARGETS = {"sm80": (80, 108), "sm90": (90, 132)}


def _target(target) -> tuple[int, int]:
    if target is None:
        return 0, 0
    if target not in _TARGETS:
        raise ValueError(f"target must be None or one of {sorted(_TARGETS)}, got {target!r}")
    return _TARGETS[target]


def _flash_launch(q, k, v, causal, left, right, tgt, count=1, role="") -> Launch:
    launch = _launch("flash_fwd", _ops._plan_flash.default(q, k, v, causal, left, right, *tgt), count, role)
    det = torch.are_deterministic_algorithms_enabled()
    text = _ops._plan_bwd.default(q, k, v, False, causal, left, right, 128, 128, det, *tgt)
    return replace(launch, backward=_launch("flash_bwd", text, count, role))


def _gather_launch(q, k, v, heads, tgt) -> Launch:
    launch = _launch("gather_fwd", _ops._plan_gather.default(q, k, v, heads, *tgt))
    return replace(launch, backward=_launch("gather_bwd", _ops._plan_gather_bwd.default(q, k, v, heads, *tgt)))


def _backward_launches(launches) -> tuple[Launch, ...]:
    """The backward launches of a plan's forward launches (those that have one)."""
    return tuple(launch.backward for launch in launches if launch.backward is not None)


def _block_sparse_launch(q, k, v, q_block, kv_block, tgt) -> Launch:
    launch = _launch("block_sparse_fwd", _ops._plan_block_sparse.default(q, k, v, q_block, kv_block, *tgt))
    det = torch.are_deterministic_algorithms_enabled()
    text = _ops._plan_bwd.default(q, k, v, True, False, -1, -1, q_block, kv_block, det, *tgt)
    return replace(launch, backward=_launch("block_sparse_bwd", text))


def _explain_dense(a, tgt) -> Plan:
    q, k, v = a["query"], a["key"], a["value"]
    _args.check_inputs(q, k, v)
    gpu = q.is_cuda or tgt[0] > 0
    why = "S = scale * Q K^T in fp32, softmax, then P V" + (" as cuBLAS GEMMs" if gpu else " on the CPU")
    launch = Launch("dense_fwd", "cublas" if gpu else "cpu", why=(why,))
    return Plan(
        "dense_attention", "dense", "the naive baseline: materialises the (B, H, Lq, Lk) score matrix", (launch,)
    )


def _explain_flash(a, tgt) -> Plan:
    q, k, v = a["query"], a["key"], a["value"]
    _args.check_4d(query=q, key=k, value=v)
    left, right = _args.window_bounds(a["window"])
    causal = bool(a["causal"])
    if a.get("key_lengths") is not None:
        why = (
            "key_lengths: the block-sparse kernel over the lengths' block mask"
            + (" and the window's" if left >= 0 or right >= 0 else "")
            + (", causal" if causal else "")
        )
        return Plan("flash_attention", "block_kernel", why, (_block_sparse_launch(q, k, v, 128, 128, tgt),))
    why = "tiled attention with an online softmax" + (", causal" if causal else "")
    if left >= 0 or right >= 0:
        why += f", window (left={left}, right={right}; -1 unbounded)"
    return Plan("flash_attention", "flash", why, (_flash_launch(q, k, v, causal, left, right, tgt),))


def _explain_flash_varlen(a, tgt) -> Plan:
    from . import _varlen

    q, k, v = a["query"], a["key"], a["value"]
    bounds = _varlen.check(q, k, v, a["cu_seqlens_q"], a["cu_seqlens_k"], a["max_seqlen_q"], a["max_seqlen_k"])
    left, right = _args.window_bounds(a["window"])
    causal = bool(a["causal"])
    if _varlen.document_route(q, k, v, bounds, cuda=q.is_cuda or tgt[0] > 0):
        runs = len(_varlen._runs(bounds))
        grad = _meta.tracks_grad(q, k, v)
        tokens = _varlen.DOCUMENT_ROUTE_TOKENS_GRAD if grad else _varlen.DOCUMENT_ROUTE_TOKENS
        reason = f"the runs average fewer than {tokens} query tokens" + (
            " (a gradient may be needed: one backward launch instead of one per run)" if grad else ""
        )
        why = (
            f"{len(bounds)} sequences ({runs} runs of equal lengths) as one block-sparse call over the packed tensors "
            f"with their document mask, built on the device: {reason}"
        )
        q4, k4, v4 = (x.unsqueeze(0).transpose(1, 2) for x in (q, k, v))
        return Plan(
            "flash_attention_varlen", "varlen_documents", why, (_block_sparse_launch(q4, k4, v4, 128, 128, tgt),)
        )
    launches = tuple(
        _flash_launch(qv, kv, vv, causal, left, right, tgt, role=f"{n} x {lq} queries, {lk} keys")
        for _, n, lq, lk, qv, kv, vv in _varlen.calls(q, k, v, bounds, True)
    )
    in_place = _varlen.packed_flash(q, k, v, cuda=q.is_cuda or tgt[0] > 0)
    why = (
        f"{len(bounds)} sequences in {len(launches)} flash_attention calls on views of the packed tensors (consecutive "
        "sequences of equal lengths batched); "
        + (
            "the kernels write into the packed output (CUDA, 16-bit, no gradient tracked)"
            if in_place
            else "the calls' outputs concatenated"
        )
    )
    return Plan("flash_attention_varlen", "varlen_flash", why, launches)


def _explain_block_sparse(a, tgt) -> Plan:
    q, k, v, mask = a["query"], a["key"], a["value"], a["mask"]
    _args.check_4d(query=q, key=k, value=v)
    _args.check_mask_kind(mask)
    lq, lk = q.shape[2], k.shape[2]
    from .patterns import Pattern

    resolved = isinstance(mask, Pattern)
    if resolved:  # resolved for these lengths (and kept on the pattern), as the call does
        mask = mask.resolve(lq, lk, device=q.device)
    if isinstance(mask, BlockSparseMask) and a.get("key_lengths") is not None:
        route = Route("block_kernel", mask.block_size, "the mask intersected with the key lengths' block mask")
    elif isinstance(mask, BlockSparseMask):
        _args.check_mask_lengths(mask.seq_lengths, lq, lk)
        route = block_sparse_route(mask, k, v, bool(a["causal"]))
    else:  # a block matrix or a Flex BlockMask: a plain block mask (converted on every call)
        if isinstance(mask, torch.Tensor):
            size = (_args.matrix_block_size(mask, lq, lk),) * 2
            why = "a bool block matrix: the block-sparse kernel over its full blocks"
        else:
            size = tuple(mask.BLOCK_SIZE) if isinstance(mask.BLOCK_SIZE, tuple) else (mask.BLOCK_SIZE,) * 2
            _args.check_mask_lengths(mask.seq_lengths, lq, lk)
            why = (
                "a FlexAttention BlockMask (converted to a BlockSparseMask on its first call, the conversion "
                "kept with the mask object): the block-sparse kernel over its lists"
            )
        route = Route("block_kernel", size, why)
    if route.kind == "flash_causal":
        launches = (_flash_launch(q, k, v, True, -1, -1, tgt),)
    elif route.kind == "flash_window":
        launches = (_flash_launch(q, k, v, False, *route.args, tgt),)
    elif route.kind == "dilated":
        from ._routes import dilated_half_window

        window, r = route.args
        half = dilated_half_window(window, r)
        views = [x[:, :, 0::r] for x in (q, k, v)]
        launches = (_flash_launch(*views, False, half, half, tgt, count=min(r, lq), role="one per residue class"),)
    elif route.kind == "dilated_2d":
        from ._routes import dilated_2d_batch

        segment, r = route.args
        launches = ()
        if lq // segment > 0:
            batch = [dilated_2d_batch(x, segment, r, data=False) for x in (q, k, v)]
            launches += (_flash_launch(*batch, False, -1, -1, tgt, role="whole segments as one batch"),)
        if lq % segment:
            tail = [x[:, :, lq // segment * segment :: r] for x in (q, k, v)]
            launches += (_flash_launch(*tail, False, -1, -1, tgt, role="ragged last segment"),)
    else:
        launches = (_block_sparse_launch(q, k, v, route.args[0], route.args[1], tgt),)
    why = (f"a Pattern resolved for (Lq={lq}, Lk={lk}): " if resolved else "") + route.why
    return Plan("block_sparse_attention", route.kind, why, launches)


def _masked_launches(q, k, v, on_cuda: bool, tgt) -> tuple[Launch, ...]:
    """The masked block route's launches: the selection's lists and bits, then the block kernel."""
    lists = Launch(
        "selection_mask",
        "cuda" if on_cuda else "cpu",
        why=("one CTA (CPU: task) per query block and index set: the union of its rows' key blocks, each row's bits",),
    )
    return (lists, _block_sparse_launch(q, k, v, 128, 128, tgt))


def _measure_note(attend: Route, q, entries_shape, on_cuda: bool) -> str:
    """What an eager call adds to explain's shapes-only choice: its measure of the selection's union."""
    measure = union_measure(attend, q, entries_shape, on_cuda)
    if measure is None:
        return ""
    _, blocks, nqb = measure
    over = "its entries" if blocks >= nqb else f"the entries of {blocks} of its {nqb} query blocks"
    return (
        f"; an eager call first measures the selection's union (over {over}, one host read) and takes the "
        "masked block route where that union makes it cheaper"
    )


def _explain_topk(a, tgt) -> Plan:
    q, k, v = a["query"], a["key"], a["value"]
    on_cuda = q.device.type == "cuda" or tgt[0] != 0
    if a["indices"] is not None:
        idx = a["indices"]
        heads = idx.shape[1]
        tokens = idx.shape[3] * (a["block_size"] or 1)
        attend = selection_route(q, k, v, heads, tokens, bool(a["causal"]), on_cuda)
        why = f"a selection made elsewhere (indices=), repeats dropped; attention over it: {attend.kind}, {attend.why}"
        why += _measure_note(attend, q, tuple(idx.shape), on_cuda)
        if attend.kind == "masked_block" and a["key_lengths"] is None:
            return Plan("topk_attention", "user_topk", why, _masked_launches(q, k, v, on_cuda, tgt))
        return Plan("topk_attention", "user_topk", why, (_gather_launch(q, k, v, heads, tgt),))
    indexer = [a[n] is not None for n in ("index_query", "index_key", "index_weights")]
    if any(indexer) and not all(indexer):
        raise ValueError("index_query, index_key and index_weights must be given together")
    route = topk_route(a["block_size"], all(indexer))
    causal = bool(a["causal"])
    if route.kind == "block_topk":
        _args.check_inputs(q, k, v)
        bs = route.args[0]
        pool = Launch(
            "block_topk_scores",
            "torch",
            why=("pooled blocks scored by two matmuls (a bound of q.k); top-k per block row",),
        )
        return Plan("topk_attention", route.kind, route.why, (pool, _block_sparse_launch(q, k, v, bs, bs, tgt)))
    if route.kind == "indexer_topk":
        iq, ik, iw = a["index_query"], a["index_key"], a["index_weights"]
        select = _launch("indexer_select", _ops._plan_indexer_select.default(iq, ik, iw, a["k"], causal, *tgt))
        heads = 1
    else:
        select = _launch("topk_select", _ops._plan_select.default(q, k, a["k"], causal, *tgt))
        heads = q.shape[1]
    attend = selection_route(q, k, v, heads, a["k"], causal, on_cuda)
    why = f"{route.why}; attention over it: {attend.kind}, {attend.why}"
    why += _measure_note(attend, q, (q.shape[0], heads, q.shape[2], a["k"]), on_cuda)
    if attend.kind == "masked_block":
        return Plan("topk_attention", route.kind, why, (select, *_masked_launches(q, k, v, on_cuda, tgt)))
    return Plan("topk_attention", route.kind, why, (select, _gather_launch(q, k, v, heads, tgt)))


def _explain_kvcache(a, tgt) -> Plan:
    from . import _kvcache

    q, kc, vc, lens = a["query"], a["key_cache"], a["value_cache"], a["cache_seqlens"]
    left, right = _args.window_bounds(a["window"])
    if a["causal"]:
        right = 0
    bt = a["block_table"]
    cap = _kvcache.capacity(kc, bt)
    cnt, idx, kv_block = _kvcache.mask_tensors(a["mask"], q, kc, bt, cap)
    text = _ops._plan_kvcache.default(q, kc, vc, lens, a["key"], a["value"], bt, cnt, idx, kv_block, left, right, *tgt)
    launch = _launch("kvcache_fwd" if text.startswith("core=portable") else "dense_fwd", text)
    if launch.kernel == "dense_fwd":
        why = "composite path: the cache gathered per sequence, then dense_attention's kernel with the element mask"
        return Plan("attention_with_kvcache", "composite", why, (launch,))
    splits = launch.options["num_splits"]
    if launch.options.get("balanced"):
        route = "decode_balanced"
        why = (
            "balanced split-KV decode: each CTA an equal run of the (batch, K/V head) pairs' key pieces, "
            "across pairs, so every SM streams the same bytes; pieces merged by their LSEs"
        )
    elif splits > 1:
        route = "decode_split_kv"
        why = "split-KV decode: each (batch, K/V head) pair's keys split over several CTAs, merged by their LSEs"
    else:
        route = "decode"
        why = "decode: one CTA per (batch, K/V head, row chunk) reads its share of the cache once"
    launches = (launch,)
    if splits > 1:
        launches += (Launch("decode_combine", "cuda_cores", why=("merges the splits' O and LSE in fp32",)),)
    return Plan("attention_with_kvcache", route, why, launches)


# sparse_attn.distributed's ops (explained there: the schedule on this rank of the process group).
_CONTEXT_PARALLEL = (
    "context_parallel_attention",
    "context_parallel_block_sparse_attention",
    "context_parallel_topk_attention",
)
_EXPLAIN = {
    "dense_attention": _explain_dense,
    "flash_attention": _explain_flash,
    "flash_attention_varlen": _explain_flash_varlen,
    "block_sparse_attention": _explain_block_sparse,
    "topk_attention": _explain_topk,
    "attention_with_kvcache": _explain_kvcache,
}


def explain(op, *args, target: str | None = None, **kwargs) -> Plan:
    """The plan a call ``op(*args, **kwargs)`` would take, without running it.

    Names the route (e.g. a ``patterns.sliding_window`` mask runs as ``flash_attention`` with its
    window) and each kernel launch: the core (``hopper``, ``portable`` mma.sync, ``cuda_cores``,
    ``cpu``), tile, schedule and options, each with the reason it was chosen. The inputs are
    checked as the op checks them; no attention kernel runs (inputs a kernel would copy for
    alignment are planned on an uninitialised tensor of the copy's layout).

    Parameters
    ----------
    op : callable or str
        One of the ops (``sparse_attn.flash_attention`` or ``"flash_attention"``, ...), or a
        context-parallel op of ``sparse_attn.distributed``: the schedule this rank of its process
        group takes (``route`` ``context_parallel_<schedule>``), why, and this rank's launches.
    *args, **kwargs
        The op's arguments, exactly as the call would pass them.
    target : {"sm80", "sm90"}, optional
        Plan for that GPU (an A100 with 108 SMs, an H100 with 132) instead of the inputs' device:
        what a call would do on a GPU this machine does not have.

    Returns
    -------
    Plan
        ``route``, ``why`` and ``launches`` (each a :class:`Launch`: ``kernel``, ``core``, ``tile``,
        ``schedule``, ``options``, ``why``, ``count``); ``print(plan)`` shows all of it.

    Examples
    --------
    >>> import torch, sparse_attn
    >>> from sparse_attn import patterns
    >>> q = k = v = torch.randn(1, 2, 1024, 64, dtype=torch.bfloat16)
    >>> plan = sparse_attn.explain(sparse_attn.block_sparse_attention, q, k, v, patterns.sliding_window(1024, 256))
    >>> plan.route
    'flash_window'
    >>> sparse_attn.explain("flash_attention", q, k, v, causal=True, target="sm90").launches[0].core
    'hopper'
    """
    from . import ops

    name = op if isinstance(op, str) else getattr(op, "__name__", None)
    if name in _CONTEXT_PARALLEL:
        from . import distributed

        return distributed._explain(name, args, kwargs, _target(target))
    if name not in _EXPLAIN:
        raise ValueError(
            f"op must be one of {sorted(_EXPLAIN) + list(_CONTEXT_PARALLEL)} (or the function), got {op!r}"
        )
    bound = inspect.signature(getattr(ops, name)).bind(*args, **kwargs)
    bound.apply_defaults()
    tgt = _target(target)
    plan = _EXPLAIN[name](bound.arguments, tgt)
    if name == "dense_attention":  # its backward is torch's autograd of its math, on any device
        return replace(plan, backward="the baseline's math redone in fp32 through autograd (materialised)")
    kernels = sorted({_BACKWARD[launch.kernel] for launch in plan.launches if launch.kernel in _BACKWARD})
    if kernels:
        launches = _backward_launches(plan.launches)
        text = _backward(", ".join(kernels), launches)
        plan = replace(plan, backward=text, backward_launches=launches)
    return plan


# The backward op of each forward kernel (autograd in _meta.py).
_BACKWARD = {"flash_fwd": "flash_bwd", "block_sparse_fwd": "block_sparse_bwd", "gather_fwd": "gather_bwd"}


# ------------------------------------------------------------------------------------ overrides
_DEFAULTS = {
    "portable_only": False,
    "tile": None,
    "per_tile_grid": False,
    "merge_boundary": None,
    "select_workspace_bytes": 0,
    "decode_splits": 0,
    "decode_ctas": 0,
    "select_filter_stride": 0,
    "bwd_head_splits": 0,
    "topk_attention_route": None,
}
_current = dict(_DEFAULTS)


def _apply(options: dict) -> None:
    block_m, block_n = options["tile"] or (0, 0)
    merge = options["merge_boundary"]
    _ops._set_plan_options.default(
        bool(options["portable_only"]),
        int(block_m),
        int(block_n),
        bool(options["per_tile_grid"]),
        -1 if merge is None else int(bool(merge)),
        int(options["select_workspace_bytes"]),
        int(options["decode_splits"]),
        int(options["select_filter_stride"]),
        int(options["bwd_head_splits"]),
        int(options["decode_ctas"]),
    )


@contextlib.contextmanager
def overrides(**changes):
    """Override the C++ plan's choices inside a ``with`` block (tests and benchmarks; the process
    holds one set, so do not use it from concurrent threads):

    - ``portable_only=True``: never the Hopper core;
    - ``tile=(block_m, block_n)``: a Hopper tile of the table (head dim 64: (192, 128),
      (128, 128), (128, 192)), taken where the table has it;
    - ``per_tile_grid=True``: the Hopper core with one CTA per tile instead of persistent CTAs;
    - ``merge_boundary=True/False``: the Hopper core's merged tile boundary on or off;
    - ``select_workspace_bytes=n``: top-k selection's score workspace;
    - ``decode_splits=n``: attention_with_kvcache's split-KV count (at most its key tiles);
    - ``decode_ctas=n``: attention_with_kvcache's grid of n CTAs, each an equal run of the
      (unit, split) pieces (at most one CTA per piece);
    - ``select_filter_stride=n``: top-k selection filtered on chip with a sample of every n-th
      key tile (where the kernels can take it), ``-1``: never filtered (the scores then go
      through the workspace).
    - ``bwd_head_splits=n``: the tensor-core backward (Hopper or portable) of flash and
      block-sparse attention with each key block's GQA group of query heads shared by n CTAs (a
      divisor of the group; capped at it), dK and dV summed in fp32 (not in deterministic mode);
    - ``topk_attention_route="gather"`` or ``"masked_block"``: how topk_attention attends over
      a selection of its own (selection_route; Python-side).

    ``explain`` shows the plan with them in force.
    """
    unknown = set(changes) - set(_DEFAULTS)
    if unknown:
        raise TypeError(f"unknown plan options {sorted(unknown)}; known: {sorted(_DEFAULTS)}")
    previous = dict(_current)
    _current.update(changes)
    _apply(_current)
    try:
        yield
    finally:
        _current.clear()
        _current.update(previous)
        _apply(previous)
