"""The step a user pays: a schedule's micro-batches plus the gradient all-reduce that ends the step.

A schedule's makespan (its busiest rank's summed micro-batch time) is not what a step costs: every
rank then joins one all-reduce of the gradients over the world. Two ways to run it are priced:

* **unoverlapped**: the all-reduce starts when the last rank finishes its last backward (what
  ``dcp.sync_gradients`` does today: one bucketed all-reduce after the step's backwards);
* **overlapped**, DDP's way (``torch.nn.parallel.DistributedDataParallel``, ``bucket_cap_mb=25``;
  gradient accumulation under ``no_sync`` until the last micro-batch): the gradients are cut into
  buckets, a bucket is ready once every rank's *last* backward has produced it (backward produces
  the gradients layer by layer, so bucket ``k`` of ``n`` is ready a fraction ``k / n`` into that
  backward), and the buckets are all-reduced one after the other, each as soon as it is ready and
  the link is free. What runs after the slowest rank's last backward is exposed.

Both are the same for every scheduler of a comparison except through *when* each rank's last
backward starts and how long it is, which is exactly what a schedule decides.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Sequence

from dcp_compile.variant import RecomputePolicy

from .analytic import BACKWARD_FLOP_RATIO
from .cost_model import CostModel
from .plan import Schedule, ScheduledMicroBatch

DDP_BUCKET_BYTES = 25 * 1024 * 1024  # torch DDP's default bucket_cap_mb


@dataclass(frozen=True)
class StepTime:
    """Seconds of one step: ``compute`` (the makespan), the all-reduce run after it (``sync``), and
    the part of the bucketed all-reduce that DDP-style overlap leaves exposed (``exposed_sync``)."""

    compute: float
    sync: float
    exposed_sync: float

    @property
    def unoverlapped(self) -> float:
        return self.compute + self.sync

    @property
    def overlapped(self) -> float:
        return self.compute + self.exposed_sync


def execution_order(schedule: Schedule) -> list[list[ScheduledMicroBatch]]:
    """Each rank's micro-batches in the order it runs them (:mod:`.plan`: descending SP size, then
    ascending first rank, then plan order)."""
    per_rank: list[list[tuple[int, int, int, ScheduledMicroBatch]]] = [[] for _ in range(schedule.world_size)]
    for index, microbatch in enumerate(schedule.microbatches):
        for rank in microbatch.ranks:
            per_rank[rank].append((-microbatch.sp_size, microbatch.first_rank, index, microbatch))
    return [[entry[-1] for entry in sorted(entries, key=lambda e: e[:3])] for entries in per_rank]


def backward_fraction(cost_model: CostModel, lengths: Sequence[int], sp_size: int, recompute: RecomputePolicy | str) -> float:
    """Share of a micro-batch's time spent in its backward (recomputation included): the forward is
    ``1 / (1 + BACKWARD_FLOP_RATIO)`` of the same micro-batch without recompute."""
    total = cost_model.time(lengths, sp_size, recompute)
    if total <= 0:
        return 0.0
    forward = cost_model.time(lengths, sp_size, RecomputePolicy.NONE) / (1 + BACKWARD_FLOP_RATIO)
    return min(max(1.0 - forward / total, 0.0), 1.0)


def gradient_sync_seconds(cost_model: CostModel, world_size: int) -> float:
    """One all-reduce of the model's gradients over the world (the cost model's links)."""
    return cost_model.hardware.all_reduce_seconds(cost_model.profile.gradient_bytes, world_size)


def step_time(
    schedule: Schedule,
    lengths: Sequence[int],
    cost_model: CostModel,
    seconds: Callable[[ScheduledMicroBatch], float] | None = None,
    bucket_bytes: float = DDP_BUCKET_BYTES,
) -> StepTime:
    """The step's time under both gradient-sync models.

    ``seconds(microbatch)`` is a micro-batch's time on each of its ranks (default: the schedule's
    prediction; a replay passes measured compute plus modelled communication). The backward share
    of each rank's last micro-batch comes from ``cost_model`` (:func:`backward_fraction`).
    """
    timed = seconds or (lambda microbatch: microbatch.predicted_time)
    world = schedule.world_size
    ends = [0.0] * world
    last_backward = [0.0] * world
    for rank, microbatches in enumerate(execution_order(schedule)):
        for microbatch in microbatches:
            ends[rank] += timed(microbatch)
        if microbatches:
            last = microbatches[-1]
            share = backward_fraction(cost_model, [lengths[p] for p in last.positions], last.sp_size, last.recompute)
            last_backward[rank] = share * timed(last)
    compute = max(ends, default=0.0)
    gradient_bytes = cost_model.profile.gradient_bytes
    hardware = cost_model.hardware
    sync = hardware.all_reduce_seconds(gradient_bytes, world)
    if world <= 1 or gradient_bytes <= 0:
        return StepTime(compute, 0.0, 0.0)
    buckets = max(1, math.ceil(gradient_bytes / bucket_bytes))
    per_bucket = hardware.all_reduce_seconds(gradient_bytes / buckets, world)
    # Bucket k is ready when the slowest rank has run k/n of its last backward; the link reduces
    # buckets in order. Ready times only grow with k, so one pass finds the last finish.
    finish = 0.0
    for k in range(1, buckets + 1):
        ready = max(end - backward * (1 - k / buckets) for end, backward in zip(ends, last_backward))
        finish = max(finish, ready) + per_bucket
    return StepTime(compute, sync, max(finish - compute, 0.0))
