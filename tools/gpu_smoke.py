"""Quick GPU correctness sweep (a subset of the test suite) with one line per case; for the
first look at a new kernel on the device. Exit code 1 if any case fails."""

import itertools
import sys
import traceback

import torch

sys.path.insert(0, "tests")
from utils import check_attention, make_qkv  # noqa: E402

import sparse_attn  # noqa: E402
from sparse_attn import patterns  # noqa: E402

failures = 0


def case(name, fn, *args):
    global failures
    try:
        fn(*args)
        print(f"ok   {name}")
    except Exception as e:  # noqa: BLE001
        failures += 1
        print(f"FAIL {name}: {type(e).__name__}: {str(e)[:300]}")
        traceback.print_exc(limit=2, file=sys.stderr)


def flash_case(dtype, d, causal, lq, lk, h, hkv, layout, window=None):
    q, k, v = make_qkv(2, h, hkv, lq, lk, d, dtype=dtype, device="cuda", layout=layout)
    out, lse = sparse_attn.flash_attention(q, k, v, causal=causal, window=window, return_lse=True)
    mask = None
    if window is not None:
        i = torch.arange(lq, device="cuda")[:, None]
        j = torch.arange(lk, device="cuda")[None, :]
        rel = j - i - (lk - lq)
        mask = (rel >= -window[0]) & (rel <= window[1])
    check_attention(out, lse, q, k, v, causal=causal, mask=mask)


for dtype, d, causal, (lq, lk), (h, hkv), layout in itertools.product(
    (torch.bfloat16, torch.float16, torch.float32),
    (64, 128, 256, 40),
    (False, True),
    ((1, 1), (17, 129), (129, 17), (257, 1000), (1000, 1000)),
    ((4, 4), (4, 1)),
    ("bhld", "blhd"),
):
    if dtype == torch.float32 and (layout == "blhd" or d == 40):
        continue
    case(
        f"flash {dtype} d={d} causal={causal} Lq={lq} Lk={lk} H={h}/{hkv} {layout}",
        flash_case,
        dtype,
        d,
        causal,
        lq,
        lk,
        h,
        hkv,
        layout,
    )

for window in ((64, 0), (100, 100), (0, 300)):
    case(f"flash window {window}", flash_case, torch.bfloat16, 128, False, 700, 900, 4, 2, "blhd", window)

for dtype in (torch.bfloat16, torch.float32):
    for causal in (False, True):

        def dense(dtype=dtype, causal=causal):
            q, k, v = make_qkv(2, 4, 2, 300, 500, 64, dtype=dtype, device="cuda")
            out, lse = sparse_attn.dense_attention(q, k, v, causal=causal, return_lse=True)
            check_attention(out, lse, q, k, v, causal=causal)

        case(f"dense {dtype} causal={causal}", dense)

for dtype in (torch.bfloat16, torch.float16, torch.float32):
    for d in (64, 128):
        for bs in (64, 128, (64, 128), (128, 64)):

            def bsp(dtype=dtype, d=d, bs=bs):
                L = 700
                q, k, v = make_qkv(2, 4, 2, L, L, d, dtype=dtype, device="cuda", layout="blhd")
                for mask in (
                    patterns.causal(L, L, block_size=bs, device="cuda"),
                    patterns.longformer(L, 90, [0, 5, 400], block_size=bs, device="cuda"),
                    patterns.random_blocks(L, 0.3, seed=1, heads=4, block_size=bs, device="cuda"),
                    patterns.dilated(L, 200, 3, block_size=bs, device="cuda"),
                ):
                    out, lse = sparse_attn.block_sparse_attention(q, k, v, mask, return_lse=True)
                    check_attention(out, lse, q, k, v, mask=mask.to_dense())

            case(f"block_sparse {dtype} d={d} block={bs}", bsp)

print(f"{failures} failures")
sys.exit(1 if failures else 0)
