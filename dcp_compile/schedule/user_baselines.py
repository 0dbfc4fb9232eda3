"""Baselines a skilled user would pick on this runtime, as schedulers the planner must beat.

The published DCP schedulers (:mod:`.published_schedulers`) reproduce one paper's system. A user
training variable-length data today would rather reach for one of these, all run by the same
compiler as DCP (so they are priced by the same cost model, collectives kept under recompute):

* :class:`BalancedStaticSP`: one SP size for every micro-batch; sequences packed first-fit
  decreasing into micro-batches up to the memory cap and dealt longest-first to the least-loaded
  group. With ``per_microbatch_recompute`` each micro-batch takes the fastest recompute policy
  that fits it (short ones pack up to the no-recompute capacity; a sequence too long for that
  runs alone under the policy it needs); without it, one policy (the fastest that fits the
  dataset's longest sample) for all.
* :class:`PackedStaticCP`: Megatron Core's packing with a static context-parallel size
  (``DpBalancedScheduler``, ``megatron/core/datasets/data_schedule.py``): sequences packed in
  arrival order up to ``cp_size * max_seqlen_per_dp_cp_rank`` tokens, the number of packs made a
  multiple of the data-parallel size by moving samples off the last packs, pack ``i`` to
  data-parallel group ``i mod dp``; one recompute policy.
* :class:`DynamicCP`: Megatron Core's dynamic context parallelism (``DefaultDynamicCPScheduler``,
  same file, with ``next_hdp_group`` and ``dcp_gpus_needed`` in ``data_schedule_utils.py``;
  NVIDIA's description: Megatron Bridge, "Dynamic Context Parallel",
  https://docs.nvidia.com/nemo/megatron-bridge/nightly/training/dynamic-context-parallel.html).
  Each sequence needs ``2 ** ceil(log2(length / max_seqlen_per_rank))`` ranks; a step is cut into
  rounds (one micro-batch per rank per round); within a round, sequences are taken longest first
  from buckets of equal estimated work (``length ** 2 / cp``), each joins the least-loaded group
  of its size that has room (per-rank tokens at most ``max_seqlen_per_rank``) or opens a group on
  free ranks when that is less loaded; once a smaller size has been placed, the round closes as
  soon as the ranks' estimated loads are within 5% of each other; ranks left empty widen the
  smallest group to twice its size. One recompute policy for every micro-batch.

Every scheduler here takes the comparison's memory cap in bytes and never plans a micro-batch the
cost model says does not fit it. Groups are placed on aligned rank blocks, largest first, as our
runtime builds them (Megatron's free-rank order gives the same blocks within a round).
"""

from __future__ import annotations

import bisect
import heapq
import math
from collections import deque
from dataclasses import dataclass
from typing import Sequence

from dcp_compile.variant import RECOMPUTE_POLICIES, RecomputePolicy

from .cost_model import CostModel
from .plan import Schedule, ScheduledMicroBatch

__all__ = ["DYNAMIC_CP_THRESHOLD_SHARES", "BalancedStaticSP", "DynamicCP", "PackedStaticCP", "dynamic_cp_at_share",
           "dynamic_cp_threshold", "gpus_needed"]

# The per-rank thresholds a user tries for dynamic CP, as shares of the most every group size holds.
DYNAMIC_CP_THRESHOLD_SHARES = (1.0, 0.5, 0.25, 0.125)


class _SameRuntimeScheduler:
    """Shared plumbing: the cost model as is, one memory cap in bytes, power-of-two SP sizes."""

    name = "user-baseline"

    def __init__(self, cost_model: CostModel, world_size: int, memory_cap: float,
                 policies: Sequence[RecomputePolicy | str] | None = None, max_tokens_per_rank: int | None = None) -> None:
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        self.cost_model = cost_model
        self.world_size = world_size
        self.memory_cap = float(memory_cap)
        # The policies it may use and a per-rank token cap: the planner runs these schedulers as
        # candidates of its own and gives them its own restrictions.
        allowed = RECOMPUTE_POLICIES if policies is None else {RecomputePolicy.parse(p) for p in policies}
        self.policies = tuple(p for p in RECOMPUTE_POLICIES if p in allowed)
        self.max_tokens_per_rank = max_tokens_per_rank
        sizes = [1]
        while sizes[-1] * 2 <= world_size:
            sizes.append(sizes[-1] * 2)
        self.sizes = sizes

    def capacity(self, sp_size: int, policy: RecomputePolicy | str) -> int:
        """Tokens one micro-batch on ``sp_size`` ranks may hold under the cap."""
        capacity = self.cost_model.token_capacity(sp_size, policy, self.memory_cap)
        if self.max_tokens_per_rank is not None:
            capacity = min(capacity, self.max_tokens_per_rank * sp_size)
        return capacity

    def fastest_policy(self, tokens: int, sp_size: int) -> RecomputePolicy | None:
        """The fastest allowed policy under which ``tokens`` fit ``sp_size`` ranks, or None."""
        for policy in self.policies:
            if tokens <= self.capacity(sp_size, policy):
                return policy
        return None

    def microbatch(self, positions: list[int], lengths: Sequence[int], spans: Sequence[float], sp_size: int,
                   first_rank: int, policy: RecomputePolicy, round_index: int = 0) -> ScheduledMicroBatch:
        mb_lengths = [lengths[p] for p in positions]
        time = self.cost_model.time(mb_lengths, sp_size, policy, [spans[p] for p in positions])
        return ScheduledMicroBatch(positions=list(positions), sp_size=sp_size, first_rank=first_rank,
                                   recompute=policy, predicted_time=time, tokens=sum(mb_lengths), round=round_index)

    @staticmethod
    def _spans(lengths: Sequence[int], spans: Sequence[float] | None) -> list[float]:
        return [float(x) for x in lengths] if spans is None else [float(s) for s in spans]

    def _no_fit(self, length: int, where: str) -> ValueError:
        return ValueError(f"{self.name}: a sequence of {length:,} tokens does not fit {where} under the memory cap of "
                          f"{self.memory_cap / 1e9:.2f} GB; give it a larger SP size or drop it from the comparison")


class BalancedStaticSP(_SameRuntimeScheduler):
    """Static SP at one size, packed best-fit decreasing and balanced longest-first (see the module
    docstring); ``max_length`` is the dataset's longest sample, which fixes the one policy when
    ``per_microbatch_recompute`` is off. With ``balanced=False`` the step is dealt to the groups in
    arrival order (as ``DistributedSampler`` deals it) and each group packs its share in that order:
    the micro-batch counts and contents per group are then not chosen per step (the ablation's
    first rungs)."""

    def __init__(self, cost_model: CostModel, world_size: int, memory_cap: float, sp_size: int, max_length: int,
                 per_microbatch_recompute: bool = True, pack_equal_lengths_only: bool = False, balanced: bool = True,
                 **restrictions) -> None:
        super().__init__(cost_model, world_size, memory_cap, **restrictions)
        self.name = "static-sp"
        self.pack_equal_lengths_only = pack_equal_lengths_only
        self.balanced = balanced
        if sp_size not in self.sizes:
            raise ValueError(f"sp_size must be a power of two up to the world ({self.sizes}), got {sp_size}")
        self.sp_size = sp_size
        self.per_microbatch_recompute = per_microbatch_recompute
        longest_policy = self.fastest_policy(max_length, sp_size)
        if longest_policy is None:
            raise self._no_fit(max_length, f"{sp_size} ranks")
        self.policy = self.policies[0] if per_microbatch_recompute else longest_policy
        # Short sequences pack up to what the packing policy holds; a longer one runs alone.
        self.budget = max(self.capacity(sp_size, self.policy), 0)
        self.name = (f"static-sp{sp_size}" + ("+recompute" if per_microbatch_recompute else f"/{longest_policy.value}")
                     + ("" if balanced else ", dealt in order"))

    def _policy_for(self, tokens: int) -> RecomputePolicy:
        policy = self.fastest_policy(tokens, self.sp_size) if self.per_microbatch_recompute else self.policy
        if policy is None or (not self.per_microbatch_recompute and tokens > self.budget):
            raise self._no_fit(tokens, f"{self.sp_size} ranks")
        return policy

    def schedule(self, lengths: Sequence[int], spans: Sequence[float] | None = None) -> Schedule:
        spans = self._spans(lengths, spans)
        if not self.balanced:
            return self._dealt_in_order(lengths, spans)
        # Best-fit decreasing (as good as first-fit decreasing, in n log n): the open micro-batches
        # sorted by the room they have left; each sequence joins the tightest that holds it.
        bins: list[list[int]] = []
        open_rooms: list[tuple[int, int]] = []  # (room, bin index), sorted
        for position in sorted(range(len(lengths)), key=lambda p: -lengths[p]):
            length = lengths[position]
            key = (length, -1) if not self.pack_equal_lengths_only else None
            index = bisect.bisect_left(open_rooms, key) if key is not None else len(open_rooms)
            if self.pack_equal_lengths_only:
                index = next((i for i, (room, b) in enumerate(open_rooms)
                              if room >= length and lengths[bins[b][0]] == length), len(open_rooms))
            if index < len(open_rooms):
                room, b = open_rooms.pop(index)
                bins[b].append(position)
                room -= length
            else:
                b = len(bins)
                bins.append([position])
                room = self.budget - length  # negative for a sequence that runs alone
            if room > 0:
                bisect.insort(open_rooms, (room, b))
        groups = self.world_size // self.sp_size
        priced = []
        for members in bins:
            policy = self._policy_for(sum(lengths[p] for p in members))
            priced.append((self.cost_model.time([lengths[p] for p in members], self.sp_size, policy,
                                                [spans[p] for p in members]), members, policy))
        priced.sort(key=lambda item: -item[0])
        heap = [(0.0, group) for group in range(groups)]
        microbatches = []
        for time, members, policy in priced:
            load, group = heapq.heappop(heap)
            microbatches.append(self.microbatch(members, lengths, spans, self.sp_size, group * self.sp_size, policy))
            heapq.heappush(heap, (load + time, group))
        return Schedule(self.world_size, microbatches, scheduler=self.name)

    def _dealt_in_order(self, lengths: Sequence[int], spans: list[float]) -> Schedule:
        groups = self.world_size // self.sp_size
        microbatches = []
        for group in range(groups):
            packs: list[list[int]] = []
            tokens = 0
            for position in range(group, len(lengths), groups):
                if packs and tokens + lengths[position] <= self.budget and not (
                        self.pack_equal_lengths_only and lengths[packs[-1][0]] != lengths[position]):
                    packs[-1].append(position)
                    tokens += lengths[position]
                else:
                    packs.append([position])
                    tokens = lengths[position]
            for pack in packs:
                policy = self._policy_for(sum(lengths[p] for p in pack))
                microbatches.append(self.microbatch(pack, lengths, spans, self.sp_size, group * self.sp_size, policy))
        return Schedule(self.world_size, microbatches, scheduler=self.name)


class PackedStaticCP(_SameRuntimeScheduler):
    """Megatron Core's static-CP packing (``DpBalancedScheduler``); ``max_length`` fixes the one
    recompute policy (the fastest under which the longest sample fits ``sp_size`` ranks)."""

    def __init__(self, cost_model: CostModel, world_size: int, memory_cap: float, sp_size: int, max_length: int,
                 recompute: RecomputePolicy | str | None = None) -> None:
        super().__init__(cost_model, world_size, memory_cap)
        self.name = "packed-static-cp"
        if sp_size not in self.sizes:
            raise ValueError(f"sp_size must be a power of two up to the world ({self.sizes}), got {sp_size}")
        self.sp_size = sp_size
        policy = RecomputePolicy.parse(recompute) if recompute is not None else self.fastest_policy(max_length, sp_size)
        if policy is None or max_length > self.capacity(sp_size, policy):
            raise self._no_fit(max_length, f"{sp_size} ranks")
        self.policy = policy
        self.budget = self.capacity(sp_size, policy)  # cp_size * max_seqlen_per_dp_cp_rank
        self.name = f"packed-cp{sp_size}/{policy.value}"

    def schedule(self, lengths: Sequence[int], spans: Sequence[float] | None = None) -> Schedule:
        spans = self._spans(lengths, spans)
        packs: list[list[int]] = []
        tokens = 0
        for position, length in enumerate(lengths):
            if packs and tokens + length <= self.budget:
                packs[-1].append(position)
                tokens += length
            else:
                packs.append([position])
                tokens = length
        groups = self.world_size // self.sp_size
        # Megatron moves samples off the last packs until the pack count divides the DP size.
        index = len(packs) - 1
        while len(packs) % groups and index >= 0:
            if len(packs[index]) > 1:
                packs.append([packs[index].pop()])
            else:
                index -= 1
        microbatches = [
            self.microbatch(pack, lengths, spans, self.sp_size, (i % groups) * self.sp_size, self.policy, i // groups)
            for i, pack in enumerate(packs)
        ]
        return Schedule(self.world_size, microbatches, scheduler=self.name)


def gpus_needed(length: int, max_seqlen_per_rank: int, min_cp_size: int = 1) -> int:
    """Megatron's ``dcp_gpus_needed``: the next power of two of ``length / max_seqlen_per_rank``."""
    raw = max(1, 2 ** math.ceil(math.log2(length / max_seqlen_per_rank)))
    return max(min_cp_size, raw)


@dataclass
class _Group:
    size: int
    members: list[int]
    per_rank_tokens: float
    positions: list[int]


class DynamicCP(_SameRuntimeScheduler):
    """Megatron Core's dynamic context parallelism (see the module docstring).

    ``max_seqlen_per_rank`` is the knob a user tunes (default: the most tokens per rank that every
    group size holds under ``recompute``); ``recompute`` is the one policy (default: the fastest
    under which ``max_length`` fits the world at that threshold).
    """

    BALANCE = 0.05  # next_hdp_group's delta: a round closes once loads are within 5%
    BUCKET_SLACK = 1.1  # dcp_make_buckets_equal closes a bucket past 1.1x its share of the work

    def __init__(self, cost_model: CostModel, world_size: int, memory_cap: float, max_length: int,
                 recompute: RecomputePolicy | str | None = None, max_seqlen_per_rank: int | None = None,
                 **restrictions) -> None:
        super().__init__(cost_model, world_size, memory_cap, **restrictions)
        self.name = "dynamic-cp"
        policies = [RecomputePolicy.parse(recompute)] if recompute is not None else list(self.policies)
        chosen = None
        for policy in policies:
            safe = min(self.capacity(size, policy) // size for size in self.sizes)
            threshold = safe if max_seqlen_per_rank is None else min(max_seqlen_per_rank, safe)
            if threshold >= 1 and gpus_needed(max_length, threshold) <= world_size:
                chosen = (policy, threshold)
                break
        if chosen is None:
            raise self._no_fit(max_length, f"the world of {world_size} ranks with dynamic CP")
        self.policy, self.max_seqlen_per_rank = chosen
        self.name = f"dynamic-cp/{self.policy.value}/{self.max_seqlen_per_rank}"

    def _work(self, length: int) -> float:
        return length * length / gpus_needed(length, self.max_seqlen_per_rank)

    def _buckets(self, items: list[tuple[int, int]]) -> list[deque]:
        """``dcp_make_buckets_equal``: as many buckets as distinct sizes, of about equal work."""
        kinds = len({gpus_needed(length, self.max_seqlen_per_rank) for _, length in items})
        target = sum(self._work(length) for _, length in items) / kinds
        buckets: list[deque] = []
        current: list[tuple[int, int]] = []
        current_work = 0.0
        left = kinds
        for index, item in enumerate(items):
            work = self._work(item[1])
            if current and (current_work + work > target * self.BUCKET_SLACK or len(items) - index <= left - len(buckets)):
                buckets.append(deque(current))
                current, current_work = [], 0.0
                left -= 1
            current.append(item)
            current_work += work
        if current:
            buckets.append(deque(current))
        return buckets

    def _round(self, items: list[tuple[int, int]]) -> tuple[list[_Group], list[tuple[int, int]]]:
        """One round (``next_hdp_group``): its groups and the sequences left for later rounds."""
        world = self.world_size
        buckets = self._buckets(items)
        loads = [0.0] * world
        free = [True] * world
        groups: list[_Group] = []
        first_needed = None
        check_balance = False
        while buckets:
            picked = None
            for b, bucket in enumerate(buckets):
                if not bucket:
                    continue
                needed = gpus_needed(bucket[0][1], self.max_seqlen_per_rank)
                if any(g.size == needed for g in groups) or sum(free) >= needed:
                    picked = b
                    break
            if picked is None:
                break
            position, length = buckets[picked][0]
            needed = gpus_needed(length, self.max_seqlen_per_rank)
            first_needed = needed if first_needed is None else first_needed
            roomy = [g for g in groups if g.size == needed and g.per_rank_tokens + length / needed <= self.max_seqlen_per_rank]
            best = min(roomy, key=lambda g: max(loads[r] for r in g.members), default=None)
            best_load = max(loads[r] for r in best.members) if best is not None else math.inf
            free_ranks = sorted((r for r in range(world) if free[r]), key=lambda r: loads[r])
            if len(free_ranks) >= needed and loads[free_ranks[needed - 1]] < best_load:
                best = _Group(needed, free_ranks[:needed], 0.0, [])
                groups.append(best)
                for r in best.members:
                    free[r] = False
            elif best is None:
                break
            best.per_rank_tokens += length / needed
            best.positions.append(position)
            for r in best.members:
                loads[r] += self._work(length)
            buckets[picked].popleft()
            while buckets and not buckets[0]:
                buckets.pop(0)
            if needed < first_needed:
                check_balance = True
            if check_balance and buckets and max(loads) - min(loads) <= self.BALANCE * max(loads):
                break
        leftovers = [item for bucket in buckets for item in bucket]
        # fill_empty_gpus: ranks with nothing widen the smallest group to twice its size.
        while groups and sum(g.size for g in groups) < world:
            smallest = min(groups, key=lambda g: g.size)
            if smallest.size * 2 > world:
                break
            smallest.per_rank_tokens /= 2
            smallest.size *= 2
        return groups, leftovers

    def schedule(self, lengths: Sequence[int], spans: Sequence[float] | None = None) -> Schedule:
        spans = self._spans(lengths, spans)
        for length in lengths:
            if gpus_needed(length, self.max_seqlen_per_rank) > self.world_size:
                raise self._no_fit(length, f"the world of {self.world_size} ranks at "
                                           f"max_seqlen_per_rank={self.max_seqlen_per_rank}")
        items = sorted(((p, lengths[p]) for p in range(len(lengths))), key=lambda item: -item[1])
        microbatches = []
        round_index = 0
        while items:
            groups, items = self._round(items)
            if not groups:
                raise AssertionError(f"{self.name}: a round placed no sequence")
            first = 0
            for group in sorted(groups, key=lambda g: -g.size):  # aligned blocks, largest first
                if first + group.size > self.world_size:
                    raise AssertionError(f"{self.name}: round {round_index} exceeds the world")
                microbatches.append(self.microbatch(group.positions, lengths, spans, group.size, first, self.policy,
                                                    round_index))
                first += group.size
            round_index += 1
        return Schedule(self.world_size, microbatches, scheduler=self.name)


def dynamic_cp_at_share(cost_model: CostModel, world_size: int, memory_cap: float, max_length: int, share: float,
                        recompute: RecomputePolicy | str | None = None, **restrictions) -> DynamicCP:
    """Dynamic CP with its per-rank threshold at ``share`` of the most every group size holds (one of
    :data:`DYNAMIC_CP_THRESHOLD_SHARES`, the thresholds a user tries); the policy is ``recompute``,
    or the fastest that holds the longest sample. Raises ``ValueError`` where none does."""
    safe = DynamicCP(cost_model, world_size, memory_cap, max_length, recompute=recompute, **restrictions)
    if share == 1.0:
        return safe
    return DynamicCP(cost_model, world_size, memory_cap, max_length, recompute=safe.policy,
                     max_seqlen_per_rank=dynamic_cp_threshold(safe.max_seqlen_per_rank, share), **restrictions)


def dynamic_cp_threshold(safe: int, share: float) -> int:
    """The per-rank threshold at ``share`` of ``safe``, the most tokens per rank every group size
    holds (what :func:`dynamic_cp_at_share` gives dynamic CP)."""
    return safe if share == 1.0 else min(safe, max(1, int(safe * share)))
