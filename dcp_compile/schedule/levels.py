"""Planning phase (a): the SP size (level) of every sequence.

Each sequence takes the size of least rank-seconds; only the first size that holds it under each
recompute policy is a candidate for that policy (at a fixed policy, work grows with the SP size:
more communication). A sequence that alone would outlast the step's average rank load is *tall*:
a binary search over target makespans then picks the sizes of the tall sequences, charging each
its whole fixed cost.
"""

from __future__ import annotations

from bisect import bisect_left

from .plan_tables import PlanTables
from .planning_state import EPSILON, PlanningError, PlanState



def choose_levels(state: PlanState) -> None:
    """Set ``state.level``, ``state.alone_time`` and ``state.average_load`` for every sequence."""
    planner = state.tables
    fixed0, per_token0, per_key0 = planner.fixed[0][0], planner.per_token[0][0], planner.per_key[0][0]
    per_sequence0 = planner.per_sequence[0][0]
    base_capacity = planner.capacity[0][0]
    fast = planner.fast_path
    amortised0 = fixed0 / base_capacity if base_capacity else 0.0
    work = [0.0] * state.n
    times = [0.0] * state.n
    level = state.level
    cache: dict[tuple[int, float], tuple[int, float, float]] = {}
    lengths, keys = state.lengths, state.keys
    for i in range(state.n):
        length = lengths[i]
        key = keys[i]
        if fast and length <= base_capacity:
            variable = per_token0 * length + per_key0 * key + per_sequence0
            work[i] = variable + amortised0 * length
            times[i] = fixed0 + variable
            continue
        choice = cache.get((length, key))
        if choice is None:
            choice = cache[(length, key)] = least_work_choice(planner, length, key)
        level[i], work[i], times[i] = choice
    state.alone_time = times
    state.average_load = sum(work) / state.world
    _choose_tall_levels(state, work, times)


def least_work_choice(planner: PlanTables, length: int, key: float) -> tuple[int, float, float]:
    """(level, amortised rank-seconds, time alone) of the least-work level for one sequence.

    At a fixed policy, work grows with the SP size (more communication), so the only candidate
    levels are, per policy, the first level whose capacity under that policy holds the sequence
    (where it then runs the fastest policy that fits).
    """
    capacity, sizes = planner.capacity, planner.sizes
    fixed, per_token, per_key, per_sequence = planner.fixed, planner.per_token, planner.per_key, planner.per_sequence
    levels = planner.levels
    best = None
    seen = -1
    for reach in planner.capacity_reach:
        j = bisect_left(reach, length)
        if j == levels or j == seen:
            continue
        seen = j
        row = capacity[j]
        q = 0
        while length > row[q]:
            q += 1
        variable = per_token[j][q] * length + per_key[j][q] * key + per_sequence[j][q]
        work = sizes[j] * (variable + fixed[j][q] * length / row[q])
        if best is None or work < best[1]:
            best = (j, work, fixed[j][q] + variable)
    if best is None:
        raise PlanningError(planner.no_fit_message(length))
    return best


def _choose_tall_levels(state: PlanState, work: list[float], times: list[float]) -> None:
    """Sequences that alone take longer than the step's average rank load get bigger groups.

    For a target makespan T each tall sequence takes its least-work level among those finishing
    within T (else its fastest); the estimate ``max(total work / world, longest time)`` is then
    minimised over the candidate targets (the tall sequences' times per level). The work term
    falls and the longest-time term rises with T, so a binary search finds the crossing.
    """
    world = state.world
    total = sum(work)
    average = total / world
    order = sorted((i for i in range(state.n) if times[i] > average), key=times.__getitem__, reverse=True)
    groups: dict[tuple[int, float], list[int]] = {}
    fixed_longest = 0.0
    if len(order) < state.n:
        fixed_longest = max(t for t in times if t <= average)
    for i in order:
        if len(groups) >= 4 * world:
            fixed_longest = max(fixed_longest, times[i])
            continue
        options = state.options(i)
        if len(options) == 1:
            fixed_longest = max(fixed_longest, times[i])
            continue
        groups.setdefault((state.lengths[i], state.keys[i]), []).append(i)
    if not groups:
        return
    sizes = state.tables.sizes
    group_list = list(groups.values())
    # A tall sequence runs alone in its micro-batch: it pays the whole fixed cost, so its work
    # at a level is size x time (not the amortised figure used for short sequences).
    group_options = [
        [(t, sizes[j] * t, j) for j, _, t in state.options(members[0])] for members in group_list
    ]
    short_total = total - sum(work[i] for members in group_list for i in members)
    candidates = sorted({t for options in group_options for t, _, _ in options})

    def evaluate(target: float) -> tuple[float, float, list[int]]:
        tall_total = 0.0
        longest = fixed_longest
        choice = []
        for members, options in zip(group_list, group_options):
            within = [(w, t, j) for t, w, j in options if t <= target * (1 + 1e-12)]
            if within:
                w, t, j = min(within)
            else:
                t, w, j = min(options)
            tall_total += len(members) * w
            longest = max(longest, t)
            choice.append(j)
        return (short_total + tall_total) / world, longest, choice

    low, high = 0, len(candidates) - 1
    while low < high:  # first target where the longest time reaches the average load
        middle = (low + high) // 2
        average_load, longest, _ = evaluate(candidates[middle])
        if longest >= average_load:
            high = middle
        else:
            low = middle + 1
    best = None
    for index in (low - 1, low, low + 1):
        if 0 <= index < len(candidates):
            average_load, longest, choice = evaluate(candidates[index])
            estimate = max(average_load, longest)
            if best is None or estimate < best[0] - EPSILON:
                best = (estimate, choice)
    for members, j in zip(group_list, best[1]):
        for i in members:
            state.level[i] = j
            for jj, p, t in state.options(i):
                if jj == j:
                    state.alone_time[i] = t
