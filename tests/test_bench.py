"""The benchmark's interleaved timing (sparse_attn.bench.time_rounds, ratio_median): every function is
timed once per round in rotated order, and ratios are taken within a round. And the block-sparse
benchmark's patterns: each builder names the pairs of its Flex mask_mod; without CUDA it exits
with a message."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from sparse_attn import bench


def test_time_rounds_times_each_fn_once_per_round_in_rotated_order(monkeypatch):
    calls = []
    monkeypatch.setattr(bench, "time_ms", lambda fn, device: fn())
    fns = {n: (lambda n=n: calls.append(n) or float(len(calls))) for n in ("a", "b", "c")}
    times = bench.time_rounds(fns, torch.device("cpu"), rounds=4)
    assert calls == ["a", "b", "c", "b", "c", "a", "c", "a", "b", "a", "b", "c"]
    # Each fn's list holds its own timings, round by round (here: the call's position).
    assert times == {"a": [1.0, 6.0, 8.0, 10.0], "b": [2.0, 4.0, 9.0, 11.0], "c": [3.0, 5.0, 7.0, 12.0]}


def test_ratio_median_pairs_rounds():
    # A drift that doubles every time between rounds cancels in per-round ratios, not in medians.
    ours, ref = [1.0, 2.0, 4.0, 8.0, 16.0], [1.1, 2.2, 4.4, 8.8, 17.6]
    assert bench.ratio_median(ref, ours) == pytest.approx(1.1)
    with pytest.raises(ValueError):
        bench.ratio_median([1.0], [1.0, 2.0])


def test_time_rounds_on_the_cpu():
    x = torch.randn(64, 64)
    times = bench.time_rounds({"mm": lambda: x @ x, "add": lambda: x + x}, torch.device("cpu"), rounds=2)
    assert set(times) == {"mm", "add"} and all(len(v) == 2 and min(v) > 0 for v in times.values())


def _load_benchmark(name: str):
    path = Path(__file__).resolve().parents[1] / "benchmarks" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _bench_block_sparse():
    return _load_benchmark("bench_block_sparse")


@pytest.mark.parametrize("length", [1536, 4500])
def test_block_sparse_benchmark_builders_match_their_mask_mods(length):
    # The benchmark times each pattern's route on the mask `patterns` builds and compares it with
    # the block kernel on the mask Flex built from the mask_mod: both must name the same pairs.
    # BigBird's builder draws its random blocks differently; it serves the construction table only.
    mods = _bench_block_sparse().flex_mask_mods(length, "cpu")
    assert "window 1024 causal" in mods
    q, kv = torch.arange(length)[:, None], torch.arange(length)[None, :]
    for name, (mask_mod, build) in mods.items():
        if name.startswith("bigbird"):
            continue
        got = build().to_dense().reshape(length, length)
        assert torch.equal(got, mask_mod(0, 0, q, kv)), name


def test_block_sparse_benchmark_without_cuda_exits_with_a_message(monkeypatch, capsys):
    # GPU-only: without a CUDA device it says so and where to go instead, rather than failing deep
    # inside torch.cuda.
    module = _bench_block_sparse()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert module.main(["--lengths", "1024", "--build-lengths"]) == 2
    err = capsys.readouterr().err
    assert "needs a CUDA device" in err and "sparse_attn.bench" in err


def test_main_job_writes_summary_csv_json_and_plots(tmp_path, capsys):
    # The main job on the CPU at one tiny length: the summary gives reference / ours per family,
    # sparse cases against SDPA's dense attention; the files (and plots, with matplotlib) exist.
    pytest.importorskip("matplotlib")
    csv_path, json_path = tmp_path / "r" / "bench.csv", tmp_path / "r" / "bench.json"
    args = ["--device", "cpu", "--lengths", "512", "--quiet", "--csv", str(csv_path), "--json", str(json_path)]
    assert bench.main(args) == 0  # the CPU's table on a GPU machine too
    out = capsys.readouterr().out
    assert "GFLOP/s" in out and "peak MiB" not in out and "summary:" in out
    data = __import__("json").loads(json_path.read_text())
    summary = {(e["case"], e["impl"]): e for e in data["summary"]}
    flash = summary[("dense L=512", "ours-flash")]
    rows = {(r["case"], r["impl"]): r for r in data["rows"]}
    assert flash["vs SDPA"] == pytest.approx(
        rows[("dense L=512", "sdpa")]["ms"] / rows[("dense L=512", "ours-flash")]["ms"]
    )
    window = next(e for e in data["summary"] if e["case"].startswith("window"))
    assert window["SDPA impl"] == "sdpa (dense)" and window["density"] < 1 and window["max_err"] < 1e-4
    assert csv_path.read_text().splitlines()[0].startswith("case,impl,ms,tflops")
    assert (tmp_path / "r" / "bench_time.png").stat().st_size > 0
    assert (tmp_path / "r" / "bench_density.png").stat().st_size > 0


@pytest.mark.parametrize("script", ["bench_flash.py", "bench_block_sparse.py"])
def test_gpu_benchmarks_without_cuda_exit_with_a_message(monkeypatch, capsys, script):
    module = _load_benchmark(script[:-3])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert module.main([]) == 2
    assert "needs a CUDA device" in capsys.readouterr().err
    assert bench.main(["--device", "cuda"]) == 2


def test_topk_benchmark_reports_accuracy_next_to_speed(capsys):
    """bench_topk on the CPU: each row carries the selection's softmax-mass recall and output error.
    On structured data (an indexer that approximates q.k) the recall is high and grows with k; on
    random data (an indexer drawn independently of q and k) the same k recovers less."""
    bench_topk = _load_benchmark("bench_topk")

    def rows(data):
        assert bench_topk.main(["--device", "cpu", "--lengths", "512", "--ks", "32", "128", "--data", data]) == 0
        lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("| 512 |")]
        token, block = lines[3:5], lines[5]  # the rows as measured (3), then the final tables (3)
        recall = [float(ln.split("|")[-4]) for ln in token]
        return recall, float(block.split("|")[-4]), [float(ln.split("|")[-2]) for ln in token]

    recall_s, block_s, err_s = rows("structured")
    recall_r, _, _ = rows("random")
    assert 0.0 < recall_s[0] < recall_s[1] <= 1.0 and 0.0 < block_s <= 1.0
    assert recall_r[0] < recall_s[0] and recall_r[1] < recall_s[1]
    assert err_s[1] < err_s[0] and all(e >= 0 for e in err_s)
