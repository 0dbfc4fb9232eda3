"""The collectives the passes insert, as traceable functional ops with exact adjoints.

Everything here is called while the passes re-trace a graph, so it must be expressible in the
graph: ``torch.ops._c10d_functional`` ops (whose registered autograd formulas are the exact
adjoints: all-to-all reverses, all-gather reduce-scatters, all-reduce all-reduces) plus two small
custom ops for the one place where the adjoint alone is not what we want, the graph outputs.

Why outputs are special: every rank of an SP group returns the same (replicated) outputs, and the
user back-propagates the same gradient into each copy. Summing the ranks' parameter gradients
would then count replicated work P times. ``scale_gradient`` divides the gradient entering a
replicated output by P, after which the exact adjoints make the sum over the group equal the
single-process gradient. A sequence gathered straight into an output takes a cheaper route:
``replicated_output`` hands each rank back the slice of the gradient that belongs to its own chunk,
which is what the reduce-scatter adjoint would compute, without the communication.
"""

from __future__ import annotations

import torch

from dcp_compile.compiler.sequence_chunks import chunk_length, chunk_lengths, chunk_start

functional = torch.ops._c10d_functional


def _wait(tensor: torch.Tensor) -> torch.Tensor:
    return functional.wait_tensor(tensor)


def all_to_all(tensor: torch.Tensor, output_splits: list, input_splits: list, group_name: str) -> torch.Tensor:
    """``all_to_all_single`` along dim 0 with (possibly uneven, symbolic) split sizes."""
    return _wait(functional.all_to_all_single(tensor.contiguous(), output_splits, input_splits, group_name))


def all_reduce_sum(tensor: torch.Tensor, group_name: str) -> torch.Tensor:
    return _wait(functional.all_reduce(tensor.contiguous(), "sum", group_name))


def all_reduce_sum_for_replicated_use(tensor: torch.Tensor, group_name: str, group_size: int) -> torch.Tensor:
    """``all_reduce_sum`` for a total that only replicated computation uses (a loss returned as it
    is): its gradient is then the same on every rank, already divided by the group size at the
    output, so the exact adjoint (another all-reduce: P equal copies summed) is a local multiply
    by P. Written so that backward issues no collective: the all-reduce runs on a detached value
    and a zero-valued term carries the gradient."""
    total = all_reduce_sum(tensor.detach(), group_name)
    if not tensor.requires_grad:
        return total
    # Not ``total + (tensor - tensor.detach()) * P``: an infinite local sum makes that term
    # inf - inf = NaN, where eager's total is the infinity (the OpInfo sweep's masked.mean).
    return total_with_local_gradient(total, tensor, float(group_size))


@torch.library.custom_op("dcp::total_with_local_gradient", mutates_args=())
def total_with_local_gradient(total: torch.Tensor, local: torch.Tensor, scale: float) -> torch.Tensor:
    """``total`` forward; the gradient goes to ``local``, times ``scale``, in backward."""
    return total.clone()


@total_with_local_gradient.register_fake
def _(total, local, scale):
    return torch.empty_like(total)


def _total_with_local_gradient_setup(ctx, inputs, output):
    ctx.scale = inputs[2]


def _total_with_local_gradient_backward(ctx, grad):
    return None, grad * ctx.scale, None


total_with_local_gradient.register_autograd(_total_with_local_gradient_backward,
                                            setup_context=_total_with_local_gradient_setup)


def gather_sequence(local: torch.Tensor, dim: int, full_length, sp_size: int, group_name: str) -> torch.Tensor:
    """All-gather the chunks of a sequence dimension into the full, ordered sequence.

    Written as one all-to-all in which every rank sends its chunk to every rank: uneven and
    empty chunks need no padding (padding to the longest chunk would make the graph's shapes
    depend on whether the length divides by P, and so add a guard and a recompile per residue).
    The adjoint (the reverse all-to-all, summed over the P copies) is the exact reduce-scatter.
    """
    moved = local.movedim(dim, 0)
    local_length = moved.shape[0]
    send = moved.unsqueeze(0).expand(sp_size, *moved.shape).reshape(sp_size * local_length, *moved.shape[1:])
    full = all_to_all(send, chunk_lengths(full_length, sp_size), [local_length] * sp_size, group_name)
    return full.movedim(0, dim)


def narrow_to_chunk(full: torch.Tensor, dim: int, full_length, sp_size: int, rank: int) -> torch.Tensor:
    """This rank's chunk of a full sequence dimension (a view: slicing costs nothing)."""
    return full.narrow(dim, chunk_start(full_length, sp_size, rank), chunk_length(full_length, sp_size, rank))


# --- output gradient ops ---------------------------------------------------------------------

@torch.library.custom_op("dcp::scale_gradient", mutates_args=())
def scale_gradient(tensor: torch.Tensor, scale: float) -> torch.Tensor:
    """Identity forward; multiplies the incoming gradient by ``scale`` in backward."""
    return tensor.clone()


@scale_gradient.register_fake
def _(tensor, scale):
    return torch.empty_like(tensor)


def _scale_gradient_backward(ctx, grad):
    return grad * ctx.scale, None


def _scale_gradient_setup(ctx, inputs, output):
    ctx.scale = inputs[1]


scale_gradient.register_autograd(_scale_gradient_backward, setup_context=_scale_gradient_setup)


@torch.library.custom_op("dcp::replicated_output", mutates_args=())
def replicated_output(full: torch.Tensor, local: torch.Tensor, dim: int, start: int) -> torch.Tensor:
    """Return ``full`` (gathered from every rank's ``local`` chunk); the gradient goes to ``local``.

    The gradient of a replicated output is the same on every rank, so each rank's share of it is
    just the slice at its own chunk: no reduce-scatter needed.
    """
    return full.clone()


@replicated_output.register_fake
def _(full, local, dim, start):
    return torch.empty_like(full)


def _replicated_output_setup(ctx, inputs, output):
    _, local, dim, start = inputs
    ctx.dim, ctx.start, ctx.length = dim, start, local.shape[dim]


def _replicated_output_backward(ctx, grad):
    return None, grad.narrow(ctx.dim, ctx.start, ctx.length), None, None


replicated_output.register_autograd(_replicated_output_backward, setup_context=_replicated_output_setup)


@torch.library.custom_op("dcp::replicated_input", mutates_args=())
def replicated_input(tensor: torch.Tensor, group_name: str) -> torch.Tensor:
    """Identity forward; the gradient is summed over the SP group in backward.

    A graph input that is not a parameter (an activation handed over by an earlier graph, after a
    graph break, or a user input that requires grad) is the same on every rank, and each rank's
    graph uses part of it: the sum of the ranks' partial gradients is its gradient, which every
    rank then returns, as eager would.
    """
    return tensor.clone()


@replicated_input.register_fake
def _(tensor, group_name):
    return torch.empty_like(tensor)


def _replicated_input_setup(ctx, inputs, output):
    ctx.group_name = inputs[1]


def _replicated_input_backward(ctx, grad):
    return all_reduce_sum(grad, ctx.group_name), None


replicated_input.register_autograd(_replicated_input_backward, setup_context=_replicated_input_setup)
