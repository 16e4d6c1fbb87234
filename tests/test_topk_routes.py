"""topk_attention's two ways of attending over its selection: gathered rows and the masked block
route (the union of a query block's selections through the block-sparse kernel). The selection's
mask (``_selection_mask``) against a Python construction of it; both routes against the fp64
reference on the selection's element mask, gradients included; the cost model's choice."""

from __future__ import annotations

import pytest
import torch
from test_topk import indices_mask
from utils import check_attention, make_qkv

import sparse_attn
from sparse_attn import _plan, _routes
from sparse_attn._plan import overrides

_ops = torch.ops.sparse_attn
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def random_selection(b, g, lq, lk, k, causal, seed, device, *, ascending=True, pad=0.1):
    """(B, G, Lq, k) int32: distinct visible keys per row (bottom-right causal), about ``pad`` of
    the slots -1, ascending or shuffled."""
    gen = torch.Generator().manual_seed(seed)
    score = torch.rand(b, g, lq, lk, generator=gen)
    if causal:
        hidden = torch.arange(lk)[None, :] > torch.arange(lq)[:, None] + (lk - lq)
        score = score.masked_fill(hidden, -1.0)
    val, idx = score.topk(min(k, lk), dim=-1)
    idx = torch.where((val >= 0) & (torch.rand(val.shape, generator=gen) >= pad), idx, -1)
    if ascending:
        idx = torch.where(idx >= 0, idx, lk).sort(-1).values
        idx = torch.where(idx < lk, idx, -1)
    return idx.to(torch.int32).to(device)


def expected_mask(indices, lk, heads, q_block, kv_block):
    """Per (b, out head, query block): the ascending union of its rows' key blocks, and per listed
    block the (q_block, kv_block) bool of what each row selected."""
    b, g, lq, _ = indices.shape
    sel = indices_mask(indices.cpu(), lk, g)  # (B, G, Lq, Lk)
    nqb, nkb = -(-lq // q_block), -(-lk // kv_block)
    pad = torch.zeros(b, g, nqb * q_block, nkb * kv_block, dtype=torch.bool)
    pad[:, :, :lq, :lk] = sel
    blocks = pad.unflatten(2, (nqb, q_block)).unflatten(4, (nkb, kv_block))  # B G nqb qb nkb kvb
    return blocks.permute(0, 1, 2, 4, 3, 5)  # B G nqb nkb qb kvb


def decode_bits(words, kv_block):
    shifts = torch.arange(32, dtype=torch.int64)
    bits = (words.long().unsqueeze(-1) >> shifts) & 1
    return bits.flatten(-2)[..., :kv_block].bool()


@pytest.mark.parametrize("ascending", [True, False], ids=["ascending", "shuffled"])
@pytest.mark.parametrize("blocks", [(128, 128), (64, 64), (64, 128), (128, 64)], ids=str)
@pytest.mark.parametrize(
    "dims",
    [
        (1, 1, 4, 300, 300, 40, True),
        (2, 2, 4, 200, 333, 70, True),
        (1, 4, 4, 130, 90, 500, False),
        (1, 1, 2, 190, 70, 16, True),
    ],
    ids=["mqa_causal", "gqa_lk_gt_lq", "mha_full_rows", "lq_gt_lk"],
)
def test_selection_mask_lists_and_bits(dims, blocks, ascending, device):
    b, g, h, lq, lk, k, causal = dims
    qb, kvb = blocks
    idx = random_selection(b, g, lq, lk, k, causal, seed=lq + k, device=device, ascending=ascending)
    check_selection_mask(idx, lk, h, qb, kvb, causal)


def check_selection_mask(idx, lk, h, qb, kvb, causal):
    """_selection_mask of idx against expected_mask: the lists, full blocks, each partial row's bits."""
    b, g, lq, _ = idx.shape
    num, kvi, kvp, words = _ops._selection_mask(idx, lk, h, qb, kvb, causal, lk - lq)
    want = expected_mask(idx, lk, g, qb, kvb)
    out_heads = 1 if g == 1 else h
    assert num.shape == (b, out_heads, want.shape[2])
    num, kvi, kvp, words = num.cpu(), kvi.cpu(), kvp.cpu(), words.cpu()
    rows_valid = (torch.arange(want.shape[2] * qb) < lq).view(-1, qb)
    keys_valid = (torch.arange(want.shape[3] * kvb) < lk).view(-1, kvb)
    for bi in range(b):
        for hh in range(out_heads):
            gi = hh * g // out_heads
            for q in range(want.shape[2]):
                union = want[bi, gi, q].flatten(1).any(-1).nonzero().flatten()
                n = int(num[bi, hh, q])
                assert torch.equal(kvi[bi, hh, q, :n], union.to(torch.int32)), (bi, hh, q)
                for s, kb in enumerate(union.tolist()):
                    bits = want[bi, gi, q, kb]
                    p = int(kvp[bi, hh, q, s])
                    every = (bits | ~rows_valid[q][:, None] | ~keys_valid[kb][None, :]).all()
                    if p < 0:
                        assert every, "listed full although some row did not select the whole block"
                    else:
                        assert not every, "a block every row selected whole must be listed full"
                        got = decode_bits(words[p], kvb)
                        assert torch.equal(got[rows_valid[q]], bits[rows_valid[q]]), (bi, hh, q, kb)


@pytest.mark.parametrize("blocks", [(128, 128), (64, 64)], ids=str)
def test_selection_mask_over_many_key_blocks_and_rows_out_of_order(blocks, device):
    """Selections over many key blocks (70 of 128 keys, 141 of 64): a block every row takes whole,
    a row that ascends and then turns back late (its blocks stored first, then ORed into), and a
    key after a row's -1s."""
    qb, kvb = blocks
    lq, lk, k = 200, 9000, 700
    idx = random_selection(1, 2, lq, lk, k, True, seed=7, device="cpu").clone()
    whole = torch.arange(50 * kvb, 51 * kvb, dtype=torch.int32)  # key block 50, in every row
    idx[0, 0, :, :kvb] = whole
    rows = torch.where(idx[0, 0] >= 0, idx[0, 0], lk).sort(-1).values
    idx[0, 0] = torch.where(rows < lk, rows, -1)
    check_selection_mask(idx.to(device), lk, 4, qb, kvb, True)  # ascending (the op's form)
    late = idx.clone()
    valid = int((late[0, 1, 5] >= 0).sum())
    late[0, 1, 5, valid - 200 : valid - 100] = late[0, 1, 5, valid - 200 : valid - 100].flip(-1)  # turns back late
    assert (late[0, 1, 5, 1:valid] < late[0, 1, 5, : valid - 1]).any()
    check_selection_mask(late.to(device), lk, 4, qb, kvb, True)
    gap = idx.clone()
    gap[0, 0, 150, 10:] = -1
    gap[0, 0, 150, 40] = 8000  # a key after the row's -1s
    check_selection_mask(gap.to(device), lk, 4, qb, kvb, True)


def test_selection_mask_fake_matches_real():
    idx = random_selection(2, 2, 150, 260, 30, True, seed=1, device="cpu")
    args = (idx, 260, 4, 64, 128, True, 260 - 150)
    real = _ops._selection_mask(*args)
    with torch._subclasses.FakeTensorMode() as mode:
        fake = _ops._selection_mask(mode.from_tensor(idx), *args[1:])
    assert [tuple(t.shape) for t in fake] == [tuple(t.shape) for t in real]


def test_selection_mask_rejects_bad_arguments():
    idx = random_selection(1, 2, 64, 64, 8, False, seed=2, device="cpu")
    with pytest.raises(RuntimeError, match="heads"):
        _ops._selection_mask(idx, 64, 3, 128, 128, False, 0)
    with pytest.raises(RuntimeError, match="q_block and kv_block"):
        _ops._selection_mask(idx, 64, 2, 32, 128, False, 0)
    with pytest.raises(RuntimeError, match="int32"):
        _ops._selection_mask(idx.long(), 64, 2, 128, 128, False, 0)


def run_route(route, *args, **kwargs):
    with overrides(topk_attention_route=route):
        return sparse_attn.topk_attention(*args, **kwargs)


CASES = {  # (B, H, Hkv, Lq, Lk, D, k, causal)
    "mha_causal": (1, 2, 2, 300, 300, 64, 40, True),
    "gqa_lk_gt_lq": (2, 4, 2, 130, 260, 64, 50, True),
    "mqa_noncausal": (1, 4, 1, 200, 150, 128, 33, False),
    "lq_gt_lk": (1, 2, 1, 190, 70, 64, 16, True),
}


@pytest.mark.parametrize("indexer", [False, True], ids=["per_head", "indexer"])
@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_masked_block_route_equals_reference(dtype, case, indexer, device):
    b, h, hkv, lq, lk, d, k, causal = CASES[case]
    q, kk, v = make_qkv(b, h, hkv, lq, lk, d, dtype=dtype, device=device, seed=3)
    extra = {}
    if indexer:
        g = torch.Generator().manual_seed(4)
        extra = dict(
            index_query=torch.randn(b, lq, 2, 32, generator=g).to(dtype).to(device),
            index_key=torch.randn(b, lk, 32, generator=g).to(dtype).to(device),
            index_weights=torch.rand(b, lq, 2, generator=g).to(dtype).to(device),
        )
    outs = {}
    for route in ("gather", "masked_block"):
        out, lse, idx = run_route(route, q, kk, v, k, causal=causal, return_lse=True, return_indices=True, **extra)
        mask = indices_mask(idx.cpu(), lk, h)
        check_attention(out.cpu(), lse.cpu(), q.cpu(), kk.cpu(), v.cpu(), mask=mask, name=f"{route} out")
        outs[route] = (out, idx)
    assert torch.equal(outs["gather"][1], outs["masked_block"][1]), "the selection does not depend on the route"


@pytest.mark.parametrize("sinks", [0, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_masked_block_route_gradients_equal_gather(dtype, sinks, device):
    q, kk, v = make_qkv(1, 4, 2, 200, 200, 64, dtype=dtype, device=device, seed=5)
    grads = {}
    for route in ("gather", "masked_block"):
        leaves = [t.detach().clone().requires_grad_() for t in (q, kk, v)]
        out = run_route(route, *leaves, 24, causal=True, sinks=sinks)
        (out.float() * torch.linspace(-1, 1, out.shape[-1], device=device)).sum().backward()
        grads[route] = [t.grad.float() for t in leaves]
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    for name, a, b in zip("qkv", grads["gather"], grads["masked_block"], strict=True):
        err = (a - b).abs().max().item() / max(1.0, a.abs().max().item())
        assert err <= tol, f"d{name}: routes differ by {err}"


def test_masked_block_route_in_query_chunks_equals_one_call(device, monkeypatch):
    q, kk, v = make_qkv(1, 2, 2, 520, 520, 64, dtype=torch.float32, device=device, seed=6)
    whole = run_route("masked_block", q, kk, v, 30, causal=True, return_lse=True)
    # Five causal partial rows a call (query blocks see 1, 2, ..., 5 key blocks): a block a call.
    monkeypatch.setattr(_routes, "SELECTION_MASK_BYTES", 2 * 5 * 128 * 128 // 8)
    assert len(_routes.selection_chunks(2, 520, 520, 128, 128, True)) == 5
    parts = run_route("masked_block", q, kk, v, 30, causal=True, return_lse=True)
    assert torch.equal(whole[0], parts[0]) and torch.equal(whole[1], parts[1])


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("lq, lk", [(1, 1), (520, 520), (300, 1000), (1000, 300), (4096, 4096)])
def test_selection_chunks_cover_the_queries_within_the_budget(monkeypatch, causal, lq, lk):
    monkeypatch.setattr(_routes, "SELECTION_MASK_BYTES", 7 * 128 * 128 // 8)  # seven partial rows
    chunks = _routes.selection_chunks(1, lq, lk, 128, 128, causal)
    assert chunks[0][0] == 0 and chunks[-1][1] == lq
    assert all(a[1] == b[0] for a, b in zip(chunks, chunks[1:], strict=False))
    for r0, r1 in chunks:
        assert r0 % 128 == 0 and r0 < r1
        rows, _ = _routes.selection_mask_size(r1 - r0, lk, 128, 128, causal, lk - lq + r0)
        assert rows <= 7 or r1 - r0 <= 128, (r0, r1, rows)  # over the budget only as one block
    total, widest = _routes.selection_mask_size(lq, lk, 128, 128, causal, lk - lq)
    if total <= 7:
        assert chunks == [(0, lq)]
    else:  # as many as chunks of the budget less one block's rows hold, none empty
        assert len(chunks) <= -(-total // max(7 - widest, 1))


def test_route_choice_follows_the_cost_model():
    """On CUDA (shapes alone): MQA's gathered rows serve 16 heads, so gather at 64k, k = 2048; with
    16 K/V heads each row serves one head and the block route wins; a small k gathers."""

    def route(h, hkv, lq, k, groups):
        q = torch.empty(1, h, lq, 128, dtype=torch.bfloat16, device="meta")
        kv = torch.empty(1, hkv, lq, 128, dtype=torch.bfloat16, device="meta")
        return _plan.selection_route(q, kv, kv, groups, k, True, cuda=True).kind

    assert route(16, 1, 65536, 2048, 1) == "gather"
    assert route(16, 16, 65536, 2048, 16) == "masked_block"
    assert route(16, 16, 65536, 2048, 1) == "masked_block"
    assert route(16, 16, 65536, 64, 16) == "gather"
    assert route(16, 16, 4096, 4096, 16) == "masked_block"  # k covers every visible key


def test_explain_names_the_attention_route():
    q = torch.empty(1, 16, 16384, 128, dtype=torch.bfloat16)  # never read: explain runs nothing
    plan = sparse_attn.explain("topk_attention", q, q, q, 2048, causal=True, target="sm90")
    assert "masked_block" in plan.why
    assert [launch.kernel for launch in plan.launches] == ["topk_select", "selection_mask", "block_sparse_fwd"]
    with overrides(topk_attention_route="gather"):
        plan = sparse_attn.explain("topk_attention", q, q, q, 2048, causal=True, target="sm90")
    assert [launch.kernel for launch in plan.launches] == ["topk_select", "gather_fwd"]


def test_compiled_masked_block_route_equals_eager():
    q, kk, v = make_qkv(1, 2, 2, 256, 256, 64, dtype=torch.float32, seed=7)
    with overrides(topk_attention_route="masked_block"):
        eager = sparse_attn.topk_attention(q, kk, v, 20, causal=True)
        compiled = torch.compile(lambda a, b, c: sparse_attn.topk_attention(a, b, c, 20, causal=True), fullgraph=True)(
            q, kk, v
        )
    assert torch.equal(eager, compiled)


def test_deterministic_training_takes_the_block_route():
    q = torch.empty(1, 16, 65536, 128, dtype=torch.bfloat16, device="meta")
    kv = torch.empty(1, 1, 65536, 128, dtype=torch.bfloat16, device="meta")
    assert _plan.selection_route(q, kv, kv, 1, 2048, True, cuda=True).kind == "gather"
    torch.use_deterministic_algorithms(True)
    try:
        assert _plan.selection_route(q, kv, kv, 1, 2048, True, cuda=True).kind == "gather"  # no gradients
        q.requires_grad_(True)
        assert _plan.selection_route(q, kv, kv, 1, 2048, True, cuda=True).kind == "masked_block"
    finally:
        torch.use_deterministic_algorithms(False)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("entry_block,kv_block", [(64, 128), (128, 128), (128, 64), (64, 64)])
def test_selection_mask_of_key_blocks_equals_their_keys(entry_block, kv_block, causal, device):
    """Entries that are key blocks give the mask of their keys (causal clipped per row)."""
    b, g, h, lq, lk = 2, 2, 4, 150, 333
    gen = torch.Generator().manual_seed(entry_block + kv_block + causal)
    blocks = torch.randint(-1, -(-lk // entry_block), (b, g, lq, 3), generator=gen).to(torch.int32)
    blocks = torch.where(blocks >= 0, blocks, -1).sort(-1).values
    offs = torch.arange(entry_block, dtype=torch.int32)
    tok = torch.where(blocks[..., None] >= 0, blocks[..., None] * entry_block + offs, -1).flatten(-2)
    limit = torch.arange(lq, dtype=torch.int32)[:, None] + (lk - lq) if causal else lk - 1
    tok = torch.where((tok <= limit) & (tok < lk), tok, -1).contiguous()
    args = (lk, h, 128, kv_block, causal, lk - lq)
    got = _ops._selection_mask(blocks.to(device), *args, entry_block)
    want = _ops._selection_mask(tok.to(device), *args, 1)
    for a, w in zip(got, want, strict=True):
        assert torch.equal(a.cpu(), w.cpu())


@pytest.mark.parametrize("entry_block", [1, 64, 128])
@pytest.mark.parametrize("blocks", [(128, 128), (64, 64), (64, 128), (128, 64)], ids=str)
@pytest.mark.parametrize("dims", [(2, 3, 300, 333, 40, True), (1, 2, 190, 70, 500, False)], ids=["causal", "full"])
def test_selection_union_counts_the_blocks_the_mask_lists(dims, blocks, entry_block, device):
    """_selection_union's count (every query block, and evenly spaced samples of them) is the number
    of key blocks _selection_mask lists there; shuffled rows and -1 entries included."""
    b, g, lq, lk, k, causal = dims
    qb, kvb = blocks
    if entry_block > 1:
        k = 6
    idx = random_selection(b, g, lq, -(-lk // entry_block), k, False, seed=k + qb, device="cpu", ascending=False)
    idx = idx.to(device)
    num = _ops._selection_mask(idx, lk, g, qb, kvb, causal, lk - lq, entry_block)[0]  # (B, G, nqb)
    nqb = num.shape[-1]
    for samples in (-1, nqb, 1, 2, nqb - 1):
        n = nqb if samples == -1 else samples
        chosen = [(2 * i + 1) * nqb // (2 * n) for i in range(n)]
        got = _ops._selection_union(idx, lk, qb, kvb, causal, lk - lq, entry_block, samples)
        assert got.device == idx.device and got.dtype == torch.int64 and got.dim() == 0
        assert got.item() == num[..., chosen].sum().item(), (samples, chosen)
    with pytest.raises((RuntimeError, ValueError), match="samples must be"):
        _ops._selection_union(idx, lk, qb, kvb, causal, lk - lq, entry_block, nqb + 1)


def test_measured_union_picks_the_block_route_for_clustered_selections(monkeypatch):
    """Shapes alone pick the gather (k is small against the keys); a selection confined to the
    first key block (sinks) touches one block per query block, and its measured union turns the
    choice; a random selection of the same size keeps the gather."""
    monkeypatch.setitem(_plan._UNION_MEASURE_BYTES_PER_S, "cpu", 1e15)  # measuring made free
    monkeypatch.setitem(_plan._UNION_MEASURE_FIXED_S, "cpu", 0.0)
    q, kk, v = make_qkv(1, 4, 4, 2048, 2048, 64, dtype=torch.float32, seed=8)
    sinks = torch.arange(16, dtype=torch.int32).expand(1, 4, 2048, 16).contiguous()
    spread = random_selection(1, 4, 2048, 2048, 16, True, seed=9, device="cpu", pad=0.0)
    assert _plan.selection_route(q, kk, v, 4, 16, True).kind == "gather"
    assert _plan.measured_selection_route(q, kk, v, sinks, 16, True).kind == "masked_block"
    assert _plan.measured_selection_route(q, kk, v, spread, 16, True).kind == "gather"
    assert _routes.selection_union(sinks, 2048, 2048, 1, True) == pytest.approx(16 / 136)
    monkeypatch.setitem(_plan._UNION_MEASURE_FIXED_S, "cpu", 1.0)  # the host's round trip too dear: shapes decide
    assert _plan.measured_selection_route(q, kk, v, sinks, 16, True).kind == "gather"
    monkeypatch.setitem(_plan._UNION_MEASURE_FIXED_S, "cpu", 0.0)
    monkeypatch.setitem(_plan._UNION_MEASURE_BYTES_PER_S, "cpu", 1.0)  # measuring too dear: shapes decide
    assert _plan.measured_selection_route(q, kk, v, sinks, 16, True).kind == "gather"


def test_sampled_union(monkeypatch):
    """A selection too large to measure whole within the cost model's share is measured on evenly
    spaced query blocks: the estimate is near the whole's (local windows of 256 keys under causal,
    random keys among each row's first tenth, sinks, key-block entries); measured whole when cheap;
    a sample large enough turns the choice to the block route for a clustered selection; too few
    blocks: shapes decide."""
    gen = torch.Generator().manual_seed(3)
    lq = lk = 8192
    rows = torch.arange(lq)[:, None]
    window = (rows - torch.randint(0, 256, (1, 2, lq, 32), generator=gen)).clamp(min=0).to(torch.int32)
    early = (torch.rand(1, 2, lq, 32, generator=gen) * ((rows + 1) // 10 + 1)).long().to(torch.int32)
    sinks = torch.arange(32, dtype=torch.int32).expand(1, 2, lq, 32).contiguous()
    blocks = (rows // 128 - torch.randint(0, 4, (1, 2, lq, 4), generator=gen)).clamp(min=0).to(torch.int32)
    for sel, entry_block in ((window, 1), (early, 1), (sinks, 1), (blocks, 128)):
        whole = _routes.selection_union(sel, lq, lk, entry_block, True)
        assert _routes.selection_union(sel, lq, lk, entry_block, True, max_entries=sel.numel()) == whole
        part = _routes.selection_union(sel, lq, lk, entry_block, True, max_entries=sel.numel() // 6)
        assert part == pytest.approx(whole, rel=0.15, abs=0.003), (entry_block, whole, part)
    q, kk, v = make_qkv(1, 4, 4, 2048, 2048, 64, dtype=torch.float32, seed=8)
    clustered = torch.arange(16, dtype=torch.int32).expand(1, 4, 2048, 16).contiguous()
    gather = _plan.selection_route(q, kk, v, 4, 16, True).args[0]
    per_block = 4 * 128 * 16  # entries of one query block; the selection holds 16 blocks' worth
    monkeypatch.setitem(_plan._UNION_MEASURE_FIXED_S, "cpu", 0.0)
    for blocks_affordable, kind in ((10, "masked_block"), (6, "gather")):
        rate = blocks_affordable * per_block * 8 / (_plan._UNION_MEASURE_SHARE * gather)
        monkeypatch.setitem(_plan._UNION_MEASURE_BYTES_PER_S, "cpu", rate)
        route = _plan.measured_selection_route(q, kk, v, clustered, 16, True)
        assert route.kind == kind, blocks_affordable
        if kind == "masked_block":  # the reason says how the union was known
            assert "estimated on 10 of 16 query blocks" in route.why, route.why


def test_explain_says_when_a_call_measures_the_union():
    """explain chooses from shapes; where an eager call would measure the union first (the gather
    long enough: 16 K/V heads at 64k, k = 256), its reason says so, and how much it reads."""
    big = torch.empty(1, 16, 65536, 128, dtype=torch.bfloat16)  # never read
    plan = sparse_attn.explain("topk_attention", big, big, big, 256, causal=True, target="sm90")
    assert "an eager call first measures the selection's union" in plan.why
    route = _plan.selection_route(big, big, big, 16, 256, True, cuda=True)
    blocks = _plan.union_measure(route, big, (1, 16, 65536, 256), cuda=True)[1]
    assert 8 <= blocks < 512 and f"{blocks} of its 512 query blocks" in plan.why, plan.why
    small = torch.empty(1, 16, 4096, 128, dtype=torch.bfloat16)
    plan = sparse_attn.explain("topk_attention", small, small, small, 256, causal=True, target="sm90")
    assert "gather" in plan.why and "measures" not in plan.why  # 1.3 ms of gather: shapes decide


def test_selection_mask_of_a_long_key_sequence(device):
    """More than 4000 key blocks (600k keys): the lists reach the last block, the bits land in it."""
    idx = torch.tensor([[[[600000, 3, -1]]]], dtype=torch.int32, device=device)
    num, kvi, kvp, words = _ops._selection_mask(idx, 600001, 1, 128, 128, False, 0)
    assert num.item() == 2 and kvi[0, 0, 0, :2].tolist() == [0, 4687]
    bits = decode_bits(words[kvp[0, 0, 0, 1].item()].cpu(), 128)
    assert bits[0].nonzero().flatten().tolist() == [600000 - 4687 * 128]
