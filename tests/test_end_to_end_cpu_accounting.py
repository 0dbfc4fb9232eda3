"""The accounting of ``benchmarks/end_to_end_cpu.py``: every schedule trains the step's clips once,
with loss weights that make the step's loss the mean over all its tokens; predictions price each
clip-shape call as the micro-batch it runs as."""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import end_to_end_cpu as bench  # noqa: E402

import dcp_compile as dcp  # noqa: E402
from dcp_compile.demo import training_demo as demo  # noqa: E402
from dcp_compile.schedule.planner import Planner, PlannerConfig  # noqa: E402
from dcp_compile.schedule.published_schedulers import DCPInterScheduler  # noqa: E402

CONFIG = bench.DiTConfig()


def test_zipf_mix_is_short_dominated_by_count_and_long_dominated_by_tokens() -> None:
    lengths = bench.zipf_lengths(0, 200_000)
    counts = Counter(lengths)
    assert set(counts) == set(bench.SHAPES)
    assert counts[16] == max(counts.values()) and counts[4096] == min(counts.values())
    tokens = {n: n * c for n, c in counts.items()}
    assert tokens[4096] > sum(tokens.values()) / 2
    for n, (frames, rows, columns) in bench.SHAPES.items():
        assert frames * rows * columns == n


def _step(seed: int) -> tuple[list[int], list[int]]:
    lengths = bench.zipf_lengths(seed, 3 * CONFIG.tokens_per_step)
    indices = list(range(len(lengths)))[:40]
    return lengths, indices


@pytest.mark.parametrize("seed", range(3))
def test_every_schedule_trains_every_clip_once_with_weights_summing_to_one(seed: int) -> None:
    lengths, indices = _step(seed)
    cost = bench.cost_model_of(CONFIG)
    step_tokens = sum(lengths[i] for i in indices)
    schedule = Planner(cost, 4, max_tokens_per_rank=bench.MAX_TOKENS_PER_RANK,
                       config=PlannerConfig(pack_equal_lengths_only=True)).plan([lengths[i] for i in indices])
    dcp_mbs = [tuple(indices[p] for p in mb.positions) for mb in schedule.microbatches]
    static = [mb.indices for mb in demo.static_microbatches(sorted(indices, key=lengths.__getitem__), lengths,
                                                             4 * bench.MAX_TOKENS_PER_RANK, 4, dcp.Variant(4, "none"))]
    inter = [mb.indices for mb in bench.dcp_inter_microbatches(
        DCPInterScheduler(cost, 4, max_tokens_per_rank=bench.MAX_TOKENS_PER_RANK), indices, lengths)]
    for name, mbs in (("dcp", dcp_mbs), ("static", static), ("inter", inter)):
        assert sorted(i for mb in mbs for i in mb) == sorted(indices), name
        weights = sum(length * count / step_tokens for mb in mbs
                      for length, count in Counter(lengths[i] for i in mb).items())
        assert weights == pytest.approx(1.0), name
    # the planner packs one shape per micro-batch; static SP mixes shapes at most at its cuts
    assert all(len({lengths[i] for i in mb}) == 1 for mb in dcp_mbs)
    assert sum(len({lengths[i] for i in mb}) - 1 for mb in static) <= len(bench.SHAPES) - 1


def test_prediction_prices_one_call_per_clip_shape() -> None:
    cost = bench.cost_model_of(CONFIG)
    lengths = [16, 16, 64, 4096]
    mixed = bench.predicted_time(cost, lengths, [0, 1, 2], 4)
    assert mixed == pytest.approx(cost.time([16, 16], 4) + cost.time([64], 4))
    assert mixed > cost.time([16, 16, 64], 4)  # one fixed cost more than a packed row


def test_clip_groups_stack_one_shape_each() -> None:
    store = bench.ClipStore([16, 64, 16], CONFIG, seed=0)
    groups = store.groups([0, 1, 2])
    assert [tokens for tokens, _ in groups] == [32, 64]
    first = groups[0][1]
    assert first["patches"].shape == (2, 16, CONFIG.patch_dim)
    assert first["text"].shape == (2, CONFIG.text_tokens, CONFIG.hidden)
    assert torch.equal(first["coords"][0], first["coords"][1])
