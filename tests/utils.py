"""Test helpers: seeded inputs and the tolerance rule (an op's error within a small multiple of the
error of the same math in the input dtype, plus a floor: see check_close)."""

from __future__ import annotations

import torch

from sparse_attn import BlockSparseMask, reference

LOW_PRECISION = (torch.bfloat16, torch.float16)


def make_qkv(b, h, hkv, lq, lk, d, dv=None, *, dtype=torch.bfloat16, device="cpu", seed=0, layout="bhld",
             scale_inputs=1.0):
    """Fresh random q, k, v. layout "blhd" gives (B, L, H, D)-contiguous storage viewed as
    (B, H, L, D), as a transformer layer's projections produce."""
    g = torch.Generator().manual_seed(seed)
    dv = d if dv is None else dv

    def rand(heads, length, dim):
        x = torch.randn(b, length, heads, dim, generator=g) * scale_inputs
        if layout == "blhd":
            return x.to(dtype).to(device).transpose(1, 2)
        return x.transpose(1, 2).contiguous().to(dtype).to(device)

    return rand(h, lq, d), rand(hkv, lk, d), rand(hkv, lk, dv)


def _floor(gold: torch.Tensor, dtype: torch.dtype) -> float:
    g = gold.to(dtype)
    return 2 * ((g + 0.3 - 0.3) - g).abs().max().item() if g.numel() else 0.0


def check_close(name, out, gold, lp, *, dtype, defined=None, c_max=2.0, c_mean=2.0):
    """Assert ``out`` (the op) against ``gold`` (fp64 reference) with the FlashAttention rule:
    max error <= c_max * (error of the same math in ``dtype``) + floor, and likewise for the mean.

    ``lp`` is the low-precision reference (same math in ``dtype``); for fp32 inputs the rule
    uses Flex's 10x factor. Rows where ``defined`` is False (fully masked) must be exactly 0.
    NaN never passes.
    """
    out64, gold64, lp64 = out.double(), gold.double(), lp.double()
    finite = torch.isfinite(gold64)
    assert not torch.isnan(out64[finite]).any(), f"{name}: NaN where the reference is finite"
    assert torch.isfinite(out64[finite]).all(), f"{name}: inf where the reference is finite"
    if dtype == torch.float32:
        c_max, c_mean = 10 * c_max, 10 * c_mean
    err = (out64 - gold64).abs().masked_fill(~finite, 0)
    err_lp = (lp64 - gold64).abs().masked_fill(~finite, 0)
    if not torch.isfinite(err_lp).all():  # degenerate low-precision reference: fixed table
        atol = {torch.float16: 4e-3, torch.bfloat16: 2e-2}.get(dtype, 1e-5)
        rtol = {torch.float16: 4e-4, torch.bfloat16: 5e-3}.get(dtype, 1e-5)
        torch.testing.assert_close(out64[finite], gold64[finite], atol=atol, rtol=rtol)
        return
    floor = max(_floor(gold64, dtype), 1e-6)
    e_k, e_lp = err.max().item() if err.numel() else 0.0, err_lp.max().item() if err.numel() else 0.0
    m_k, m_lp = err.mean().item() if err.numel() else 0.0, err_lp.mean().item() if err.numel() else 0.0
    where = tuple(int(i) for i in torch.unravel_index(err.argmax(), err.shape)) if err.numel() else ()
    msg = (f"{name}: e_k={e_k:.3e} e_lp={e_lp:.3e} ratio={e_k / max(e_lp, 1e-30):.2f} floor={floor:.2e} "
           f"m_k={m_k:.3e} m_lp={m_lp:.3e} at {where}")
    assert e_k <= c_max * e_lp + floor, msg
    assert m_k <= c_mean * m_lp + floor / 10, msg
    if defined is not None:
        empty = ~defined
        if empty.any():
            assert (out64[empty] == 0).all(), f"{name}: a fully masked row is not exactly 0"


def check_attention(out, lse, q, k, v, *, mask=None, causal=False, scale=None, name="out"):
    """Compare an op's (out, lse) with the fp64 reference under the same mask."""
    gold, gold_lse = reference.attention(q, k, v, mask=mask, causal=causal, scale=scale)
    lp, _ = reference.attention(q, k, v, mask=mask, causal=causal, scale=scale, dtype=q.dtype)
    defined = torch.isfinite(gold_lse)
    check_close(name, out, gold, lp, dtype=q.dtype, defined=defined.unsqueeze(-1).expand_as(gold))
    if lse is not None:
        assert lse.dtype == torch.float32
        assert torch.equal(torch.isneginf(lse), ~defined), f"{name}: LSE is -inf exactly on the empty rows"
        both = defined
        tol = 1e-4 if q.dtype == torch.float32 else 2e-3
        err = (lse.double()[both] - gold_lse[both]).abs()
        assert err.numel() == 0 or err.max().item() <= tol * max(1.0, gold_lse[both].abs().max().item()), (
            f"{name}: lse error {err.max().item():.3e}")
    return gold


def band_mask(lq: int, lk: int, causal: bool = False, window=None) -> torch.Tensor:
    """(Lq, Lk) bool: what flash_attention's causal and window=(left, right) let row i see
    (bottom-right aligned; a bound of None is unbounded)."""
    i = torch.arange(lq)[:, None] + (lk - lq)
    j = torch.arange(lk)[None, :]
    m = torch.ones(lq, lk, dtype=torch.bool)
    if causal:
        m &= j <= i
    if window is not None:
        left, right = window
        if left is not None:
            m &= j >= i - left
        if right is not None:
            m &= j <= i + right
    return m


def block_kernel_mask(mask: BlockSparseMask) -> BlockSparseMask:
    """The same block mask as a plain one: block_sparse_attention runs it through the block-sparse
    kernel even where the pattern builder's tag would route it elsewhere (patterns.causal,
    sliding_window, dilated, dilated_2d), so tests of the kernel keep their causal, band, all-partial
    and empty-row masks."""
    return BlockSparseMask(*mask._tensors(), seq_lengths=mask.seq_lengths, block_size=mask.block_size)
