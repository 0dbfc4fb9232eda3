"""Attention with sinks as gpt-oss writes it by hand: a learned per-head logit concatenated to the
scores before the softmax (after a causal mask, with the row maximum subtracted) and dropped
after, so each query may put part of its weight on "no token". Spelled with the sink column last
or first, with grouped-query heads (keys/values repeated) or not."""

from __future__ import annotations

import math

import torch
import torch.nn as nn

WIDTH, HEADS = 16, 2
HEAD_DIM = WIDTH // HEADS


class SinkAttention(nn.Module):
    def __init__(self, sink_first: bool, kv_heads: int) -> None:
        super().__init__()
        self.sink_first, self.kv_heads = sink_first, kv_heads
        self.q = nn.Linear(WIDTH, WIDTH)
        self.kv = nn.Linear(WIDTH, 2 * kv_heads * HEAD_DIM)
        self.out = nn.Linear(WIDTH, WIDTH)
        self.sinks = nn.Parameter(torch.randn(HEADS))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        q = self.q(x).view(b, n, HEADS, HEAD_DIM).transpose(1, 2)
        k, v = self.kv(x).view(b, n, 2, self.kv_heads, HEAD_DIM).permute(2, 0, 3, 1, 4)
        if self.kv_heads != HEADS:  # transformers' repeat_kv
            k, v = (t.repeat_interleave(HEADS // self.kv_heads, dim=1) for t in (k, v))
        scores = torch.matmul(q, k.transpose(2, 3)) / math.sqrt(HEAD_DIM)
        future = torch.ones(n, n, dtype=torch.bool, device=x.device).triu(1)
        scores = scores.masked_fill(future, float("-inf"))
        sinks = self.sinks.reshape(1, -1, 1, 1).expand(b, -1, n, -1)
        combined = torch.cat([sinks, scores] if self.sink_first else [scores, sinks], dim=-1)
        combined = combined - combined.max(dim=-1, keepdim=True).values
        probs = torch.softmax(combined, dim=-1, dtype=combined.dtype)
        weights = probs[..., 1:] if self.sink_first else probs[..., :-1]
        out = torch.matmul(weights, v).transpose(1, 2).reshape(b, n, WIDTH)
        return x + self.out(out)


class SinkModel(nn.Module):
    def __init__(self, sink_first: bool = False, kv_heads: int = HEADS) -> None:
        super().__init__()
        self.layers = nn.ModuleList(SinkAttention(sink_first, kv_heads) for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


VARIANTS = {
    "sink_last": dict(),
    "sink_first_gqa": dict(sink_first=True, kv_heads=1),
}


def build(name: str) -> SinkModel:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return SinkModel(**VARIANTS[name])


def activations(length: int, batch: int = 2) -> torch.Tensor:
    return torch.randn(batch, length, WIDTH, generator=torch.Generator().manual_seed(length))


def sinks_worker(rank: int, world_size: int, names: list[str], lengths: list[int]) -> dict:
    from sequence_programs import check_model

    results = {}
    for name in names:
        problems, seen = check_model(name, lambda name=name: build(name), activations, lengths)
        results[name] = {"problems": problems, **seen}
    return results
