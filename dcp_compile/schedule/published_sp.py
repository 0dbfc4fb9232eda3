"""The published system's sequence parallelism as released, priced on the cost model.

The DCP release of VideoSys is one squashed commit, NUS-HPC-AI-Lab/VideoSys@09ad75e
(2024-12-10, "[feat] data centric parallel training (#234)"), the commit that adds the benchmark
configs the published figures come from. Its STDiT3 (``videosys/models/transformers/
open_sora_transformer_3d.py``) runs SP as DSP (dimension switching), not as head-scatter Ulysses:

* **Spatial sharding, spatial padding.** ``STDiT3.forward`` (after the patch embedding):
  ``set_pad("spatial", S, sp_group)`` then ``split_sequence(x, sp_group, dim=2, pad=get_pad(
  "spatial"))`` on ``x`` of shape ``[B, T, S, C]``: each rank keeps ``ceil(S / sp)`` of every
  frame's ``S`` spatial tokens, the last rank's share padded (``videosys/core/distributed/comm.py``,
  ``set_pad``: ``pad = (sp - S % sp) % sp``; ``_split_sequence_func`` concatenates the padding and
  splits). Everything token-local (norms, modulation, cross-attention queries, MLPs) and the
  **temporal** blocks run on that share: ``STDiT3Block.forward`` with ``self.temporal`` rearranges
  ``B (T S) C -> (B S) T C`` and attends over all ``T`` frames of its own spatial positions, with
  no communication.
* **Spatial attention through a padded all-to-all.** A spatial block needs whole frames, so
  ``STDiT3Block.forward`` calls ``dynamic_switch(x_m, S, T, to_spatial_shard=False)`` before
  ``self.attn`` and ``dynamic_switch(..., to_spatial_shard=True)`` after it: an
  ``all_to_all_with_pad`` (``comm.py``) that scatters the frames (``scatter_pad=get_pad(
  "temporal")``: ``T`` padded to a multiple of ``sp`` with zeros) and gathers the spatial tokens
  (trimmed back to ``S``), and its inverse. The attention sub-block (``OpenSoraAttention``: the
  ``qkv`` projection, the attention core, ``proj``) runs on ``ceil(T / sp)`` whole frames per rank,
  padded frames included; the two all-to-alls move the padded ``[B, T_pad, ceil(S/sp), C]`` tensor.
  (Issue 21's summary puts the switch on the temporal attention; the code puts it on the spatial
  one, since the resting layout is spatially sharded. Modelled as the code does it.)
* **Images switch over the batch.** For ``T == 1`` (``is_image = T == 1``) ``dynamic_switch``
  scatters the batch instead of the frames (``scatter_dim = 0``, ``scatter_pad = get_pad("batch")``
  with ``set_pad("batch", x.shape[0], sp_group)``): each rank runs the spatial attention of
  ``ceil(B / sp)`` whole images, the batch padded to a multiple of ``sp`` with zero images. The
  temporal attention of an image is one key long and is skipped (``OpenSoraAttention.forward``,
  ``videosys/models/modules/attentions.py``: ``if N == 1: x = v``); its projections still run.

The older code this replaces (frame-axis sharding, ``split_sequence(x, dim=1,
pad=get_temporal_pad())``, an image at SP 4 computed whole on every rank) is from cd7ac04
(2024-09-25) and is not what the DCP release runs.

Priced here (:func:`published_terms`): the cost model's own per-token and per-token-key
coefficients at SP 1 (so any :class:`~.cost_model.CostModel`, analytic or profiled, sets the
speed) applied to what one rank computes (:class:`RankShare`), plus the switches' all-to-alls on
the cost model's hardware. Left out, each small at the benchmark's shapes: the final
``gather_sequence`` (one all-gather per micro-batch, against 112-168 all-to-alls) and the final
layer on the gathered output (a 1152 x 32 projection: under 0.01% of the FLOPs); peak memory is
priced unpadded (the spatial padding is at most ``sp - 1`` of a frame's 144-3600 tokens).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

from dcp_compile.variant import RecomputePolicy, resends_collectives

from .analytic import COST_TERMS, context_seconds_per_sequence
from .cost_model import CostModel
from .model_profile import ModelProfile

RELEASE = "NUS-HPC-AI-Lab/VideoSys@09ad75e (2024-12-10)"


def padded(size: int, sp_size: int) -> int:
    """``size`` rounded up to a multiple of ``sp_size``, as ``comm.py: set_pad`` pads a dimension
    (``pad = (sp - size % sp) % sp``) before splitting or scattering it."""
    return size + (sp_size - size % sp_size) % sp_size


@dataclass(frozen=True)
class VideoShape:
    """A sample's latent grid as the transformer sees it: ``frames`` x ``spatial_tokens``."""

    frames: int
    spatial_tokens: int

    @property
    def tokens(self) -> int:
        return self.frames * self.spatial_tokens

    @classmethod
    def from_length_span(cls, length: int, span: float) -> "VideoShape | None":
        """Read ``T`` and ``S`` back from a sample's length ``T * S`` and its span ``(T + S) / 2``
        (:func:`.model_profile.video_attention_span`, ``T <= S``); None when the span is not of
        that form (full attention, text)."""
        discriminant = span * span - length
        if discriminant < 0:
            return None
        frames = round(span - math.sqrt(discriminant))
        if frames < 1 or length % frames:
            return None
        shape = cls(frames, length // frames)
        if abs((shape.frames + shape.spatial_tokens) / 2 - span) > 1e-9 * span:
            return None
        return shape


@dataclass(frozen=True)
class RankShare:
    """What one rank of an SP group computes for one micro-batch under the released SP.

    ``local_tokens``: positions of the spatially sharded layout (``B * T * ceil(S / sp)``): the
    token-local work, the cross-attentions and the temporal blocks run on them.
    ``spatial_rows``: positions entering each spatial attention sub-block after the switch
    (``B * ceil(T / sp) * S``; images ``ceil(B / sp) * S``), padding included.
    ``spatial_token_keys`` / ``temporal_token_keys``: (query, key) pairs of one spatial / one
    temporal attention layer. ``switch_elements``: positions of the tensor one rank hands to one
    switch all-to-all (times the hidden width in bytes). ``samples``: real samples (each pays its
    text context once per rank).
    """

    local_tokens: int
    spatial_rows: int
    spatial_token_keys: float
    temporal_token_keys: float
    switch_elements: int
    samples: int


def rank_share(shapes: Sequence[VideoShape], sp_size: int) -> RankShare:
    """One rank's share of a micro-batch of ``shapes`` on ``sp_size`` ranks (see the module
    docstring for the code each line follows). The released model takes one ``[B, C, T, H, W]``
    tensor, so a batch has one shape; a micro-batch of several shapes is priced as one batch per
    shape (the images of each shape padded together)."""
    if sp_size < 1:
        raise ValueError(f"sp_size must be >= 1, got {sp_size}")
    local = rows = switch = 0
    spatial_keys = temporal_keys = 0.0
    for shape, batch in _batches(shapes).items():
        frames, spatial = shape.frames, shape.spatial_tokens
        spatial_share = padded(spatial, sp_size) // sp_size  # split_sequence(dim=2, pad=get_pad("spatial"))
        local += batch * frames * spatial_share
        if sp_size == 1:
            shape_rows = batch * frames * spatial
        elif frames == 1:  # dynamic_switch(is_image=True): the batch is scattered, padded to the SP size
            shape_rows = padded(batch, sp_size) // sp_size * spatial
            switch += padded(batch, sp_size) * spatial_share
        else:  # dynamic_switch: the frames are scattered, padded to the SP size
            shape_rows = batch * padded(frames, sp_size) // sp_size * spatial
            switch += batch * padded(frames, sp_size) * spatial_share
        rows += shape_rows
        spatial_keys += shape_rows * spatial
        if frames > 1:  # OpenSoraAttention.forward: ``if N == 1: x = v`` (no attention core)
            temporal_keys += batch * frames * spatial_share * frames
    return RankShare(local, rows, spatial_keys, temporal_keys, switch, len(shapes))


def _batches(shapes: Sequence[VideoShape]) -> dict[VideoShape, int]:
    counts: dict[VideoShape, int] = {}
    for shape in shapes:
        counts[shape] = counts.get(shape, 0) + 1
    return counts


@dataclass(frozen=True)
class STDiT3Layout:
    """Where STDiT3's work sits, from its profile: ``spatial_blocks`` of the ``attention_layers``
    (28 of 56) switch layouts; ``projection_share`` is the part of the per-token matmul FLOPs in
    the spatial blocks' self-attention projections (``qkv`` and ``proj``), which run on the
    switched rows; the rest runs on the rank's local tokens."""

    spatial_blocks: int
    attention_layers: int
    hidden_size: int
    projection_share: float

    @classmethod
    def from_profile(cls, profile: ModelProfile) -> "STDiT3Layout":
        if profile.num_attention_layers % 2:
            raise ValueError(
                f"{profile.name}: the released SP alternates spatial and temporal blocks; "
                f"got {profile.num_attention_layers} attention layers (an odd number)"
            )
        spatial = profile.num_attention_layers // 2
        h = profile.hidden_size
        kv_width = profile.head_dim * profile.num_kv_heads
        projection_flops = spatial * 2 * (h * h + 2 * h * kv_width + h * h)
        return cls(spatial, profile.num_attention_layers, h, projection_flops / profile.linear_flops_per_token)


def published_terms(
    cost_model: CostModel, lengths: Sequence[int], spans: Sequence[float], sp_size: int,
    recompute: RecomputePolicy | str,
) -> dict[str, float]:
    """Scaled seconds per cost term of one micro-batch as the released SP computes it on each rank
    of an ``sp_size`` group. A sample whose span is not a video's is priced by the cost model as
    is (no released-SP layout applies to it)."""
    recompute = RecomputePolicy.parse(recompute)
    shapes = [VideoShape.from_length_span(n, s) for n, s in zip(lengths, spans)]
    if not lengths or any(shape is None for shape in shapes):
        return cost_model.terms(lengths, sp_size, recompute, spans)
    share = rank_share(shapes, sp_size)  # type: ignore[arg-type]
    layout = STDiT3Layout.from_profile(cost_model.profile)
    raw = cost_model.raw_term_coefficients(1, recompute)  # per position of one rank's work
    scales = cost_model.scales
    linear_tokens = (1 - layout.projection_share) * share.local_tokens + layout.projection_share * share.spatial_rows
    # The profile's per-token-key FLOPs sum over all attention layers, half spatial, half temporal.
    token_keys = (share.spatial_token_keys + share.temporal_token_keys) * layout.spatial_blocks / layout.attention_layers
    context = context_seconds_per_sequence(cost_model.profile, cost_model.hardware, recompute) * share.samples
    terms = {
        "linear": raw["linear"][1] * linear_tokens + context,
        "attention": raw["attention"][2] * token_keys,
        "memory": raw["memory"][0] + raw["memory"][1] * share.local_tokens,
        "communication": switch_seconds(cost_model, share, sp_size, recompute),
        "overhead": raw["overhead"][0],
    }
    assert set(terms) == set(COST_TERMS)
    return {term: scales[term] * value for term, value in terms.items()}


def switch_seconds(cost_model: CostModel, share: RankShare, sp_size: int, recompute: RecomputePolicy) -> float:
    """Unscaled seconds of the switches' all-to-alls: two per spatial block (into and out of the
    attention), forward and backward; a whole-block-checkpointed block (``block``, or
    ``collectives_recomputed`` under ``full``: the published ``auto_recompute`` wraps each block in
    ``torch.utils.checkpoint``) sends its forward two again."""
    if sp_size <= 1 or not share.switch_elements:
        return 0.0
    hardware = cost_model.hardware
    passes = 3 if resends_collectives(recompute, cost_model.collectives_recomputed) else 2
    calls = 2 * passes * STDiT3Layout.from_profile(cost_model.profile).spatial_blocks
    bytes_per_call = share.switch_elements * cost_model.profile.hidden_size * cost_model.profile.activation_dtype_bytes
    return calls * (hardware.all_to_all_latency(sp_size) + bytes_per_call * hardware.all_to_all_seconds_per_byte(sp_size))


def published_time(
    cost_model: CostModel, lengths: Sequence[int], spans: Sequence[float], sp_size: int,
    recompute: RecomputePolicy | str,
) -> float:
    """Seconds of one micro-batch on each rank of an ``sp_size`` group under the released SP."""
    if not lengths:
        return 0.0
    return sum(published_terms(cost_model, lengths, spans, sp_size, recompute).values())
