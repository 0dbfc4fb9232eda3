"""The main job's cost model and its reading of the results, on synthetic profiles (the end-to-end
run is ``tests/test_dcp_training.py::test_demo_runs_end_to_end``)."""

from __future__ import annotations

import math

import pytest
import torch

import dcp_compile as dcp
from dcp_compile.demo import training_demo as demo
from dcp_compile.schedule.measured_costs import MeasuredCosts, Measurement, fit_all


def _profile(scale: float) -> dict:
    points = [Measurement((n,), sp, policy, scale * (2e-3 + (1.3 if policy != "none" else 1.0) * 1e-5 * n / sp))
              for sp in (1, 2) for policy in dcp.RecomputePolicy for n in (64, 256, 1024)]
    return MeasuredCosts("test cpu", {"torch": torch.__version__}, fit_all(points), tuple(points)).to_dict()


def test_cost_model_takes_each_point_at_the_slowest_process_and_a_cap_that_forces_recompute_on_static() -> None:
    cost_model, cap = demo.demo_cost_model([_profile(1.0), _profile(1.5)], (1e-4, 1e9), world_size=2)
    assert cost_model.measured.fit_for(1, "none").seconds([256]) == pytest.approx(1.5 * (2e-3 + 1e-5 * 256), rel=1e-6)
    # The longest sample fits on the whole world only with full recompute, as the demo says.
    assert cost_model.fastest_feasible_recompute(demo.LONGEST, 2, cap) == dcp.RecomputePolicy.FULL
    assert cost_model.token_capacity(1, "none", cap) < demo.LONGEST
    assert cost_model.hardware.intra_node_latency == 1e-4 and cost_model.hardware.gpus_per_node == 2
    # SP 2 micro-batches pay the measured link: 4 all-to-alls x 2 passes x layers of latency at least.
    assert cost_model.time([256], 2) > cost_model.measured.fit_for(2, "none").seconds([256]) + 8 * demo.LAYERS * 1e-4


def test_paired_ratio_is_a_geometric_mean_with_an_interval() -> None:
    mean, low, high = demo.paired_ratio([1.2, 1.3, 1.25, 1.15])
    assert mean == pytest.approx(math.exp(sum(map(math.log, [1.2, 1.3, 1.25, 1.15])) / 4))
    assert low < mean < high and low > 1.0
    assert demo.paired_ratio([1.1]) == (pytest.approx(1.1),) * 3


def test_mix_is_short_dominated_but_long_samples_carry_tokens() -> None:
    lengths = demo.long_tailed_lengths(20000, seed=0)
    assert sorted(lengths)[len(lengths) // 2] < 4 * demo.SHORTEST
    assert max(lengths) > 0.9 * demo.LONGEST
    assert sum(n for n in lengths if n > demo.LONGEST // 2) / sum(lengths) > 0.2


def test_prediction_misses_are_told_per_kind_of_micro_batch() -> None:
    timings = [
        demo.MicroBatchTiming("dcp", 0, 1, "full", 5, 800, measured=2.0, predicted=1.0),
        demo.MicroBatchTiming("dcp", 1, 1, "full", 3, 700, measured=2.0, predicted=1.0),
        demo.MicroBatchTiming("dcp", 0, 1, "none", 20, 300, measured=0.5, predicted=0.6),
        demo.MicroBatchTiming("static", 0, 2, "full", 1, 1000, measured=1.0, predicted=1.0),
    ]
    lines = demo.prediction_by_kind(timings)
    rows = {tuple(line.split()[:4]): line for line in lines[2:]}
    assert set(rows) == {("dcp", "1", "full", "2-8"), ("dcp", "1", "none", "9-32"), ("static", "2", "full", "1")}
    assert rows[("dcp", "1", "full", "2-8")].split()[4:] == ["2", "1,500", "4.000", "2.000", "-50%"]
    assert rows[("dcp", "1", "none", "9-32")].endswith("+20%")


def test_a_step_on_dedicated_cores_waits_for_each_group_and_for_the_gradient_sync() -> None:
    from dcp_compile.demo.dedicated_cores import RankWork, composed_step_seconds

    # Rank 0 runs a long SP-1 batch, then an SP-2 one with rank 1, then a short SP-1 batch; rank 1
    # runs a short one, the SP-2 one, then a long one. Per-rank sums are 1+2+0.5 and 0.2+2+1.5;
    # with the SP-2 batch starting when rank 0 is ready, rank 1 ends at 1+2+1.5.
    rank0 = [RankWork((1,), (0,), 1.0), RankWork((2, 3), (0, 1), 2.0), RankWork((4,), (0,), 0.5)]
    rank1 = [RankWork((5,), (1,), 0.2), RankWork((2, 3), (0, 1), 2.0), RankWork((6,), (1,), 1.5)]
    assert composed_step_seconds([rank0, rank1], [0.1, 0.3]) == pytest.approx(1.0 + 2.0 + 1.5 + 0.3)
    assert composed_step_seconds([[], []], [0.0, 0.0]) == 0.0
    crossed = [[RankWork((1,), (0, 1), 1.0), RankWork((2,), (0, 1), 1.0)],
               [RankWork((2,), (0, 1), 1.0), RankWork((1,), (0, 1), 1.0)]]
    with pytest.raises(ValueError, match="cannot meet"):
        composed_step_seconds(crossed, [0.0, 0.0])


def test_a_single_threaded_cpu_is_timed_by_its_process_cpu_clock_and_the_profile_says_so() -> None:
    from dcp_compile.device_profile.device_timing import clock_for, time_step
    from dcp_compile.schedule.measured_costs import Clock

    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert clock_for(torch.device("cpu")) is Clock.PROCESS_CPU
        timing = time_step(lambda: torch.ones(64, 64) @ torch.ones(64, 64), torch.device("cpu"), repeats=2)
        assert timing.clock is Clock.PROCESS_CPU and timing.seconds > 0
        if threads > 1:
            torch.set_num_threads(2)  # CPU time would sum the threads: the wall clock is kept
            assert clock_for(torch.device("cpu")) is Clock.DEVICE_WALL
    finally:
        torch.set_num_threads(threads)
    old_file = {k: v for k, v in _profile(1.0).items() if k != "clock"}
    costs = MeasuredCosts.from_dict(old_file)
    assert costs.clock is Clock.DEVICE_WALL  # written before the field existed: wall time
    again = MeasuredCosts.from_dict({**costs.to_dict(), "clock": Clock.PROCESS_CPU.value})
    assert again.clock is Clock.PROCESS_CPU and again.to_dict()["clock"] == Clock.PROCESS_CPU.value


def test_model_profile_counts_attention_called_with_keyword_arguments() -> None:
    """diffusers' attention processors call SDPA with ``query=``/``key=``/``value=``."""
    class KeywordAttention(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.project = torch.nn.Linear(8, 24)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            q, k, v = self.project(x).view(1, x.shape[1], 3, 2, 4).permute(2, 0, 3, 1, 4)
            return torch.nn.functional.scaled_dot_product_attention(query=q, key=k, value=v).sum()

    profile = dcp.ModelProfile.measure(KeywordAttention(), lambda n: (torch.randn(1, n, 8),), lengths=(8, 16, 32))
    assert profile.num_attention_layers == 1
