"""Measure a real model's profile: FLOPs and saved bytes counted at a few lengths, then fitted."""

from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence

import numpy as np

from dcp_compile.variant import RecomputePolicy

from .presets import layer_activation_bytes, transformer_fields


def measure_fields(
    model: Any,
    make_inputs: Callable[[int], Any],
    lengths: Sequence[int] = (64, 128, 256),
    *,
    name: str | None = None,
    causal: bool = False,
    num_layers: int | None = None,
) -> dict[str, Any]:
    """The :class:`~.model_profile.ModelProfile` fields of ``model``, counted at ``lengths``.

    FLOPs come from ``torch.utils.flop_counter.FlopCounterMode`` with the math SDPA kernel (so the
    attention matmuls are counted on CPU too) and are fitted as ``c0 + c1 * L + c2 * L^2``: ``c1``
    is the linear term, ``c2`` the attention term (halved when ``causal``, because a flash kernel
    skips the masked half the math kernel computes). Activation bytes are what autograd saves
    (``saved_tensors_hooks``), less parameters: that is the ``none`` policy; the other policies
    keep the same fractions of it as a standard block of the measured width and heads does
    (:func:`.presets.layer_activation_bytes`, MLP width assumed 4x). Attention layers, heads and
    width are read off the ``scaled_dot_product_attention`` calls.
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
                kwargs = kwargs or {}
                # diffusers' attention processors pass query and key by keyword.
                query = args[0] if len(args) > 0 else kwargs["query"]
                key = args[1] if len(args) > 1 else kwargs["key"]
                value = args[2] if len(args) > 2 else kwargs["value"]
                storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in (query, key, value)}
                tokens = max(1, query.numel() // (query.shape[-3] * query.shape[-1]))
                attention_calls.append((query.shape[-3], key.shape[-3], query.shape[-1], query.shape[-2],
                                        sum(storages.values()) / tokens))
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
                        call_with_inputs(model, inputs)
                else:
                    call_with_inputs(model, inputs)
            # Saved activations under the default (flash-style) kernel, which keeps no L x L buffer.
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                call_with_inputs(model, inputs)
            flops.append(float(counter.get_total_flops()))
            saved_bytes.append(float(sum(seen.values())))
    finally:
        model.train(was_training)

    xs = np.asarray(lengths, dtype=float)
    c0, c1, c2 = np.polynomial.polynomial.polyfit(xs, np.asarray(flops), deg=2)
    c2 = max(float(c2), 0.0)
    if c1 <= 0:
        c1 = max(flops[-1] - c2 * lengths[-1] ** 2, 1.0) / lengths[-1]
    _, bytes_per_token = np.polynomial.polynomial.polyfit(xs, np.asarray(saved_bytes), deg=1)
    bytes_per_token = max(float(bytes_per_token), 1.0)

    attention_layers = len(attention_calls)
    if attention_calls:
        heads, kv_heads, head_dim, _, storage_bytes = attention_calls[0]
    else:
        heads, kv_heads, head_dim, storage_bytes = 1, 1, 1, 0.0
    layers = num_layers or max(1, attention_layers)
    hidden = heads * head_dim
    dtype_bytes = parameters[0].element_size() if parameters else 4
    per_layer = bytes_per_token / layers
    # The policies' shares of a standard block of this shape (the measured total is ``none``).
    standard = layer_activation_bytes(
        hidden_size=hidden, num_heads=heads, kv_width=kv_heads * head_dim, ffn_hidden_size=4 * hidden,
        gated_mlp=False, cross_attention=False, dtype_bytes=dtype_bytes,
    )
    activation = {policy.value: per_layer * standard[policy.value] / standard["none"] for policy in RecomputePolicy}
    recompute = transformer_fields(
        "shape", num_layers=layers, hidden_size=hidden, num_heads=heads, num_kv_heads=kv_heads, dtype_bytes=dtype_bytes,
    )["recompute_forward_fraction"]
    # What the storages behind q, k, v hold beyond q, k, v themselves (a fused projection kept
    # alive by a view): what an attention checkpoint keeps at SP 1.
    qkv_bytes = dtype_bytes * (heads + 2 * kv_heads) * head_dim
    storage_bytes = float(storage_bytes) if storage_bytes > 1.01 * qkv_bytes else 0.0
    parameter_bytes = float(sum(p.numel() * p.element_size() for p in parameters))
    parameter_count = float(sum(p.numel() for p in parameters))
    return dict(
        name=name or type(model).__name__,
        num_layers=layers,
        num_attention_layers=attention_layers,
        hidden_size=hidden,
        num_heads=heads,
        num_kv_heads=kv_heads,
        linear_flops_per_token=float(c1),
        attention_flops_per_token_key=c2 * (0.5 if causal else 1.0),
        activation_bytes_per_token=activation,
        recompute_forward_fraction=recompute,
        memory_traffic_bytes_per_token=2 * bytes_per_token,
        output_bytes_per_token=0.0,
        parameter_bytes=parameter_bytes,
        gradient_bytes=parameter_bytes,
        optimizer_bytes=8 * parameter_count,
        activation_dtype_bytes=dtype_bytes,
        causal=causal,
        attention_input_storage_bytes_per_token=storage_bytes,
    )


def call_with_inputs(model: Any, inputs: Any) -> Any:
    """``model(**inputs)``, ``model(*inputs)`` or ``model(inputs)``, as ``make_inputs`` returned them."""
    if isinstance(inputs, Mapping):
        return model(**inputs)
    if isinstance(inputs, tuple):
        return model(*inputs)
    return model(inputs)
