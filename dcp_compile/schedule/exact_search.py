"""Planning phase (e): on small steps, a bounded branch-and-bound over packings and blocks.

Run on steps of a few sequences and ranks (``PlannerConfig.exact_search_max_sequences`` /
``exact_search_max_ranks``), where the heuristic phases can miss the optimum by a visible
margin. Sequences are taken longest first; each joins an open micro-batch or opens one on some
block; a branch is cut when its busiest rank, or the average of the placed loads plus the least
work still to place, reaches the best makespan found. Blocks that are mirror images of an
untouched sibling are skipped. The node budget (not a time limit) keeps every rank's answer the same.
"""

from __future__ import annotations

import logging

from .planning_state import DraftMicroBatch, PlanState

log = logging.getLogger(__name__)


def exact_search(state: PlanState, node_budget: int) -> None:
    """Branch-and-bound over packings and blocks; replaces the plan if it finds a better one."""
    planner = state.tables
    incumbent = max(state.loads)
    order = sorted(range(state.n), key=lambda i: (-state.lengths[i], i))
    sizes = planner.sizes
    blocks = []  # (level, block, first rank, size)
    for level, size in enumerate(sizes):
        for k in range(planner.blocks_per_level[level]):
            blocks.append((level, planner.block_offset[level] + k, k * size, size))
    least_work = []
    for i in order:
        best = float("inf")
        for j, p, t in state.options(i):
            best = min(best, sizes[j] * (t - planner.fixed[j][p]))
        least_work.append(best)
    remaining_work = [0.0] * (state.n + 1)
    for index in range(state.n - 1, -1, -1):
        remaining_work[index] = remaining_work[index + 1] + least_work[index]
    world = state.world
    loads = [0.0] * world
    open_mbs: list[list] = []  # [level, block, first, size, policy, tokens, keys, time, members]
    subtree_used = [0] * planner.num_blocks
    best_plan = None
    best_value = incumbent * (1 - 1e-9)
    nodes = 0
    lengths, keys = state.lengths, state.keys
    mixed = planner.mixed_packing

    def ancestors(level: int, k: int):
        for up in range(level, planner.levels):
            kk = k >> (up - level)
            if kk < planner.blocks_per_level[up]:
                yield planner.block_offset[up] + kk

    def symmetric_duplicate(level: int, k: int) -> bool:
        # Skip a pristine block whose pristine left sibling (at some ancestor) is equivalent.
        for up in range(level, planner.levels - 1):
            kk = k >> (up - level)
            if kk & 1:
                left = planner.block_offset[up] + kk - 1
                right = planner.block_offset[up] + kk
                if subtree_used[left] == 0 and subtree_used[right] == 0:
                    return True
        return False

    def search(index: int, current_max: float, total_load: float) -> None:
        nonlocal nodes, best_plan, best_value
        nodes += 1
        if nodes > node_budget:
            return
        if index == len(order):
            if current_max < best_value:
                best_value = current_max
                best_plan = [(m[0], m[1], m[4], list(m[8]), m[7], m[5]) for m in open_mbs]
            return
        if max(current_max, (total_load + remaining_work[index]) / world) >= best_value:
            return
        i = order[index]
        length, key = lengths[i], keys[i]
        # join an open micro-batch
        for m in open_mbs:
            if not (mixed or lengths[m[8][0]] == length):
                continue
            level = m[0]
            tokens = m[5] + length
            policy = planner.policy_for(level, tokens)
            if policy < 0:
                continue
            time = state.micro_batch_time(level, policy, tokens, m[6] + key, len(m[8]) + 1)
            delta = time - m[7]
            first, size = m[2], m[3]
            new_max = current_max
            for r in range(first, first + size):
                loads[r] += delta
                if loads[r] > new_max:
                    new_max = loads[r]
            if new_max < best_value:
                saved = (m[4], m[5], m[6], m[7])
                m[4], m[5], m[6], m[7] = policy, tokens, m[6] + key, time
                m[8].append(i)
                search(index + 1, new_max, total_load + delta * size)
                m[8].pop()
                m[4], m[5], m[6], m[7] = saved
            for r in range(first, first + size):
                loads[r] -= delta
            if nodes > node_budget:
                return
        # open a new micro-batch on some block
        for level, block, first, size in blocks:
            policy = planner.policy_for(level, length)
            if policy < 0:
                continue
            k = block - planner.block_offset[level]
            if symmetric_duplicate(level, k):
                continue
            time = planner.micro_batch_time(level, policy, length, key, 1)
            new_max = current_max
            for r in range(first, first + size):
                loads[r] += time
                if loads[r] > new_max:
                    new_max = loads[r]
            if new_max < best_value:
                touched = list(ancestors(level, k))
                for b in touched:
                    subtree_used[b] += 1
                open_mbs.append([level, block, first, size, policy, length, key, time, [i]])
                search(index + 1, new_max, total_load + time * size)
                open_mbs.pop()
                for b in touched:
                    subtree_used[b] -= 1
            for r in range(first, first + size):
                loads[r] -= time
            if nodes > node_budget:
                return

    search(0, 0.0, 0.0)
    if best_plan is None:
        return
    log.debug("exact search improved the makespan %.6g -> %.6g in %d nodes", incumbent, best_value, nodes)
    state.block_mbs = [[] for _ in range(planner.num_blocks)]
    state.loads = [0.0] * world
    for level, block, policy, members, time, tokens in best_plan:
        mb = DraftMicroBatch(level, block, policy, tokens, sum(keys[i] for i in members), time, list(members))
        state.block_mbs[block].append(mb)
        for i in members:
            state.seq_mb[i] = mb
            state.level[i] = level
        for r in state.block_ranks(level, block):
            state.loads[r] += time
