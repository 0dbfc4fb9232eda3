"""Rounds: how a step runs when the model state is sharded during it (ZeRO-3).

Why. Under ``dcp.shard_model(model, reshard_after_forward=True)`` every micro-batch all-gathers
each sharded module's parameters over the *world* in forward and again in backward, and
reduce-scatters its gradients over the world after backward. Those are world collectives: every
rank must issue them the same number of times, in the same order, or they pair up wrongly or hang.
A data-centric step gives ranks different numbers of micro-batches (some none at all), so the plan
is cut into rounds: in each round every rank runs exactly one micro-batch, or none and joins the
round's all-gathers and reduce-scatters with zero gradients (an *idle round*,
:func:`dcp_compile.runtime.fsdp.idle_round`). Every rank then runs the same number of rounds.

What a round costs. Every rank waits at the round's collectives for the slowest rank, so a round
takes its longest micro-batch, and the step the sum over its rounds
(``Schedule.makespan`` of a plan with ``rounds``). Every micro-batch's time already includes the
round's parameter all-gathers and gradient reduce-scatters (``CostModel.state_round_seconds``, in
the fixed cost the planner charges each micro-batch), which an idle rank pays too: the planner
thereby prefers fewer, larger micro-batches where memory allows.

How rounds are assigned (:func:`assign_rounds`, a post-pass on the planner's schedule): longest
micro-batch first, each into the earliest round in which every rank of its block is free. Long
micro-batches thus share rounds with long ones and short with short, which is what keeps the sum of
the rounds' maxima low (for micro-batches on single ranks, aligning every rank's micro-batches in
descending order of time is optimal). Then :func:`balance_rounds` moves sequences out of the
micro-batch that sets a round's time into micro-batches of the same block in shorter rounds (or
into a round where that block is idle), while the step gets shorter.
Everything is deterministic, so every rank derives the same rounds.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Sequence

from dcp_compile.variant import RECOMPUTE_POLICIES

from .plan import Schedule, ScheduledMicroBatch

if TYPE_CHECKING:
    from .plan_tables import PlanTables

log = logging.getLogger(__name__)


def assign_rounds(schedule: Schedule) -> Schedule:
    """Put every micro-batch of ``schedule`` into a round (in place) and return the schedule with
    ``rounds`` set: longest first, each into the earliest round in which all its ranks are free."""
    microbatches = schedule.microbatches
    order = sorted(range(len(microbatches)), key=lambda i: (
        -microbatches[i].predicted_time, -microbatches[i].sp_size, microbatches[i].first_rank, i))
    busy = [0] * schedule.world_size  # per rank, a bit per round it already runs a micro-batch in
    rounds = 0
    for i in order:
        microbatch = microbatches[i]
        taken = 0
        for rank in microbatch.ranks:
            taken |= busy[rank]
        free = ~taken & (taken + 1)  # the lowest round no rank of the block is busy in
        for rank in microbatch.ranks:
            busy[rank] |= free
        microbatch.round = free.bit_length() - 1
        rounds = max(rounds, microbatch.round + 1)
    schedule.rounds = rounds
    return schedule


def round_times(schedule: Schedule) -> list[float]:
    """Each round's time: its longest micro-batch."""
    times = [0.0] * schedule.rounds
    for microbatch in schedule.microbatches:
        times[microbatch.round] = max(times[microbatch.round], microbatch.predicted_time)
    return times


def balance_rounds(schedule: Schedule, tables: "PlanTables", lengths: Sequence[int], keys: Sequence[float],
                   max_moves: int = 2_000, dense_rows: bool = False) -> Schedule:
    """Shorten a plan in rounds by moving sequences between micro-batches of one block (in place).

    A round takes its longest micro-batch. For the round that costs the most above its runner-up,
    try each sequence of its longest micro-batch: into another micro-batch of the same block in
    another round (the fastest policy that holds the sum; packing rules of the planner), or into a
    new micro-batch in a round where the block is idle; take the move that shortens the step most.
    Stop when no move helps or after ``max_moves``. Rounds left empty are dropped. ``dense_rows``:
    a packed row's scores follow from its sums (the planner's ``PlanState.dense_rows``)."""
    if schedule.rounds <= 1:
        return schedule
    moves = 0
    scores = None
    if dense_rows:
        from dcp_compile.kernels.dense_ranges import scores_from_sums as scores
    while moves < max_moves:
        apply = _best_move(schedule, tables, lengths, keys, scores)
        if apply is None:
            break
        apply()
        moves += 1
    _drop_empty_rounds(schedule)
    if moves:
        log.debug("balance_rounds: %d moves, %d rounds, %.6g s", moves, schedule.rounds, schedule.makespan)
    return schedule


def _best_move(schedule: Schedule, tables: "PlanTables", lengths: Sequence[int], keys: Sequence[float], scores):
    """The best single-sequence move out of a round's longest micro-batch (a function that makes
    it), or None."""

    def _time(tables: "PlanTables", level: int, tokens: int, keys: float, sequences: int) -> tuple[float, int]:
        policy = tables.policy_for(level, tokens)
        if policy < 0:
            return float("inf"), -1
        if scores is not None:
            keys = scores(tokens, keys, sequences)
        return tables.micro_batch_time(level, policy, tokens, keys, sequences), policy

    times = round_times(schedule)
    level_of = {size: j for j, size in enumerate(tables.sizes)}
    choices = getattr(tables, "choices", RECOMPUTE_POLICIES)  # what the tables' policy indices name
    # Each round's longest and runner-up micro-batch times.
    longest: list[ScheduledMicroBatch | None] = [None] * schedule.rounds
    second = [0.0] * schedule.rounds
    for microbatch in schedule.microbatches:
        r = microbatch.round
        if longest[r] is None or microbatch.predicted_time > longest[r].predicted_time:
            if longest[r] is not None:
                second[r] = max(second[r], longest[r].predicted_time)
            longest[r] = microbatch
        else:
            second[r] = max(second[r], microbatch.predicted_time)
    by_block: dict[tuple[int, int], list[ScheduledMicroBatch]] = {}
    for microbatch in schedule.microbatches:
        by_block.setdefault((microbatch.sp_size, microbatch.first_rank), []).append(microbatch)
    busy_rounds: dict[int, set[int]] = {}  # rank -> rounds it runs in
    for microbatch in schedule.microbatches:
        for rank in microbatch.ranks:
            busy_rounds.setdefault(rank, set()).add(microbatch.round)
    # Each micro-batch's summed keys, once: summing them per candidate move made a move search
    # quadratic in a round's sequences (38 s to plan a 2,013-sequence step on 32 ranks).
    key_sums = {id(microbatch): sum(keys[p] for p in microbatch.positions) for microbatch in schedule.microbatches}
    best_gain, best_apply = 1e-9 * max(times), None
    for r in sorted(range(schedule.rounds), key=lambda r: second[r] - times[r]):
        source = longest[r]
        if times[r] - second[r] <= best_gain:
            break  # rounds are visited by how much their longest micro-batch stands out
        if source is None or len(source.positions) < 2:
            continue  # moving a micro-batch's only sequence just renames its round
        level = level_of[source.sp_size]
        for position in source.positions:
            rest_tokens = source.tokens - lengths[position]
            rest_keys = key_sums[id(source)] - keys[position]
            rest_time, rest_policy = _time(tables, level, rest_tokens, rest_keys, len(source.positions) - 1)
            new_source_round = max(second[r], rest_time)
            saved = times[r] - new_source_round
            if saved <= best_gain:
                continue
            # Into another micro-batch of the block.
            for target in by_block[(source.sp_size, source.first_rank)]:
                if target is source:
                    continue
                if not tables.mixed_packing and lengths[target.positions[0]] != lengths[position]:
                    continue
                target_keys = key_sums[id(target)] + keys[position]
                grown, policy = _time(tables, level, target.tokens + lengths[position], target_keys,
                                      len(target.positions) + 1)
                cost = max(0.0, grown - times[target.round])
                if saved - cost > best_gain:
                    best_gain = saved - cost
                    best_apply = _mover(schedule, source, position, rest_time, rest_policy, lengths,
                                        target=target, target_time=grown, target_policy=policy, choices=choices)
            # Into a round where the whole block is idle.
            for idle in _idle_rounds(source, busy_rounds, schedule.rounds):
                alone, policy = _time(tables, level, lengths[position], keys[position], 1)
                cost = max(0.0, alone - times[idle])
                if saved - cost > best_gain:
                    best_gain = saved - cost
                    best_apply = _mover(schedule, source, position, rest_time, rest_policy, lengths,
                                        new_round=idle, target_time=alone, target_policy=policy, choices=choices)
    return best_apply


def _idle_rounds(microbatch: ScheduledMicroBatch, busy_rounds: dict[int, set[int]], rounds: int) -> list[int]:
    busy: set[int] = set()
    for rank in microbatch.ranks:
        busy |= busy_rounds.get(rank, set())
    return [r for r in range(rounds) if r not in busy]


def _mover(schedule: Schedule, source: ScheduledMicroBatch, position: int, rest_time: float, rest_policy: int,
           lengths: Sequence[int], *, target: ScheduledMicroBatch | None = None, new_round: int = -1,
           target_time: float, target_policy: int, choices: Sequence = RECOMPUTE_POLICIES):
    def apply() -> None:
        source.positions.remove(position)
        source.tokens -= lengths[position]
        source.predicted_time = rest_time
        source.recompute = choices[rest_policy]
        if target is not None:
            target.positions.append(position)
            target.tokens += lengths[position]
            target.predicted_time = target_time
            target.recompute = choices[target_policy]
        else:
            schedule.microbatches.append(ScheduledMicroBatch(
                positions=[position], sp_size=source.sp_size, first_rank=source.first_rank,
                recompute=choices[target_policy], predicted_time=target_time,
                tokens=lengths[position], round=new_round))

    return apply


def _drop_empty_rounds(schedule: Schedule) -> None:
    used = sorted({microbatch.round for microbatch in schedule.microbatches})
    renumber = {old: new for new, old in enumerate(used)}
    for microbatch in schedule.microbatches:
        microbatch.round = renumber[microbatch.round]
    schedule.rounds = len(used)
