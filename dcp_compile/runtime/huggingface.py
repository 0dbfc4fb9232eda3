"""Packed micro-batches for Hugging Face models: ``attn_implementation="dcp"``.

(The Trainer integration is :mod:`dcp_compile.runtime.trainer`; users import both from
:mod:`dcp_compile.huggingface`.)

Given packed ``position_ids`` (positions restarting at each sequence), Hugging Face's ``sdpa``
implementation builds a dense ``[B, 1, T, T]`` block-causal mask from them, and masked attention
cannot become varlen attention. The ``dcp`` implementation registered here is plain SDPA without a
mask, like Hugging Face's flash-attention integrations: where sequences end is then said by
``dcp.use(mb, sequence_lengths=...)``, and the packed variant's attention runs the varlen kernel
over those boundaries. The position ids still drive the rotary embedding.

Contract: with ``attn_implementation="dcp"`` a row is one sequence unless ``dcp.use`` gives
``sequence_lengths``. Padding masks are refused (they would be ignored otherwise): pack instead.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

ATTENTION_IMPLEMENTATION = "dcp"


def dcp_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Hugging Face attention-interface signature: q/k/v ``[B, H, T, D]`` in, ``[B, T, H, D]`` out."""
    if attention_mask is not None:
        raise ValueError(
            "attn_implementation='dcp' got an attention mask (padding): it keeps sequences apart by packing, "
            "not by masks. Pack the batch (dcp.pack_sequences, then dcp.use(mb, sequence_lengths=...)) and "
            "pass no attention_mask, or use attn_implementation='sdpa' for padded batches"
        )
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    groups = getattr(module, "num_key_value_groups", 1)
    out = F.scaled_dot_product_attention(
        query, key, value, dropout_p=dropout if module.training else 0.0, scale=scaling,
        is_causal=bool(causal), enable_gqa=groups > 1,
    )
    return out.transpose(1, 2).contiguous(), None


def _no_mask(*args: Any, attention_mask: torch.Tensor | None = None, **kwargs: Any) -> torch.Tensor | None:
    """The mask interface: no mask is ever built; a padding mask is handed on (and refused above)."""
    return attention_mask


def register() -> str:
    """Register ``"dcp"`` with Hugging Face's attention and mask interfaces; returns the name."""
    try:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface
    except ImportError as error:
        raise ImportError(
            "dcp_compile.runtime.huggingface needs a transformers release with AttentionInterface and "
            f"masking_utils.AttentionMaskInterface (the one installed lacks them: {error}); upgrade transformers"
        ) from error

    AttentionInterface.register(ATTENTION_IMPLEMENTATION, dcp_attention_forward)
    AttentionMaskInterface.register(ATTENTION_IMPLEMENTATION, _no_mask)
    return ATTENTION_IMPLEMENTATION


def use_packed_attention(model: torch.nn.Module) -> torch.nn.Module:
    """Switch a Hugging Face model to ``attn_implementation="dcp"`` (in place; returns it)."""
    register()
    if hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation(ATTENTION_IMPLEMENTATION)
    else:  # releases before set_attn_implementation read the config at every forward
        model.config._attn_implementation = ATTENTION_IMPLEMENTATION
    return model
