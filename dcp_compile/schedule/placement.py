"""Planning phase (b): longest-processing-time placement with first-fit packing inside a block.

Phase 1 takes the big sequences (alone longer than 1/64 of the average rank load) in decreasing
time, whatever their level; each goes to the block of its size with the least maximum rank load
(block maxima kept in a tree, one lazy heap per level). Placing tall single-rank sequences
before multi-rank ones matters: a rank that already runs an 11 s video must not also be loaded
by every large block it belongs to. Phase 2 places the rest level by level, largest blocks first,
each level from one heap over its blocks (adding to a block raises all its ranks alike, so its
maximum stays exact); small items then only fill gaps.

Inside a block a sequence joins a micro-batch by :meth:`PlanState.first_fit`, the one packing rule
the other phases use too.
"""

from __future__ import annotations

import heapq

from .planning_state import PlanState

BIG_ITEM_FRACTION = 64  # sequences above average load / this are placed first, across levels


def place(state: PlanState) -> None:
    """Place every sequence at its chosen level (``state.level``); see the module docstring."""
    planner = state.tables
    times = state.alone_time
    order = sorted(range(state.n), key=times.__getitem__, reverse=True)  # stable: ties by index
    threshold = state.average_load / BIG_ITEM_FRACTION
    split = 0
    while split < state.n and times[order[split]] >= threshold:
        split += 1
    if split:
        _place_by_block_maxima(state, order[:split])
    by_level: list[list[int]] = [[] for _ in planner.sizes]
    for i in order[split:]:
        by_level[state.level[i]].append(i)
    for level in range(planner.levels - 1, -1, -1):
        _place_on_level(state, level, by_level[level])


def _place_on_level(state: PlanState, level: int, items: list[int]) -> None:
    """LPT of ``items`` over the blocks of one level from a heap of block maxima (adding to a
    block raises all its ranks alike, so its maximum stays exact), with next-fit packing into
    the block's newest micro-batch and first fit over a few recent ones."""
    if not items:
        return
    planner = state.tables
    size = planner.sizes[level]
    offset = planner.block_offset[level]
    lengths, keys = state.lengths, state.keys
    capacity = planner.capacity[level]
    per_token, per_key, per_sequence = planner.per_token[level], planner.per_key[level], planner.per_sequence[level]
    block_mbs = state.block_mbs
    seq_mb = state.seq_mb
    level_of = state.level
    loads = state.loads
    mixed = planner.mixed_packing
    dense = state.dense_rows
    count = planner.blocks_per_level[level]
    if size == 1:
        heap = [(loads[k], k) for k in range(count)]
    else:
        heap = [(max(loads[k * size : (k + 1) * size]), k) for k in range(count)]
    heapq.heapify(heap)
    added = [0.0] * count  # the blocks' ranks get their loads once, at the end
    heapreplace = heapq.heapreplace
    for i in items:
        load, k = heap[0]
        block = offset + k
        length = lengths[i]
        mbs = block_mbs[block]
        if mbs:
            # Common case, kept inline (it is most of the work on large steps): it fits the
            # block's newest micro-batch without a slower policy.
            mb = mbs[-1]
            q = mb.policy
            if mb.tokens + length <= capacity[q] and (mixed or lengths[mb.members[0]] == length):
                key = keys[i]
                if dense:
                    delta = state.micro_batch_time(level, q, mb.tokens + length, mb.keys + key, len(mb.members) + 1) - mb.time
                else:
                    delta = per_token[q] * length + per_key[q] * key + per_sequence[q]
                mb.tokens += length
                mb.keys += key
                mb.time += delta
                mb.members.append(i)
                seq_mb[i] = mb
                level_of[i] = level
                added[k] += delta
                heapreplace(heap, (load + delta, k))
                continue
        delta, mb, policy = state.first_fit(block, level, i)
        state.add(i, level, block, mb, policy, delta, update_loads=False)
        added[k] += delta
        heapreplace(heap, (load + delta, k))
    for k, delta in enumerate(added):
        if delta:
            for r in range(k * size, (k + 1) * size):
                loads[r] += delta


def _place_by_block_maxima(state: PlanState, items: list[int]) -> None:
    """Each item to the least-loaded block of its level, by maximum rank load (a tree of block
    maxima: placing on a block raises it and every block inside it; the blocks around it take
    the larger of their halves), with one lazy heap per level."""
    planner = state.tables
    levels = planner.levels
    offset = planner.block_offset
    counts = planner.blocks_per_level
    maxima = state.block_maxima()
    heaps = [[(maxima[offset[level] + k], k) for k in range(counts[level])] for level in range(levels)]
    for heap in heaps:
        heapq.heapify(heap)
    heappush, heappop = heapq.heappush, heapq.heappop
    for i in items:
        level = state.level[i]
        heap = heaps[level]
        base = offset[level]
        while heap[0][0] != maxima[base + heap[0][1]]:
            heappop(heap)
        k = heap[0][1]
        block = base + k
        delta, mb, policy = state.first_fit(block, level, i)
        state.add(i, level, block, mb, policy, delta)
        # the block and every block inside it rise by delta
        for down in range(level, -1, -1):
            width = 1 << (level - down)
            start = offset[down] + k * width
            down_heap = heaps[down]
            for node in range(start, start + width):
                maxima[node] += delta
                heappush(down_heap, (maxima[node], node - offset[down]))
        # the blocks around it take the max of their halves
        kk = k
        for up in range(level + 1, levels):
            kk >>= 1
            if kk >= counts[up]:
                break
            child = offset[up - 1] + 2 * kk
            a, b = maxima[child], maxima[child + 1]
            value = a if a > b else b
            node = offset[up] + kk
            if value == maxima[node]:
                break
            maxima[node] = value
            heappush(heaps[up], (value, kk))
