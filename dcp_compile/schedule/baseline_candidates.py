"""The planner never loses to a plan it could have made: the user baselines' plans as candidates.

Static SP at one size with per-micro-batch recompute or one policy for all (the fixed lean setup
ALST runs among them), Megatron's packed static CP and dynamic CP (:mod:`.user_baselines`) make plans that lie inside the planner's search space (aligned blocks,
the same policies, the same cap), but its heuristics do not always find them: long text at 8
ranks planned 1-2% slower than static SP 8. So after planning, each such plan is made too, and the
fastest is kept. A candidate is only built when a lower bound on its makespan (its sequences'
least work at its sizes, spread over the world, with no fixed cost) is below the planner's own
makespan, which on large steps is almost never: the check costs one pass over the sequences.
"""

from __future__ import annotations

import logging
import math
from collections import Counter
from typing import TYPE_CHECKING, Sequence

from dcp_compile.variant import RECOMPUTE_POLICIES

from .analytic import ScoreLayout
from .plan import Schedule
from .plan_tables import EPSILON
from .user_baselines import (
    DYNAMIC_CP_THRESHOLD_SHARES, BalancedStaticSP, PackedStaticCP, dynamic_cp_at_share, dynamic_cp_threshold,
    gpus_needed,
)

if TYPE_CHECKING:
    from .planner import Planner

log = logging.getLogger(__name__)


def _least_work(planner: "Planner", level: int, length: int, key: float, policies: Sequence[int]) -> tuple[float, float]:
    """(rank-seconds, seconds alone) of one sequence at ``level`` under the fastest of ``policies``
    that holds it alone, without the fixed cost; (inf, inf) where none does."""
    row = planner.capacity[level]
    feasible = [p for p in policies if length <= row[p]]
    if not feasible:
        return math.inf, math.inf
    variable = min(planner.per_token[level][p] * length + planner.per_key[level][p] * key
                   + planner.per_sequence[level][p] for p in feasible)
    return planner.sizes[level] * variable, variable + min(planner.fixed[level][p] for p in feasible)


def _makespan_bound(planner: "Planner", sizes_of: dict[tuple[int, float], int], distinct: Counter,
                    policies: Sequence[int], tokens: int) -> float:
    """No plan that runs each sequence at ``sizes_of[(length, key)]``'s level beats this: its least
    work spread over the world (each micro-batch paying a fixed cost and holding at most its level's
    capacity), or its longest sequence alone."""
    world = planner.world_size
    work = longest = 0.0
    tokens_at: dict[int, int] = {}
    for (length, key), count in distinct.items():
        level = sizes_of[(length, key)]
        rank_seconds, alone = _least_work(planner, level, length, key, policies)
        work += count * rank_seconds
        longest = max(longest, alone)
        tokens_at[level] = tokens_at.get(level, 0) + count * length
    for level, level_tokens in tokens_at.items():
        capacity = max(planner.capacity[level][p] for p in policies)
        work += planner.sizes[level] * min(planner.fixed[level][p] for p in policies) * -(-level_tokens // capacity)
    return max(work / world, longest)


def best_of_baselines(planner: "Planner", schedule: Schedule, lengths: Sequence[int], keys: Sequence[float],
                      spans: Sequence[float] | None) -> Schedule:
    """``schedule``, or a baseline candidate's plan when that one has the smaller makespan (each laid
    out as it runs: in rounds under sharded model state, :meth:`Planner.finish`)."""
    dense_rows = spans is None and planner.score_layout is ScoreLayout.DENSE_RANGES
    schedule = planner.finish(schedule, lengths, keys, dense_rows)
    best, best_makespan = schedule, schedule.makespan
    config = planner.config
    world = planner.world_size
    allowed_levels = [j for j, size in enumerate(planner.sizes) if size in planner.allowed_sizes]
    allowed_policies = [p for p, policy in enumerate(RECOMPUTE_POLICIES) if policy in planner.allowed_policies]
    restrictions = dict(policies=planner.allowed_policies, max_tokens_per_rank=config.max_tokens_per_rank)
    longest = max(lengths)
    candidates = []
    tokens = sum(lengths)
    distinct = Counter(zip(lengths, keys))  # steps repeat shapes (video buckets): price each once
    for level in allowed_levels:
        if _least_work(planner, level, longest, longest, allowed_policies)[0] == math.inf:
            continue  # the longest sequence fits no allowed policy at this size
        bound = _makespan_bound(planner, dict.fromkeys(distinct, level), distinct, allowed_policies, tokens)
        if bound < best_makespan - EPSILON:
            candidates.append(lambda level=level: BalancedStaticSP(
                planner.cost_model, world, planner.memory_cap, planner.sizes[level], longest,
                pack_equal_lengths_only=config.pack_equal_lengths_only, **restrictions))
            # One policy for every micro-batch, packed up to what that policy holds: fewer, larger
            # micro-batches than the fastest policy's, which wins where each micro-batch pays a
            # large fixed cost (a ZeRO-3 round: the state's all-gathers, host copies when offloaded).
            # The fixed lean setup (ALST's) and Megatron's packed static CP are such plans.
            # Two such policies a level: the fastest that holds the longest sequence (what a user
            # fixes) and the one that holds the most (the largest packs); each is a plan to make.
            holding = [p for p in planner.allowed_policies if planner.capacity[level][RECOMPUTE_POLICIES.index(p)] >= longest]
            roomiest = max(holding, key=lambda p: planner.capacity[level][RECOMPUTE_POLICIES.index(p)], default=None)
            for policy in dict.fromkeys(holding[:1] + ([roomiest] if roomiest is not None else [])):
                candidates.append(lambda level=level, policy=policy: BalancedStaticSP(
                    planner.cost_model, world, planner.memory_cap, planner.sizes[level], longest,
                    per_microbatch_recompute=False, pack_equal_lengths_only=config.pack_equal_lengths_only,
                    policies=(policy,), max_tokens_per_rank=config.max_tokens_per_rank))
                if not config.pack_equal_lengths_only and config.max_tokens_per_rank is None:
                    candidates.append(lambda level=level, policy=policy: PackedStaticCP(
                        planner.cost_model, world, planner.memory_cap, planner.sizes[level], longest, recompute=policy))
    # Every policy at every threshold a user tries: the grid comparison.py tunes dynamic CP over, so
    # no threshold and policy tuned with hindsight plans a step faster than this planner. With only
    # the fastest policy that holds the longest sequence, dynamic CP tuned to `selective` planned 3%
    # faster on the long-sequence replay (replay_long_cpu, 8 ranks).
    dynamic_grid = [(policy, share) for policy in planner.allowed_policies for share in DYNAMIC_CP_THRESHOLD_SHARES] \
        if not config.pack_equal_lengths_only and len(allowed_levels) == planner.levels else []

    def consider(scheduler) -> None:
        nonlocal best, best_makespan
        try:
            candidate = scheduler.schedule(lengths, spans)
        except ValueError:  # the baseline cannot plan this step under the planner's restrictions
            return
        for microbatch in candidate.microbatches:
            microbatch.round = 0
        candidate = planner.finish(Schedule(world, candidate.microbatches, scheduler="dcp", chosen_from=scheduler.name),
                                   lengths, keys, dense_rows)
        if candidate.makespan < best_makespan - EPSILON:
            log.debug("planner: %s's plan (%.4g s) beats the planned one (%.4g s)", scheduler.name,
                      candidate.makespan, best_makespan)
            best, best_makespan = candidate, candidate.makespan

    for build in candidates:
        try:
            scheduler = build()
        except ValueError:  # the baseline cannot hold this step under the planner's restrictions
            continue
        consider(scheduler)
    level_of = {size: j for j, size in enumerate(planner.sizes)}
    for policy, share in dynamic_grid:
        # The threshold from the planner's own capacity tables (the same cost model, cap and
        # restrictions as the scheduler's), so that a candidate the bound rules out is never built:
        # building one prices every group size's capacity again.
        p = RECOMPUTE_POLICIES.index(policy)
        threshold = dynamic_cp_threshold(min(planner.capacity[j][p] // size for j, size in enumerate(planner.sizes)),
                                         share)
        if threshold < 1 or gpus_needed(longest, threshold) > world:
            continue  # the policy cannot hold the longest sequence at this threshold
        needed = {shape: gpus_needed(shape[0], threshold) for shape in distinct}
        if any(size not in level_of for size in needed.values()):
            continue  # a CP size the planner does not build (heads or world it cannot split over)
        sizes_of = {shape: level_of[size] for shape, size in needed.items()}
        if _makespan_bound(planner, sizes_of, distinct, [p], tokens) >= best_makespan - EPSILON:
            continue
        try:
            scheduler = dynamic_cp_at_share(planner.cost_model, world, planner.memory_cap, longest, share,
                                            recompute=policy, **restrictions)
        except ValueError:
            continue
        consider(scheduler)
    return best
