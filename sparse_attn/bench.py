"""The main job: time every op and the references on this machine, print the table and a summary.

    python -m sparse_attn.bench                  # small defaults (about a minute on a CPU)
    python -m sparse_attn.bench --lengths 4096 8192 --dtype bfloat16 --batch 2 --heads 16
    python -m sparse_attn.bench --csv out/bench.csv --json out/bench.json   # + PNG plots beside them

For each case it reports the median time, the achieved rate (4 * D FLOPs per computed (query,
key) pair: the pairs the op actually computes, so sparse ops are not credited for skipped work;
GFLOP/s on the CPU, TFLOP/s on a GPU), peak extra device memory (CUDA only) and the max error
against an fp32 reference with the same mask. References run in the same process: SDPA (each
backend that accepts the case), FlexAttention (compiled on CUDA, eager on the CPU) and naive
PyTorch (matmul, softmax, matmul). The summary answers "how much faster than SDPA / Flex / naive
here, at what accuracy": per case, reference time / our time (> 1: ours is faster) next to our
error. With --csv or --json, PNG plots are written beside the file (matplotlib, when installed):
time and memory against length, speed-up and error against density.
"""

from __future__ import annotations

import argparse
import csv
import json
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

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
    length: int = 0
    density: float = 1.0  # computed pairs / (Lq * Lk) of the case


def format_table(rows: list[Row], gpu: bool) -> str:
    """The rows; the rate in TFLOP/s on a GPU, GFLOP/s on the CPU; peak memory only on a GPU (the
    CPU has no allocator statistics); notes only where a row has one."""
    unit, scale = ("TFLOP/s", 1.0) if gpu else ("GFLOP/s", 1e3)
    notes = any(r.note for r in rows)
    head = f"{'case':<34} {'impl':<26} {'ms':>9} {unit:>8}" + (f" {'peak MiB':>9}" if gpu else "") + f" {'max err':>9}"
    head += "  note" if notes else ""
    lines = [head, "-" * len(head)]
    for r in rows:
        line = f"{r.case:<34} {r.impl:<26} {r.ms:9.3f} {r.tflops * scale:8.2f}"
        if gpu:
            line += f" {r.mem_mib:9.1f}" if r.mem_mib is not None else f" {'-':>9}"
        line += f" {r.max_err:9.2e}" if r.max_err is not None else f" {'-':>9}"
        lines.append(line + (f"  {r.note}" if r.note else ""))
    return "\n".join(lines)


# Reference families of the summary: the first present of each family is the one compared.
_FAMILIES = {
    "SDPA": ("sdpa-cudnn", "sdpa", "sdpa-flash", "sdpa-efficient", "sdpa (dense)"),
    "Flex": ("flex", "flex (same mask)"),
    "naive": ("naive-pytorch",),
}


def summarize(rows: list[Row]) -> list[dict]:
    """Per case and op of ours: our time, reference time / ours for each reference family
    (> 1: ours is faster), and our max error. A sparse case without an SDPA row is compared with
    SDPA's dense attention at its length (what skipping the work saves)."""
    out = []
    timed = [r for r in rows if r.ms == r.ms]  # skipped rows are NaN
    dense_sdpa = {r.length: r.ms for r in timed if r.case.startswith("dense ") and r.impl in _FAMILIES["SDPA"]}
    for case in dict.fromkeys(r.case for r in rows):
        of_case = [r for r in timed if r.case == case]
        refs = {r.impl: r.ms for r in of_case if not r.impl.startswith("ours")}
        if of_case and not any(n in refs for n in _FAMILIES["SDPA"]) and of_case[0].length in dense_sdpa:
            refs["sdpa (dense)"] = dense_sdpa[of_case[0].length]
        for r in of_case:
            if not r.impl.startswith("ours"):
                continue
            entry = {"case": case, "impl": r.impl, "ms": r.ms, "max_err": r.max_err, "density": r.density}
            for family, names in _FAMILIES.items():
                name = next((n for n in names if n in refs), None)
                entry[f"vs {family}"] = refs[name] / r.ms if name is not None else None
                entry[f"{family} impl"] = name
            out.append(entry)
    return out


def format_summary(summary: list[dict]) -> str:
    head = f"{'case':<34} {'ours':<20} {'ms':>9}" + "".join(f" {'vs ' + f:>9}" for f in _FAMILIES) + f" {'max err':>9}"
    lines = [
        "summary: reference time / our time (> 1: ours is faster; sparse ops against SDPA's dense attention "
        "at the same length), and our max error vs fp32",
        head,
        "-" * len(head),
    ]
    for e in summary:
        cells = "".join(f" {e[f'vs {f}']:8.2f}x" if e[f"vs {f}"] is not None else f" {'-':>9}" for f in _FAMILIES)
        err = f" {e['max_err']:9.2e}" if e["max_err"] is not None else f" {'-':>9}"
        lines.append(f"{e['case']:<34} {e['impl']:<20} {e['ms']:9.3f}{cells}{err}")
    return "\n".join(lines)


def write_results(rows: list[Row], summary: list[dict], csv_path: str | None, json_path: str | None, meta: dict):
    """The rows as CSV and/or (with the summary and the run's settings) JSON; then the plots beside
    the first file written. Returns the files written."""
    written = []
    if csv_path:
        path = Path(csv_path)
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(asdict(rows[0]).keys()) if rows else ["case"])
            writer.writeheader()
            writer.writerows(asdict(r) for r in rows)
        written.append(path)
    if json_path:
        path = Path(json_path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"run": meta, "rows": [asdict(r) for r in rows], "summary": summary}, indent=1))
        written.append(path)
    if written:
        written += plot_results(rows, summary, written[0].with_suffix(""))
    return written


def plot_results(rows: list[Row], summary: list[dict], stem: Path) -> list[Path]:
    """PNG plots next to the results (stem_time.png, stem_memory.png, stem_density.png): time and
    peak memory against length per op and reference, speed-up over SDPA and max error against
    density. Nothing (and a note) without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("note: matplotlib is not installed, so no plots (pip install matplotlib)", file=sys.stderr)
        return []
    files = []
    kinds = sorted({r.case.rsplit(" L=", 1)[0] for r in rows})
    for what, attr, label in (("time", "ms", "ms (median)"), ("memory", "mem_mib", "peak extra MiB")):
        if all(getattr(r, attr) is None for r in rows):
            continue  # no memory statistics on the CPU
        fig, axes = plt.subplots(1, len(kinds), figsize=(4.2 * len(kinds), 3.6), squeeze=False)
        for ax, kind in zip(axes[0], kinds, strict=True):
            of_kind = [r for r in rows if r.case.rsplit(" L=", 1)[0] == kind and getattr(r, attr) is not None]
            for impl in dict.fromkeys(r.impl for r in of_kind):
                pts = sorted((r.length, getattr(r, attr)) for r in of_kind if r.impl == impl)
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=impl)
            ax.set(title=kind, xlabel="sequence length", ylabel=label, xscale="log", yscale="log")
            ax.legend(fontsize=6)
        fig.tight_layout()
        files.append(stem.parent / f"{stem.name}_{what}.png")
        fig.savefig(files[-1], dpi=120)
        plt.close(fig)
    sparse = [e for e in summary if e["vs SDPA"] is not None and e["density"] < 1.0]
    if sparse:
        fig, (a, b) = plt.subplots(1, 2, figsize=(9, 3.6))
        for e in sparse:
            a.scatter(e["density"], e["vs SDPA"], s=14)
            a.annotate(e["case"], (e["density"], e["vs SDPA"]), fontsize=5)
            if e["max_err"] is not None:
                b.scatter(e["density"], e["max_err"], s=14)
        a.axhline(1.0, color="grey", lw=0.5)
        a.set(xlabel="density (computed pairs / all pairs)", ylabel="SDPA time / ours", title="speed-up vs density")
        b.set(xlabel="density", ylabel="max error vs fp32", yscale="log", title="accuracy vs density")
        fig.tight_layout()
        files.append(stem.parent / f"{stem.name}_density.png")
        fig.savefig(files[-1], dpi=120)
        plt.close(fig)
    return files


def require_cuda(script: str) -> bool:
    """False, after saying what the script needs and where to go instead, when no CUDA device is
    usable (a CPU build of torch or of sparse_attn, or no GPU)."""
    if torch.cuda.is_available() and sparse_attn.cuda_kernels_available():
        return True
    why = "no CUDA device" if not torch.cuda.is_available() else "sparse_attn was built without its CUDA kernels"
    print(
        f"{script} times GPU kernels and needs a CUDA device ({why} here); on the CPU, ./scripts/bench.sh "
        "(python -m sparse_attn.bench) times every op at small sizes.",
        file=sys.stderr,
    )
    return False


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


class _Progress:
    """A progress bar (tqdm, when installed) or one line per step, on stderr."""

    def __init__(self, total: int, enabled: bool):
        self.enabled, self.total, self.done, self.bar = enabled, total, 0, None
        if enabled:
            try:
                from tqdm import tqdm

                self.bar = tqdm(total=total, file=sys.stderr, unit="run", dynamic_ncols=True)
            except ImportError:
                pass

    def step(self, what: str) -> None:
        self.done += 1
        if self.bar is not None:
            self.bar.set_description(what[:48])
            self.bar.update(1)
        elif self.enabled:
            print(f"[{self.done}/{self.total}] {what}", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def run_cases(cases: list[Case], d: int, device: torch.device, *, progress=True, length=0, full_pairs=0.0):
    rows = []
    bar = _Progress(sum(len(c.ours) + len(c.refs) for c in cases), progress)
    for case in cases:
        gold = case.gold()
        density = case.pairs / full_pairs if full_pairs else 1.0
        for impl, fn in list(case.ours.items()) + list(case.refs.items()):
            bar.step(f"{case.name}: {impl}")
            try:
                out = fn()
                err = float((out.float() - gold).abs().max()) if impl.startswith("ours") else None
                ms = time_ms(fn, device)
                mem = peak_extra_bytes(fn, device)
            except (RuntimeError, torch.OutOfMemoryError) as e:  # a backend that rejects the case
                note = f"skipped: {str(e)[:60]}"
                rows.append(Row(case.name, impl, float("nan"), float("nan"), None, None, note, length, density))
                continue
            mib = None if mem is None else mem / 2**20
            rows.append(Row(case.name, impl, ms, tflops(case.pairs, d, ms), mib, err, "", length, density))
    bar.close()
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
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    parser.add_argument("--csv", default=None, help="also write the rows as CSV (plots go beside it)")
    parser.add_argument("--json", default=None, help="also write rows, summary and settings as JSON")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    if cuda and not require_cuda("python -m sparse_attn.bench --device cuda"):
        return 2
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
        full = float(b * h * length * length)
        rows += run_cases(cases, args.head_dim, device, progress=not args.quiet, length=length, full_pairs=full)
    print(format_table(rows, cuda))
    summary = summarize(rows)
    print()
    print(format_summary(summary))
    meta = {
        "device": torch.cuda.get_device_name(device) if cuda else "cpu",
        "torch": torch.__version__,
        "dtype": str(dtype),
        "batch": b,
        "heads": h,
        "kv_heads": hkv,
        "head_dim": args.head_dim,
    }
    for path in write_results(rows, summary, args.csv, args.json, meta):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
