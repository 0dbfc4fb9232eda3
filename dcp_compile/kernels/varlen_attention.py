"""Padding-free (varlen) attention as ``dcp::`` custom ops.

When the sampler packs several short sequences into one micro-batch, attention must not cross
sequence boundaries and padding would waste the very compute DCP tries to save. The sequences are
concatenated along the token axis and delimited by ``cu_seqlens`` (cumulative lengths, as in
flash-attn's varlen API).

``dcp::varlen_attention_fwd`` returns ``(out, lse)``; ``dcp::varlen_attention_bwd`` returns
``(dq, dk, dv)``. Both are opaque to ``torch.compile`` (fake implementations give the shapes, so
symbolic token counts trace) and the forward's registered autograd formula calls the backward op,
so AOTAutograd puts the backward kernel in the compiled backward graph.
"""

from __future__ import annotations

import logging
import math
from typing import Any, Optional

import torch

from . import varlen_attention_reference as reference
from .attention_choice import VarlenChoice, VarlenKernel, VarlenShape, available_kernels, choose_varlen_kernel, \
    equal_length_sdpa
from .dispatch import kernel_backend
from .varlen_flex import flex_document_attention
from .triton_loader import triton_module

log = logging.getLogger(__name__)

_TRITON_MODULE = "varlen_attention_triton"
_TRITON_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_MAX_HEAD_DIM = 256


def _resolve_scale(scale: Optional[float], head_dim: int) -> float:
    return float(scale) if scale is not None else 1.0 / math.sqrt(head_dim)


def _check_cu_seqlens_values(cu_seqlens: torch.Tensor, total: int, max_seqlen: int) -> None:
    """Data checks, only where they cost no device sync (cu_seqlens on the CPU)."""
    if cu_seqlens.device.type != "cpu":
        return
    cu = cu_seqlens.tolist()
    lengths = [b - a for a, b in zip(cu[:-1], cu[1:])]
    if cu[0] != 0 or any(n < 0 for n in lengths):
        raise ValueError(f"cu_seqlens must start at 0 and be non-decreasing, got {cu}")
    if cu[-1] != total:
        raise ValueError(
            f"cu_seqlens ends at {cu[-1]} but q has {total} tokens; every token must belong to a sequence"
        )
    if lengths and max(lengths) > max_seqlen:
        raise ValueError(f"max_seqlen={max_seqlen} is smaller than the longest sequence ({max(lengths)})")


def _longest_sequence(cu_seqlens: torch.Tensor, max_seqlen: int) -> int:
    """``max_seqlen`` as given, or read from ``cu_seqlens`` when it is 0 (how compiled graphs call
    the op: the longest sequence changes every batch). Free for a CPU ``cu_seqlens``; a device one
    costs a sync."""
    if max_seqlen > 0:
        return max_seqlen
    if cu_seqlens.numel() < 2:
        return 0
    return int((cu_seqlens[1:] - cu_seqlens[:-1]).max())


def _on_kernel_device(cu_seqlens: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host ``cu_seqlens`` on the kernel's device without a host sync. A blocking copy from
    pageable memory first waits for the stream's queued kernels, once per attention call, so the
    CPU could not run ahead of the GPU; from pinned memory the copy is queued like a kernel (the
    caching host allocator keeps the pinned block until the copy has run)."""
    if cu_seqlens.device.type == "cpu" and device.type == "cuda":
        return cu_seqlens.pin_memory().to(device, non_blocking=True)
    return cu_seqlens.to(device)


def _triton_inputs(*tensors: torch.Tensor) -> list[torch.Tensor]:
    """The kernels index the feature dim with stride 1; token and head strides may be anything."""
    return [t if t.stride(-1) == 1 else t.contiguous() for t in tensors]


@torch.library.custom_op("dcp::varlen_attention_fwd", mutates_args=())
def _varlen_attention_fwd(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
    max_seqlen: int, causal: bool, scale: Optional[float],
) -> tuple[torch.Tensor, torch.Tensor]:
    max_seqlen = _longest_sequence(cu_seqlens, max_seqlen)
    _check_cu_seqlens_values(cu_seqlens, q.shape[0], max_seqlen)
    sm_scale = _resolve_scale(scale, q.shape[-1])
    if kernel_backend(q) == "triton":
        if q.dtype not in _TRITON_DTYPES:
            raise TypeError(f"the Triton varlen attention supports {_TRITON_DTYPES}, got {q.dtype}")
        kernels = triton_module(_TRITON_MODULE, q.device)
        q, k, v = _triton_inputs(q, k, v)
        return kernels.forward(q, k, v, _on_kernel_device(cu_seqlens, q.device), max_seqlen, causal, sm_scale)
    return reference.attention_forward(q, k, v, cu_seqlens, causal, sm_scale)


@_varlen_attention_fwd.register_fake
def _(q, k, v, cu_seqlens, max_seqlen, causal, scale):
    return torch.empty_like(q, memory_format=torch.contiguous_format), q.new_empty(
        (q.shape[1], q.shape[0]), dtype=torch.float32
    )


@torch.library.custom_op("dcp::varlen_attention_bwd", mutates_args=())
def _varlen_attention_bwd(
    grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    out: torch.Tensor, lse: torch.Tensor, cu_seqlens: torch.Tensor,
    max_seqlen: int, causal: bool, scale: Optional[float],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    sm_scale = _resolve_scale(scale, q.shape[-1])
    max_seqlen = _longest_sequence(cu_seqlens, max_seqlen)
    if kernel_backend(q) == "triton":
        kernels = triton_module(_TRITON_MODULE, q.device)
        grad_out, q, k, v, out = _triton_inputs(grad_out, q, k, v, out)
        return kernels.backward(
            grad_out, q, k, v, out, lse, _on_kernel_device(cu_seqlens, q.device), max_seqlen, causal, sm_scale
        )
    return reference.attention_backward(grad_out, q, k, v, out, lse, cu_seqlens, causal, sm_scale)


@_varlen_attention_bwd.register_fake
def _(grad_out, q, k, v, out, lse, cu_seqlens, max_seqlen, causal, scale):
    return (
        torch.empty_like(q, memory_format=torch.contiguous_format),
        torch.empty_like(k, memory_format=torch.contiguous_format),
        torch.empty_like(v, memory_format=torch.contiguous_format),
    )


def _fwd_setup(ctx: Any, inputs: tuple, output: tuple) -> None:
    q, k, v, cu_seqlens, max_seqlen, causal, scale = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, cu_seqlens)
    ctx.max_seqlen, ctx.causal, ctx.scale = max_seqlen, causal, scale
    ctx.mark_non_differentiable(lse)


def _fwd_backward(ctx: Any, grad_out: torch.Tensor, grad_lse: Optional[torch.Tensor]) -> tuple:
    q, k, v, out, lse, cu_seqlens = ctx.saved_tensors
    dq, dk, dv = torch.ops.dcp.varlen_attention_bwd(
        grad_out, q, k, v, out, lse, cu_seqlens, ctx.max_seqlen, ctx.causal, ctx.scale
    )
    return dq, dk, dv, None, None, None, None


_varlen_attention_fwd.register_autograd(_fwd_backward, setup_context=_fwd_setup)


def _check_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor) -> None:
    """Shape/dtype checks that hold for symbolic shapes too (no data is read)."""
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
        raise ValueError(
            f"varlen_attention expects q [T, Hq, D], k/v [T, Hkv, D]; got {tuple(q.shape)}, "
            f"{tuple(k.shape)}, {tuple(v.shape)}"
        )
    if k.shape != v.shape or q.shape[0] != k.shape[0] or q.shape[2] != k.shape[2]:
        raise ValueError(
            f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}: tokens and head dim must "
            "match and k, v must have the same shape"
        )
    if q.shape[1] % k.shape[1] != 0:
        raise ValueError(f"GQA needs query heads ({q.shape[1]}) divisible by KV heads ({k.shape[1]})")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k, v dtypes differ: {q.dtype}, {k.dtype}, {v.dtype}")
    if q.shape[2] > _MAX_HEAD_DIM:
        raise ValueError(f"head dim {q.shape[2]} > {_MAX_HEAD_DIM} is not supported")
    if cu_seqlens.dim() != 1 or cu_seqlens.shape[0] < 1 or cu_seqlens.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"cu_seqlens must be a 1-D int32/int64 tensor [num_seqs + 1], got {cu_seqlens.dtype} "
            f"{tuple(cu_seqlens.shape)}"
        )


def varlen_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    causal: bool = False,
    scale: Optional[float] = None,
    kernel: Optional[str] = None,
) -> torch.Tensor:
    """Attention over packed sequences, no padding and no attention across sequence boundaries.

    q ``[T, Hq, D]``, k/v ``[T, Hkv, D]`` (GQA when Hkv < Hq), ``cu_seqlens`` ``[N + 1]`` with
    ``cu_seqlens[0] == 0`` and ``cu_seqlens[-1] == T``, ``max_seqlen`` >= the longest sequence
    (it sizes the launch grid; 0 reads it from ``cu_seqlens``). ``scale`` defaults to ``1/sqrt(D)``. Returns ``[T, Hq, D]``.
    A CPU ``cu_seqlens`` is validated; a CUDA one is trusted (validating would sync the device).

    The implementation is the fastest measured for the shape (:mod:`.attention_choice`: the Triton
    kernel, FlexAttention with a document mask, or SDPA when every sequence has the same length;
    on CPU the torch reference); ``kernel`` (a :class:`.attention_choice.VarlenKernel` value) forces
    one. :func:`last_varlen_choice` says what the last call ran and why. Under ``torch.compile``
    (symbolic sizes) a direct call stays the ``dcp::`` op; the packed micro-batches dcp compiles
    (``dcp.use(..., sequence_lengths=...)``) choose per call in the dispatcher instead
    (``compiler/passes/use_varlen_attention.py``).
    """
    _check_inputs(q, k, v, cu_seqlens)
    needs_grad = torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, v))
    choice = _choose(q, cu_seqlens, max_seqlen, causal, kernel, needs_grad)
    if choice is not None and choice.kernel is VarlenKernel.FLEX:
        return flex_document_attention(q, k, v, cu_seqlens, causal, scale)
    if choice is not None and choice.kernel is VarlenKernel.EQUAL_SDPA:
        return equal_length_sdpa(q, k, v, cu_seqlens.shape[0] - 1, causal, scale)
    out, _ = torch.ops.dcp.varlen_attention_fwd(q, k, v, cu_seqlens, max_seqlen, causal, scale)
    return out


_last_choice: list[Optional[VarlenChoice]] = [None]


def last_varlen_choice() -> Optional[VarlenChoice]:
    """The implementation the last eager :func:`varlen_attention` call ran, with the reason."""
    return _last_choice[0]


def _choose(q: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int, causal: bool,
            kernel: Optional[str], needs_grad: bool = False) -> Optional[VarlenChoice]:
    if any(isinstance(size, torch.SymInt) for size in (*q.shape, *cu_seqlens.shape)):
        return None  # traced: the dcp:: op, whose kernel is picked when it runs
    shape = VarlenShape.of(q, cu_seqlens, max_seqlen, causal)
    if kernel is not None:
        choice = VarlenChoice(VarlenKernel(kernel), "asked for")
        if choice.kernel is VarlenKernel.EQUAL_SDPA and not shape.equal_lengths:
            raise ValueError(f"kernel='equal_sdpa' needs sequences of one length (max_seqlen * sequences == tokens), "
                             f"got {shape.num_seqs} sequences of up to {max_seqlen} over {shape.total_tokens} tokens")
    else:
        available = available_kernels(shape)
        if needs_grad and shape.device_type != "cuda":
            available.discard(VarlenKernel.FLEX)  # torch has no FlexAttention backward off CUDA
        choice = choose_varlen_kernel(shape, available=available)
    _last_choice[0] = choice
    return choice
