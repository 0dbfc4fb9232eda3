"""Matrix products and norms: they contract or normalize the trailing (feature) dimensions, so
the tokens must sit before those; ``k^T @ v`` that sums over the tokens is a local product plus
one all-reduce (a rewrite)."""

from __future__ import annotations

from typing import Any, Iterable

import torch
import torch.fx as fx

from dcp_compile.compiler.passes.sequence_dims.model import AnalysisView, NodeRole, Rewrite, Role, SequenceDim
from dcp_compile.compiler.passes.sequence_dims.registry import broadcast_partners, mixing, op_name, rule, single
from dcp_compile.compiler.passes.sequence_dims.symbolic import equal, shape_of, value_of

aten = torch.ops.aten

def leading_dims_rule(node: fx.Node, analysis: AnalysisView, first: fx.Node, trailing: int,
                      others: Iterable[Any] = ()) -> NodeRole:
    """The op works on the last ``trailing`` dims of ``first``; the sequence must be before them."""
    for other in others:
        if isinstance(other, fx.Node) and analysis.dims_of(other):
            return mixing(f"{op_name(node)} contracts a sequence-indexed operand")
    rank = value_of(first).dim()
    out = value_of(node)
    out_rank = (out[0] if isinstance(out, (tuple, list)) else out).dim()
    dims = []
    for seq in analysis.dims_of(first):
        if seq.dim >= rank - trailing:
            return mixing(f"{op_name(node)} over the sequence dimension")
        dims.append(seq.moved(seq.dim + out_rank - rank))
    elements = None
    if isinstance(out, (tuple, list)):
        elements = tuple(tuple(dims) if isinstance(e, torch.Tensor) and e.dim() == out_rank else () for e in out)
    return NodeRole(Role.TOKEN_LOCAL, tuple(dims), (first,), element_dims=elements)


@rule(aten.linear.default)
def linear_rule(node: fx.Node, analysis: AnalysisView) -> NodeRole:
    return leading_dims_rule(node, analysis, node.args[0], 1, node.args[1:])


@rule(aten.matmul.default, aten.mm.default, aten.bmm.default)
def matmul_rule(node: fx.Node, analysis: AnalysisView) -> NodeRole:
    first, second = node.args[:2]
    if value_of(first).dim() == 1:
        return mixing("a vector-matrix product over the sequence")
    first_seq, second_seq = single(analysis.dims_of(first)), single(analysis.dims_of(second))
    first_rank, second_rank, out_rank = value_of(first).dim(), value_of(second).dim(), value_of(node).dim()
    if (first_seq is not None and second_seq is not None and first_seq.plain and second_seq.plain
        and first_seq.dim == first_rank - 1 and second_seq.dim == second_rank - 2):
        # ``k^T @ v`` of linear attention: a sum over the sequence, done locally plus one all-reduce.
        return mixing("a matrix product that sums over the sequence",
                      rewrite=Rewrite.CONTRACT_OVER_SEQUENCE, aligned=(first, second))
    if (first_seq is not None and second_seq is not None and first_seq.dim < first_rank - 2
        and second_seq.dim < second_rank - 2 and first_seq.dim - first_rank == second_seq.dim - second_rank
            and first_seq == second_seq.moved(first_seq.dim)):
        # Both operands batched over the same tokens (``bmm(row, expert_weight[token])``): one
        # small product per token.
        return NodeRole(Role.TOKEN_LOCAL, (first_seq.moved(first_seq.dim + out_rank - first_rank),), (first, second))
    if first_seq is None and not analysis.dims_of(first) and second_seq is not None and second_seq.dim == second_rank - 1:
        # ``kv @ q^T`` with the tokens as columns: each output column is one token's.
        return NodeRole(Role.TOKEN_LOCAL, (second_seq.moved(out_rank - 1),), (second,))
    result = leading_dims_rule(node, analysis, first, 1, (second,))
    if result.role is Role.TOKEN_LOCAL and first_seq is not None and first_seq.dim < first_rank - 2 and second_rank > 2:
        return batched_over_tokens(node, analysis, result, second, first_seq.moved(first_seq.dim + out_rank - first_rank))
    return result


def batched_over_tokens(node: fx.Node, analysis: AnalysisView, result: NodeRole, second: fx.Node,
                        seq: SequenceDim) -> NodeRole:
    """``bmm(rows, weights)`` with the tokens in the batch dimensions of ``rows`` pairs each token
    with a batch entry of ``weights`` (``w[expert_ids]`` of an MoE's flattened tokens): where that
    entry spans the tokens (a size other than 1) ``weights`` is cut to the same chunk, as an
    elementwise op's broadcast partner is; a value that spans them but runs on the full sequence
    for a reason of its own cannot be paired with the chunk, and the product gathers."""
    out_rank = value_of(node).dim()
    partners = broadcast_partners(node, analysis, seq, out_rank)
    position = seq.dim - (out_rank - value_of(second).dim())
    spans = position >= 0 and not equal(shape_of(value_of(second))[position], 1)
    if spans and not any(partner is second for partner, _ in partners):
        return mixing("a batched matmul whose other operand spans the tokens without being indexed by them")
    return NodeRole(Role.TOKEN_LOCAL, result.sequence_dims, result.aligned_inputs + tuple(p for p, _ in partners),
                    partners=partners)


@rule(aten.addmm.default)
def addmm_rule(node: fx.Node, analysis: AnalysisView) -> NodeRole:
    bias, first, second = node.args[:3]
    return leading_dims_rule(node, analysis, first, 1, (second, bias))


@rule(aten.layer_norm.default, aten.rms_norm.default, aten.native_layer_norm.default)
def norm_rule(node: fx.Node, analysis: AnalysisView) -> NodeRole:
    normalized = node.args[1]
    return leading_dims_rule(node, analysis, node.args[0], len(normalized), node.args[2:])


@rule(aten.outer.default, aten.ger.default)
def outer_rule(node: fx.Node, analysis: AnalysisView) -> NodeRole:
    left, right = node.args[:2]
    if analysis.dims_of(right):
        return mixing("an outer product with a sequence-indexed right operand")
    return NodeRole(Role.TOKEN_LOCAL, analysis.dims_of(left), (left,))


