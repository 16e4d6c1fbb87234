"""Dynamic top-k attention at long context: lightning-indexer scoring, selection and gathered
attention timed separately and end to end, against our dense causal flash_attention and SDPA's
cuDNN backend measured in the same run; plus block mode against block_sparse_attention on the
mask it selected.

    python benchmarks/bench_topk.py                                  # L = 16k..128k, k = 256..2048
    python benchmarks/bench_topk.py --lengths 16384 --ks 2048 --hkv 1 16
    python benchmarks/bench_topk.py --markdown benchmarks/results_topk.md

Shapes follow the issue: B = 1, H = 16, D = 128, bf16, causal; indexer HI = 4, DI = 64; random
inputs (timing does not depend on the data). `--hkv` sets the number of K/V heads: 1 is
DeepSeek's MQA-style sharing (every head reads the one selected row, loaded once for all 16),
16 gives each head its own K/V (16x the gathered bytes). Columns: `score` and `select` are the
indexer's scoring and selection kernels (from the profiler; filtered where the plan filters:
scoring = the sample and the filtered pass, selection = thresholds, candidates and fallback),
`unfiltered` the same selection timed with the filter off (`select_filter_stride=-1`: every
score through the workspace) in the same run, `sel / attn` = (score + select) / attn (target
<= 0.5), `attn` the gathered attention, `e2e` topk_attention end to end; `vs flash` = dense
causal flash time / e2e; `peak MiB` = memory e2e allocates, outputs included, against `L·k` =
the int32 index tensor (the O(L·k) check).

Accuracy next to speed (`--no-accuracy` skips it): `recall` and `recall p01` are the mean and 1st
percentile over every query row of the share of its dense softmax probability that the selection
covers, `rel. err` the output's Frobenius relative error against dense causal flash_attention
(`sparse_attn.analysis.evaluate`, scores in fp32). `--data random` (default: independent Gaussians,
the worst case; the indexer's inputs are drawn independently of q and k, so its selection knows
nothing of the attention) or `--data structured` (`analysis.structured_qkv`: local attention plus
heavy hitters, and `analysis.structured_indexer`: an indexer that approximates q.k, as a trained
one does).
"""

from __future__ import annotations

import argparse
import datetime
import math
import sys
from functools import partial

import torch

import sparse_attn
from sparse_attn import analysis
from sparse_attn._plan import overrides
from sparse_attn._routes import block_kernel as _run_block_sparse
from sparse_attn._routes import block_topk_mask as _block_topk_mask
from sparse_attn.bench import peak_extra_bytes, run_sdpa, sdpa_backends, time_ms


def kernel_ms(fn, names: dict[str, str]) -> dict[str, float]:
    """Milliseconds of one fn() call spent in CUDA kernels whose name contains each pattern."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    out = dict.fromkeys(names, 0.0)
    for evt in prof.key_averages():
        us = getattr(evt, "device_time_total", None)
        if us is None:
            us = evt.cuda_time_total
        for label, pattern in names.items():
            if pattern in evt.key:
                out[label] += us / 1e3
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", type=int, nargs="+", default=None)
    ap.add_argument("--ks", type=int, nargs="+", default=None)
    ap.add_argument("--hkv", type=int, nargs="+", default=[1])
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--hi", type=int, default=4)
    ap.add_argument("--di", type=int, default=64)
    ap.add_argument("--block-density", type=float, default=0.1)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--data", choices=["random", "structured"], default="random")
    ap.add_argument("--no-accuracy", dest="accuracy", action="store_false", help="timing only")
    ap.add_argument("--markdown", default=None, help="also write the tables to this file")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    lengths = args.lengths or ([16384, 32768, 65536, 131072] if cuda else [1024])
    ks = args.ks or ([256, 1024, 2048] if cuda else [64, 256])
    dtype = torch.bfloat16 if cuda else torch.float32
    h, d = args.heads, args.dim
    gen = torch.Generator(device=device).manual_seed(0)

    def rnd(*shape):
        return torch.randn(*shape, generator=gen, device=device, dtype=dtype)

    name = torch.cuda.get_device_name(device) if cuda else "cpu"
    head = f"# top-k attention, {name}, {dtype}, B=1 H={h} D={d} HI={args.hi} DI={args.di}, causal, {args.data} data"
    lines = [head + f", torch {torch.__version__}", f"# {datetime.datetime.now():%Y-%m-%d %H:%M}", ""]
    token_rows, block_rows = [], []
    for length in lengths:
        for hkv in args.hkv:
            if args.data == "structured":
                q, k, v = analysis.structured_qkv(1, h, length, d, dtype=dtype, device=device)
                k, v = k[:, :hkv].contiguous(), v[:, :hkv].contiguous()
                iq, ik, iw = analysis.structured_indexer(q, k, index_heads=args.hi, index_dim=args.di)
                inputs = dict(q=q, k=k, v=v, iq=iq, ik=ik, iw=iw)
                del q, k, v, iq, ik, iw
            else:
                inputs = dict(
                    q=rnd(1, h, length, d), k=rnd(1, hkv, length, d), v=rnd(1, hkv, length, d),
                    iq=rnd(1, length, args.hi, args.di), ik=rnd(1, length, args.di),
                    iw=torch.rand(1, length, args.hi, generator=gen, device=device).to(dtype),
                )  # fmt: skip
            t, b = measure_length(inputs, ks, args.block_density, device, args.accuracy)
            token_rows += t
            block_rows += b
            del inputs

    lines += ["## token mode (lightning indexer)", "", _TOKEN_HEAD, _sep(_TOKEN_HEAD)]
    lines += [_token_line(r) for r in token_rows]
    lines += [
        "",
        f"## block mode, {args.block_density:.0%} of key blocks (128), causal",
        "",
        _BLOCK_HEAD,
        _sep(_BLOCK_HEAD),
    ]
    lines += [_block_line(r) for r in block_rows]
    text = "\n".join(lines)
    print()
    print(text)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(text + "\n")
    return 0


def measure_length(x: dict, ks: list[int], block_density: float, device: torch.device, accuracy: bool = True):
    """The token-mode rows (one per k) and the block-mode row of one set of inputs."""
    q, k, v, iq, ik, iw = (x[n] for n in ("q", "k", "v", "iq", "ik", "iw"))
    cuda = device.type == "cuda"
    length, h, hkv, d = q.shape[2], q.shape[1], k.shape[1], q.shape[3]
    flash_ms = time_ms(partial(sparse_attn.flash_attention, q, k, v, causal=True), device)
    cudnn_ms = float("nan")
    if cuda and hkv == h:  # cuDNN's SDPA takes no GQA
        try:
            cudnn_ms = time_ms(partial(run_sdpa, q, k, v, sdpa_backends(device)["sdpa-cudnn"], causal=True), device)
        except RuntimeError as e:  # not every build/shape has it
            print(f"sdpa-cudnn unavailable: {e}", file=sys.stderr)
    dense = sparse_attn.flash_attention(q, k, v, causal=True) if accuracy else None

    def quality(method) -> dict:
        """Recall and output error of one method on these inputs (NaN when not measured)."""
        if not accuracy:
            return dict(recall=math.nan, recall_p01=math.nan, rel_err=math.nan)
        r = analysis.evaluate(q, k, v, method, causal=True, reference=dense)
        return dict(recall=r.recall_mean, recall_p01=r.recall_p01, rel_err=r.rel_error)

    token_rows = []
    for kk in ks:
        sel = partial(torch.ops.sparse_attn.indexer_select, iq, ik, iw, kk, True)
        idx = sel()
        e2e = partial(sparse_attn.topk_attention, q, k, v, kk, causal=True, index_query=iq, index_key=ik,
                      index_weights=iw)  # fmt: skip
        sel_ms = time_ms(sel, device)
        with overrides(select_filter_stride=-1):
            unfiltered_ms = time_ms(sel, device)
        attn_ms = time_ms(partial(torch.ops.sparse_attn.gather_fwd, q, k, v, idx), device)
        e2e_ms = time_ms(e2e, device)
        split = kernel_ms(sel, {"score": "topk_score", "all": "topk_"}) if cuda else {}
        score = split.get("score", float("nan"))
        token_rows.append(
            dict(L=length, hkv=hkv, k=kk, score=score, select=split.get("all", sel_ms) - (score if cuda else 0.0),
                 unfiltered=unfiltered_ms, sel=sel_ms, attn=attn_ms, e2e=e2e_ms, flash=flash_ms, cudnn=cudnn_ms,
                 peak=peak_extra_bytes(e2e, device), idx_bytes=idx.numel() * 4,
                 **quality(("indexer", kk, iq, ik, iw)))
        )  # fmt: skip
        print(_token_line(token_rows[-1]), flush=True)
        del idx
    # Block mode: k blocks = density x key blocks, against the kernel on the same mask.
    kb = max(1, round(block_density * math.ceil(length / 128)))
    mask, _ = _block_topk_mask(q, k, kb, 128, True)
    score_ms = time_ms(partial(_block_topk_mask, q, k, kb, 128, True), device)
    bs_ms = time_ms(partial(_run_block_sparse, q, k, v, mask, d**-0.5), device)
    e2e_ms = time_ms(partial(sparse_attn.topk_attention, q, k, v, kb, block_size=128, causal=True), device)
    block = dict(L=length, hkv=hkv, k=kb, score=score_ms, bs=bs_ms, e2e=e2e_ms, flash=flash_ms,
                 **quality(("block", kb, 128)))  # fmt: skip
    print(_block_line(block), flush=True)
    return token_rows, [block]


_TOKEN_HEAD = (
    "| L | Hkv | k | score ms | select ms | unfiltered ms | sel / attn | attn ms | e2e ms | flash causal ms "
    "| cuDNN causal ms | vs flash | peak MiB | L·k MiB | recall | recall p01 | rel. err |"
)
_BLOCK_HEAD = (
    "| L | Hkv | k blocks | score+select ms | block-sparse ms | e2e ms | e2e / (score + bs) | vs flash "
    "| recall | recall p01 | rel. err |"
)


def _sep(head: str) -> str:
    return "|" + "---|" * (head.count("|") - 1)


def _token_line(r) -> str:
    peak = f"{r['peak'] / 2**20:.0f}" if r["peak"] is not None else "-"
    return (
        f"| {r['L']} | {r['hkv']} | {r['k']} | {r['score']:.3f} | {r['select']:.3f} | {r['unfiltered']:.3f} "
        f"| {r['sel'] / r['attn']:.2f} | {r['attn']:.3f} | {r['e2e']:.3f} | {r['flash']:.3f} | {r['cudnn']:.3f} "
        f"| {r['flash'] / r['e2e']:.2f} | {peak} | {r['idx_bytes'] / 2**20:.0f} | {_quality(r)} |"
    )


def _quality(r) -> str:
    return f"{r['recall']:.4f} | {r['recall_p01']:.4f} | {r['rel_err']:.3g}"


def _block_line(r) -> str:
    return (
        f"| {r['L']} | {r['hkv']} | {r['k']} | {r['score']:.3f} | {r['bs']:.3f} | {r['e2e']:.3f} "
        f"| {r['e2e'] / (r['score'] + r['bs']):.2f} | {r['flash'] / r['e2e']:.2f} | {_quality(r)} |"
    )


if __name__ == "__main__":
    sys.exit(main())
