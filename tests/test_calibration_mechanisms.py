"""One test per mechanism the calibration against the published DCP figures rests on
(``tests/test_simulator_calibration.py``): the published token unit, the per-sample text context,
the published ``drop_last`` epoch, DCP-inter's profile ranked after the pyramid knapsack, and the
released SP's layout (VideoSys 09ad75e, ``published_sp``: spatial shards padded to the SP size,
spatial attention after a padded all-to-all switch over the frames, images switched over the
padded batch). Each test checks the mechanism itself, never a published figure. Small inputs:
the whole file runs in seconds."""

from __future__ import annotations

import math
import sys
from collections import Counter
from dataclasses import replace
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from planner import FRAMES, RESOLUTIONS, opensora_workload, video_shape  # noqa: E402

from dcp_compile.schedule.analytic import context_seconds_per_sequence  # noqa: E402
from dcp_compile.schedule.cost_model import CostModel, ModelProfile  # noqa: E402
from dcp_compile.schedule.hardware import Hardware  # noqa: E402
from dcp_compile.schedule.model_profile import video_attention_span  # noqa: E402
from dcp_compile.schedule.published_accounting import published_tokens, transformer_tokens  # noqa: E402
from dcp_compile.schedule.published_schedulers import BucketParallelScheduler, DCPInterScheduler  # noqa: E402
from dcp_compile.schedule.published_sp import (  # noqa: E402
    STDiT3Layout,
    VideoShape,
    padded,
    published_terms,
    published_time,
    rank_share,
)

STDIT3 = ModelProfile.from_config("stdit3-xl/2")


# --------------------------------------------------------------------------- token unit
def test_published_tokens_are_latent_positions() -> None:
    # 720p, 408 frames: 120 latent frames of 90 x 160 latent positions; the transformer sees 45 x 80 per frame.
    assert published_tokens(408, 720, 1280) == 120 * 90 * 160
    assert transformer_tokens(408, 720, 1280) == 120 * 45 * 80 == 432_000
    # 240p image: 30 x 53 latent positions (426 // 8), 15 x 27 patches (the odd width is padded).
    assert published_tokens(1, 240, 426) == 1590
    assert transformer_tokens(1, 240, 426) == 405
    for resolution, (height, width) in RESOLUTIONS.items():
        for frames in FRAMES:
            assert transformer_tokens(frames, height, width) == math.prod(video_shape(resolution, frames))
            assert 3.9 <= published_tokens(frames, height, width) / transformer_tokens(frames, height, width) <= 4.0


# --------------------------------------------------------------------------- per-sample context
def test_text_context_is_priced_per_sample_on_every_rank() -> None:
    model = CostModel(STDIT3, Hardware.H100, optimizer_shards=32)
    # 56 cross-attentions, K and V projections of 300 tokens of width 1152: ~89 GFLOP forward per sample.
    assert STDIT3.context_flops_per_sequence == pytest.approx(56 * 2 * 2 * 1152**2 * 300)
    per_sample = {sp: model.time_coefficients(sp, "full").per_sequence for sp in (1, 2, 4, 8)}
    assert len(set(per_sample.values())) == 1 and per_sample[1] > 0  # not divided by the SP size
    assert model.time_coefficients(1, "none").per_sequence < per_sample[1]  # recomputed under full
    # It is separable: n samples pay n times, whatever their lengths.
    coefficients = model.time_coefficients(4, "full")
    lengths = [144] * 64
    expected = coefficients.fixed + coefficients.per_token * sum(lengths) + coefficients.per_token_key * sum(
        n * 72.5 for n in lengths) + coefficients.per_sequence * len(lengths)
    assert model.time(lengths, 4, "full", [72.5] * 64) == pytest.approx(expected)
    # A 144p image at SP 4 (36 tokens per rank): the text costs about as much as the image itself.
    image = model.time([144] * 1024, 4, "full", [72.5] * 1024) - 1024 * per_sample[4]
    assert 0.5 < 1024 * per_sample[4] / image < 1.5
    # A model without a context pays nothing per sample.
    llama = CostModel(ModelProfile.from_config("llama-3-8b"), Hardware.H200)
    assert llama.time_coefficients(4, "full").per_sequence == 0.0
    assert context_seconds_per_sequence(llama.profile, llama.hardware, "full") == 0.0


# --------------------------------------------------------------------------- the published epoch
@pytest.fixture(scope="module")
def workload():
    # 8000 videos: at the datasheet speed DCP-inter's profiled batches are large enough that the
    # min 15 accumulation cannot be fed from a 2000-video epoch (everything would be dropped).
    return opensora_workload("video balanced", 2, num_videos=8000)


def test_dcp_inter_drop_last_groups_never_run_dry(workload) -> None:
    """With ``drop_last`` every group of a round runs exactly its accumulation count of full
    profiled batches (the published sampler removes groups whose bucket cannot feed them); what
    is not trained is reported as dropped."""
    model = CostModel(STDIT3, Hardware.H100, optimizer_shards=32)
    scheduler = DCPInterScheduler(model, 32, max_accumulation=5, min_accumulation=15, drop_last=True)
    schedule = scheduler.schedule(workload.lengths, workload.spans)
    schedule.validate(len(workload.lengths))
    assert 0 < len(schedule.dropped) < len(workload.lengths)  # min 15 accumulation drops much of the epoch
    spans: dict[int, float] = {}  # a bucket is a length; its span is its members' largest
    for length, span in zip(workload.lengths, workload.spans):
        spans[length] = max(span, spans.get(length, 0.0))
    profiles = {length: scheduler.profile_bucket(length, span) for length, span in spans.items()}
    for round_index in {mb.round for mb in schedule.microbatches}:
        members = [mb for mb in schedule.microbatches if mb.round == round_index]
        per_group = Counter(mb.first_rank for mb in members)
        groups = sorted({(mb.first_rank, mb.sp_size, workload.lengths[mb.positions[0]]) for mb in members}, key=lambda g: g[0])
        assert sum(sp for _, sp, _ in groups) == 32  # every GPU busy
        for mb in members:
            assert len(mb.positions) == profiles[workload.lengths[mb.positions[0]]].batch_size
        times = [profiles[length].time for _, _, length in groups]
        counts = scheduler.accumulation_counts(times, 5, 15)
        assert [per_group[first] for first, _, _ in groups] == counts


def test_bucket_parallel_drop_last_runs_whole_rounds_of_whole_batches(workload) -> None:
    model = CostModel(STDIT3, Hardware.H100, optimizer_shards=32)
    scheduler = BucketParallelScheduler(model, 32, max(workload.lengths), sp_size=4, drop_last=True)
    schedule = scheduler.schedule(workload.lengths, workload.spans)
    schedule.validate(len(workload.lengths))
    rounds = Counter(mb.round for mb in schedule.microbatches)
    assert set(rounds.values()) == {8}  # 8 groups of 4 in every round
    sizes = {}
    for mb in schedule.microbatches:
        sizes.setdefault(workload.lengths[mb.positions[0]], set()).add(len(mb.positions))
    assert all(len(batch_sizes) == 1 for batch_sizes in sizes.values())  # no ragged tail batch
    kept = BucketParallelScheduler(model, 32, max(workload.lengths), sp_size=4).schedule(workload.lengths, workload.spans)
    assert kept.dropped == [] and len(schedule.dropped) > 0


# --------------------------------------------------------------------------- pyramid in the profile
@pytest.mark.parametrize("length,span", [(144, 72.5), (4320, 1000.0), (54_000, 1807.5)])
def test_dcp_inter_profile_ranks_batches_after_the_knapsack(length: int, span: float) -> None:
    """The published profiler runs the pyramid knapsack on every batch it tries and keeps the
    best samples per GPU-second after it: never worse than ranking by fully checkpointed time."""
    model = CostModel(STDIT3, Hardware.H100, optimizer_shards=32)
    pyramid = DCPInterScheduler(model, 32, pyramid_recompute=True)
    plain = DCPInterScheduler(model, 32, pyramid_recompute=False)
    chosen = pyramid.profile_bucket(length, span)
    assert chosen.time == pytest.approx(pyramid.profiled_time(length, span, chosen.sp_size, chosen.batch_size))
    full_checkpointed = plain.profile_bucket(length, span)
    after_knapsack = pyramid.profiled_time(length, span, full_checkpointed.sp_size, full_checkpointed.batch_size)
    assert chosen.batch_size / (chosen.sp_size * chosen.time) >= full_checkpointed.batch_size / (
        full_checkpointed.sp_size * after_knapsack) - 1e-12
    # The ablation that ranks batches fully checkpointed profiles like the plain scheduler.
    ablated = DCPInterScheduler(model, 32, pyramid_recompute=True, pyramid_in_profile=False)
    assert ablated.profile_bucket(length, span) == full_checkpointed
    # The knapsack only spends memory the batch leaves under the cap.
    unchecked = pyramid.uncheckpointed_layers(chosen)
    tokens = [length] * chosen.batch_size
    full = pyramid.cost_model.peak_memory(tokens, chosen.sp_size, "full")
    none = pyramid.cost_model.peak_memory(tokens, chosen.sp_size, "none")
    assert full + unchecked * (none - full) / STDIT3.num_layers <= pyramid.memory_cap + 1e-6


# --------------------------------------------------------------------------- the released SP (VideoSys 09ad75e)
def test_pad_to_the_sp_size_like_set_pad() -> None:
    """``comm.py: set_pad``: ``pad = (sp - size % sp) % sp``."""
    assert [padded(n, 4) for n in (1, 4, 15, 30, 60, 144, 405)] == [4, 4, 16, 32, 60, 144, 408]
    assert [padded(n, 8) for n in (6, 60, 1620)] == [8, 64, 1624]
    assert padded(405, 1) == 405


@pytest.mark.parametrize("frames,height,width", [(1, 9, 16), (15, 15, 27), (30, 23, 40), (120, 45, 80)])
def test_video_shape_reads_frames_and_spatial_tokens_back(frames, height, width) -> None:
    span = video_attention_span(frames, height, width)
    assert VideoShape.from_length_span(frames * height * width, span) == VideoShape(frames, height * width)


def test_full_attention_samples_have_no_video_shape() -> None:
    for length in (2, 144, 4096, 100_000):
        assert VideoShape.from_length_span(length, float(length)) is None


def test_spatial_sharding_pads_each_frames_tokens_and_switches_over_padded_frames() -> None:
    """240p x 51 frames (15 latent frames of 15 x 27 = 405 tokens) at SP 4: each rank keeps
    ceil(405 / 4) = 102 tokens of every frame (``split_sequence(dim=2, pad=get_pad("spatial"))``);
    the spatial attention runs on 16 / 4 = 4 whole frames (``dynamic_switch`` scatters the frames
    padded to 16); the temporal attention attends over the 15 frames of the rank's positions."""
    share = rank_share([VideoShape(15, 405)] * 2, 4)
    assert share.local_tokens == 2 * 15 * 102
    assert share.spatial_rows == 2 * 4 * 405
    assert share.spatial_token_keys == 2 * 4 * 405 * 405
    assert share.temporal_token_keys == 2 * 15 * 102 * 15
    assert share.switch_elements == 2 * 16 * 102  # the padded [B, T_pad, S / sp] tensor each rank sends
    assert share.samples == 2


def test_images_at_sp4_switch_over_the_padded_batch() -> None:
    """Six 144p images (1 x 144 tokens) at SP 4: spatially sharded like videos (36 tokens each per
    rank); the spatial attention switch scatters the batch (``dynamic_switch(is_image=True)``,
    ``get_pad("batch")``: 6 padded to 8), so each rank attends over 2 whole images; an image's
    temporal attention is one key long and skipped (``if N == 1: x = v``)."""
    share = rank_share([VideoShape(1, 144)] * 6, 4)
    assert share.local_tokens == 6 * 36
    assert share.spatial_rows == 2 * 144
    assert share.spatial_token_keys == 2 * 144 * 144
    assert share.temporal_token_keys == 0
    assert share.switch_elements == 8 * 36
    # A batch that divides by the SP size wastes nothing: per rank a quarter of the images' work.
    even = rank_share([VideoShape(1, 144)] * 8, 4)
    assert even.spatial_rows * 4 == 8 * 144 and even.local_tokens * 4 == 8 * 144


def test_sp1_is_the_cost_model_for_videos() -> None:
    """At SP 1 nothing is split or switched: the released layout prices a video exactly as the
    cost model does (the split of the work between local tokens and switched rows is exact)."""
    model = replace(CostModel(STDIT3, Hardware.H100, optimizer_shards=32), collectives_recomputed=True)
    lengths = [15 * 405] * 3 + [60 * 1620]
    spans = [video_attention_span(15, 15, 27)] * 3 + [video_attention_span(60, 30, 54)]
    for policy in ("full", "none"):
        assert published_time(model, lengths, spans, 1, policy) == pytest.approx(model.time(lengths, 1, policy, spans))


def test_released_sp_pads_only_where_shapes_do_not_divide() -> None:
    """With no padding (720p x 408 frames: 120 latent frames of 3600 tokens at SP 4) a rank
    computes exactly a quarter of the work; with padded frames (15 at SP 4) the spatial attention
    sub-blocks compute 16 / 15 of it."""
    model = CostModel(STDIT3, Hardware.H100, optimizer_shards=32)
    layout = STDiT3Layout.from_profile(STDIT3)
    assert layout.spatial_blocks == 28 and 0.1 < layout.projection_share < 0.2
    whole = published_terms(model, [120 * 3600], [video_attention_span(120, 45, 80)], 1, "full")
    quarter = published_terms(model, [120 * 3600], [video_attention_span(120, 45, 80)], 4, "full")
    context = model.scales["linear"] * context_seconds_per_sequence(STDIT3, model.hardware, "full")
    assert quarter["linear"] - context == pytest.approx((whole["linear"] - context) / 4)
    assert quarter["attention"] == pytest.approx(whole["attention"] / 4)
    short = rank_share([VideoShape(15, 405)], 4)
    assert short.spatial_rows / (15 * 405 / 4) == pytest.approx(16 / 15)


def test_switch_all_to_alls_two_per_spatial_block_per_pass() -> None:
    """Two all-to-alls per spatial block (into and out of the attention), none in the temporal
    blocks; forward and backward, and the forward's again when a block is checkpointed whole."""
    base = CostModel(STDIT3, Hardware.H100, optimizer_shards=32)
    shape = VideoShape(60, 1620)
    share = rank_share([shape], 4)
    bytes_per_call = share.switch_elements * STDIT3.hidden_size * STDIT3.activation_dtype_bytes
    per_call = base.hardware.all_to_all_latency(4) + bytes_per_call * base.hardware.all_to_all_seconds_per_byte(4)
    span = video_attention_span(60, 30, 54)
    for recomputed, policy, passes in ((False, "full", 2), (True, "full", 3), (True, "none", 2)):
        model = replace(base, collectives_recomputed=recomputed)
        sent = published_terms(model, [shape.tokens], [span], 4, policy)["communication"]
        assert sent == pytest.approx(model.scales["communication"] * 2 * passes * 28 * per_call)
    # Ulysses (our compiler) sends q, k, v and out in all 56 attention layers: 4x the calls, and more bytes.
    ulysses = base.terms([shape.tokens], 4, "full", [span])["communication"]
    assert ulysses > 3 * published_terms(base, [shape.tokens], [span], 4, "full")["communication"]


def test_published_schedulers_price_the_released_sp_when_asked() -> None:
    model = CostModel(STDIT3, Hardware.H100, optimizer_shards=32)
    released = BucketParallelScheduler(model, 32, 10**6, sp_size=4, released_sp=True)
    ulysses = BucketParallelScheduler(model, 32, 10**6, sp_size=4)
    lengths, spans = [144] * 6, [video_attention_span(1, 9, 16)] * 6
    assert released.computed_time(lengths, spans, 4, "full") == pytest.approx(
        published_time(released.cost_model, lengths, spans, 4, "full"))
    assert ulysses.computed_time(lengths, spans, 4, "full") == pytest.approx(
        released.cost_model.time(lengths, 4, "full", spans))
    # Text (no video shape) is priced by the cost model as is.
    assert released.computed_time([4096], [4096.0], 4, "full") == pytest.approx(
        ulysses.computed_time([4096], [4096.0], 4, "full"))
