"""Varlen attention as FlexAttention with a document mask: one of the implementations the
varlen path chooses from (:mod:`.attention_choice`).

Packed q ``[T, Hq, D]``, k/v ``[T, Hkv, D]`` and ``cu_seqlens`` become one FlexAttention call over
``[1, H, T, D]`` whose block mask lets a token attend only within its own sequence (and only to
earlier tokens when causal); blocks that cross no sequence boundary are skipped, so the work is
that of the sequences, not of ``T^2``. FlexAttention has its own autograd (its backward kernel is
generated with the forward), which is why the measured H200 table prefers it forward+backward.

On CUDA the call goes through ``torch.compile(flex_attention)`` (eager FlexAttention is a dense
reference); elsewhere it runs eagerly, exact, at ``O(T^2)`` memory (CPU tests).

Compiled graphs take :func:`document_mask_inputs` (once per graph) and
:func:`flex_document_attention_of_mask` (per attention) instead: the block mask is built
from each block's first and last document with plain tensor ops (``create_block_mask`` maps the
mask over every position with ``vmap``, which a pre-dispatch trace with a symbolic token count
bakes into constants), and the FlexAttention operator is called directly, so the graph holds it
and AOTAutograd derives its own backward (Inductor then fuses both).
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


def document_mask_mod_of_buffer(causal: bool) -> Callable:
    """The document mask with the document ids as FlexAttention's extra mask buffer (a traced
    graph cannot close over a tensor it computes)."""
    if causal:
        def mask(b, h, q_idx, kv_idx, documents):  # noqa: ANN001 - FlexAttention's signature
            return (documents[q_idx] == documents[kv_idx]) & (q_idx >= kv_idx)
    else:
        def mask(b, h, q_idx, kv_idx, documents):  # noqa: ANN001
            return documents[q_idx] == documents[kv_idx]
    return mask


def _ordered(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A ``[rows, cols]`` block bitmap as FlexAttention's (count per row, column indices in order)."""
    counts = blocks.sum(-1, dtype=torch.int32)
    indices = torch.argsort(blocks.to(torch.int8), dim=-1, descending=True, stable=True).to(torch.int32)
    return counts[None, None], indices[None, None]


def document_block_bitmaps(documents: torch.Tensor, total: Any, causal: bool,
                           block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(partial, full) ``[blocks, blocks]`` bitmaps of the document mask over ``total`` tokens.

    Documents are non-decreasing along the tokens, so a block holds the documents from its first
    to its last, and two blocks share one iff those ranges overlap. A block pair is *full* (the
    mask is true everywhere in it, so the kernel skips evaluating it) when both blocks lie in one
    and the same document, hold no padding and, when causal, sit strictly below the diagonal;
    *partial* when they share a document otherwise (and, when causal, the kv block is not later).
    """
    blocks = (total + block - 1) // block
    padding = blocks * block - total
    ids = torch.cat([documents, documents.new_full((padding,), -1)]).view(blocks, block)
    real = ids >= 0
    first = torch.where(real, ids, torch.iinfo(ids.dtype).max).amin(1)
    last = ids.amax(1)
    index = torch.arange(blocks, device=documents.device)
    shares = (first[:, None] <= last[None, :]) & (first[None, :] <= last[:, None])
    single = (first == last) & real.all(1)
    full = single[:, None] & single[None, :] & (first[:, None] == first[None, :])
    if causal:
        shares = shares & (index[:, None] >= index[None, :])
        below = index[:, None] > index[None, :] if block > 1 else index[:, None] >= index[None, :]
        full = full & below  # a diagonal block is causal-masked, unless it is one token
    return shares & ~full, full


def document_block_mask_tensors(documents: torch.Tensor, total: Any, causal: bool,
                                block: int) -> tuple[torch.Tensor, ...]:
    """The tensors of FlexAttention's ``BlockMask`` of the document mask (kv-major then q-major
    counts and indices, partial then full), from :func:`document_block_bitmaps`."""
    partial, full = document_block_bitmaps(documents, total, causal, block)
    return (*_ordered(partial), *_ordered(full), *_ordered(partial.transpose(0, 1)), *_ordered(full.transpose(0, 1)))


def block_mask_of(tensors: tuple[torch.Tensor, ...], total: Any, causal: bool, block: int) -> Any:
    """The ``BlockMask`` of :func:`document_block_mask_tensors`' tensors."""
    from torch.nn.attention.flex_attention import BlockMask

    kv_counts, kv_indices, full_kv_counts, full_kv_indices, q_counts, q_indices, full_q_counts, full_q_indices = tensors
    return BlockMask(seq_lengths=(total, total), kv_num_blocks=kv_counts, kv_indices=kv_indices,
                     full_kv_num_blocks=full_kv_counts, full_kv_indices=full_kv_indices,
                     q_num_blocks=q_counts, q_indices=q_indices, full_q_num_blocks=full_q_counts,
                     full_q_indices=full_q_indices, BLOCK_SIZE=(block, block),
                     mask_mod=document_mask_mod_of_buffer(causal))


def _identity_score(score, b, h, q_idx, kv_idx):  # noqa: ANN001 - FlexAttention's score_mod signature
    return score


def _kernel_options(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> dict:
    """The options the public ``flex_attention`` would pass its operator, with the log-sum-exp
    kept (the backward needs it)."""
    try:
        from torch.nn.attention.flex_attention import _apply_kernel_options

        return dict(_apply_kernel_options(q, k, v, True, None))
    except (ImportError, TypeError):  # another torch: the operator's own defaults
        return {"OUTPUT_LOGSUMEXP": True, "OUTPUT_MAX": False}


def graph_block_size(device: torch.device) -> int:
    """128 on CUDA (FlexAttention's tile); 16 elsewhere, where the unfused operator ignores the
    blocks and small ones keep the mask cheap."""
    return 128 if device.type == "cuda" else 16


def document_mask_inputs(cu_seqlens: torch.Tensor, tokens: torch.Tensor, causal: bool) -> tuple[torch.Tensor, ...]:
    """Document ids and block-mask tensors for packed ``tokens`` (``[T, ...]``, read for ``T`` and
    the device only): built once per graph and causality, shared by every attention site.
    Traceable with a symbolic ``T`` and sequence count, no host sync: ``cu_seqlens`` (on the host)
    is copied to the device without waiting, and ``repeat_interleave`` is given its output size."""
    total = tokens.shape[0]
    documents = document_ids(cu_seqlens.to(device=tokens.device, non_blocking=True), total)
    return (documents, *document_block_mask_tensors(documents, total, causal, graph_block_size(tokens.device)))


def flex_document_attention_of_mask(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                    mask_inputs: tuple[torch.Tensor, ...], causal: bool,
                                    scale: Optional[float]) -> torch.Tensor:
    """Packed q ``[T, Hq, D]``, k/v ``[T, Hkv, D]`` -> ``[T, Hq, D]`` by the FlexAttention operator
    (called directly, so a traced graph holds it and AOTAutograd derives its backward) over
    :func:`document_mask_inputs`."""
    from torch._higher_order_ops.flex_attention import flex_attention as flex_operator

    total, hq, dim = q.shape
    documents, *tensors = mask_inputs
    mask = block_mask_of(tuple(tensors), total, causal, graph_block_size(q.device))
    layout = [x.transpose(0, 1).unsqueeze(0) for x in (q, k, v)]  # [1, H, T, D]
    outputs = flex_operator(*layout, _identity_score, mask.as_tuple(),
                            scale if scale is not None else 1.0 / math.sqrt(dim),
                            _kernel_options(*layout), (), (documents,))
    return outputs[0].squeeze(0).transpose(0, 1)  # (out, lse[, max]): the count differs by version


def flex_document_attention_traceable(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                                      causal: bool, scale: Optional[float]) -> torch.Tensor:
    """:func:`flex_document_attention_of_mask` with its own mask (one attention alone)."""
    return flex_document_attention_of_mask(q, k, v, document_mask_inputs(cu_seqlens, q, causal), causal, scale)
