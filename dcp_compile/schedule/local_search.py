"""Planning phases (c) and (d): improve a placed step by moves, then merge micro-batches.

(c) A local search on the busiest rank, while the makespan drops: move one of its sequences to
the least-loaded block of its size or of the next feasible size up or down, or to the block
around the busy rank; swap it with a shorter one on the least-loaded block of the same size; or
consolidate everything under one of the busy rank's blocks into a single micro-batch on that
block (the move that wins when fixed per-micro-batch costs dominate). The search is bounded by a
count of candidate evaluations, never by time, so every rank stops at the same plan.

(d) A merge pass that fuses two micro-batches of one block when the merged one is faster than
the two apart (one fixed cost saved, no slower recompute policy needed).
"""

from __future__ import annotations

from bisect import bisect_left

from .planning_state import EPSILON, DraftMicroBatch, PlanState

CONSOLIDATION_LIMIT = 16  # most micro-batches merged by one consolidation move


def _affected_max(state: PlanState, src_level: int, src_block: int, removal: float, dst_level: int, dst_block: int, insertion: float, maxima: list[float]) -> float:
    """Max load over the ranks of both blocks after moving a sequence between them."""
    src = state.block_ranks(src_level, src_block)
    dst = state.block_ranks(dst_level, dst_block)
    if src.stop <= dst.start or dst.stop <= src.start:
        a = maxima[src_block] + removal
        b = maxima[dst_block] + insertion
        return a if a > b else b
    low = min(src.start, dst.start)
    high = max(src.stop, dst.stop)
    loads = state.loads
    best = float("-inf")
    for r in range(low, high):
        value = loads[r]
        if src.start <= r < src.stop:
            value += removal
        if dst.start <= r < dst.stop:
            value += insertion
        if value > best:
            best = value
    return best


def local_search(state: PlanState, budget: int) -> None:
    """Move, consolidate or swap on the busiest rank while the makespan drops, for at most
    ``budget`` candidate evaluations (see the module docstring)."""
    planner = state.tables
    evaluations = 0
    while evaluations < budget:
        maxima = state.block_maxima()
        makespan = max(state.loads)
        critical = state.loads.index(makespan)
        # least-loaded and second least-loaded block per level
        least: list[tuple[int, int]] = []
        for level in range(planner.levels):
            offset = planner.block_offset[level]
            count = planner.blocks_per_level[level]
            first = second = -1
            for k in range(count):
                value = maxima[offset + k]
                if first < 0 or value < maxima[offset + first]:
                    first, second = k, first
                elif second < 0 or value < maxima[offset + second]:
                    second = k
            least.append((offset + first, offset + second if second >= 0 else -1))
        critical_blocks = [
            planner.block_offset[level] + (critical >> level)
            if (critical >> level) < planner.blocks_per_level[level] else -1
            for level in range(planner.levels)
        ]
        best_value = makespan - max(1e-9 * makespan, EPSILON)
        best_move = None
        for src_level in range(planner.levels):
            src_block = planner.block_offset[src_level] + (critical >> src_level)
            if src_level and (critical >> src_level) >= planner.blocks_per_level[src_level]:
                continue
            for mb in state.block_mbs[src_block]:
                seen_lengths = set()
                for i in mb.members:
                    signature = (state.lengths[i], state.keys[i])
                    if signature in seen_lengths or evaluations >= budget:
                        continue
                    seen_lengths.add(signature)
                    removal, _ = state.removal(i)
                    for dst_level in state.neighbour_levels(i, src_level):
                        # The least-loaded block of that size, and (for another size) the one
                        # around or inside the busy rank: spreading a sequence over the busy
                        # rank's neighbours often beats moving it far away.
                        first, second = least[dst_level]
                        targets = [second if first == src_block else first]
                        if dst_level != src_level:
                            around = critical_blocks[dst_level]
                            if around >= 0 and around != targets[0]:
                                targets.append(around)
                        for dst_block in targets:
                            if dst_block < 0:
                                continue
                            insertion, _, _ = state.first_fit(dst_block, dst_level, i)
                            evaluations += 1
                            value = _affected_max(state, src_level, src_block, removal, dst_level, dst_block, insertion, maxima)
                            if value < best_value:
                                best_value = value
                                best_move = (i, dst_level, dst_block)
        consolidation = _best_consolidation(state, critical, best_value)
        if consolidation is not None:
            _consolidate(state, *consolidation)
            continue
        if best_move is not None:
            i, dst_level, dst_block = best_move
            state.remove(i)
            delta, mb, policy = state.first_fit(dst_block, dst_level, i)
            state.add(i, dst_level, dst_block, mb, policy, delta)
            continue
        swap = _find_swap(state, critical, makespan, maxima, least)
        evaluations += swap[1]
        if swap[0] is None:
            break
        i, k = swap[0]
        level_i, block_i = state.seq_mb[i].level, state.seq_mb[i].block
        level_k, block_k = state.seq_mb[k].level, state.seq_mb[k].block
        before = list(state.loads)
        saved = state.snapshot(block_i, block_k)
        state.remove(i)
        state.remove(k)
        delta, mb, policy = state.first_fit(block_k, level_k, i)
        state.add(i, level_k, block_k, mb, policy, delta)
        delta, mb, policy = state.first_fit(block_i, level_i, k)
        state.add(k, level_i, block_i, mb, policy, delta)
        affected = list(state.block_ranks(level_i, block_i)) + list(state.block_ranks(level_k, block_k))
        if max(state.loads[r] for r in affected) >= makespan - max(1e-9 * makespan, EPSILON):
            state.restore(saved, before)
            break


def _best_consolidation(state: PlanState, critical: int, threshold: float) -> tuple[int, int, float] | None:
    """Pack everything under one of the busy rank's blocks into a single micro-batch on that
    block, when that beats ``threshold``. The move that wins when fixed per-micro-batch costs
    dominate: a few short sequences run faster together on 4 ranks than apart on 1 or 2."""
    planner = state.tables
    best = None
    above = [0.0] * (planner.levels + 1)  # load from blocks strictly above each level
    for level in range(planner.levels - 1, -1, -1):
        k = critical >> level
        if k >= planner.blocks_per_level[level]:
            continue
        above[level] = above[level + 1] + sum(mb.time for mb in state.block_mbs[planner.block_offset[level] + k])
    for level in range(1, planner.levels):
        k = critical >> level
        if k >= planner.blocks_per_level[level]:
            continue
        mbs = state.subtree_micro_batches(level, k, limit=CONSOLIDATION_LIMIT)
        if mbs is None or len(mbs) < 2 or not all(state.packable(mbs[0].members, mb.members) for mb in mbs):
            continue
        tokens = sum(mb.tokens for mb in mbs)
        if tokens > planner.max_capacity[level]:
            continue
        policy = planner.policy_for(level, tokens)
        time = state.micro_batch_time(level, policy, tokens, sum(mb.keys for mb in mbs), sum(len(mb.members) for mb in mbs))
        value = above[level + 1] + time
        if value < threshold:
            threshold = value
            best = (level, k, value)
    return best


def _consolidate(state: PlanState, level: int, k: int, _value: float) -> None:
    planner = state.tables
    mbs = state.subtree_micro_batches(level, k)
    members = [i for mb in mbs for i in mb.members]
    for mb in mbs:
        state.block_mbs[mb.block].remove(mb)
        for r in state.block_ranks(mb.level, mb.block):
            state.loads[r] -= mb.time
    block = planner.block_offset[level] + k
    tokens = sum(state.lengths[i] for i in members)
    keys = sum(state.keys[i] for i in members)
    policy = planner.policy_for(level, tokens)
    time = state.micro_batch_time(level, policy, tokens, keys, len(members))
    mb = DraftMicroBatch(level, block, policy, tokens, keys, time, members)
    state.block_mbs[block].append(mb)
    for i in members:
        state.seq_mb[i] = mb
        state.level[i] = level
    for r in state.block_ranks(level, block):
        state.loads[r] += time


def _find_swap(state: PlanState, critical: int, makespan: float, maxima: list[float], least: list[tuple[int, int]]):
    """Swap a sequence on the busiest rank with a shorter one on the least-loaded block of the
    same size, choosing the pair whose time difference best splits the gap."""
    planner = state.tables
    evaluations = 0
    best = None
    best_value = makespan - max(1e-9 * makespan, EPSILON)
    for level in range(planner.levels):
        if (critical >> level) >= planner.blocks_per_level[level]:
            continue
        src_block = planner.block_offset[level] + (critical >> level)
        dst_block, second = least[level]
        if dst_block == src_block:
            dst_block = second
        if dst_block < 0:
            continue
        src = state.block_ranks(level, src_block)
        dst = state.block_ranks(level, dst_block)
        if not (src.stop <= dst.start or dst.stop <= src.start):
            continue
        gap = makespan - maxima[dst_block]
        if gap <= 0:
            continue
        candidates = []
        for mb in state.block_mbs[dst_block]:
            per_token = planner.per_token[level][mb.policy]
            per_key = planner.per_key[level][mb.policy]
            per_sequence = planner.per_sequence[level][mb.policy]
            for k in mb.members:
                candidates.append((per_token * state.lengths[k] + per_key * state.keys[k] + per_sequence, k))
        if not candidates:
            continue
        candidates.sort()
        values = [c[0] for c in candidates]
        for mb in state.block_mbs[src_block]:
            per_token = planner.per_token[level][mb.policy]
            per_key = planner.per_key[level][mb.policy]
            per_sequence = planner.per_sequence[level][mb.policy]
            for i in mb.members:
                own = per_token * state.lengths[i] + per_key * state.keys[i] + per_sequence
                position = bisect_left(values, own - gap / 2)
                for index in (position - 1, position):
                    if not 0 <= index < len(candidates):
                        continue
                    other_value, k = candidates[index]
                    difference = own - other_value
                    if difference <= 0:
                        continue
                    evaluations += 1
                    value = max(maxima[src_block] - difference, maxima[dst_block] + difference)
                    if value < best_value and state.lengths[i] <= planner.max_capacity[level]:
                        best_value = value
                        best = (i, k)
    return best, evaluations


def merge_micro_batches(state: PlanState) -> None:
    """Merge two micro-batches of one block when the merged one needs no slower recompute
    policy: it then saves one fixed per-micro-batch cost and costs nothing else."""
    planner = state.tables
    for level in range(planner.levels):
        offset = planner.block_offset[level]
        capacity = planner.capacity[level]
        for k in range(planner.blocks_per_level[level]):
            block = offset + k
            mbs = state.block_mbs[block]
            if len(mbs) < 2:
                continue
            mbs.sort(key=lambda mb: mb.tokens)
            # A merge never needs a policy slower than the slowest one already used here.
            slowest = max(mb.policy for mb in mbs)
            bound = max(capacity[: slowest + 1])
            a = 0
            while a < len(mbs) - 1:
                first = mbs[a]
                merge = None
                for b in range(a + 1, len(mbs)):
                    second = mbs[b]
                    policy = first.policy if first.policy > second.policy else second.policy
                    tokens = first.tokens + second.tokens
                    if tokens > bound:
                        break  # sorted by tokens: every later partner is larger
                    if tokens > capacity[policy] or not state.packable(first.members, second.members):
                        continue
                    policy = planner.policy_for(level, tokens)
                    time = state.micro_batch_time(level, policy, tokens, first.keys + second.keys,
                                                   len(first.members) + len(second.members))
                    # a slower policy for one side's tokens can cost more than the fixed cost saved
                    if time < first.time + second.time - EPSILON:
                        merge = (b, policy, time)
                        break
                if merge is None:
                    a += 1
                    continue
                b, policy, time = merge
                second = mbs[b]
                delta = time - first.time - second.time
                second.members.extend(first.members)
                second.tokens += first.tokens
                second.keys += first.keys
                second.time, second.policy = time, policy
                for i in first.members:
                    state.seq_mb[i] = second
                del mbs[a]
                mbs.sort(key=lambda mb: mb.tokens)
                for r in state.block_ranks(level, block):
                    state.loads[r] += delta
