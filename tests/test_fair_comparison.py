"""Fair comparisons: one budget for every scheduler, the step a user pays, baselines a user would
pick, and a planner that never loses to a plan it could have made."""

from __future__ import annotations

import math
import random
import sys
from dataclasses import replace
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dcp_compile.schedule.comparison import ABLATION_RUNGS, Budget, ablation, contenders, plan_run, tune
from dcp_compile.schedule.cost_model import CostModel, ModelProfile
from dcp_compile.schedule.hardware import Hardware
from dcp_compile.schedule.plan import Schedule, ScheduledMicroBatch
from dcp_compile.schedule.planner import Planner, PlannerConfig
from dcp_compile.schedule.step_time import DDP_BUCKET_BYTES, execution_order, step_time
from dcp_compile.schedule.user_baselines import BalancedStaticSP, DynamicCP, PackedStaticCP, gpus_needed
from dcp_compile.variant import RecomputePolicy

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

LLAMA = CostModel(ModelProfile.from_config("llama-3-8b"), Hardware.H100, optimizer_shards=8)
SMALL = CostModel(
    ModelProfile.transformer("small", num_layers=8, hidden_size=1024, num_heads=8, ffn_hidden_size=4096,
                             vocab_size=32000, causal=True),
    Hardware.H100, optimizer_shards=8,
)


def text_step(rng: random.Random, tokens: int, longest: int) -> list[int]:
    lengths: list[int] = []
    while sum(lengths) < tokens:
        lengths.append(min(longest, max(16, int(rng.lognormvariate(7.0, 1.4)))))
    return lengths


def _fits(cost_model: CostModel, schedule: Schedule, lengths: list[int], cap: float) -> bool:
    return all(cost_model.peak_memory([lengths[p] for p in mb.positions], mb.sp_size, mb.recompute) <= cap * (1 + 1e-12)
               for mb in schedule.microbatches)


# ------------------------------------------------------------------ one budget
@pytest.mark.parametrize("fraction", [0.9, 0.5])
def test_every_contender_plans_under_the_budgets_cap_and_cost_model(fraction: float) -> None:
    budget = Budget(SMALL, 8, fraction)
    families = contenders(budget, 32768)
    assert {"dcp", "static-sp", "static-sp+recompute", "packed-static-cp", "dynamic-cp"} <= set(families)
    for members in families.values():
        for scheduler in members:
            assert scheduler.memory_cap == pytest.approx(budget.memory_cap), scheduler.name
            model = scheduler.cost_model
            # the same model: the published ones only add their whole-block checkpointing
            assert (model.profile, model.hardware, model.scales, model.optimizer_shards) == (
                SMALL.profile, SMALL.hardware, SMALL.scales, SMALL.optimizer_shards), scheduler.name


def test_the_simulated_comparison_builds_every_scheduler_from_one_budget() -> None:
    import fair_simulation
    import workloads

    setup = dict(workloads.load()["setups"]["simulated"], steps=1, tokens_per_rank=4096)
    row = fair_simulation.run_configuration(setup, 0.9, 8, "sft-llama3", 0)
    caps = {family["memory_cap"] for family in row["families"].values()} | {
        rung["memory_cap"] for rung in row["ablation"].values()}
    assert len(caps) == 1 and caps.pop() == pytest.approx(0.9 * Hardware.H100.memory_capacity)
    assert len(row["families"]) >= 6 and len(row["ablation"]) == len(ABLATION_RUNGS)


def test_the_replay_builds_every_scheduler_from_one_budget() -> None:
    import replay

    families, rungs = replay.plan_families(Budget(SMALL, 8, 0.8), [(text_step(random.Random(1), 8 * 4096, 8192), None)],
                                           8192)
    caps = {c.scheduler.memory_cap for c in list(families.values()) + list(rungs.values())}
    assert len(caps) == 1 and caps.pop() == pytest.approx(0.8 * Hardware.H100.memory_capacity)
    assert "dcp" in families and len(rungs) == len(ABLATION_RUNGS)


def test_the_long_replay_needs_lean_for_its_longest_sample_and_plans_fixed_lean() -> None:
    """replay_long_cpu's claim (workloads.json): under its stand-in cap the context-window sample
    fits on 8 ranks under lean and under no faster policy there; its scaled documents keep the mix's
    shape (most samples short, the longest near the window); fixed-lean (ALST's setup) is planned."""
    import replay
    import torch
    import workloads

    setup = workloads.load()["setups"]["replay_long_cpu"]
    m, context = setup["model"], setup["context_window"]
    prior = ModelProfile.transformer("replay-gpt", num_layers=m["layers"], hidden_size=m["width"],
                                     num_heads=m["heads"], ffn_hidden_size=4 * m["width"], vocab_size=m["vocab"],
                                     causal=True, dtype_bytes=4)
    model = CostModel(prior, Hardware.H100, optimizer_shards=8)
    cap = replay.stand_in_cap(model, context, torch.device("cpu"), **setup["stand_in"])
    model = CostModel(prior, replace(Hardware.H100, memory_capacity=cap / setup["memory_fraction"]), optimizer_shards=8)
    budget = Budget(model, 8, setup["memory_fraction"])
    holds = replay.holds_by_policy(model, budget.memory_cap, 8)
    assert holds["lean"][8] >= context > max(holds[p][8] for p in ("none", "full", "block", "offload"))
    dist = replay.text_distribution("pretrain-byted", setup)
    step = workloads.steps(dist, 0, 8 * setup["tokens_per_rank"], 6, context)
    lengths = [n for s in step for n in s.lengths]
    assert min(lengths) >= workloads.SHORTEST_SCALED_DOCUMENT and max(lengths) > holds["offload"][8]
    assert sorted(lengths)[len(lengths) // 2] < context // 64
    families, _ = replay.plan_families(budget, [(s.lengths, None) for s in step[:1]], context, ablation=False)
    assert families["fixed-lean"].scheduler.name == "fixed-lean sp8"


def test_the_video_replay_builds_every_scheduler_from_one_budget_packing_equal_shapes_only() -> None:
    """The replay's video path (replay_cpu's DiT stand-in): one budget that packs equal lengths
    only; the families that pack mixed lengths into one row are out; DCP, static SP with recompute
    and the ablation's rungs pack equal shapes only; every micro-batch replays as one call per shape."""
    import replay
    import torch
    import workloads

    from dcp_compile.schedule.comparison import MIXED_PACKING_FAMILIES

    setup = workloads.load()["setups"]["replay_cpu"]
    video = setup["video"]
    dit = CostModel(replay.dit_prior(video, torch.float32), Hardware.H100, optimizer_shards=8)
    cap = replay.stand_in_cap(dit, video["context_window"], torch.device("cpu"))
    dit = CostModel(dit.profile, replace(Hardware.H100, memory_capacity=cap / setup["memory_fraction"]),
                    optimizer_shards=8)
    dist = replay.video_distribution("video-opensora", video)
    step = workloads.steps(dist, 0, 8 * video["tokens_per_rank"], 1, video["context_window"])[0]
    assert [math.prod(shape) for shape in step.shapes] == step.lengths and max(step.lengths) <= video["context_window"]
    budget = Budget(dit, 8, setup["memory_fraction"], pack_equal_lengths_only=True)
    families, rungs = replay.plan_families(budget, [(step.lengths, None)], video["context_window"])
    caps = {c.scheduler.memory_cap for c in list(families.values()) + list(rungs.values())}
    assert len(caps) == 1 and caps.pop() == pytest.approx(budget.memory_cap)
    assert "dcp" in families and "static-sp+recompute" in families and len(rungs) == len(ABLATION_RUNGS)
    assert not set(MIXED_PACKING_FAMILIES) & set(families)
    shapes = replay.clips_of(step)
    for label, contender in list(families.items()) + list(rungs.items()):
        for mb in contender.schedules[0].microbatches:
            mb_shapes = [shapes[p] for p in mb.positions]
            calls = replay.DiTReplayer.calls(mb_shapes, mb.sp_size, mb.recompute)
            assert len(calls) == len(set(mb_shapes)) and sum(count for (_, count), _, _ in calls) == len(mb_shapes)
            if label in ("dcp", "static-sp+recompute") or label in rungs:
                assert len({step.lengths[p] for p in mb.positions}) == 1, (label, mb)


# ------------------------------------------------------------------ the step a user pays
def _microbatch(first: int, size: int, time: float, positions: list[int]) -> ScheduledMicroBatch:
    return ScheduledMicroBatch(positions, size, first, RecomputePolicy.NONE, time, 1000)


def test_step_time_prices_the_all_reduce_after_or_under_the_last_backward() -> None:
    schedule = Schedule(4, [_microbatch(0, 4, 2.0, [0]), _microbatch(0, 1, 1.0, [1]), _microbatch(1, 1, 0.5, [2])])
    lengths = [4096, 1024, 512]
    result = step_time(schedule, lengths, SMALL)
    assert result.compute == pytest.approx(3.0)
    assert result.sync == pytest.approx(SMALL.hardware.all_reduce_seconds(SMALL.profile.gradient_bytes, 4))
    assert result.compute <= result.overlapped <= result.unoverlapped
    # at least the last bucket runs after the slowest rank's backward
    buckets = math.ceil(SMALL.profile.gradient_bytes / DDP_BUCKET_BYTES)
    assert result.exposed_sync >= SMALL.hardware.all_reduce_seconds(SMALL.profile.gradient_bytes / buckets, 4) * 0.999
    # ranks run larger groups first: rank 0 ends with its SP-1 micro-batch
    assert [mb.sp_size for mb in execution_order(schedule)[0]] == [4, 1]
    one_rank = Schedule(1, [_microbatch(0, 1, 1.0, [0])])
    assert step_time(one_rank, [10], SMALL).unoverlapped == pytest.approx(1.0)


def test_a_long_last_backward_hides_the_all_reduce() -> None:
    short = step_time(Schedule(2, [_microbatch(0, 2, 0.001, [0])]), [64], SMALL)
    long = step_time(Schedule(2, [_microbatch(0, 2, 100.0, [0])]), [64], SMALL)
    assert long.exposed_sync < short.exposed_sync
    buckets = math.ceil(SMALL.profile.gradient_bytes / DDP_BUCKET_BYTES)
    # only the last bucket is left after a backward long enough to reduce every other one under it
    assert long.exposed_sync == pytest.approx(SMALL.hardware.all_reduce_seconds(SMALL.profile.gradient_bytes / buckets, 2))


# ------------------------------------------------------------------ baselines a user would pick
def test_megatron_dynamic_cp_gpus_needed() -> None:
    # Megatron Bridge's example: max_seqlen_per_rank=64, a 128-token sample needs 2 ranks, 64 and below 1
    assert [gpus_needed(n, 64) for n in (128, 96, 64, 48, 8)] == [2, 2, 1, 1, 1]
    assert gpus_needed(300, 64) == 8 and gpus_needed(10, 64, min_cp_size=2) == 2


@pytest.mark.parametrize("seed", range(4))
def test_user_baselines_plan_valid_steps_that_fit(seed: int) -> None:
    rng = random.Random(seed)
    lengths = text_step(rng, 8 * 16384, 32768)
    budget = Budget(SMALL, 8, 0.5)
    cap = budget.memory_cap
    schedulers = [BalancedStaticSP(SMALL, 8, cap, s, 32768) for s in (2, 4, 8)]
    schedulers += [BalancedStaticSP(SMALL, 8, cap, 4, 32768, per_microbatch_recompute=False, balanced=False)]
    schedulers += [PackedStaticCP(SMALL, 8, cap, s, 32768) for s in (2, 4, 8)]
    schedulers += [DynamicCP(SMALL, 8, cap, 32768), DynamicCP(SMALL, 8, cap, 32768, max_seqlen_per_rank=8192)]
    for scheduler in schedulers:
        schedule = scheduler.schedule(lengths)
        schedule.validate(len(lengths))
        assert _fits(SMALL, schedule, lengths, cap), scheduler.name
    packed = PackedStaticCP(SMALL, 8, cap, 2, 32768).schedule(lengths)
    assert len(packed.microbatches) % 4 == 0  # Megatron makes the pack count a multiple of the DP size
    static = BalancedStaticSP(SMALL, 8, cap, 4, 32768, per_microbatch_recompute=False).schedule(lengths)
    assert len({mb.recompute for mb in static.microbatches}) == 1
    dynamic = DynamicCP(SMALL, 8, cap, 32768, max_seqlen_per_rank=8192).schedule(lengths)
    for mb in dynamic.microbatches:  # every micro-batch's per-rank tokens within the threshold
        assert mb.tokens / mb.sp_size <= 8192


def test_a_baseline_that_cannot_hold_the_longest_sample_says_so() -> None:
    cap = Budget(LLAMA, 8, 0.9).memory_cap
    with pytest.raises(ValueError, match="does not fit 1 ranks.*larger SP size"):
        BalancedStaticSP(LLAMA, 8, cap, 1, 400_000)  # SP 1 holds 145K tokens under recompute=lean


def test_tune_keeps_the_cheapest_candidate_that_plans_every_step() -> None:
    cap = Budget(SMALL, 8, 0.5).memory_cap
    candidates = [BalancedStaticSP(SMALL, 8, cap, s, 32768) for s in (2, 4, 8)]
    steps = [text_step(random.Random(s), 8 * 8192, 32768) for s in range(3)]
    chosen, total = tune(candidates, steps, lambda c, lengths: c.schedule(lengths).makespan)
    assert total == pytest.approx(min(sum(c.schedule(x).makespan for x in steps) for c in candidates))


# ------------------------------------------------------------------ the planner's restrictions and fallbacks
def test_planner_restricted_to_one_size_and_policy() -> None:
    lengths = text_step(random.Random(3), 8 * 16384, 32768)
    one_size = Planner(SMALL, 8, 0.5, config=PlannerConfig(sp_sizes=(4,))).plan(lengths)
    assert {mb.sp_size for mb in one_size.microbatches} == {4}
    one_policy = Planner(SMALL, 8, 0.5, config=PlannerConfig(recompute_policies=(RecomputePolicy.FULL,))).plan(lengths)
    assert {mb.recompute for mb in one_policy.microbatches} == {RecomputePolicy.FULL}
    with pytest.raises(ValueError, match="holds none of the SP sizes"):
        Planner(SMALL, 8, config=PlannerConfig(sp_sizes=(3,)))


def test_ablation_ladder_ends_at_dcp_and_starts_at_static_sp() -> None:
    budget = Budget(SMALL, 8, 0.5)
    rungs = ablation(budget, 32768, 4)
    assert list(rungs) == list(ABLATION_RUNGS)
    lengths = text_step(random.Random(5), 8 * 16384, 32768)
    first = rungs[ABLATION_RUNGS[0]].schedule(lengths)
    assert {mb.sp_size for mb in first.microbatches} == {4} and len({mb.recompute for mb in first.microbatches}) == 1
    assert rungs[ABLATION_RUNGS[3]].schedule(lengths).makespan <= rungs[ABLATION_RUNGS[2]].schedule(lengths).makespan + 1e-9


def test_no_fit_message_quotes_the_best_group() -> None:
    with pytest.raises(ValueError, match=r"the most any group holds is [\d,]+ tokens \(\d+ ranks"):
        Planner(LLAMA, 8).plan([1024, 10_000_000])


DISTRIBUTIONS = {
    "short": lambda rng: max(16, int(rng.expovariate(1 / 600))),
    "long-tail": lambda rng: max(16, int(rng.lognormvariate(7.5, 1.6))),
    "bimodal": lambda rng: rng.choice([rng.randint(64, 512), rng.randint(8000, 30000)]),
}


@settings(max_examples=120, deadline=None, derandomize=True)
@given(st.sampled_from(sorted(DISTRIBUTIONS)), st.sampled_from([2, 4, 8]), st.integers(1, 40),
       st.integers(0, 10**6), st.sampled_from([0.35, 0.5, 0.9]))
def test_planner_never_loses_to_static_sp_or_dynamic_cp(distribution: str, world: int, count: int, seed: int,
                                                         fraction: float) -> None:
    """A property over random steps: the planner's makespan is at most any static SP size's (with
    per-micro-batch recompute) and dynamic CP's at each threshold a user tries, same cap and model."""
    rng = random.Random(seed)
    lengths = [min(32768, DISTRIBUTIONS[distribution](rng)) for _ in range(count)]
    model = CostModel(SMALL.profile, SMALL.hardware, optimizer_shards=world)
    planner = Planner(model, world, fraction)
    cap = planner.memory_cap
    longest = max(lengths)
    try:
        makespan = planner.plan(lengths).makespan
    except ValueError:
        return  # nothing fits: no baseline can plan it either (the static and dynamic checks below would raise)
    rivals = []
    size = 1
    while size <= world:
        try:
            rivals.append(BalancedStaticSP(model, world, cap, size, longest))
        except ValueError:
            pass
        size *= 2
    for share in (1.0, 0.5, 0.25, 0.125):
        try:
            safe = DynamicCP(model, world, cap, longest)
            rivals.append(DynamicCP(model, world, cap, longest, recompute=safe.policy,
                                    max_seqlen_per_rank=max(1, int(safe.max_seqlen_per_rank * share))))
        except ValueError:
            pass
    for rival in rivals:
        assert makespan <= rival.schedule(lengths).makespan * (1 + 1e-9), rival.name


def test_plan_run_tunes_every_family_on_the_same_steps() -> None:
    budget = Budget(SMALL, 8, 0.5)
    steps = [(text_step(random.Random(s), 8 * 8192, 16384), None) for s in range(2)]
    families, rungs = plan_run(budget, steps, 16384)
    for contender in families.values():
        assert len(contender.schedules) == 2
    assert families["static-sp+recompute"].configurations >= 2
    assert list(rungs) == list(ABLATION_RUNGS)


@pytest.mark.slow
def test_the_video_replay_runs_end_to_end_at_tiny_sizes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """About 4 minutes on 2 busy cores: the replay's video path (VideoDiT profiled, compiled per
    SP size and policy, one call per clip shape) on replay_tiny's sizes with clips up to 900
    tokens, beside a text block; the table says which families cannot train the DiT and why."""
    import copy

    import replay
    import workloads

    def tiny_setup(device, tiny, name=None):
        spec = workloads.load()
        setup = dict(spec["setups"]["replay_tiny"], name="replay_tiny", seeds=[0], distributions=["sft-llama3", "video-opensora"])
        video = copy.deepcopy(spec["setups"]["replay_cpu"]["video"])
        video.update(tokens_per_rank=256, context_window=900, profile_lengths=[60, 240, 900], profile_held_out=[112],
                     profile_sp_sizes=[1, 2, 4, 8])
        return dict(setup, video=video)

    monkeypatch.setattr(replay, "setup_for", tiny_setup)
    assert replay.main(["--tiny", "--out-dir", str(tmp_path)]) == 0
    text = (tmp_path / "replay_cpu_tiny.md").read_text()
    assert "complete: 2 of 2" in text and "| 8 | video-opensora |" in text
    assert text.count("packs mixed shapes: cannot train it") == 2
    import json

    rows = json.loads((tmp_path / "replay_cpu_tiny.json").read_text())["rows"]
    video = [r for r in rows if r["distribution"] == "video-opensora"]
    assert {r["kind"] for r in video} == {"video"} and len({r["memory_cap"] for r in video}) == 1
    assert {"dcp", "static-sp+recompute"} <= {r["family"] for r in video if not r["ablation"]}
