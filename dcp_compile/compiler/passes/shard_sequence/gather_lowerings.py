"""Full values of chunked nodes in place of their plain all-gather (``Path.GATHER``): a
selection across the batch taken from its source's one gather, and a value only reshaped into
graph outputs gathered the way an output is."""

from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx

from dcp_compile.compiler import collectives
from dcp_compile.compiler.passes.shard_sequence.lowering_context import Lowered, LoweringContext, OpForm, Path
from dcp_compile.compiler.passes.shard_sequence.lowerings import op_form
from dcp_compile.compiler.sequence_chunks import chunk_start

aten = torch.ops.aten
# Selections along a dimension other than the sequence (a sample of the batch, a range of them).
BATCH_SELECTIONS = frozenset({aten.select.int, aten.slice.Tensor, aten.narrow.default})


def _selection_of_gathered_source(context: LoweringContext) -> bool:
    node = context.node
    if node.op != "call_function" or node.target not in BATCH_SELECTIONS:
        return False
    source = node.args[0]
    if not isinstance(source, fx.Node) or not context.holds_chunk(source):
        return False
    local = context.chunk_of(source)
    if not isinstance(local, torch.Tensor):
        return False
    seq = context.seq_of(source)
    rank = local.dim()
    dim = node.args[1] % rank
    if not seq.plain or dim == seq.dim:
        return False
    # Selections whose own consumers run on full values (they will be gathered too).
    siblings = [user for user in source.users if user.op == "call_function" and user.target in BATCH_SELECTIONS
                and user.args[1] % rank == dim and any(c not in context.plan.sharded_nodes for c in user.users)]
    return context.holds_full(source) or len(siblings) >= 2


@op_form(OpForm.SELECTION_OF_GATHERED_SOURCE, Path.GATHER, when=_selection_of_gathered_source)
def lower_selection_of_gathered_source(context: LoweringContext) -> Lowered:
    """A selection across the batch (``hidden[i]``) of a chunked value, in full, from one gather.

    A model that unpatchifies each sample on its own (``hidden[i][text:]`` per ``i``) would
    otherwise gather every sample's selection separately: the same bytes in B collectives.
    When the source has two or more such selections, or is gathered already, it is gathered
    once and each selection is taken from it.
    """
    node = context.node
    full = context.full_of(node.args[0], context.reason, context.consumer)
    args = fx.map_arg(node.args[1:], context.full_of)
    kwargs = fx.map_arg(node.kwargs, context.full_of)
    return context.lowered(context.call(node.target, (full, *args), kwargs))


def _only_reshaped_into_outputs(context: LoweringContext) -> bool:
    consumer = context.consumer
    if consumer is None or consumer not in context.output_tail or context.sp_size <= 1:
        return False
    if not isinstance(context.chunk_of(context.node), torch.Tensor):
        return False
    return context.seq_of(context.node).plain


@op_form(OpForm.GATHER_FOR_OUTPUT, Path.GATHER, when=_only_reshaped_into_outputs)
def lower_gather_for_output(context: LoweringContext) -> Lowered:
    """The value in full for a consumer whose result is only reshaped into graph outputs.

    A sliding-window K/V cache keeps ``keys[:, :, -window:]`` of each layer and returns it:
    a slice along the sequence, so it needs the full keys, but only to hand them back, like
    a returned full cache. It is gathered the way an output is (outside autograd, its
    gradient handed to this rank's chunk without a sum over ranks) and counted as an output
    gather, not as a gather the computation needs. Not kept (``output_gather``): a computing
    consumer of the same value gets its own, summed gather.
    """
    local = context.chunk_of(context.node)
    seq = context.seq_of(context.node)
    full: Any = context.gather(local.detach(), seq)
    if local.requires_grad:
        start = chunk_start(context.length, context.sp_size, context.rank)
        full = collectives.replicated_output(full, local, seq.dim, start)
    return context.lowered(full, output_gather=True)
