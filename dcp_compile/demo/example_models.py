"""A small GPT-style decoder the demo and the benchmarks train: plain PyTorch, no DCP code in it."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


class Block(nn.Module):
    def __init__(self, hidden: int, heads: int):
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(hidden)
        self.qkv = nn.Linear(hidden, 3 * hidden, bias=False)
        self.proj = nn.Linear(hidden, hidden, bias=False)
        self.norm2 = nn.LayerNorm(hidden)
        self.mlp = nn.Sequential(nn.Linear(hidden, 4 * hidden), nn.GELU(), nn.Linear(4 * hidden, hidden))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        batch, length, hidden = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(batch, length, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        attention = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attention.transpose(1, 2).reshape(batch, length, hidden))
        return x + self.mlp(self.norm2(x))


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-second, first], dim=-1) * sin


class TinyGPT(nn.Module):
    """GPT-style decoder: RoPE from ``arange``, causal SDPA, shifted-label cross-entropy."""

    def __init__(self, vocab: int = 512, hidden: int = 128, layers: int = 2, heads: int = 4):
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.blocks = nn.ModuleList(Block(hidden, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(hidden)
        self.head = nn.Linear(hidden, vocab, bias=False)
        head_dim = hidden // heads
        self.register_buffer("inv_freq", 1.0 / 10000 ** (torch.arange(0, head_dim, 2).float() / head_dim), persistent=False)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor,
                position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """``position_ids`` ``[B, S]``: RoPE positions, for packed rows where they restart per sequence."""
        if position_ids is None:
            positions = torch.arange(input_ids.shape[1], device=input_ids.device).float()
            angles = torch.outer(positions, self.inv_freq)  # [S, D/2], broadcast over batch and heads
        else:
            angles = (position_ids.float()[..., None] * self.inv_freq).unsqueeze(1)  # [B, 1, S, D/2]
        cos, sin = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()
        x = self.embed(input_ids)
        for block in self.blocks:
            x = block(x, cos, sin)
        logits = self.head(self.norm(x)).float()
        shifted = F.pad(labels, (0, 1), value=-100)[:, 1:]
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), shifted.reshape(-1), ignore_index=-100)
