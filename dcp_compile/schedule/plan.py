"""The records a plan is made of: what each rank trains on in one optimizer step.

Two layers:

* :class:`Schedule` / :class:`ScheduledMicroBatch` are what a scheduler (our planner or a
  baseline) produces: micro-batches of *positions* in the step's list of sequences, each on an
  aligned block of ranks. A schedule knows nothing about datasets or loss weights, so all
  schedulers are compared on equal terms.
* :class:`StepPlan` / :class:`GroupPlan` / :class:`MicroBatch` are what the training loop sees:
  dataset indices, SP group ranks, recompute policy and the loss scale, for one rank, plus the
  global view (all groups) that every rank derives identically.

Execution order. A rank may belong to several groups in one step (a block of 4 ranks runs a long
sequence together, then each of its ranks runs short ones alone). Every rank runs its
micro-batches by descending SP size, then ascending first rank of the group, then plan order. Two
micro-batches that share ranks are then run in the same order by every rank they share (aligned
blocks are nested or disjoint), so collectives never cross, and the ranks of a group reach each
group's micro-batches together: a rank's finish time is exactly the sum of its micro-batch times.

Rounds. When the model state is sharded during the step (ZeRO-3, ``CostModel.state_sharding``),
every micro-batch all-gathers the parameters and reduce-scatters the gradients over the *world*,
so every rank must run forward and backward equally often. Such a plan is cut into rounds
(:mod:`.rounds`): in each round every rank runs exactly one micro-batch, or none and joins the
round's collectives with zero gradients (``dcp.shard_model``'s idle round). ``Schedule.rounds`` and
``StepPlan.num_rounds`` count them (the same on every rank), ``MicroBatch.round`` says which round
a micro-batch runs in, ranks run their micro-batches by round, and the step takes the sum over
rounds of the round's longest micro-batch (``Schedule.makespan``).
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass, field
from typing import Sequence

from dcp_compile.variant import RECOMPUTE_POLICIES, RecomputePolicy, Variant

log = logging.getLogger(__name__)


# ---------------------------------------------------------------------------------------------
# Scheduler output
# ---------------------------------------------------------------------------------------------
@dataclass(slots=True)
class ScheduledMicroBatch:
    """One micro-batch of a schedule: ``positions`` index the step's sequence list."""

    positions: list[int]
    sp_size: int
    first_rank: int
    recompute: RecomputePolicy  # the planner and the published schedulers give the enum
    predicted_time: float
    tokens: int
    # Schedules with several synchronised rounds per step: the published baselines (a gradient sync
    # ends each), and every plan under sharded model state (one micro-batch per rank per round).
    round: int = 0

    @property
    def ranks(self) -> range:
        return range(self.first_rank, self.first_rank + self.sp_size)


@dataclass
class Schedule:
    """A scheduler's answer for one step: micro-batches on aligned rank blocks."""

    world_size: int
    microbatches: list[ScheduledMicroBatch]
    scheduler: str = "dcp"
    # Positions the scheduler discards instead of training (the published samplers' ``drop_last``).
    dropped: list[int] = field(default_factory=list)
    # The planner keeps a baseline's plan when it is faster than its own: which one (else None).
    chosen_from: str | None = None
    # Rounds of a plan under sharded model state (every rank runs one micro-batch or nothing in
    # each, ``round`` says which); 0: the plan has no rounds (ranks run their micro-batches freely).
    rounds: int = 0

    def rank_loads(self) -> list[float]:
        """Seconds each rank spends (the sum of its micro-batch times)."""
        loads = [0.0] * self.world_size
        for microbatch in self.microbatches:
            for rank in microbatch.ranks:
                loads[rank] += microbatch.predicted_time
        return loads

    @property
    def makespan(self) -> float:
        """The step's time: the busiest rank's summed micro-batch time (one sync per step), or for
        a plan in rounds the sum of each round's longest micro-batch (every rank waits for it at
        the round's collectives)."""
        if self.rounds:
            return self.synchronised_makespan
        return max(self.rank_loads(), default=0.0)

    def rank_rounds(self, rank: int) -> list[ScheduledMicroBatch | None]:
        """A plan in rounds: what ``rank`` runs in each round (None: nothing, an idle round)."""
        slots: list[ScheduledMicroBatch | None] = [None] * self.rounds
        for microbatch in self.microbatches:
            if rank in microbatch.ranks:
                if slots[microbatch.round] is not None:
                    raise AssertionError(f"{self.scheduler}: rank {rank} runs two micro-batches in round {microbatch.round}")
                slots[microbatch.round] = microbatch
        return slots

    @property
    def synchronised_makespan(self) -> float:
        """The step's time if all ranks synchronise after every round (the published baselines
        end each of their iterations with a gradient sync): the sum of the rounds' makespans. Equal
        to :attr:`makespan` for single-round schedules, never below it."""
        rounds = sorted({microbatch.round for microbatch in self.microbatches})
        if len(rounds) <= 1:
            return max(self.rank_loads(), default=0.0)
        total = 0.0
        for round_index in rounds:
            loads = [0.0] * self.world_size
            for microbatch in self.microbatches:
                if microbatch.round == round_index:
                    for rank in microbatch.ranks:
                        loads[rank] += microbatch.predicted_time
            total += max(loads)
        return total

    def positions(self) -> list[int]:
        """Every scheduled position (each exactly once in a valid schedule)."""
        return [p for microbatch in self.microbatches for p in microbatch.positions]

    def validate(self, num_sequences: int) -> None:
        """Raise if a sequence is missing or repeated (dropped ones count as seen), or a block is misaligned."""
        seen = sorted(self.positions() + list(self.dropped))
        if seen != list(range(num_sequences)):
            missing = sorted(set(range(num_sequences)) - set(seen))
            repeated = sorted({p for p in seen if seen.count(p) > 1})
            raise AssertionError(f"{self.scheduler}: schedule misses positions {missing[:10]} / repeats {repeated[:10]}")
        for microbatch in self.microbatches:
            size = microbatch.sp_size
            if size & (size - 1) or microbatch.first_rank % size or microbatch.first_rank + size > self.world_size:
                raise AssertionError(f"{self.scheduler}: misaligned group {microbatch.first_rank}+{size}")
        if self.rounds:
            for microbatch in self.microbatches:
                if not 0 <= microbatch.round < self.rounds:
                    raise AssertionError(f"{self.scheduler}: round {microbatch.round} outside the plan's {self.rounds}")
            for rank in range(self.world_size):
                self.rank_rounds(rank)


# ---------------------------------------------------------------------------------------------
# What the training loop sees
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class MicroBatch:
    """One forward/backward on this rank.

    ``indices`` are dataset indices (every rank of ``group_ranks`` gets the same, full batch; the
    compiled model shards it), ``loss_scale`` multiplies the micro-batch's mean token loss so that
    the step's summed gradient is the gradient of the mean token loss over the whole step.
    """

    indices: tuple[int, ...]
    variant: Variant  # what ``dcp.use(mb)`` runs: SP size, recompute policy
    loss_scale: float
    group_ranks: tuple[int, ...]
    predicted_time: float
    tokens: int = 0
    round: int = -1  # the round it runs in, in a plan with rounds (sharded model state); else -1

    @property
    def sp_size(self) -> int:
        return self.variant.sp_size

    @property
    def recompute(self) -> RecomputePolicy:
        return self.variant.recompute

    @property
    def first_rank(self) -> int:
        return self.group_ranks[0]


@dataclass(frozen=True)
class GroupPlan:
    """The micro-batches one aligned SP group runs, in order."""

    sp_size: int
    ranks: tuple[int, ...]
    microbatches: tuple[MicroBatch, ...]

    @property
    def predicted_time(self) -> float:
        return sum(mb.predicted_time for mb in self.microbatches)

    @property
    def tokens(self) -> int:
        return sum(mb.tokens for mb in self.microbatches)

    @property
    def num_samples(self) -> int:
        return sum(len(mb.indices) for mb in self.microbatches)


@dataclass(frozen=True)
class StepPlan:
    """One optimizer step: this rank's micro-batches (in execution order) and every group."""

    step: int
    epoch: int
    microbatches: tuple[MicroBatch, ...]
    groups: tuple[GroupPlan, ...]
    predicted_makespan: float
    tokens: int
    rank: int = 0
    world_size: int = 1
    lower_bound: float = 0.0
    scheduler: str = "dcp"
    num_rounds: int = 0  # rounds of a plan under sharded model state (the same on every rank); else 0
    _hash: list[str] = field(default_factory=list, repr=False, compare=False)

    # ------------------------------------------------------------------ views
    @property
    def indices(self) -> list[int]:
        """Every dataset index of the step (all ranks), in group order."""
        return [i for group in self.groups for mb in group.microbatches for i in mb.indices]

    def rank_microbatches(self, rank: int) -> tuple[MicroBatch, ...]:
        """The micro-batches ``rank`` runs, in the execution order described in the module docstring."""
        return _rank_microbatches(self.groups, rank)

    @property
    def rounds(self) -> tuple[MicroBatch | None, ...]:
        """This rank's rounds (a plan under sharded model state): the micro-batch it runs in each,
        or None where it runs none; ``()`` for a plan without rounds."""
        return self.rank_rounds(self.rank)

    def rank_rounds(self, rank: int) -> tuple[MicroBatch | None, ...]:
        if not self.num_rounds:
            return ()
        slots: list[MicroBatch | None] = [None] * self.num_rounds
        for microbatch in self.rank_microbatches(rank):
            slots[microbatch.round] = microbatch
        return tuple(slots)

    def predicted_rank_times(self) -> list[float]:
        loads = [0.0] * self.world_size
        for group in self.groups:
            for rank in group.ranks:
                loads[rank] += group.predicted_time
        return loads

    def plan_hash(self) -> str:
        """A digest of the global plan (groups, indices, policies, step, epoch), the same on every
        rank that derived the same plan. Predicted times are left out: they are floats, and two
        ranks that agree on what to run agree on the plan."""
        if not self._hash:
            payload = [
                self.epoch, self.step, self.world_size,
                [
                    [group.sp_size, group.ranks[0], [[list(mb.indices), mb.recompute.value] for mb in group.microbatches]]
                    for group in self.groups
                ],
            ]
            if self.num_rounds:
                payload.append([self.num_rounds, [[mb.round for mb in group.microbatches] for group in self.groups]])
            self._hash.append(hashlib.sha256(json.dumps(payload, separators=(",", ":")).encode()).hexdigest())
        return self._hash[0]

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_schedule(
        cls,
        schedule: Schedule,
        *,
        step: int,
        epoch: int,
        rank: int,
        indices: Sequence[int],
        lengths: Sequence[int],
        supervised_tokens: Sequence[int] | None = None,
        lower_bound: float = 0.0,
    ) -> "StepPlan":
        """Turn a schedule over the step's sequences (``indices[p]``, ``lengths[p]``) into a plan.

        ``loss_scale = supervised_tokens(micro-batch) / supervised_tokens(step)``; supervised
        tokens default to the lengths.
        """
        supervised = list(lengths if supervised_tokens is None else supervised_tokens)
        step_supervised = sum(supervised)
        if step_supervised <= 0:
            log.warning("step %d of epoch %d has no supervised tokens: every loss_scale is 0", step, epoch)
        ordered = sorted(
            enumerate(schedule.microbatches), key=lambda item: (-item[1].sp_size, item[1].first_rank, item[0])
        )
        grouped: dict[tuple[int, int], list[MicroBatch]] = {}
        for _, scheduled in ordered:
            mb_supervised = sum(supervised[p] for p in scheduled.positions)
            record = MicroBatch(
                indices=tuple(int(indices[p]) for p in scheduled.positions),
                variant=Variant(scheduled.sp_size, RecomputePolicy.parse(scheduled.recompute)),
                loss_scale=(mb_supervised / step_supervised) if step_supervised > 0 else 0.0,
                group_ranks=tuple(scheduled.ranks),
                predicted_time=scheduled.predicted_time,
                tokens=sum(int(lengths[p]) for p in scheduled.positions),
                round=scheduled.round if schedule.rounds else -1,
            )
            grouped.setdefault((scheduled.sp_size, scheduled.first_rank), []).append(record)
        groups = tuple(
            GroupPlan(sp_size=size, ranks=tuple(range(first, first + size)), microbatches=tuple(mbs))
            for (size, first), mbs in grouped.items()
        )
        return cls(
            step=step,
            epoch=epoch,
            microbatches=_rank_microbatches(groups, rank),
            groups=groups,
            predicted_makespan=schedule.makespan,
            tokens=int(sum(lengths)),
            rank=rank,
            world_size=schedule.world_size,
            lower_bound=lower_bound,
            scheduler=schedule.scheduler,
            num_rounds=schedule.rounds,
        )

    # ------------------------------------------------------------------ display
    def __str__(self) -> str:
        samples = sum(group.num_samples for group in self.groups)
        header = (
            f"step {self.step} (epoch {self.epoch}) | rank {self.rank} of {self.world_size} | "
            f"{samples} samples, {self.tokens:,} tokens | predicted makespan {_seconds(self.predicted_makespan)}"
        )
        if self.lower_bound > 0 and self.predicted_makespan > 0:
            header += f" (lower bound {_seconds(self.lower_bound)}, {100 * self.lower_bound / self.predicted_makespan:.1f}%)"
        columns = ("", "ranks", "sp", "micro-batches", "samples", "tokens", "recompute", "time")
        rows = []
        for group in self.groups:
            policies = [p.value for p in sorted({mb.recompute for mb in group.microbatches}, key=_policy_order)]
            first, last = group.ranks[0], group.ranks[-1]
            rows.append((
                "*" if self.rank in group.ranks else "",
                f"{first}" if first == last else f"{first}-{last}",
                str(group.sp_size),
                str(len(group.microbatches)),
                str(group.num_samples),
                f"{group.tokens:,}",
                ",".join(policies),
                _seconds(group.predicted_time),
            ))
        widths = [max(len(columns[i]), *(len(row[i]) for row in rows)) if rows else len(columns[i]) for i in range(len(columns))]
        lines = [header, "  ".join(c.rjust(w) for c, w in zip(columns, widths))]
        lines += ["  ".join(cell.rjust(w) for cell, w in zip(row, widths)) for row in rows]
        mine = sum(mb.predicted_time for mb in self.microbatches)
        rounds = f" in {self.num_rounds} rounds" if self.num_rounds else ""
        lines.append(
            f"this rank ({self.rank}): {len(self.microbatches)} micro-batches{rounds}, predicted {_seconds(mine)}; "
            f"plan {self.plan_hash()[:12]}"
        )
        return "\n".join(lines)


def _rank_microbatches(groups: Sequence[GroupPlan], rank: int) -> tuple[MicroBatch, ...]:
    mine = [group for group in groups if rank in group.ranks]
    mine.sort(key=lambda group: (-group.sp_size, group.ranks[0]))
    ordered = [mb for group in mine for mb in group.microbatches]
    if ordered and ordered[0].round >= 0:  # a plan in rounds runs them by round
        ordered.sort(key=lambda mb: mb.round)
    return tuple(ordered)


def _policy_order(policy: RecomputePolicy) -> int:
    return RECOMPUTE_POLICIES.index(policy)


def _seconds(value: float) -> str:
    if value >= 1:
        return f"{value:.3f} s"
    return f"{1000 * value:.1f} ms"
