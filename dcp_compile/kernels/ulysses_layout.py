"""Fused all-to-all layout ops for the Ulysses sequence-parallel pass.

Layouts (P = SP size, Hp = heads per rank after padding, S_r = this rank's sequence chunk):

* ``pack_for_heads(x [B, H, S_r, D]) -> send [P, S_r, B, Hp, D]``: the send buffer of the forward
  all-to-all (split on dim 0 into P equal blocks). ``head_index[j*Hp + h]`` names the source head
  of destination slot ``(j, h)``; -1 is a padding head (zeros). This one map covers head padding
  (H % P != 0) and GQA KV-head replication (fewer KV heads than P).
  After the all-to-all the receive buffer is ``[S, B, Hp, D]`` and attention reads it as the view
  ``.permute(1, 2, 0, 3)``: no unpack pass on that side.
* ``pack_for_sequence(out [B, Hp, S, D]) -> send [S, B, Hp, D]``: send buffer of the way back
  (split on dim 0 by the uneven chunk lengths S_0..S_{P-1}).
* ``unpack_from_heads(recv [P, S_r, B, Hp, D], H) -> [B, H, S_r, D]``: back to the SDPA layout,
  dropping padding slots.

Each op is a ``torch.library.custom_op`` (namespace ``dcp``) so it traces opaquely under
``torch.compile``/AOTAutograd with symbolic shapes, and each is one Triton launch per direction.
The backward of the gather (pack_for_heads) is the scatter-sum (unpack_from_heads with the same
head map: replicated KV heads sum their gradients, padding slots drop) and vice versa; the
sequence-side pack and its inverse are each other's backward.
"""

from __future__ import annotations

import logging
from typing import Any, Optional

import torch

from . import ulysses_layout_reference as reference
from .dispatch import kernel_backend
from .triton_loader import triton_module

log = logging.getLogger(__name__)

_TRITON_MODULE = "ulysses_layout_triton"


def _check_head_map(num_heads: int, sp_size: int, hp: int, head_index: Optional[torch.Tensor]) -> None:
    """Shape checks (trace-safe), plus value checks when the map lives on the CPU (no sync)."""
    if sp_size < 1 or hp < 1:
        raise ValueError(f"sp_size ({sp_size}) and padded_heads_per_rank ({hp}) must be >= 1")
    if head_index is None:
        if sp_size * hp < num_heads:
            raise ValueError(
                f"{num_heads} heads do not fit in sp_size * padded_heads_per_rank = {sp_size} * {hp}; "
                f"use padded_heads_per_rank = ceil(heads / sp_size) = {-(-num_heads // sp_size)}"
            )
        return
    if head_index.dim() != 1 or head_index.shape[0] != sp_size * hp:
        raise ValueError(
            f"head_index must be 1-D of length sp_size * padded_heads_per_rank = {sp_size * hp}, "
            f"got shape {tuple(head_index.shape)}"
        )
    if head_index.dtype.is_floating_point or head_index.dtype.is_complex or head_index.dtype == torch.bool:
        raise ValueError(f"head_index must be an integer tensor, got {head_index.dtype}")
    if head_index.device.type == "cpu" and head_index.numel() > 0 and not _is_fake(head_index):
        lo, hi = int(head_index.min()), int(head_index.max())
        if lo < -1 or hi >= num_heads:
            raise ValueError(
                f"head_index values must be -1 (padding) or in [0, {num_heads}), got range [{lo}, {hi}]"
            )


def _is_fake(t: torch.Tensor) -> bool:
    from torch._subclasses.fake_tensor import is_fake

    return is_fake(t)


# --------------------------------------------------------------------------- head-side gather


@torch.library.custom_op("dcp::pack_for_heads", mutates_args=())
def _pack_for_heads(x: torch.Tensor, sp_size: int, padded_heads_per_rank: int, head_index: Optional[torch.Tensor]) -> torch.Tensor:
    _check_head_map(x.shape[1], sp_size, padded_heads_per_rank, head_index)
    if kernel_backend(x) == "triton":
        return triton_module(_TRITON_MODULE, x.device).gather_heads(x, sp_size, padded_heads_per_rank, head_index)
    return reference.pack_for_heads(x, sp_size, padded_heads_per_rank, head_index)


@_pack_for_heads.register_fake
def _(x: torch.Tensor, sp_size: int, padded_heads_per_rank: int, head_index: Optional[torch.Tensor]) -> torch.Tensor:
    batch, _, seq, dim = x.shape
    return x.new_empty((sp_size, seq, batch, padded_heads_per_rank, dim))


def _pack_for_heads_setup(ctx: Any, inputs: tuple, output: torch.Tensor) -> None:
    x, _, _, head_index = inputs
    ctx.num_heads = x.shape[1]
    ctx.save_for_backward(head_index)


def _pack_for_heads_backward(ctx: Any, grad: torch.Tensor) -> tuple:
    (head_index,) = ctx.saved_tensors
    return torch.ops.dcp.unpack_from_heads(grad, ctx.num_heads, head_index), None, None, None


_pack_for_heads.register_autograd(_pack_for_heads_backward, setup_context=_pack_for_heads_setup)


# --------------------------------------------------------------------------- head-side scatter


@torch.library.custom_op("dcp::unpack_from_heads", mutates_args=())
def _unpack_from_heads(recv: torch.Tensor, num_heads: int, head_index: Optional[torch.Tensor]) -> torch.Tensor:
    _check_head_map(num_heads, recv.shape[0], recv.shape[3], head_index)
    if kernel_backend(recv) == "triton":
        return triton_module(_TRITON_MODULE, recv.device).scatter_heads(recv, num_heads, head_index)
    return reference.unpack_from_heads(recv, num_heads, head_index)


@_unpack_from_heads.register_fake
def _(recv: torch.Tensor, num_heads: int, head_index: Optional[torch.Tensor]) -> torch.Tensor:
    _, seq, batch, _, dim = recv.shape
    return recv.new_empty((batch, num_heads, seq, dim))


def _unpack_from_heads_setup(ctx: Any, inputs: tuple, output: torch.Tensor) -> None:
    recv, _, head_index = inputs
    ctx.sp_size = recv.shape[0]
    ctx.hp = recv.shape[3]
    ctx.save_for_backward(head_index)


def _unpack_from_heads_backward(ctx: Any, grad: torch.Tensor) -> tuple:
    (head_index,) = ctx.saved_tensors
    return torch.ops.dcp.pack_for_heads(grad, ctx.sp_size, ctx.hp, head_index), None, None


_unpack_from_heads.register_autograd(_unpack_from_heads_backward, setup_context=_unpack_from_heads_setup)


# --------------------------------------------------------------------------- sequence side


def _sequence_copy(src_bhsd: torch.Tensor, dst_bhsd: torch.Tensor) -> None:
    triton_module(_TRITON_MODULE, src_bhsd.device).permute_copy(src_bhsd, dst_bhsd)


@torch.library.custom_op("dcp::pack_for_sequence", mutates_args=())
def _pack_for_sequence(out: torch.Tensor) -> torch.Tensor:
    if kernel_backend(out) == "triton":
        batch, heads, seq, dim = out.shape
        send = torch.empty((seq, batch, heads, dim), dtype=out.dtype, device=out.device)
        _sequence_copy(out, send.permute(1, 2, 0, 3))
        return send
    return reference.pack_for_sequence(out)


@_pack_for_sequence.register_fake
def _(out: torch.Tensor) -> torch.Tensor:
    batch, heads, seq, dim = out.shape
    return out.new_empty((seq, batch, heads, dim))


@torch.library.custom_op("dcp::unpack_from_sequence", mutates_args=())
def _unpack_from_sequence(send: torch.Tensor) -> torch.Tensor:
    if kernel_backend(send) == "triton":
        seq, batch, heads, dim = send.shape
        out = torch.empty((batch, heads, seq, dim), dtype=send.dtype, device=send.device)
        _sequence_copy(send.permute(1, 2, 0, 3), out)
        return out
    return reference.unpack_from_sequence(send)


@_unpack_from_sequence.register_fake
def _(send: torch.Tensor) -> torch.Tensor:
    seq, batch, heads, dim = send.shape
    return send.new_empty((batch, heads, seq, dim))


def _no_setup(ctx: Any, inputs: tuple, output: torch.Tensor) -> None:
    pass


_pack_for_sequence.register_autograd(
    lambda ctx, grad: torch.ops.dcp.unpack_from_sequence(grad), setup_context=_no_setup
)
_unpack_from_sequence.register_autograd(
    lambda ctx, grad: torch.ops.dcp.pack_for_sequence(grad), setup_context=_no_setup
)


# --------------------------------------------------------------------------- public API


def pack_for_heads(
    x: torch.Tensor,
    sp_size: int,
    padded_heads_per_rank: int,
    head_index: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Send buffer ``[P, S_r, B, Hp, D]`` of the forward all-to-all, from ``x [B, H, S_r, D]``.

    ``send[j, s, b, h, d] = x[b, head_index[j*Hp + h], s, d]``; -1 in ``head_index`` writes a
    zero (padding) head. ``head_index=None`` means slot k reads head k, with slots >= H padding.
    Values of a CPU ``head_index`` are range-checked; a CUDA one is trusted (checking would sync).
    """
    if x.dim() != 4:
        raise ValueError(f"pack_for_heads expects x of shape [B, H, S_r, D], got {tuple(x.shape)}")
    return torch.ops.dcp.pack_for_heads(x, sp_size, padded_heads_per_rank, head_index)


def unpack_from_heads(
    recv: torch.Tensor,
    num_heads: int,
    head_index: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """``[B, num_heads, S_r, D]`` from the all-to-all receive buffer ``recv [P, S_r, B, Hp, D]``.

    ``out[b, j*Hp + h, s, d] = recv[j, s, b, h, d]``; padding slots (>= num_heads) are dropped.
    With a ``head_index`` it is the adjoint of :func:`pack_for_heads` (slots sharing a source head
    are summed), which is what the gather's backward uses.
    """
    if recv.dim() != 5:
        raise ValueError(f"unpack_from_heads expects recv of shape [P, S_r, B, Hp, D], got {tuple(recv.shape)}")
    return torch.ops.dcp.unpack_from_heads(recv, num_heads, head_index)


def pack_for_sequence(out: torch.Tensor) -> torch.Tensor:
    """Contiguous ``[S, B, Hp, D]`` send buffer of the way back, from attention output ``[B, Hp, S, D]``."""
    if out.dim() != 4:
        raise ValueError(f"pack_for_sequence expects out of shape [B, Hp, S, D], got {tuple(out.shape)}")
    return torch.ops.dcp.pack_for_sequence(out)
