"""Elementwise ops the pointwise tag does not cover: a dtype cast by example, one-hot encoding,
a user's elementwise ``autograd.Function``, and the reads of metadata alone (sizes, factories by
example), which carry no token."""

from __future__ import annotations

import torch
import torch.fx as fx

from dcp_compile.compiler.custom_autograd import custom_autograd_function, function_of
from dcp_compile.compiler.passes.sequence_dims.model import AnalysisView, NodeRole, Role
from dcp_compile.compiler.passes.sequence_dims.registry import FACTORIES_BY_EXAMPLE, mixing, pointwise, rule

aten = torch.ops.aten


@rule(aten.type_as.default)
def type_as_rule(node: fx.Node, analysis: AnalysisView) -> NodeRole:
    """``a.type_as(b)`` reads only ``b``'s dtype: it keeps ``a``'s layout, whatever ``b``'s shape."""
    source, other = node.args[:2]
    dims = analysis.dims_of(source)
    aligned = (source, other) if dims and analysis.dims_of(other) else (source,)
    return NodeRole(Role.TOKEN_LOCAL if dims else Role.NONE, dims, aligned if dims else ())


@rule(aten.broadcast_tensors.default)
def broadcast_tensors_rule(node: fx.Node, analysis: AnalysisView) -> NodeRole:
    """Each output is its input broadcast to the common shape: elementwise, as ``a + b`` pairs them."""
    return pointwise(node, analysis)


@rule(aten.one_hot.default)
def one_hot_rule(node: fx.Node, analysis: AnalysisView) -> NodeRole:
    source = node.args[0]
    return NodeRole(Role.TOKEN_LOCAL, analysis.dims_of(source), (source,))


@rule(custom_autograd_function._opoverload)
def custom_autograd_function_rule(node: fx.Node, analysis: AnalysisView) -> NodeRole:
    """A user's ``autograd.Function``: token-local when its forward and backward are elementwise."""
    function = function_of(node.args[0])
    if function.elementwise:
        return pointwise(node, analysis)
    return mixing(f"custom autograd.Function at {function.name} is not elementwise")


@rule(aten.sym_size.int)
def sym_size_rule(node: fx.Node, analysis: AnalysisView) -> NodeRole:
    return NodeRole(Role.NONE)


@rule(*FACTORIES_BY_EXAMPLE)
def metadata_read_rule(node: fx.Node, analysis: AnalysisView) -> NodeRole:
    """``x.new_zeros(size)`` and its kin read ``x``'s dtype and device only: no token of ``x`` reaches
    the result, so it depends on no position. A result whose size holds the sequence length is a
    fresh sequence-sized value (a source, settled by the registry); any other is replicated."""
    return NodeRole(Role.NONE, reason="reads only its input's dtype and device")
