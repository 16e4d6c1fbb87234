"""Time the builders of ``sparse_attn.patterns`` (issue 4: building a mask must cost at most 5% of the
attention that uses it; at L = 131072 that attention takes a few milliseconds on an H200).

    python tools/time_mask_build.py --device cuda            # L = 131072, block 128
    python tools/time_mask_build.py --device cpu --length 32768 --block-size 64
    python tools/time_mask_build.py --device meta            # data-dependence check: meta holds no data

One row per pattern, medians over ``--repeat`` builds after ``--warmup`` builds:

- ``wall ms``: from the call until the mask is ready (on CUDA: until the GPU has finished its work).
- ``host ms``: until the builder returns, without waiting for the GPU (what the Python thread pays).
- ``gpu ms``: between CUDA events recorded before and after the build (CUDA only).
- ``cold wall ms``: as ``wall ms`` with the builders' cached host work cleared before each build
  (``_mask_compiler._clear_plans``: a first build with these arguments).
- ``aten ops``: operators dispatched during one build, counted with a ``TorchDispatchMode``;
  ``on device`` is those touching a tensor on the target device that are not views (about one
  kernel launch each on a GPU; tensor copies to the device included).
- ``syncs``: host-device synchronisations during one build (CUDA only, from
  ``torch.cuda.set_sync_debug_mode("warn")``).

On ``meta`` a builder that needs data on the device (``.item()``, ``nonzero``, ``torch.unique``, ...)
fails; the row says so (its times are no guide: meta kernels run largely in Python).
On the CPU the device ops work on the (nQb, nKb) tables for real, so at long lengths they dominate;
at a short length (``--length 2048``) the CPU times approximate the host cost of a GPU build.
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

try:
    from sparse_attn import _mask_compiler, patterns
except ImportError:  # no built extension here (e.g. a bare GPU machine): the pattern library needs none
    import pathlib
    import sys
    import types

    pkg = types.ModuleType("sparse_attn")
    pkg.__path__ = [str(pathlib.Path(__file__).resolve().parents[1] / "sparse_attn")]
    sys.modules["sparse_attn"] = pkg
    from sparse_attn import _mask_compiler, patterns


def cases(length: int, block: int):
    """(name, builder taking a device) at sequence length ``length``."""
    bs = dict(block_size=block)
    return [
        ("causal", lambda d: patterns.causal(length, length, device=d, **bs)),
        ("causal compact=False", lambda d: patterns.causal(length, length, device=d, compact=False, **bs)),
        ("random 10%", lambda d: patterns.random_blocks(length, 0.1, seed=0, device=d, **bs)),
        ("sliding_window 1024", lambda d: patterns.sliding_window(length, 1024, device=d, **bs)),
        ("sliding_window 4096", lambda d: patterns.sliding_window(length, 4096, device=d, **bs)),
        ("sliding_window 1024 causal", lambda d: patterns.sliding_window(length, 1024, causal=True, device=d, **bs)),
        ("dilated 2048 r=2", lambda d: patterns.dilated(length, 2048, 2, device=d, **bs)),
        ("dilated_2d 2048 r=2", lambda d: patterns.dilated_2d(length, 2048, 2, device=d, **bs)),
        ("strided 4096 local=256", lambda d: patterns.strided(length, 4096, 256, device=d, **bs)),
        ("global_tokens 64", lambda d: patterns.global_tokens(length, range(64), device=d, **bs)),
        ("longformer 512 g=64", lambda d: patterns.longformer(length, 512, range(64), device=d, **bs)),
        ("bigbird 256 g=64 r=3", lambda d: patterns.bigbird(length, 256, 64, 3, seed=0, device=d, **bs)),
        ("bigbird 256 g=64 r=3 h=16", lambda d: patterns.bigbird(length, 256, 64, 3, seed=0, heads=16, device=d, **bs)),
    ]


class CountOps(TorchDispatchMode):
    def __init__(self, device: torch.device):
        super().__init__()
        self.device = device
        self.total = 0
        self.on_device = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.total += 1
        tensors = [t for t in tree_flatten((args, kwargs, out))[0] if isinstance(t, torch.Tensor)]
        if not func.is_view and any(t.device.type == self.device.type for t in tensors):
            self.on_device += 1
        return out


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(build, device: torch.device, warmup: int, repeat: int) -> dict:
    for _ in range(warmup):
        build(device)
    sync(device)
    cold = []
    for _ in range(repeat):
        _mask_compiler._clear_plans()
        t0 = time.perf_counter()
        build(device)
        sync(device)
        cold.append((time.perf_counter() - t0) * 1e3)
    wall, host, gpu = [], [], []
    for _ in range(repeat):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        t0 = time.perf_counter()
        build(device)
        t1 = time.perf_counter()
        if device.type == "cuda":
            end.record()
        sync(device)
        t2 = time.perf_counter()
        host.append((t1 - t0) * 1e3)
        wall.append((t2 - t0) * 1e3)
        if device.type == "cuda":
            gpu.append(start.elapsed_time(end))
    counter = CountOps(device)
    with counter:
        build(device)
    syncs = None
    if device.type == "cuda":
        sync(device)
        torch.cuda.set_sync_debug_mode("warn")
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                build(device)
            syncs = sum("synchroniz" in str(w.message) for w in caught)
        finally:
            torch.cuda.set_sync_debug_mode(0)
    return {
        "wall": statistics.median(wall),
        "host": statistics.median(host),
        "gpu": statistics.median(gpu) if gpu else None,
        "cold": statistics.median(cold),
        "ops": counter.total,
        "dev_ops": counter.on_device,
        "syncs": syncs,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--length", type=int, default=131072)
    parser.add_argument("--block-size", type=int, default=128)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeat", type=int, default=10)
    parser.add_argument("-k", default="", help="only patterns whose name contains this")
    args = parser.parse_args()
    device = torch.device(args.device)
    print(f"L = {args.length}, block {args.block_size}, device {device}, torch {torch.__version__}")
    print("| pattern | wall ms | host ms | gpu ms | cold wall ms | aten ops | on device | syncs |")
    print("|---|---|---|---|---|---|---|---|")
    for name, build in cases(args.length, args.block_size):
        if args.k not in name:
            continue
        try:
            r = measure(build, device, args.warmup, args.repeat)
        except Exception as e:  # noqa: BLE001  (one failing builder must not hide the others)
            print(f"| {name} | {type(e).__name__}: {str(e).splitlines()[0][:80]} | | | | | | |")
            continue

        def fmt(x):
            return "" if x is None else f"{x:.3f}" if isinstance(x, float) else str(x)

        cols = (r["wall"], r["host"], r["gpu"], r["cold"], r["ops"], r["dev_ops"], r["syncs"])
        print(f"| {name} | " + " | ".join(fmt(c) for c in cols) + " |")


if __name__ == "__main__":
    main()
