"""Plan one step: which ranks run which sequences, packed how, with which SP size and recompute.

The problem. A step's sequences must each run once, in micro-batches; a micro-batch packs one or
more sequences and runs on an aligned block of ``s`` ranks (``s`` a power of two, ranks
``[k*s, (k+1)*s)``) with one recompute policy, and must fit the memory cap. A rank's time is the
sum of the micro-batches of the blocks it belongs to (see :mod:`dcp_compile.schedule.plan` for why that is
exact); the step takes the longest rank's time, the *makespan*, which we minimise.

How this differs from the published DCP schedulers, and why:

1. **Nested blocks, not one partition per step.** The published schedulers split the world into
   disjoint groups for a step (intra) or keep one group per bucket (inter). Here a rank can run a
   micro-batch on a block of 8 and then short sequences on its own: blocks of different sizes
   overlap, ordered largest first, so nobody waits. The long-tail case (one huge video and
   thousands of images) then needs no compromise between a big group for the video and many
   small groups for the images.
2. **Packing across buckets.** Any sequences may share a micro-batch (varlen attention); short
   ones are packed up to the memory cap instead of padding to a bucket's batch, which amortises
   the fixed per-micro-batch cost (launches, all-to-all latency, weight reads).
3. **Recompute per micro-batch from the cost model**, the fastest policy that fits, instead of a
   per-bucket knapsack computed offline; the cap is 90% of memory, not 65-70%, because the plan is
   computed from exact token counts rather than from a profile that must leave room for error.
4. **A deterministic optimiser instead of random draws with magic penalties**:
   (a) each sequence takes the SP size of least rank-seconds (the first size that holds it under
   each recompute policy is the only candidate for that policy), unless it alone would outlast
   the step: a binary search over target makespans then picks the sizes of these tall sequences,
   charging each its whole fixed cost; (b) longest-processing-time placement with first-fit
   packing: the big sequences first, across sizes, each on the block of its size with the least
   maximum rank load (a tree of block maxima with one lazy heap per level), then the rest level
   by level from a heap of block maxima; (c) a local search on the busiest rank: move a sequence to
   the least-loaded block of its size or of the next feasible size up or down, or to the block
   around the busy rank; swap it with a shorter one; or consolidate everything under one of the
   busy rank's blocks into a single micro-batch on that block (the move that wins when fixed
   costs dominate), while the makespan drops; (d) a merge pass that fuses micro-batches of a
   block when that saves a fixed cost; (e) on small steps (at most 8 sequences and 8 ranks) a
   bounded branch-and-bound that proves or improves the result. Everything depends only on the
   inputs (no time limits, no unseeded randomness), so every rank derives the same plan.

Measured (``tests/test_planner.py``, ``benchmarks/planner.py``): optimal on small steps (with
(e)); without (e), within 2% of the exhaustive optimum on average and 15% at worst on random
4-rank steps of up to 6 sequences; within 1-2% of a lower bound on 4096-sequence steps, in 15-50 ms
of pure Python on a shared 2-core machine (about half that on an idle modern core).

Assumption: peak memory depends only on a micro-batch's token count (flash/varlen attention), so
"fits" is a token capacity per (SP size, policy), computed once from the cost model.

The phases live in their own modules, each a function of one :class:`~.planning_state.PlanState`
(the step's micro-batches and rank loads, with the moves they share): (a) :mod:`.levels`,
(b) :mod:`.placement`, (c) and (d) :mod:`.local_search`, (e) :mod:`.exact_search`. This module
keeps the tables they read (per SP size and policy: time coefficients and token capacities) and
runs them in order.

Under sharded model state (``CostModel.state_sharding``: ZeRO-3) every micro-batch issues world
collectives, and the plan is cut into rounds with the same count on every rank (:mod:`.rounds`):
the phases above plan as usual, every micro-batch's fixed cost holding the round's all-gathers
and reduce-scatters, then :func:`.rounds.assign_rounds` and :func:`.rounds.balance_rounds` lay the
micro-batches out in rounds, and the baselines' plans are compared laid out the same way.
"""

from __future__ import annotations

import copy
import gc
import logging
import math
from dataclasses import dataclass, replace
from typing import Sequence

from dcp_compile.variant import RECOMPUTE_POLICIES, RecomputePolicy

from .analytic import ScoreLayout
from .baseline_candidates import best_of_baselines
from .cost_model import CostModel
from .exact_search import exact_search
from .levels import choose_levels
from .local_search import local_search, merge_micro_batches
from .placement import place
from .plan import Schedule
from .plan_tables import PlanTables
from .planning_state import EPSILON, PlanningError, PlanState
from .rounds import assign_rounds, balance_rounds

__all__ = ["Planner", "PlannerConfig", "PlanningError", "plan_step"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PlannerConfig:
    """Knobs of the planner; the defaults are what the benchmarks use.

    ``local_search_evaluations`` bounds the local search by a count of candidate evaluations (not
    by time: a time limit would make ranks disagree). ``exact_search_nodes`` is the node budget of
    the branch-and-bound run on steps of at most ``exact_search_max_sequences`` sequences and
    ``exact_search_max_ranks`` ranks (0 disables it). ``pack_equal_lengths_only``: a micro-batch
    holds sequences of one length only, for models whose samples cannot share a packed row (a
    video DiT whose cross-attention to each clip's caption cannot take sequence boundaries, so a
    micro-batch runs one call per clip shape: packing two lengths would cost two fixed costs,
    where the cost model would count one).
    """

    memory_fraction: float = 0.9
    max_tokens_per_rank: int | None = None
    max_sp_size: int | None = None
    local_search_evaluations: int = 8_000
    exact_search_nodes: int = 40_000
    exact_search_max_sequences: int = 8
    exact_search_max_ranks: int = 16
    pack_equal_lengths_only: bool = False
    sp_sizes: tuple[int, ...] | None = None
    recompute_policies: tuple[RecomputePolicy, ...] | None = None


class Planner(PlanTables):
    """Plans steps for one cost model, world size and memory cap (its tables, built once, are
    what the planning phases read)."""

    def __init__(
        self,
        cost_model: CostModel,
        world_size: int,
        memory_fraction: float | None = None,
        max_tokens_per_rank: int | None = None,
        config: PlannerConfig | None = None,
    ) -> None:
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        config = config or PlannerConfig()
        overrides = {}
        if memory_fraction is not None:
            overrides["memory_fraction"] = memory_fraction
        if max_tokens_per_rank is not None:
            overrides["max_tokens_per_rank"] = max_tokens_per_rank
        self.config = replace(config, **overrides)
        if not 0 < self.config.memory_fraction <= 1:
            raise ValueError(f"memory_fraction must be in (0, 1], got {self.config.memory_fraction}")
        self.cost_model = cost_model
        self._rung_below: Planner | None | bool = False  # built at its first use (False: not yet)
        if cost_model.rounds and cost_model.optimizer_shards != world_size:
            raise ValueError(
                f"the cost model shards the model state over optimizer_shards={cost_model.optimizer_shards} ranks "
                f"(state_sharding={cost_model.state_sharding.value!r}) but the planner plans for a world of "
                f"{world_size}: dcp.shard_model shards over the world, so build the CostModel with "
                f"optimizer_shards={world_size}")
        super().__init__(
            cost_model, world_size, memory_cap=self.config.memory_fraction * cost_model.hardware.memory_capacity,
            max_sp_size=self.config.max_sp_size, max_tokens_per_rank=self.config.max_tokens_per_rank,
            mixed_packing=not self.config.pack_equal_lengths_only, sp_sizes=self.config.sp_sizes,
            recompute_policies=self.config.recompute_policies,
        )

    # ------------------------------------------------------------------ public API
    def plan(self, lengths: Sequence[int], spans: Sequence[float] | None = None) -> Schedule:
        """The schedule of one step over sequences of ``lengths`` (``spans``: keys per query, default
        the length). Raises :class:`PlanningError` if a sequence fits on no block."""
        n = len(lengths)
        if n == 0:
            return Schedule(self.world_size, [], scheduler="dcp")
        lengths = [int(x) for x in lengths]
        if spans is None:
            keys = [float(x) * x for x in lengths]
        else:
            if len(spans) != n:
                raise ValueError(f"got {len(spans)} spans for {n} lengths; give one span per sequence")
            keys = [float(x) * s for x, s in zip(lengths, spans)]
        # The planner allocates many small objects and frees none: the cyclic collector would
        # only add pauses of up to a few hundred ms over a large heap.
        collecting = gc.isenabled()
        gc.disable()
        try:
            # A packed row's scores on a dense-row device follow from its sums only when keys are
            # squared lengths; given spans, the cost model counts them as given, and so does this.
            dense_rows = spans is None and self.score_layout is ScoreLayout.DENSE_RANGES
            state = self._search(self, lengths, keys, dense_rows)
            makespan = max(state.loads)
            longest = max(lengths)
            # Restarts on restricted tables (see RESTRICTED_CAPACITY_SHARES): small steps only, where
            # a few coarse micro-batches cannot be balanced; large ones balance within 1-2% anyway.
            restarts = self._restricted_tables(sum(lengths) / self.world_size, longest) if n <= RESTART_MAX_SEQUENCES else []
            for tables in restarts:
                if longest > max(tables.max_capacity):
                    continue  # the restriction cannot hold the longest sequence
                candidate = self._search(tables, lengths, keys, dense_rows)
                self._reprice(candidate, n)
                if max(candidate.loads) < makespan - EPSILON:
                    state, makespan = candidate, max(candidate.loads)
            schedule = best_of_baselines(self, state.to_schedule(), lengths, keys, spans)
            return self._no_slower_than_the_rung_below(schedule, lengths, spans) if n <= LADDER_MAX_SEQUENCES else schedule
        finally:
            if collecting:
                gc.enable()

    def _no_slower_than_the_rung_below(self, schedule: Schedule, lengths: list[int],
                                       spans: Sequence[float] | None) -> Schedule:
        """``schedule``, or this step's plan under the memory ladder's rung below this cap when that
        one is faster (it fits here: this cap is larger). That plan takes the rung below its own,
        and so on down, so a plan of at most :data:`LADDER_MAX_SEQUENCES` sequences is never slower
        than under any rung below its cap (:data:`MEMORY_LADDER_STEP`)."""
        lower = self.rung_below()
        if lower is None or max(lengths) > max(lower.max_capacity):
            return schedule  # nothing below holds the longest sequence (nor any rung under it)
        try:
            candidate = lower.plan(lengths, spans)
        except PlanningError:
            return schedule
        if candidate.makespan < schedule.makespan - EPSILON:
            origin = f"memory_fraction={lower.config.memory_fraction:g}"  # the rung it was made under
            if candidate.chosen_from and not candidate.chosen_from.startswith("memory_fraction="):
                origin = f"{origin}: {candidate.chosen_from}"
            return replace(candidate, chosen_from=origin if not (candidate.chosen_from or "").startswith(
                "memory_fraction=") else candidate.chosen_from)
        return schedule

    def rung_below(self) -> "Planner | None":
        """The planner of the same cost model, world and settings under the memory ladder's rung
        below this cap (``None`` at the bottom)."""
        if self._rung_below is False:
            fraction = rung_below(self.config.memory_fraction)
            self._rung_below = None if fraction is None else Planner(
                self.cost_model, self.world_size, config=replace(self.config, memory_fraction=fraction))
        return self._rung_below

    def _search(self, tables: PlanTables, lengths: list[int], keys: list[float], dense_rows: bool) -> PlanState:
        """Phases (a)-(e) of one step on ``tables`` (this planner's, or a restricted copy)."""
        n = len(lengths)
        state = PlanState(tables, lengths, keys, dense_rows=dense_rows)
        choose_levels(state)
        place(state)
        # Large steps are already within a fraction of a percent after placement (many small
        # items balance well); the search budget goes to small steps, where it matters.
        budget = min(self.config.local_search_evaluations, max(200, 2_000_000 // n))
        local_search(state, budget)
        merge_micro_batches(state)
        if (
            self.config.exact_search_nodes
            and n <= self.config.exact_search_max_sequences
            and self.world_size <= self.config.exact_search_max_ranks
        ):
            exact_search(state, self.config.exact_search_nodes)
        return state

    def _restricted_tables(self, per_rank: float, longest: int) -> list[PlanTables]:
        """Copies of the tables where a micro-batch holds at most a share of ``per_rank`` tokens per
        rank (:data:`RESTRICTED_CAPACITY_SHARES`), or at most ``longest`` tokens (never more than the
        cap lets it hold)."""
        out = []
        limits = [[int(per_rank * share * size) for size in self.sizes] for share in RESTRICTED_CAPACITY_SHARES]
        limits.append([longest] * self.levels)
        for limit in limits:
            tables = copy.copy(self)
            tables.capacity = [[min(c, cut) for c in row] for row, cut in zip(self.capacity, limit)]
            if tables.capacity == self.capacity or any(t.capacity == tables.capacity for t in out):
                continue
            tables.max_capacity = [max(row) for row in tables.capacity]
            tables.capacity_reach = []
            for p in range(len(RECOMPUTE_POLICIES)):
                reach, running = [], 0
                for j in range(self.levels):
                    running = max(running, tables.capacity[j][p])
                    reach.append(running)
                tables.capacity_reach.append(reach)
            tables.fast_path = False
            out.append(tables)
        return out

    def _reprice(self, state: PlanState, n: int) -> None:
        """Put a plan made on restricted tables back on this planner's: each micro-batch takes the
        fastest policy that fits it here, then the local search and merge go on from there."""
        state.tables = self
        state._options_cache.clear()
        state._neighbour_cache.clear()
        state.loads = [0.0] * self.world_size
        for block_mbs in state.block_mbs:
            for mb in block_mbs:
                mb.policy = self.policy_for(mb.level, mb.tokens)
                mb.time = state.micro_batch_time(mb.level, mb.policy, mb.tokens, mb.keys, len(mb.members))
                for r in state.block_ranks(mb.level, mb.block):
                    state.loads[r] += mb.time
        local_search(state, min(self.config.local_search_evaluations, max(200, 2_000_000 // n)))
        merge_micro_batches(state)

    def finish(self, schedule: Schedule, lengths: Sequence[int], keys: Sequence[float], dense_rows: bool = False) -> Schedule:
        """The schedule as it runs: laid out in rounds under sharded model state (see the module
        docstring), else as it is. ``dense_rows``: as :class:`PlanState`'s."""
        if not self.cost_model.rounds:
            return schedule
        return balance_rounds(assign_rounds(schedule), self, lengths, keys, dense_rows=dense_rows)

    def lower_bound(self, lengths: Sequence[int], spans: Sequence[float] | None = None) -> float:
        """A makespan no schedule can beat: the larger of the average least work per rank and the
        longest sequence's least time (packing never makes a sequence cheaper than alone, bar the
        shared fixed cost, which is left out)."""
        if not lengths:
            return 0.0
        keys = [float(x) * x for x in lengths] if spans is None else [float(x) * s for x, s in zip(lengths, spans)]
        total = 0.0
        longest = 0.0
        for length, key in zip(lengths, keys):
            best_work = best_time = float("inf")
            for j, size in enumerate(self.sizes):
                p = self.policy_for(j, length)
                if p < 0:
                    continue
                variable = self.per_token[j][p] * length + self.per_key[j][p] * key + self.per_sequence[j][p]
                best_work = min(best_work, size * variable)
                best_time = min(best_time, self.fixed[j][p] + variable)
            if best_work == float("inf"):
                raise PlanningError(self.no_fit_message(length))
            total += best_work
            longest = max(longest, best_time)
        return max(total / self.world_size, longest)

    def no_fit_message(self, length: int) -> str:
        static = self.cost_model.memory_coefficients(1, "full").fixed_bytes
        if static >= self.memory_cap:
            return (
                f"the model state alone ({static / 1e9:.1f} GB of parameters, gradients, optimizer state and "
                f"runtime reserve) exceeds the memory cap of {self.memory_cap / 1e9:.1f} GB, so no sequence fits; "
                "shard the optimizer state (CostModel(optimizer_shards=world size) for ZeRO-1), shard the whole "
                "state during the step (state_sharding='sharded', dcp.shard_model(model, reshard_after_forward=True)) "
                "or also offload it to the host (state_sharding='sharded_offload'), or check the "
                "cost model's hardware and memory_fraction"
            )
        # The group that holds the most is not always the largest one: a bigger group keeps more
        # all-to-all buffers per token, so quote the best capacity and where it is.
        best_level = max(range(self.levels), key=lambda j: (self.max_capacity[j], -j))
        best_policy = RECOMPUTE_POLICIES[self.capacity[best_level].index(self.max_capacity[best_level])]
        restricted = ""
        if len(self.allowed_sizes) < self.levels or len(self.allowed_policies) < len(RECOMPUTE_POLICIES):
            restricted = (f" (SP sizes {list(self.allowed_sizes)} and policies "
                          f"{[p.value for p in self.allowed_policies]} allowed)")
        return (
            f"a sequence of {length:,} tokens fits on no SP group: the most any group holds is "
            f"{self.max_capacity[best_level]:,} tokens ({self.sizes[best_level]} ranks, recompute={best_policy.value}) "
            f"under the memory cap of {self.memory_cap / 1e9:.1f} GB{restricted}"
            + (f" and max_tokens_per_rank={self.config.max_tokens_per_rank}" if self.config.max_tokens_per_rank else "")
            + "; split or truncate such samples, raise memory_fraction / max_tokens_per_rank, or use more ranks"
        )


# Why restarts. With more memory the phases pack more tokens per micro-batch and give sequences
# smaller groups (less work), which on a small step makes a few coarse items that cannot be
# balanced: the plan under a larger cap came out up to 12% slower than under a smaller one (random
# steps of 1-40 sequences on 8 and 16 ranks, tests/test_planner_properties.py). So small steps are
# also planned on copies of the tables whose micro-batches hold at most a share of the step's
# average tokens per rank (per rank of the group), or at most the longest sequence's tokens; these
# limits do not depend on the cap, so planners under two caps share the restarts where the caps do
# not bind. Each restart is then repriced on the real tables (fastest policy that fits) and
# searched on from there; the best plan wins.
RESTRICTED_CAPACITY_SHARES = (1.0, 0.5, 0.25)
RESTART_MAX_SEQUENCES = 512

# Why a memory ladder. Restarts make a larger cap's plan slower less often, not never: the search
# is local, and with more room it can settle on other, coarser micro-batches (a 9-sequence step on
# 16 ranks: 1.3% slower under 0.85 of the memory than under 0.8). A plan made under a smaller cap
# fits a larger one, so a planner (on steps of at most RESTART_MAX_SEQUENCES sequences) also plans
# under the rung of this ladder below its cap, which plans under the rung below its own, and keeps
# the fastest: by construction never slower than under any rung below the cap. Between two caps
# off the ladder the smaller one's plan is not among those tried; a finer ladder tries more plans.
# Each rung is a plan more (a video step of 40 clips on 8 ranks at 0.9: 17 rungs, 6 -> 84 ms; a
# 500-sequence text step on 16 ranks: 0.27 -> 1.06 s), so only small steps climb it: large ones
# balance within 1-2% anyway, and a plan of hundreds of sequences is not planned 18 times.
MEMORY_LADDER_STEP = 0.05  # of the device's memory
LADDER_MAX_SEQUENCES = 64


def rung_below(memory_fraction: float) -> float | None:
    """The largest multiple of :data:`MEMORY_LADDER_STEP` below ``memory_fraction`` (``None`` if none)."""
    rung = math.ceil(round(memory_fraction / MEMORY_LADDER_STEP, 9)) - 1
    return round(rung * MEMORY_LADDER_STEP, 9) if rung >= 1 else None


def plan_step(
    cost_model: CostModel,
    lengths: Sequence[int],
    world_size: int,
    spans: Sequence[float] | None = None,
    memory_fraction: float = 0.9,
    max_tokens_per_rank: int | None = None,
) -> Schedule:
    """One-shot convenience: build a :class:`Planner` and plan one step."""
    return Planner(cost_model, world_size, memory_fraction, max_tokens_per_rank).plan(lengths, spans)
