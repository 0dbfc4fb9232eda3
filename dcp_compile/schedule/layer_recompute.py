"""A per-layer recompute mix for one micro-batch, priced by the cost model: our counterpart of
the published pyramid recompute.

The published system chooses, per bucket, which layers run unchecked (a 0/1 choice per layer
between "keep everything" and "checkpoint the block"). Here each layer may take any of the
policies (``none``, ``attention``, ``selective``, ``full``, ``block``); the model's layers are
alike, so a mix is a count per policy, and the best mix under a memory cap is found by trying
every count split (``C(L + k - 1, k - 1)`` for ``k`` policies: 32k for 56 layers and 4, about
30 ms). A policy no faster and no smaller than another is dropped first (it can be swapped for
the other in any mix at no cost): ``block`` at SP 1, or where ``full`` is priced as it. Time and memory are linear in
the counts: each layer contributes its share (``1 / L``) of the whole-model difference between
policies, which is how the cost model builds them.

This is priced only: the compiler applies one policy to a whole micro-batch today, so the planner
does not use mixes; :func:`best_layer_mix` shows what per-layer choice would buy on the same model.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from dcp_compile.variant import RECOMPUTE_POLICIES, RecomputePolicy

from .cost_model import CostModel


@dataclass(frozen=True)
class LayerMix:
    """How many layers run under each policy, and the micro-batch's priced time and peak memory."""

    layers: dict[RecomputePolicy, int]
    time: float
    peak_memory: float


def mix_cost(
    cost_model: CostModel, lengths: Sequence[int], sp_size: int, layers: dict[RecomputePolicy, int],
    spans: Sequence[float] | None = None,
) -> tuple[float, float]:
    """(time, peak memory) of a micro-batch whose layers run under ``layers`` (counts per policy)."""
    total = cost_model.profile.num_layers
    if sum(layers.values()) != total:
        raise ValueError(f"a layer mix must cover all {total} layers, got {sum(layers.values())}")
    time = sum(count / total * cost_model.time(lengths, sp_size, policy, spans) for policy, count in layers.items())
    memory = sum(count / total * cost_model.peak_memory(lengths, sp_size, policy) for policy, count in layers.items())
    return time, memory


def best_layer_mix(
    cost_model: CostModel, lengths: Sequence[int], sp_size: int, memory_cap: float,
    spans: Sequence[float] | None = None, policies: Sequence[RecomputePolicy] = RECOMPUTE_POLICIES,
) -> LayerMix | None:
    """The fastest count split over ``policies`` whose peak memory is under ``memory_cap``, or None."""
    total = cost_model.profile.num_layers
    times = {p: cost_model.time(lengths, sp_size, p, spans) for p in policies}
    peaks = {p: cost_model.peak_memory(lengths, sp_size, p) for p in policies}
    policies = [p for i, p in enumerate(policies) if not any(
        times[q] <= times[p] and peaks[q] <= peaks[p] and (j < i or times[q] < times[p] or peaks[q] < peaks[p])
        for j, q in enumerate(policies) if q is not p)]
    best: LayerMix | None = None

    def visit(index: int, left: int, counts: dict[RecomputePolicy, int]) -> None:
        nonlocal best
        policy = policies[index]
        if index == len(policies) - 1:
            split = {**counts, policy: left}
            peak = sum(n * peaks[p] for p, n in split.items()) / total
            if peak <= memory_cap:
                time = sum(n * times[p] for p, n in split.items()) / total
                if best is None or time < best.time:
                    best = LayerMix(split, time, peak)
            return
        for count in range(left + 1):
            visit(index + 1, left - count, {**counts, policy: count})

    visit(0, total, {})
    return best
