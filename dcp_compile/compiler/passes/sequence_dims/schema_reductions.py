"""Reductions with no rule of their own, by one rule over the reduced dimensions.

An op is a reduction when its schema says so: it carries ``torch.Tag.reduction``, or it takes a
``dim`` and a ``keepdim`` argument; and its output confirms it: each output has the input's shape
with the reduced dimensions removed (or kept as 1). ``linalg_vector_norm`` over the head
dimension (a q/k normalisation), ``prod``, ``median``, ``var_mean``, ``count_nonzero`` all
follow from that, with no rule per op. Over other dimensions the tokens stay apart
(token-local); over the sequence, the op mixes (gathered; sums and means have their own rule with
an exact rewrite in ``reduction_rules``). Any other tensor operand must not be sequence-indexed.

An op with a ``dim`` argument but no reduction shape (``renorm`` normalises the slices *along*
``dim``, that is over every other dimension) is not taken: default deny.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from dcp_compile.compiler.passes.sequence_dims.model import AnalysisView, NodeRole, Role
from dcp_compile.compiler.passes.sequence_dims.registry import Stage, argument, mixing, op_name, stage_rule
from dcp_compile.compiler.passes.sequence_dims.symbolic import equal, normalize, shape_of, value_of


def reduced_dimensions(node: fx.Node) -> tuple[set[int], bool] | None:
    """The dimensions ``node`` reduces and its ``keepdim``, when it is a reduction; else None."""
    target = node.target
    if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
        return None
    schema = target._schema
    names = {argument.name for argument in schema.arguments}
    if "dim" not in names or not (torch.Tag.reduction in target.tags or "keepdim" in names):
        return None
    source = node.args[0] if node.args else None
    source_value, out = value_of(source), value_of(node)
    if not isinstance(source_value, torch.Tensor):
        return None
    rank = source_value.dim()
    raw = argument(node, "dim")
    keepdim = bool(argument(node, "keepdim", False))
    if raw is None or (isinstance(raw, (list, tuple)) and len(raw) == 0):
        reduced = set(range(rank))
    elif isinstance(raw, int):
        reduced = {normalize(raw, rank)}
    elif isinstance(raw, (list, tuple)) and all(isinstance(d, int) for d in raw):
        reduced = {normalize(d, rank) for d in raw}
    else:
        return None
    in_shape = shape_of(source_value)
    expected = [1 if d in reduced else size for d, size in enumerate(in_shape) if keepdim or d not in reduced]
    outputs = out if isinstance(out, (tuple, list)) else (out,)
    for value in outputs:
        shape = shape_of(value)
        if shape is None or len(shape) != len(expected) or not all(equal(a, b) for a, b in zip(shape, expected)):
            return None
    return reduced, keepdim


@stage_rule(Stage.SCHEMA_REDUCTION)
def schema_reduction_rule(node: fx.Node, analysis: AnalysisView) -> NodeRole | None:
    """A reduction read off its schema and shapes; None when ``node`` is no reduction."""
    found = reduced_dimensions(node)
    if found is None:
        return None
    reduced, keepdim = found
    source = node.args[0]
    others = [n for n in node.all_input_nodes if n is not source and analysis.dims_of(n)]
    if others:
        return mixing(f"{op_name(node)} with a second sequence-indexed operand")
    dims = []
    for seq in analysis.dims_of(source):
        if seq.dim in reduced:
            return mixing(f"{op_name(node)} over the sequence dimension")
        shift = 0 if keepdim else sum(1 for d in reduced if d < seq.dim)
        dims.append(seq.moved(seq.dim - shift))
    out = value_of(node)
    elements = tuple(tuple(dims) for _ in out) if isinstance(out, (tuple, list)) else None
    return NodeRole(Role.TOKEN_LOCAL, tuple(dims), (source,), reason="a reduction over other dimensions",
                    element_dims=elements)
