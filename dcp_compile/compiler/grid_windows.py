"""Halo exchange: each rank's window of a token grid, for ops that read neighbouring positions.

A convolution over an image's latent grid (Sana's Mix-FFN: 1x1 conv, 3x3 depthwise conv, 1x1
conv) or over a video's frames (a temporal conv) reads, for each position, the positions up to a
few grid steps away. With the tokens sharded in contiguous chunks, a rank needs only its chunk
plus the grid steps around it: its *window* is the whole outermost grid steps (image rows, video
frames) that overlap its chunk, widened by the convolutions' radius on each side and clipped at
the grid's edges. Where the window ends at the grid's edge, the convolution's zero padding is
exactly what eager computes; where it ends inside the grid, the positions near the window's edge
are wrong, but they are at least ``radius`` steps away from the rank's own tokens, which are the
only ones kept.

The exchange is one all-to-all in which rank ``j`` sends rank ``i`` the part of its chunk that
lies in ``i``'s window (usually the neighbours only; every rank in between when chunks are shorter
than the window). Its adjoint sends the window's gradient back and sums the overlaps into the
chunk. The bounds are plain integer arithmetic (``torch.sym_max``/``sym_min`` for the clipping),
so one trace serves every length, as for the chunks themselves (see ``sequence_chunks``).
"""

from __future__ import annotations

from typing import Any

import torch

from dcp_compile.compiler.sequence_chunks import chunk_length, chunk_start

functional = torch.ops._c10d_functional


def window_units(length: Any, unit: Any, radius: int, sp_size: int, rank: int) -> tuple[Any, Any]:
    """``(first, count)``: the outermost grid steps (of ``unit`` tokens each) in ``rank``'s window."""
    start = chunk_start(length, sp_size, rank)
    end = start + chunk_length(length, sp_size, rank)
    first = torch.sym_max(start // unit - radius, 0)
    last = torch.sym_min((end + unit - 1) // unit + radius, length // unit)
    return first, last - first


def _overlap(a_start: int, a_end: int, b_start: int, b_end: int) -> tuple[int, int]:
    start = max(a_start, b_start)
    return start, max(0, min(a_end, b_end) - start)


def _exchange_plan(length: int, unit: int, radius: int, sp_size: int, rank: int):
    """What this rank sends (offset and length in its chunk, per destination) and receives (per source)."""
    chunks = [(chunk_start(length, sp_size, r), chunk_start(length, sp_size, r) + chunk_length(length, sp_size, r))
              for r in range(sp_size)]
    windows = []
    for r in range(sp_size):
        first, count = window_units(length, unit, radius, sp_size, r)
        windows.append((first * unit, (first + count) * unit))
    own_start, own_end = chunks[rank]
    sends = []
    for window_start, window_end in windows:
        start, size = _overlap(own_start, own_end, window_start, window_end)
        sends.append((start - own_start if size else 0, size))
    window_start, window_end = windows[rank]
    receives = [_overlap(start, end, window_start, window_end)[1] for start, end in chunks]
    return sends, receives


def _all_to_all(tensor: torch.Tensor, output_splits: list[int], input_splits: list[int], group_name: str) -> torch.Tensor:
    return functional.wait_tensor(functional.all_to_all_single(tensor.contiguous(), output_splits, input_splits, group_name))


@torch.library.custom_op("dcp::exchange_grid_window", mutates_args=())
def exchange_grid_window(local: torch.Tensor, dim: int, length: int, unit: int, radius: int, sp_size: int,
                         rank: int, group_name: str) -> torch.Tensor:
    """This rank's window (whole grid steps, widened by ``radius``) from every rank's chunk of ``dim``."""
    sends, receives = _exchange_plan(length, unit, radius, sp_size, rank)
    moved = local.movedim(dim, 0)
    send = torch.cat([moved.narrow(0, offset, size) for offset, size in sends])
    window = _all_to_all(send, receives, [size for _, size in sends], group_name)
    return window.movedim(0, dim).contiguous()


def _resized(tensor: torch.Tensor, dim: int, size: Any) -> torch.Tensor:
    shape = list(tensor.shape)
    shape[dim] = size
    return tensor.new_empty(shape)


def _remember_arguments(ctx, inputs, output) -> None:
    ctx.arguments = inputs[1:]  # everything but the tensor: the adjoint takes the same


@exchange_grid_window.register_fake
def _(local, dim, length, unit, radius, sp_size, rank, group_name):
    return _resized(local, dim, window_units(length, unit, radius, sp_size, rank)[1] * unit)


@torch.library.custom_op("dcp::return_grid_window_gradient", mutates_args=())
def return_grid_window_gradient(window_gradient: torch.Tensor, dim: int, length: int, unit: int, radius: int,
                                sp_size: int, rank: int, group_name: str) -> torch.Tensor:
    """The adjoint of the exchange: every window's gradient goes back to the chunks it came from,
    and the overlapping pieces of this rank's chunk are summed."""
    sends, receives = _exchange_plan(length, unit, radius, sp_size, rank)
    moved = window_gradient.movedim(dim, 0)
    returned = _all_to_all(moved, [size for _, size in sends], receives, group_name)
    own = chunk_length(length, sp_size, rank)
    gradient = moved.new_zeros(own, *moved.shape[1:])
    position = 0
    for offset, size in sends:
        if size:
            gradient.narrow(0, offset, size).add_(returned.narrow(0, position, size))
        position += size
    return gradient.movedim(0, dim).contiguous()


@return_grid_window_gradient.register_fake
def _(window_gradient, dim, length, unit, radius, sp_size, rank, group_name):
    return _resized(window_gradient, dim, chunk_length(length, sp_size, rank))


def _exchange_backward(ctx, gradient):
    return (return_grid_window_gradient(gradient, *ctx.arguments),) + (None,) * len(ctx.arguments)


exchange_grid_window.register_autograd(_exchange_backward, setup_context=_remember_arguments)


@torch.library.custom_op("dcp::own_tokens_of_grid_window", mutates_args=())
def own_tokens_of_grid_window(window: torch.Tensor, dim: int, length: int, unit: int, radius: int, sp_size: int,
                              rank: int) -> torch.Tensor:
    """This rank's chunk, cut out of a value computed on its window."""
    first, _ = window_units(length, unit, radius, sp_size, rank)
    offset = chunk_start(length, sp_size, rank) - first * unit
    return window.narrow(dim, offset, chunk_length(length, sp_size, rank)).contiguous()


@own_tokens_of_grid_window.register_fake
def _(window, dim, length, unit, radius, sp_size, rank):
    return _resized(window, dim, chunk_length(length, sp_size, rank))


@torch.library.custom_op("dcp::place_tokens_in_grid_window", mutates_args=())
def place_tokens_in_grid_window(chunk_gradient: torch.Tensor, dim: int, length: int, unit: int, radius: int,
                                sp_size: int, rank: int) -> torch.Tensor:
    """The adjoint of ``own_tokens_of_grid_window``: the chunk's gradient at its place, zeros around."""
    first, count = window_units(length, unit, radius, sp_size, rank)
    shape = list(chunk_gradient.shape)
    shape[dim] = count * unit
    window = chunk_gradient.new_zeros(shape)
    offset = chunk_start(length, sp_size, rank) - first * unit
    window.narrow(dim, offset, chunk_gradient.shape[dim]).copy_(chunk_gradient)
    return window


@place_tokens_in_grid_window.register_fake
def _(chunk_gradient, dim, length, unit, radius, sp_size, rank):
    return _resized(chunk_gradient, dim, window_units(length, unit, radius, sp_size, rank)[1] * unit)


def _own_backward(ctx, gradient):
    return (place_tokens_in_grid_window(gradient, *ctx.arguments),) + (None,) * len(ctx.arguments)


own_tokens_of_grid_window.register_autograd(_own_backward, setup_context=_remember_arguments)
