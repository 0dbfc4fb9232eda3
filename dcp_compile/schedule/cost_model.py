"""Time and peak memory of one training micro-batch, by sequence lengths, SP size and recompute policy.

The planner asks this model thousands of questions per step, so it is analytic: a
:class:`ModelProfile` (FLOPs, activation bytes, all-to-all volume of one transformer) on a
:class:`~dcp_compile.schedule.hardware.Hardware` record. Every term is *separable* over the sequences of a
micro-batch::

    time(lengths, sp, recompute) = fixed(sp, recompute)
                                   + per_token(sp, recompute) * sum(lengths)
                                   + per_token_key(sp, recompute) * sum(length * span)

where ``span`` is the number of keys a query attends to, averaged over the attention layers (the
length itself for full attention; ``(frames + height * width) / 2`` for a video DiT that alternates
spatial and temporal attention). ``fixed`` holds what a micro-batch pays however few tokens it
has (kernel launches, all-to-all latency, reading the weights), which is why packing short
sequences into one micro-batch pays. Peak memory is ``static + bytes_per_token * sum(lengths) / sp``
(flash/varlen attention keeps no quadratic buffer), so "does it fit" is a token capacity.

The analytic terms are peak-rate seconds; five scale factors (inverse efficiencies: linear
matmuls, attention, memory-bound ops, communication, per-layer overhead) turn them into wall time.
:meth:`CostModel.calibrate` fits those factors to a short profile, and :meth:`CostModel.save` /
:meth:`CostModel.load` keep the result as JSON, so a job plans with measured numbers without a
second launch (the published system profiles, writes files and relaunches).

A recompute policy trades memory for time: ``"none"`` keeps every activation, ``"attention"``
recomputes the attention sub-block from its input, ``"selective"`` also recomputes the cheap,
memory-hungry ops of the MLP (norms, activations), ``"full"`` keeps only each block's input and
recomputes the whole forward in backward. Collective outputs are never recomputed (re-sending an
all-to-all costs more than storing its result), so the policies that drop them from the saved set
keep them explicitly when ``sp > 1``.
"""

from __future__ import annotations

import itertools
import json
import logging
import math
import os
from dataclasses import asdict, dataclass, field, replace
from functools import lru_cache
from typing import Any, Callable, Iterable, Mapping, Sequence

from dcp_compile.variant import RECOMPUTE_POLICIES, RecomputePolicy

from .hardware import Hardware

log = logging.getLogger(__name__)

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
    """``time = fixed + per_token * tokens + per_token_key * token_keys`` for one (sp, recompute)."""

    fixed: float
    per_token: float
    per_token_key: float

    def time(self, tokens: float, token_keys: float) -> float:
        return self.fixed + self.per_token * tokens + self.per_token_key * token_keys


@dataclass(frozen=True)
class MemoryCoefficients:
    """``peak_memory = fixed_bytes + bytes_per_token * tokens`` (tokens of the whole micro-batch,
    already divided by the SP size inside ``bytes_per_token``)."""

    fixed_bytes: float
    bytes_per_token: float

    def peak(self, tokens: float) -> float:
        return self.fixed_bytes + self.bytes_per_token * tokens


# ---------------------------------------------------------------------------------------------
# Model profile
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ModelProfile:
    """What the cost model needs to know about one transformer, per token.

    Attributes:
        num_layers: blocks that keep activations for backward and pay a launch overhead.
        num_attention_layers: self-attention layers over the sharded sequence; each costs 4
            all-to-alls (q, k, v, out) forward and 4 backward under sequence parallelism.
        linear_flops_per_token: forward FLOPs per token of everything but the attention core
            (projections, MLPs, cross-attention to a fixed-length context, the output head).
        attention_flops_per_token_key: forward FLOPs per (query, key) pair, summed over the
            attention layers and already halved for causal masks (see the module docstring for
            ``span``).
        activation_bytes_per_token: bytes per token *per layer* kept for backward, per recompute
            policy.
        recompute_forward_fraction: per policy, the fractions of the forward's (linear, attention,
            memory-bound) work that backward runs again.
        memory_traffic_bytes_per_token: forward bytes read and written per token by memory-bound
            ops over all layers.
        output_bytes_per_token: transient bytes per token of the head and loss (logits).
        parameter_bytes / gradient_bytes / optimizer_bytes: model state per replica (the optimizer
            state may be sharded, see ``CostModel.optimizer_shards``).
    """

    name: str
    num_layers: int
    num_attention_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    linear_flops_per_token: float
    attention_flops_per_token_key: float
    activation_bytes_per_token: dict[str, float]
    recompute_forward_fraction: dict[str, tuple[float, float, float]]
    memory_traffic_bytes_per_token: float
    output_bytes_per_token: float
    parameter_bytes: float
    gradient_bytes: float
    optimizer_bytes: float
    activation_dtype_bytes: int = 2
    causal: bool = False

    def __post_init__(self) -> None:
        missing = [p for p in RECOMPUTE_POLICIES if p not in self.activation_bytes_per_token]
        missing += [p for p in RECOMPUTE_POLICIES if p not in self.recompute_forward_fraction]
        if missing:
            raise ValueError(
                f"ModelProfile {self.name!r} lacks entries for recompute policies {sorted(set(missing))}; "
                f"give activation_bytes_per_token and recompute_forward_fraction for all of {RECOMPUTE_POLICIES}"
            )
        if self.num_heads % max(1, self.num_kv_heads):
            raise ValueError(f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    # ------------------------------------------------------------------ constructors
    @classmethod
    def transformer(
        cls,
        name: str,
        *,
        num_layers: int,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int | None = None,
        ffn_hidden_size: int | None = None,
        gated_mlp: bool = False,
        vocab_size: int = 0,
        causal: bool = True,
        cross_attention_tokens: int = 0,
        output_channels: int = 0,
        dtype_bytes: int = 2,
        gradient_dtype_bytes: int = 4,
        optimizer_bytes_per_parameter: int = 12,
        extra_parameters: int = 0,
    ) -> "ModelProfile":
        """A profile from the shape of a standard pre-norm transformer.

        Counts matmul FLOPs exactly (2 per multiply-add) and activation bytes with the usual
        flash-attention accounting (no quadratic buffer). ``cross_attention_tokens`` adds a
        cross-attention sub-block per layer to a context of that many tokens (a DiT's text).
        """
        kv_heads = num_kv_heads or num_heads
        head_dim = hidden_size // num_heads
        kv_width = kv_heads * head_dim
        ffn = ffn_hidden_size or 4 * hidden_size
        h = hidden_size
        attention_params = 2 * h * h + 2 * h * kv_width
        mlp_params = (3 if gated_mlp else 2) * h * ffn
        cross_params = 2 * h * h if cross_attention_tokens else 0  # q and out projections per video token
        block_params = attention_params + mlp_params + cross_params
        head_params = h * (vocab_size or output_channels)
        total_params = num_layers * (block_params + (2 * h * h if cross_attention_tokens else 0)) + head_params
        total_params += vocab_size * h + extra_parameters  # embeddings

        cross_core_flops = 4 * h * cross_attention_tokens  # q @ k^T and p @ v against the context
        linear_flops = num_layers * (2 * block_params + cross_core_flops) + 2 * head_params
        attention_flops = num_layers * 4 * h * (0.5 if causal else 1.0)

        # Activation elements per token per layer (multiply by dtype_bytes).
        attention_saved = 4 * h + 2 * kv_width  # norm in, qkv in, q/k/v, attention out
        mlp_saved = 2 * h + (4 * ffn if gated_mlp else 2 * ffn)  # norm in, fc1 in, fc1/gate/act outs
        cross_saved = 4 * h if cross_attention_tokens else 0
        none = attention_saved + mlp_saved + cross_saved
        attention_policy = h + mlp_saved + cross_saved  # the attention sub-block keeps only its input
        selective = h + (h + (2 * ffn if gated_mlp else ffn)) + (h if cross_attention_tokens else 0)
        full = h
        activation = {
            "none": none * dtype_bytes,
            "attention": attention_policy * dtype_bytes,
            "selective": selective * dtype_bytes,
            "full": full * dtype_bytes,
        }
        attention_linear_share = (attention_params + cross_params) / block_params
        recompute = {
            "none": (0.0, 0.0, 0.0),
            "attention": (attention_linear_share, 1.0, 0.4),
            "selective": (attention_linear_share, 1.0, 0.8),
            "full": (1.0, 1.0, 1.0),
        }
        return cls(
            name=name,
            num_layers=num_layers,
            num_attention_layers=num_layers,
            hidden_size=h,
            num_heads=num_heads,
            num_kv_heads=kv_heads,
            linear_flops_per_token=float(linear_flops),
            attention_flops_per_token_key=float(attention_flops),
            activation_bytes_per_token={k: float(v) for k, v in activation.items()},
            recompute_forward_fraction=recompute,
            memory_traffic_bytes_per_token=float(2 * none * dtype_bytes * num_layers),
            output_bytes_per_token=float((vocab_size * (dtype_bytes + 4)) if vocab_size else 2 * output_channels * dtype_bytes),
            parameter_bytes=float(total_params * dtype_bytes),
            gradient_bytes=float(total_params * gradient_dtype_bytes),
            optimizer_bytes=float(total_params * optimizer_bytes_per_parameter),
            activation_dtype_bytes=dtype_bytes,
            causal=causal,
        )

    @classmethod
    def from_config(cls, config: str | Mapping[str, Any] | Any) -> "ModelProfile":
        """A profile from a preset name, a dict, or a Hugging Face-style config object.

        Presets: ``"stdit3-xl/2"`` (alias ``"open-sora-v1.2"``): Open-Sora v1.2's 1.1B video DiT,
        28 spatial + 28 temporal blocks of width 1152, 16 heads, cross-attention to 300 T5 tokens
        (give samples ``span = (latent_frames + height_tokens * width_tokens) / 2``, see
        :func:`video_attention_span`); ``"llama-3-8b"``: 32 layers, width 4096, 32 heads with 8 KV
        heads, SwiGLU 14336, vocabulary 128256, causal. A dict or object is read for the usual Hugging
        Face field names (``hidden_size``, ``num_hidden_layers``, ``num_attention_heads``,
        ``num_key_value_heads``, ``intermediate_size``, ``vocab_size``).
        """
        if isinstance(config, str):
            key = config.lower().replace("_", "-")
            if key in ("stdit3-xl/2", "stdit3-xl-2", "open-sora-v1.2", "opensora-v1.2", "stdit3"):
                return cls.transformer(
                    "stdit3-xl/2",
                    num_layers=56,  # 28 spatial + 28 temporal blocks
                    hidden_size=1152,
                    num_heads=16,
                    ffn_hidden_size=4 * 1152,
                    causal=False,
                    cross_attention_tokens=300,
                    output_channels=2 * 4 * 4,  # learned sigma x 4 latent channels x 2x2 patch
                    extra_parameters=4096 * 1152 + 1152 * 1152 * 6,  # caption projection, t-embedder
                )
            if key in ("llama-3-8b", "llama3-8b", "meta-llama-3-8b"):
                return cls.transformer(
                    "llama-3-8b",
                    num_layers=32,
                    hidden_size=4096,
                    num_heads=32,
                    num_kv_heads=8,
                    ffn_hidden_size=14336,
                    gated_mlp=True,
                    vocab_size=128256,
                    causal=True,
                )
            raise ValueError(
                f"unknown model preset {config!r}; use 'stdit3-xl/2', 'llama-3-8b', a config dict, "
                "or ModelProfile.transformer(...) / ModelProfile.measure(...)"
            )

        def read(*names: str, default: Any = None) -> Any:
            for name in names:
                if isinstance(config, Mapping) and name in config:
                    return config[name]
                if not isinstance(config, Mapping) and hasattr(config, name):
                    return getattr(config, name)
            return default

        hidden = read("hidden_size", "d_model", "n_embd")
        layers = read("num_hidden_layers", "num_layers", "n_layer", "depth")
        heads = read("num_attention_heads", "num_heads", "n_head")
        if hidden is None or layers is None or heads is None:
            raise ValueError(
                "config lacks hidden_size / num_hidden_layers / num_attention_heads; "
                "pass them in a dict or use ModelProfile.transformer(...)"
            )
        activation = str(read("hidden_act", "activation_function", default="gelu")).lower()
        return cls.transformer(
            str(read("name_or_path", "_name_or_path", "model_type", default="transformer") or "transformer"),
            num_layers=int(layers),
            hidden_size=int(hidden),
            num_heads=int(heads),
            num_kv_heads=read("num_key_value_heads", default=None),
            ffn_hidden_size=read("intermediate_size", "ffn_hidden_size", "n_inner", default=None),
            gated_mlp=activation in ("silu", "swiglu", "swish"),
            vocab_size=int(read("vocab_size", default=0) or 0),
            causal=bool(read("is_causal", "causal", default=True)),
        )

    @classmethod
    def measure(
        cls,
        model: Any,
        make_inputs: Callable[[int], Any],
        lengths: Sequence[int] = (64, 128, 256),
        *,
        name: str | None = None,
        causal: bool = False,
        num_layers: int | None = None,
    ) -> "ModelProfile":
        """Count the model's forward FLOPs and saved-activation bytes at a few lengths and fit them.

        ``make_inputs(length)`` returns the model's inputs for one sample of ``length`` tokens (a dict
        of keyword arguments or a tuple). FLOPs come from ``torch.utils.flop_counter.FlopCounterMode``
        with the math SDPA kernel (so the attention matmuls are counted on CPU too) and are fitted as
        ``c0 + c1 * L + c2 * L^2``: ``c1`` is the linear term, ``c2`` the attention term (halved when
        ``causal``, because a flash kernel skips the masked half the math kernel computes).
        Activation bytes are what autograd saves (``saved_tensors_hooks``), less parameters. Attention
        layers, heads and width are read off the ``scaled_dot_product_attention`` calls. Cheap at
        the default lengths on a small model; no backward is run.
        """
        import torch
        from torch.nn.attention import SDPBackend, sdpa_kernel
        from torch.utils.flop_counter import FlopCounterMode

        if len(lengths) < 3:
            raise ValueError("ModelProfile.measure needs at least 3 lengths to fit linear and quadratic terms")
        parameters = list(model.parameters())
        parameter_storages = {p.untyped_storage().data_ptr() for p in parameters}
        flops: list[float] = []
        saved_bytes: list[float] = []
        attention_calls: list[tuple[int, int, int, int]] = []

        class _CountAttention(torch.overrides.TorchFunctionMode):
            def __torch_function__(self, func, types, args=(), kwargs=None):
                if func is torch.nn.functional.scaled_dot_product_attention:
                    query, key = args[0], args[1]
                    attention_calls.append((query.shape[-3], key.shape[-3], query.shape[-1], query.shape[-2]))
                return func(*args, **(kwargs or {}))

        was_training = model.training
        model.train()
        try:
            for index, length in enumerate(lengths):
                inputs = make_inputs(int(length))
                seen: dict[int, int] = {}

                def pack(tensor: "torch.Tensor") -> "torch.Tensor":
                    storage = tensor.untyped_storage()
                    if storage.data_ptr() not in parameter_storages:
                        seen[storage.data_ptr()] = storage.nbytes()
                    return tensor

                # FLOPs under the math kernel (counted on every device), without autograd.
                counter = FlopCounterMode(display=False)
                with torch.no_grad(), sdpa_kernel(SDPBackend.MATH), counter:
                    if index == 0:
                        with _CountAttention():
                            _call(model, inputs)
                    else:
                        _call(model, inputs)
                # Saved activations under the default (flash-style) kernel, which keeps no L x L buffer.
                with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                    _call(model, inputs)
                flops.append(float(counter.get_total_flops()))
                saved_bytes.append(float(sum(seen.values())))
        finally:
            model.train(was_training)

        c0, c1, c2 = _least_squares_polynomial([float(x) for x in lengths], flops, degree=2)
        c2 = max(c2, 0.0)
        if c1 <= 0:
            c1 = max(flops[-1] - c2 * lengths[-1] ** 2, 1.0) / lengths[-1]
        _, bytes_per_token, _ = _least_squares_polynomial([float(x) for x in lengths], saved_bytes, degree=1) + [0.0]
        bytes_per_token = max(bytes_per_token, 1.0)

        attention_layers = len(attention_calls)
        if attention_calls:
            heads, kv_heads, head_dim, _ = attention_calls[0]
        else:
            heads, kv_heads, head_dim = 1, 1, 1
        layers = num_layers or max(1, attention_layers)
        hidden = heads * head_dim
        dtype_bytes = parameters[0].element_size() if parameters else 4
        per_layer = bytes_per_token / layers
        activation = {
            "none": per_layer,
            "attention": per_layer * 0.85,
            "selective": per_layer * 0.45,
            "full": min(per_layer, float(hidden * dtype_bytes)),
        }
        parameter_bytes = float(sum(p.numel() * p.element_size() for p in parameters))
        parameter_count = float(sum(p.numel() for p in parameters))
        return cls(
            name=name or type(model).__name__,
            num_layers=layers,
            num_attention_layers=attention_layers,
            hidden_size=hidden,
            num_heads=heads,
            num_kv_heads=kv_heads,
            linear_flops_per_token=c1,
            attention_flops_per_token_key=c2 * (0.5 if causal else 1.0),
            activation_bytes_per_token=activation,
            recompute_forward_fraction={
                "none": (0.0, 0.0, 0.0),
                "attention": (0.3, 1.0, 0.4),
                "selective": (0.3, 1.0, 0.8),
                "full": (1.0, 1.0, 1.0),
            },
            memory_traffic_bytes_per_token=2 * bytes_per_token,
            output_bytes_per_token=0.0,
            parameter_bytes=parameter_bytes,
            gradient_bytes=parameter_bytes,
            optimizer_bytes=8 * parameter_count,
            activation_dtype_bytes=dtype_bytes,
            causal=causal,
        )

    # ------------------------------------------------------------------ io
    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["recompute_forward_fraction"] = {k: list(v) for k, v in self.recompute_forward_fraction.items()}
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "ModelProfile":
        data = dict(data)
        data["recompute_forward_fraction"] = {
            k: tuple(float(x) for x in v) for k, v in data["recompute_forward_fraction"].items()
        }
        data["activation_bytes_per_token"] = {k: float(v) for k, v in data["activation_bytes_per_token"].items()}
        return cls(**data)


def video_attention_span(latent_frames: int, height_tokens: int, width_tokens: int) -> float:
    """Mean keys per query of a spatial-temporal DiT (half its layers attend within a frame, half
    along time): the ``span`` to give the cost model and the sampler for such a sample."""
    return (latent_frames + height_tokens * width_tokens) / 2


def _call(model: Any, inputs: Any) -> Any:
    if isinstance(inputs, Mapping):
        return model(**inputs)
    if isinstance(inputs, tuple):
        return model(*inputs)
    return model(inputs)


def _least_squares_polynomial(xs: Sequence[float], ys: Sequence[float], degree: int) -> list[float]:
    """Coefficients (constant first) of the least-squares polynomial; x is scaled for conditioning."""
    scale = max(abs(x) for x in xs) or 1.0
    rows = [[(x / scale) ** k for k in range(degree + 1)] for x in xs]
    solution = _solve_least_squares(rows, list(ys), list(range(degree + 1)))
    return [solution[k] / scale**k for k in range(degree + 1)]


def _solve_least_squares(rows: Sequence[Sequence[float]], targets: Sequence[float], columns: Sequence[int]) -> dict[int, float]:
    """Least squares on the given columns through the normal equations (Gauss-Jordan with partial
    pivoting); a few unknowns only."""
    size = len(columns)
    normal = [[0.0] * (size + 1) for _ in range(size)]
    for row, target in zip(rows, targets):
        values = [row[c] for c in columns]
        for i in range(size):
            for j in range(size):
                normal[i][j] += values[i] * values[j]
            normal[i][size] += values[i] * target
    for pivot in range(size):
        best = max(range(pivot, size), key=lambda r: abs(normal[r][pivot]))
        normal[pivot], normal[best] = normal[best], normal[pivot]
        if abs(normal[pivot][pivot]) < 1e-300:
            continue
        for r in range(size):
            if r != pivot and normal[r][pivot]:
                factor = normal[r][pivot] / normal[pivot][pivot]
                for c in range(pivot, size + 1):
                    normal[r][c] -= factor * normal[pivot][c]
    return {
        columns[i]: (normal[i][size] / normal[i][i] if abs(normal[i][i]) > 1e-300 else 0.0) for i in range(size)
    }


def _non_negative_least_squares(rows: Sequence[Sequence[float]], targets: Sequence[float], columns: Sequence[int]) -> dict[int, float]:
    """Exact NNLS for a handful of unknowns: the best of the unconstrained fits on every subset of
    columns whose solution is non-negative (2^5 = 32 small solves)."""
    best: dict[int, float] | None = None
    best_error = math.inf
    for count in range(len(columns), 0, -1):
        for subset in itertools.combinations(columns, count):
            solution = _solve_least_squares(rows, targets, subset)
            if any(value < 0 for value in solution.values()):
                continue
            error = sum(
                (sum(row[c] * solution.get(c, 0.0) for c in columns) - target) ** 2
                for row, target in zip(rows, targets)
            )
            if error < best_error - 1e-18:
                best, best_error = solution, error
    return {c: (best or {}).get(c, 0.0) for c in columns}


# ---------------------------------------------------------------------------------------------
# Cost model
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class CalibrationPoint:
    """One profiled configuration: a micro-batch of ``lengths`` on ``sp_size`` ranks."""

    lengths: tuple[int, ...]
    sp_size: int
    recompute: str = "none"


@dataclass(frozen=True)
class CalibrationReport:
    """What :meth:`CostModel.calibrate` fitted and how well (relative errors per point)."""

    scales: dict[str, float]
    relative_errors: tuple[float, ...]
    fixed_terms: tuple[str, ...]

    @property
    def max_relative_error(self) -> float:
        return max((abs(e) for e in self.relative_errors), default=0.0)


@dataclass(frozen=True)
class CostModel:
    """Predicts time and peak memory of a micro-batch; see the module docstring.

    ``optimizer_shards`` divides the optimizer state (ZeRO-1 over the data-parallel world);
    ``reserved_bytes`` is what the runtime keeps for itself (CUDA context, NCCL and cuBLAS workspaces).
    Instances are immutable: every rank must plan with the same model, and a model that could change
    under a sampler would break that. :meth:`calibrate` returns a new one.
    """

    profile: ModelProfile
    hardware: Hardware
    scales: dict[str, float] = field(default_factory=lambda: dict(DEFAULT_SCALES))
    optimizer_shards: int = 1
    reserved_bytes: float = float(GiB)
    calibration: CalibrationReport | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        unknown = set(self.scales) - set(COST_TERMS)
        if unknown:
            raise ValueError(f"unknown cost terms {sorted(unknown)}; the terms are {COST_TERMS}")
        object.__setattr__(self, "scales", {**DEFAULT_SCALES, **self.scales})
        if self.optimizer_shards < 1:
            raise ValueError(f"optimizer_shards must be >= 1, got {self.optimizer_shards}")

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
    def raw_term_coefficients(self, sp_size: int, recompute: str) -> dict[str, tuple[float, float, float]]:
        """Unscaled seconds of each term as ``(fixed, per_token, per_token_key)`` coefficients."""
        return _raw_term_coefficients(self.profile, self.hardware, sp_size, recompute)

    def time_coefficients(self, sp_size: int, recompute: str = "none") -> TimeCoefficients:
        return _time_coefficients(self, sp_size, recompute)

    def memory_coefficients(self, sp_size: int, recompute: str = "none") -> MemoryCoefficients:
        return _memory_coefficients(self, sp_size, recompute)

    # ------------------------------------------------------------------ queries
    def terms(
        self,
        lengths: Sequence[int],
        sp_size: int,
        recompute: str = "none",
        spans: Sequence[float] | None = None,
    ) -> dict[str, float]:
        """Scaled seconds per term for one micro-batch."""
        tokens, token_keys = _token_sums(lengths, spans)
        raw = self.raw_term_coefficients(sp_size, recompute)
        return {
            term: self.scales[term] * (c[0] + c[1] * tokens + c[2] * token_keys) if tokens else 0.0
            for term, c in raw.items()
        }

    def time(
        self,
        lengths: Sequence[int],
        sp_size: int,
        recompute: str = "none",
        spans: Sequence[float] | None = None,
    ) -> float:
        """Seconds of one forward + backward of a micro-batch packing ``lengths`` on ``sp_size``
        ranks (every rank of the group takes this long); 0 for an empty micro-batch."""
        tokens, token_keys = _token_sums(lengths, spans)
        if not tokens:
            return 0.0
        return self.time_coefficients(sp_size, recompute).time(tokens, token_keys)

    def sequence_work(self, length: int, sp_size: int, recompute: str = "none", span: float | None = None) -> float:
        """Rank-seconds one sequence alone costs: ``sp_size * time([length])``."""
        return sp_size * self.time([length], sp_size, recompute, None if span is None else [span])

    def peak_memory(self, lengths: Sequence[int], sp_size: int, recompute: str = "none") -> float:
        """Peak bytes on each rank of the group while it trains on the micro-batch."""
        return self.memory_coefficients(sp_size, recompute).peak(sum(lengths))

    def token_capacity(self, sp_size: int, recompute: str, memory_cap: float) -> int:
        """The most tokens one micro-batch on ``sp_size`` ranks may hold under ``memory_cap`` bytes."""
        coefficients = self.memory_coefficients(sp_size, recompute)
        room = memory_cap - coefficients.fixed_bytes
        if room <= 0:
            return 0
        tokens = int(room // coefficients.bytes_per_token)
        while tokens > 0 and coefficients.peak(tokens) > memory_cap:  # guard float rounding
            tokens -= 1
        return tokens

    def fastest_feasible_recompute(self, tokens: int, sp_size: int, memory_cap: float) -> str | None:
        """The fastest policy under which ``tokens`` fit on ``sp_size`` ranks, or None."""
        for policy in RECOMPUTE_POLICIES:
            if self.memory_coefficients(sp_size, policy).peak(tokens) <= memory_cap:
                return policy
        return None

    # ------------------------------------------------------------------ calibration
    def calibrate(
        self,
        measure_fn: Callable[[Sequence[int], int, str], float],
        points: Iterable[CalibrationPoint | tuple],
        progress: bool = True,
    ) -> "CostModel":
        """Fit the per-term scale factors to measured times and return the calibrated model.

        ``measure_fn(lengths, sp_size, recompute)`` runs (or simulates) one micro-batch and returns
        its seconds. The fit is a non-negative least squares on *relative* errors (a 10 ms and a 10 s
        point count alike). A term that no point exercises (communication when every point has
        ``sp_size == 1``) keeps its previous scale and is listed in ``report.fixed_terms``.
        """
        from tqdm.auto import tqdm

        points = [p if isinstance(p, CalibrationPoint) else CalibrationPoint(tuple(p[0]), int(p[1]), *p[2:]) for p in points]
        if not points:
            raise ValueError("calibrate needs at least one point; see CostModel.calibration_points()")
        rows: list[list[float]] = []
        targets: list[float] = []
        for point in tqdm(points, desc="calibrating cost model", disable=not progress, leave=False):
            measured = float(measure_fn(list(point.lengths), point.sp_size, point.recompute))
            if not measured > 0:
                raise ValueError(f"measure_fn returned {measured!r} for {point}; it must return positive seconds")
            tokens, token_keys = _token_sums(point.lengths, None)
            raw = self.raw_term_coefficients(point.sp_size, point.recompute)
            row = [raw[t][0] + raw[t][1] * tokens + raw[t][2] * token_keys for t in COST_TERMS]
            rows.append([value / measured for value in row])  # relative-error weighting
            targets.append(1.0)
        active = [i for i, term in enumerate(COST_TERMS) if any(row[i] > 0 for row in rows)]
        fixed_terms = tuple(COST_TERMS[i] for i in range(len(COST_TERMS)) if i not in active)
        # Terms not exercised keep their scale: move their contribution to the target side.
        adjusted = [
            target - sum(row[i] * self.scales[COST_TERMS[i]] for i in range(len(COST_TERMS)) if i not in active)
            for row, target in zip(rows, targets)
        ]
        solution = _non_negative_least_squares(rows, adjusted, active)
        scales = dict(self.scales)
        for i in active:
            scales[COST_TERMS[i]] = solution[i]
        errors = tuple(sum(row[i] * scales[COST_TERMS[i]] for i in range(len(COST_TERMS))) - 1.0 for row in rows)
        report = CalibrationReport(scales=scales, relative_errors=errors, fixed_terms=fixed_terms)
        log.info("calibrated cost model %s: max relative error %.1f%%", scales, 100 * report.max_relative_error)
        return replace(self, scales=scales, calibration=report)

    def calibration_points(
        self,
        max_length: int,
        sp_sizes: Sequence[int] = (1, 2, 4),
        recompute: Sequence[str] = RECOMPUTE_POLICIES,
        min_length: int = 128,
    ) -> list[CalibrationPoint]:
        """A small design that separates the terms: one and several sequences (overhead vs. linear),
        short and long (linear vs. attention), every policy, and SP > 1 (communication)."""
        lengths: list[int] = []
        length = max(1, min_length)
        while length <= max_length:
            lengths.append(length)
            length *= 4
        if not lengths or lengths[-1] != max_length:
            lengths.append(max_length)
        points = []
        for sp in sp_sizes:
            for policy in recompute:
                for length in lengths:
                    points.append(CalibrationPoint((length,), sp, policy))
                points.append(CalibrationPoint((lengths[0],) * 4, sp, policy))
        return points

    # ------------------------------------------------------------------ io
    def to_dict(self) -> dict[str, Any]:
        return {
            "format": "dcp-compile cost model",
            "version": 1,
            "profile": self.profile.to_dict(),
            "hardware": self.hardware.to_dict(),
            "scales": dict(self.scales),
            "optimizer_shards": self.optimizer_shards,
            "reserved_bytes": self.reserved_bytes,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "CostModel":
        if data.get("format") != "dcp-compile cost model":
            raise ValueError("not a dcp-compile cost model file (missing format tag); write it with CostModel.save")
        return cls(
            profile=ModelProfile.from_dict(data["profile"]),
            hardware=Hardware.from_dict(data["hardware"]),
            scales={k: float(v) for k, v in data["scales"].items()},
            optimizer_shards=int(data.get("optimizer_shards", 1)),
            reserved_bytes=float(data.get("reserved_bytes", GiB)),
        )

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write the model as JSON (write-then-rename, so a reader never sees half a file)."""
        temporary = f"{os.fspath(path)}.tmp"
        with open(temporary, "w") as handle:
            json.dump(self.to_dict(), handle, indent=2, sort_keys=True)
        os.replace(temporary, path)

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> "CostModel":
        with open(path) as handle:
            return cls.from_dict(json.load(handle))


def _token_sums(lengths: Sequence[int], spans: Sequence[float] | None) -> tuple[int, float]:
    tokens = sum(lengths)
    if spans is None:
        token_keys = float(sum(length * length for length in lengths))
    else:
        if len(spans) != len(lengths):
            raise ValueError(f"got {len(spans)} spans for {len(lengths)} lengths; give one span per sequence")
        token_keys = float(sum(length * span for length, span in zip(lengths, spans)))
    return tokens, token_keys


def _check_policy(recompute: str) -> None:
    RecomputePolicy.parse(recompute)


def _raw_term_coefficients(
    profile: ModelProfile, hardware: Hardware, sp_size: int, recompute: str
) -> dict[str, tuple[float, float, float]]:
    _check_policy(recompute)
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
    if sp_size > 1:
        kv_width = profile.head_dim * max(profile.num_kv_heads, sp_size)  # GQA replicates KV heads
        bytes_per_token_per_layer = profile.activation_dtype_bytes * (2 * profile.hidden_size + 2 * kv_width)
        # 4 all-to-alls forward (q, k, v, out) and the same 4 backward, per attention layer.
        volume_per_token = 2 * profile.num_attention_layers * bytes_per_token_per_layer / sp_size
        communication_per_token = volume_per_token * hardware.all_to_all_seconds_per_byte(sp_size)
        communication_fixed = 8 * profile.num_attention_layers * hardware.all_to_all_latency(sp_size)
    else:
        communication_per_token = communication_fixed = 0.0
    overhead = profile.num_layers * hardware.layer_overhead_s
    return {
        "linear": (0.0, linear, 0.0),
        "attention": (0.0, 0.0, attention),
        "memory": (memory_fixed, memory_per_token, 0.0),
        "communication": (communication_fixed, communication_per_token, 0.0),
        "overhead": (overhead, 0.0, 0.0),
    }


@lru_cache(maxsize=4096)
def _time_coefficients(model: CostModel, sp_size: int, recompute: str) -> TimeCoefficients:
    raw = model.raw_term_coefficients(sp_size, recompute)
    totals = [0.0, 0.0, 0.0]
    for term, coefficients in raw.items():
        scale = model.scales[term]
        for i in range(3):
            totals[i] += scale * coefficients[i]
    return TimeCoefficients(*totals)


@lru_cache(maxsize=4096)
def _memory_coefficients(model: CostModel, sp_size: int, recompute: str) -> MemoryCoefficients:
    _check_policy(recompute)
    profile = model.profile
    static = (
        profile.parameter_bytes
        + profile.gradient_bytes
        + profile.optimizer_bytes / model.optimizer_shards
        + model.reserved_bytes
    )
    per_layer = profile.activation_bytes_per_token[recompute]
    if sp_size > 1 and recompute in ("selective", "full"):
        # Collective outputs (q, k, v after the all-to-all, the gathered output) are always saved.
        kv_width = profile.head_dim * max(profile.num_kv_heads, sp_size)
        per_layer += profile.activation_dtype_bytes * (2 * profile.hidden_size + 2 * kv_width)
    working_layer = profile.activation_bytes_per_token["none"]  # one layer's full set during its backward
    all_to_all_buffers = (
        2 * profile.activation_dtype_bytes * (2 * profile.hidden_size + 2 * profile.head_dim * profile.num_kv_heads)
        if sp_size > 1 else 0.0
    )
    per_token = (
        profile.num_layers * per_layer + working_layer + profile.output_bytes_per_token + all_to_all_buffers
    ) / sp_size
    return MemoryCoefficients(static, per_token)
