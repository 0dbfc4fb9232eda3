"""The published schedulers, on our cost model, as baselines the planner must beat.

Faithful to the reference implementation (VideoSys ``videosys/training/datasets/open_sora/sampler.py``
and ``videosys/core/dcp/profiler.py``, late 2024; see ``/work/shared/reference/published-dcp.md``):

* :class:`StaticSPScheduler`: one SP size and one recompute policy for everything (the smallest SP
  that holds the longest sample, every block checkpointed), one micro-batch token budget (what fits
  the longest sample), samples dealt to groups in order like ``DistributedSampler`` and packed in
  arrival order up to the budget, gradient accumulation, one sync per step.
* :class:`BucketParallelScheduler`: Open-Sora's bucket sampler: one SP size for all, per-bucket
  batch sizes from a profile (largest power-of-two batch under 70% of memory) rescaled toward the
  median bucket time; each round every group runs one micro-batch of one bucket.
* :class:`DCPIntraScheduler`: the published "sp_balance" schedule: fill the GPUs with groups
  (random SP weighted by how many buckets prefer it, a random bucket of that SP, the bucket's max
  batch), balance toward the shortest group by shrinking batches and doubling SP (assuming time
  halves), give back surplus samples, drop the smallest groups that no longer fit, raise batches
  toward the longest group. One micro-batch per group per round.
* :class:`DCPInterScheduler`: the published gradient-accumulation schedule: groups keep their
  profiled (SP, batch); accumulation counts come from the 1.2-overshoot / 1.0-undershoot penalty
  search with the published ``dcp_inter_ckpt`` bounds (max 5, min 15); with ``pyramid_recompute``
  each bucket leaves some layers unchecked, chosen as published by a knapsack over the memory a
  batch leaves under the cap, in 1 GiB steps (:meth:`DCPInterScheduler.uncheckpointed_layers`), run
  on every batch the profile tries, which then ranks the batches by their time after it.

Every baseline plans with whole-block checkpointing as published (``CostModel.collectives_recomputed``:
a checkpointed block keeps only its input at any SP size and re-sends its all-to-alls in backward).
With ``released_sp=True`` a micro-batch is priced as the released SP computes it (VideoSys 09ad75e,
:mod:`.published_sp`: spatial shards, padded all-to-all switches, images over the batch); the
calibration against the published figures uses it, the iso-batch comparisons price every
scheduler's SP as our compiler's Ulysses SP.

Adaptations, all in the baselines' favour or neutral:

* **Iso-batch.** Every scheduler trains exactly the step's samples (ours draws them; the published
  samplers draw from buckets). Round-based schedulers run as many rounds as it takes; tails are
  kept (``keep_last``), never dropped or padded. ``drop_last=True`` gives the published benchmark's
  epoch instead (bucket tails and rounds that cannot be filled are discarded and listed in
  ``Schedule.dropped``): the calibration against the published figures uses it.
* **Time.** Iso-batch means one optimizer step per step, so the rounds of a round-based scheduler
  are gradient-accumulation micro-steps with one sync at the end: a step costs its busiest rank's
  summed micro-batch time, exactly as for our plans. That ignores the waits the published
  placement causes (a group's collectives start when its slowest member arrives from the previous
  round), so it flatters the baselines; ``Schedule.synchronised_makespan`` gives the published
  per-round-sync time for reference. Micro-batch times come from the same cost model as ours, on
  the actual lengths.
* **Randomness** comes from a seeded generator (deterministic); the weighted SP draw is done
  correctly (the reference code compares a uniform draw to non-cumulative weights).
* **Buckets** are the distinct lengths when there are at most ``max_buckets`` of them (the
  Open-Sora setting), else geometric length bins (ratio 1.25) represented by their longest member.
"""

from __future__ import annotations

import logging
import math
import random
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Sequence

from dcp_compile.variant import RecomputePolicy

from .cost_model import CostModel
from .plan import Schedule, ScheduledMicroBatch
from .published_sp import published_time

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

PUBLISHED_MEMORY_FRACTION = 0.7  # the published profiler keeps peak memory under 65-70%
_MAX_PROFILE_BATCH = 4096
_GiB = 1024**3  # the published profiler's GB


@dataclass(frozen=True)
class BucketProfile:
    """The profiled configuration of one bucket: SP size, batch size, time of a full batch."""

    length: int
    span: float
    sp_size: int
    batch_size: int
    time: float
    recompute: RecomputePolicy


def bucketize(lengths: Sequence[int], max_buckets: int = 32) -> list[int]:
    """Bucket key (the bucket's representative, i.e. longest, length) of every sequence."""
    distinct = sorted(set(lengths))
    if len(distinct) <= max_buckets:
        return list(lengths)
    ratio = 1.25
    keys = []
    representative: dict[int, int] = {}
    for length in lengths:
        index = int(math.floor(math.log(max(length, 1), ratio)))
        representative[index] = max(representative.get(index, 0), length)
        keys.append(index)
    return [representative[index] for index in keys]


class _BaselineScheduler:
    """Shared plumbing: memory cap, SP sizes, evaluation of micro-batches on the cost model."""

    name = "baseline"

    def __init__(
        self,
        cost_model: CostModel,
        world_size: int,
        *,
        memory_fraction: float = PUBLISHED_MEMORY_FRACTION,
        max_tokens_per_rank: int | None = None,
        recompute: RecomputePolicy | str = RecomputePolicy.FULL,
        max_buckets: int = 32,
        seed: int = 0,
        drop_last: bool = False,
        released_sp: bool = False,
    ) -> None:
        recompute = RecomputePolicy.parse(recompute)
        # The published system checkpoints whole blocks: backward re-sends their all-to-alls and
        # a block keeps only its input, whatever the SP size.
        self.cost_model = replace(cost_model, collectives_recomputed=True)
        self.world_size = world_size
        self.memory_cap = memory_fraction * cost_model.hardware.memory_capacity
        self.max_tokens_per_rank = max_tokens_per_rank
        self.recompute = recompute
        self.max_buckets = max_buckets
        self.seed = seed
        # ``drop_last``: the published benchmark's epoch semantics (bucket tails and rounds that
        # cannot be filled are discarded, not trained); off for iso-batch comparisons.
        self.drop_last = drop_last
        # ``released_sp``: price each micro-batch as the released STDiT3's SP computes it (VideoSys
        # 09ad75e: spatial shards padded to the SP size, spatial attention after a padded
        # all-to-all switch, images switched over the padded batch; ``published_sp``), not as
        # our compiler's Ulysses SP. The calibration against the published figures turns it on;
        # off by default, so the iso-batch comparisons price every scheduler's SP alike.
        self.released_sp = released_sp
        self.node_size = max(1, min(world_size, cost_model.hardware.gpus_per_node))
        sizes = [1]
        while sizes[-1] * 2 <= world_size:
            sizes.append(sizes[-1] * 2)
        self.sizes = sizes

    # ------------------------------------------------------------------ helpers
    def fits(self, lengths: Sequence[int], sp_size: int, recompute: RecomputePolicy | str | None = None) -> bool:
        tokens = sum(lengths)
        if self.max_tokens_per_rank is not None and tokens > self.max_tokens_per_rank * sp_size:
            return False
        return self.cost_model.peak_memory(lengths, sp_size, recompute or self.recompute) <= self.memory_cap

    def smallest_sp(self, length: int, recompute: RecomputePolicy | str | None = None) -> int:
        for size in self.sizes:
            if self.fits([length], size, recompute):
                return size
        raise ValueError(
            f"{self.name}: a sequence of {length:,} tokens fits on no SP size up to {self.sizes[-1]} "
            f"under {self.memory_cap / 1e9:.1f} GB with recompute={recompute or self.recompute!r}"
        )

    def computed_time(self, lengths: Sequence[int], spans: Sequence[float], sp_size: int, recompute: RecomputePolicy | str) -> float:
        """The cost model's time of a micro-batch as the published model computes it (with
        ``released_sp``, as the released SP splits it: :func:`.published_sp.published_time`)."""
        if self.released_sp:
            return published_time(self.cost_model, lengths, spans, sp_size, recompute)
        return self.cost_model.time(lengths, sp_size, recompute, spans)

    def microbatch(
        self, positions: list[int], lengths: Sequence[int], spans: Sequence[float], sp_size: int,
        first_rank: int, recompute: RecomputePolicy | str | None = None, round_index: int = 0,
    ) -> ScheduledMicroBatch:
        policy = RecomputePolicy.parse(recompute or self.recompute)
        mb_lengths = [lengths[p] for p in positions]
        time = self.computed_time(mb_lengths, [spans[p] for p in positions], sp_size, policy)
        return ScheduledMicroBatch(
            positions=list(positions), sp_size=sp_size, first_rank=first_rank, recompute=policy,
            predicted_time=time, tokens=sum(mb_lengths), round=round_index,
        )

    def profile_bucket(self, length: int, span: float, fixed_sp: int | None = None) -> BucketProfile:
        """The published offline profile of one bucket.

        Start at SP 1 (or ``fixed_sp``), batch 1; double the batch until it no longer fits; then
        double SP and restart at half the last good batch; keep the (batch, SP) with the most
        samples per GPU-second over every batch that fitted (the published profiler ranks all its
        rows, ``profiler.py``: ``sorted(dp_results, key=bs / sp / time)``), each timed by
        :meth:`profiled_time`. SP stays within a node unless the bucket fits nowhere there.
        """
        best: BucketProfile | None = None
        sp = fixed_sp or 1
        start_batch = 1
        limit = self.node_size if fixed_sp is None else fixed_sp
        while sp <= self.world_size:
            if sp > limit and best is not None:
                break
            batch = start_batch
            good = 0
            while batch <= _MAX_PROFILE_BATCH and self.fits([length] * batch, sp):
                good = batch
                time = self.profiled_time(length, span, sp, batch)
                if best is None or batch / (sp * time) > best.batch_size / (best.sp_size * best.time):
                    best = BucketProfile(length, span, sp, batch, time, self.recompute)
                batch *= 2
            if good:
                start_batch = max(1, good // 2)
            if fixed_sp is not None:
                break
            sp *= 2
        if best is None:
            raise ValueError(
                f"{self.name}: a bucket of {length:,}-token samples fits on no SP size up to "
                f"{min(self.world_size, fixed_sp or self.world_size)} under {self.memory_cap / 1e9:.1f} GB"
            )
        return best

    def profiled_time(self, length: int, span: float, sp_size: int, batch_size: int) -> float:
        """What the published profiler records for a batch of ``batch_size`` samples of one
        bucket on ``sp_size`` ranks: the time of the batch under this scheduler's policy."""
        return self.computed_time([length] * batch_size, [span] * batch_size, sp_size, self.recompute)

    def group_by_bucket(self, lengths: Sequence[int], spans: Sequence[float]) -> dict[int, list[int]]:
        keys = bucketize(lengths, self.max_buckets)
        buckets: dict[int, list[int]] = {}
        for position, key in enumerate(keys):
            buckets.setdefault(key, []).append(position)
        return dict(sorted(buckets.items()))

    def bucket_profiles(self, buckets: dict[int, list[int]], spans: Sequence[float], fixed_sp: int | None = None) -> dict[int, BucketProfile]:
        profiles = {}
        for key, positions in buckets.items():
            span = max(spans[p] for p in positions)
            profiles[key] = self.profile_bucket(key, span, fixed_sp)
        return profiles

    def schedule(self, lengths: Sequence[int], spans: Sequence[float] | None = None) -> Schedule:
        raise NotImplementedError

    @staticmethod
    def _spans(lengths: Sequence[int], spans: Sequence[float] | None) -> list[float]:
        return [float(x) for x in lengths] if spans is None else [float(s) for s in spans]


# ---------------------------------------------------------------------------------------------
class StaticSPScheduler(_BaselineScheduler):
    """One SP size, one policy and one micro-batch budget for every sample of the dataset.

    The budget is what fits the longest sample: ``batch_size`` samples of ``max_length`` tokens.
    With ``packing=True`` (the default, and the stronger baseline: the usual practice for text with
    varlen attention) each group packs its samples, in arrival order, into micro-batches of up to
    ``batch_size * max_length`` tokens; with ``packing=False`` a micro-batch holds ``batch_size``
    samples whatever their lengths.
    """

    name = "static-sp"

    def __init__(
        self, cost_model: CostModel, world_size: int, max_length: int, *, sp_size: int | None = None,
        packing: bool = True, **kwargs,
    ) -> None:
        super().__init__(cost_model, world_size, **kwargs)
        self.sp_size = sp_size or self.smallest_sp(max_length)
        batch = 1
        while self.fits([max_length] * (batch * 2), self.sp_size) and batch < _MAX_PROFILE_BATCH:
            batch *= 2
        self.batch_size = batch
        self.token_budget = batch * max_length
        self.packing = packing

    def schedule(self, lengths: Sequence[int], spans: Sequence[float] | None = None) -> Schedule:
        spans = self._spans(lengths, spans)
        groups = self.world_size // self.sp_size
        dealt: list[list[int]] = [[] for _ in range(groups)]
        for position in range(len(lengths)):
            dealt[position % groups].append(position)
        microbatches = []
        for group, positions in enumerate(dealt):
            batches: list[list[int]] = []
            if self.packing:
                tokens = 0
                for position in positions:
                    if batches and tokens + lengths[position] <= self.token_budget:
                        batches[-1].append(position)
                        tokens += lengths[position]
                    else:
                        batches.append([position])
                        tokens = lengths[position]
            else:
                batches = [positions[start : start + self.batch_size] for start in range(0, len(positions), self.batch_size)]
            for batch in batches:
                microbatches.append(self.microbatch(batch, lengths, spans, self.sp_size, group * self.sp_size))
        return Schedule(self.world_size, microbatches, scheduler=self.name)


# ---------------------------------------------------------------------------------------------
class BucketParallelScheduler(_BaselineScheduler):
    """Open-Sora's bucket sampler: one SP size, per-bucket batch sizes, one micro-batch per group
    per (synchronised) round."""

    name = "bucket-parallel"

    def __init__(self, cost_model: CostModel, world_size: int, max_length: int, *, sp_size: int | None = None, **kwargs) -> None:
        super().__init__(cost_model, world_size, **kwargs)
        self.sp_size = max(sp_size or 1, self.smallest_sp(max_length))
        self._profiles: dict[tuple[int, float], BucketProfile] = {}

    def _batch_sizes(self, buckets: dict[int, list[int]], spans: Sequence[float]) -> dict[int, int]:
        profiles = {}
        for key, positions in buckets.items():
            span = max(spans[p] for p in positions)
            cache_key = (key, span)
            if cache_key not in self._profiles:
                self._profiles[cache_key] = self.profile_bucket(key, span, fixed_sp=self.sp_size)
            profiles[key] = self._profiles[cache_key]
        # Rescale toward the median bucket time (the profiler's interpolate step with static SP:
        # only buckets slower than the median shrink their batch).
        times = sorted(profile.time for profile in profiles.values())
        median = _median(times)
        sizes = {}
        for key, profile in profiles.items():
            batch = profile.batch_size
            if profile.time > median:
                batch = max(1, int(batch * median / profile.time))
            sizes[key] = batch
        return sizes

    def schedule(self, lengths: Sequence[int], spans: Sequence[float] | None = None) -> Schedule:
        spans = self._spans(lengths, spans)
        buckets = self.group_by_bucket(lengths, spans)
        sizes = self._batch_sizes(buckets, spans)
        batches: list[list[int]] = []
        for key, positions in buckets.items():
            size = sizes[key]
            if self.drop_last:  # the published sampler cuts each bucket to whole batches
                positions = positions[: len(positions) - len(positions) % size]
            batches += [positions[start : start + size] for start in range(0, len(positions), size)]
        random.Random(self.seed).shuffle(batches)
        groups = self.world_size // self.sp_size
        if self.drop_last:  # ... and the access order to whole rounds
            batches = batches[: len(batches) - len(batches) % groups]
        microbatches = [
            self.microbatch(batch, lengths, spans, self.sp_size, (index % groups) * self.sp_size, round_index=index // groups)
            for index, batch in enumerate(batches)
        ]
        return _with_dropped(Schedule(self.world_size, microbatches, scheduler=self.name), len(lengths))


# ---------------------------------------------------------------------------------------------
@dataclass
class _GroupChoice:
    bucket: int
    batch_size: int
    sp_size: int
    time: float  # the scheduler's own estimate (profile-based)


class _RoundScheduler(_BaselineScheduler):
    """Round-based published schedulers: profile per bucket, then rounds until the step is empty."""

    def __init__(self, cost_model: CostModel, world_size: int, **kwargs) -> None:
        super().__init__(cost_model, world_size, **kwargs)
        self._profile_cache: dict[tuple[int, float], BucketProfile] = {}

    def profiles_for(self, buckets: dict[int, list[int]], spans: Sequence[float]) -> dict[int, BucketProfile]:
        profiles = {}
        for key, positions in buckets.items():
            span = max(spans[p] for p in positions)
            if (key, span) not in self._profile_cache:
                self._profile_cache[(key, span)] = self.profile_bucket(key, span)
            profiles[key] = self._profile_cache[(key, span)]
        return profiles

    def _place(self, groups: list[tuple[int, list[list[int]], str | None]], lengths, spans, round_index: int) -> list[ScheduledMicroBatch]:
        """Aligned contiguous blocks, largest SP first (the published placement)."""
        groups = sorted(groups, key=lambda g: -g[0])
        first = 0
        out = []
        for sp_size, batches, policy in groups:
            first = ((first + sp_size - 1) // sp_size) * sp_size
            if first + sp_size > self.world_size:
                raise AssertionError(f"{self.name}: groups exceed the world in round {round_index}")
            for batch in batches:
                if batch:
                    out.append(self.microbatch(batch, lengths, spans, sp_size, first, policy, round_index))
            first += sp_size
        return out

    @staticmethod
    def _weighted_sp(rng: random.Random, candidates: list[int], bucket_counts: dict[int, int]) -> int:
        weights = [bucket_counts[sp] for sp in candidates]
        draw = rng.random() * sum(weights)
        for sp, weight in zip(candidates, weights):
            if draw < weight:
                return sp
            draw -= weight
        return candidates[-1]


class DCPIntraScheduler(_RoundScheduler):
    """The published intra-iteration balancing (``sp_balance_scope="iter"``), keep-last semantics."""

    name = "dcp-intra"

    def schedule(self, lengths: Sequence[int], spans: Sequence[float] | None = None) -> Schedule:
        spans = self._spans(lengths, spans)
        buckets = self.group_by_bucket(lengths, spans)
        profiles = self.profiles_for(buckets, spans)
        remaining = {key: list(positions) for key, positions in buckets.items()}
        rng = random.Random(self.seed)
        max_sp = self.node_size
        microbatches: list[ScheduledMicroBatch] = []
        round_index = 0
        while any(remaining.values()):
            sp_buckets = self._sp_buckets(remaining, profiles)
            plans: list[_GroupChoice] = []
            free = self.world_size
            while free > 0:
                candidates = [sp for sp in sorted(sp_buckets) if sp <= free and sp_buckets[sp]]
                if not candidates:
                    break
                sp = self._weighted_sp(rng, candidates, {s: len(b) for s, b in sp_buckets.items()})
                bucket = sp_buckets[sp][rng.randrange(len(sp_buckets[sp]))]
                profile = profiles[bucket]
                count = min(profile.batch_size, self._left(remaining, plans, bucket))
                plans.append(_GroupChoice(bucket, count, sp, profile.time / profile.batch_size * count))
                free -= sp
                if self._left(remaining, plans, bucket) == 0:
                    sp_buckets[sp].remove(bucket)
            if not plans:
                raise AssertionError("dcp-intra: no group could be formed")
            # Balance toward the shortest group that still has samples left behind it.
            with_more = [p.time for p in plans if self._left(remaining, plans, p.bucket) > 0]
            target = min(with_more) if with_more else 0.0
            for plan in plans:
                if with_more and plan.time < target:
                    continue  # a bucket's last batch shorter than the target is left alone
                if not with_more:
                    continue
                unit = plan.time / plan.batch_size
                batch = max(1, plan.batch_size - round((plan.time - target) / unit))
                time = unit * batch
                best_time, best_diff, best_sp = time, abs(time - target), plan.sp_size
                sp = plan.sp_size
                while sp < max_sp and time > target:
                    sp *= 2
                    time /= 2  # the published estimate: doubling SP halves the time
                    if abs(time - target) < best_diff:
                        best_time, best_diff, best_sp = time, abs(time - target), sp
                plan.batch_size, plan.time, plan.sp_size = batch, best_time, best_sp
            # Drop the smallest groups while the groups exceed the world.
            plans.sort(key=lambda p: -p.sp_size)
            while sum(p.sp_size for p in plans) > self.world_size:
                plans.pop()
            # Raise batches toward the longest group.
            longest = max(p.time for p in plans)
            for plan in plans:
                profile = profiles[plan.bucket]
                unit = plan.time / plan.batch_size
                increment = int((longest - plan.time) // unit) if unit > 0 else 0
                increment = min(increment, profile.batch_size - plan.batch_size, self._left(remaining, plans, plan.bucket))
                if increment > 0:
                    plan.batch_size += increment
                    plan.time += unit * increment
            groups = []
            for plan in plans:
                take = remaining[plan.bucket][: plan.batch_size]
                remaining[plan.bucket] = remaining[plan.bucket][plan.batch_size :]
                if not take:
                    continue
                # Keep the memory promise when SP was doubled past the profile: never less than profiled.
                groups.append((plan.sp_size, [take], None))
            microbatches += self._place(groups, lengths, spans, round_index)
            round_index += 1
        return Schedule(self.world_size, microbatches, scheduler=self.name)

    @staticmethod
    def _left(remaining: dict[int, list[int]], plans: list[_GroupChoice], bucket: int) -> int:
        taken = sum(p.batch_size for p in plans if p.bucket == bucket)
        return len(remaining[bucket]) - taken

    @staticmethod
    def _sp_buckets(remaining: dict[int, list[int]], profiles: dict[int, BucketProfile]) -> dict[int, list[int]]:
        sp_buckets: dict[int, list[int]] = {}
        for key, positions in remaining.items():
            if positions:
                sp_buckets.setdefault(profiles[key].sp_size, []).append(key)
        return sp_buckets


def _best_counts(target: "torch.Tensor", inner: "torch.Tensor", limit: float) -> tuple["torch.Tensor", "torch.Tensor"]:
    """For each group time ``inner[i]`` and target ``target[j]``, the published count (1 to
    ``limit / inner``, ``inner * count`` not over ``limit``; least penalty, the smallest count of
    equal ones) and its penalty (inf where no count is allowed, as the loops leave it): ``[i, j]``."""
    import torch  # the schedule package imports torch only where it computes with it

    inner = inner[:, None]
    most = torch.floor(limit / inner)  # int(limit / inner) for a positive quotient
    floor = torch.floor(target[None, :] / inner)
    best_score = torch.full_like(floor, math.inf)
    best_count = torch.ones_like(floor)
    for offset in (-1.0, 0.0, 1.0, 2.0):  # float division may land one off the true floor
        count = floor + offset
        value = count * inner
        allowed = (count >= 1) & (count <= most) & (value <= limit)
        score = torch.where(value > target, (value - target) * 1.2, target - value)
        better = allowed & (score < best_score)  # counts ascend: a tie keeps the smaller
        best_score = torch.where(better, score, best_score)
        best_count = torch.where(better, count, best_count)
    return best_count.to(torch.int64), best_score


class DCPInterScheduler(_RoundScheduler):
    """The published inter-iteration schedule: per-group gradient accumulation chosen by the
    asymmetric penalty (1.2 x overshoot, 1.0 x undershoot), optionally with pyramid recompute."""

    name = "dcp-inter"

    def __init__(
        self, cost_model: CostModel, world_size: int, *, max_accumulation: int = 5, min_accumulation: int = 15,
        pyramid_recompute: bool = True, pyramid_in_profile: bool = True, **kwargs,
    ) -> None:
        super().__init__(cost_model, world_size, **kwargs)
        self.max_accumulation = max_accumulation
        self.min_accumulation = min_accumulation
        self.pyramid_recompute = pyramid_recompute
        # As published, the profile ranks batches by their time after the knapsack; False ranks
        # them fully checkpointed and applies the knapsack to the chosen batch only (an ablation).
        self.pyramid_in_profile = pyramid_in_profile
        self._unchecked_cache: dict[BucketProfile, int] = {}

    def _unchecked(self, profile: BucketProfile) -> int:
        if profile not in self._unchecked_cache:
            self._unchecked_cache[profile] = self.uncheckpointed_layers(profile)
        return self._unchecked_cache[profile]

    @staticmethod
    def accumulation_counts(times: Sequence[float], max_accumulation: int, min_accumulation: int = 1) -> list[int]:
        """The published search: try every target ``t_j * m`` up to ``max(t) * max_accumulation``; each
        group takes the count minimising 1.2 x overshoot / 1.0 x undershoot; keep the target with
        the least total penalty; scale up if the largest count is below ``min_accumulation``.

        The published loops try every count of every group for every target: with a bucket a
        thousand times faster than the slowest that is billions of steps. A group's penalty falls
        until its count reaches the target and rises after, so its best count is one of the two
        around ``target / t``; the targets of one ``t_j`` are scored together. Same counts and the
        same float sums, in the published order (``tests/test_planner.py`` checks it against the loops)."""
        import torch  # the schedule package imports torch only where it computes with it

        limit = max(times) * max_accumulation
        best_counts: list[int] | None = None
        best_penalty = math.inf
        inner = torch.tensor(list(times), dtype=torch.float64)
        for outer in times:
            targets = outer * torch.arange(1, int(limit / outer) + 1, dtype=torch.float64)
            targets = targets[: int((targets <= limit).cumprod(0).sum())]  # the loops stop at the first over
            if not len(targets):
                continue
            counts, scores = _best_counts(targets, inner, limit)
            penalty = torch.cumsum(scores, dim=0)[-1]  # summed group by group from 0.0, as the loops add
            index = int(torch.argmin(penalty))  # the first of equal penalties, as the loops keep it
            if float(penalty[index]) < best_penalty:
                best_penalty = float(penalty[index])
                best_counts = [int(c) for c in counts[:, index]]
        counts = best_counts or [1] * len(times)
        if max(counts) < min_accumulation:
            factor = math.ceil(min_accumulation / max(counts))
            counts = [c * factor for c in counts]
        return counts

    def uncheckpointed_layers(self, profile: BucketProfile) -> int:
        """The published pyramid recompute for one bucket (``profiler.py``, ``dynamic_recompute``):
        a knapsack over the memory the (SP, batch) leaves under the cap, in whole GiB
        (``floor((cap - peak) / GiB)``), where ``n`` unchecked layers cost ``ceil(n * layer_bytes /
        GiB)`` (a layer's bytes beyond its checkpointed input) and are worth their forward time.
        The layers are alike, so the knapsack keeps the most layers that fit. Returns how many
        layers run without checkpointing."""
        return self._unchecked_layers(profile.length, profile.sp_size, profile.batch_size)

    def _unchecked_layers(self, length: int, sp_size: int, batch_size: int) -> int:
        tokens = [length] * batch_size
        full = self.cost_model.peak_memory(tokens, sp_size, RecomputePolicy.FULL)
        none = self.cost_model.peak_memory(tokens, sp_size, RecomputePolicy.NONE)
        layers = self.cost_model.profile.num_layers
        spare_gib = math.floor((self.memory_cap - full) / _GiB)
        per_layer = max(0.0, none - full) / layers
        if spare_gib <= 0:
            return 0
        if per_layer == 0:
            return layers
        return min(layers, int(spare_gib * _GiB // per_layer))

    def profiled_time(self, length: int, span: float, sp_size: int, batch_size: int) -> float:
        """With pyramid recompute the published profiler runs the knapsack on every batch it
        tries and ranks the batches by their time after it (``best_full_time = pred_full_time -
        reduced_time``), so a smaller batch that leaves more layers unchecked can win."""
        full = super().profiled_time(length, span, sp_size, batch_size)
        if not (self.pyramid_recompute and self.pyramid_in_profile):
            return full
        unchecked = self._unchecked_layers(length, sp_size, batch_size)
        if not unchecked:
            return full
        none = self.computed_time([length] * batch_size, [span] * batch_size, sp_size, RecomputePolicy.NONE)
        return full - unchecked / self.cost_model.profile.num_layers * max(0.0, full - none)

    def _pyramid(self, microbatch: ScheduledMicroBatch, unchecked: int) -> ScheduledMicroBatch:
        """The micro-batch with ``unchecked`` of its layers kept (not recomputed): its time is the
        block-checkpointed time less that share of the recompute (layers are alike in the model)."""
        if not unchecked:
            return microbatch
        layers = self.cost_model.profile.num_layers
        full = microbatch.predicted_time
        positions = microbatch.positions
        none = self.computed_time(
            [self._lengths[p] for p in positions], [self._spans_now[p] for p in positions], microbatch.sp_size,
            RecomputePolicy.NONE,
        )
        time = full - (unchecked / layers) * max(0.0, full - none)
        return replace(microbatch, predicted_time=time)

    def _place_round(self, chosen: list[tuple[int, list[int]]], profiles: dict[int, BucketProfile],
                     remaining: dict[int, list[int]], buckets: dict, lengths: Sequence[int], spans: Sequence[float],
                     round_index: int) -> list[ScheduledMicroBatch]:
        """One round's groups: each chosen bucket's first batch plus its accumulation count of
        further batches, placed on the cluster, with the bucket's pyramid recompute (a tail batch
        is smaller than the profiled one, so the bucket's choice still fits)."""
        chosen.sort(key=lambda item: -profiles[item[0]].sp_size)
        counts = self.accumulation_counts([profiles[b].time for b, _ in chosen], self.max_accumulation, self.min_accumulation)
        groups = []
        for (bucket, first_batch), count in zip(chosen, counts):
            profile = profiles[bucket]
            batches = [first_batch]
            for _ in range(count - 1):
                if not remaining[bucket]:
                    break
                batch, remaining[bucket] = remaining[bucket][: profile.batch_size], remaining[bucket][profile.batch_size :]
                batches.append(batch)
            groups.append((profile.sp_size, batches, None))
        placed = self._place(groups, lengths, spans, round_index)
        if self.pyramid_recompute:
            bucket_of = {p: key for key, members in buckets.items() for p in members}
            placed = [self._pyramid(mb, self._unchecked(profiles[bucket_of[mb.positions[0]]])) for mb in placed]
        return placed

    def schedule(self, lengths: Sequence[int], spans: Sequence[float] | None = None) -> Schedule:
        spans = self._spans(lengths, spans)
        self._lengths, self._spans_now = list(lengths), spans
        buckets = self.group_by_bucket(lengths, spans)
        profiles = self.profiles_for(buckets, spans)
        if self.drop_last:
            return self._schedule_dropping(lengths, spans, buckets, profiles)
        remaining = {key: list(positions) for key, positions in buckets.items()}
        rng = random.Random(self.seed)
        microbatches: list[ScheduledMicroBatch] = []
        round_index = 0
        while any(remaining.values()):
            sp_buckets = DCPIntraScheduler._sp_buckets(remaining, profiles)
            chosen: list[tuple[int, list[int]]] = []  # (bucket, first batch)
            free = self.world_size
            while free > 0:
                candidates = [sp for sp in sorted(sp_buckets) if sp <= free and sp_buckets[sp]]
                if not candidates:
                    break
                sp = self._weighted_sp(rng, candidates, {s: len(b) for s, b in sp_buckets.items()})
                bucket = sp_buckets[sp][rng.randrange(len(sp_buckets[sp]))]
                size = profiles[bucket].batch_size
                batch, remaining[bucket] = remaining[bucket][:size], remaining[bucket][size:]
                chosen.append((bucket, batch))
                free -= sp
                if not remaining[bucket]:
                    sp_buckets[sp].remove(bucket)
            if not chosen:
                raise AssertionError("dcp-inter: no group could be formed")
            placed = self._place_round(chosen, profiles, remaining, buckets, lengths, spans, round_index)
            microbatches += placed
            round_index += 1
        return Schedule(self.world_size, microbatches, scheduler=self.name)

    def _schedule_dropping(
        self, lengths: Sequence[int], spans: Sequence[float], buckets: dict[int, list[int]],
        profiles: dict[int, BucketProfile],
    ) -> Schedule:
        """The published epoch with ``drop_last`` (the benchmark configs' setting; VideoSys
        ``sampler.py: _build_local_bucket_id_access_order_acc``). Each bucket is cut to whole
        profiled batches. A round fills the GPUs with groups (weighted SP, random bucket, a full
        first batch); once they are full, a group whose bucket has fewer batches left than its
        share of the round's accumulation (``max_time // t - 1``, times its groups in the round) is
        removed, the rest of its bucket discarded, and its GPUs refilled. A round that can no
        longer fill the GPUs is discarded. Groups never run out mid-round, so they idle only by
        the penalty search's mismatch; the discarded samples are neither trained nor counted
        (``Schedule.dropped``)."""
        rng = random.Random(self.seed)
        remaining: dict[int, list[int]] = {}
        for key, positions in buckets.items():
            size = profiles[key].batch_size
            remaining[key] = positions[: len(positions) - len(positions) % size]
        microbatches: list[ScheduledMicroBatch] = []
        round_index = 0
        while any(remaining.values()):
            sp_buckets = DCPIntraScheduler._sp_buckets(remaining, profiles)
            chosen: list[tuple[int, list[int]]] = []
            free = self.world_size
            complete = True
            while free > 0:
                candidates = [sp for sp in sorted(sp_buckets) if sp <= free and sp_buckets[sp]]
                if not candidates:
                    complete = False
                    break
                sp = self._weighted_sp(rng, candidates, {s: len(b) for s, b in sp_buckets.items()})
                bucket = sp_buckets[sp][rng.randrange(len(sp_buckets[sp]))]
                size = profiles[bucket].batch_size
                batch, remaining[bucket] = remaining[bucket][:size], remaining[bucket][size:]
                chosen.append((bucket, batch))
                free -= sp
                if not remaining[bucket]:
                    sp_buckets[sp].remove(bucket)
                if free <= 0:
                    times = [profiles[b].time for b, _ in chosen]
                    counts = self.accumulation_counts(times, self.max_accumulation, self.min_accumulation)
                    longest = max(t * c for t, c in zip(times, counts))
                    index = 0
                    while index < len(chosen):
                        key = chosen[index][0]
                        profile = profiles[key]
                        required = (longest // profile.time - 1) * sum(1 for b, _ in chosen if b == key)
                        if len(remaining[key]) // profile.batch_size < required:
                            chosen.pop(index)
                            free += profile.sp_size
                            remaining[key] = []
                            if key in sp_buckets.get(profile.sp_size, []):
                                sp_buckets[profile.sp_size].remove(key)
                        else:
                            index += 1
            if not complete or not chosen:
                continue  # the published sampler discards a round it cannot fill
            placed = self._place_round(chosen, profiles, remaining, buckets, lengths, spans, round_index)
            microbatches += placed
            round_index += 1
        return _with_dropped(Schedule(self.world_size, microbatches, scheduler=self.name), len(lengths))


def _with_dropped(schedule: Schedule, num_sequences: int) -> Schedule:
    """``schedule`` with every position it does not train recorded as dropped."""
    kept = set(schedule.positions())
    schedule.dropped = [p for p in range(num_sequences) if p not in kept]
    return schedule


def _median(values: Sequence[float]) -> float:
    ordered = sorted(values)
    middle = len(ordered) // 2
    if len(ordered) % 2:
        return ordered[middle]
    return (ordered[middle - 1] + ordered[middle]) / 2


def make_baselines(
    cost_model: CostModel,
    world_size: int,
    max_length: int,
    *,
    bucket_sp_size: int | None = None,
    max_tokens_per_rank: int | None = None,
    seed: int = 0,
) -> list[_BaselineScheduler]:
    """The four published baselines for a dataset whose longest sample has ``max_length`` tokens."""
    common = dict(max_tokens_per_rank=max_tokens_per_rank, seed=seed)
    return [
        StaticSPScheduler(cost_model, world_size, max_length, **common),
        BucketParallelScheduler(cost_model, world_size, max_length, sp_size=bucket_sp_size, **common),
        DCPIntraScheduler(cost_model, world_size, **common),
        DCPInterScheduler(cost_model, world_size, **common),
    ]
