"""Properties of the planner over random steps (issue 37, item 6): it never loses to a plan it
could have made. On random steps from several length distributions (uniform, long-tailed,
bimodal text on Llama-3-8B; the Open-Sora video bucket mix on STDiT3-XL/2; H100, 8 and 16 ranks):

(a) its step time (makespan plus the gradient all-reduce, as the comparison prices it) is at most
    every static SP size's and every dynamic CP threshold's under the same cap and cost model;
(b) under a larger memory cap it is never slower than under a smaller one on the planner's memory
    ladder (multiples of ``MEMORY_LADDER_STEP`` of the device's memory; steps of at most
    ``LADDER_MAX_SEQUENCES`` sequences), by construction: it plans under the rung below its cap
    too. Off the ladder (0.76 here) that is not guaranteed: such pairs are a printed statistic;
(c) every micro-batch fits the cap.

The gap to :meth:`Planner.lower_bound` is printed as a statistic (``-s`` shows it).
"""

from __future__ import annotations

import random
import statistics
import sys
from functools import lru_cache
from pathlib import Path

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from dcp_compile.schedule.cost_model import CostModel, ModelProfile
from dcp_compile.schedule.hardware import Hardware
from dcp_compile.schedule.plan import Schedule
from dcp_compile.schedule.planner import LADDER_MAX_SEQUENCES, MEMORY_LADDER_STEP, Planner, PlanningError
from dcp_compile.schedule.step_time import step_time
from dcp_compile.schedule.user_baselines import DYNAMIC_CP_THRESHOLD_SHARES, BalancedStaticSP, dynamic_cp_at_share
from dcp_compile.variant import RECOMPUTE_POLICIES

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import workloads  # noqa: E402

TEXT, VIDEO = "llama-3-8b", "stdit3-xl/2"
# Memory fractions where each model trains on 8 and 16 H100s: Llama-3-8B's state (optimizer
# sharded over the world) leaves room for activations from about 0.75 of the memory up.
FRACTIONS = {TEXT: (0.76, 0.8, 0.85, 0.9, 1.0), VIDEO: (0.3, 0.5, 0.7, 0.9)}
_VIDEO_MIX = workloads.distribution("video-opensora")
DISTRIBUTIONS = {
    "uniform": lambda rng: rng.randint(64, 32768),
    "long-tail": lambda rng: max(16, min(131072, int(rng.lognormvariate(8.0, 1.6)))),
    "bimodal": lambda rng: rng.choice([rng.randint(64, 1024), rng.randint(16000, 65536)]),
    "video": lambda rng: _VIDEO_MIX.sample(rng)[0],
}
RELATIVE = 1e-9  # float noise: the planner's and the baselines' sums of the same times


@lru_cache(maxsize=None)
def cost_model(name: str, world: int) -> CostModel:
    return CostModel(ModelProfile.from_config(name), Hardware.H100, optimizer_shards=world)


@lru_cache(maxsize=None)
def planner(name: str, world: int, fraction: float) -> Planner:
    return Planner(cost_model(name, world), world, fraction)


def draw_step(seed: int, distribution: str, count: int) -> tuple[str, list[int]]:
    rng = random.Random(seed)
    return (VIDEO if distribution == "video" else TEXT), [DISTRIBUTIONS[distribution](rng) for _ in range(count)]


def seconds(schedule: Schedule, lengths: list[int], model: CostModel) -> float:
    """The step a user pays (gradient all-reduce after the last backward), as the comparison tunes on."""
    return step_time(schedule, lengths, model).unoverlapped


def rivals(name: str, world: int, fraction: float, lengths: list[int]):
    """Static SP at every size that holds the longest sequence, dynamic CP at every threshold a user
    tries under every policy: the plans the planner could have made."""
    model, cap, longest = cost_model(name, world), planner(name, world, fraction).memory_cap, max(lengths)
    size = 1
    while size <= world:
        try:
            yield BalancedStaticSP(model, world, cap, size, longest)
        except ValueError:
            pass
        size *= 2
    for policy in RECOMPUTE_POLICIES:
        for share in DYNAMIC_CP_THRESHOLD_SHARES:
            try:
                yield dynamic_cp_at_share(model, world, cap, longest, share, recompute=policy)
            except ValueError:
                continue


def fits(model: CostModel, schedule: Schedule, lengths: list[int], cap: float) -> bool:
    """Every micro-batch within the device's cap and the host's (offload and lean keep block inputs there)."""
    return all(model.peak_memory([lengths[p] for p in mb.positions], mb.sp_size, mb.recompute) <= cap * (1 + 1e-12)
               and model.host_peak([lengths[p] for p in mb.positions], mb.sp_size, mb.recompute)
               <= model.host_memory_cap * (1 + 1e-12)
               for mb in schedule.microbatches)


GAPS: list[float] = []
OFF_LADDER: list[float] = []  # a larger cap's step time over a smaller one's, the smaller off the ladder


def on_the_ladder(fraction: float, count: int) -> bool:
    rung = fraction / MEMORY_LADDER_STEP
    return abs(rung - round(rung)) < 1e-9 and count <= LADDER_MAX_SEQUENCES


def check_step(seed: int, distribution: str, world: int, count: int, pair: tuple[int, int], monotone: bool = True) -> None:
    name, lengths = draw_step(seed, distribution, count)
    model = cost_model(name, world)
    small, large = sorted(FRACTIONS[name][i] for i in pair)
    times = {}
    for fraction in (small, large) if small != large else (small,):
        p = planner(name, world, fraction)
        try:
            schedule = p.plan(lengths)
        except PlanningError:
            continue  # nothing fits this cap: no baseline plans it either
        schedule.validate(len(lengths))
        assert fits(model, schedule, lengths, p.memory_cap), (distribution, world, fraction, lengths)  # (c)
        ours = times[fraction] = seconds(schedule, lengths, model)
        GAPS.append(schedule.makespan / p.lower_bound(lengths) - 1)
        for rival in rivals(name, world, fraction, lengths):  # (a)
            theirs = seconds(rival.schedule(lengths), lengths, model)
            assert ours <= theirs * (1 + RELATIVE), (rival.name, getattr(rival, "sp_size", None), fraction, ours / theirs, lengths)
    if monotone and small in times and large in times:  # (b)
        if on_the_ladder(small, len(lengths)):
            assert times[large] <= times[small] * (1 + RELATIVE), (distribution, world, small, large, times[large] / times[small], lengths)
        else:
            OFF_LADDER.append(times[large] / times[small])


steps = dict(seed=st.integers(0, 10**9), distribution=st.sampled_from(sorted(DISTRIBUTIONS)),
             world=st.sampled_from([8, 16]), count=st.integers(1, 40), pair=st.tuples(st.integers(0, 4), st.integers(0, 4)))


@settings(max_examples=60, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(**steps)
def test_planner_never_loses_to_a_plan_it_could_have_made(seed, distribution, world, count, pair) -> None:
    check_step(seed, distribution, world, count, _pair(distribution, pair))


def _pair(distribution: str, pair: tuple[int, int]) -> tuple[int, int]:
    fractions = FRACTIONS[VIDEO if distribution == "video" else TEXT]
    return tuple(i % len(fractions) for i in pair)


@pytest.mark.slow
@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(**steps)
def test_planner_never_loses_to_the_baselines_and_fits_many_steps(seed, distribution, world, count, pair) -> None:
    check_step(seed, distribution, world, count, _pair(distribution, pair), monotone=False)


@pytest.mark.slow
@settings(max_examples=400, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(**steps)
# Before the memory ladder this pair's plan was 1.3% slower under 0.85 of the memory than under 0.8
# (the strict xfail this test was): the search under the larger cap settled on coarser micro-batches.
@example(seed=0, distribution="long-tail", world=16, count=9, pair=(1, 2))
def test_larger_cap_is_never_slower_many_steps(seed, distribution, world, count, pair) -> None:
    check_step(seed, distribution, world, count, _pair(distribution, pair))


def test_report_gap_to_lower_bound() -> None:
    """The gap statistic of the steps above (printed; the bound is loose on small steps: it counts
    no fixed cost and assumes perfect balance)."""
    if not GAPS:  # run alone: plan a few fixed steps for the statistic
        for seed in range(6):
            check_step(seed, sorted(DISTRIBUTIONS)[seed % len(DISTRIBUTIONS)], 8, 5 + 6 * seed, (0, 0), monotone=False)
    print(f"\nplanner gap to lower bound over {len(GAPS)} plans: mean {statistics.mean(GAPS):.3f}, "
          f"median {statistics.median(GAPS):.3f}, max {max(GAPS):.3f}")
    if OFF_LADDER:
        slower = [ratio for ratio in OFF_LADDER if ratio > 1 + RELATIVE]
        print(f"larger cap over a smaller one off the memory ladder, {len(OFF_LADDER)} pairs: "
              f"{len(slower)} slower, worst {max(OFF_LADDER):.4f}x")
    assert min(GAPS) >= -1e-9  # the bound is a bound


def test_planner_beats_dynamic_cp_tuned_to_any_policy_on_a_measured_cost_model() -> None:
    """The long-sequence replay's measured CPU profile (``tests/data/replay_long_cpu_profile.json``,
    ``benchmarks/replay.py --setup replay_long_cpu``, run 3) under its stand-in cap, 8 ranks, the
    setup's steps: DCP at least as fast as dynamic CP at every threshold a user tries under every
    policy, step by step. Its candidates once held only the fastest policy that fits the longest
    sequence, and dynamic CP tuned to ``selective`` planned 1-3% faster there."""
    from dataclasses import replace

    import torch

    from benchmark_scripts import load_benchmark
    from dcp_compile.schedule.comparison import Budget

    setup = workloads.load()["setups"]["replay_long_cpu"]
    measured = CostModel.load(Path(__file__).parent / "data" / "replay_long_cpu_profile.json")
    cap = load_benchmark("replay").stand_in_cap(measured, setup["context_window"], torch.device("cpu"),
                                                **setup["stand_in"])
    world = 8
    model = replace(measured, hardware=replace(measured.hardware, memory_capacity=cap / setup["memory_fraction"]),
                    optimizer_shards=world)
    budget = Budget(model, world, setup["memory_fraction"])
    distribution = workloads.distribution("pretrain-byted", length_scale=setup["length_scale"])
    steps = workloads.steps(distribution, 0, setup["tokens_per_rank"] * world, setup["steps"], setup["context_window"])
    dcp_planner = Planner(model, world, setup["memory_fraction"])
    for step in steps:
        ours = seconds(dcp_planner.plan(step.lengths), step.lengths, model)
        for policy in RECOMPUTE_POLICIES:
            for share in DYNAMIC_CP_THRESHOLD_SHARES:
                try:
                    rival = dynamic_cp_at_share(model, world, budget.memory_cap, max(step.lengths), share,
                                                recompute=policy)
                except ValueError:
                    continue
                theirs = seconds(rival.schedule(step.lengths), step.lengths, model)
                assert ours <= theirs * (1 + RELATIVE), (rival.name, ours / theirs)
