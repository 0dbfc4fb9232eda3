"""Attention as model libraries write it by hand: ``einsum`` products with any index names (an
ellipsis for the batch indices too), an additive relative-position or ALiBi bias, causal or
bidirectional, and a q/k normalisation by ``torch.linalg.vector_norm`` over the head dimension."""

from __future__ import annotations

import math

import torch
import torch.nn as nn

WIDTH, HEADS = 16, 2
HEAD_DIM = WIDTH // HEADS


def alibi_slopes(heads: int) -> torch.Tensor:
    return torch.tensor([2.0 ** (-8.0 * (h + 1) / heads) for h in range(heads)])


class EinsumAttention(nn.Module):
    """``einsum`` scores, optional bias, softmax, ``einsum`` with the values."""

    def __init__(self, causal: bool, bias: str, qk_norm: bool, layout: str) -> None:
        super().__init__()
        self.causal, self.bias, self.qk_norm, self.layout = causal, bias, qk_norm, layout
        self.qkv = nn.Linear(WIDTH, 3 * WIDTH)
        self.out = nn.Linear(WIDTH, WIDTH)
        self.relative = nn.Embedding(64, HEADS)  # learned relative-position bias, per head
        self.register_buffer("slopes", alibi_slopes(HEADS), persistent=False)

    def position_bias(self, n: int, device: torch.device) -> torch.Tensor:
        positions = torch.arange(n, device=device)
        distance = positions[None, :] - positions[:, None]  # [i, j]
        if self.bias == "alibi":
            return self.slopes[:, None, None] * distance[None]  # [h, i, j]
        buckets = distance.clamp(-32, 31) + 32
        return self.relative(buckets).permute(2, 0, 1)  # [h, i, j]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, HEADS, HEAD_DIM).unbind(2)  # [b, n, h, d]
        if self.qk_norm:
            q = q / torch.linalg.vector_norm(q, dim=-1, keepdim=True).clamp_min(1e-6)
            k = k / torch.linalg.vector_norm(k, dim=-1, keepdim=True).clamp_min(1e-6)
        if self.layout == "bhnd":
            q, k, v = (t.transpose(1, 2) for t in (q, k, v))
            scores = torch.einsum("b h i d, b h j d -> b h i j", q, k)
        elif self.layout == "ellipsis":  # batch and heads under an ellipsis
            q, k, v = (t.transpose(1, 2) for t in (q, k, v))
            scores = torch.einsum("...id,...jd->...ij", q, k)
        elif self.layout == "ellipsis_tokens_first":
            scores = torch.einsum("...qhd,...khd->...hqk", q, k)
        else:  # the tokens-first layout, other index names
            scores = torch.einsum("bqhc,bkhc->bhqk", q, k)
        scores = scores / math.sqrt(HEAD_DIM)
        if self.bias != "none":
            scores = scores + self.position_bias(n, x.device)
        if self.causal:
            future = torch.ones(n, n, dtype=torch.bool, device=x.device).triu(1)
            scores = scores.masked_fill(future, float("-inf"))
        attn = scores.softmax(dim=-1)
        if self.layout == "bhnd":
            out = torch.einsum("b h i j, b h j d -> b h i d", attn, v).transpose(1, 2)
        elif self.layout == "ellipsis":
            out = torch.einsum("...ij,...jd->...id", attn, v).transpose(1, 2)
        elif self.layout == "ellipsis_tokens_first":
            out = torch.einsum("...hqk,...khd->...qhd", attn, v)
        else:
            out = torch.einsum("bhqk,bkhc->bqhc", attn, v)
        return x + self.out(out.reshape(b, n, WIDTH))


class EinsumModel(nn.Module):
    def __init__(self, causal: bool, bias: str, qk_norm: bool = False, layout: str = "bhnd") -> None:
        super().__init__()
        self.layers = nn.ModuleList(EinsumAttention(causal, bias, qk_norm, layout) for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


VARIANTS = {
    "einsum_ellipsis_bidirectional": dict(causal=False, bias="none", layout="ellipsis"),
    "einsum_causal": dict(causal=True, bias="none"),
    "einsum_causal_alibi": dict(causal=True, bias="alibi"),
    "einsum_relative_bias": dict(causal=False, bias="relative"),
    "einsum_tokens_first_qk_norm": dict(causal=True, bias="none", qk_norm=True, layout="bnhd"),
    "einsum_ellipsis_tokens_first_alibi": dict(causal=False, bias="alibi", layout="ellipsis_tokens_first"),
}


def build(name: str) -> EinsumModel:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return EinsumModel(**VARIANTS[name])


def activations(length: int, batch: int = 2) -> torch.Tensor:
    return torch.randn(batch, length, WIDTH, generator=torch.Generator().manual_seed(length))


def spellings_worker(rank: int, world_size: int, names: list[str], lengths: list[int]) -> dict:
    from sequence_programs import check_model

    results = {}
    for name in names:
        problems, seen = check_model(name, lambda name=name: build(name), activations, lengths)
        results[name] = {"problems": problems, **seen}
    return results
