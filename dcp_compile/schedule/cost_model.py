"""Time and peak memory of one training micro-batch, by sequence lengths, SP size and recompute policy.

The planner asks this model thousands of questions per step, so it is analytic: a
:class:`ModelProfile` (FLOPs, activation bytes, all-to-all volume of one transformer) on a
:class:`~dcp_compile.schedule.hardware.Hardware` record. Every term is *separable* over the
sequences of a micro-batch::

    time(lengths, sp, recompute) = fixed(sp, recompute)
                                   + per_token(sp, recompute) * sum(lengths)
                                   + per_token_key(sp, recompute) * sum(length * span)
                                   + per_sequence(recompute) * len(lengths)

where ``span`` is the number of keys a query attends to, averaged over the attention layers (the
length itself for full attention; ``(frames + height * width) / 2`` for a video DiT that alternates
spatial and temporal attention). ``fixed`` holds what a micro-batch pays however few tokens it
has (kernel launches, all-to-all latency, reading the weights), which is why packing short
sequences into one micro-batch pays; ``per_sequence`` is what a sample costs on every rank of its
group whatever its length and the SP size (a DiT's text context, which no rank shards: see
:func:`.analytic.context_seconds_per_sequence`). Peak memory is ``static + bytes_per_token * sum(lengths) / sp``
(flash/varlen attention keeps no quadratic buffer), so "does it fit" is a token capacity.

A recompute policy (:class:`~dcp_compile.variant.RecomputePolicy`, the names the compiler builds)
trades memory for time: ``none`` keeps every activation; ``attention`` recomputes each attention
and what makes its queries, keys and values back to (and including) their projections;
``selective`` also recomputes every op that is not a matrix product, keeping only matmul outputs;
``full`` keeps only each block's input (and what every block reads from outside, such as a RoPE
table) and recomputes the whole forward, the head included, in backward; under sequence
parallelism it keeps the all-to-alls' outputs too (re-sending an all-to-all costs more than
storing its result), as every policy does but ``block``, which re-sends them in backward and
keeps only the block inputs (whole-block checkpointing, as ``torch.utils.checkpoint`` and the
published systems do it: ``collectives_recomputed`` prices ``full`` so). The bytes each policy
keeps are priced in :mod:`.presets` and checked against the compiled variants by
``tests/test_recompute_pricing.py``.

Where the parts live: the formulas in :mod:`.analytic`; profiles in :mod:`.model_profile`
(shapes and presets in :mod:`.presets`, measurement in :mod:`.profiling`); fitting the five
scale factors (inverse efficiencies of matmuls, attention, memory-bound ops, communication,
per-layer overhead) to a short profile in :mod:`.calibration`; the JSON file in
:mod:`.serialization`. The names are all importable from here.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field, replace
from functools import lru_cache
from typing import Any, Callable, Iterable, Mapping, Sequence

from dcp_compile.variant import RECOMPUTE_POLICIES, REGIONS_BY_DEFAULT, RecomputePolicy

from . import calibration, serialization
from .analytic import (
    BACKWARD_FLOP_RATIO,
    COST_TERMS,
    DEFAULT_SCALES,
    FLASH_BACKWARD_FLOP_RATIO,
    GiB,
    MemoryCoefficients,
    ScoreLayout,
    StateSharding,
    TimeCoefficients,
    context_seconds_per_sequence,
    host_state_bytes,
    memory_coefficients,
    model_state_bytes,
    raw_term_coefficients,
    state_round_seconds,
    token_sums,
)
from .calibration import CalibrationPoint, CalibrationReport
from .hardware import Hardware
from .measured_costs import MeasuredCosts
from .model_profile import ModelProfile, video_attention_span

__all__ = [
    "BACKWARD_FLOP_RATIO", "COST_TERMS", "DEFAULT_SCALES", "FLASH_BACKWARD_FLOP_RATIO", "GiB",
    "RECOMPUTE_POLICIES", "CalibrationPoint", "CalibrationReport", "CostModel", "MemoryCoefficients",
    "ModelProfile", "RecomputePolicy", "StateSharding", "TimeCoefficients", "video_attention_span",
]


@dataclass(frozen=True)
class CostModel:
    """Predicts time and peak memory of a micro-batch; see the module docstring.

    ``optimizer_shards`` divides the optimizer state (ZeRO-1 over the data-parallel world);
    ``reserved_bytes`` is what the runtime keeps for itself (CUDA context, NCCL and cuBLAS workspaces).
    ``state_sharding`` (:class:`~.analytic.StateSharding`): ``replicated`` (the default: whole
    parameters and gradients on every rank during the step, as DDP and ``dcp.shard_model``'s
    default mode keep them), ``sharded`` (ZeRO-3, ``dcp.shard_model(model,
    reshard_after_forward=True)``: parameters, gradients and optimizer state all divided over the
    ``optimizer_shards`` ranks, which must then be the planner's world, plus one round's unsharded
    parameters and gradients; every micro-batch pays the world's all-gathers and reduce-scatters
    and plans run in rounds) or ``sharded_offload`` (``sharded`` with FSDP2's ``CPUOffloadPolicy``:
    the shards live in host memory and the optimizer steps there, see
    :meth:`optimizer_step_seconds`).
    ``collectives_recomputed``: ``full`` means whole-block checkpointing, which re-sends the
    blocks' all-to-alls in backward and keeps only block inputs (the published system; the
    baselines plan with it), instead of our compiler's ``full``, which keeps the all-to-all
    outputs: ``full`` is then priced as ``block``, the policy our compiler builds for it.
    ``regions``: the model is compiled in regions (``options={"regions": True}``; the default is
    the compile option's, ``dcp_compile.variant.REGIONS_BY_DEFAULT``), where ``attention`` and
    ``full`` are checkpoints around regions at run time and keep more than the whole-graph
    variants (each attention's inputs; under ``full`` each region's: the residual stream and
    attention's inputs and output per layer); their memory is priced so
    (:meth:`ModelProfile.regional_saved_bytes_per_token`). ``dcp.profile`` sets it from its ``options``.
    Instances are immutable: every rank must plan with the same model, and a model that could change
    under a sampler would break that. :meth:`calibrate` returns a new one.

    ``measured``: per-variant compute times that ``dcp.profile`` measured on the device
    (:mod:`.measured_costs`). Where present they replace the analytic compute of that variant
    (the ``linear``, ``attention``, ``memory`` and ``overhead`` terms); communication, which one
    device cannot measure, stays modelled and is added on top; a variant that was not measured
    gets the analytic prior scaled by how the nearest measured variant compared with it
    (:meth:`source` says which of the three a variant's time is).
    """

    profile: ModelProfile
    hardware: Hardware
    scales: dict[str, float] = field(default_factory=lambda: dict(DEFAULT_SCALES))
    optimizer_shards: int = 1
    reserved_bytes: float = float(GiB)
    calibration: CalibrationReport | None = field(default=None, compare=False)
    collectives_recomputed: bool = False
    measured: MeasuredCosts | None = field(default=None, compare=False)
    state_sharding: StateSharding = StateSharding.REPLICATED
    regions: bool = REGIONS_BY_DEFAULT  # as the compile option's default

    def __post_init__(self) -> None:
        unknown = set(self.scales) - set(COST_TERMS)
        if unknown:
            raise ValueError(f"unknown cost terms {sorted(unknown)}; the terms are {COST_TERMS}")
        object.__setattr__(self, "scales", {**DEFAULT_SCALES, **self.scales})
        if self.optimizer_shards < 1:
            raise ValueError(f"optimizer_shards must be >= 1, got {self.optimizer_shards}")
        object.__setattr__(self, "state_sharding", StateSharding.parse(self.state_sharding))

    @property
    def score_layout(self) -> ScoreLayout:
        """What a packed micro-batch's token-keys count: the measured device's attention kernel's
        scores (the CPU reference kernel may compute a whole row), else each sequence's own."""
        return self.measured.score_layout if self.measured is not None else ScoreLayout.PER_SEQUENCE

    def __hash__(self) -> int:  # identity hash: used as a cache key by the planner
        return id(self)

    def __eq__(self, other: object) -> bool:
        return self is other

    @classmethod
    def default(cls, world_size: int = 1) -> "CostModel":
        """The analytic model of the present device with a generic ~1B-parameter causal
        transformer profile: the fallback when the user gives none. It gets the shape of the problem
        right (quadratic attention, packing, memory caps) but not your model's constants; give
        ``ModelProfile.measure(model, ...)`` or a preset for real plans."""
        profile = ModelProfile.transformer(
            "generic-1b", num_layers=16, hidden_size=2048, num_heads=16, ffn_hidden_size=8192,
            gated_mlp=True, vocab_size=32000, causal=True,
        )
        return cls(profile, Hardware.detect(), optimizer_shards=max(1, world_size))

    # ------------------------------------------------------------------ coefficients
    def raw_term_coefficients(self, sp_size: int, recompute: RecomputePolicy | str) -> dict[str, tuple[float, float, float]]:
        """Unscaled seconds of each term as ``(fixed, per_token, per_token_key)`` coefficients."""
        return raw_term_coefficients(self.profile, self.hardware, sp_size, recompute, self.collectives_recomputed,
                                     self.state_sharding, self.optimizer_shards)

    def time_coefficients(self, sp_size: int, recompute: RecomputePolicy | str = "none") -> TimeCoefficients:
        return _time_coefficients(self, sp_size, recompute)

    def without_communication(self) -> "CostModel":
        """The same model with its communication term at zero: the compute a micro-batch costs,
        so that ``time - without_communication().time`` is the communication it is priced."""
        return replace(self, scales={**self.scales, "communication": 0.0})

    def source(self, sp_size: int, recompute: RecomputePolicy | str = "none") -> str:
        """Where this variant's compute time comes from: ``measured on <device>``, ``analytic
        prior scaled to sp=<n>/<policy> measured on <device>``, or ``analytic`` (``block`` unmeasured
        where ``full`` was measured at its SP size: ``full``'s compute, ``measured on <device> as full``)."""
        if self.measured is None:
            return "analytic"
        if self.measured.fit_for(sp_size, recompute) is not None:
            return f"measured on {self.measured.device}"
        twin = self.measured.compute_fit_for(sp_size, recompute)
        if twin is not None:
            return f"measured on {self.measured.device} as {twin.recompute.value}"
        nearest = self.measured.nearest_fit(sp_size, recompute)
        if nearest is None:
            return "analytic"
        return f"analytic prior scaled to sp={nearest.sp_size}/{nearest.recompute.value} measured on {self.measured.device}"

    def memory_coefficients(self, sp_size: int, recompute: RecomputePolicy | str = "none") -> MemoryCoefficients:
        return _memory_coefficients(self, sp_size, recompute)

    # ------------------------------------------------------------------ model state
    @property
    def rounds(self) -> bool:
        """Must plans run in rounds (the state is sharded during the step: every micro-batch issues
        world collectives, so every rank must issue them equally often)?"""
        return self.state_sharding.rounds

    def model_state_bytes(self) -> float:
        """Device bytes of model state per rank during a step (:func:`.analytic.model_state_bytes`)."""
        return model_state_bytes(self.profile, self.state_sharding, self.optimizer_shards)

    def host_state_bytes(self) -> float:
        """Host bytes of model state per rank (the shards of ``sharded_offload``; else 0)."""
        return host_state_bytes(self.profile, self.state_sharding, self.optimizer_shards)

    @property
    def host_memory_cap(self) -> float:
        """Host bytes a rank may hold: its node's host memory over the ranks that share it (the
        world, ``optimizer_shards``, up to a node's GPUs); infinite where the hardware does not
        say (``Hardware.host_memory_per_node == 0``)."""
        per_node = self.hardware.host_memory_per_node
        if not per_node:
            return math.inf
        return per_node / min(self.optimizer_shards, self.hardware.gpus_per_node)

    def host_peak(self, lengths: Sequence[int], sp_size: int, recompute: RecomputePolicy | str = "none") -> float:
        """Host bytes each rank of the group holds while it trains on the micro-batch: the state's
        shards (``sharded_offload``) and the offloaded block inputs (``offload``, ``lean``)."""
        per_token = self.profile.host_activation_bytes_per_token(recompute) / sp_size
        return self.host_state_bytes() + per_token * sum(lengths)

    def _host_token_capacity(self, sp_size: int, recompute: RecomputePolicy | str) -> float:
        per_token = self.profile.host_activation_bytes_per_token(recompute) / sp_size
        room = self.host_memory_cap - self.host_state_bytes()
        if room < 0:
            return 0
        return math.inf if not per_token or room == math.inf else int(room / per_token)

    def state_round_seconds(self) -> float:
        """Seconds every round costs each rank for the model state's collectives (and, offloaded,
        host copies), scaled as communication; included in every micro-batch's fixed time."""
        return self.scales["communication"] * state_round_seconds(
            self.profile, self.hardware, self.state_sharding, self.optimizer_shards)

    def optimizer_step_seconds(self) -> float:
        """Seconds of one optimizer step on a rank, once per step and outside the plan's makespan:
        an Adam-like update reads and writes its state, reads the gradient and writes the
        parameters, all of the rank's ``1 / optimizer_shards``; memory-bound, at the host's memory
        bandwidth share under ``sharded_offload`` (FSDP2's ``CPUOffloadPolicy`` steps on the host),
        else at the device's (the ``memory`` scale applies). A lower bound: PyTorch's CPU AdamW
        runs below the host's bandwidth."""
        profile = self.profile
        moved = (2 * profile.optimizer_bytes + profile.gradient_bytes + profile.parameter_bytes) / self.optimizer_shards
        offloaded = self.state_sharding is StateSharding.SHARDED_OFFLOAD
        bandwidth = self.hardware.host_memory_bandwidth if offloaded else self.hardware.memory_bandwidth
        return self.scales["memory"] * moved / bandwidth

    # ------------------------------------------------------------------ queries
    def terms(
        self,
        lengths: Sequence[int],
        sp_size: int,
        recompute: RecomputePolicy | str = "none",
        spans: Sequence[float] | None = None,
    ) -> dict[str, float]:
        """Scaled seconds per term for one micro-batch."""
        tokens, token_keys = token_sums(lengths, spans, self.score_layout)
        raw = self.raw_term_coefficients(sp_size, recompute)
        out = {
            term: self.scales[term] * (c[0] + c[1] * tokens + c[2] * token_keys) if tokens else 0.0
            for term, c in raw.items()
        }
        if tokens:  # the per-sample context projections are matmuls: priced with the linear term
            out["linear"] += self.scales["linear"] * context_seconds_per_sequence(self.profile, self.hardware, recompute) * len(lengths)
        return out

    def time(
        self,
        lengths: Sequence[int],
        sp_size: int,
        recompute: RecomputePolicy | str = "none",
        spans: Sequence[float] | None = None,
    ) -> float:
        """Seconds of one forward + backward of a micro-batch packing ``lengths`` on ``sp_size``
        ranks (every rank of the group takes this long); 0 for an empty micro-batch."""
        tokens, token_keys = token_sums(lengths, spans, self.score_layout)
        if not tokens:
            return 0.0
        return self.time_coefficients(sp_size, recompute).time(tokens, token_keys, len(lengths))

    def sequence_work(self, length: int, sp_size: int, recompute: RecomputePolicy | str = "none", span: float | None = None) -> float:
        """Rank-seconds one sequence alone costs: ``sp_size * time([length])``."""
        return sp_size * self.time([length], sp_size, recompute, None if span is None else [span])

    def peak_memory(self, lengths: Sequence[int], sp_size: int, recompute: RecomputePolicy | str = "none") -> float:
        """Peak bytes on each rank of the group while it trains on the micro-batch."""
        return self.memory_coefficients(sp_size, recompute).peak(sum(lengths))

    def token_capacity(self, sp_size: int, recompute: RecomputePolicy | str, memory_cap: float) -> int:
        """The most tokens one micro-batch on ``sp_size`` ranks may hold under ``memory_cap`` bytes
        on the device and :attr:`host_memory_cap` on the host."""
        device = self.memory_coefficients(sp_size, recompute).token_capacity(memory_cap)
        return int(min(device, self._host_token_capacity(sp_size, recompute)))

    def fastest_feasible_recompute(self, tokens: int, sp_size: int, memory_cap: float) -> RecomputePolicy | None:
        """The fastest policy under which ``tokens`` fit on ``sp_size`` ranks, or None."""
        for policy in RECOMPUTE_POLICIES:
            if (self.memory_coefficients(sp_size, policy).peak(tokens) <= memory_cap
                    and self.host_peak([tokens], sp_size, policy) <= self.host_memory_cap):
                return policy
        return None

    # ------------------------------------------------------------------ calibration
    def calibrate(
        self,
        measure_fn: Callable[[Sequence[int], int, str], float],
        points: Iterable[CalibrationPoint | tuple],
        progress: bool = True,
    ) -> "CostModel":
        """Fit the per-term scale factors to measured times and return the calibrated model
        (see :func:`.calibration.calibrate`)."""
        return calibration.calibrate(self, measure_fn, points, progress)

    def calibration_points(
        self,
        max_length: int,
        sp_sizes: Sequence[int] = (1, 2, 4),
        recompute: Sequence[RecomputePolicy | str] = RECOMPUTE_POLICIES,
        min_length: int = 128,
    ) -> list[CalibrationPoint]:
        """A small design that separates the terms (see :func:`.calibration.calibration_points`)."""
        return calibration.calibration_points(max_length, sp_sizes, recompute, min_length)

    # ------------------------------------------------------------------ io
    def to_dict(self) -> dict[str, Any]:
        return serialization.cost_model_to_dict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "CostModel":
        return serialization.cost_model_from_dict(cls, data)

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write the model as JSON (write-then-rename, so a reader never sees half a file)."""
        serialization.save(self, path)

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> "CostModel":
        return serialization.load(cls, path)


@lru_cache(maxsize=4096)
def _time_coefficients(model: CostModel, sp_size: int, recompute: RecomputePolicy | str) -> TimeCoefficients:
    raw = model.raw_term_coefficients(sp_size, recompute)
    per_sequence = model.scales["linear"] * context_seconds_per_sequence(model.profile, model.hardware, recompute)
    if model.measured is None:
        return TimeCoefficients(*_scaled_sum(model, raw, COST_TERMS), per_sequence=per_sequence)
    communication = _scaled_sum(model, raw, ("communication",))
    fit = model.measured.compute_fit_for(sp_size, recompute)  # block: full's compute, its own communication
    if fit is not None and fit.per_sequence is not None:  # packed rows of several sequences were timed
        return TimeCoefficients(
            fit.fixed + communication[0], fit.per_token + communication[1], fit.per_token_key + communication[2],
            per_sequence=fit.per_sequence,
        )
    if fit is not None:
        # A measurement is one sample: its fixed part holds that sample's context work, which the
        # separable form charges per sequence instead.
        return TimeCoefficients(
            max(fit.fixed - per_sequence, 0.0) + communication[0], fit.per_token + communication[1],
            fit.per_token_key + communication[2], per_sequence=per_sequence,
        )
    nearest = model.measured.nearest_fit(sp_size, recompute)
    compute_terms = tuple(t for t in COST_TERMS if t != "communication")
    compute = _scaled_sum(model, raw, compute_terms)
    if nearest is None:
        return TimeCoefficients(*(a + b for a, b in zip(compute, communication)), per_sequence=per_sequence)
    # The prior, scaled by how the nearest measured variant compares with its own prior at the
    # longest micro-batch it measured (one sequence of that many tokens).
    length = nearest.max_tokens
    prior = _scaled_sum(model, model.raw_term_coefficients(nearest.sp_size, nearest.recompute), compute_terms)
    prior_seconds = prior[0] + prior[1] * length + prior[2] * length * length + per_sequence
    ratio = nearest.seconds([length]) / prior_seconds if prior_seconds > 0 else 1.0
    return TimeCoefficients(
        *(ratio * a + b for a, b in zip(compute, communication)), per_sequence=ratio * per_sequence,
    )


def _scaled_sum(model: CostModel, raw: dict[str, tuple[float, float, float]], terms: Iterable[str]) -> tuple[float, float, float]:
    totals = [0.0, 0.0, 0.0]
    for term in terms:
        for i in range(3):
            totals[i] += model.scales[term] * raw[term][i]
    return totals[0], totals[1], totals[2]


@lru_cache(maxsize=4096)
def _memory_coefficients(model: CostModel, sp_size: int, recompute: RecomputePolicy | str) -> MemoryCoefficients:
    analytic = memory_coefficients(
        model.profile, sp_size, recompute, optimizer_shards=model.optimizer_shards, reserved_bytes=model.reserved_bytes,
        collectives_recomputed=model.collectives_recomputed, state_sharding=model.state_sharding,
        regions=model.regions,
    )
    fit = model.measured.fit_for(sp_size, recompute) if model.measured is not None else None
    measured = fit.memory_coefficients() if fit is not None else None
    if measured is None:
        return analytic
    # Model state (parameters, gradients, optimizer, runtime reserve) stays counted; the
    # activations are what the allocator measured above it during the forward and backward (a
    # tiled loss's chunk among them: the measured lengths' shares, extrapolated per token).
    return MemoryCoefficients(analytic.fixed_bytes + measured.fixed_bytes, measured.bytes_per_token)
