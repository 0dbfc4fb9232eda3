"""Varlen attention as FlexAttention with a document mask: one of the implementations the
varlen path chooses from (:mod:`.attention_choice`).

Packed q ``[T, Hq, D]``, k/v ``[T, Hkv, D]`` and ``cu_seqlens`` become one FlexAttention call over
``[1, H, T, D]`` whose block mask lets a token attend only within its own sequence (and only to
earlier tokens when causal); blocks that cross no sequence boundary are skipped, so the work is
that of the sequences, not of ``T^2``. FlexAttention has its own autograd (its backward kernel is
generated with the forward), which is why the measured H200 table prefers it forward+backward.

On CUDA the call goes through ``torch.compile(flex_attention)`` (eager FlexAttention is a dense
reference); elsewhere it runs eagerly, exact, at ``O(T^2)`` memory (CPU tests).
"""

from __future__ import annotations

import functools
import math
import warnings
from typing import Any, Callable, Optional

import torch


def flex_available() -> bool:
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention  # noqa: F401
    except ImportError:
        return False
    return True


def document_ids(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    """The sequence index of every token: ``[0, 0, 0, 1, 1, 2, ...]`` from ``cu_seqlens``."""
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).to(torch.int64)
    return torch.repeat_interleave(torch.arange(lengths.numel(), device=cu_seqlens.device), lengths,
                                   output_size=total)


def document_mask_mod(documents: torch.Tensor, causal: bool) -> Callable:
    """A FlexAttention ``mask_mod``: same sequence, and not a later token when causal."""
    if causal:
        def mask(b, h, q_idx, kv_idx):  # noqa: ANN001 - FlexAttention's signature
            return (documents[q_idx] == documents[kv_idx]) & (q_idx >= kv_idx)
    else:
        def mask(b, h, q_idx, kv_idx):  # noqa: ANN001
            return documents[q_idx] == documents[kv_idx]
    return mask


@functools.cache
def _compiled_flex() -> Callable:
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=True)


def flex_document_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
    causal: bool = False, scale: Optional[float] = None, block_size: int = 128,
) -> torch.Tensor:
    """Attention over packed sequences by FlexAttention; ``[T, Hq, D]`` out, differentiable."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    total, hq, dim = q.shape
    cu = cu_seqlens.to(device=q.device)
    documents = document_ids(cu, total)
    # the mask is built on the tokens' device; on CPU small blocks keep the eager path cheap
    block = block_size if q.device.type == "cuda" else max(1, min(block_size, total))
    # On CUDA the mask is built by a compiled kernel (eagerly it costs milliseconds at 16k tokens,
    # which the chosen path pays inside its clock); note that it compiles once per token count.
    block_mask = create_block_mask(document_mask_mod(documents, causal), None, None, total, total,
                                   device=q.device, BLOCK_SIZE=block, _compile=q.device.type == "cuda")
    layout = [x.transpose(0, 1).unsqueeze(0) for x in (q, k, v)]  # [1, H, T, D]
    run: Any = _compiled_flex() if q.device.type == "cuda" else flex_attention
    with warnings.catch_warnings():  # off CUDA the unfused path is the point (tests), not a mistake
        warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
        out = run(*layout, block_mask=block_mask, scale=scale if scale is not None else 1.0 / math.sqrt(dim),
                  enable_gqa=hq != k.shape[1])
    return out.squeeze(0).transpose(0, 1)
