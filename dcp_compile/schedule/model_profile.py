"""What the cost model needs to know about one model: per-token FLOPs, saved bytes, model state.

Build one from a transformer's shape (:meth:`ModelProfile.transformer`, accounting in
:mod:`.presets`), a preset name or Hugging Face config (:meth:`ModelProfile.from_config`), or by
counting a real model (:meth:`ModelProfile.measure`, in :mod:`.profiling`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Mapping, Sequence

from dcp_compile.variant import RECOMPUTE_POLICIES, RecomputePolicy

from .presets import config_shape, preset_shape, transformer_fields
from .profiling import measure_fields


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
            attention layers and already halved for causal masks (see the module docstring of
            :mod:`.cost_model` for ``span``).
        activation_bytes_per_token: bytes per token *per layer* kept for backward at SP 1, per
            recompute policy (:class:`~dcp_compile.variant.RecomputePolicy` names; what each
            keeps is spelled out in :mod:`.presets`).
        recompute_forward_fraction: per policy, the fractions of the forward's (linear, attention,
            memory-bound) work that backward runs again.
        memory_traffic_bytes_per_token: forward bytes read and written per token by memory-bound
            ops over all layers.
        output_bytes_per_token: transient bytes per token of the head and loss (logits).
        parameter_bytes / gradient_bytes / optimizer_bytes: model state per replica (the optimizer
            state may be sharded, see ``CostModel.optimizer_shards``).
        head_activation_bytes_per_token: bytes per token kept for backward outside the blocks
            (final norm, output head, loss; under ``full`` only what every block reads from
            outside, such as a shared RoPE table), per policy; zeros when not given.
        context_flops_per_sequence: forward FLOPs per *sample* that do not depend on its length
            and that every rank of an SP group repeats: the key/value projections of a
            conditioning context (a DiT's text) in every cross-attention. The context is not a
            sequence-indexed value, so neither the published model nor our compiler shards it.
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
    head_activation_bytes_per_token: dict[str, float] = field(default_factory=dict)
    context_flops_per_sequence: float = 0.0

    def __post_init__(self) -> None:
        if not self.head_activation_bytes_per_token:
            object.__setattr__(self, "head_activation_bytes_per_token", {p.value: 0.0 for p in RECOMPUTE_POLICIES})
        missing = [p for p in RECOMPUTE_POLICIES if p not in self.activation_bytes_per_token]
        missing += [p for p in RECOMPUTE_POLICIES if p not in self.recompute_forward_fraction]
        missing += [p for p in RECOMPUTE_POLICIES if p not in self.head_activation_bytes_per_token]
        if missing:
            raise ValueError(
                f"ModelProfile {self.name!r} lacks entries for recompute policies {sorted({str(p) for p in missing})}; "
                f"give activation_bytes_per_token, recompute_forward_fraction (and head_activation_bytes_per_token, "
                f"if any) for all of {tuple(p.value for p in RECOMPUTE_POLICIES)}"
            )
        if self.num_heads % max(1, self.num_kv_heads):
            raise ValueError(f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    # ------------------------------------------------------------------ saved activations
    def saved_activation_bytes_per_token(
        self, recompute: RecomputePolicy | str, sp_size: int = 1, collectives_recomputed: bool = False,
    ) -> float:
        """Bytes per token of a rank's share that backward keeps under ``recompute`` on ``sp_size``
        ranks: the layers' activations, what the head and loss keep and, under sequence
        parallelism, the all-to-all outputs that every policy keeps (re-sending one costs more
        than storing it).

        At SP > 1 each attention layer keeps q, k and v as the all-to-alls deliver them (KV heads
        replicated up to the SP size), in place of the local q, k, v that ``none`` keeps at SP 1;
        ``attention`` keeps them too (its recomputation stops at the all-to-alls), and
        ``selective`` and ``full`` also keep the output all-to-all's result.

        ``collectives_recomputed``: whole-block checkpointing as the published system does it
        (``torch.utils.checkpoint`` around each block): under ``full`` a block keeps only its
        input, the all-to-alls inside it run again in backward (priced as time by
        :func:`.analytic.raw_term_coefficients`), so nothing per layer depends on the SP size.
        """
        recompute = RecomputePolicy.parse(recompute)
        saved = self.num_layers * self.activation_bytes_per_token[recompute]
        saved += self.head_activation_bytes_per_token[recompute]
        if collectives_recomputed and recompute == RecomputePolicy.FULL:
            return float(saved)
        if sp_size > 1:
            dtype = self.activation_dtype_bytes
            qkv_local = dtype * (self.hidden_size + 2 * self.head_dim * self.num_kv_heads)
            qkv_delivered = dtype * (self.hidden_size + 2 * self.head_dim * max(self.num_kv_heads, sp_size))
            output = dtype * self.hidden_size
            kept = {
                RecomputePolicy.NONE: qkv_delivered - qkv_local,
                RecomputePolicy.ATTENTION: qkv_delivered,
                RecomputePolicy.SELECTIVE: qkv_delivered + output,
                RecomputePolicy.FULL: qkv_delivered + output,
            }[recompute]
            saved += self.num_attention_layers * kept
        return float(saved)

    def saved_activation_bytes(
        self, tokens: int, recompute: RecomputePolicy | str, sp_size: int = 1, collectives_recomputed: bool = False,
    ) -> float:
        """Bytes each rank keeps for backward for a micro-batch of ``tokens`` tokens: the priced
        counterpart of the compiler's ``VariantRecord.saved_activation_bytes``."""
        return self.saved_activation_bytes_per_token(recompute, sp_size, collectives_recomputed) * tokens / sp_size

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
        rotary: bool = False,
        dtype_bytes: int = 2,
        gradient_dtype_bytes: int = 4,
        optimizer_bytes_per_parameter: int = 12,
        extra_parameters: int = 0,
    ) -> "ModelProfile":
        """A profile from the shape of a standard pre-norm transformer.

        Counts matmul FLOPs exactly (2 per multiply-add) and the bytes each recompute policy keeps
        as the compiler builds it, with flash-attention accounting (no quadratic buffer); see
        :mod:`.presets`. ``cross_attention_tokens`` adds a cross-attention sub-block per layer to a
        context of that many tokens (a DiT's text). ``rotary``: the model builds one RoPE table
        (cos, sin) outside its blocks and hands it to every block, so ``full`` keeps it as a
        block input.
        """
        return cls(**transformer_fields(
            name, num_layers=num_layers, hidden_size=hidden_size, num_heads=num_heads, num_kv_heads=num_kv_heads,
            ffn_hidden_size=ffn_hidden_size, gated_mlp=gated_mlp, vocab_size=vocab_size, causal=causal,
            cross_attention_tokens=cross_attention_tokens, output_channels=output_channels, rotary=rotary,
            dtype_bytes=dtype_bytes,
            gradient_dtype_bytes=gradient_dtype_bytes, optimizer_bytes_per_parameter=optimizer_bytes_per_parameter,
            extra_parameters=extra_parameters,
        ))

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
        name, shape = preset_shape(config) if isinstance(config, str) else config_shape(config)
        return cls.transformer(name, **shape)

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

        ``make_inputs(length)`` returns the model's inputs for one sample of ``length`` tokens (a
        dict of keyword arguments or a tuple). Details in :func:`.profiling.measure_fields`. Cheap
        at the default lengths on a small model; no backward is run.
        """
        return cls(**measure_fields(model, make_inputs, lengths, name=name, causal=causal, num_layers=num_layers))

    # ------------------------------------------------------------------ io
    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        for key in ("activation_bytes_per_token", "head_activation_bytes_per_token"):
            data[key] = {str(k): float(v) for k, v in data[key].items()}
        data["recompute_forward_fraction"] = {str(k): list(v) for k, v in self.recompute_forward_fraction.items()}
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "ModelProfile":
        """The profile :meth:`to_dict` wrote (files without ``head_activation_bytes_per_token``, from
        before it was priced, load with zeros there)."""
        data = dict(data)
        data["recompute_forward_fraction"] = {
            k: tuple(float(x) for x in v) for k, v in data["recompute_forward_fraction"].items()
        }
        for key in ("activation_bytes_per_token", "head_activation_bytes_per_token"):
            if key in data:
                data[key] = {k: float(v) for k, v in data[key].items()}
        return cls(**data)


def video_attention_span(latent_frames: int, height_tokens: int, width_tokens: int) -> float:
    """Mean keys per query of a spatial-temporal DiT (half its layers attend within a frame, half
    along time): the ``span`` to give the cost model and the sampler for such a sample."""
    return (latent_frames + height_tokens * width_tokens) / 2
