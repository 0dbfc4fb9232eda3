"""The demo's setup and its verdict block, without training (fast).

* One budget: DCP's sampler and static SP plan with the same cost model and the same memory cap
  (the audit of issue 33 asked that a baseline not win or lose by a different budget).
* ``--seed`` draws different data and plans; the same seed draws the same.
* The verdict block names both clocks, gives each ratio with its interval, the prediction and its
  error, the seed, and reads an interval that spans 1.0 as no difference.

The end-to-end run that checks the block is the last output is
``tests/test_dcp_training.py::test_demo_runs_end_to_end``.
"""

from __future__ import annotations

import math

import pytest
import torch

import dcp_compile as dcp
from dcp_compile.demo import training_demo as demo
from dcp_compile.schedule.measured_costs import Clock, MeasuredCosts, Measurement, fit_all

WORLD_SIZE = 2
LINK = (1e-4, 1e9)  # seconds per all-to-all, bytes/s


def _profile(scale: float) -> dict:
    """A synthetic ``profile_compute`` result: every (SP size, policy) of a 2-rank world, recompute
    30% dearer, times linear in tokens."""
    points = [Measurement((n,), sp, policy, scale * (2e-3 + (1.3 if policy != "none" else 1.0) * 1e-5 * n / sp))
              for sp in (1, 2) for policy in dcp.RecomputePolicy for n in (64, 256, 1024)]
    return MeasuredCosts("test cpu", {"torch": torch.__version__}, fit_all(points), tuple(points)).to_dict()


def _setup(seed: int = 0, steps: int = 2) -> demo.DemoSetup:
    return demo.build_setup([_profile(1.0), _profile(1.2)], LINK, WORLD_SIZE, rank=0, seed=seed, steps=steps)


def test_dcp_and_static_sp_plan_with_one_cost_model_and_one_memory_cap() -> None:
    setup = _setup()
    planner = setup.sampler.planner
    assert setup.static.cost_model is setup.sampler.cost_model is planner.cost_model
    caps = setup.memory_caps()
    assert caps["dcp"] == caps["static"] == planner.memory_cap
    digests = setup.cost_model_digests()
    assert digests["dcp"] == digests["static"] and len(digests["dcp"]) == 16
    # Static SP's micro-batch budget is the planner's own capacity for the same (SP size, policy).
    level = planner.sizes.index(WORLD_SIZE)
    policy_index = list(dcp.RecomputePolicy).index(setup.static.policy)
    assert setup.static.capacity == planner.capacity[level][policy_index] > 0
    # The cap binds as the demo says: the longest sample fits the whole world only with full recompute,
    # while one rank holds a typical short sample without any.
    assert setup.static.policy is dcp.RecomputePolicy.FULL
    assert setup.cost_model.token_capacity(1, "none", caps["dcp"]) >= 4 * demo.SHORTEST
    assert setup.static.variant == dcp.Variant(WORLD_SIZE, dcp.RecomputePolicy.FULL)


def test_a_different_memory_cap_would_show_in_the_digest_and_caps() -> None:
    """The two equalities above can fail: a static setup fitted to another cap or cost model differs."""
    setup = _setup()
    other_model, _ = demo.demo_cost_model([_profile(2.0), _profile(2.0)], LINK, WORLD_SIZE)
    assert demo.cost_model_digest(other_model) != setup.cost_model_digests()["dcp"]
    looser = demo.StaticSP.fit(setup.cost_model, 4 * setup.static.memory_cap, WORLD_SIZE)
    assert looser.policy is not dcp.RecomputePolicy.FULL and looser.capacity > setup.static.capacity


def test_seed_draws_the_data_and_the_plans() -> None:
    first, again, other = _setup(0), _setup(0), _setup(1)
    assert first.lengths == again.lengths
    assert all(torch.equal(a, b) for a, b in zip(first.dataset, again.dataset))
    assert first.lengths != other.lengths
    assert first.sampler.steps() == again.sampler.steps() != other.sampler.steps()


def _result(wall: tuple[float, float, float], cpu: tuple[float, float, float], steps: int = 6,
            clock: Clock = Clock.PROCESS_CPU) -> dict:
    return {"seed": 3, "steps": steps, "world_size": 2, "wall_speedup": wall[0], "wall_paired_speedup": wall,
            "speedup": cpu[0], "paired_speedup": cpu, "predicted_speedup": 1.10, "clock": clock.value,
            "max_loss_difference": 4.8e-7}


def test_verdict_names_both_clocks_the_prediction_its_errors_and_the_seed() -> None:
    lines = demo.verdict_lines(_result((1.05, 0.90, 1.25), (1.21, 1.08, 1.37)))
    assert len(lines) <= 10
    text = "\n".join(lines)
    assert "seed 3" in lines[0] and "6 steps" in lines[0]
    wall = next(line for line in lines if line.startswith("wall clock"))
    cpu = next(line for line in lines if line.startswith("CPU clock"))
    assert "elapsed time on this machine" in wall and "1.05x" in wall and "95% interval 0.90-1.25x" in wall
    assert "reconstructed: per-micro-batch process CPU time composed into steps" in cpu
    assert "1.21x" in cpu and "95% interval 1.08-1.37x" in cpu
    # 1.10 / 1.21 - 1 = -9% on the CPU clock; 1.10 / 1.05 - 1 = +5% on the wall clock.
    assert "predicted 1.10x" in text and "error -9% against the CPU clock" in text and "+5% against the wall clock" in text
    assert lines[-2] == ("reading: wall clock: no significant difference (interval spans 1.0); "
                         "CPU clock: DCP faster (interval above 1.0)")


@pytest.mark.parametrize(("interval", "words"), [
    ((1.2, 1.1, 1.3), "DCP faster (interval above 1.0)"),
    ((0.8, 0.7, 0.9), "static SP faster (interval below 1.0)"),
    ((1.0, 0.8, 1.2), "no significant difference (interval spans 1.0)"),
    ((1.3, 0.99, 1.6), "no significant difference (interval spans 1.0)"),
])
def test_reading_calls_a_difference_only_where_the_interval_leaves_one(interval, words) -> None:
    assert demo.reading(interval, steps=6) == words


def test_one_step_has_no_interval_and_the_verdict_says_so() -> None:
    assert demo.reading((1.3, 1.3, 1.3), steps=1).startswith("no interval")
    assert demo.reading((1.3, math.nan, math.nan), steps=4).startswith("no interval")
    lines = demo.verdict_lines(_result((1.3, 1.3, 1.3), (1.2, 1.2, 1.2), steps=1))
    assert "1 step," in lines[0] and "(paired over 1 step)" in lines[1]
    assert lines[-2].count("no interval from one step") == 2


def test_on_a_gpu_the_second_clock_is_the_device_clock_not_a_reconstruction() -> None:
    lines = demo.verdict_lines(_result((1.1, 1.0, 1.2), (1.1, 1.0, 1.2), clock=Clock.DEVICE_WALL))
    assert not any("reconstructed" in line for line in lines)
    assert lines[2].startswith("device clock (each step's synchronised time")
