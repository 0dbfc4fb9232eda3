"""Tokens sorted, processed and put back: the dispatch of a mixture-of-experts layer.

An MoE feed-forward flattens its tokens, sorts the (token, expert) pairs by expert, gathers the
token rows in that order, runs each expert on its contiguous group (a grouped matmul whose group
offsets come from per-expert counts), and scatters the rows back with the inverse permutation.
Every token's output depends only on its own row, so the whole dispatch can run on the rank's
tokens alone, as if they were the whole batch: sort, counts and inverse permutation are all
computed from the local rows, no gather.

That is only exact while every permuted value stays inside the dispatch. The analysis therefore
tracks, for every value, the order of its token rows (``token_order``: the sort it follows, or
token order) and, for index tensors, what their values address (:class:`TokenPositions`). A
permuted value is only ever combined with values in the same order, indexes the rows of a tensor
in the frame its positions address, and comes back to token order through the inverse of its own
permutation; anything else is sequence-mixing, and the sharding pass refuses to gather a value
whose rows are permuted (a gather would interleave the ranks' local orders).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import sympy
import torch
import torch.fx as fx

from dcp_compile.compiler.passes.sequence_dims.model import (
    AnalysisView, Findings, NodeRole, Rewrite, Role, SequenceDim, TokenPositions,
)
from dcp_compile.compiler.passes.sequence_dims.registry import (
    Stage, mixing, op_name, pointwise, rule, stage_rule,
)
from dcp_compile.compiler.passes.sequence_dims.symbolic import equal, normalize, shape_of, value_of

aten = torch.ops.aten


def token_dim(node: Any, analysis: AnalysisView) -> SequenceDim | None:
    dims = analysis.dims_of(node)
    if len(dims) != 1 or dims[0].dim != 0 or dims[0].before != 0 or dims[0].after != 0:
        return None
    return dims[0]


def sort_token_set(node: fx.Node, analysis: AnalysisView, source: fx.Node, dim: int) -> NodeRole | None:
    """``sort``/``argsort`` of a 1-D token-indexed value (expert ids) along its tokens: the local
    rows sorted locally, with the sort's own indices as positions in that frame."""
    seq = token_dim(source, analysis)
    if seq is None or dim != 0 or value_of(source).dim() != 1 or analysis.roles[source].token_order is not None:
        return None
    if node in analysis.refused_dispatches:
        return mixing(analysis.refused_dispatches[node])
    positions = TokenPositions(node, seq.inner)
    out = value_of(node)
    if isinstance(out, (tuple, list)):
        return NodeRole(Role.TOKEN_LOCAL, (seq,), (source,), "sorts this rank's tokens (a local permutation)",
                        element_dims=((seq,), (seq,)), token_order=node,
                        findings=Findings(positions=((1, positions),)))  # sort: (values, indices)
    return NodeRole(Role.TOKEN_LOCAL, (seq,), (source,), "sorts this rank's tokens (a local permutation)",
                    token_order=node, findings=Findings(positions=((None, positions),)))  # argsort: the indices alone


@rule(aten.floor_divide.default, aten.div.Tensor_mode)
def position_of_token(node: fx.Node, analysis: AnalysisView) -> NodeRole:
    """``pair_position // k``: from the (token, expert) frame to the token frame."""
    source, divisor = node.args[:2]
    positions = analysis.positions.get(source)
    result = pointwise(node, analysis)
    if positions is None or not isinstance(divisor, int) or divisor <= 0:
        return result
    if node.target is aten.div.Tensor_mode and node.kwargs.get("rounding_mode", node.args[2] if len(node.args) > 2 else None) != "floor":
        return result
    inner = sympy.cancel(positions.inner / divisor)
    if result.role == Role.TOKEN_LOCAL and sympy.fraction(inner)[1] == 1:
        found = TokenPositions(positions.sort, inner, positions.inverse)
        return replace(result, findings=Findings(positions=((None, found),)))
    return result


@rule(aten.index.Tensor)
def index_rule(node: fx.Node, analysis: AnalysisView) -> NodeRole:
    """``rows[positions]`` inside a token permutation: gather the local rows in sorted order, or
    put them back in token order with the inverse permutation."""
    source, indices = node.args[:2]
    index = indices[0] if len(indices) == 1 and isinstance(indices[0], fx.Node) else None
    return rows_at(node, analysis, source, index)


@rule(aten.index_select.default)
def index_select_rule(node: fx.Node, analysis: AnalysisView) -> NodeRole:
    """``rows.index_select(0, positions)`` is ``rows[positions]``; along another dimension, a
    selection of features by an index that is not sequence-indexed keeps the tokens apart."""
    source, dim, index = node.args[:3]
    if normalize(dim, value_of(source).dim()) == 0:
        return rows_at(node, analysis, source, index)
    dims = analysis.dims_of(source)
    if analysis.dims_of(index) or any(seq.dim == normalize(dim, value_of(source).dim()) for seq in dims):
        return mixing("index_select along the sequence dimension (or by a sequence-indexed index)")
    return NodeRole(Role.TOKEN_LOCAL, dims, (source,)) if dims else NodeRole(Role.NONE)


def rows_at(node: fx.Node, analysis: AnalysisView, source: fx.Node, index: fx.Node | None) -> NodeRole:
    """The rows of ``source`` at ``index`` (dimension 0)."""
    positions = analysis.positions.get(index) if index is not None else None
    source_seq = token_dim(source, analysis)
    if positions is None or source_seq is None:
        if index is not None and not analysis.dims_of(source):
            # ``table[token_ids]``: rows of a replicated table picked per token, an embedding lookup.
            return NodeRole(Role.TOKEN_LOCAL, analysis.dims_of(index), (index,) if analysis.dims_of(index) else ())
        return mixing(f"no sharding rule for {op_name(node)}")
    index_seq = token_dim(index, analysis)
    if index_seq is None or not equal(source_seq.inner, positions.inner) or not equal(source_seq.outer, index_seq.outer):
        return mixing("indexes token rows in another frame than its positions address")
    source_order = analysis.roles[source].token_order
    if not positions.inverse and source_order is None:
        order = positions.sort  # rows gathered in the sort's order
    elif positions.inverse and source_order is positions.sort:
        order = None  # back in token order
    else:
        return mixing("indexes token rows with the positions of another permutation")
    return NodeRole(Role.TOKEN_LOCAL, (index_seq,), (source, index), "rows of this rank's tokens, permuted locally",
                    token_order=order)


@rule(aten.index_put_.default, aten.index_put.default)
def inverse_permutation_rule(node: fx.Node, analysis: AnalysisView) -> NodeRole:
    """``inverse[perm] = arange(n)``: the inverse of a local permutation, built on the local rows."""
    destination, indices, values = node.args[:3]
    index = indices[0] if len(indices) == 1 and isinstance(indices[0], fx.Node) else None
    positions = analysis.positions.get(index) if index is not None else None
    if (positions is None or positions.inverse or not isinstance(values, fx.Node)
        or values.target not in (aten.arange.default, aten.arange.start) or len(node.args) > 3 and node.args[3]):
        if analysis.dims_of(destination) or (index is not None and analysis.dims_of(index)):
            return mixing("index_put_ with no sharding rule")
        return NodeRole(Role.TOKEN_LOCAL)
    index_seq = token_dim(index, analysis)
    if index_seq is None or not equal(shape_of(value_of(values))[0], shape_of(value_of(index))[0]):
        return mixing("index_put_ of positions that do not cover the tokens")
    inverse = TokenPositions(positions.sort, positions.inner, inverse=True)
    return NodeRole(Role.MIXING, (index_seq,), (index,), "the inverse of a local token permutation",
                    rewrite=Rewrite.INVERSE_PERMUTATION, token_order=positions.sort,
                    findings=Findings(positions=((None, inverse),)))


@rule(aten.index_add_.default, aten.index_add.default)
def rows_added_back_rule(node: fx.Node, analysis: AnalysisView) -> NodeRole:
    """``out.index_add_(0, token_of_row, rows)``: rows in a local sort's order added back to the
    tokens they came from (an MoE's combine, summing a token's top-k rows), with positions of that
    same sort. Each rank adds its own rows to its own tokens. ``out`` is in token order, or a fresh
    value of the token frame's size that is not sequence-indexed yet (``tokens.new_zeros(...)``):
    it is cut to the rank's tokens like a broadcast partner."""
    destination, dim, index, rows = node.args[:4]
    positions = analysis.positions.get(index)
    if positions is None or positions.inverse or normalize(dim, value_of(destination).dim()) != 0:
        if any(analysis.dims_of(n) for n in (destination, index, rows) if isinstance(n, fx.Node)):
            return mixing("index_add of sequence-indexed rows with no sharding rule")
        return NodeRole(Role.NONE)
    index_seq, rows_seq = token_dim(index, analysis), token_dim(rows, analysis)
    if (index_seq is None or rows_seq != index_seq or analysis.roles[rows].token_order is not positions.sort
            or analysis.roles[index].token_order is not positions.sort):
        return mixing("index_add of rows in another order than its positions'")
    frame = SequenceDim(0, outer=index_seq.outer, inner=positions.inner)
    partners: tuple[tuple[fx.Node, SequenceDim], ...] = ()
    destination_seq = token_dim(destination, analysis)
    if destination_seq is None and not analysis.dims_of(destination):
        role = analysis.roles.get(destination)
        size = shape_of(value_of(destination))[0]
        if (role is not None and role.role not in (Role.NONE, Role.SOURCE)) or analysis.length is None or not equal(
                size, analysis.length * frame.outer * frame.inner):
            return mixing("index_add of token rows into a value that is not indexed by the tokens")
        partners, destination_seq = ((destination, frame),), frame
    if (destination_seq is None or analysis.roles[destination].token_order is not None
            or not equal(destination_seq.inner, frame.inner) or not equal(destination_seq.outer, frame.outer)):
        return mixing("index_add of token rows into another frame than its positions address")
    return NodeRole(Role.TOKEN_LOCAL, (frame,), (destination, index, rows),
                    "adds rows of this rank's tokens back to them (a local permutation's combine)",
                    token_order=None, partners=partners)


@rule(aten.histc.default, aten.bincount.default)
def token_count_rule(node: fx.Node, analysis: AnalysisView) -> NodeRole:
    """Counts over this rank's (sorted) tokens: the group sizes of its own rows."""
    source = node.args[0]
    if analysis.dims_of(source) and analysis.roles[source].token_order is not None:
        return NodeRole(Role.TOKEN_SET, (), (source,), "counts this rank's tokens", token_order=None)
    if analysis.dims_of(source):
        return mixing(f"{node.target} over the sequence")
    return NodeRole(Role.TOKEN_LOCAL)


@stage_rule(Stage.GROUPED_MATMUL)
def grouped_matmul_rule(node: fx.Node, analysis: AnalysisView) -> NodeRole:
    """``grouped_mm(rows, weights, offsets)``: each row times its group's weight; with the groups
    counted from the same local rows, a row-wise op."""
    rows, weights = node.args[:2]
    offsets = node.args[2] if len(node.args) > 2 else node.kwargs.get("offs")
    seq = token_dim(rows, analysis)
    if seq is None or analysis.dims_of(weights):
        return mixing("grouped matmul over the sequence")
    if isinstance(offsets, fx.Node) and analysis.roles.get(offsets) is not None and analysis.roles[offsets].role == Role.TOKEN_SET:
        return NodeRole(Role.TOKEN_LOCAL, (seq,), (rows, offsets), "each row by its expert (groups counted locally)",
                        token_order=analysis.roles[rows].token_order)
    return mixing("grouped matmul whose groups are not counted from this rank's tokens")


@rule(aten.topk.default, aten.sort.default, aten.sort.stable, aten.argsort.default, aten.argsort.stable,
      aten.kthvalue.default)
def select_along_rule(node: fx.Node, analysis: AnalysisView) -> NodeRole:
    """Sorting or picking the top-k along a feature dimension (a router over experts) keeps tokens apart."""
    source = node.args[0]
    rank = value_of(source).dim()
    if node.target is aten.topk.default:
        dim = node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", -1)
    elif node.target is aten.kthvalue.default:
        dim = node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", -1)
    else:
        dim = node.kwargs.get("dim", -1)
        if len(node.args) > 1 and isinstance(node.args[1], int) and not isinstance(node.args[1], bool):
            dim = node.args[1]
    dim = normalize(dim, rank)
    dims = analysis.dims_of(source)
    if any(seq.dim == dim for seq in dims):
        return sort_token_set(node, analysis, source, dim) or mixing(f"{op_name(node)} along the sequence dimension")
    out = value_of(node)
    elements = tuple(dims for _ in out) if isinstance(out, (tuple, list)) else None
    return NodeRole(Role.TOKEN_LOCAL, dims, (source,), element_dims=elements)
