"""End to end: a small GPT trained with our attention follows SDPA's loss curve step for step
(the CPU kernels; on a GPU the CUDA kernels too)."""

import pytest
import torch

import sparse_attn
from sparse_attn._gpt import GPT, train


def _sdpa(q, k, v):
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)


def _ours(q, k, v):
    return sparse_attn.flash_attention(q, k, v, causal=True)


def _ours_block_sparse(q, k, v):
    mask = sparse_attn.patterns.causal(q.shape[2], k.shape[2], device=q.device)
    return sparse_attn.block_sparse_attention(q, k, v, mask)


@pytest.mark.parametrize("ours", [_ours, _ours_block_sparse], ids=["flash", "block_sparse"])
def test_loss_curve_equals_sdpa_over_50_steps(ours, device):
    tokens = torch.randint(0, 64, (2, 97), generator=torch.Generator().manual_seed(0)).to(device)
    curves = []
    for attention in (_sdpa, ours):
        torch.manual_seed(0)
        model = GPT(vocab=64, width=64, heads=4, layers=2, attention=attention).to(device)
        curves.append(train(model, tokens, steps=50))
    ref, got = torch.tensor(curves[0]), torch.tensor(curves[1])
    assert ref[-1] < 0.5 * ref[0], "the model did not learn: the comparison would say little"
    torch.testing.assert_close(got, ref, atol=2e-3, rtol=2e-3)
