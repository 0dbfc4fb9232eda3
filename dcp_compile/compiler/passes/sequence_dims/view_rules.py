"""Views: reshapes, permutes, expands and repeats move the sequence dimension without reading
across it; a reshape that splits the sequence (an unpatchify) is sequence-mixing, unless it opens
a grid window (``grid_rules``, tried first by the registry's chain)."""

from __future__ import annotations

import sympy
import torch
import torch.fx as fx

from dcp_compile.compiler.passes.sequence_dims.model import AnalysisView, NodeRole, Role, SequenceDim
from dcp_compile.compiler.passes.sequence_dims.registry import VIEWS, mixing, rule, sequence_inputs, single
from dcp_compile.compiler.passes.sequence_dims.symbolic import (
    equal, map_through_view, normalize, product, shape_of, value_of,
)

aten = torch.ops.aten


@rule(*VIEWS)
def view_rule(node: fx.Node, analysis: AnalysisView) -> NodeRole:
    if not sequence_inputs(node, analysis):
        return NodeRole(Role.NONE)
    source = node.args[0]
    seq = single(analysis.dims_of(source))
    if seq is None:
        return mixing("a reshape of a value with several sequence dimensions")
    if seq.joint:
        return joint_view(node, source, seq)
    mapped = map_through_view(shape_of(value_of(source)), shape_of(value_of(node)), seq, analysis.length)
    if isinstance(mapped, str):
        return mixing(mapped)
    return NodeRole(Role.TOKEN_LOCAL, (mapped,), (source,))


def joint_view(node: fx.Node, source: fx.Node, seq: SequenceDim) -> NodeRole:
    """A reshape keeps a joint dimension only when it leaves that dimension whole and in place
    relative to the rows before it (heads split or merged after it, size-1 dims added)."""
    in_shape, out_shape = shape_of(value_of(source)), shape_of(value_of(node))
    rows_before = product(in_shape[: seq.dim])
    rows = sympy.Integer(1)
    for out_dim, size in enumerate(out_shape):
        if equal(rows, rows_before) and equal(size, in_shape[seq.dim]):
            return NodeRole(Role.TOKEN_LOCAL, (seq.moved(out_dim),), (source,))
        rows = rows * size
    return mixing("a reshape that folds a joint (text + image) sequence dimension")


def permutation(node: fx.Node) -> list[int]:
    """The dimension order a permute, transpose, ``t`` or ``mT`` produces."""
    rank = value_of(node.args[0]).dim()
    if node.target is aten.permute.default:
        return [normalize(d, rank) for d in node.args[1]]
    if node.target is aten.t.default:
        return [1, 0] if rank == 2 else list(range(rank))
    if node.target is aten.mT.default:
        return list(range(rank - 2)) + [rank - 1, rank - 2]
    a, b = (normalize(d, rank) for d in node.args[1:3])
    order = list(range(rank))
    order[a], order[b] = order[b], order[a]
    return order


@rule(aten.permute.default, aten.transpose.int, aten.t.default, aten.mT.default)
def permute_rule(node: fx.Node, analysis: AnalysisView) -> NodeRole:
    source = node.args[0]
    order = permutation(node)
    dims = tuple(seq.moved(order.index(seq.dim)) for seq in analysis.dims_of(source))
    return NodeRole(Role.TOKEN_LOCAL, dims, (source,))


@rule(aten.expand.default)
def expand_rule(node: fx.Node, analysis: AnalysisView) -> NodeRole:
    source = node.args[0]
    offset = value_of(node).dim() - value_of(source).dim()
    dims = tuple(seq.moved(seq.dim + offset) for seq in analysis.dims_of(source))
    return NodeRole(Role.TOKEN_LOCAL, dims, (source,))


@rule(aten.view_as_complex.default, aten.view_as_real.default)
def complex_view_rule(node: fx.Node, analysis: AnalysisView) -> NodeRole:
    """Complex RoPE (``view_as_complex(x.reshape(..., -1, 2)) * freqs``): the pair of reals that
    becomes one complex number is the last dimension, never the sequence."""
    source = node.args[0]
    rank = value_of(source).dim()
    dims = analysis.dims_of(source)
    if node.target is aten.view_as_complex.default and any(seq.dim == rank - 1 for seq in dims):
        return mixing("view_as_complex over the sequence dimension")
    return NodeRole(Role.TOKEN_LOCAL, dims, (source,))


@rule(aten.repeat.default)
def repeat_rule(node: fx.Node, analysis: AnalysisView) -> NodeRole:
    """``x.repeat(1, 2)`` tiles features; it keeps tokens apart unless it tiles the sequence."""
    source, repeats = node.args[:2]
    offset = len(repeats) - value_of(source).dim()  # repeat may add leading dimensions
    dims = []
    for seq in analysis.dims_of(source):
        count = repeats[seq.dim + offset]
        if not (isinstance(count, int) and count == 1):
            return mixing("repeat along the sequence dimension")
        dims.append(seq.moved(seq.dim + offset))
    return NodeRole(Role.TOKEN_LOCAL, tuple(dims), (source,))


@rule(aten.repeat_interleave.self_int, aten.repeat_interleave.self_Tensor)
def repeat_interleave_rule(node: fx.Node, analysis: AnalysisView) -> NodeRole:
    source = node.args[0]
    dim = node.args[2] if len(node.args) > 2 else node.kwargs.get("dim")
    if dim is None:
        return mixing("repeat_interleave of a flattened sequence")
    dim = normalize(dim, value_of(source).dim())
    if any(seq.dim == dim for seq in analysis.dims_of(source)):
        return mixing("repeat_interleave along the sequence dimension")
    return NodeRole(Role.TOKEN_LOCAL, analysis.dims_of(source), (source,))
