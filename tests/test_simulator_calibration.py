"""The simulator on the published system's own setting, against its published figures.

Open-Sora v1.2 STDiT3-XL/2 (1.1B) on 32 H100 (4 nodes of 8), the three Zipf video mixes; bucket
parallel at SP 4 with per-bucket batches from its profile, DCP-inter with the published bounds
(max 5 / min 15 accumulation) and pyramid recompute; each scheduler at its own batch with a
gradient sync after every round (``benchmarks/simulate.py: published_setting``). Published, in M
tokens/s: bucket parallel 0.90 / 1.16 / 1.54, DCP-inter 2.24 / 2.06 / 1.97.

What the calibrated-from-datasheet model (H100 peak numbers, matmuls at 60% of peak, attention 45%,
memory-bound ops 70%, NCCL 70%; no per-row fitting) reproduces, and what it does not:

* bucket parallel short-dominated (0.92) and balanced (0.87, -25%) are within +-25%;
* bucket parallel long-dominated (0.87 vs 1.54) and every DCP-inter figure (0.74-0.79 vs
  1.97-2.24) are out of reach, and so is the published ranking. The nameable reason: in the
  analytic model a token costs nearly the same at every length and SP size (compute-bound; the
  NVLink all-to-all at SP 4 adds 10-15%), so neither published trend can appear. DCP-inter's
  published 2.24M tokens/s is 70k tokens/s per GPU, which needs >= 46% MFU on matmuls alone at
  100% utilisation; our model's SP 1 without any recompute reaches 55k at 100% utilisation, and
  DCP-inter loses a further 35-40% to idle groups under the 1.2/1.0 penalty search with min 15
  accumulation. Reproducing the published gap would need per-micro-batch inefficiencies the
  model does not price (launch-bound small images at SP 4, realised all-to-all bandwidth of small
  messages, the published token counting, if it counts latent positions before the 2x2 patch:
  x4). Those rows are strict xfails: a change that makes them pass must update this file.
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
from dcp_compile.schedule.published_schedulers import BucketProfile, DCPInterScheduler  # noqa: E402
from dcp_compile.variant import RecomputePolicy  # noqa: E402

DISTRIBUTIONS = tuple(PUBLISHED_M_TOKENS_PER_S)
REACHED = {("video short-dominated", "bucket-parallel"), ("video balanced", "bucket-parallel")}
OUT_OF_REACH = (
    "the analytic model prices a token nearly alike at every length and SP size (see the module "
    "docstring); the published gap needs per-micro-batch inefficiencies it does not model"
)


@pytest.fixture(scope="module")
def simulated() -> dict[str, dict[str, dict[str, float]]]:
    return {distribution: published_setting(distribution) for distribution in DISTRIBUTIONS}


def _cases():
    for distribution in DISTRIBUTIONS:
        for scheduler in ("bucket-parallel", "dcp-inter"):
            marks = () if (distribution, scheduler) in REACHED else (pytest.mark.xfail(strict=True, reason=OUT_OF_REACH),)
            yield pytest.param(distribution, scheduler, marks=marks, id=f"{distribution}-{scheduler}")


@pytest.mark.parametrize("distribution,scheduler", list(_cases()))
def test_absolute_throughput_within_25_percent_of_published(simulated, distribution: str, scheduler: str) -> None:
    published = PUBLISHED_M_TOKENS_PER_S[distribution][scheduler]
    ours = simulated[distribution][scheduler]["m_tokens_per_s"]
    assert abs(ours / published - 1) <= 0.25, f"{distribution} {scheduler}: {ours:.2f} vs published {published:.2f}"


@pytest.mark.parametrize("distribution", [pytest.param(d, marks=pytest.mark.xfail(strict=True, reason=OUT_OF_REACH)) for d in DISTRIBUTIONS])
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
    # A profile that fills the cap leaves no room: every layer stays checkpointed.
    crowded = BucketProfile(profile.length, profile.span, profile.sp_size,
                            int(profile.batch_size * scheduler.memory_cap / full) + 1, profile.time, profile.recompute)
    assert scheduler.uncheckpointed_layers(replace(crowded, batch_size=crowded.batch_size)) == 0
