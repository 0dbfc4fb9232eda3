"""The planner: near-optimal on small steps, never over the memory cap, never worse than the
published schedulers on the same cost model."""

from __future__ import annotations

import math
import random
import time
from dataclasses import replace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dcp_compile.schedule.published_schedulers import (
    BucketParallelScheduler,
    DCPInterScheduler,
    DCPIntraScheduler,
    StaticSPScheduler,
    make_baselines,
)
from dcp_compile.schedule.cost_model import RECOMPUTE_POLICIES, CostModel, ModelProfile, video_attention_span
from dcp_compile.schedule.hardware import Hardware
from dcp_compile.schedule.planner import Planner, PlannerConfig, PlanningError

# Four ranks in two "nodes" of two: SP 4 pays the slow link. Llama-8B with the optimizer sharded
# over 4 ranks leaves ~8.6k tokens per rank without recompute, ~31k with full recompute at SP 1
# (~23.5k at SP 4, where each rank also keeps the all-to-all outputs; the head's backward under
# `full` holds its rebuilt log-probabilities and two vocabulary-wide fp32 gradients): steps of
# 0.5k-90k-token sequences exercise packing, SP sizes and recompute together, and all fit on 4 ranks.
SMALL_HARDWARE = replace(Hardware.H200, gpus_per_node=2)
SMALL_MODEL = CostModel(ModelProfile.from_config("llama-3-8b"), SMALL_HARDWARE, optimizer_shards=4)
VIDEO_MODEL = CostModel(ModelProfile.from_config("stdit3-xl/2"), Hardware.H200, optimizer_shards=16)
LLM_MODEL = CostModel(ModelProfile.from_config("llama-3-8b"), Hardware.H200, optimizer_shards=16)
MEMORY_FRACTION = 0.9

# Open-Sora v1.2 buckets: (latent frames, height tokens, width tokens).
VIDEO_BUCKETS = [
    (1 if frames == 1 else frames * 5 // 17, math.ceil(height / 16), math.ceil(width / 16))
    for height, width in ((144, 256), (240, 426), (360, 640), (480, 854), (720, 1280))
    for frames in (1, 51, 102, 204, 408)
]


def optimal_makespan(cost: CostModel, lengths: list[int], world: int, cap: float, max_tokens_per_rank=None) -> float:
    """Exhaustive search over packings, aligned blocks and policies (depth-first, pruned only by
    the incumbent), on the cost model's own time and memory functions."""
    sizes = [1 << k for k in range(world.bit_length()) if (1 << k) <= world]
    blocks = [(size, k * size) for size in sizes for k in range(world // size)]

    def microbatch_time(mb_lengths: list[int], size: int) -> float | None:
        if max_tokens_per_rank is not None and sum(mb_lengths) > max_tokens_per_rank * size:
            return None
        for policy in RECOMPUTE_POLICIES:
            if cost.peak_memory(mb_lengths, size, policy) <= cap:
                return cost.time(mb_lengths, size, policy)
        return None

    order = sorted(lengths, reverse=True)
    best = [math.inf]
    loads = [0.0] * world
    open_mbs: list[list] = []

    def search(index: int) -> None:
        if max(loads) >= best[0]:
            return
        if index == len(order):
            best[0] = max(loads)
            return
        length = order[index]
        for mb in open_mbs:
            size, first, mb_lengths, old = mb
            new = microbatch_time(mb_lengths + [length], size)
            if new is None:
                continue
            for r in range(first, first + size):
                loads[r] += new - old
            mb[2], mb[3] = mb_lengths + [length], new
            search(index + 1)
            mb[2], mb[3] = mb_lengths, old
            for r in range(first, first + size):
                loads[r] -= new - old
        for size, first in blocks:
            alone = microbatch_time([length], size)
            if alone is None:
                continue
            for r in range(first, first + size):
                loads[r] += alone
            open_mbs.append([size, first, [length], alone])
            search(index + 1)
            open_mbs.pop()
            for r in range(first, first + size):
                loads[r] -= alone

    search(0)
    return best[0]


def check_schedule(cost: CostModel, schedule, lengths, spans, cap, max_tokens_per_rank=None) -> None:
    schedule.validate(len(lengths))
    for mb in schedule.microbatches:
        mb_lengths = [lengths[p] for p in mb.positions]
        assert cost.peak_memory(mb_lengths, mb.sp_size, mb.recompute) <= cap, mb
        if max_tokens_per_rank is not None:
            assert sum(mb_lengths) <= max_tokens_per_rank * mb.sp_size, mb
        mb_spans = None if spans is None else [spans[p] for p in mb.positions]
        assert mb.predicted_time == pytest.approx(cost.time(mb_lengths, mb.sp_size, mb.recompute, mb_spans), rel=1e-9)


small_lengths = st.lists(st.integers(min_value=256, max_value=90_000), min_size=1, max_size=6)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(lengths=small_lengths)
def test_within_five_percent_of_the_optimum_on_small_steps(lengths: list[int]) -> None:
    cap = MEMORY_FRACTION * SMALL_HARDWARE.memory_capacity
    planner = Planner(SMALL_MODEL, 4, memory_fraction=MEMORY_FRACTION)
    schedule = planner.plan(lengths)
    check_schedule(SMALL_MODEL, schedule, lengths, None, cap)
    optimum = optimal_makespan(SMALL_MODEL, lengths, 4, cap)
    assert optimum <= schedule.makespan * (1 + 1e-9)  # the oracle really is a bound
    assert schedule.makespan <= 1.05 * optimum
    assert planner.lower_bound(lengths) <= optimum * (1 + 1e-9)


def test_heuristic_alone_is_close_to_the_optimum() -> None:
    """Without the small-step branch-and-bound (what large steps get), measured on a fixed set
    of random instances: the average gap stays small and no instance is far off."""
    cap = MEMORY_FRACTION * SMALL_HARDWARE.memory_capacity
    heuristic = Planner(SMALL_MODEL, 4, config=PlannerConfig(exact_search_nodes=0))
    rng = random.Random(2024)
    ratios = []
    for _ in range(80):
        lengths = [int(rng.choice([512, 2048, 8000, 16000, 30000, 60000, 85000]) * rng.uniform(0.5, 1.1))
                   for _ in range(rng.randint(1, 6))]
        ratios.append(heuristic.plan(lengths).makespan / optimal_makespan(SMALL_MODEL, lengths, 4, cap))
    assert min(ratios) >= 1 - 1e-9
    assert sum(ratios) / len(ratios) < 1.02, sorted(ratios)[-5:]
    assert max(ratios) < 1.25, sorted(ratios)[-5:]


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(lengths=st.lists(st.integers(min_value=200, max_value=30_000), min_size=1, max_size=5),
       max_tokens=st.sampled_from([4096, 8192, 20000]))
def test_max_tokens_per_rank_is_respected_and_still_near_optimal(lengths, max_tokens) -> None:
    cap = MEMORY_FRACTION * SMALL_HARDWARE.memory_capacity
    if max(lengths) > 4 * max_tokens:
        with pytest.raises(PlanningError, match="max_tokens_per_rank"):
            Planner(SMALL_MODEL, 4, max_tokens_per_rank=max_tokens).plan(lengths)
        return
    schedule = Planner(SMALL_MODEL, 4, max_tokens_per_rank=max_tokens).plan(lengths)
    check_schedule(SMALL_MODEL, schedule, lengths, None, cap, max_tokens)
    assert schedule.makespan <= 1.05 * optimal_makespan(SMALL_MODEL, lengths, 4, cap, max_tokens)


@st.composite
def mixed_steps(draw):
    """A step of a video or a text workload on 2-16 ranks, with bucketed lengths."""
    world = draw(st.sampled_from([2, 4, 8, 16]))
    if draw(st.booleans()):
        buckets = draw(st.lists(st.sampled_from(VIDEO_BUCKETS), min_size=1, max_size=6, unique=True))
        shapes = draw(st.lists(st.sampled_from(buckets), min_size=1, max_size=48))
        lengths = [t * h * w for t, h, w in shapes]
        spans = [video_attention_span(t, h, w) for t, h, w in shapes]
        return VIDEO_MODEL, world, lengths, spans
    buckets = draw(st.lists(st.sampled_from([256, 1024, 4096, 8192, 16384, 32768, 65536]), min_size=1, max_size=4, unique=True))
    lengths = draw(st.lists(st.sampled_from(buckets), min_size=1, max_size=48))
    return LLM_MODEL, world, lengths, None


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=mixed_steps())
def test_never_worse_than_the_published_schedulers(case) -> None:
    cost, world, lengths, spans = case
    planner = Planner(cost, world)
    try:
        schedule = planner.plan(lengths, spans)
    except PlanningError:
        return  # the world is too small for some sequence under our cap: nothing to compare
    check_schedule(cost, schedule, lengths, spans, MEMORY_FRACTION * cost.hardware.memory_capacity)
    try:
        baselines = make_baselines(cost, world, max(lengths))
    except ValueError:
        return  # the published 70% cap holds no configuration for the longest sequence
    for baseline in baselines:
        if isinstance(baseline, DCPInterScheduler):
            # Its pyramid recompute leaves some layers unchecked: a per-layer mix DCP cannot plan
            # yet (test_pyramid_recompute_beats_dcp_where_a_layer_mix_would_help); without it its
            # plans are ones DCP could make.
            baseline.pyramid_recompute = False
        theirs = baseline.schedule(lengths, spans)
        theirs.validate(len(lengths))
        assert schedule.makespan <= theirs.makespan * (1 + 1e-9), (baseline.name, schedule.makespan, theirs.makespan)


def test_pyramid_recompute_beats_dcp_where_a_layer_mix_would_help() -> None:
    """A known loss, kept in view: the published DCP-inter keeps some layers unchecked where the
    memory left under the cap allows (pyramid recompute), a per-layer mix of ``none`` and ``full``;
    DCP's planner picks one policy per micro-batch, so one 65,536-token Llama-3-8B sequence on 2
    ranks runs 2.6% slower under DCP. Per-layer mixes (branch wip/layer-mix-rebased) close it:
    when they land this test fails and goes."""
    planner = Planner(LLM_MODEL, 2)
    ours = planner.plan([65536])
    (inter,) = [b for b in make_baselines(LLM_MODEL, 2, 65536) if isinstance(b, DCPInterScheduler)]
    theirs = inter.schedule([65536], None)
    assert ours.makespan > theirs.makespan * 1.02, (ours.makespan, theirs.makespan)
    inter.pyramid_recompute = False
    assert ours.makespan <= inter.schedule([65536], None).makespan * (1 + 1e-9)


def test_a_long_sequence_shares_ranks_with_short_ones() -> None:
    """Nested blocks: one sequence that needs 8 ranks and many short ones finish together."""
    lengths = [60_000] + [1024] * 120
    planner = Planner(LLM_MODEL, 8)
    schedule = planner.plan(lengths)
    long_mb = next(mb for mb in schedule.microbatches if 0 in mb.positions)
    assert long_mb.sp_size >= 2
    short_ranks = {r for mb in schedule.microbatches if 0 not in mb.positions for r in mb.ranks}
    assert short_ranks & set(long_mb.ranks)  # the long sequence's ranks also run short ones
    assert schedule.makespan <= 1.1 * planner.lower_bound(lengths)


def test_planning_is_deterministic_and_complete() -> None:
    rng = random.Random(5)
    lengths = [rng.choice([256, 1024, 4096, 16384, 65536]) for _ in range(300)]
    first = Planner(LLM_MODEL, 16).plan(lengths)
    second = Planner(LLM_MODEL, 16).plan(list(lengths))
    assert [(mb.positions, mb.sp_size, mb.first_rank, mb.recompute) for mb in first.microbatches] == [
        (mb.positions, mb.sp_size, mb.first_rank, mb.recompute) for mb in second.microbatches
    ]
    check_schedule(LLM_MODEL, first, lengths, None, MEMORY_FRACTION * Hardware.H200.memory_capacity)


def test_baselines_follow_the_published_rules() -> None:
    lengths = [4096] * 10 + [65536] * 3
    static = StaticSPScheduler(LLM_MODEL, 8, max_length=65536)
    schedule = static.schedule(lengths)
    assert {mb.sp_size for mb in schedule.microbatches} == {static.sp_size}
    assert {mb.recompute for mb in schedule.microbatches} == {"full"}
    bucket = BucketParallelScheduler(LLM_MODEL, 8, max_length=65536, sp_size=4)
    assert {mb.sp_size for mb in bucket.schedule(lengths).microbatches} == {4}
    # The accumulation search of DCP-inter: a group twice as fast runs twice as many micro-batches.
    assert DCPInterScheduler.accumulation_counts([1.0, 2.0], max_accumulation=4) in ([2, 1], [4, 2])
    assert DCPInterScheduler.accumulation_counts([1.0, 1.0, 3.0], max_accumulation=3) == [3, 3, 1]
    for scheduler in (DCPIntraScheduler(LLM_MODEL, 8), DCPInterScheduler(LLM_MODEL, 8)):
        scheduler.schedule(lengths).validate(len(lengths))


def published_accumulation_counts(times, max_accumulation: int, min_accumulation: int = 1) -> list[int]:
    """DCP-inter's accumulation search as published (VideoSys), loop for loop: the reference the
    scheduler's scored-together search must equal."""
    limit = max(times) * max_accumulation
    best_counts, best_penalty = None, math.inf
    for outer in times:
        for multiple in range(1, int(limit / outer) + 1):
            target = outer * multiple
            if target > limit:
                break
            counts, penalty = [], 0.0
            for inner in times:
                best_inner, best_count = math.inf, 1
                for count in range(1, int(limit / inner) + 1):
                    value = inner * count
                    if value > limit:
                        break
                    score = (value - target) * 1.2 if value > target else (target - value)
                    if score < best_inner:
                        best_inner, best_count = score, count
                counts.append(best_count)
                penalty += best_inner
            if penalty < best_penalty:
                best_penalty, best_counts = penalty, counts
    counts = best_counts or [1] * len(times)
    if max(counts) < min_accumulation:
        factor = math.ceil(min_accumulation / max(counts))
        counts = [c * factor for c in counts]
    return counts


@settings(max_examples=100, deadline=None, derandomize=True)
@given(st.lists(st.one_of(st.floats(0.02, 1.0), st.sampled_from([0.1, 0.2, 0.3, 0.25, 0.5, 1.0])), min_size=1,
                max_size=5),
       st.integers(1, 4), st.integers(1, 12))
def test_the_accumulation_search_equals_the_published_loops(times, max_accumulation, min_accumulation) -> None:
    """Times fifty-fold apart (an 8-token bucket beside a long one made the loops take minutes;
    the reference's own loops bound the spread a test can afford), and equal or simply related
    times (ties, targets that land on a count exactly)."""
    assert DCPInterScheduler.accumulation_counts(times, max_accumulation, min_accumulation) == \
        published_accumulation_counts(times, max_accumulation, min_accumulation)


def test_unplannable_sequences_get_a_clear_error() -> None:
    with pytest.raises(PlanningError, match="fits on no SP group.*use more ranks"):
        Planner(LLM_MODEL, 2).plan([1024, 10_000_000])
    with pytest.raises(PlanningError, match="model state alone"):
        Planner(CostModel(ModelProfile.from_config("llama-3-8b"), Hardware.H100), 8).plan([1024])


@pytest.mark.slow
def test_planning_4096_sequences_on_64_ranks_is_fast() -> None:
    rng = random.Random(0)
    shapes = [rng.choice(VIDEO_BUCKETS) for _ in range(4096)]
    lengths = [t * h * w for t, h, w in shapes]
    spans = [video_attention_span(t, h, w) for t, h, w in shapes]
    planner = Planner(CostModel(ModelProfile.from_config("stdit3-xl/2"), Hardware.H200, optimizer_shards=64), 64)
    planner.plan(lengths, spans)
    timings = []
    for _ in range(3):
        start = time.perf_counter()
        schedule = planner.plan(lengths, spans)
        timings.append(time.perf_counter() - start)
    assert min(timings) < 0.15  # the goal is 50 ms (see benchmarks/planner.py); this guards regressions
    assert schedule.makespan <= 1.05 * planner.lower_bound(lengths, spans)


def test_packed_rows_are_priced_as_the_measured_kernel_computes_them() -> None:
    """A CPU profile counts a packed row's scores as its kernel computes them (the whole ``T^2``
    of a short or dense row, ``ScoreLayout.DENSE_RANGES``). The planner once summed each
    sequence's own ``L^2`` instead: the demo's plans were priced 10-25% under what they cost,
    and its predicted speedup over static SP came out 1.45x where it measured 1.03x."""
    import torch

    from dcp_compile.schedule.analytic import ScoreLayout
    from dcp_compile.schedule.measured_costs import MeasuredCosts, Measurement, fit_all

    def seconds(row) -> float:  # a kernel whose attention follows the scores it computes
        from dcp_compile.kernels.dense_ranges import dense_scores

        return 1e-3 + 4e-6 * sum(row) + 3e-8 * dense_scores(row) + 2e-4 * len(row)

    rows = [(n,) for n in (64, 128, 256, 512, 1024)] + [(64,) * 8, (128,) * 4, (32,) * 12, (300, 300)]
    points = [Measurement(row, sp, policy, seconds(row) / sp)
              for sp in (1, 2) for policy in ("none", "full") for row in rows]
    measured = MeasuredCosts(device="test CPU", software={"torch": torch.__version__},
                             fits=fit_all(points, ScoreLayout.DENSE_RANGES), measurements=tuple(points),
                             score_layout=ScoreLayout.DENSE_RANGES)
    profile = ModelProfile.transformer("t", num_layers=2, hidden_size=64, num_heads=4, vocab_size=256)
    cost = CostModel(profile, Hardware.this_cpu(), measured=measured)
    assert cost.time([64] * 8, 1) > cost.time([64], 1) * 8 * 0.9  # a dense row costs its T^2, not 8 x 64^2
    rng = random.Random(3)
    lengths = [rng.choice((16, 24, 40, 64, 96, 200, 420)) for _ in range(60)]
    # Rows of at most 400 tokens per rank (a tight memory cap's): the kernel computes them whole.
    schedule = Planner(cost, 2, memory_fraction=MEMORY_FRACTION, max_tokens_per_rank=400).plan(lengths)
    check_schedule(cost, schedule, lengths, None, cost.hardware.memory_capacity * MEMORY_FRACTION, 400)
    assert any(len(mb.positions) > 1 for mb in schedule.microbatches)  # packing was priced, not avoided
