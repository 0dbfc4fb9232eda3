"""Triton kernels for the Ulysses all-to-all layouts (loaded through :mod:`.triton_loader`).

All three transforms move ``D``-long rows (one token of one head) from one place to another, so
each program copies a tile of ``BLOCK_S`` tokens x ``D`` features of one (batch, head) pair: reads
and writes stay contiguous along ``D`` and the kernels run at copy bandwidth. Head selection
(padding heads, GQA replication) happens in the address computation, so every transform is a
single pass over the data with no intermediate tensors.

* ``gather_heads``: ``send[j, s, b, h, :] = x[b, head_index[j*Hp + h], s, :]`` (zeros for -1).
* ``scatter_heads``: its adjoint, ``out[b, g, s, :] = sum over slots k with head_index[k] == g of
  recv[k // Hp, s, b, k % Hp, :]`` accumulated in fp32 (fp64 for fp64) (each output tile is written once, so
  no atomics and the result is deterministic).
* ``permute_copy``: ``dst[b, h, s, :] = src[b, h, s, :]`` for arbitrary strides on both sides, the
  sequence-side pack and its inverse.

The kernels call only Triton *builtins* (``tl.full``, not the ``@jit``-defined ``tl.zeros``):
library functions written with ``@triton.jit`` are built once, when ``triton.language`` is first
imported, in whatever mode ``TRITON_INTERPRET`` had then, and cannot be called from a kernel
built in the other mode. Staying on builtins lets :mod:`.triton_loader` build these kernels
interpreted or compiled regardless of import order.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from .triton_loader import use_interpreter


@triton.jit
def _gather_heads_kernel(
    x_ptr, index_ptr, send_ptr,
    S, B, HP, H, D, n_s_blocks,
    stride_xb, stride_xh, stride_xs, stride_xd,
    HAS_INDEX: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
):
    pid = tl.program_id(0)
    s_block = pid % n_s_blocks
    rest = pid // n_s_blocks
    b = rest % B
    slot = rest // B  # destination head slot j*HP + h
    if HAS_INDEX:
        src = tl.load(index_ptr + slot).to(tl.int64)
    else:
        src = tl.where(slot < H, slot, -1).to(tl.int64)
    j = slot // HP
    h = slot % HP

    offs_s = s_block * BLOCK_S + tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    in_bounds = (offs_s[:, None] < S) & (offs_d[None, :] < D)
    rows = offs_s.to(tl.int64)
    x_ptrs = (x_ptr + b.to(tl.int64) * stride_xb + src * stride_xh
              + rows[:, None] * stride_xs + offs_d[None, :] * stride_xd)
    # A padding slot (src == -1) reads no rows at all and stores zeros.
    rows_to_read = tl.where(src >= 0, S, 0)
    read_mask = (offs_s[:, None] < rows_to_read) & (offs_d[None, :] < D)
    tile = tl.load(x_ptrs, mask=read_mask, other=0.0)

    row_stride = B * HP * D  # send is contiguous [P, S, B, HP, D]
    send_ptrs = (send_ptr + (j.to(tl.int64) * S + rows[:, None]) * row_stride
                 + (b * HP + h).to(tl.int64) * D + offs_d[None, :])
    tl.store(send_ptrs, tile, mask=in_bounds)


@triton.jit
def _scatter_heads_kernel(
    recv_ptr, index_ptr, out_ptr,
    S, B, HP, H, D, n_s_blocks,
    stride_rj, stride_rs, stride_rb, stride_rh, stride_rd,
    HAS_INDEX: tl.constexpr, NUM_SLOTS: tl.constexpr, ACC_DTYPE: tl.constexpr,
    BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
):
    pid = tl.program_id(0)
    s_block = pid % n_s_blocks
    rest = pid // n_s_blocks
    b = rest % B
    g = rest // B  # output (source-side) head

    offs_s = s_block * BLOCK_S + tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    in_bounds = (offs_s[:, None] < S) & (offs_d[None, :] < D)
    rows = offs_s.to(tl.int64)
    base = recv_ptr + b.to(tl.int64) * stride_rb + rows[:, None] * stride_rs + offs_d[None, :] * stride_rd

    acc = tl.full([BLOCK_S, BLOCK_D], 0.0, dtype=ACC_DTYPE)
    if HAS_INDEX:
        # Every slot that reads head g contributes (GQA replication); -1 slots match nothing.
        for k in range(NUM_SLOTS):
            src = tl.load(index_ptr + k)
            if src == g:
                j = k // HP
                h = k % HP
                ptrs = base + j.to(tl.int64) * stride_rj + h.to(tl.int64) * stride_rh
                acc += tl.load(ptrs, mask=in_bounds, other=0.0).to(ACC_DTYPE)
    else:
        j = g // HP
        h = g % HP
        ptrs = base + j.to(tl.int64) * stride_rj + h.to(tl.int64) * stride_rh
        acc += tl.load(ptrs, mask=in_bounds, other=0.0).to(ACC_DTYPE)

    out_ptrs = out_ptr + ((b.to(tl.int64) * H + g) * S + rows[:, None]) * D + offs_d[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=in_bounds)


@triton.jit
def _permute_copy_kernel(
    src_ptr, dst_ptr,
    S, H, D, n_s_blocks,
    ss_b, ss_h, ss_s, ss_d,
    ds_b, ds_h, ds_s, ds_d,
    BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
):
    pid = tl.program_id(0)
    s_block = pid % n_s_blocks
    rest = pid // n_s_blocks
    h = (rest % H).to(tl.int64)
    b = (rest // H).to(tl.int64)
    offs_s = s_block * BLOCK_S + tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    in_bounds = (offs_s[:, None] < S) & (offs_d[None, :] < D)
    rows = offs_s.to(tl.int64)
    src_ptrs = src_ptr + b * ss_b + h * ss_h + rows[:, None] * ss_s + offs_d[None, :] * ss_d
    dst_ptrs = dst_ptr + b * ds_b + h * ds_h + rows[:, None] * ds_s + offs_d[None, :] * ds_d
    tl.store(dst_ptrs, tl.load(src_ptrs, mask=in_bounds), mask=in_bounds)


def _tile(seq_len: int, head_dim: int, device: torch.device) -> tuple[int, int]:
    """(BLOCK_S, BLOCK_D): ~4K elements per program on a GPU, bigger tiles when interpreted
    (the interpreter pays per program, not per element)."""
    block_d = triton.next_power_of_2(head_dim)
    budget = 16384 if use_interpreter(device) else 4096
    block_s = max(1, min(triton.next_power_of_2(max(seq_len, 1)), budget // block_d))
    return block_s, block_d


def gather_heads(x: torch.Tensor, sp_size: int, hp: int, head_index: Optional[torch.Tensor]) -> torch.Tensor:
    batch, num_heads, seq, dim = x.shape
    send = torch.empty((sp_size, seq, batch, hp, dim), dtype=x.dtype, device=x.device)
    if send.numel() == 0:
        return send
    block_s, block_d = _tile(seq, dim, x.device)
    n_s_blocks = triton.cdiv(seq, block_s)
    index = head_index.to(device=x.device, non_blocking=True) if head_index is not None else x
    grid = (n_s_blocks * batch * sp_size * hp,)
    _gather_heads_kernel[grid](
        x, index, send,
        seq, batch, hp, num_heads, dim, n_s_blocks,
        *x.stride(),
        HAS_INDEX=head_index is not None, BLOCK_S=block_s, BLOCK_D=block_d,
    )
    return send


def scatter_heads(recv: torch.Tensor, num_heads: int, head_index: Optional[torch.Tensor]) -> torch.Tensor:
    sp_size, seq, batch, hp, dim = recv.shape
    out = torch.empty((batch, num_heads, seq, dim), dtype=recv.dtype, device=recv.device)
    if out.numel() == 0:
        return out
    block_s, block_d = _tile(seq, dim, recv.device)
    n_s_blocks = triton.cdiv(seq, block_s)
    index = head_index.to(device=recv.device, non_blocking=True) if head_index is not None else recv
    grid = (n_s_blocks * batch * num_heads,)
    _scatter_heads_kernel[grid](
        recv, index, out,
        seq, batch, hp, num_heads, dim, n_s_blocks,
        *recv.stride(),
        HAS_INDEX=head_index is not None, NUM_SLOTS=sp_size * hp,
        ACC_DTYPE=tl.float64 if recv.dtype == torch.float64 else tl.float32,
        BLOCK_S=block_s, BLOCK_D=block_d,
    )
    return out


def permute_copy(src: torch.Tensor, dst: torch.Tensor) -> torch.Tensor:
    """Copy ``src`` into ``dst``; both are [B, H, S, D] views with any strides."""
    batch, heads, seq, dim = src.shape
    if dst.numel() == 0:
        return dst
    block_s, block_d = _tile(seq, dim, src.device)
    n_s_blocks = triton.cdiv(seq, block_s)
    grid = (n_s_blocks * batch * heads,)
    _permute_copy_kernel[grid](
        src, dst,
        seq, heads, dim, n_s_blocks,
        *src.stride(), *dst.stride(),
        BLOCK_S=block_s, BLOCK_D=block_d,
    )
    return dst
