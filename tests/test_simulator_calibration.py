"""The simulator on the published system's own setting, against its published figures.

Open-Sora v1.2 STDiT3-XL/2 (1.1B) on 32 H100 (4 nodes of 8), the three Zipf video mixes; bucket
parallel at SP 4 with per-bucket batches from its profile, DCP-inter with the published bounds
(max 5 / min 15 accumulation) and pyramid recompute; each scheduler at its own batch with a
gradient sync after every round (``benchmarks/simulate.py: published_setting``). Published, in M
tokens/s: bucket parallel 0.90 / 1.16 / 1.54, DCP-inter 2.24 / 2.06 / 1.97.

What is modelled (each mechanism has its own unit test in ``tests/test_calibration_mechanisms.py``,
of the mechanism, not of these figures):

* the published unit: VAE latent positions before the 2x2 patch, ~3.96x the transformer tokens
  (``published_accounting``, VideoSys ``train.py``);
* the published SP as released (VideoSys 09ad75e, ``published_sp``): spatial shards of every frame
  padded to the SP size, temporal blocks without communication, each spatial block's attention
  on whole frames after a padded all-to-all switch over the frames, images switched over the
  batch padded to the SP size;
* the published epoch (``drop_last``) and DCP-inter's profile ranked after the pyramid knapsack;
* the per-sample text context (K/V projections of 300 T5 tokens in every cross-attention), which
  every rank of an SP group repeats.

Compute speed: the cost model's datasheet default efficiencies ("simulated: analytic compute at
default efficiencies"); no factor borrowed from other measurements (the 2.55x "stack slowdown"
from Open-Sora 1.0's H800 throughputs is gone, and so is the frame-padded SP of older code,
cd7ac04). ``published_setting(..., compute=cost_model)`` takes a profiled cost model instead.

Deviations, from the run (``simulated  published  deviation``; none within +-25%):

    video short-dominated  bucket-parallel   3.58  0.90 +297%
    video short-dominated  dcp-inter         4.91  2.24 +119%
    video balanced         bucket-parallel   3.45  1.16 +197%
    video balanced         dcp-inter         4.59  2.06 +123%
    video long-dominated   bucket-parallel   3.62  1.54 +135%
    video long-dominated   dcp-inter         4.60  1.97 +133%

Why, as far as we can name it: the level (2.3-4.0x the published figures) is the datasheet
efficiencies, far above what the published stack reaches on a width-1152 DiT; only a profile of
an STDiT3-like block on a GPU can set it, and none exists yet. The shape: the published bucket
parallel falls from 1.54 to 0.90 as images grow in the mix, ours stays flat (DCP-inter / bucket
parallel 1.37 / 1.33 / 1.27 against the published 2.49 / 1.78 / 1.28): under the released SP a
batch of images at SP 4 is split over the batch with nothing wasted at the profiled batch sizes,
so the model prices a 144p image at SP 4 about 1.5x a video per token (mostly its text context),
and whatever makes images slow in the published baseline is not in the model. The ranking
(DCP-inter above bucket parallel) holds in all three rows and is the one check on the published
figures kept here; ``test_deviations_are_the_ones_stated`` keeps the table above in step with the
simulator without asserting any figure against the published ones.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, replace
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from simulate import (  # noqa: E402
    ANALYTIC_COMPUTE,
    PROFILED_TERMS,
    PUBLISHED_M_TOKENS_PER_S,
    compute_label,
    compute_scales_from,
    deviation_lines,
    published_cost_model,
    published_setting,
)

from dcp_compile.schedule.cost_model import DEFAULT_SCALES, CostModel, ModelProfile  # noqa: E402
from dcp_compile.schedule.hardware import Hardware  # noqa: E402
from dcp_compile.schedule.published_schedulers import DCPInterScheduler  # noqa: E402
from dcp_compile.variant import RecomputePolicy  # noqa: E402

DISTRIBUTIONS = tuple(PUBLISHED_M_TOKENS_PER_S)


@pytest.fixture(scope="module")
def simulated() -> dict[str, dict[str, dict[str, float]]]:
    return {distribution: published_setting(distribution) for distribution in DISTRIBUTIONS}


def test_deviations_are_the_ones_stated(simulated) -> None:
    """Prints the deviation table and checks that the module docstring states what the simulator
    gives now (rerun and paste the printed lines when a mechanism changes)."""
    lines = deviation_lines(simulated)
    print("\n".join(lines))
    stated = [line.strip() for line in __doc__.splitlines() if line.startswith("    video ")]
    assert stated == [line.strip() for line in lines]


@pytest.mark.parametrize("distribution", DISTRIBUTIONS)
def test_published_ranking(simulated, distribution: str) -> None:
    row = simulated[distribution]
    assert row["dcp-inter"]["m_tokens_per_s"] > row["bucket-parallel"]["m_tokens_per_s"]


def test_compute_speed_is_the_datasheet_default_unless_a_profiled_model_is_given() -> None:
    assert published_cost_model().scales == DEFAULT_SCALES
    assert compute_label() == ANALYTIC_COMPUTE == "simulated: analytic compute at default efficiencies"
    profiled = CostModel(ModelProfile.from_config("stdit3-xl/2"), Hardware.H200,
                         scales={"linear": 3.0, "attention": 4.0, "memory": 2.0, "communication": 9.0, "overhead": 5.0})
    model = published_cost_model(compute=profiled)
    assert model.hardware == Hardware.H100
    assert {t: model.scales[t] for t in PROFILED_TERMS} == {t: profiled.scales[t] for t in PROFILED_TERMS}
    assert model.scales["communication"] == DEFAULT_SCALES["communication"]  # one device cannot measure the links
    assert "profiled" in compute_label(profiled) and "H200" in compute_label(profiled)


@pytest.mark.skipif("measured" not in CostModel.__dataclass_fields__, reason="no measured cost models in this tree")
def test_a_measured_model_sets_the_compute_speed_by_its_ratio_to_the_prior() -> None:
    """A model whose device ran the profiled block twice as slow as the analytic prior doubles
    the published setting's compute scales (an efficiency, carried to the H100)."""

    @dataclass(frozen=True, eq=False)
    class TwiceAsSlow(CostModel):
        def time(self, lengths, sp_size, recompute="none", spans=None):  # type: ignore[override]
            if self.measured is None:
                return super().time(lengths, sp_size, recompute, spans)
            return 2.0 * replace(self, measured=None).time(lengths, sp_size, recompute, spans)

    measured = TwiceAsSlow(ModelProfile.from_config("stdit3-xl/2"), Hardware.H200, measured=object())
    scales = compute_scales_from(measured)
    assert scales == pytest.approx({t: 2.0 * DEFAULT_SCALES[t] for t in PROFILED_TERMS})


# --------------------------------------------------------------------------- the memory model
STDIT = ModelProfile.from_config("stdit3-xl/2")


def test_block_checkpointing_divides_activation_memory_by_sp() -> None:
    """Whole-block checkpointing keeps block inputs only, so a rank's bytes per token of the
    micro-batch fall as 1/SP; our compiler's ``full`` keeps the all-to-all outputs and does not."""
    published = CostModel(STDIT, Hardware.H100, optimizer_shards=32, collectives_recomputed=True)
    ours = CostModel(STDIT, Hardware.H100, optimizer_shards=32)
    per_token = [published.memory_coefficients(sp, "full").bytes_per_token for sp in (1, 2, 4, 8)]
    for sp, value in zip((2, 4, 8), per_token[1:]):
        assert value * sp == pytest.approx(per_token[1] * 2)  # exactly 1/SP from SP 2 on
        assert value < 1.15 * per_token[0] / sp  # SP 1 has no all-to-all buffers (+10% at SP > 1)
    assert ours.memory_coefficients(4, "full").bytes_per_token > published.memory_coefficients(4, "full").bytes_per_token


def test_recomputed_collectives_are_charged() -> None:
    published = CostModel(STDIT, Hardware.H100, collectives_recomputed=True)
    ours = CostModel(STDIT, Hardware.H100)
    lengths, spans = [54000], [1800.0]
    sent_published = published.terms(lengths, 4, "full", spans)["communication"]
    sent_ours = ours.terms(lengths, 4, "full", spans)["communication"]
    assert sent_published == pytest.approx(1.5 * sent_ours)  # 12 all-to-alls per layer instead of 8
    assert published.terms(lengths, 4, "none", spans) == ours.terms(lengths, 4, "none", spans)


def test_pyramid_knapsack_uses_spare_memory_only() -> None:
    cost_model = CostModel(STDIT, Hardware.H100, optimizer_shards=32)
    scheduler = DCPInterScheduler(cost_model, 32)
    # A bucket whose best (SP, batch) leaves room for some layers but not all (53 of 56 here; at
    # 4320 tokens the best batch now leaves room for all 56: the H100's 81,559 MiB and the
    # backward working set the memory model prices moved the profile's choice).
    profile = scheduler.profile_bucket(8000, 1000.0)
    unchecked = scheduler.uncheckpointed_layers(profile)
    assert 0 < unchecked < STDIT.num_layers
    tokens = [profile.length] * profile.batch_size
    model = scheduler.cost_model
    full = model.peak_memory(tokens, profile.sp_size, RecomputePolicy.FULL)
    none = model.peak_memory(tokens, profile.sp_size, RecomputePolicy.NONE)
    assert full + unchecked * (none - full) / STDIT.num_layers <= scheduler.memory_cap
    # A batch that fills the cap to within a sample (under 1 GiB here) leaves no room: every layer
    # stays checkpointed.
    fullest = model.token_capacity(profile.sp_size, RecomputePolicy.FULL, scheduler.memory_cap) // profile.length
    crowded = replace(profile, batch_size=fullest)
    assert scheduler.uncheckpointed_layers(crowded) == 0
