"""Token grids on each rank's window (see ``sequence_dims/grid_rules`` and ``grid_windows``): the
entry fetches the window by one halo exchange, the exit keeps the rank's own tokens, and the ops
between run on the window (views to its sizes, size reads of the whole grid as traced)."""

from __future__ import annotations

import torch
import torch.fx as fx

from dcp_compile.compiler import grid_windows
from dcp_compile.compiler.passes.sequence_dims import VIEWS, Rewrite, expression
from dcp_compile.compiler.passes.shard_sequence.lowering_context import Lowered, LoweringContext, OpForm, Path
from dcp_compile.compiler.passes.shard_sequence.lowerings import CannotShard, lowering, op_form

aten = torch.ops.aten


@lowering(Rewrite.ENTER_GRID_WINDOW)
def lower_enter_grid_window(context: LoweringContext) -> Lowered:
    n = context.node
    region = context.analysis.grid_regions[n]
    local = context.chunk_of(n.args[0])
    if context.length is None:
        raise CannotShard("the sequence length is unknown where the grid is entered")
    arguments = context.window_arguments(region)
    _, units = grid_windows.window_units(*arguments)
    window = grid_windows.exchange_grid_window(local, region.token_dim, *arguments, context.group)
    return context.lowered(window.reshape(context.window_sizes(region, units=units)), window_units=units,
                           rewrite=f"this rank's window of the token grid (halo exchange of {region.radius} "
                                   f"step(s) of {region.unit} tokens each side, no gather)")


@lowering(Rewrite.LEAVE_GRID_WINDOW)
def lower_leave_grid_window(context: LoweringContext) -> Lowered:
    n = context.node
    region = context.analysis.grid_exits[n]
    if context.window_units(region.entry) is None:  # the entry ran on gathered tokens
        return context.lowered(context.narrow(context.run_full(), context.seq_of(n)))
    tokens_dim = region.exits[n]
    window = context.full_of(n.args[0]).reshape(context.window_sizes(region, tokens_dim))
    return context.lowered(grid_windows.own_tokens_of_grid_window(window, tokens_dim,
                                                                  *context.window_arguments(region)))


def _is_size_read(context: LoweringContext) -> bool:
    return context.node.target is aten.sym_size.int


@op_form(OpForm.SIZE_ON_WINDOW, Path.WINDOW, when=_is_size_read)
def lower_size_on_window(context: LoweringContext) -> Lowered:
    """The whole grid's size, as traced: a size read inside the window means the model's grid."""
    return context.lowered(context.evaluate(expression(context.node.meta["val"])))


def _is_view(context: LoweringContext) -> bool:
    return context.node.target in VIEWS or context.node.target is aten.expand.default


@op_form(OpForm.VIEW_ON_WINDOW, Path.WINDOW, when=_is_view)
def lower_view_on_window(context: LoweringContext) -> Lowered:
    """A view or expand to the window's sizes instead of the whole grid's."""
    n = context.node
    region = context.analysis.grid_members[n]
    args = fx.map_arg(n.args, context.full_of)
    fx.map_arg(n.kwargs, context.full_of)  # the generic path's conversions, in its order
    if n.target is aten.expand.default:
        return context.lowered(args[0].expand(context.window_sizes(region)))
    return context.lowered(args[0].reshape(context.window_sizes(region)))
