"""Our per-layer recompute mix against the published pyramid (0/1 knapsack), on one cost model."""

from __future__ import annotations

import pytest

from dcp_compile.schedule.cost_model import CostModel, ModelProfile
from dcp_compile.schedule.hardware import Hardware
from dcp_compile.schedule.layer_recompute import best_layer_mix, mix_cost
from dcp_compile.schedule.published_schedulers import DCPInterScheduler
from dcp_compile.variant import RecomputePolicy

STDIT = ModelProfile.from_config("stdit3-xl/2")
BUCKETS = [(144, 72.5), (4320, 1000.0), (24300, 1500.0), (108000, 1850.0)]
# About 30 s a bucket on 2 cores: one in the quick tier, the others slow (CI's time budget).
CASES = [BUCKETS[1]] + [pytest.param(*bucket, marks=pytest.mark.slow) for bucket in BUCKETS if bucket != BUCKETS[1]]


@pytest.mark.parametrize("length,span", CASES)
def test_our_mix_is_no_slower_than_the_pyramid_and_fits(length: int, span: float) -> None:
    scheduler = DCPInterScheduler(CostModel(STDIT, Hardware.H100, optimizer_shards=32), 32)
    model = scheduler.cost_model  # block checkpointing, as the published system runs
    profile = scheduler.profile_bucket(length, span)
    lengths, spans = [length] * profile.batch_size, [span] * profile.batch_size
    unchecked = scheduler.uncheckpointed_layers(profile)
    pyramid = {RecomputePolicy.NONE: unchecked, RecomputePolicy.FULL: STDIT.num_layers - unchecked}
    pyramid_time, pyramid_peak = mix_cost(model, lengths, profile.sp_size, pyramid, spans)
    assert pyramid_peak <= scheduler.memory_cap
    ours = best_layer_mix(model, lengths, profile.sp_size, scheduler.memory_cap, spans)
    assert ours is not None and ours.peak_memory <= scheduler.memory_cap
    assert sum(ours.layers.values()) == STDIT.num_layers
    assert ours.time <= pyramid_time * (1 + 1e-12)
    # Restricted to the pyramid's two choices, the exhaustive search finds at least the knapsack's answer.
    two = best_layer_mix(model, lengths, profile.sp_size, scheduler.memory_cap, spans,
                         policies=(RecomputePolicy.NONE, RecomputePolicy.FULL))
    assert two.time <= pyramid_time * (1 + 1e-12)


def test_a_mix_must_cover_every_layer() -> None:
    model = CostModel(STDIT, Hardware.H100)
    with pytest.raises(ValueError, match="cover all 56 layers"):
        mix_cost(model, [1000], 1, {RecomputePolicy.NONE: 3})
