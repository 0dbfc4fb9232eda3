"""The planner's tables: per SP level and recompute policy, a micro-batch's time coefficients and
token capacity, and the block numbering of the rank grid. Built once per cost model and world;
the planning phases read them through :class:`~.planning_state.PlanState` (this module, not the
planner, is what the state depends on).

Blocks are numbered level by level: block ``block_offset[level] + k`` is ranks
``[k * size, (k + 1) * size)`` with ``size = sizes[level]``.
"""

from __future__ import annotations

import logging
from typing import Collection

from dcp_compile.variant import RECOMPUTE_POLICIES, RecomputePolicy

from .cost_model import CostModel

log = logging.getLogger(__name__)
EPSILON = 1e-12  # seconds: costs closer than this are equal


class PlanTables:
    """Per (level, policy): fixed, per-token, per-token-key and per-sequence seconds and the token
    capacity under ``memory_cap``; levels are the SP sizes 1, 2, 4, ... up to the world (or
    ``max_sp_size``)."""

    def __init__(self, cost_model: CostModel, world_size: int, memory_cap: float, max_sp_size: int | None = None,
                 max_tokens_per_rank: int | None = None, mixed_packing: bool = True,
                 sp_sizes: Collection[int] | None = None,
                 recompute_policies: Collection[RecomputePolicy | str] | None = None) -> None:
        self.world_size = world_size
        self.mixed_packing = mixed_packing
        self.memory_cap = memory_cap
        # Which scores a packed micro-batch computes on the measured device: the planner must count
        # what the cost model counts, or it prices packed rows below what they cost there.
        self.score_layout = cost_model.score_layout
        limit = min(world_size, max_sp_size or world_size)
        sizes = [1]
        while sizes[-1] * 2 <= limit:
            sizes.append(sizes[-1] * 2)
        self.sizes = sizes
        self.levels = len(sizes)
        self.blocks_per_level = [world_size // s for s in sizes]
        self.block_offset = []
        offset = 0
        for count in self.blocks_per_level:
            self.block_offset.append(offset)
            offset += count
        self.num_blocks = offset
        policies = len(RECOMPUTE_POLICIES)
        self.fixed = [[0.0] * policies for _ in sizes]
        self.per_token = [[0.0] * policies for _ in sizes]
        self.per_key = [[0.0] * policies for _ in sizes]
        # What each sample costs on every rank of its group whatever its length (a DiT's caption:
        # its key/value projections run in full on every rank). Every phase prices it: a short
        # clip on 4 ranks pays its caption 4 times in rank-seconds, which is why it runs on 1.
        self.per_sequence = [[0.0] * policies for _ in sizes]
        self.capacity = [[0] * policies for _ in sizes]
        # A size or policy left out holds no tokens: every phase then never places a sequence there
        # (the restricted planners of an ablation, or of a scheduler that must not choose them).
        allowed_sizes = set(sizes) if sp_sizes is None else {int(s) for s in sp_sizes}
        allowed_policies = set(RECOMPUTE_POLICIES) if recompute_policies is None else {
            RecomputePolicy.parse(p) for p in recompute_policies}
        if not allowed_sizes & set(sizes):
            raise ValueError(f"sp_sizes={sorted(allowed_sizes)} holds none of the SP sizes {sizes} of a world of "
                             f"{world_size}; give powers of two up to the world size")
        if not allowed_policies:
            raise ValueError("recompute_policies is empty; give at least one policy")
        self.allowed_sizes = tuple(size for size in sizes if size in allowed_sizes)
        self.allowed_policies = tuple(policy for policy in RECOMPUTE_POLICIES if policy in allowed_policies)
        for j, size in enumerate(sizes):
            for p, policy in enumerate(RECOMPUTE_POLICIES):
                coefficients = cost_model.time_coefficients(size, policy)
                self.fixed[j][p] = coefficients.fixed
                self.per_token[j][p] = coefficients.per_token
                self.per_key[j][p] = coefficients.per_token_key
                self.per_sequence[j][p] = coefficients.per_sequence
                capacity = cost_model.token_capacity(size, policy, self.memory_cap)
                if size not in allowed_sizes or policy not in allowed_policies:
                    capacity = 0
                if max_tokens_per_rank is not None:
                    capacity = min(capacity, max_tokens_per_rank * size)
                self.capacity[j][p] = capacity
        self.max_capacity = [max(row) for row in self.capacity]
        # Per policy, the running maximum of the capacity over levels: the first level that holds a
        # length under a policy is the first where this monotone reach covers it (bisect).
        self.capacity_reach = []
        for p in range(policies):
            reach, running = [], 0
            for j in range(len(sizes)):
                running = max(running, self.capacity[j][p])
                reach.append(running)
            self.capacity_reach.append(reach)
        # Is "SP 1, no recompute" the least work for every sequence that fits it? It is when every
        # other (size, policy) costs at least as much per token and per token-key, counting the
        # base choice's amortised fixed cost (true for any sane model; checked so that the fast
        # path stays correct for odd cost models).
        base_capacity = self.capacity[0][0]
        self.fast_path = base_capacity > 0 and all(
            size * self.per_token[j][p] >= self.per_token[0][0] + self.fixed[0][0] / base_capacity - EPSILON
            and size * self.per_key[j][p] >= self.per_key[0][0] - EPSILON
            and size * self.per_sequence[j][p] >= self.per_sequence[0][0] - EPSILON
            for j, size in enumerate(sizes)
            for p in range(policies)
            if (j, p) != (0, 0)
        )
        if not self.fast_path:
            log.info("planner fast path disabled: SP 1 without recompute is not the cheapest per token")

    def policy_for(self, level: int, tokens: int) -> int:
        """The fastest policy under which ``tokens`` fit at ``level``, or -1."""
        capacity = self.capacity[level]
        for p in range(len(capacity)):
            if tokens <= capacity[p]:
                return p
        return -1

    def micro_batch_time(self, level: int, policy: int, tokens: int, keys: float, sequences: int) -> float:
        """Seconds of a micro-batch of ``sequences`` sequences, ``tokens`` tokens (``keys``
        token-keys) at ``level`` under ``policy``."""
        return (self.fixed[level][policy] + self.per_token[level][policy] * tokens + self.per_key[level][policy] * keys
                + self.per_sequence[level][policy] * sequences)
