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

Model state (:class:`StateSharding`): where parameters, gradients and optimizer state live decides
``static`` and, when they are sharded during the step (ZeRO-3), adds to every micro-batch's
``fixed`` time the world's parameter all-gathers and gradient reduce-scatters of one round
(:func:`state_round_seconds`).
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


class StateSharding(str, Enum):
    """Where the model state lives during a step (what ``CostModel.state_sharding`` selects).

    * ``replicated``: every rank holds the whole parameters and gradients for the step, the
      optimizer state divided by ``optimizer_shards`` (ZeRO-1). This is ``dcp.shard_model``'s
      default mode (FSDP2 gathered once per step, one reduce-scatter at the sync: ZeRO-3 storage
      between steps, ZeRO-2-like peak) as well as DDP's and plain replicated training's.
    * ``sharded``: ZeRO-3, ``dcp.shard_model(model, reshard_after_forward=True)``: parameters,
      gradients and optimizer state divided over the ``optimizer_shards`` ranks (the world), plus
      what FSDP2 holds unsharded while a micro-batch runs (:func:`unsharded_state_bytes`). Every
      micro-batch, and every idle round, all-gathers the parameters over the world (forward and
      backward) and reduce-scatters the gradients: priced per micro-batch, and the plan runs in
      rounds so that every rank issues those collectives equally often.
    * ``sharded_offload``: ``sharded`` with FSDP2's ``CPUOffloadPolicy``: the sharded parameters,
      gradients and optimizer state stay in host memory and the optimizer steps on the host
      (:meth:`~.cost_model.CostModel.optimizer_step_seconds`); the device holds only what is
      unsharded while a micro-batch runs, and each round also copies the shards over the host link.
    """

    REPLICATED = "replicated"
    SHARDED = "sharded"
    SHARDED_OFFLOAD = "sharded_offload"

    @classmethod
    def parse(cls, value: "StateSharding | str") -> "StateSharding":
        if isinstance(value, cls):
            return value
        key = str(value).lower().replace("-", "_").replace("+", "_").replace(" ", "_")
        key = {"zero3": "sharded", "zero_3": "sharded", "zero3_offload": "sharded_offload",
               "zero_3_offload": "sharded_offload", "zero1": "replicated", "zero_1": "replicated"}.get(key, key)
        try:
            return cls(key)
        except ValueError:
            raise ValueError(f"unknown state_sharding {value!r}; use one of {[m.value for m in cls]}") from None

    @property
    def rounds(self) -> bool:
        """Does a plan under this state run in rounds (world collectives per micro-batch)?"""
        return self is not StateSharding.REPLICATED


def block_state_fraction(profile: "ModelProfile") -> float:
    """The share of the model's parameters that one repeated block holds (what ``dcp.shard_model``
    shards as one FSDP module), from the profile's shape: attention ``2 h^2 + 2 h kv``, the MLP
    ``(3 if gated else 2) h ffn``, a cross-attention's ``4 h^2`` (queries, output, and the
    context's keys and values), in the activation dtype; at most ``1 / num_layers``."""
    if profile.parameter_bytes <= 0 or profile.num_layers < 1:
        return 0.0
    h = profile.hidden_size
    kv = max(1, profile.num_kv_heads) * profile.head_dim
    ffn = profile.ffn_hidden_size or 4 * h
    count = 2 * h * h + 2 * h * kv + (3 if profile.gated_mlp else 2) * h * ffn
    if profile.num_cross_attention_layers:
        count += 4 * h * h
    return min(1.0 / profile.num_layers, count * profile.activation_dtype_bytes / profile.parameter_bytes)


def unsharded_state_bytes(profile: "ModelProfile") -> float:
    """Bytes of parameters and gradients FSDP2 holds unsharded on a rank while a micro-batch runs
    under ``reshard_after_forward=True``: the root's own parameters (embeddings, head, final norm:
    FSDP2 does not reshard the root after forward) and their gradients until the root's
    reduce-scatter at the end of backward, plus two blocks' parameters and gradients (in backward
    the next block is all-gathered while the current one computes, and a block's gradients wait
    for their reduce-scatter while the next block's arrive). Priced in the profile's parameter and
    gradient dtypes."""
    block = block_state_fraction(profile)
    root = max(0.0, 1.0 - profile.num_layers * block)
    return (root + 2 * block) * (profile.parameter_bytes + profile.gradient_bytes)


def model_state_bytes(profile: "ModelProfile", state_sharding: StateSharding | str = StateSharding.REPLICATED,
                      optimizer_shards: int = 1) -> float:
    """Device bytes of model state per rank during a step under ``state_sharding`` (see
    :class:`StateSharding`); ``optimizer_shards`` is the number of ranks the state is sharded over."""
    state_sharding = StateSharding.parse(state_sharding)
    if state_sharding is StateSharding.REPLICATED:
        return profile.parameter_bytes + profile.gradient_bytes + profile.optimizer_bytes / optimizer_shards
    in_flight = unsharded_state_bytes(profile)
    if state_sharding is StateSharding.SHARDED_OFFLOAD:
        return in_flight
    return (profile.parameter_bytes + profile.gradient_bytes + profile.optimizer_bytes) / optimizer_shards + in_flight


def host_state_bytes(profile: "ModelProfile", state_sharding: StateSharding | str, optimizer_shards: int = 1) -> float:
    """Host bytes of model state per rank: the shards ``sharded_offload`` keeps there, else 0."""
    if StateSharding.parse(state_sharding) is not StateSharding.SHARDED_OFFLOAD:
        return 0.0
    return (profile.parameter_bytes + profile.gradient_bytes + profile.optimizer_bytes) / optimizer_shards


def state_round_seconds(profile: "ModelProfile", hardware: Hardware, state_sharding: StateSharding | str,
                        shards: int) -> float:
    """Unscaled seconds (the ``communication`` scale applies) of one round's model-state traffic on
    each rank, whatever it runs in the round (a micro-batch or nothing): the parameters
    all-gathered over the ``shards`` ranks in forward and again in backward (the root's only once:
    FSDP2 keeps them through backward) and the gradients reduce-scattered, one collective per
    sharded module each; under ``sharded_offload`` also the shards' copies over the host link
    (parameter shards in for each all-gather, in the gradient dtype, which is the stored one;
    gradient shards out). 0 for ``replicated`` (its one reduction per step is outside the plan)."""
    state_sharding = StateSharding.parse(state_sharding)
    if not state_sharding.rounds:
        return 0.0
    block = block_state_fraction(profile)
    root = max(0.0, 1.0 - profile.num_layers * block)
    gathered = 2.0 - root  # share of the parameters all-gathered per round
    modules = profile.num_layers + 1
    seconds = (
        hardware.all_gather_seconds(gathered * profile.parameter_bytes, shards, calls=2 * modules)
        + hardware.reduce_scatter_seconds(profile.gradient_bytes, shards, calls=modules)
    )
    if state_sharding is StateSharding.SHARDED_OFFLOAD:
        seconds += (gathered + 1.0) * profile.gradient_bytes / shards / hardware.host_link_bandwidth
    return seconds


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
class CappedTerm:
    """Bytes that grow with a rank's tokens up to a bound and then stay: a tiled op's chunk, which
    holds a rank's whole share up to one chunk (``tokens``: of the micro-batch, where each share
    fills a chunk)."""

    bytes_per_token: float
    tokens: float


@dataclass(frozen=True)
class WorkingPhase:
    """One phase of backward as :class:`MemoryCoefficients` prices it: bytes per token of the
    micro-batch (already divided by the SP size) and the capped terms alive in it only."""

    bytes_per_token: float
    capped: tuple[CappedTerm, ...] = ()

    def bytes(self, tokens: float) -> float:
        return self.bytes_per_token * tokens + sum(term.bytes_per_token * min(tokens, term.tokens) for term in self.capped)


@dataclass(frozen=True)
class MemoryCoefficients:
    """``peak_memory(tokens) = fixed_bytes + kept * tokens + max(phase.bytes(tokens))`` (tokens of
    the whole micro-batch, already divided by the SP size inside the per-token terms).

    ``bytes_per_token`` is the slope at long lengths: what is kept and the largest phase's
    per-token bytes (``kept`` is ``bytes_per_token`` less that largest phase slope). A phase's
    capped terms grow with the tokens up to a bound and then stay: a tiled op's chunk, alive in
    its phase only (the tiled loss's in the head's, the tiled MLP's in an MLP's), which holds a
    rank's whole share up to one chunk. Without phases (a measured fit):
    ``fixed_bytes + bytes_per_token * tokens``."""

    fixed_bytes: float
    bytes_per_token: float
    phases: tuple[WorkingPhase, ...] = ()

    @property
    def capped_bytes_per_token(self) -> float:
        """The first phase capped term's slope (the tiled loss's, where there is one); 0 without."""
        terms = [term for phase in self.phases for term in phase.capped]
        return terms[0].bytes_per_token if terms else 0.0

    @property
    def capped_tokens(self) -> float:
        terms = [term for phase in self.phases for term in phase.capped]
        return terms[0].tokens if terms else 0.0

    def peak(self, tokens: float) -> float:
        kept = self.bytes_per_token
        working = 0.0
        if self.phases:
            kept -= max(phase.bytes_per_token for phase in self.phases)
            working = max(phase.bytes(tokens) for phase in self.phases)
        return self.fixed_bytes + kept * tokens + working

    def token_capacity(self, memory_cap: float) -> int:
        """The most tokens whose :meth:`peak` is within ``memory_cap`` (0 where none fit): the peak
        grows with the tokens (piecewise linear), so search it."""
        if self.peak(0) > memory_cap:
            return 0
        if self.bytes_per_token <= 0:
            raise ValueError("a micro-batch that costs no memory per token has no token capacity")
        high = max(1, int((memory_cap - self.fixed_bytes) / self.bytes_per_token) + 1)
        while self.peak(high) <= memory_cap:  # past every capped term the slope is bytes_per_token
            high *= 2
        low = 0  # peak(low) fits, peak(high) does not
        while high - low > 1:
            middle = (low + high) // 2
            if self.peak(middle) <= memory_cap:
                low = middle
            else:
                high = middle
        return low


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
    collectives_recomputed: bool = False, state_sharding: StateSharding | str = StateSharding.REPLICATED,
    state_shards: int = 1,
) -> dict[str, tuple[float, float, float]]:
    """Unscaled seconds of each term as ``(fixed, per_token, per_token_key)`` coefficients.

    ``block`` (whole-block checkpointing, the published system's ``full``): backward re-runs each
    block's forward, its 4 all-to-alls included, so a layer sends 12 of them per micro-batch
    instead of 8. ``collectives_recomputed`` prices ``full`` so too. Under a sharded
    ``state_sharding`` the round's parameter all-gathers and gradient reduce-scatters over the
    ``state_shards`` ranks (:func:`state_round_seconds`) join the fixed communication time."""
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
    communication_fixed += state_round_seconds(profile, hardware, state_sharding, state_shards)
    # offload, lean: each block input goes to the host in forward and comes back in backward, priced
    # as if no compute hid it (on a GPU a side stream overlaps the copies: an upper bound).
    communication_per_token += 2 * profile.host_activation_bytes_per_token(recompute) / (
        sp_size * hardware.host_link_bandwidth)
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
    state_sharding: StateSharding | str = StateSharding.REPLICATED,
    regions: bool = False,
) -> MemoryCoefficients:
    """Peak bytes on each rank of an ``sp_size`` group: model state plus, per token of the
    micro-batch, what backward keeps (:meth:`ModelProfile.saved_activation_bytes_per_token`: the
    layers', the head's, the all-to-all outputs and a ring's K/V blocks) and the largest working
    set a phase of backward holds on top of it
    (:meth:`ModelProfile.backward_working_bytes_per_token`: what that layer or the head rebuilds,
    and the activation gradients alive meanwhile, all-to-all buffers included with the KV heads
    as wide as they travel). Checked against the measured peak of a step on CPU by
    ``benchmarks/memory_peaks.py`` (``benchmarks/results/memory_peaks_cpu.md``).

    The model state is :func:`model_state_bytes` under ``state_sharding``: whole parameters and
    gradients and ``1 / optimizer_shards`` of the optimizer state (``replicated``), or all of it
    divided over ``optimizer_shards`` ranks plus what is unsharded while the micro-batch runs
    (``sharded``), or only the latter (``sharded_offload``).

    A language model's tiled loss (every policy but ``none``, :mod:`dcp_compile.tiled_loss`) holds
    one chunk's logits and the fp32 tensors made from them at a time: a rank's whole share where
    it is shorter than a chunk, one chunk (:meth:`ModelProfile.loss_chunk_bytes`) whatever the
    length beyond (a capped term of :class:`MemoryCoefficients`); so does the tiled MLP under
    ``lean`` (:meth:`ModelProfile.mlp_chunk_bytes`). ``offload`` and ``lean`` keep most block
    inputs in host memory (:meth:`ModelProfile.host_activation_bytes_per_token`), not priced here.
    ``regions``: the variant is compiled in regions (``options={"regions": True}``), whose
    ``attention`` and ``full`` checkpoint around regions at run time and keep the regions' inputs
    (:meth:`ModelProfile.regional_saved_bytes_per_token`, ``benchmarks/results/memory_peaks_regions_cpu.md``)."""
    recompute = RecomputePolicy.parse(recompute)
    static = model_state_bytes(profile, state_sharding, optimizer_shards) + reserved_bytes
    saved = profile.saved_activation_bytes_per_token(recompute, sp_size, collectives_recomputed, regions)
    phases = profile.backward_phases(recompute, sp_size, collectives_recomputed, regions)
    working = []
    for phase in phases:
        capped = ()
        if phase.chunk_bytes:
            chunk_tokens = phase.chunk_tokens * sp_size  # a micro-batch's tokens at which each share fills a chunk
            capped = (CappedTerm(phase.chunk_bytes / chunk_tokens, chunk_tokens),)
        working.append(WorkingPhase(phase.bytes_per_token / sp_size, capped))
    slope = (saved + max(phase.bytes_per_token for phase in phases)) / sp_size
    return MemoryCoefficients(static, slope, tuple(working))
