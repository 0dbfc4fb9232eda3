"""Convolutions, pooling, resampling and group normalisation: ops over the last 1, 2 or 3
(spatial) dimensions of a value laid out ``[N, C, *spatial]`` (or ``[C, *spatial]``).

Pooling and resampling treat each ``(n, c)`` plane on its own, so a sequence carried by the batch
or the channel dimension keeps its positions apart; a convolution mixes the channels and a group
normalisation normalises each sample over its channels and positions, so only the batch dimension
of a batched input does. Over a spatial dimension (a conv over time, a pooling
of positions) the op reads neighbouring positions: sequence-mixing, gathered (an audio encoder's
strided convolution over its frames is exactly that).
"""

from __future__ import annotations

import re

import torch
import torch.fx as fx

from dcp_compile.compiler.passes.sequence_dims.model import AnalysisView, NodeRole, Role
from dcp_compile.compiler.passes.sequence_dims.registry import mixing, op_name, rule, sequence_inputs
from dcp_compile.compiler.passes.sequence_dims.symbolic import value_of

aten = torch.ops.aten

PER_PLANE = (
    "avg_pool1d", "avg_pool2d", "avg_pool3d", "max_pool1d", "max_pool2d", "max_pool1d_with_indices",
    "max_pool2d_with_indices", "max_pool3d_with_indices", "adaptive_avg_pool1d", "_adaptive_avg_pool2d",
    "_adaptive_avg_pool3d", "adaptive_max_pool1d", "adaptive_max_pool2d", "adaptive_max_pool3d",
    "upsample_nearest1d", "upsample_nearest2d", "upsample_nearest3d", "upsample_linear1d", "upsample_bilinear2d",
    "upsample_bicubic2d", "upsample_trilinear3d", "_upsample_nearest_exact1d", "_upsample_nearest_exact2d",
    "_upsample_nearest_exact3d", "_upsample_bilinear2d_aa", "_upsample_bicubic2d_aa",
)


def _spatial_dims(name: str) -> int:
    return int(re.search(r"(\d)d", name).group(1))


SPATIAL_DIMS = {getattr(getattr(aten, name), overload): _spatial_dims(name)
                for name in PER_PLANE for overload in ("default", "vec") if hasattr(getattr(aten, name), overload)}


@rule(*SPATIAL_DIMS)
def per_plane_rule(node: fx.Node, analysis: AnalysisView) -> NodeRole:
    """Pooling and resampling: token-local along the dimensions before the spatial ones."""
    source = node.args[0]
    if any(n is not source for n in sequence_inputs(node, analysis)):
        return mixing(f"{op_name(node)} with a second sequence-indexed operand")
    rank = value_of(source).dim()
    dims = analysis.dims_of(source)
    if any(seq.dim >= rank - SPATIAL_DIMS[node.target] for seq in dims):
        return mixing(f"{op_name(node)} over the sequence dimension (a spatial dimension of it)")
    out = value_of(node)
    elements = tuple(dims for _ in out) if isinstance(out, (tuple, list)) else None
    return NodeRole(Role.TOKEN_LOCAL, dims, (source,), element_dims=elements)


@rule(aten.convolution.default, aten.group_norm.default)
def per_sample_rule(node: fx.Node, analysis: AnalysisView) -> NodeRole:
    """Token-local along the batch dimension of a batched input only: a convolution (batched when
    its input has the weight's rank) and a group normalisation (always batched, ``[N, C, *]``)."""
    source = node.args[0]
    if any(n is not source for n in sequence_inputs(node, analysis)):
        return mixing(f"{op_name(node)} with a sequence-indexed weight or bias")
    if node.target is aten.group_norm.default:
        batched = value_of(source).dim() >= 2
    else:
        batched = value_of(source).dim() == value_of(node.args[1]).dim()
    dims = analysis.dims_of(source)
    if not batched or any(seq.dim != 0 for seq in dims):
        return mixing(f"{op_name(node)} over the sequence dimension (its channels or a spatial dimension)")
    return NodeRole(Role.TOKEN_LOCAL, dims, (source,))
