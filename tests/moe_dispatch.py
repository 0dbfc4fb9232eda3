"""Mixture-of-experts feed-forwards in the dispatch styles model libraries use, between attention
layers, for parity tests at SP 2:

* ``loop``: Mixtral's loop over experts: the (token, expert) pairs of each expert found with
  ``torch.where``, their rows picked with ``index_select`` and the expert's output added back with
  ``index_add_`` into a ``new_zeros`` buffer;
* ``gathered_weights``: experts as batched matmuls over the flattened (token, expert) pairs, each
  pair's expert weights gathered by expert id (``bmm(rows, w[expert_ids])``);
* ``sorted_bmm``: the pairs sorted by expert id, rows gathered in that order, a batched matmul
  with each row's expert weights, and the rows scattered back by ``index_add_`` of the pairs'
  token positions;
* ``capacity``: a Switch-style top-1 router with a capacity ``ceil(tokens * factor / experts)``:
  each token's position in its expert's buffer is a ``cumsum`` over the tokens, tokens past the
  capacity are dropped (their feed-forward output is zero), the kept ones are written into an
  ``[experts * capacity, D]`` buffer, run as one batched matmul over the experts and read back;
* ``sorted_capacity``: ``sorted_bmm`` with a capacity: a pair's place in its expert's group is its
  sorted position minus the group's start (per-expert counts by ``histc``), pairs past
  ``ceil(tokens * k * factor / experts)`` are dropped; ``sorted_cumsum_capacity`` counts the
  place by a ``cumsum`` over the sorted pairs' one-hot experts instead.

Each returns its output and an auxiliary load-balancing loss accumulated from ``new_zeros(())``.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

WIDTH, HEADS, EXPERTS, HIDDEN = 16, 2, 4, 24


class Experts(nn.Module):
    """The experts' weights, stacked: ``[E, D, H]`` and ``[E, H, D]``."""

    def __init__(self) -> None:
        super().__init__()
        self.w_in = nn.Parameter(torch.randn(EXPERTS, WIDTH, HIDDEN) * WIDTH**-0.5)
        self.w_out = nn.Parameter(torch.randn(EXPERTS, HIDDEN, WIDTH) * HIDDEN**-0.5)


class MoE(nn.Module):
    def __init__(self, style: str, top_k: int = 2, capacity_factor: float = 1.0) -> None:
        super().__init__()
        self.style, self.top_k, self.capacity_factor = style, top_k, capacity_factor
        self.router = nn.Linear(WIDTH, EXPERTS, bias=False)
        self.experts = Experts()

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        b, s, d = x.shape
        tokens = x.reshape(-1, d)
        probs = self.router(tokens).softmax(-1)
        aux = tokens.new_zeros(())
        aux = aux + (probs.mean(0) * probs.mean(0)).sum() * EXPERTS  # a load-balancing term
        out = getattr(self, self.style)(tokens, probs)
        return out.view(b, s, d), aux

    def routed(self, probs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        weights, experts = probs.topk(self.top_k, dim=-1)
        return weights / weights.sum(-1, keepdim=True), experts

    def loop(self, tokens: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
        weights, experts = self.routed(probs)
        out = tokens.new_zeros(tokens.shape)
        mask = F.one_hot(experts, EXPERTS).permute(2, 1, 0)  # [E, k, T]
        for e in range(EXPERTS):
            slot, token = torch.where(mask[e])
            rows = tokens.index_select(0, token)
            hidden = F.silu(rows @ self.experts.w_in[e]) @ self.experts.w_out[e]
            out.index_add_(0, token, hidden * weights[token, slot, None])
        return out

    def gathered_weights(self, tokens: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
        weights, experts = self.routed(probs)
        t, d = tokens.shape
        rows = tokens[:, None].expand(t, self.top_k, d).reshape(-1, 1, d)  # [T*k, 1, D]
        ids = experts.reshape(-1)
        hidden = F.silu(torch.bmm(rows, self.experts.w_in[ids]))
        out = torch.bmm(hidden, self.experts.w_out[ids]).view(t, self.top_k, d)
        return (out * weights[..., None]).sum(1)

    def sorted_bmm(self, tokens: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
        weights, experts = self.routed(probs)
        ids, order = experts.reshape(-1).sort()
        token = order // self.top_k
        rows = tokens.index_select(0, token).unsqueeze(1)
        hidden = F.silu(torch.bmm(rows, self.experts.w_in.index_select(0, ids)))
        out = torch.bmm(hidden, self.experts.w_out.index_select(0, ids)).squeeze(1)
        out = out * weights.reshape(-1)[order].unsqueeze(-1)
        return tokens.new_zeros(tokens.shape).index_add_(0, token, out)

    def capacity(self, tokens: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
        t, d = tokens.shape
        capacity = math.ceil(t * self.capacity_factor / EXPERTS)
        gate, expert = probs.max(-1)
        chosen = F.one_hot(expert, EXPERTS)  # [T, E]
        position = (chosen.cumsum(0) * chosen).sum(-1) - 1  # the token's place in its expert's buffer
        kept = position < capacity
        slot = torch.where(kept, expert * capacity + position, EXPERTS * capacity)  # dropped: a spare row
        buffer = tokens.new_zeros(EXPERTS * capacity + 1, d).index_add(0, slot, tokens)
        grouped = buffer[:-1].view(EXPERTS, capacity, d)
        hidden = torch.bmm(F.silu(torch.bmm(grouped, self.experts.w_in)), self.experts.w_out)
        rows = torch.cat([hidden.reshape(-1, d), hidden.new_zeros(1, d)])[slot]
        return rows * (gate * kept)[:, None]

    def sorted_capacity(self, tokens: torch.Tensor, probs: torch.Tensor, places: str = "counts") -> torch.Tensor:
        t = tokens.shape[0]
        capacity = math.ceil(t * self.top_k * self.capacity_factor / EXPERTS)
        weights, experts = self.routed(probs)
        ids, order = experts.reshape(-1).sort(stable=True)
        if places == "counts":  # a pair's sorted position minus its group's start
            counts = torch.histc(ids.float(), bins=EXPERTS, min=0, max=EXPERTS - 1).long()
            starts = counts.cumsum(0) - counts
            position = torch.arange(ids.shape[0], device=ids.device) - starts[ids]
        else:  # a running count of the pair's expert over the sorted pairs
            chosen = F.one_hot(ids, EXPERTS)
            position = (chosen.cumsum(0) * chosen).sum(-1) - 1
        token = order // self.top_k
        rows = tokens.index_select(0, token).unsqueeze(1)
        hidden = F.silu(torch.bmm(rows, self.experts.w_in.index_select(0, ids)))
        out = torch.bmm(hidden, self.experts.w_out.index_select(0, ids)).squeeze(1)
        out = out * (weights.reshape(-1)[order] * (position < capacity))[:, None]
        return tokens.new_zeros(tokens.shape).index_add_(0, token, out)

    def sorted_cumsum_capacity(self, tokens: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
        return self.sorted_capacity(tokens, probs, places="cumsum")


class Block(nn.Module):
    def __init__(self, style: str) -> None:
        super().__init__()
        self.qkv = nn.Linear(WIDTH, 3 * WIDTH)
        self.out = nn.Linear(WIDTH, WIDTH)
        self.norm = nn.LayerNorm(WIDTH)
        self.moe = MoE(style)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        b, n, _ = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, HEADS, WIDTH // HEADS).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.out(a.transpose(1, 2).reshape(b, n, WIDTH))
        ff, aux = self.moe(self.norm(x))
        return x + ff, aux


class MoEModel(nn.Module):
    """Two attention + MoE blocks; the output carries the auxiliary losses (as a mean-square loss
    of it trains them)."""

    def __init__(self, style: str) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(style) for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        total = x.new_zeros(())
        for block in self.blocks:
            x, aux = block(x)
            total = total + aux
        return x + 0.01 * total


STYLES = ("loop", "gathered_weights", "sorted_bmm", "capacity", "sorted_capacity", "sorted_cumsum_capacity")


def build(style: str) -> MoEModel:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return MoEModel(style)


def activations(length: int, batch: int = 2) -> torch.Tensor:
    return torch.randn(batch, length, WIDTH, generator=torch.Generator().manual_seed(length))


def moe_worker(rank: int, world_size: int, styles: list[str], lengths: list[int]) -> dict:
    from sequence_programs import check_model

    results = {}
    for style in styles:
        problems, seen = check_model(style, lambda style=style: build(style), activations, lengths)
        results[style] = {"problems": problems, **seen}
    return results
