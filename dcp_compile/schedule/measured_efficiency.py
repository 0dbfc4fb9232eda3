"""How fast the Open-Sora software stack really trains a STDiT, from Open-Sora's own published
measurements, as one factor on the cost model's compute terms.

The analytic model's default scale factors assume a well-tuned stack (matmuls at 60% of peak,
flash attention at 45%, memory-bound ops at 70%). A STDiT of width 1152 trained by Open-Sora's
code reaches far less: many small GEMMs, dozens of unfused elementwise ops per block (adaLN
modulate, gates, residuals, the spatial/temporal rearranges), the per-sample conditioning. The
Open-Sora project published what its stack measures (``docs/acceleration.md`` of
hpcaitech/Open-Sora, "Efficient STDiT": STDiT-XL/2 on 8 x H800, tokens/s/GPU), independently of
the DCP benchmark. :func:`stack_slowdown` prices those runs on our model and returns the
geometric mean of measured over predicted seconds; :func:`with_stack_slowdown` scales the
compute terms (linear, attention, memory) of a cost model by it. Communication and the per-layer
overhead keep their own constants (they are not the kernels this measures).

Only the gradient-checkpointed rows are used: every run of the DCP benchmark checkpoints
(``grad_checkpoint: True`` in all its configs), and the rows without checkpointing were measured
at small batches (their 16k-token row is slower per token than the 65k-token checkpointed one).
The measured model is Open-Sora 1.0's STDiT-XL/2, not v1.2's STDiT3: same width, heads, depth
and attention pattern, one MLP and one cross-attention per spatial+temporal block instead of
two; :func:`stdit_v1_profile` prices it with the same accounting as our STDiT3 preset.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Sequence

from .cost_model import CostModel
from .hardware import GB, Hardware
from .model_profile import ModelProfile, video_attention_span

COMPUTE_TERMS: tuple[str, ...] = ("linear", "attention", "memory")

# NVIDIA H800 SXM: the H100 SXM's compute and HBM (989 TFLOP/s dense bf16, 3.35 TB/s), NVLink
# cut to 400 GB/s (200 GB/s one way).
H800 = replace(Hardware.H100, name="H800", intra_node_bandwidth=200 * GB)


@dataclass(frozen=True)
class MeasuredThroughput:
    """One published training measurement: a video of ``frames`` x ``spatial_tokens`` tokens per
    sample on ``sp_size`` GPUs, ``recompute`` (``full``: every block checkpointed), in
    transformer tokens per second per GPU."""

    frames: int
    spatial_tokens: int
    sp_size: int
    recompute: str
    tokens_per_s_per_gpu: float
    source: str

    @property
    def tokens(self) -> int:
        return self.frames * self.spatial_tokens


_ACCELERATION_MD = "hpcaitech/Open-Sora docs/acceleration.md, 'Efficient STDiT' table (8 x H800)"
# "STDiT (GC) 64x512 (65k): 0.40 samples/s/GPU, 25k tokens/s/GPU" and "STDiT (GC, sp=2)
# 360x512 (370k): 0.10 samples/s/GPU, 18k tokens/s/GPU". Open-Sora 1.0's 2D VAE keeps the frames
# and downsamples 8x; the 2x2 patch gives 32 x 32 = 1024 tokens per 512 x 512 frame (the
# table's 65k = 64 x 1024).
OPEN_SORA_STDIT_H800: tuple[MeasuredThroughput, ...] = (
    MeasuredThroughput(64, 1024, 1, "full", 25e3, _ACCELERATION_MD),
    MeasuredThroughput(360, 1024, 2, "full", 18e3, _ACCELERATION_MD),
)


def stdit_v1_profile() -> ModelProfile:
    """Open-Sora 1.0's STDiT-XL/2 (the measured model): 28 blocks of width 1152, 16 heads, each a
    spatial self-attention, a cross-attention to 120 T5 tokens, a temporal self-attention and
    one MLP. Built as a 28-layer transformer with cross-attention, plus the temporal
    self-attention of each block (its q/k/v/out projections, its attention core, its share of
    the memory-bound traffic: what an attention sub-block keeps), as our STDiT3 preset counts
    them."""
    hidden = 1152
    base = ModelProfile.transformer(
        "stdit-xl/2 (Open-Sora 1.0)", num_layers=28, hidden_size=hidden, num_heads=16, ffn_hidden_size=4 * hidden,
        causal=False, cross_attention_tokens=120, output_channels=2 * 4 * 4,
    )
    temporal_flops = 28 * 2 * 4 * hidden * hidden
    attention_share = base.activation_bytes_per_token["none"] - base.activation_bytes_per_token["attention"]
    temporal_traffic = 28 * 2 * attention_share
    return replace(
        base,
        num_attention_layers=56,
        linear_flops_per_token=base.linear_flops_per_token + temporal_flops,
        attention_flops_per_token_key=2 * base.attention_flops_per_token_key,
        memory_traffic_bytes_per_token=base.memory_traffic_bytes_per_token + temporal_traffic,
    )


def predicted_tokens_per_s_per_gpu(cost_model: CostModel, record: MeasuredThroughput, batch_tokens: int = 1 << 17) -> float:
    """Our model's tokens/s/GPU for ``record``'s run, at a batch of about ``batch_tokens`` tokens
    (large enough that per-micro-batch fixed costs do not matter, as in a throughput run)."""
    batch = max(1, batch_tokens // record.tokens)
    span = video_attention_span(record.frames, record.spatial_tokens, 1)
    seconds = cost_model.time([record.tokens] * batch, record.sp_size, record.recompute, [span] * batch)
    return batch * record.tokens / (seconds * record.sp_size)


def stack_slowdown(
    records: Sequence[MeasuredThroughput] = OPEN_SORA_STDIT_H800, profile: ModelProfile | None = None,
    hardware: Hardware = H800,
) -> float:
    """Geometric mean over ``records`` of measured seconds per token over our model's (default
    scales): how much slower the measured stack runs the model's compute than the model assumes."""
    model = CostModel(profile or stdit_v1_profile(), hardware, optimizer_shards=8)
    ratios = [predicted_tokens_per_s_per_gpu(model, r) / r.tokens_per_s_per_gpu for r in records]
    return math.exp(sum(math.log(r) for r in ratios) / len(ratios))


def with_stack_slowdown(cost_model: CostModel, slowdown: float) -> CostModel:
    """``cost_model`` with its compute terms (linear, attention, memory-bound) ``slowdown`` times slower."""
    if slowdown <= 0:
        raise ValueError(f"slowdown must be positive, got {slowdown}")
    scales = {term: value * (slowdown if term in COMPUTE_TERMS else 1.0) for term, value in cost_model.scales.items()}
    return replace(cost_model, scales=scales)
