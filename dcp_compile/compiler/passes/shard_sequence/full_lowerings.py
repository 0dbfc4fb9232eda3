"""Ops on full values that read chunked ones without a gather (a size, a whole element of a
chunked tuple, a scalar known at compile time), attention sites every rank computes whole (which
the record counts as replicated or unsharded), and views run as reshapes."""

from __future__ import annotations

import operator

import torch

from dcp_compile.compiler.passes.find_attention import SDPA
from dcp_compile.compiler.passes.sequence_dims import expression
from dcp_compile.compiler.passes.shard_sequence.lowering_context import Lowered, LoweringContext, OpForm, Path, Site
from dcp_compile.compiler.passes.shard_sequence.lowerings import op_form

aten = torch.ops.aten
SCALAR_READS = (aten.item.default, aten._local_scalar_dense.default)


def _call_of(context: LoweringContext, *targets: object) -> bool:
    return context.node.op == "call_function" and context.node.target in targets


@op_form(OpForm.SIZE_OF_FULL, Path.FULL, when=lambda context: _call_of(context, aten.sym_size.int))
def lower_size_of_full(context: LoweringContext) -> Lowered:
    """A size of a chunked value read whole: the chunk's own size off the sequence, the full
    length (with a joint dimension's segments, or a flattened one's factors) on it."""
    source, dim = context.node.args
    if context.holds_full(source):
        return context.lowered(context.full_of(source).size(dim))
    seq = context.seq_of(source)
    local = context.chunk_of(source)
    if dim % local.dim() != seq.dim:
        return context.lowered(local.size(dim))
    if seq.joint:
        before, after = context.segments(seq)
        return context.lowered(before + context.length + after)
    outer, inner = context.factors(seq)
    return context.lowered(context.length * outer * inner)


def _whole_element(context: LoweringContext) -> bool:
    n = context.node
    return (_call_of(context, operator.getitem) and context.holds_chunk(n.args[0])
            and not context.analysis.dims_of(n.args[0], n.args[1]))


@op_form(OpForm.WHOLE_ELEMENT, Path.FULL, when=_whole_element)
def lower_whole_element(context: LoweringContext) -> Lowered:
    """An element of a chunked tuple that is whole on every rank: taken as it is, no gather."""
    n = context.node
    return context.lowered(context.chunk_of(n.args[0])[n.args[1]])


def _known_scalar(context: LoweringContext) -> bool:
    return _call_of(context, *SCALAR_READS) and context.node.args[0] in context.scalar_values


@op_form(OpForm.SCALAR_READ, Path.FULL, when=_known_scalar)
def lower_scalar_read(context: LoweringContext) -> Lowered:
    """A scalar input's value, baked in at compile time: no tensor read (and no graph break)."""
    return context.lowered(context.scalar_values[context.node.args[0]])


def _whole_attention(context: LoweringContext) -> bool:
    n = context.node
    return context.sp_size > 1 and n.op == "call_function" and (n.target is SDPA or n in context.analysis.regions)


@op_form(OpForm.WHOLE_ATTENTION, Path.FULL, when=_whole_attention)
def lower_whole_attention(context: LoweringContext) -> Lowered:
    """An attention site on full values: replicated when it runs over another, unsharded
    sequence (a text encoder's tokens, an audio stream) as eager does, unsharded otherwise."""
    n, analysis = context.node, context.analysis
    query = analysis.regions[n].query if n in analysis.regions else n.args[0]
    if not analysis.dims_of(query) and expression(query.meta["val"].shape[-2]) != analysis.length:
        return context.lowered(context.run_generic(), site=Site.REPLICATED)
    role = context.role
    reason = role.reason if role is not None and role.reason else "its region holds no sequence-sharded value"
    return context.lowered(context.run_generic(), site=Site.UNSHARDED, site_reason=reason)


@op_form(OpForm.VIEW_ON_FULL, Path.FULL,
         when=lambda context: context.node.target in (aten.view.default, aten._unsafe_view.default))
def lower_view_on_full(context: LoweringContext) -> Lowered:
    """A view as a reshape: a gathered value need not be viewable where the original was."""
    args, kwargs = context.full_args()
    return context.lowered(context.run_op(context.node.op, aten.reshape.default, args, kwargs))
