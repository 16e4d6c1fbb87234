"""attention_with_kvcache: against per-sequence attention over the cached + new tokens (fp64
reference, FlashAttention's 2x rule), on contiguous and paged caches (shuffled pages of 1 to 256
tokens), with appends, GQA, causal and windows, sparse decode masks, CUDA graph replay and the
argument checks. Cache slots no sequence owns hold NaN: they must never reach an output."""

from __future__ import annotations

import pytest
import torch
from utils import check_close

import sparse_attn
from sparse_attn import BlockSparseMask, reference

NAN = float("nan")


class Cache:
    """A filled cache (contiguous or paged) and the per-sequence history it holds."""

    def __init__(self, b, hkv, d, dv, seqlens, cap, *, page_size=None, dtype, device, seed=0, spare_pages=3):
        g = torch.Generator().manual_seed(seed)
        self.seqlens = list(seqlens)
        self.hist_k = [torch.randn(hkv, n, d, generator=g).to(dtype) for n in seqlens]
        self.hist_v = [torch.randn(hkv, n, dv, generator=g).to(dtype) for n in seqlens]
        self.page_size = page_size
        if page_size is None:
            k = torch.full((b, hkv, cap, d), NAN, dtype=dtype)
            v = torch.full((b, hkv, cap, dv), NAN, dtype=dtype)
            for i, n in enumerate(seqlens):
                k[i, :, :n] = self.hist_k[i]
                v[i, :, :n] = self.hist_v[i]
            self.block_table = None
        else:
            pages = cap // page_size
            num_pages = b * pages + spare_pages
            table = torch.randperm(num_pages, generator=g)[: b * pages].view(b, pages).to(torch.int32)
            k = torch.full((num_pages, page_size, hkv, d), NAN, dtype=dtype)
            v = torch.full((num_pages, page_size, hkv, dv), NAN, dtype=dtype)
            for i, n in enumerate(seqlens):
                for t in range(n):
                    k[table[i, t // page_size], t % page_size] = self.hist_k[i][:, t]
                    v[table[i, t // page_size], t % page_size] = self.hist_v[i][:, t]
            self.block_table = table.to(device)
        self.k, self.v = k.to(device), v.to(device)
        self.lens = torch.tensor(seqlens, dtype=torch.int32, device=device)

    def token(self, cache, b, t):
        """(Hkv, D) of token t of sequence b in ``cache``."""
        if self.block_table is None:
            return cache[b, :, t]
        return cache[int(self.block_table[b, t // self.page_size]), t % self.page_size]


def expected(cache: Cache, q, k_new, v_new, *, causal=True, window=(-1, -1), block_sel=None, kv_block=64):
    """Per sequence: fp64 and low-precision references over history (+ new tokens)."""
    outs, lps, lses = [], [], []
    lq = q.shape[2]
    for b in range(len(cache.seqlens)):
        k = cache.hist_k[b].to(q.device)
        v = cache.hist_v[b].to(q.device)
        if k_new is not None:
            k = torch.cat([k, k_new[b]], dim=1)
            v = torch.cat([v, v_new[b]], dim=1)
        lk = k.shape[1]
        i = torch.arange(lq, device=q.device)[:, None] + (lk - lq)
        j = torch.arange(lk, device=q.device)[None, :]
        mask = torch.ones(lq, lk, dtype=torch.bool, device=q.device)
        left, right = window
        if causal:
            right = 0
        if left >= 0:
            mask &= j >= i - left
        if right >= 0:
            mask &= j <= i + right
        mask = mask[None, None].expand(1, q.shape[1], lq, lk)
        if block_sel is not None:  # (Bm, Hm, nKb) bool
            sel = block_sel[min(b, block_sel.shape[0] - 1)].repeat_interleave(kv_block, dim=-1)[:, :lk]
            sel = sel.repeat_interleave(q.shape[1] // sel.shape[0], dim=0)
            mask = mask & sel[None, :, None, :].to(q.device)
        o, lse = reference.attention(q[b : b + 1], k[None], v[None], mask=mask)
        lp, _ = reference.attention(q[b : b + 1], k[None], v[None], mask=mask, dtype=q.dtype)
        outs.append(o)
        lps.append(lp)
        lses.append(lse)
    return torch.cat(outs), torch.cat(lps), torch.cat(lses)


def run_case(
    device,
    *,
    b=2,
    h=4,
    hkv=2,
    lq=1,
    d=64,
    dv=None,
    seqlens=(5, 70),
    cap=128,
    page_size=None,
    append=True,
    causal=True,
    window=None,
    dtype=torch.bfloat16,
    seed=0,
):
    dv = d if dv is None else dv
    cache = Cache(b, hkv, d, dv, seqlens, cap, page_size=page_size, dtype=dtype, device=device, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    q = torch.randn(b, h, lq, d, generator=g).to(dtype).to(device)
    k_new = v_new = None
    if append:
        k_new = torch.randn(b, hkv, lq, d, generator=g).to(dtype).to(device)
        v_new = torch.randn(b, hkv, lq, dv, generator=g).to(dtype).to(device)
    out, lse = sparse_attn.attention_with_kvcache(
        q,
        cache.k,
        cache.v,
        cache.lens,
        key=k_new,
        value=v_new,
        block_table=cache.block_table,
        causal=causal,
        window=window,
        return_lse=True,
    )
    wl, wr = (-1, -1) if window is None else ((window, window) if isinstance(window, int) else window)
    gold, lp, gold_lse = expected(cache, q, k_new, v_new, causal=causal, window=(wl, wr))
    check_close("out", out, gold, lp, dtype=dtype)
    finite = torch.isfinite(gold_lse)
    assert torch.equal(torch.isfinite(lse), finite)
    torch.testing.assert_close(lse[finite].double(), gold_lse[finite], atol=2e-2, rtol=0)
    if append:  # the new tokens landed at cache_seqlens[b] + i, in the right pages
        for i, n in enumerate(seqlens):
            for t in range(lq):
                assert torch.equal(cache.token(cache.k, i, n + t), k_new[i, :, t])
                assert torch.equal(cache.token(cache.v, i, n + t), v_new[i, :, t])
    return out


@pytest.mark.parametrize("page_size", [None, 1, 16, 64])
@pytest.mark.parametrize("lq", [1, 5])
@pytest.mark.parametrize("append", [True, False])
def test_cache_layouts(device, page_size, lq, append):
    run_case(device, lq=lq, page_size=page_size, append=append, seqlens=(7, 64 + 9 * lq))


@pytest.mark.parametrize("h,hkv", [(4, 4), (8, 2), (8, 1)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_gqa_and_dtypes(device, h, hkv, dtype):
    run_case(device, h=h, hkv=hkv, lq=3, dtype=dtype, page_size=16)


@pytest.mark.parametrize("causal,window", [(False, None), (True, 20), (False, (30, 2)), (True, (0, None))])
def test_masks(device, causal, window):
    run_case(device, lq=6, causal=causal, window=window, seqlens=(3, 100), page_size=16)


@pytest.mark.parametrize("d,dv", [(128, 128), (32, 32), (64, 32)])
def test_head_dims(device, d, dv):
    run_case(device, d=d, dv=dv, lq=2)


def test_empty_cache_rows_see_nothing(device):
    # No history and no append: every row sees no key (0, LSE -inf), never NaN.
    cache = Cache(2, 2, 64, 64, (0, 0), 64, dtype=torch.bfloat16, device=device)
    q = torch.randn(2, 4, 1, 64, dtype=torch.bfloat16, device=device)
    out, lse = sparse_attn.attention_with_kvcache(q, cache.k, cache.v, cache.lens, return_lse=True)
    assert torch.equal(out, torch.zeros_like(out))
    assert torch.isneginf(lse).all()


def test_sparse_decode_mask(device):
    sparse_decode_case(device)


def sparse_decode_case(device, *, b=2, h=4, hkv=2, lq=1, d=64, cap=512):
    cache = Cache(b, hkv, d, d, (300, 450, 0, 500)[:b], cap, page_size=64, dtype=torch.bfloat16, device=device)
    g = torch.Generator().manual_seed(3)
    sel = torch.rand(b, hkv, 1, cap // 64, generator=g) < 0.4
    sel[..., 0] = True  # the first block (attention sinks) always
    mask = BlockSparseMask.from_block_matrix(sel.to(device), seq_lengths=(lq, cap), block_size=(64, 64))
    q = torch.randn(b, h, lq, d, generator=g).to(torch.bfloat16).to(device)
    kn = torch.randn(b, hkv, lq, d, generator=g).to(torch.bfloat16).to(device)
    vn = torch.randn(b, hkv, lq, d, generator=g).to(torch.bfloat16).to(device)
    out = sparse_attn.attention_with_kvcache(
        q, cache.k, cache.v, cache.lens, key=kn, value=vn, block_table=cache.block_table, mask=mask
    )
    gold, lp, _ = expected(cache, q, kn, vn, block_sel=sel[:, :, 0], kv_block=64)
    check_close("sparse decode", out, gold, lp, dtype=torch.bfloat16)


def test_decode_steps_match_prefill(device):
    # Generating token by token with the cache equals causal flash attention over the sequence.
    b, h, hkv, d, n = 1, 4, 2, 64, 24
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(b, hh, n, d, generator=g).to(device) for hh in (h, hkv, hkv))
    full = sparse_attn.flash_attention(q, k, v, causal=True)
    kc = torch.zeros(b, hkv, 32, d, device=device)
    vc = torch.zeros(b, hkv, 32, d, device=device)
    lens = torch.zeros(b, dtype=torch.int32, device=device)
    steps = []
    for t in range(n):
        sl = slice(t, t + 1)
        steps.append(sparse_attn.attention_with_kvcache(q[:, :, sl], kc, vc, lens, key=k[:, :, sl], value=v[:, :, sl]))
        lens += 1
    torch.testing.assert_close(torch.cat(steps, dim=2), full, atol=1e-5, rtol=1e-5)


# ---- argument checks ----


def _args(device="cpu", paged=False):
    q = torch.randn(2, 4, 1, 64, device=device)
    if paged:
        kc = torch.zeros(6, 16, 2, 64, device=device)
        bt = torch.tensor([[0, 1, 2], [3, 4, 5]], dtype=torch.int32, device=device)
    else:
        kc = torch.zeros(2, 2, 48, 64, device=device)
        bt = None
    lens = torch.tensor([3, 4], dtype=torch.int32, device=device)
    return q, kc, kc.clone(), lens, bt


@pytest.mark.parametrize(
    "change,match",
    [
        (lambda a: a.update(lens=a["lens"].long()), "cache_seqlens must be int32"),
        (lambda a: a.update(lens=a["lens"][:1]), "cache_seqlens must be 1-D"),
        (lambda a: a.update(q=a["q"][..., :32]), "head dimension must be query's"),
        (lambda a: a.update(vc=a["vc"][:, :1]), "agree in all but the last dimension"),
        (lambda a: a.update(q=a["q"][:, :3]), "multiple of the cache's K/V heads"),
        (lambda a: a.update(kc=a["kc"].half()), "key_cache must have query's dtype"),
        (lambda a: a.update(key=torch.zeros(2, 2, 1, 64)), "key and value must be given together"),
        (lambda a: a.update(key=torch.zeros(2, 2, 2, 64), value=torch.zeros(2, 2, 2, 64)), "key must have shape"),
    ],
)
def test_bad_shapes(change, match):
    q, kc, vc, lens, _ = _args()
    a = {"q": q, "kc": kc, "vc": vc, "lens": lens}
    change(a)
    with pytest.raises(RuntimeError, match=match):
        sparse_attn.attention_with_kvcache(a["q"], a["kc"], a["vc"], a["lens"], key=a.get("key"), value=a.get("value"))


def test_bad_values(device):
    q, kc, vc, lens, bt = _args(device, paged=True)
    kn = torch.zeros(2, 2, 1, 64, device=device)
    with pytest.raises(ValueError, match=r"cache_seqlens\[1\] = 48 plus 1 new tokens does not fit"):
        sparse_attn.attention_with_kvcache(
            q,
            kc,
            vc,
            torch.tensor([3, 48], dtype=torch.int32, device=device),
            key=kn,
            value=kn,
            block_table=bt,
            validate=True,
        )
    bad = bt.clone()
    bad[1, 0] = 6
    with pytest.raises(ValueError, match=r"block_table\[1, 0\] = 6 points outside the cache's 6 pages"):
        sparse_attn.attention_with_kvcache(q, kc, vc, lens, block_table=bad, validate=True)
    with pytest.raises(ValueError, match="cache_seqlens\\[0\\] = -1"):
        sparse_attn.attention_with_kvcache(
            q, kc, vc, torch.tensor([-1, 2], dtype=torch.int32, device=device), block_table=bt, validate=True
        )
    with pytest.raises(RuntimeError, match="block_table must be 2-D"):
        sparse_attn.attention_with_kvcache(q, kc, vc, lens, block_table=bt[0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_unchecked_bad_values_follow_the_kernel(device, dtype):
    """validate=False: lengths clamped to [0, capacity], new tokens past the cache or in a page
    outside it dropped (nothing else written), a page outside the cache read as zeros, on every
    path (fp32: the composite; fp16 on CUDA: the kernel)."""
    if dtype == torch.float16 and device == "cpu":
        pytest.skip("the CPU takes fp16 through the composite too (covered by fp32)")
    torch.manual_seed(0)
    q = torch.randn(2, 4, 1, 64, device=device, dtype=dtype)
    kn = torch.randn(2, 2, 1, 64, device=device, dtype=dtype)
    run = sparse_attn.attention_with_kvcache
    # Contiguous: a negative length appends at 0; a full cache drops its new token.
    kc = torch.randn(2, 2, 48, 64, device=device, dtype=dtype)
    vc, before = kc.clone(), kc.clone()
    lens = torch.tensor([-3, 48], dtype=torch.int32, device=device)
    out = run(q, kc, vc, lens, key=kn, value=kn, validate=False)
    assert torch.equal(kc[0, :, 0], kn[0, :, 0]) and torch.equal(kc[0, :, 1:], before[0, :, 1:])
    assert torch.equal(kc[1], before[1]) and torch.equal(vc[1], before[1])
    ref = run(q, kc.clone(), vc.clone(), torch.tensor([1, 48], dtype=torch.int32, device=device))
    torch.testing.assert_close(out, ref, atol=0, rtol=0)
    # Paged: the new token of sequence 1 falls in a page the table lists as -1: dropped.
    kc = torch.randn(6, 16, 2, 64, device=device, dtype=dtype)
    vc, before = kc.clone(), kc.clone()
    bt = torch.tensor([[0, 1, 2], [3, -1, 5]], dtype=torch.int32, device=device)
    lens = torch.tensor([5, 20], dtype=torch.int32, device=device)
    out = run(q, kc, vc, lens, key=kn, value=kn, block_table=bt, validate=False)
    assert torch.equal(kc[0, 5], kn[0, :, 0]) and torch.equal(kc[1:], before[1:]) and torch.equal(vc[1:], before[1:])
    # ... and its keys in that page read as zeros: as a valid page holding zeros.
    zero_page = torch.cat([kc, torch.zeros_like(kc[:1])])
    bt_zero = torch.tensor([[0, 1, 2], [3, 6, 5]], dtype=torch.int32, device=device)
    ref = run(q, zero_page, torch.cat([vc, torch.zeros_like(vc[:1])]), lens + 1, block_table=bt_zero)
    torch.testing.assert_close(out, ref, atol=0, rtol=0)


def test_bad_masks():
    q, kc, vc, lens, _ = _args()
    sel = torch.ones(1, 1, 1, 1, dtype=torch.bool)
    with pytest.raises(ValueError, match="capacity"):
        sparse_attn.attention_with_kvcache(
            q, kc, vc, lens, mask=BlockSparseMask.from_block_matrix(sel, seq_lengths=(1, 64), block_size=64)
        )
    with pytest.raises(TypeError, match="BlockSparseMask"):
        sparse_attn.attention_with_kvcache(q, kc, vc, lens, mask=torch.ones(1, 48, dtype=torch.bool))


# ---- CUDA kernel: split-KV, long caches, graphs, unchecked bad values ----


@pytest.mark.cuda
@pytest.mark.parametrize("b,hkv,h,lq", [(1, 8, 32, 1), (1, 2, 16, 16), (3, 4, 4, 4), (64, 8, 32, 1)])
@pytest.mark.parametrize("page_size", [None, 16, 256])
def test_cuda_long_caches(b, hkv, h, lq, page_size):
    # From one split-KV CTA per (b, head) to dozens: the plan picks the split count.
    g = torch.Generator().manual_seed(b * 31 + lq)
    lens = torch.randint(1, 4000, (b,), generator=g).tolist()
    run_case("cuda", b=b, h=h, hkv=hkv, lq=lq, d=128, seqlens=lens, cap=4096 + 256, page_size=page_size)


@pytest.mark.cuda
@pytest.mark.parametrize("splits", [2, 5, 8, 16, 24, 40])
@pytest.mark.parametrize("b,hkv,h,lq,d", [(1, 2, 8, 1, 128), (2, 1, 8, 16, 64), (1, 2, 4, 4, 256)])
def test_cuda_split_merges(splits, b, hkv, h, lq, d):
    # Split counts forced from 2 to 40, merged by the combine kernel (at head dim 256, 40 splits
    # are more than its threads load ahead): against the reference, including splits that get no
    # key tile (a sequence shorter than the others).
    lens = (3000, 37)[:b] if b > 1 else (2900,)
    with sparse_attn._plan.overrides(decode_splits=splits):
        run_case("cuda", b=b, h=h, hkv=hkv, lq=lq, d=d, seqlens=lens, cap=3072, page_size=64, window=(40, 0))
        run_case("cuda", b=b, h=h, hkv=hkv, lq=lq, d=d, seqlens=lens, cap=3072)


@pytest.mark.cuda
@pytest.mark.parametrize("splits,ctas", [(1, 3), (2, 7), (4, 5), (7, 13), (16, 17), (33, 40)])
@pytest.mark.parametrize("b,hkv,h,lq,d", [(3, 2, 8, 1, 128), (2, 2, 32, 8, 64), (1, 2, 4, 4, 256)])
def test_cuda_balanced_walk(splits, ctas, b, hkv, h, lq, d):
    # A grid smaller than its (unit, split) pieces: each CTA an equal run of consecutive pieces,
    # ending one unit's keys and starting the next's (with one split: several whole units per CTA,
    # each written straight to the output); units of two row chunks (32 heads on 2, 8 tokens);
    # sequences of unequal lengths and an empty one, windows, pages, a block mask.
    lens = (2900, 0, 1500)[:b] if b > 1 else (2900,)
    with sparse_attn._plan.overrides(decode_splits=splits, decode_ctas=ctas):
        q = torch.zeros(b, h, lq, d, dtype=torch.bfloat16, device="cuda")
        kc = torch.zeros(b, hkv, 3072, d, dtype=torch.bfloat16, device="cuda")
        lens_t = torch.tensor(lens, dtype=torch.int32, device="cuda")
        launch = sparse_attn.explain(sparse_attn.attention_with_kvcache, q, kc, kc, lens_t).launches[0]
        rows = h // hkv * lq
        chunk = 16 if rows <= 16 else (32 if rows <= 32 else 64)
        pieces = b * hkv * -(-rows // chunk) * splits
        assert launch.options["num_splits"] == splits and launch.options["ctas"] == min(ctas, pieces), str(launch)
        run_case("cuda", b=b, h=h, hkv=hkv, lq=lq, d=d, seqlens=lens, cap=3072, page_size=64, window=(40, 0))
        run_case("cuda", b=b, h=h, hkv=hkv, lq=lq, d=d, seqlens=lens, cap=3072)
        run_case("cuda", b=b, h=h, hkv=hkv, lq=lq, d=d, seqlens=lens, cap=3072, causal=False, append=False)
        sparse_decode_case("cuda", b=b, h=h, hkv=hkv, lq=lq, d=d, cap=3072)


@pytest.mark.cuda
def test_cuda_kernel_is_planned():
    q = torch.randn(1, 32, 1, 128, device="cuda", dtype=torch.bfloat16)
    kc = torch.zeros(1, 8, 32768, 128, device="cuda", dtype=torch.bfloat16)
    lens = torch.tensor([30000], dtype=torch.int32, device="cuda")
    plan = sparse_attn.explain(sparse_attn.attention_with_kvcache, q, kc, kc, lens)
    assert plan.route == "decode_split_kv" and plan.launches[0].options["num_splits"] > 1, str(plan)
    plan = sparse_attn.explain(sparse_attn.attention_with_kvcache, q.float(), kc.float(), kc.float(), lens)
    assert plan.route == "composite", str(plan)


@pytest.mark.cuda
@pytest.mark.parametrize("paged", [False, True])
def test_cuda_graph_replay(paged):
    # Every slot a replay may read holds a token (history of 1000 in both sequences).
    b, h, hkv, d, cap = 2, 8, 2, 128, 1024
    cache = Cache(b, hkv, d, d, (1000, 1000), cap, page_size=64 if paged else None, dtype=torch.bfloat16, device="cuda")
    q = torch.randn(b, h, 1, d, device="cuda", dtype=torch.bfloat16)
    kn = torch.randn(b, hkv, 1, d, device="cuda", dtype=torch.bfloat16)
    vn = torch.randn(b, hkv, 1, d, device="cuda", dtype=torch.bfloat16)
    lens = torch.tensor([100, 700], dtype=torch.int32, device="cuda")
    table = cache.block_table.clone() if paged else None

    def step():
        return sparse_attn.attention_with_kvcache(q, cache.k, cache.v, lens, key=kn, value=vn, block_table=table)

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step()  # warm-up (plans, allocations)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    for new_lens in ([100, 700], [5, 900], [998, 1]):
        lens.copy_(torch.tensor(new_lens, dtype=torch.int32))
        if paged:  # a different page order each replay: same tokens, moved pages
            perm = torch.randperm(table.shape[1])
            moved_k, moved_v = cache.k.clone(), cache.v.clone()
            for bb in range(b):
                moved_k[table[bb, perm].long()] = cache.k[table[bb].long()]
                moved_v[table[bb, perm].long()] = cache.v[table[bb].long()]
            cache.k.copy_(moved_k)
            cache.v.copy_(moved_v)
            table.copy_(table[:, perm].clone())
        graph.replay()
        eager = sparse_attn.attention_with_kvcache(q, cache.k, cache.v, lens, key=kn, value=vn, block_table=table)
        torch.testing.assert_close(out, eager, atol=0, rtol=0)


@pytest.mark.cuda
def test_cuda_unchecked_bad_values_stay_in_bounds():
    # Lengths past the cache and pages outside it: no fault, no NaN from unowned slots.
    q, kc, vc, lens, bt = _args("cuda", paged=True)
    q, kc, vc = q.half(), kc.half(), vc.half()
    kn = torch.ones(2, 2, 1, 64, device="cuda", dtype=torch.half)
    bad_lens = torch.tensor([1 << 30, -5], dtype=torch.int32, device="cuda")
    bad_bt = torch.tensor([[0, -7, 99], [1 << 30, 4, 5]], dtype=torch.int32, device="cuda")
    out = sparse_attn.attention_with_kvcache(q, kc, vc, bad_lens, key=kn, value=kn, block_table=bad_bt)
    torch.cuda.synchronize()
    assert torch.isfinite(out).all()


@pytest.mark.cuda
def test_cuda_head_dim_256():
    run_case("cuda", d=256, lq=4, h=8, hkv=2, seqlens=(500, 900), cap=1024, page_size=32)


def test_explain_cpu():
    q, kc, vc, lens, _ = _args()
    plan = sparse_attn.explain(sparse_attn.attention_with_kvcache, q, kc, vc, lens)
    assert plan.route == "composite" and plan.launches[0].core == "cpu"
    plan = sparse_attn.explain(
        sparse_attn.attention_with_kvcache, q.bfloat16(), kc.bfloat16(), vc.bfloat16(), lens, target="sm90"
    )
    # 2 (batch, K/V head) pairs on 132 SMs: the 48-token cache holds one key tile, so no split.
    assert plan.route == "decode" and plan.launches[0].options["num_splits"] == 1, str(plan)
    long = torch.zeros(2, 2, 8192, 64, dtype=torch.bfloat16)
    plan = sparse_attn.explain(sparse_attn.attention_with_kvcache, q.bfloat16(), long, long, lens, target="sm90")
    # 4 pairs on 132 SMs: 33 splits would give each SM one CTA; the 128 key tiles allow 32 (4 tiles
    # each, the plan's minimum).
    assert plan.route == "decode_split_kv" and plan.launches[0].options["num_splits"] == 32, str(plan)
    # Pages shorter than a key tile scatter its rows over the memory: two CTAs per SM hide that
    # (twice the splits); longer pages and contiguous caches one per SM.
    q1 = torch.zeros(1, 32, 1, 128, dtype=torch.bfloat16)
    lens1 = torch.full((1,), 32768, dtype=torch.int32)
    for page, splits in ((16, 33), (64, 16), (256, 16)):
        pages = torch.zeros(32768 // page, page, 8, 128, dtype=torch.bfloat16)
        table = torch.arange(32768 // page, dtype=torch.int32)[None]
        plan = sparse_attn.explain(
            sparse_attn.attention_with_kvcache, q1, pages, pages, lens1, block_table=table, target="sm90"
        )
        assert plan.launches[0].options["num_splits"] == splits, (page, str(plan))
    # 128 pairs give nearly every one of the 132 SMs a CTA: no split (64 pairs: split).
    for b in (16, 8):
        q16 = torch.zeros(b, 32, 1, 64, dtype=torch.bfloat16)
        cache = torch.zeros(b, 8, 2048, 64, dtype=torch.bfloat16)
        full = torch.full((b,), 2048, dtype=torch.int32)
        plan = sparse_attn.explain(sparse_attn.attention_with_kvcache, q16, cache, cache, full, target="sm90")
        assert (plan.launches[0].options["num_splits"] == 1) == (b == 16), (b, str(plan))
    # 72 / 80 pairs of one CTA each stream below DRAM's rate (an H100 SM: ~38 GB/s, 3.35 TB/s of
    # DRAM needs ~81 of them): 132 CTAs share their pieces (11 / 33 per pair); 88 pairs do not.
    for b, route, splits in ((9, "decode_balanced", 11), (10, "decode_balanced", 33), (11, "decode", 1)):
        plan = _h100_decode_plan(b)
        o = plan.launches[0].options
        assert plan.route == route and o["num_splits"] == splits, (b, str(plan))
        assert o["ctas"] == (132 if splits > 1 else 8 * b), (b, str(plan))
        # The same pairs in pages shorter than a key tile (reads that scatter): no balanced grid.
        paged = _h100_decode_plan(b, page_size=16)
        assert paged.route != "decode_balanced", (b, str(paged))
        # Eight new tokens per sequence (32 query rows per K/V head, two row tiles): not measured
        # with the balanced grid, so one CTA per pair.
        multi = _h100_decode_plan(b, lq=8)
        assert multi.route != "decode_balanced", (b, str(multi))
    # 192 pairs: 60 of the 132 SMs would hold two CTAs and end last, so 264 CTAs share the pairs'
    # pieces evenly (11 per pair, 8 per CTA); 256 pairs load the SMs about evenly: one CTA each.
    for b, route, ctas in ((24, "decode_balanced", 264), (32, "decode", 256)):
        plan = _h100_decode_plan(b)
        o = plan.launches[0].options
        assert plan.route == route and o["ctas"] == ctas, (b, str(plan))
        assert o["num_splits"] == (11 if b == 24 else 1) and o["balanced"] == (b == 24), (b, str(plan))
        assert [launch.kernel for launch in plan.launches][1:] == (["decode_combine"] if b == 24 else []), str(plan)


def _h100_decode_plan(b, lq=1, length=8192, page_size=None):
    """explain's plan (target sm90: an H100 SXM) for decode of B = b, H = 32, Hkv = 8, D = 128, bf16,
    every cache holding `length` tokens, contiguous or in pages of page_size tokens."""
    q = torch.zeros(b, 32, lq, 128, dtype=torch.bfloat16)
    cache = torch.zeros(b, 8, length, 128, dtype=torch.bfloat16)
    full = torch.full((b,), length, dtype=torch.int32)
    kw = {}
    if page_size is not None:
        cache = cache.transpose(1, 2).reshape(b * length // page_size, page_size, 8, 128)
        kw["block_table"] = torch.arange(b * length // page_size, dtype=torch.int32).view(b, -1)
    return sparse_attn.explain(sparse_attn.attention_with_kvcache, q, cache, cache, full, target="sm90", **kw)


def test_kvcache_topk_mask_bad_input():
    iq, iw, ik = torch.randn(2, 1, 4, 64), torch.rand(2, 1, 4), torch.randn(2, 1024, 64)
    lens = torch.tensor([100, 900], dtype=torch.int32)
    run = sparse_attn.kvcache_topk_mask
    cases = [
        (lambda: run(iq, iw, ik, lens[:1], 3), ValueError, r"cache_seqlens must be int32 \(B=2,\)"),
        (lambda: run(iq, iw, ik, lens.long(), 3), ValueError, "cache_seqlens must be int32"),
        (lambda: run(iq, iw, ik, [100, 900], 3), TypeError, "cache_seqlens must be a tensor"),
        (lambda: run(iq, iw, ik, lens, 3, sinks=-2), ValueError, "sinks must be an integer >= 0"),
        (lambda: run(iq, iw, ik, lens, 3, recent=True), ValueError, "recent must be an integer >= 0"),
        (lambda: run(iq, iw, ik, lens, 3, block_size=64.0), ValueError, "block_size must be 64 or 128"),
        (lambda: run(iq.long(), iw, ik, lens, 3), ValueError, "index_query must be float32"),
        (lambda: run(iq, iw, ik.double(), lens, 3), ValueError, "index_key_cache must be float32"),
        (lambda: run(iq, iw, ik.half(), lens, 3), ValueError, "index_key_cache must have index_query's dtype"),
        (lambda: run(iq[:, :, :0], iw[:, :, :0], ik, lens, 3), ValueError, "at least one token, indexer head"),
        (lambda: run(iq, iw, ik.to("meta"), lens, 3), ValueError, "index_key_cache must be on index_query's device"),
    ]
    for call, exc, match in cases:
        with pytest.raises(exc, match=match):
            call()


def test_kvcache_topk_mask(device):
    # The indexer's top blocks, sinks and the newest block always; blocks past a length never.
    b, lq, hi, di, lmax, bs = 2, 1, 4, 32, 1024, 128
    g = torch.Generator().manual_seed(11)
    iq = torch.randn(b, lq, hi, di, generator=g)
    iw = torch.rand(b, lq, hi, generator=g)
    ik = torch.randn(b, lmax, di, generator=g)
    lens = torch.tensor([300, 1000], dtype=torch.int32)
    mask = sparse_attn.kvcache_topk_mask(*(t.to(device) for t in (iq, iw, ik, lens)), 4, block_size=bs)
    scores = (torch.einsum("bqhd,bld->bqhl", iq, ik).relu() * iw[..., None]).sum(2).amax(1)
    for i, n in enumerate(lens.tolist()):
        nb = -(-n // bs)
        block = scores[i, :n].tolist() + [float("-inf")] * (nb * bs - n)
        block = torch.tensor(block).view(nb, bs).amax(-1)
        forced = {0, nb - 1}
        rest = [j for j in block.argsort(descending=True).tolist() if j not in forced]
        want = sorted(forced | set(rest[: max(0, 4 - len(forced))]))[: min(4, nb)]
        cnt = int(mask.kv_num_blocks[i, 0, 0])
        assert mask.kv_indices[i, 0, 0, :cnt].tolist() == want
    # The mask drives a sparse decode that reads exactly those blocks.
    cache = Cache(b, 2, 64, 64, lens.tolist(), lmax, dtype=torch.bfloat16, device=device)
    q = torch.randn(b, 4, lq, 64, generator=g).to(torch.bfloat16).to(device)
    out = sparse_attn.attention_with_kvcache(q, cache.k, cache.v, cache.lens, mask=mask)
    sel = torch.zeros(b, 1, lmax // bs, dtype=torch.bool)
    for i in range(b):
        sel[i, 0, mask.kv_indices[i, 0, 0, : int(mask.kv_num_blocks[i, 0, 0])].long().cpu()] = True
    gold, lp, _ = expected(cache, q, None, None, block_sel=sel.expand(b, 2, -1), kv_block=bs)
    check_close("topk decode", out, gold, lp, dtype=torch.bfloat16)


def test_compiled_decode_step_matches_eager(device):
    # torch.compile(fullgraph=True) of a decode step (append + attend): same output, same caches.
    b, h, hkv, d, cap = 2, 4, 2, 64, 128
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    g = torch.Generator().manual_seed(9)
    q = torch.randn(b, h, 1, d, generator=g).to(device, dtype)
    kn = torch.randn(b, hkv, 1, d, generator=g).to(device, dtype)
    vn = torch.randn(b, hkv, 1, d, generator=g).to(device, dtype)
    caches = [torch.randn(b, hkv, cap, d, generator=g).to(device, dtype) for _ in range(2)]
    lens = torch.tensor([5, 77], dtype=torch.int32, device=device)

    def step(q, kc, vc, lens, kn, vn):
        return sparse_attn.attention_with_kvcache(q, kc, vc, lens, key=kn, value=vn, validate=False)

    eager_k, eager_v = caches[0].clone(), caches[1].clone()
    want = step(q, eager_k, eager_v, lens, kn, vn)
    comp_k, comp_v = caches[0].clone(), caches[1].clone()
    got = torch.compile(step, fullgraph=True)(q, comp_k, comp_v, lens, kn, vn)
    torch.testing.assert_close(got, want, atol=0, rtol=0)
    assert torch.equal(comp_k, eager_k) and torch.equal(comp_v, eager_v)


@pytest.mark.cuda
def test_traced_route_agrees_with_the_plan():
    from sparse_attn import _kvcache

    for dtype in (torch.bfloat16, torch.float32):
        for d, dv in ((64, 64), (128, 128), (256, 256), (64, 32)):
            q = torch.zeros(1, 4, 1, d, device="cuda", dtype=dtype)
            kc = torch.zeros(1, 2, 64, d, device="cuda", dtype=dtype)
            vc = torch.zeros(1, 2, 64, dv, device="cuda", dtype=dtype)
            lens = torch.zeros(1, dtype=torch.int32, device="cuda")
            route = torch.ops.sparse_attn._kvcache_route.default(q, kc, vc, lens, None, None, None, None, None, 0)
            assert _kvcache.traced_route(q, kc, vc, None, 0) == bool(route), (dtype, d, dv)


@pytest.mark.cuda
@pytest.mark.parametrize("k", [1, 3, 9, 40])
def test_kvcache_topk_mask_cuda_selection_equals_cpu(k):
    # The CUDA selection kernel against the PyTorch path: lengths of 0, inside a block, whole blocks,
    # fewer blocks than k, and more.
    b, lmax = 6, 4096
    g = torch.Generator().manual_seed(k)
    iq, iw, ik = (
        torch.randn(b, 1, 4, 64, generator=g),
        torch.rand(b, 1, 4, generator=g),
        torch.randn(b, lmax, 64, generator=g),
    )
    lens = torch.tensor([0, 5, 128, 700, 3000, 4096], dtype=torch.int32)
    cpu = sparse_attn.kvcache_topk_mask(iq, iw, ik, lens, k, sinks=2, recent=2)
    gpu = sparse_attn.kvcache_topk_mask(*(t.cuda() for t in (iq, iw, ik, lens)), k, sinks=2, recent=2)
    assert torch.equal(gpu.kv_num_blocks.cpu(), cpu.kv_num_blocks)
    for i in range(b):
        n = int(cpu.kv_num_blocks[i, 0, 0])
        assert gpu.kv_indices[i, 0, 0, :n].cpu().tolist() == cpu.kv_indices[i, 0, 0, :n].tolist(), i
