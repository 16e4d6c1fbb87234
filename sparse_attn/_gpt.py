"""A small GPT-style block stack whose attention is a parameter: what the training test and the
end-to-end training benchmark run (one definition of the model for both)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

# attention(q, k, v) -> out, on (B, H, L, D) views of the (B, L, H, D) projections.
Attention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class Block(nn.Module):
    def __init__(self, width: int, heads: int, attention: Attention):
        super().__init__()
        self.heads, self.attention = heads, attention
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.proj = nn.Linear(width, 3 * width, bias=False), nn.Linear(width, width, bias=False)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, length, width = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, length, 3, self.heads, -1).unbind(2)
        o = self.attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        x = x + self.proj(o.transpose(1, 2).reshape(b, length, width))
        return x + self.mlp(self.norm2(x))


class GPT(nn.Module):
    def __init__(self, vocab: int, width: int, heads: int, layers: int, attention: Attention):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList(Block(width, heads, attention) for _ in range(layers))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def train(model: GPT, tokens: torch.Tensor, steps: int, lr: float = 1e-3) -> list[float]:
    """Next-token training with AdamW on one fixed batch; the loss of every step."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    losses = []
    for _ in range(steps):
        logits = model(tokens[:, :-1])
        loss = nn.functional.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(float(loss))
    return losses
