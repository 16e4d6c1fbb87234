"""KV-cache decode on the GPU: attention_with_kvcache against the HBM copy bandwidth and SDPA
(cuDNN, FlashAttention backends), all measured in one run (bf16, GQA 32/8, D = 128).

Every call is captured in a CUDA graph and the replay timed (CUDA events, median of 40, the L2
flushed by a 512 MiB read before each replay), so the times are the GPU's, with one graph launch
each, for ours and SDPA's alike. Bandwidth = bytes of K and V the call must read
(B * Hkv * L * D * 2 tensors * 2 bytes) over time; copy = copying 1 GiB on the device, read + write
bytes over time, from the same run; bound = one graph launch (a tiny kernel's replay, timed the same
way) plus the cache's bytes at the copy bandwidth: at small caches the launch dominates. (A copy of
the cache's size is no bound there: below ~100 MB its written half stays in the 50 MB L2, and
torch.amax, a read-only reduction, took 1.6x the copy's time at 16.8 MB.)
SDPA runs with enable_gqa (no K/V expansion); with several new tokens it runs without a causal
mask (its causal mask is top-left aligned), which reads the same bytes. The varlen_routes table
times eagerly too (its document route is not captured in a graph): see its docstring.

    python benchmarks/bench_decode.py                   # every table (decode ... varlen_routes)
    python benchmarks/bench_decode.py --quick           # a few shapes
    python benchmarks/bench_decode.py --json out.json   # also write the rows
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

import sparse_attn
from sparse_attn import BlockSparseMask
from sparse_attn.bench import require_cuda, run_sdpa, sdpa_backends

H, HKV, D = 32, 8, 128
DT = torch.bfloat16


_FLUSH: list[torch.Tensor] = []


def flush_l2() -> None:
    """Evicts the L2 by reading 512 MiB (a reduction: the L2 is left holding clean lines, as after a
    GEMM that read its weights; a write-based flush would leave ~50 MB of dirty lines whose
    write-back the next kernel would pay for)."""
    if not _FLUSH:
        _FLUSH.append(torch.ones(1 << 28, dtype=torch.bfloat16, device="cuda"))
    torch.amax(_FLUSH[0])


def time_graph(fn, reps: int = 40) -> float:
    """Median milliseconds of one replay of fn() captured in a CUDA graph, the L2 flushed before
    each replay (NaN if it cannot run). Replays as timed for at least 50 ms first: the first
    call timed after a large free and allocation (the previous shape's tensors) ran up to 18 %
    slow for tens of milliseconds, whichever kernel it was (H100, B = 9, 32k after B = 64, 32k)."""
    try:
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            fn()
        torch.cuda.current_stream().wait_stream(s)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
    except RuntimeError as e:  # a backend that refuses the shape
        print(f"    (skipped: {str(e).splitlines()[0][:100]})", file=sys.stderr)
        return float("nan")
    torch.cuda.synchronize()
    start = time.perf_counter()
    while time.perf_counter() - start < 0.05:
        for _ in range(5):
            flush_l2()
            graph.replay()
        torch.cuda.synchronize()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    for start, end in events:
        flush_l2()
        start.record()
        graph.replay()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(start.elapsed_time(end) for start, end in events)


def copy_bandwidth() -> float:
    """TB/s of copying 1 GiB on the device, read + write bytes: the better of the copy engine path
    (``copy_``) and an elementwise kernel (``torch.neg(out=)``), which differ by GPU."""
    x = torch.zeros(1 << 29, dtype=torch.bfloat16, device="cuda")
    y = torch.empty_like(x)
    ms = min(time_graph(lambda: y.copy_(x)), time_graph(lambda: torch.neg(x, out=y)))
    return 2 * x.numel() * 2 / (ms * 1e-3) / 1e12


def launch_ms() -> float:
    """Milliseconds of a graph replay of one tiny kernel, timed as every call here: the fixed cost
    any call pays before its first byte moves."""
    x = torch.zeros(1, device="cuda")
    return time_graph(lambda: x.add_(1))


def decode(q, kc, vc, lens, **kwargs):
    """The call to time, its tensors bound now."""
    return lambda: sparse_attn.attention_with_kvcache(q, kc, vc, lens, **kwargs)


def sdpa(q, k, v, backend):
    return lambda: run_sdpa(q, k, v, backend)


def inputs(b: int, length: int, lq: int):
    q = torch.randn(b, H, lq, D, device="cuda", dtype=DT)
    kc = torch.randn(b, HKV, length, D, device="cuda", dtype=DT)
    vc = torch.randn(b, HKV, length, D, device="cuda", dtype=DT)
    lens = torch.full((b,), length, dtype=torch.int32, device="cuda")
    return q, kc, vc, lens


def cache_bytes(b: int, length: int) -> int:
    return b * HKV * length * D * 2 * 2


def run_table(header: list[str], shapes, row_fn) -> list[str]:
    """A table: its header, then row_fn(*shape)'s lines per shape (memory freed in between)."""
    out = list(header)
    for shape in shapes:
        out += row_fn(*shape)
        torch.cuda.empty_cache()
    return out


def decode_table(args, copy_bw: float, rows: list[dict]) -> list[str]:
    backends = sdpa_backends(torch.device("cuda"))
    launch = launch_ms()
    header = [
        "decode: one graph replay per call; TB/s = K+V bytes read / time; frac = of the copy bandwidth;",
        "bound ms = one graph launch (a tiny kernel's replay, same run) + K+V bytes at the copy bandwidth; of bound = "
        "bound / ours",
        f"(one graph launch: {launch * 1e3:.1f} us); splits: pieces per (batch, K/V head), 'b' where the plan "
        "balances them over fewer CTAs (the walk)",
        f"{'B':>3} {'L':>7} {'Lq':>3} {'splits':>6} {'ours ms':>8} {'TB/s':>6} {'frac':>5} {'bound ms':>8} "
        f"{'of bound':>8} {'cudnn TB/s':>10} {'flash TB/s':>10} {'vs cudnn':>8} {'vs flash':>8}",
    ]
    return run_table(
        header,
        args.shapes,
        lambda b, length, lq: [decode_row(args, copy_bw, launch, rows, backends, b, length, lq)],
    )


def decode_row(args, copy_bw, launch, rows, backends, b, length, lq) -> str:
    q, kc, vc, lens = inputs(b, length, lq)
    plan = sparse_attn.explain(sparse_attn.attention_with_kvcache, q, kc, vc, lens)
    options = plan.launches[0].options
    splits = options.get("num_splits", 0)
    split_text = f"{splits}{'b' if options.get('balanced') else ''}"
    t_ours = time_graph(decode(q, kc, vc, lens))
    for n in args.splits or ():
        with sparse_attn._plan.overrides(decode_splits=n):
            t = time_graph(decode(q, kc, vc, lens))
        print(f"    splits={n}: {t:.4f} ms, {cache_bytes(b, length) / (t * 1e-3) / 1e12:.2f} TB/s")
    t_bound = launch + cache_bytes(b, length) / (copy_bw * 1e12) * 1e3
    t_cudnn = time_graph(sdpa(q, kc, vc, backends["sdpa-cudnn"]))
    t_flash = time_graph(sdpa(q, kc, vc, backends["sdpa-flash"]))
    bw = [cache_bytes(b, length) / (t * 1e-3) / 1e12 for t in (t_ours, t_cudnn, t_flash)]
    rows.append(
        dict(
            table="decode",
            b=b,
            length=length,
            lq=lq,
            splits=splits,
            ctas=options.get("ctas", 0),
            ours_ms=t_ours,
            ours_tbs=bw[0],
            frac_copy=bw[0] / copy_bw,
            bound_ms=t_bound,
            of_bound=t_bound / t_ours,
            cudnn_tbs=bw[1],
            flash_tbs=bw[2],
            vs_cudnn=t_cudnn / t_ours,
            vs_flash=t_flash / t_ours,
        )
    )
    return (
        f"{b:>3} {length:>7} {lq:>3} {split_text:>6} {t_ours:>8.4f} {bw[0]:>6.2f} {bw[0] / copy_bw:>5.2f} "
        f"{t_bound:>8.4f} {t_bound / t_ours:>8.2f} {bw[1]:>10.2f} {bw[2]:>10.2f} {t_cudnn / t_ours:>8.2f} "
        f"{t_flash / t_ours:>8.2f}"
    )


def paged_table(args, copy_bw: float, rows: list[dict]) -> list[str]:
    header = [
        "paged: shuffled pages against the contiguous cache (same tokens), one new token; BLHD = the",
        "contiguous cache stored token-major (B, L, Hkv, D), a head's rows interleaved as in a paged cache",
        f"{'B':>3} {'L':>7} {'page':>5} {'ms':>8} {'TB/s':>6} {'frac':>5} {'vs contiguous':>13}",
    ]
    return run_table(header, args.paged_shapes, lambda b, length: paged_rows(args, copy_bw, rows, b, length))


def paged_rows(args, copy_bw, rows, b, length) -> list[str]:
    q, kc, vc, lens = inputs(b, length, 1)
    t_contig = time_graph(decode(q, kc, vc, lens))
    layouts = [
        ("BLHD", None, kc.transpose(1, 2).contiguous().transpose(1, 2), vc.transpose(1, 2).contiguous().transpose(1, 2))
    ]
    for page in args.pages:
        pages = length // page
        perm = torch.randperm(b * pages, device="cuda")
        # Page p of sequence s holds its tokens [p * page, (p + 1) * page).
        pk = torch.empty(b * pages, page, HKV, D, device="cuda", dtype=DT)
        pv = torch.empty_like(pk)
        pk[perm] = kc.transpose(1, 2).reshape(b * pages, page, HKV, D)
        pv[perm] = vc.transpose(1, 2).reshape(b * pages, page, HKV, D)
        layouts.append((page, perm.view(b, pages).to(torch.int32), pk, pv))
    out = []
    for page, table, k, v in layouts:
        t = time_graph(decode(q, k, v, lens, block_table=table))
        bw = cache_bytes(b, length) / (t * 1e-3) / 1e12
        rows.append(
            dict(
                table="paged",
                b=b,
                length=length,
                page=page,
                ms=t,
                tbs=bw,
                frac_copy=bw / copy_bw,
                vs_contiguous=t_contig / t,
            )
        )
        out.append(f"{b:>3} {length:>7} {page:>5} {t:>8.4f} {bw:>6.2f} {bw / copy_bw:>5.2f} {t_contig / t:>13.2f}")
    return out


def sparse_table(args, copy_bw: float, rows: list[dict]) -> list[str]:
    header = [
        "sparse decode: a random selection of 128-token cache blocks per (sequence, K/V head), one new token;",
        "bound = selected bytes / copy bandwidth; same bytes = dense decode (ours, cuDNN) of a contiguous cache",
        "holding as many tokens as the selection",
        f"{'B':>3} {'L':>7} {'kept':>5} {'ms':>8} {'dense ms':>8} {'speedup':>7} {'bound ms':>8} {'/ bound':>7} "
        f"{'same-bytes ms':>13} {'cudnn same':>10} {'/ same':>6} {'/ cudnn same':>12}",
    ]
    return run_table(header, args.sparse_shapes, lambda b, length: sparse_rows(args, copy_bw, rows, b, length))


def sparse_rows(args, copy_bw, rows, b, length) -> list[str]:
    q, kc, vc, lens = inputs(b, length, 1)
    t_dense = time_graph(decode(q, kc, vc, lens))
    out = []
    for keep in args.keep:
        sel = torch.rand(b, HKV, 1, length // 128, device="cuda") < keep
        mask = BlockSparseMask.from_block_matrix(sel, seq_lengths=(1, length), block_size=(128, 128))
        t = time_graph(decode(q, kc, vc, lens, mask=mask))
        for n in args.splits or ():
            with sparse_attn._plan.overrides(decode_splits=n):
                print(f"    splits={n}: {time_graph(decode(q, kc, vc, lens, mask=mask)):.4f} ms")
        kept = sel.float().mean().item()
        bound = kept * cache_bytes(b, length) / (copy_bw * 1e12) * 1e3
        # Dense decode over the same bytes: a contiguous cache of the selection's token count.
        same = max(128, round(kept * length / 128) * 128)
        qs, ks, vs, ls = inputs(b, same, 1)
        t_same = time_graph(decode(qs, ks, vs, ls))
        t_same_cudnn = time_graph(sdpa(qs, ks, vs, sdpa_backends(torch.device("cuda"))["sdpa-cudnn"]))
        del qs, ks, vs, ls
        rows.append(
            dict(
                table="sparse",
                b=b,
                length=length,
                kept=kept,
                ms=t,
                dense_ms=t_dense,
                speedup=t_dense / t,
                bound_ms=bound,
                over_bound=t / bound,
                same_bytes_ms=t_same,
                same_bytes_cudnn_ms=t_same_cudnn,
                over_same_bytes=t / t_same,
                over_same_bytes_cudnn=t / t_same_cudnn,
            )
        )
        out.append(
            f"{b:>3} {length:>7} {kept:>5.2f} {t:>8.4f} {t_dense:>8.4f} {t_dense / t:>7.2f} "
            f"{bound:>8.4f} {t / bound:>7.2f} {t_same:>13.4f} {t_same_cudnn:>10.4f} {t / t_same:>6.2f} "
            f"{t / t_same_cudnn:>12.2f}"
        )
    return out


def topk_table(args, copy_bw: float, rows: list[dict]) -> list[str]:
    """Top-k decode: the lightning indexer (HI = 4, DI = 64) scores the cache's index keys, the top
    blocks (sink and newest included) form the mask, and the decode reads only those blocks."""
    header = [
        "top-k decode: kvcache_topk_mask (indexer over (B, L, 64) index keys, top blocks of 128) + sparse decode,",
        "one new token, against dense decode",
        f"{'B':>3} {'L':>7} {'blocks':>6} {'mask ms':>8} {'total ms':>8} {'dense ms':>8} {'speedup':>7}",
    ]
    return run_table(header, args.sparse_shapes, lambda b, length: topk_rows(args, rows, b, length))


def topk_rows(args, rows, b, length) -> list[str]:
    q, kc, vc, lens = inputs(b, length, 1)
    iq = torch.randn(b, 1, 4, 64, device="cuda", dtype=DT)
    iw = torch.rand(b, 1, 4, device="cuda", dtype=DT)
    ik = torch.randn(b, length, 64, device="cuda", dtype=DT)
    t_dense = time_graph(decode(q, kc, vc, lens))
    out = []
    for blocks in args.topk_blocks:

        def mask_only(blocks=blocks):
            return sparse_attn.kvcache_topk_mask(iq, iw, ik, lens, blocks)

        def both(mask_only=mask_only):
            return sparse_attn.attention_with_kvcache(q, kc, vc, lens, mask=mask_only())

        t_mask, t_all = time_graph(mask_only), time_graph(both)
        rows.append(
            dict(
                table="topk",
                b=b,
                length=length,
                blocks=blocks,
                mask_ms=t_mask,
                ms=t_all,
                dense_ms=t_dense,
                speedup=t_dense / t_all,
            )
        )
        out.append(
            f"{b:>3} {length:>7} {blocks:>6} {t_mask:>8.4f} {t_all:>8.4f} {t_dense:>8.4f} {t_dense / t_all:>7.2f}"
        )
    return out


def varlen_table(args, copy_bw: float, rows: list[dict]) -> list[str]:
    """Prefill of a packed mixed batch (causal) against one sequence of the same causal work."""
    out = [
        "varlen prefill (causal, packed, cu_seqlens on the CPU) vs one sequence of equal causal work;",
        "TFLOP/s count 4 * D per visible (query, key) pair",
        f"{'lengths':<40} {'varlen ms':>9} {'TFLOP/s':>7} {'single L':>8} {'single ms':>9} {'TFLOP/s':>7} {'ratio':>5}",
    ]
    for lens in args.varlen_batches:
        pairs = sum(n * (n + 1) // 2 for n in lens)
        single = int(round((2 * pairs) ** 0.5))
        g = torch.Generator(device="cuda").manual_seed(0)
        q = torch.randn(sum(lens), H, D, device="cuda", dtype=DT, generator=g)
        k = torch.randn(sum(lens), HKV, D, device="cuda", dtype=DT, generator=g)
        v = torch.randn_like(k)
        cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
        longest = max(lens)
        t_var = time_graph(
            lambda q=q, k=k, v=v, cu=cu, m=longest: sparse_attn.flash_attention_varlen(
                q, k, v, cu, cu, m, m, causal=True
            )
        )
        qs, ks, vs, _ = inputs(1, single, single)
        ks, vs = ks[:, :, :single], vs[:, :, :single]
        t_one = time_graph(lambda qs=qs, ks=ks, vs=vs: sparse_attn.flash_attention(qs, ks, vs, causal=True))
        pairs_one = single * (single + 1) // 2
        tf_var = 4 * D * H * pairs / (t_var * 1e-3) / 1e12
        tf_one = 4 * D * H * pairs_one / (t_one * 1e-3) / 1e12
        rows.append(
            dict(
                table="varlen",
                lengths=lens,
                ms=t_var,
                tflops=tf_var,
                single=single,
                single_ms=t_one,
                single_tflops=tf_one,
                ratio=tf_var / tf_one,
            )
        )
        name = ",".join(f"{n // 1024}k" if n % 1024 == 0 else str(n) for n in lens)
        out.append(
            f"{name:<40} {t_var:>9.3f} {tf_var:>7.1f} {single:>8} {t_one:>9.3f} {tf_one:>7.1f} {tf_var / tf_one:>5.2f}"
        )
        del q, k, v, qs, ks, vs
        torch.cuda.empty_cache()
    return out


def time_eager(fn, reps: int = 10) -> float:
    """Median milliseconds of fn() run eagerly (host work included: CUDA events around each call,
    the GPU idle before it)."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def uniform_lengths(n: int, lo: int, hi: int, seed: int) -> list[int]:
    return torch.randint(lo, hi + 1, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def varlen_routes_table(args, copy_bw: float, rows: list[dict]) -> list[str]:
    """flash_attention_varlen's two routes on one packed causal batch: one flash call per run of
    equal lengths, or one block-sparse call over the document mask. Eager forward (host work
    included; the document route builds its mask in the first call and the timed calls reuse it,
    as a model's later layers do), the attention alone as a graph (the document route itself is
    not captured), the mask's build on the host (what the first layer pays), and a training step
    (forward and backward, eager); "auto" is the route the op takes outside a graph capture."""
    from sparse_attn import _varlen

    out = [
        "varlen routes (causal; per-run flash calls vs one block-sparse call over the document mask); ms",
        f"{'batch':<20} {'tokens':>6} {'mean':>5} {'fwd runs':>8} {'fwd docs':>8} {'runs/docs':>9} "
        f"{'graph runs':>10} {'graph docs':>10} {'build':>6} {'train runs':>10} {'train docs':>10} "
        f"{'runs/docs':>9} {'auto':>4}",
    ]
    route = _varlen.document_route
    for name, lens in args.varlen_route_batches:
        total = sum(lens)
        cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
        g = torch.Generator(device="cuda").manual_seed(0)
        q = torch.randn(total, H, D, device="cuda", dtype=DT, generator=g)
        k = torch.randn(total, HKV, D, device="cuda", dtype=DT, generator=g)
        v = torch.randn_like(k)
        top = max(lens)
        bounds = _varlen.check(q, k, v, cu, cu, top, top)
        auto = route(q, k, v, bounds)
        mean = total // len(_varlen._runs(bounds))
        qg, kg, vg = (x.detach().clone().requires_grad_(True) for x in (q, k, v))
        grad = torch.randn_like(q)

        def fwd(q=q, k=k, v=v, cu=cu, top=top):
            return sparse_attn.flash_attention_varlen(q, k, v, cu, cu, top, top, causal=True)

        def step(q=qg, k=kg, v=vg, cu=cu, top=top, grad=grad):
            sparse_attn.flash_attention_varlen(q, k, v, cu, cu, top, top, causal=True).backward(grad)

        times = {}
        try:
            for docs in (False, True):
                _varlen.document_route = lambda *a, docs=docs, **kw: docs
                times[docs] = (time_eager(fwd), time_eager(step, 5))
        finally:
            _varlen.document_route = route
        t_graph_runs = time_graph(fwd)  # captured: the per-run route
        mask = _varlen.document_mask(bounds, total, total, -1, 0, q.device)
        q4, k4, v4 = (x.unsqueeze(0).transpose(1, 2) for x in (q, k, v))
        t_graph_docs = time_graph(lambda q4=q4, k4=k4, v4=v4, m=mask: sparse_attn.block_sparse_attention(q4, k4, v4, m))
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(20):
            _varlen.document_mask(bounds, total, total, -1, 0, q.device)
        t_build = (time.perf_counter() - t0) / 20 * 1e3
        (f_r, t_r), (f_d, t_d) = times[False], times[True]
        rows.append(
            dict(
                table="varlen_routes",
                batch=name,
                tokens=total,
                mean_run=mean,
                fwd_runs=f_r,
                fwd_docs=f_d,
                graph_runs=t_graph_runs,
                graph_docs=t_graph_docs,
                build_host=t_build,
                train_runs=t_r,
                train_docs=t_d,
                auto="documents" if auto else "runs",
            )
        )
        out.append(
            f"{name:<20} {total:>6} {mean:>5} {f_r:>8.3f} {f_d:>8.3f} {f_r / f_d:>9.2f} {t_graph_runs:>10.3f} "
            f"{t_graph_docs:>10.3f} {t_build:>6.3f} {t_r:>10.2f} {t_d:>10.2f} {t_r / t_d:>9.2f} "
            f"{'docs' if auto else 'runs':>4}"
        )
        del q, k, v, qg, kg, vg, q4, k4, v4, mask
        torch.cuda.empty_cache()
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a few shapes only")
    parser.add_argument("--tables", nargs="+", default=["decode", "paged", "sparse", "topk", "varlen", "varlen_routes"])
    parser.add_argument("--json", help="write the rows here")
    parser.add_argument("--splits", type=int, nargs="+", help="also time these split-KV counts (decode table)")
    args = parser.parse_args(argv)
    if not require_cuda("bench_decode.py"):
        return 1
    if args.quick:
        args.shapes = [(1, 32768, 1), (8, 32768, 1), (1, 4096, 16)]
        args.paged_shapes, args.pages = [(8, 32768)], [16, 256]
        args.sparse_shapes, args.keep = [(1, 131072)], [0.1]
        args.varlen_batches = [[1024, 4096, 16384, 32768]]
        args.varlen_route_batches = [("128 x U[64,1024]", uniform_lengths(128, 64, 1024, 1))]
        args.topk_blocks = [51]
    else:
        args.shapes = [
            (b, length, lq)
            for b in (1, 8, 64)
            for length in (4096, 32768, 131072)
            for lq in (1, 16)
            if b * length <= 64 * 32768
        ]
        # Batches whose (batch, K/V head) pairs fill the SMs unevenly: 72 pairs (the balanced walk,
        # one CTA per SM), 96 (one CTA per pair), 192 (the walk, two CTAs per SM).
        args.shapes += [(9, 32768, 1), (12, 8192, 1), (24, 32768, 1)]
        args.paged_shapes, args.pages = [(1, 32768), (8, 32768)], [1, 16, 64, 256]
        args.sparse_shapes, args.keep = [(1, 131072), (8, 131072)], [0.05, 0.1, 0.25]
        args.topk_blocks = [51, 102]
        args.varlen_batches = [
            [1024, 4096, 16384, 32768],
            [1024, 2048, 3072, 8192, 8192, 12288, 32768, 1024],
            [1000, 1500, 7000, 9000, 20000, 31000],
        ]
        args.varlen_route_batches = [
            ("1k,4k,16k,32k", [1024, 4096, 16384, 32768]),
            ("1000..31000", [1000, 1500, 7000, 9000, 20000, 31000]),
            ("256 x U[16,512]", uniform_lengths(256, 16, 512, 4)),
            ("128 x U[64,1024]", uniform_lengths(128, 64, 1024, 1)),
            ("64 x U[512,1536]", uniform_lengths(64, 512, 1536, 6)),
            ("48 x U[768,2304]", uniform_lengths(48, 768, 2304, 7)),
            ("32 x U[1024,3072]", uniform_lengths(32, 1024, 3072, 8)),
            ("16 x U[1k,8k]", uniform_lengths(16, 1024, 8192, 3)),
            ("8 x U[4k,12k]", uniform_lengths(8, 4096, 12288, 9)),
        ]
    copy_bw = copy_bandwidth()
    print(f"device: {torch.cuda.get_device_name()}; copy bandwidth {copy_bw:.2f} TB/s (1 GiB, read + write)")
    rows: list[dict] = []
    tables = {
        "decode": decode_table,
        "paged": paged_table,
        "sparse": sparse_table,
        "topk": topk_table,
        "varlen": varlen_table,
        "varlen_routes": varlen_routes_table,
    }
    for name in args.tables:
        print("\n".join(tables[name](args, copy_bw, rows)), flush=True)
        print()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "copy_tbs": copy_bw, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
