"""The simulator on the published system's own setting, against its published figures.

Open-Sora v1.2 STDiT3-XL/2 (1.1B) on 32 H100 (4 nodes of 8), the three Zipf video mixes; bucket
parallel at SP 4 with per-bucket batches from its profile, DCP-inter with the published bounds
(max 5 / min 15 accumulation) and pyramid recompute; each scheduler at its own batch with a
gradient sync after every round (``benchmarks/simulate.py: published_setting``). Published, in M
tokens/s: bucket parallel 0.90 / 1.16 / 1.54, DCP-inter 2.24 / 2.06 / 1.97.

What the model needed, none of it fitted to these six figures (each has its own unit test in
``tests/test_calibration_mechanisms.py``):

* the published unit: the benchmark counts VAE latent positions before the 2x2 patch, ~3.96x the
  transformer tokens the model prices (``published_accounting``, from VideoSys ``train.py``);
* the published stack's speed: Open-Sora's own STDiT throughputs on H800 (gradient-checkpointed
  rows of its ``docs/acceleration.md``) run the compute 2.55x slower than the datasheet defaults
  (``measured_efficiency``);
* the published epoch: ``drop_last`` (bucket tails and rounds that cannot be filled are discarded,
  so DCP-inter's groups never run dry mid-round: +3-7% on its figures), and DCP-inter's profile
  ranking every batch by its time after the pyramid knapsack (``published_schedulers``: +22-31%, the
  largest single step, since small batches of short samples then run with few layers checkpointed);
* the per-sample text context (K/V projections of 300 T5 tokens in every cross-attention), which
  every rank of an SP group repeats (``analytic.context_seconds_per_sequence``: -7% / -6% on bucket
  parallel short-dominated / balanced, within +-3% elsewhere);
* the published SP's frame-axis sharding: VideoSys's STDiT3 splits the *latent frames* over the SP
  group, padded to a multiple of its size (``split_sequence(x, dim=1, pad=get_temporal_pad())``,
  ``set_temporal_pad``), so an image (one frame) at SP 4 is one real and three padded frames and
  every rank computes the whole image; 15 and 30 latent frames pad to 16 and 32
  (``published_accounting.frame_sharded_shape``, ``frame_sharded=True`` on the published
  schedulers: bucket parallel short-dominated 1.48 -> 0.68, balanced 1.43 -> 1.14, long-dominated
  1.49 -> 1.44; DCP-inter, which profiles images at SP 1, unchanged).

``benchmarks/results/simulate.md`` tabulates the calibration with each mechanism turned off in turn.

Reproduced within +-25%: all six figures (bucket parallel 0.68 / 1.14 / 1.44 vs 0.90 / 1.16 /
1.54, DCP-inter 2.08 / 2.00 / 1.99 vs 2.24 / 2.06 / 1.97) and the published ranking in every row.
Solving the three published bucket-parallel figures for the mixes' token shares, the published
baseline runs images at SP 4 2.6-4.5x slower per token than its videos; without the frame padding
the model ran a 144p image at SP 4 only 1.5x slower per token than a video, with it 4.3x
(``tests/test_calibration_mechanisms.py``). The short-dominated bucket-parallel figure is the
closest to the edge (-24%): the padding slightly overshoots what the figures imply there.
"""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from simulate import PUBLISHED_M_TOKENS_PER_S, published_setting  # noqa: E402

from dcp_compile.schedule.cost_model import CostModel, ModelProfile  # noqa: E402
from dcp_compile.schedule.hardware import Hardware  # noqa: E402
from dcp_compile.schedule.published_schedulers import DCPInterScheduler  # noqa: E402
from dcp_compile.variant import RecomputePolicy  # noqa: E402

DISTRIBUTIONS = tuple(PUBLISHED_M_TOKENS_PER_S)
OUT_OF_REACH: dict[tuple[str, str], str] = {}  # (distribution, scheduler) -> why; a strict xfail each


@pytest.fixture(scope="module")
def simulated() -> dict[str, dict[str, dict[str, float]]]:
    return {distribution: published_setting(distribution) for distribution in DISTRIBUTIONS}


def _cases():
    for distribution in DISTRIBUTIONS:
        for scheduler in ("bucket-parallel", "dcp-inter"):
            reason = OUT_OF_REACH.get((distribution, scheduler))
            marks = (pytest.mark.xfail(strict=True, reason=reason),) if reason else ()
            yield pytest.param(distribution, scheduler, marks=marks, id=f"{distribution}-{scheduler}")


@pytest.mark.parametrize("distribution,scheduler", list(_cases()))
def test_absolute_throughput_within_25_percent_of_published(simulated, distribution: str, scheduler: str) -> None:
    published = PUBLISHED_M_TOKENS_PER_S[distribution][scheduler]
    ours = simulated[distribution][scheduler]["m_tokens_per_s"]
    assert abs(ours / published - 1) <= 0.25, f"{distribution} {scheduler}: {ours:.2f} vs published {published:.2f}"


@pytest.mark.parametrize("distribution", DISTRIBUTIONS)
def test_published_ranking(simulated, distribution: str) -> None:
    row = simulated[distribution]
    assert row["dcp-inter"]["m_tokens_per_s"] > row["bucket-parallel"]["m_tokens_per_s"]


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
    profile = scheduler.profile_bucket(4320, 1000.0)
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
