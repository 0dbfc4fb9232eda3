"""How the published DCP benchmark counts tokens, so simulated throughput can be compared with it.

The published training loop (VideoSys ``examples/training/open_sora/train.py``, the line
``local_token_counter += x.shape[0] * x.shape[2] * x.shape[3] * x.shape[4] / sp_size``) counts
the positions of the VAE latent ``x`` of shape ``[B, C, T, H/8, W/8]``, *before* the model's
``(1, 2, 2)`` patch embedding. The transformer sees one token per 2 x 2 latent positions, so the
published "tokens/s" is about four times the transformer tokens/s that our cost model and
sampler count (exactly ``T * (H/8) * (W/8)`` against ``T * ceil(H/16) * ceil(W/16)``; the
padding of odd latent widths makes the ratio 3.9-4.0). This is a unit, not an efficiency:
nothing here is fitted.
"""

from __future__ import annotations

import math

VAE_SPATIAL_DOWNSAMPLE = 8  # Open-Sora v1.2's VAE: 8x in height and width
PATCH_SIZE = (1, 2, 2)  # STDiT3-XL/2's patch embedding over (time, height, width) of the latent


def latent_frames(frames: int) -> int:
    """Latent frames of a clip as the published dummy dataset makes them (``frames * 5 // 17``;
    an image stays one frame)."""
    return 1 if frames == 1 else frames * 5 // 17


def published_tokens(frames: int, height: int, width: int) -> int:
    """Tokens of one sample as the published benchmark counts them: latent positions."""
    return latent_frames(frames) * (height // VAE_SPATIAL_DOWNSAMPLE) * (width // VAE_SPATIAL_DOWNSAMPLE)


def transformer_tokens(frames: int, height: int, width: int) -> int:
    """Tokens the transformer sees (what the cost model prices): latent positions per patch."""
    t, h, w = PATCH_SIZE
    down = VAE_SPATIAL_DOWNSAMPLE
    return (
        math.ceil(latent_frames(frames) / t) * math.ceil(height / (down * h)) * math.ceil(width / (down * w))
    )


def frame_sharded_shape(length: int, span: float, sp_size: int) -> tuple[int, float]:
    """(tokens, span) a sample computes on each rank's share when the published STDiT3 runs it
    on ``sp_size`` ranks: VideoSys shards the *frame* axis (``split_sequence(x, dim=1,
    pad=get_temporal_pad())`` in ``STDiT3.forward``; ``set_temporal_pad``: ``pad = (sp - T % sp)
    % sp``), so the latent frames are padded to a multiple of the SP size and the padded frames
    are computed like real ones in every block (the temporal blocks' ``dynamic_switch`` all-to-all
    gathers them back along time). An image (1 frame) at SP 4 becomes 4 frames, one per rank:
    each rank computes the whole image; 15 and 30 latent frames (51 and 102 frames) pad to 16 and
    32 at SP 4. Padded positions are not counted as trained tokens (the published counter reads
    the latent before padding).

    The sample's frames ``T`` and tokens per frame ``S`` are read back from its length ``T * S``
    and its spatial-temporal span ``(T + S) / 2`` (:func:`.model_profile.video_attention_span`),
    ``T <= S``; a sample whose span is not of that form (full attention, text) is returned
    unchanged. The spatial padding of the temporal blocks (``S`` to a multiple of the SP size: at
    most ``sp - 1`` positions of a frame's hundreds) is left out.
    """
    if sp_size <= 1:
        return length, span
    discriminant = span * span - length
    if discriminant < 0:
        return length, span
    frames = round(span - math.sqrt(discriminant))
    if frames < 1 or length % frames:
        return length, span
    per_frame = length // frames
    if abs((frames + per_frame) / 2 - span) > 1e-9 * span:
        return length, span
    padded = -(-frames // sp_size) * sp_size
    return padded * per_frame, (padded + per_frame) / 2
