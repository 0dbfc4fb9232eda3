"""A training step's time on cores of its own, from each rank's measured micro-batch times.

On a shared CPU machine the wall clock also counts the time the OS gave to other processes: the
demo's DCP / static SP ratio read 0.92x at load 30 and 1.16x at load 5. Each rank's process CPU
time per micro-batch does not move with the load. Summing it per rank would hide the waits a plan
makes: a micro-batch of an SP group starts only when the last of its ranks is ready (its
all-to-alls wait for them), and the step ends with one gradient all-reduce over every rank. This
module composes the measured times along the plan's order with exactly those waits, which is what
the step takes when every rank has a core to itself.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence


@dataclass(frozen=True)
class RankWork:
    """One micro-batch as one rank ran it."""

    key: tuple[int, ...]  # the micro-batch's sample indices: the same on every rank of its group
    group_ranks: tuple[int, ...]
    seconds: float


def composed_step_seconds(per_rank: Sequence[Sequence[RankWork]], tails: Sequence[float]) -> float:
    """The step's time with each rank on its own core.

    ``per_rank[r]``: rank ``r``'s micro-batches in the order it ran them; ``tails[r]``: its time
    after the last micro-batch (gradient sync and optimizer step), which starts when every rank is
    done. A group's micro-batch starts at the latest ready time of its ranks.
    """
    if len(tails) != len(per_rank):
        raise ValueError(f"{len(per_rank)} ranks of micro-batches but {len(tails)} tails")
    ready = [0.0] * len(per_rank)
    position = [0] * len(per_rank)
    remaining = sum(len(work) for work in per_rank)
    while remaining:
        progressed = False
        for rank, work in enumerate(per_rank):
            if position[rank] >= len(work):
                continue
            item = work[position[rank]]
            heads = [per_rank[m][position[m]] if position[m] < len(per_rank[m]) else None for m in item.group_ranks]
            if any(head is None or head.key != item.key for head in heads):
                continue  # a member of the group is still on an earlier micro-batch
            start = max(ready[m] for m in item.group_ranks)
            for member, head in zip(item.group_ranks, heads):
                ready[member] = start + head.seconds
                position[member] += 1
                remaining -= 1
            progressed = True
        if not progressed:
            stuck = {rank: work[position[rank]].key for rank, work in enumerate(per_rank) if position[rank] < len(work)}
            raise ValueError(f"the ranks' micro-batch orders cannot meet (each rank waits on another): next on each "
                             f"rank {stuck}; every rank must run its groups' micro-batches in the same order")
    return max(ready, default=0.0) + max(tails, default=0.0)
