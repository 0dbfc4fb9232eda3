"""Attention written through einops and einx helpers, as model code that uses them writes it:
heads split and merged by ``rearrange`` (or the ``Rearrange`` layer), GQA key/value heads repeated
by ``einops.repeat``, and the products spelled as ``einops.einsum`` (dynamo traces it to
``torch.einsum``), as ``einops.reduce`` of a broadcast product (a multiply, a permute moving the
reduced axis last, a ``sum``), or as ``einx.dot``. A sigmoid attention (no softmax) is the one
the finder cannot recognise: its warning must name the scores product."""

from __future__ import annotations

import math

import einops
import torch
import torch.nn as nn
from einops.layers.torch import Rearrange

WIDTH, HEADS, KV_HEADS = 16, 4, 2
HEAD_DIM = WIDTH // HEADS


def causal_mask(n: int, device: torch.device) -> torch.Tensor:
    return torch.ones(n, n, dtype=torch.bool, device=device).triu(1)


def einops_scores(q: torch.Tensor, k: torch.Tensor, spelling: str) -> torch.Tensor:
    """``[b h i d] x [b h j d] -> [b h i j]`` in one of the einops spellings."""
    if spelling == "einsum":
        return einops.einsum(q, k, "batch head i dim, batch head j dim -> batch head i j")
    if spelling == "reduce":
        pairs = einops.rearrange(q, "b h i d -> b h i 1 d") * einops.rearrange(k, "b h j d -> b h 1 j d")
        return einops.reduce(pairs, "b h i j d -> b h i j", "sum")
    # the tokens-first layout: einops permutes the reduced axis last, then sums
    pairs = einops.rearrange(q, "b h i d -> b i 1 h d") * einops.rearrange(k, "b h j d -> b 1 j h d")
    return einops.reduce(pairs, "b i j h d -> b h i j", "sum")


def einops_values(attn: torch.Tensor, v: torch.Tensor, spelling: str) -> torch.Tensor:
    """``[b h i j] x [b h j d] -> [b h i d]``."""
    if spelling == "einsum":
        return einops.einsum(attn, v, "b h i j, b h j d -> b h i d")
    pairs = einops.rearrange(attn, "b h i j -> b h i j 1") * einops.rearrange(v, "b h j d -> b h 1 j d")
    return einops.reduce(pairs, "b h i j d -> b h i d", "sum")


class EinopsAttention(nn.Module):
    """Causal GQA self-attention, every reshape and product an einops call."""

    def __init__(self, spelling: str) -> None:
        super().__init__()
        self.spelling = spelling
        self.q = nn.Sequential(nn.Linear(WIDTH, WIDTH), Rearrange("b n (h d) -> b h n d", h=HEADS))
        self.kv = nn.Linear(WIDTH, 2 * KV_HEADS * HEAD_DIM)
        self.out = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q = self.q(x)
        k, v = einops.rearrange(self.kv(x), "b n (two h d) -> two b h n d", two=2, h=KV_HEADS)
        k, v = (einops.repeat(t, "b h n d -> b (h r) n d", r=HEADS // KV_HEADS) for t in (k, v))
        scores = einops_scores(q, k, self.spelling) / math.sqrt(HEAD_DIM)
        scores = scores.masked_fill(causal_mask(x.shape[1], x.device), float("-inf"))
        out = einops_values(scores.softmax(dim=-1), v, self.spelling)
        return x + self.out(einops.rearrange(out, "b h n d -> b n (h d)"))


class EinxAttention(nn.Module):
    """Bidirectional attention in einx: ``einx.id`` for the heads, ``einx.dot`` for both products,
    ``einx.softmax`` over the keys."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(WIDTH, 3 * WIDTH)
        self.out = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        import einx

        q, k, v = einx.id("b n (three h d) -> three b h n d", self.qkv(x), three=3, h=HEADS)
        scores = einx.dot("b h i d, b h j d -> b h i j", q, k) / math.sqrt(HEAD_DIM)
        out = einx.dot("b h i j, b h j d -> b h i d", einx.softmax("b h i [j]", scores), v)
        return x + self.out(einx.id("b h n d -> b n (h d)", out))


class SigmoidAttention(nn.Module):
    """Sigmoid attention (no softmax: SDPA cannot express it, no region matches it), beside a
    smaller single-head ``[b, i, j]`` token-similarity gate: the scores are the larger product."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(WIDTH, 3 * WIDTH)
        self.out = nn.Linear(WIDTH, WIDTH)
        self.bias = nn.Parameter(torch.tensor(-2.0))  # sigmoid attention's -log(n), learned

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        gate = torch.sigmoid(x @ x.transpose(1, 2)).mean(-1, keepdim=True)  # [b, i, j], one head
        q, k, v = self.qkv(x).view(b, n, 3, HEADS, HEAD_DIM).permute(2, 0, 3, 1, 4)
        weights = torch.sigmoid(torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(HEAD_DIM) + self.bias)
        return x + gate * self.out((weights @ v).transpose(1, 2).reshape(b, n, WIDTH))


class Stack(nn.Module):
    def __init__(self, layer: type[nn.Module], *args: str) -> None:
        super().__init__()
        self.layers = nn.ModuleList(layer(*args) for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


VARIANTS = {
    "einops_einsum": lambda: Stack(EinopsAttention, "einsum"),
    "einops_reduce": lambda: Stack(EinopsAttention, "reduce"),
    "einops_reduce_tokens_first": lambda: Stack(EinopsAttention, "reduce_tokens_first"),
    "einx": lambda: Stack(EinxAttention),
}


def build(name: str) -> nn.Module:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return VARIANTS[name]()


def activations(length: int, batch: int = 2) -> torch.Tensor:
    return torch.randn(batch, length, WIDTH, generator=torch.Generator().manual_seed(length))


def einops_worker(rank: int, world_size: int, names: list[str], lengths: list[int]) -> dict:
    from sequence_programs import check_model

    results = {}
    for name in names:
        problems, seen = check_model(name, lambda name=name: build(name), activations, lengths)
        results[name] = {"problems": problems, **seen}
    return results
