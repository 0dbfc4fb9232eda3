"""The analytic model: seconds and bytes of one micro-batch from a profile and a hardware record.

Every term is *separable* over the sequences of a micro-batch::

    time(lengths, sp, recompute) = fixed(sp, recompute)
                                   + per_token(sp, recompute) * sum(lengths)
                                   + per_token_key(sp, recompute) * sum(length * span)

``span`` is the number of keys a query attends to (see :mod:`.cost_model`); ``fixed`` is what a
micro-batch pays however few tokens it has (kernel launches, all-to-all latency, reading the
weights). Peak memory is ``static + bytes_per_token * sum(lengths)`` (flash/varlen attention
keeps no quadratic buffer; the ring's block attention builds one, which is not priced). The
terms here are peak-rate seconds, before the scale factors
(inverse efficiencies) that :class:`~.cost_model.CostModel` applies and calibration fits.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING, Sequence

from dcp_compile.variant import RecomputePolicy, resends_collectives

from .attention_communication import attention_communication
from .hardware import Hardware

if TYPE_CHECKING:
    from .model_profile import ModelProfile

COST_TERMS: tuple[str, ...] = ("linear", "attention", "memory", "communication", "overhead")

# Inverse efficiencies before calibration: typical fractions of peak that bf16 training reaches
# (matmuls ~60%, flash attention ~45%, memory-bound ops ~70%, NCCL all-to-all ~70%).
DEFAULT_SCALES: dict[str, float] = {
    "linear": 1 / 0.60,
    "attention": 1 / 0.45,
    "memory": 1 / 0.70,
    "communication": 1 / 0.70,
    "overhead": 1.0,
}
FLASH_BACKWARD_FLOP_RATIO = 2.5  # flash-attention backward does 5 matmuls to the forward's 2
BACKWARD_FLOP_RATIO = 2.0  # weight and input gradients of every matmul
GiB = 1024**3


@dataclass(frozen=True)
class TimeCoefficients:
    """``time = fixed + per_token * tokens + per_token_key * token_keys + per_sequence * sequences``
    for one (sp, recompute)."""

    fixed: float
    per_token: float
    per_token_key: float
    per_sequence: float = 0.0

    def time(self, tokens: float, token_keys: float, sequences: int = 0) -> float:
        return self.fixed + self.per_token * tokens + self.per_token_key * token_keys + self.per_sequence * sequences


def context_seconds_per_sequence(profile: "ModelProfile", hardware: Hardware, recompute: RecomputePolicy | str) -> float:
    """Unscaled seconds (a matmul: the ``linear`` scale applies) one sample's conditioning context
    costs on *every* rank of its group, whatever the SP size: the key/value projections of the
    context in each cross-attention (``ModelProfile.context_flops_per_sequence``), forward,
    backward (input and weight gradients: 2x) and, under any recompute policy, forward again
    (they sit inside the recomputed attention / block). Why it matters: the published STDiT3
    attends to 300 T5 tokens per sample in all 56 cross-attentions, about 89 GFLOP of forward per
    sample; a 144p image (144 tokens) at SP 4 has 36 tokens per rank, so this per-sample work is
    about as large as the image's own (VideoSys ``OpenSoraMultiHeadCrossAttention.forward``:
    ``kv_linear(cond)`` over every sample's text on every rank)."""
    recompute = RecomputePolicy.parse(recompute)
    passes = 1 + BACKWARD_FLOP_RATIO + (0 if recompute == RecomputePolicy.NONE else 1)
    return profile.context_flops_per_sequence * passes / hardware.peak_flops


@dataclass(frozen=True)
class MemoryCoefficients:
    """``peak_memory = fixed_bytes + bytes_per_token * tokens`` (tokens of the whole micro-batch,
    already divided by the SP size inside ``bytes_per_token``)."""

    fixed_bytes: float
    bytes_per_token: float

    def peak(self, tokens: float) -> float:
        return self.fixed_bytes + self.bytes_per_token * tokens


class ScoreLayout(Enum):
    """Which attention scores a packed micro-batch computes: what its token-keys count.

    The model prices attention per score computed, so it must count the scores the kernel that
    runs computes. GPU kernels (and the analytic model) compute each sequence's own ``L x span``;
    the CPU reference kernel sometimes computes the whole row's ``T x T`` in one masked pass
    (:mod:`dcp_compile.kernels.dense_ranges`), and a packed row's cost then follows ``T^2``."""

    PER_SEQUENCE = "per_sequence"
    DENSE_RANGES = "dense_ranges"


def token_sums(lengths: Sequence[int], spans: Sequence[float] | None,
               layout: ScoreLayout = ScoreLayout.PER_SEQUENCE) -> tuple[int, float]:
    """(tokens, token-keys) of a micro-batch: ``sum(lengths)`` and ``sum(length * span)`` (spans
    given), or the scores ``layout`` computes (``sum(length^2)`` per sequence)."""
    tokens = sum(lengths)
    if spans is not None:
        if len(spans) != len(lengths):
            raise ValueError(f"got {len(spans)} spans for {len(lengths)} lengths; give one span per sequence")
        token_keys = float(sum(length * span for length, span in zip(lengths, spans)))
    elif layout is ScoreLayout.DENSE_RANGES:
        from dcp_compile.kernels.dense_ranges import dense_scores

        token_keys = dense_scores(lengths)
    else:
        token_keys = float(sum(length * length for length in lengths))
    return tokens, token_keys


def raw_term_coefficients(
    profile: "ModelProfile", hardware: Hardware, sp_size: int, recompute: RecomputePolicy | str,
    collectives_recomputed: bool = False,
) -> dict[str, tuple[float, float, float]]:
    """Unscaled seconds of each term as ``(fixed, per_token, per_token_key)`` coefficients.

    ``block`` (whole-block checkpointing, the published system's ``full``): backward re-runs each
    block's forward, its 4 all-to-alls included, so a layer sends 12 of them per micro-batch
    instead of 8. ``collectives_recomputed`` prices ``full`` so too."""
    recompute = RecomputePolicy.parse(recompute)
    if sp_size < 1:
        raise ValueError(f"sp_size must be >= 1, got {sp_size}")
    linear_extra, attention_extra, memory_extra = profile.recompute_forward_fraction[recompute]
    flops = hardware.peak_flops
    linear = profile.linear_flops_per_token * (1 + BACKWARD_FLOP_RATIO + linear_extra) / (sp_size * flops)
    attention = (
        profile.attention_flops_per_token_key * (1 + FLASH_BACKWARD_FLOP_RATIO + attention_extra) / (sp_size * flops)
    )
    memory_per_token = profile.memory_traffic_bytes_per_token * (1 + BACKWARD_FLOP_RATIO + memory_extra) / (
        sp_size * hardware.memory_bandwidth
    )
    # Forward reads the weights once, backward twice (input and weight gradients).
    memory_fixed = 3 * profile.parameter_bytes / hardware.memory_bandwidth
    # 4 all-to-alls forward (q, k, v, out) and the same 4 backward per attention layer, or the
    # ring (x Ulysses) steps where the SP size does not divide the heads; a recomputed block
    # sends its forward's again.
    passes = 3 if resends_collectives(recompute, collectives_recomputed) else 2
    communication_fixed, communication_per_token = attention_communication(profile, hardware, sp_size, passes)
    overhead = profile.num_layers * hardware.layer_overhead_s
    return {
        "linear": (0.0, linear, 0.0),
        "attention": (0.0, 0.0, attention),
        "memory": (memory_fixed, memory_per_token, 0.0),
        "communication": (communication_fixed, communication_per_token, 0.0),
        "overhead": (overhead, 0.0, 0.0),
    }


def memory_coefficients(
    profile: "ModelProfile",
    sp_size: int,
    recompute: RecomputePolicy | str,
    *,
    optimizer_shards: int = 1,
    reserved_bytes: float = float(GiB),
    collectives_recomputed: bool = False,
) -> MemoryCoefficients:
    """Peak bytes on each rank of an ``sp_size`` group: model state plus, per token of the
    micro-batch, what backward keeps (:meth:`ModelProfile.saved_activation_bytes_per_token`: the
    layers', the head's, the all-to-all outputs and a ring's K/V blocks) and the largest working
    set a phase of backward holds on top of it
    (:meth:`ModelProfile.backward_working_bytes_per_token`: what that layer or the head rebuilds,
    and the activation gradients alive meanwhile, all-to-all buffers included with the KV heads
    as wide as they travel). Checked against the measured peak of a step on CPU by
    ``benchmarks/memory_peaks.py`` (``benchmarks/results/memory_peaks_cpu.md``)."""
    recompute = RecomputePolicy.parse(recompute)
    static = (
        profile.parameter_bytes
        + profile.gradient_bytes
        + profile.optimizer_bytes / optimizer_shards
        + reserved_bytes
    )
    saved = profile.saved_activation_bytes_per_token(recompute, sp_size, collectives_recomputed)
    working = profile.backward_working_bytes_per_token(recompute, sp_size, collectives_recomputed)
    return MemoryCoefficients(static, (saved + working) / sp_size)
