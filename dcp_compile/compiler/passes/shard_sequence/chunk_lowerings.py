"""Ops on chunks whose generic form would be wrong or wasteful: a view's sizes name the full
sequence (they get -1 there, so one graph fits every chunk), a slice along the sequence may keep
all of it, and an attention over a dimension this rank holds whole is counted as rank-local."""

from __future__ import annotations

from typing import Any

import torch

from dcp_compile.compiler.passes.find_attention import SDPA
from dcp_compile.compiler.passes.sequence_dims import VIEWS, expression
from dcp_compile.compiler.passes.shard_sequence.lowering_context import Lowered, LoweringContext, OpForm, Path, Site
from dcp_compile.compiler.passes.shard_sequence.lowerings import op_form

aten = torch.ops.aten
SIZED_VIEWS = (aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.expand.default)
TEMPLATE_VIEWS = (aten.view_as.default, aten.reshape_as.default)
# A chunk may not be viewable where the full value was: these become reshapes.
RESHAPED = (aten.view.default, aten._unsafe_view.default, *TEMPLATE_VIEWS)


def _is_view(context: LoweringContext) -> bool:
    return context.node.target in VIEWS or context.node.target is aten.expand.default


@op_form(OpForm.VIEW_ON_CHUNK, Path.CHUNK, when=_is_view)
def lower_view_on_chunk(context: LoweringContext) -> Lowered:
    """A view with -1 at the sequence: view_as/reshape_as carry this rank's sizes instead of
    the full-size template's (which is then read for nothing and never gathered)."""
    n = context.node
    args, kwargs = context.chunk_args(metadata=(1,) if n.target in TEMPLATE_VIEWS else None)
    args = local_sizes(context, args)
    target = aten.reshape.default if n.target in RESHAPED else n.target
    return context.lowered(context.run_op(n.op, target, args, kwargs))


def local_sizes(context: LoweringContext, args: tuple) -> tuple:
    """Replace the sequence entry of a size list by -1; a view then fits any chunk."""
    n = context.node
    target = n.target
    if target in SIZED_VIEWS:
        sizes, offset = list(args[1]), 0
    elif target is aten.unflatten.int:
        sizes, offset = list(args[2]), args[1] % (args[0].dim())
    elif target in TEMPLATE_VIEWS:
        # The full-size template is not this rank's shape: reshape to the output's own sizes.
        return (args[0], output_sizes(context))
    else:
        return args
    out_dim = context.seq_of(n).dim - offset
    if not 0 <= out_dim < len(sizes):
        return args
    static = n.meta["val"].shape
    for index, size in enumerate(sizes):
        if index != out_dim and isinstance(size, int) and size == -1 and target is not aten.expand.default:
            # A second inferred size (``ids.view(-1, S)`` with a symbolic batch): spell it out.
            sizes[index] = context.evaluate(expression(static[index + offset]))
    sizes[out_dim] = -1
    if target is aten.unflatten.int:
        return (args[0], args[1], sizes, *args[3:])
    return (args[0], sizes, *args[2:])


def output_sizes(context: LoweringContext) -> list[Any]:
    """The output's sizes on this rank: the traced sizes, -1 at the sequence dimension."""
    seq = context.seq_of(context.node)
    sizes = [context.evaluate(expression(size)) for size in context.node.meta["val"].shape]
    sizes[seq.dim] = -1
    return sizes


def _is_slice(context: LoweringContext) -> bool:
    return context.node.target in (aten.slice.Tensor, aten.narrow.default)


@op_form(OpForm.SLICE_ON_CHUNK, Path.CHUNK, when=_is_slice)
def lower_slice_on_chunk(context: LoweringContext) -> Lowered:
    """A slice along the sequence that the analysis kept token-local keeps all of it: the chunk
    itself (slicing the chunk by the full bounds would cut it)."""
    n = context.node
    args, kwargs = context.chunk_args()
    source_seq = context.seq_of(n.args[0])
    if args[1] % args[0].dim() == source_seq.dim:
        return context.lowered(args[0])
    return context.lowered(context.run_op(n.op, n.target, args, kwargs))


def _is_attention(context: LoweringContext) -> bool:
    return context.node.target is SDPA


@op_form(OpForm.RANK_LOCAL_ATTENTION, Path.CHUNK, when=_is_attention)
def lower_rank_local_attention(context: LoweringContext) -> Lowered:
    """Attention over a dimension this rank holds whole (the batch of a folded sequence): as it
    is, on the chunks, counted as a rank-local site."""
    return context.lowered(context.run_generic(), site=Site.RANK_LOCAL)
