"""Plain-torch versions of the Ulysses layout transforms.

These are the specification the Triton kernels are tested against, the implementation used for
CPU tensors, and the "permute/index chain" baseline in the kernel benchmarks. Every function
returns a freshly allocated contiguous tensor (never a view of its input): the custom ops that
call them are declared non-aliasing.
"""

from __future__ import annotations

from typing import Optional

import torch


def source_heads(num_heads: int, num_slots: int, head_index: Optional[torch.Tensor], device: torch.device) -> torch.Tensor:
    """Slot -> source head, with padding slots mapped to ``num_heads`` (an extra zero head)."""
    if head_index is None:
        index = torch.arange(num_slots, device=device)
    else:
        index = head_index.to(device=device, dtype=torch.int64)
    return torch.where((index < 0) | (index >= num_heads), num_heads, index)


def pack_for_heads(x: torch.Tensor, sp_size: int, hp: int, head_index: Optional[torch.Tensor]) -> torch.Tensor:
    """``send[j, s, b, h] = x[b, head_index[j*hp + h], s]`` (zeros for padding slots)."""
    batch, num_heads, seq, dim = x.shape
    padded = torch.cat([x, x.new_zeros(batch, 1, seq, dim)], dim=1)
    gathered = padded.index_select(1, source_heads(num_heads, sp_size * hp, head_index, x.device))
    view = gathered.view(batch, sp_size, hp, seq, dim).permute(1, 3, 0, 2, 4)
    return torch.empty(view.shape, dtype=x.dtype, device=x.device).copy_(view)


def unpack_from_heads(recv: torch.Tensor, num_heads: int, head_index: Optional[torch.Tensor]) -> torch.Tensor:
    """Adjoint of :func:`pack_for_heads`: slots are summed back into the head they came from."""
    sp_size, seq, batch, hp, dim = recv.shape
    slots = recv.permute(2, 0, 3, 1, 4).reshape(batch, sp_size * hp, seq, dim)
    if head_index is None:
        # Identity layout: slot k is head k, slots >= num_heads are padding and dropped.
        kept = slots[:, :num_heads]
        return torch.empty(kept.shape, dtype=recv.dtype, device=recv.device).copy_(kept)
    accumulate = torch.float32 if recv.dtype in (torch.float16, torch.bfloat16) else recv.dtype
    out = torch.zeros(batch, num_heads + 1, seq, dim, dtype=accumulate, device=recv.device)
    out.index_add_(1, source_heads(num_heads, sp_size * hp, head_index, recv.device), slots.to(accumulate))
    return out[:, :num_heads].to(recv.dtype).contiguous()


def pack_for_sequence(out: torch.Tensor) -> torch.Tensor:
    """``[B, H, S, D]`` (any strides) -> contiguous ``[S, B, H, D]``."""
    view = out.permute(2, 0, 1, 3)
    return torch.empty(view.shape, dtype=out.dtype, device=out.device).copy_(view)


def unpack_from_sequence(send: torch.Tensor) -> torch.Tensor:
    """``[S, B, H, D]`` (any strides) -> contiguous ``[B, H, S, D]``; inverse of pack_for_sequence."""
    view = send.permute(1, 2, 0, 3)
    return torch.empty(view.shape, dtype=send.dtype, device=send.device).copy_(view)
