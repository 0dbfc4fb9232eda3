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

