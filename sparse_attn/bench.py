"""The main job: time every op and the references on this machine, print one table.

    python -m sparse_attn.bench                  # small defaults (about a minute on a CPU)
    python -m sparse_attn.bench --lengths 4096 8192 --dtype bfloat16 --batch 2 --heads 16

For each case it reports the median time, achieved TFLOP/s (4 * D FLOPs per computed
(query, key) pair: the pairs the op actually computes, so sparse ops are not credited for
skipped work), peak extra device memory (CUDA only) and the max error against an fp32
reference with the same mask. References run in the same process: SDPA (each backend that
accepts the case), FlexAttention (compiled on CUDA, eager on the CPU) and naive PyTorch
(matmul, softmax, matmul).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch

import sparse_attn
from sparse_attn import patterns, reference

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


# ----------------------------------------------------------------------------------------- timing
def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_ms(fn: Callable[[], object], device: torch.device, *, min_reps: int = 3, budget_s: float = 1.0) -> float:
    """Median milliseconds of fn(). CUDA: triton's do_bench (events, L2 flushed) when available."""
    if device.type == "cuda":
        try:
            from triton.testing import do_bench

            return float(do_bench(fn, warmup=25, rep=100, return_mode="median"))
        except ImportError:
            pass
    fn()
    sync(device)
    times = []
    start = time.perf_counter()
    while len(times) < min_reps or (time.perf_counter() - start < budget_s and len(times) < 50):
        if device.type == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def time_rounds(fns: dict[str, Callable[[], object]], device: torch.device, rounds: int = 3) -> dict[str, list[float]]:
    """Milliseconds of each fn over `rounds` rounds, every fn timed once per round (time_ms), in
    rotated order. A GPU's clock drifts by several per cent over a minute of load, so ratios
    between fns taken within one round are steadier than ratios of separately timed medians
    (see ratio_median)."""
    names = list(fns)
    times: dict[str, list[float]] = {n: [] for n in names}
    for r in range(rounds):
        for n in names[r % len(names) :] + names[: r % len(names)]:
            times[n].append(time_ms(fns[n], device))
    return times


def ratio_median(num: list[float], den: list[float]) -> float:
    """Median over rounds of num[r] / den[r] (times from one time_rounds call)."""
    return statistics.median(a / b for a, b in zip(num, den, strict=True))


def peak_extra_bytes(fn: Callable[[], object], device: torch.device) -> int | None:
    """Peak device memory fn() allocates beyond what is live before it (outputs included)."""
    if device.type != "cuda":
        return None
    sync(device)
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    out = fn()
    sync(device)
    peak = torch.cuda.max_memory_allocated(device) - base
    del out
    return peak


def tflops(pairs: float, head_dim: int, ms: float) -> float:
    return 4.0 * pairs * head_dim / (ms * 1e-3) / 1e12 if ms > 0 else float("nan")


# ------------------------------------------------------------------------------------------ table
@dataclass
class Row:
    case: str
    impl: str
    ms: float
    tflops: float
    mem_mib: float | None
    max_err: float | None
    note: str = ""


def format_table(rows: list[Row]) -> str:
    head = f"{'case':<34} {'impl':<26} {'ms':>9} {'TFLOP/s':>8} {'peak MiB':>9} {'max err':>9}  note"
    lines = [head, "-" * len(head)]
    for r in rows:
        mem = f"{r.mem_mib:9.1f}" if r.mem_mib is not None else f"{'-':>9}"
        err = f"{r.max_err:9.2e}" if r.max_err is not None else f"{'-':>9}"
        lines.append(f"{r.case:<34} {r.impl:<26} {r.ms:9.3f} {r.tflops:8.2f} {mem} {err}  {r.note}")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------- references
def naive_attention(q, k, v, *, causal=False, mask=None):
    """The textbook composition in the input dtype: matmul, softmax, matmul."""
    g = q.shape[1] // k.shape[1]
    if g > 1:
        k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    s = torch.matmul(q, k.transpose(-1, -2)) * q.shape[-1] ** -0.5
    if causal:
        mask = reference.causal_mask(q.shape[2], k.shape[2], q.device)
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    return torch.matmul(torch.softmax(s, dim=-1), v)


def sdpa_backends(device: torch.device) -> dict[str, object]:
    from torch.nn.attention import SDPBackend

    if device.type == "cpu":
        return {"sdpa": None}
    return {
        "sdpa-cudnn": SDPBackend.CUDNN_ATTENTION,
        "sdpa-flash": SDPBackend.FLASH_ATTENTION,
        "sdpa-efficient": SDPBackend.EFFICIENT_ATTENTION,
    }


def run_sdpa(q, k, v, backend, *, causal=False, attn_mask=None):
    from torch.nn.attention import sdpa_kernel

    f = torch.nn.functional.scaled_dot_product_attention
    gqa = q.shape[1] != k.shape[1]
    if backend is None:
        return f(q, k, v, attn_mask=attn_mask, is_causal=causal, enable_gqa=gqa)
    with sdpa_kernel([backend]):
        return f(q, k, v, attn_mask=attn_mask, is_causal=causal, enable_gqa=gqa)


_FLEX = {}


def flex_fn(device: torch.device):
    """flex_attention, compiled on CUDA (eager on the CPU, where compiling is slow)."""
    if device.type not in _FLEX:
        from torch.nn.attention.flex_attention import flex_attention

        if device.type != "cuda":  # eager on purpose: compiling on the CPU takes minutes
            warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
        if device.type == "cuda":
            # One compile per shape and mask; past dynamo's default of 8 it would fall back to the
            # eager path, which materialises the scores (and runs out of memory at long lengths).
            torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 256)
        _FLEX[device.type] = torch.compile(flex_attention, dynamic=False) if device.type == "cuda" else flex_attention
    return _FLEX[device.type]


# ------------------------------------------------------------------------------------------ cases
@dataclass
class Case:
    name: str
    pairs: float  # computed (query, key) pairs summed over batch and heads
    ours: dict[str, Callable[[], object]]
    refs: dict[str, Callable[[], object]]
    gold: Callable[[], torch.Tensor]  # fp32 reference output with the same selection


def build_cases(b, h, hkv, lq, lk, d, dtype, device, *, seed=0, causal_only=False) -> list[Case]:
    gen = torch.Generator(device="cpu").manual_seed(seed)

    def rnd(*shape):
        return torch.randn(*shape, generator=gen).to(dtype).to(device)

    q, k, v = rnd(b, h, lq, d), rnd(b, hkv, lk, d), rnd(b, hkv, lk, d)
    cases = []
    full_pairs = float(b * h * lq * lk)
    causal_pairs = float(b * h * sum(min(lk, max(0, i + lk - lq + 1)) for i in range(lq)))
    square = lq == lk

    def gold_dense(causal):
        return lambda: reference.attention(q, k, v, causal=causal, dtype=torch.float32)[0]

    for causal in (True,) if causal_only else (False, True):
        refs = {}
        for name, backend in sdpa_backends(device).items():
            if causal and not square:
                continue  # SDPA's is_causal is top-left aligned
            refs[name] = (lambda be, c: lambda: run_sdpa(q, k, v, be, causal=c))(backend, causal)
        refs["naive-pytorch"] = (lambda c: lambda: naive_attention(q, k, v, causal=c))(causal)
        ours = {
            "ours-dense": (lambda c: lambda: sparse_attn.dense_attention(q, k, v, causal=c))(causal),
            "ours-flash": (lambda c: lambda: sparse_attn.flash_attention(q, k, v, causal=c))(causal),
        }
        if square and (device.type == "cuda" or lq <= 2048):
            bm = patterns.causal(lq, lk, device=device) if causal else None
            flex = flex_fn(device)
            if bm is not None:
                fbm = bm.to_flex_block_mask()
                refs["flex"] = lambda fbm=fbm, flex=flex: flex(q, k, v, block_mask=fbm, enable_gqa=h != hkv)
            else:
                refs["flex"] = lambda flex=flex: flex(q, k, v, enable_gqa=h != hkv)
        cases.append(
            Case(
                f"{'causal' if causal else 'dense'} L={lq}",
                causal_pairs if causal else full_pairs,
                ours,
                refs,
                gold_dense(causal),
            )
        )
    if causal_only or not square:
        return cases

    # Block-sparse patterns (and FlexAttention on the identical mask).
    window = max(lq // 8, 64)
    masks = {
        f"window w={window}": patterns.sliding_window(lq, window, device=device),
        "longformer g=64": patterns.longformer(lq, window, range(64), device=device),
        "random 10%": patterns.random_blocks(lq, 0.1, seed=seed, device=device),
    }
    for name, mask in masks.items():
        pairs = float(mask.computed_pairs().double().mean()) * b * h
        refs = {}
        if device.type == "cuda" or lq <= 2048:
            fbm = mask.to_flex_block_mask()
            flex = flex_fn(device)
            refs["flex (same mask)"] = lambda fbm=fbm, flex=flex: flex(q, k, v, block_mask=fbm, enable_gqa=h != hkv)
        cases.append(
            Case(
                f"{name} L={lq}",
                pairs,
                {"ours-block-sparse": lambda m=mask: sparse_attn.block_sparse_attention(q, k, v, m)},
                refs,
                lambda m=mask: reference.block_sparse_attention(q, k, v, m, dtype=torch.float32)[0],
            )
        )

    # Dynamic top-k, token and block mode.
    topk = max(lq // 8, 16)
    idx = sparse_attn.topk_attention(q, k, v, topk, causal=True, return_indices=True)[1]
    pairs = float((idx >= 0).sum()) * (h // idx.shape[1])
    cases.append(
        Case(
            f"topk token k={topk} causal L={lq}",
            pairs,
            {"ours-topk": lambda: sparse_attn.topk_attention(q, k, v, topk, causal=True)},
            {},
            lambda: reference.gather_attention(q, k, v, idx, dtype=torch.float32)[0],
        )
    )
    return cases


def run_cases(cases: list[Case], d: int, device: torch.device, *, progress=True) -> list[Row]:
    rows = []
    total = sum(len(c.ours) + len(c.refs) for c in cases)
    done = 0
    for case in cases:
        gold = case.gold()
        for impl, fn in list(case.ours.items()) + list(case.refs.items()):
            done += 1
            if progress:
                print(f"[{done}/{total}] {case.name}: {impl}", file=sys.stderr, flush=True)
            try:
                out = fn()
                err = float((out.float() - gold).abs().max()) if impl.startswith("ours") else None
                ms = time_ms(fn, device)
                mem = peak_extra_bytes(fn, device)
            except (RuntimeError, torch.OutOfMemoryError) as e:  # a backend that rejects the case
                rows.append(Row(case.name, impl, float("nan"), float("nan"), None, None, f"skipped: {str(e)[:60]}"))
                continue
            rows.append(Row(case.name, impl, ms, tflops(case.pairs, d, ms), None if mem is None else mem / 2**20, err))
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default=None, choices=sorted(DTYPES), help="default: bfloat16 (CUDA), float32 (CPU)")
    parser.add_argument("--lengths", type=int, nargs="+", default=None)
    parser.add_argument("--batch", type=int, default=None)
    parser.add_argument("--heads", type=int, default=None)
    parser.add_argument("--kv-heads", type=int, default=None)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--quiet", action="store_true", help="no progress lines")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    dtype = DTYPES[args.dtype] if args.dtype else (torch.bfloat16 if cuda else torch.float32)
    lengths = args.lengths or ([1024, 4096] if cuda else [256, 1024])
    b = args.batch or (2 if cuda else 1)
    h = args.heads or (16 if cuda else 4)
    hkv = args.kv_heads or h
    torch.backends.cuda.matmul.allow_tf32 = False
    print(
        f"sparse_attn {sparse_attn.__version__} | torch {torch.__version__} | device "
        f"{torch.cuda.get_device_name(device) if cuda else 'cpu'} | dtype {dtype} | B={b} H={h} Hkv={hkv} "
        f"D={args.head_dim}",
        flush=True,
    )
    rows = []
    for length in lengths:
        cases = build_cases(b, h, hkv, length, length, args.head_dim, dtype, device)
        rows += run_cases(cases, args.head_dim, device, progress=not args.quiet)
    print(format_table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
