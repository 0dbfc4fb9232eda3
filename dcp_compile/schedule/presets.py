"""Profiles from a model's shape: the standard pre-norm transformer, named presets, Hugging Face configs.

:func:`transformer_fields` is the accounting behind :meth:`ModelProfile.transformer`: matmul
FLOPs (2 per multiply-add), and the bytes per token that backward keeps under each recompute
policy, priced as the compiler builds the policies (``dcp_compile/compiler/passes/recompute.py``,
vocabulary in :class:`dcp_compile.variant.RecomputePolicy`):

* ``none``: everything autograd saves. Per layer: the norm inputs and their mean/rstd, the q/k/v
  projection input, q, k, v, the attention output and its logsumexp, the output projection's
  input (the ``[B, S, hidden]`` copy of the attention output), the MLP input, its hidden
  activations (``fc1`` and activation outputs; gate, up, activation and product for a gated MLP);
* ``attention``: recompute each attention and what makes its q, k, v back to (and including)
  their projections: q, k, v, the attention output and logsumexp go; the projections' input, the
  output projection's input and the MLP stay;
* ``selective``: ``attention`` plus every op that is not a matrix product: only matmul outputs
  stay (the output projection, the MLP's ``fc1`` (gate, up) and ``fc2``; the q/k/v projections
  are recomputed with the attention);
* ``full``: recompute every block from its input, which is kept: one ``[hidden]`` vector per
  token per layer. The head (final norm, output head, loss) keeps nothing of its own: the ops
  outside the blocks form one region whose partitioner id is the lowest, so the last block's
  output is not a saved boundary and backward recomputes the last block and the head from the
  last block's input (the head's matmul is in the ``full`` recompute fraction already). What the
  ops outside the blocks hand to every block is kept as a block input too: a RoPE table built
  once in the model (``rotary=True``: cos and sin, ``head_dim`` each per token);
* ``block``: ``full``'s set at SP 1 (the block input, the shared RoPE table); at SP > 1 it keeps
  no all-to-all output either, as its backward sends them again.

``adaptive_norm`` (adaLN-Zero / adaLN-single DiTs: PixArt, STDiT3, Wan) adds, under ``none`` and
``attention``, what the modulation and the gates keep: each modulated norm's output (the scale's
gradient needs it) and each gated branch's output before its gate (the gate's gradient needs it).

Under sequence parallelism the all-to-all outputs are kept under every policy but ``block`` (see
:meth:`ModelProfile.saved_activation_bytes_per_token`). What lies outside the blocks (final norm,
output head, loss, a shared RoPE table) is priced per policy in ``head_activation_bytes_per_token``.

A language model's loss is tiled under every policy but ``none`` (:mod:`dcp_compile.tiled_loss`,
the compiler's ``tile_loss`` pass): the output projection and cross-entropy run over chunks of
``loss_chunk_tokens`` tokens (default: the backend's, :func:`dcp_compile.tiled_loss.default_chunk_tokens`)
and backward recomputes each chunk's logits. Under those policies the
head keeps no fp32 log-probabilities and its backward holds no ``[tokens, vocab]`` gradient: what
one chunk holds is a fixed amount (:func:`dcp_compile.tiled_loss.loss_chunk_bytes`, in the
micro-batch's fixed bytes), and the forward work backward runs again includes one output-projection
matmul under ``attention`` and ``selective`` (``full`` and ``block`` recompute the head anyway).
``loss_chunk_tokens=0`` prices a loss the compiler does not tile (``disable_passes=["tile_loss"]``).

Besides what is kept, backward holds a working set (:func:`layer_recomputed_bytes` and
:meth:`ModelProfile.backward_working_bytes_per_token`): what a layer's backward recomputes (per
sub-block: the attention's just before the attention's backward, the MLP's before the MLP's; under
``full`` the whole block at once) and the activation gradients alive while it runs.
Not priced: the RoPE table under the other policies (the partitioner recomputes it from the
positions, or under ``none`` keeps the angles: ``head_dim`` per token, under 1% of what ``none``
keeps); ``tests/test_recompute_pricing.py`` compares this accounting with what the compiled
variants save.
"""

from __future__ import annotations

from typing import Any, Mapping

from dcp_compile.tiled_loss import default_chunk_tokens
from dcp_compile.variant import RecomputePolicy, checkpoints_whole_blocks

FP32_BYTES = 4  # norm statistics, attention logsumexp and the loss run in fp32 whatever the dtype
TARGET_BYTES = 8  # int64 class targets the loss keeps


def transformer_fields(
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
    adaptive_norm: bool = False,
    dtype_bytes: int = 2,
    gradient_dtype_bytes: int = 4,
    optimizer_bytes_per_parameter: int = 12,
    extra_parameters: int = 0,
    loss_chunk_tokens: int | None = None,
    fused_qkv: bool = False,
) -> dict[str, Any]:
    """The :class:`ModelProfile` fields of a standard pre-norm transformer (see the module docstring)."""
    kv_heads = num_kv_heads or num_heads
    head_dim = hidden_size // num_heads
    kv_width = kv_heads * head_dim
    ffn = ffn_hidden_size or 4 * hidden_size
    h = hidden_size
    qkv_params = h * h + 2 * h * kv_width
    attention_params = qkv_params + h * h
    mlp_params = (3 if gated_mlp else 2) * h * ffn
    cross_params = 2 * h * h if cross_attention_tokens else 0  # q and out projections per video token
    block_params = attention_params + mlp_params + cross_params
    head_params = h * (vocab_size or output_channels)
    total_params = num_layers * (block_params + (2 * h * h if cross_attention_tokens else 0)) + head_params
    total_params += vocab_size * h + extra_parameters  # embeddings

    cross_core_flops = 4 * h * cross_attention_tokens  # q @ k^T and p @ v against the context
    # The context's key and value projections in every cross-attention: per sample, not per token.
    context_flops = num_layers * 2 * (2 * h * h) * cross_attention_tokens
    linear_flops = num_layers * (2 * block_params + cross_core_flops) + 2 * head_params
    attention_flops = num_layers * 4 * h * (0.5 if causal else 1.0)

    shape = dict(hidden_size=h, num_heads=num_heads, kv_width=kv_width, ffn_hidden_size=ffn, gated_mlp=gated_mlp,
                 cross_attention=bool(cross_attention_tokens), dtype_bytes=dtype_bytes, adaptive_norm=adaptive_norm)
    activation = layer_activation_bytes(**shape)
    # A fused projection with rotated q and k: v is a view that keeps the whole projection alive
    # beside the rotated copies (``attention_input_storage_bytes_per_token``), so ``none`` keeps
    # ``h + kv`` more per token than the standard block's separate q, k, v.
    storage = float(dtype_bytes * (2 * h + 3 * kv_width)) if fused_qkv and rotary else 0.0
    activation["none"] += max(0.0, storage - dtype_bytes * (h + 2 * kv_width))
    recomputed = layer_recomputed_bytes(**shape)
    if loss_chunk_tokens is None:  # the backend's default chunk for this vocabulary
        loss_chunk_tokens = default_chunk_tokens(vocab_size, dtype_bytes) if vocab_size else 0
    tiled = bool(vocab_size) and loss_chunk_tokens > 0
    head = head_activation_bytes(
        hidden_size=h, vocab_size=vocab_size, output_channels=output_channels, dtype_bytes=dtype_bytes,
        rotary_dim=head_dim if rotary else 0, adaptive_norm=adaptive_norm, tiled=tiled,
    )
    # Forward work backward runs again, as fractions of (matmul FLOPs, attention FLOPs, memory-bound
    # traffic). Matmuls: the q/k/v projections under ``attention`` and ``selective`` (the output
    # projection and the MLP keep their outputs), every one under ``full``. Memory-bound traffic
    # (proportional to the bytes ``none`` keeps): the ops between the q/k/v projections and the
    # attention (RoPE, head layout) under ``attention``; every non-matmul op under ``selective``.
    qkv_linear_share = (qkv_params + (h * h if cross_attention_tokens else 0)) / block_params
    none_elements = activation["none"] / dtype_bytes
    qkv_memory_share = min(1.0, (h + 2 * kv_width) / none_elements)
    # The tiled loss recomputes the output projection in backward (one matmul of the head) under
    # `attention` and `selective`; `full` and `block` recompute it anyway.
    head_share = 2 * head_params / linear_flops if tiled else 0.0
    mlp_linear_share = num_layers * 2 * mlp_params / linear_flops
    mlp_memory_share = min(1.0, (4 if gated_mlp else 2) * ffn * dtype_bytes / activation["none"])
    recompute = {
        "none": (0.0, 0.0, 0.0),
        "attention": (qkv_linear_share + head_share, 1.0, qkv_memory_share),
        "selective": (qkv_linear_share + head_share, 1.0, 1.0),
        "full": (1.0, 1.0, 1.0),
        "block": (1.0, 1.0, 1.0),  # the same forward again; what differs is communication (analytic.py)
        "offload": (1.0, 1.0, 1.0),  # block's work; the host copies are priced as communication
        # The tiled MLP's backward runs each chunk's MLP forward once more.
        "lean": (1.0 + mlp_linear_share, 1.0, 1.0 + mlp_memory_share),
    }
    return dict(
        name=name,
        num_layers=num_layers,
        num_attention_layers=num_layers,
        hidden_size=h,
        num_heads=num_heads,
        num_kv_heads=kv_heads,
        linear_flops_per_token=float(linear_flops),
        attention_flops_per_token_key=float(attention_flops),
        activation_bytes_per_token=activation,
        recompute_forward_fraction=recompute,
        memory_traffic_bytes_per_token=float(2 * activation["none"] * num_layers),
        output_bytes_per_token=float(loss_gradient_bytes(vocab_size, output_channels, dtype_bytes)),
        parameter_bytes=float(total_params * dtype_bytes),
        gradient_bytes=float(total_params * gradient_dtype_bytes),
        optimizer_bytes=float(total_params * optimizer_bytes_per_parameter),
        activation_dtype_bytes=dtype_bytes,
        causal=causal,
        head_activation_bytes_per_token=head,
        context_flops_per_sequence=float(context_flops),
        ffn_hidden_size=ffn,
        gated_mlp=gated_mlp,
        recomputed_bytes_per_token=recomputed,
        num_cross_attention_layers=num_layers if cross_attention_tokens else 0,
        vocab_size=int(vocab_size),
        loss_chunk_tokens=int(loss_chunk_tokens) if tiled else 0,
        # A fused projection (h + 2 kv wide) alive behind v's view, beside the rotated q and k copies.
        attention_input_storage_bytes_per_token=storage,
    )


def loss_gradient_bytes(vocab_size: int, output_channels: int, dtype_bytes: int) -> int:
    """Bytes per token the head's backward holds at once beyond what is kept: for a language model
    the fp32 gradient of the log-probabilities (``nll_loss_backward``, dense) and of the logits
    (``_log_softmax_backward_data``), alive together; for a regression head the gradient of the
    error and of the prediction."""
    if vocab_size:
        return 2 * vocab_size * FP32_BYTES
    return 2 * output_channels * dtype_bytes


def layer_activation_bytes(
    *,
    hidden_size: int,
    num_heads: int,
    kv_width: int,
    ffn_hidden_size: int,
    gated_mlp: bool,
    cross_attention: bool,
    dtype_bytes: int,
    adaptive_norm: bool = False,
) -> dict[str, float]:
    """Bytes per token one block keeps for backward, per recompute policy, at SP 1."""
    h, ffn = hidden_size, ffn_hidden_size
    # Elements of the activation dtype. Self-attention: norm input, q/k/v projection input, q, k, v,
    # attention output, output projection input; of which ``attention`` keeps the first two and the last.
    attention_all, attention_kept = 5 * h + 2 * kv_width, 3 * h
    # Cross-attention to a fixed context (its keys and values are per sample, not per token):
    # q projection input, q, attention output, output projection input.
    cross_all, cross_kept = (4 * h, 2 * h) if cross_attention else (0, 0)
    # MLP: norm input, fc1 input, then fc1 and activation outputs (gated: gate, up, act(gate), product).
    mlp_all = 2 * h + (4 if gated_mlp else 2) * ffn
    # Matmul outputs, what ``selective`` keeps: output projection(s), fc1 (gate and up), fc2.
    matmul_outputs = h + (h if cross_attention else 0) + (2 if gated_mlp else 1) * ffn + h
    # fp32: each norm's mean and rstd (2 norms), each attention's logsumexp (one per head).
    norm_stats = 2 * 2
    logsumexp = num_heads * (2 if cross_attention else 1)
    # adaLN: the two modulated norms' outputs and the two gated branches' outputs (self-attention
    # and MLP; the cross-attention is not gated). ``selective`` keeps the branch outputs already
    # (matmul outputs) and recomputes the norms; ``full`` keeps neither.
    modulation = 4 * h if adaptive_norm else 0
    return {
        RecomputePolicy.NONE.value: float((attention_all + cross_all + mlp_all + modulation) * dtype_bytes
                                          + (norm_stats + logsumexp) * FP32_BYTES),
        RecomputePolicy.ATTENTION.value: float((attention_kept + cross_kept + mlp_all + modulation) * dtype_bytes
                                               + norm_stats * FP32_BYTES),
        RecomputePolicy.SELECTIVE.value: float(matmul_outputs * dtype_bytes),
        RecomputePolicy.FULL.value: float(h * dtype_bytes),
        # The block input, as under `full` (what `full` keeps beyond it at SP > 1, the all-to-alls'
        # outputs, `block` does not: ModelProfile.attention_kept_bytes_per_token).
        RecomputePolicy.BLOCK.value: float(h * dtype_bytes),
        # The block input again: where it lives (host memory) is ModelProfile's business.
        RecomputePolicy.OFFLOAD.value: float(h * dtype_bytes),
        RecomputePolicy.LEAN.value: float(h * dtype_bytes),
    }


def layer_recomputed_bytes(
    *,
    hidden_size: int,
    num_heads: int,
    kv_width: int,
    ffn_hidden_size: int,
    gated_mlp: bool,
    cross_attention: bool,
    dtype_bytes: int,
    adaptive_norm: bool = False,
) -> dict[str, tuple[float, float]]:
    """Bytes per token one block's backward rebuilds, per policy, as ``(attention part, MLP part)``
    at SP 1: what the partitioner recomputes just before that sub-block's backward and frees after
    it (under ``full`` the whole block is rebuilt at once, before the MLP's backward, and the
    attention part lives on to the attention's).

    The parts split :func:`layer_activation_bytes`'s ``none`` set: the MLP part is its norm's
    input and statistics, ``fc1``'s input and outputs and the activation's output (adaLN: the
    norm's output and the MLP's output before its gate); the rest is the attention part (both
    attentions and their norms). ``attention`` rebuilds q, k, v, the attention output and its
    logsumexp; ``selective`` everything but the matmul outputs (the MLP's ``fc1``/gate and up
    outputs stay, and with adaLN the gated branches' outputs; the other matmul outputs it keeps
    are not in the ``none`` set); ``full`` everything but the block input."""
    h, ffn = hidden_size, ffn_hidden_size
    d, f = dtype_bytes, FP32_BYTES
    mlp_elements = 2 * h + (4 if gated_mlp else 2) * ffn + (2 * h if adaptive_norm else 0)
    mlp_none = mlp_elements * d + 2 * f
    none = layer_activation_bytes(
        hidden_size=h, num_heads=num_heads, kv_width=kv_width, ffn_hidden_size=ffn, gated_mlp=gated_mlp,
        cross_attention=cross_attention, dtype_bytes=d, adaptive_norm=adaptive_norm,
    )[RecomputePolicy.NONE.value]
    attention_none = none - mlp_none
    logsumexp = num_heads * (2 if cross_attention else 1)
    # `attention`: q, k, v and the attention output (and the cross-attention's q and output), logsumexps.
    attention_rebuilt = (h + 2 * kv_width + h + (2 * h if cross_attention else 0)) * d + logsumexp * f
    # Matmul outputs in the ``none`` set, which ``selective`` keeps: fc1 (gate and up); with adaLN
    # also each gated branch's output (the output projection's and fc2's).
    branch_output = h * d if adaptive_norm else 0
    mlp_matmuls_in_none = (2 if gated_mlp else 1) * ffn * d + branch_output
    return {
        RecomputePolicy.NONE.value: (0.0, 0.0),
        RecomputePolicy.ATTENTION.value: (float(attention_rebuilt), 0.0),
        RecomputePolicy.SELECTIVE.value: (float(attention_none - branch_output), float(mlp_none - mlp_matmuls_in_none)),
        RecomputePolicy.FULL.value: (float(attention_none - h * d), float(mlp_none)),
        RecomputePolicy.BLOCK.value: (float(attention_none - h * d), float(mlp_none)),
        RecomputePolicy.OFFLOAD.value: (float(attention_none - h * d), float(mlp_none)),
        # The tiled MLP rebuilds its norm and its input whole, its ffn-wide tensors a chunk at a
        # time (a fixed amount: dcp_compile.tiled_mlp.mlp_chunk_bytes).
        RecomputePolicy.LEAN.value: (float(attention_none - h * d), float(mlp_none - (4 if gated_mlp else 2) * ffn * d)),
    }


def head_activation_bytes(
    *, hidden_size: int, vocab_size: int, output_channels: int, dtype_bytes: int, rotary_dim: int = 0,
    adaptive_norm: bool = False, tiled: bool = False,
) -> dict[str, float]:
    """Bytes per token kept outside the blocks (final norm, output head, loss, a shared RoPE table), per policy.

    ``none`` and ``attention`` keep the final norm's input, statistics and output (the head's
    input) and the loss's fp32 log-probabilities (a language model: plus its int64 targets) or
    prediction; ``selective`` keeps the head's matmul output (the logits); ``full`` keeps nothing
    of the head (not even the last block's output: the head is recomputed, with the last block,
    from the last block's input, which the layers' ``full`` entry counts) but keeps what every
    block reads from outside: a RoPE table built once in the model, cos and sin of
    ``rotary_dim`` each per token (0: none). ``adaptive_norm``: the final norm's output is
    modulated, so ``none`` and ``attention`` keep it too.

    ``tiled`` (a language model whose loss the compiler tiles under every policy but ``none``):
    ``attention`` keeps the final norm's input, statistics and output (the tiled loss's input) and
    the targets, no log-probabilities; ``selective`` keeps nothing of the head (no logits: the
    tiled loss recomputes them, and the norm is recomputed from the last block's output, which
    the layers' entries price), only the targets.
    """
    rotary_table = float(2 * rotary_dim * dtype_bytes)
    if not vocab_size and not output_channels:
        return {policy.value: rotary_table if policy is RecomputePolicy.FULL or checkpoints_whole_blocks(policy) else 0.0
                for policy in RecomputePolicy}
    h = hidden_size
    if vocab_size:
        loss_kept = vocab_size * FP32_BYTES + TARGET_BYTES
        matmul_output = vocab_size * dtype_bytes
    else:
        loss_kept = output_channels * FP32_BYTES
        matmul_output = output_channels * dtype_bytes
    kept = (3 if adaptive_norm else 2) * h * dtype_bytes + 2 * FP32_BYTES + loss_kept
    tiled = tiled and bool(vocab_size)
    return {
        RecomputePolicy.NONE.value: float(kept),
        RecomputePolicy.ATTENTION.value: float(kept - vocab_size * FP32_BYTES if tiled else kept),
        RecomputePolicy.SELECTIVE.value: float(TARGET_BYTES if tiled else matmul_output),
        RecomputePolicy.FULL.value: rotary_table,
        RecomputePolicy.BLOCK.value: rotary_table,
        RecomputePolicy.OFFLOAD.value: rotary_table,
        RecomputePolicy.LEAN.value: rotary_table,
    }


# ---------------------------------------------------------------------------------------------
# Named presets and configs
# ---------------------------------------------------------------------------------------------
PRESETS: dict[str, dict[str, Any]] = {
    # Open-Sora v1.2's 1.1B video DiT: 28 spatial + 28 temporal blocks, cross-attention to 300 T5 tokens.
    "stdit3-xl/2": dict(
        num_layers=56,
        hidden_size=1152,
        num_heads=16,
        ffn_hidden_size=4 * 1152,
        causal=False,
        cross_attention_tokens=300,
        output_channels=2 * 4 * 4,  # learned sigma x 4 latent channels x 2x2 patch
        extra_parameters=4096 * 1152 + 1152 * 1152 * 6,  # caption projection, t-embedder
        adaptive_norm=True,  # STDiT3Block: t2i_modulate(norm1(x)), gate_msa * attn, ..., gate_mlp * mlp
    ),
    "llama-3-8b": dict(
        num_layers=32,
        hidden_size=4096,
        num_heads=32,
        num_kv_heads=8,
        ffn_hidden_size=14336,
        gated_mlp=True,
        vocab_size=128256,
        causal=True,
        rotary=True,  # Hugging Face Llama builds cos/sin once and hands them to every layer
    ),
}
ALIASES: dict[str, str] = {
    "stdit3-xl/2": "stdit3-xl/2", "stdit3-xl-2": "stdit3-xl/2", "open-sora-v1.2": "stdit3-xl/2",
    "opensora-v1.2": "stdit3-xl/2", "stdit3": "stdit3-xl/2",
    "llama-3-8b": "llama-3-8b", "llama3-8b": "llama-3-8b", "meta-llama-3-8b": "llama-3-8b",
}


def preset_shape(name: str) -> tuple[str, dict[str, Any]]:
    """(canonical name, :func:`transformer_fields` keywords) of a named preset."""
    key = ALIASES.get(name.lower().replace("_", "-"))
    if key is None:
        raise ValueError(
            f"unknown model preset {name!r}; use 'stdit3-xl/2', 'llama-3-8b', a config dict, "
            "or ModelProfile.transformer(...) / ModelProfile.measure(...)"
        )
    return key, dict(PRESETS[key])


def config_shape(config: Mapping[str, Any] | Any) -> tuple[str, dict[str, Any]]:
    """(name, :func:`transformer_fields` keywords) read from a dict or a Hugging Face-style config
    (``hidden_size``, ``num_hidden_layers``, ``num_attention_heads``, ``num_key_value_heads``,
    ``intermediate_size``, ``vocab_size``, ``hidden_act``; ``rope_theta`` or ``rope_parameters``
    marks a model that builds one RoPE table for all its layers, as Hugging Face's Llama-family
    models do)."""

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
    name = str(read("name_or_path", "_name_or_path", "model_type", default="transformer") or "transformer")
    return name, dict(
        num_layers=int(layers),
        hidden_size=int(hidden),
        num_heads=int(heads),
        num_kv_heads=read("num_key_value_heads", default=None),
        ffn_hidden_size=read("intermediate_size", "ffn_hidden_size", "n_inner", default=None),
        gated_mlp=activation in ("silu", "swiglu", "swish"),
        vocab_size=int(read("vocab_size", default=0) or 0),
        causal=bool(read("is_causal", "causal", default=True)),
        # transformers 5 keeps rope_theta inside rope_parameters; 4.x on the config itself
        rotary=read("rope_theta", "rope_parameters", default=None) is not None,
    )
