"""Token grids: the stretch of a graph that reshapes the tokens into a grid and back.

A DiT whose feed-forward convolves the latent grid (Sana's Mix-FFN:
``x.unflatten(1, (H, W)).permute(0, 3, 1, 2)``, a 3x3 depthwise conv between 1x1 convs, then
``flatten(2, 3)`` back to tokens; Sana-Video adds a conv over frames) splits the sharded token
dimension into grid dimensions, which a contiguous chunk of tokens cannot follow. Gathering every
token for it costs an all-gather per layer. But the ops in between read only positions at most a
few steps away along the outermost grid dimension (rows of an image, frames of a video), so each
rank can run them on its *window* (its chunk's whole rows or frames, widened by that reach; see
``dcp_compile.compiler.grid_windows``) and keep its own tokens where the grid is flattened back.

This module finds such a stretch, a *grid region*, from the reshape that enters it: it follows
the outermost grid dimension through the region's ops with the sequence analysis' own rules (the
grid dimension plays the sequence's part, with the number of rows or frames as its length), adds
each convolution's reach along it, and ends at the reshapes that merge the grid back into a
dimension of all the tokens (the exits). A region is refused, and its entry gathers as before,
when an op reads across the grid dimension in another way, when the grid reaches the graph's
outputs, or when it combines with a value that is indexed by position from outside the region.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Iterator

import sympy
import torch
import torch.fx as fx

from dcp_compile.compiler.passes.find_attention import SDPA
from dcp_compile.compiler.passes.sequence_dims.model import (
    AnalysisView, Findings, GridRegion, NodeRole, Refusal, RefusalKind, Rewrite, Role, SequenceAnalysis, SequenceDim,
    read_only,
)
from dcp_compile.compiler.passes.sequence_dims.registry import (
    RULES, VIEWS, Stage, is_pointwise, pointwise, record_findings, single, stage_rule,
)
from dcp_compile.compiler.passes.sequence_dims.symbolic import (
    SPLITS_SEQUENCE, divides, equal, map_through_view, product, shape_of, value_of,
)

aten = torch.ops.aten

CONVOLUTIONS = {
    aten.conv1d.default, aten.conv2d.default, aten.conv3d.default, aten.convolution.default,
    aten.conv1d.padding, aten.conv2d.padding, aten.conv3d.padding, aten._convolution.default,
}


@stage_rule(Stage.GRID_ENTRY)
def grid_entry_rule(node: fx.Node, analysis: AnalysisView) -> NodeRole | None:
    """A reshape that splits the plain tokens into a grid opens a grid region where one can be
    found (returned in the role's findings, which the driver records); None leaves the reshape to
    its view rule, as does a role whose findings say why no region opens."""
    source = node.args[0]
    seq = single(analysis.dims_of(source))
    if seq is None or seq.joint or node in analysis.refused_grids:
        return None
    mapped = map_through_view(shape_of(value_of(source)), shape_of(value_of(node)), seq, analysis.length)
    if mapped != SPLITS_SEQUENCE:
        return None
    region = find_grid_region(node, analysis)
    if isinstance(region, GridRegion):
        return entered(region)
    return NodeRole(Role.NONE, findings=Findings(refused_grid=region))


def find_grid_region(entry: fx.Node, analysis: AnalysisView) -> GridRegion | str:
    """The grid region ``entry`` opens, or why there is none."""
    source = entry.args[0]
    dims = analysis.dims_of(source)
    if len(dims) != 1 or not dims[0].plain:
        return "the tokens are not alone in their dimension"
    role = analysis.roles.get(source)
    if role is not None and role.token_order is not None:
        return "the tokens are permuted"
    token_dim = dims[0].dim
    in_shape, out_shape = shape_of(value_of(source)), shape_of(value_of(entry))
    split = len(out_shape) - len(in_shape) + 1
    if (split < 2 or in_shape[:token_dim] != out_shape[:token_dim]
        or in_shape[token_dim + 1:] != out_shape[token_dim + split:]
            or not equal(product(out_shape[token_dim:token_dim + split]), analysis.length)):
        return "the reshape does not split the tokens alone into a grid"
    units = out_shape[token_dim]
    if not divides(units, analysis.length):
        return "the grid's outermost size does not divide the sequence length"
    region = GridRegion(entry, token_dim, units, sympy.cancel(analysis.length / units))
    grid = SequenceAnalysis(length=units, graph=analysis.graph, parameters=analysis.parameters)
    grid.roles[entry] = NodeRole(Role.TOKEN_LOCAL, (SequenceDim(token_dim),), token_order=None)
    region.grid_dims[entry] = SequenceDim(token_dim)
    reach: dict[fx.Node, int] = {entry: 0}
    for node in _after(entry):
        inside = [n for n in node.all_input_nodes if n in region.grid_dims]
        if not inside:
            continue
        why = _follow(node, region, grid, reach, analysis)
        if why is not None:
            return f"{node.name} ({node.target}): {why}"
    if not region.exits:
        return "the grid is never flattened back into tokens"
    return replace(region, radius=max(reach[node.args[0]] for node in region.exits))


def _after(entry: fx.Node) -> Iterator[fx.Node]:
    node = entry.next
    while node.op != "root":
        yield node
        node = node.next


def _follow(node: fx.Node, region: GridRegion, grid: SequenceAnalysis, reach: dict[fx.Node, int],
            analysis: AnalysisView) -> str | None:
    """Add ``node`` to the region (as a member, an exit or a size read), or say why it can't be."""
    if node.op != "call_function":
        return "the grid reaches the graph's outputs"
    if node in analysis.region_members or node in analysis.regions or node.target is SDPA:
        return "attention inside the grid"
    if node.target is aten.sym_size.int:
        region.size_reads.add(node)
        return None
    inputs = [n for n in node.all_input_nodes if isinstance(value_of(n), (torch.Tensor, tuple, list))]
    outside = {n for n in inputs if n not in region.grid_dims}
    reach[node] = max(reach[n] for n in node.all_input_nodes if n in reach)
    if node.target in VIEWS:
        mapped = map_through_view(shape_of(value_of(node.args[0])), shape_of(value_of(node)),
                                  region.grid_dims[node.args[0]], region.units)
        if isinstance(mapped, str):
            return mapped
        if equal(mapped.outer, 1) and equal(mapped.inner, region.unit):
            region.exits[node] = mapped.dim  # all the tokens again, in their order
            return None
        result = NodeRole(Role.TOKEN_LOCAL, (mapped,))
    elif node.target in CONVOLUTIONS:
        result, conv_reach = _convolution(node, region)
        if isinstance(result, str):
            return result
        reach[node] += conv_reach
    elif node.target in RULES:
        result = RULES[node.target](node, read_only(grid))
        record_findings(node, result, grid)
    elif is_pointwise(node.target):
        result = pointwise(node, read_only(grid))
        record_findings(node, result, grid)
    else:
        return "no rule for it on a window of the grid"
    if result.role != Role.TOKEN_LOCAL or len(result.sequence_dims) != 1:
        return result.reason or "it reads across the grid's outermost dimension"
    if not (equal(result.sequence_dims[0].before, 0) and equal(result.sequence_dims[0].after, 0)):
        return "it pads or concatenates along the grid's outermost dimension"
    for other in outside:
        if grid.roles.get(other) is not None and grid.roles[other].role == Role.SOURCE:
            return "combines the grid with a value indexed by grid position from outside"
    grid.roles[node] = NodeRole(Role.TOKEN_LOCAL, result.sequence_dims, element_dims=result.element_dims, token_order=None)
    region.grid_dims[node] = result.sequence_dims[0]
    if outside:
        region.outside_inputs[node] = outside
    return None


def _convolution(node: fx.Node, region: GridRegion) -> tuple[NodeRole | str, int]:
    """A convolution keeps the grid dimension where it is; along it, it reads ``reach`` steps each
    side, which the window must hold. Only a stride-1 convolution padded to keep the size ("same")
    qualifies; one whose batch dimension holds the grid (frames folded into the batch) reads
    nothing across it."""
    source, weight = node.args[0], node.args[1]
    if source not in region.grid_dims or weight in region.grid_dims:
        return "the grid is the convolution's weight", 0
    grid_dim = region.grid_dims[source]
    if grid_dim.dim == 0:
        return NodeRole(Role.TOKEN_LOCAL, (grid_dim,)), 0
    if grid_dim.dim == 1:
        return "a convolution over the grid's outermost dimension as channels", 0
    if not grid_dim.plain:
        return "a convolution over a dimension that folds the grid with another", 0
    spatial = grid_dim.dim - 2
    kernel_size = shape_of(value_of(weight))[2 + spatial]
    if not kernel_size.is_Integer:
        return "a convolution with a symbolic kernel size", 0
    kernel_size = int(kernel_size)
    stride, padding, dilation, transposed = _convolution_arguments(node, len(shape_of(value_of(weight))) - 2)
    if transposed:
        return "a transposed convolution", 0
    if stride[spatial] != 1:
        return "a strided convolution along the grid", 0
    span = dilation[spatial] * (kernel_size - 1)
    if span % 2:
        return "a convolution with an even kernel along the grid", 0
    if padding == "same":
        pass
    elif padding == "valid" or padding[spatial] != span // 2:
        return "a convolution that changes the grid's size (not padded to keep it)", 0
    return NodeRole(Role.TOKEN_LOCAL, (grid_dim,)), span // 2


def _convolution_arguments(node: fx.Node, spatial_dims: int) -> tuple[list[int], Any, list[int], bool]:
    def expanded(value: Any, default: int) -> list[int]:
        if value is None:
            return [default] * spatial_dims
        if isinstance(value, int):
            return [value] * spatial_dims
        value = list(value)
        return value * spatial_dims if len(value) == 1 else value

    args = list(node.args) + [None] * 9
    if node.target in (aten.convolution.default, aten._convolution.default):
        stride, padding, dilation, transposed = args[3], args[4], args[5], bool(args[6])
    else:  # convNd(input, weight, bias, stride, padding, dilation, groups)
        stride = args[3] if args[3] is not None else node.kwargs.get("stride")
        padding = args[4] if args[4] is not None else node.kwargs.get("padding", 0)
        dilation = args[5] if args[5] is not None else node.kwargs.get("dilation")
        transposed = False
    if isinstance(padding, str):
        return expanded(stride, 1), padding, expanded(dilation, 1), transposed
    return expanded(stride, 1), expanded(padding, 0), expanded(dilation, 1), transposed


def outside_input_refusal(node: fx.Node, region: GridRegion, analysis: AnalysisView) -> NodeRole | None:
    """A member's inputs from outside the region must be the same whole value on every rank (weights,
    a per-sample modulation): a sequence-indexed one would be a chunk, not the window's positions.
    Else the region is refused: a role whose findings stop this attempt (the next one gathers at
    the entry)."""
    for other in region.outside_inputs.get(node, ()):
        why = None
        role = analysis.roles.get(other)
        if other in analysis.grid_members or other in analysis.grid_regions:
            why = f"{node.name} combines the window with another grid's ({other.name}), whose window may differ"
        elif role is not None and (analysis.dims_of(other) or role.role not in (Role.NONE, Role.SOURCE)):
            why = f"{node.name} reads {other.name}, which is sequence-indexed, from outside the grid"
        elif role is not None and role.role == Role.SOURCE:
            why = f"{node.name} reads {other.name}, a full sequence-indexed value"
        if why is not None:
            return NodeRole(Role.MIXING, reason=why, findings=Findings(refusal=Refusal(RefusalKind.GRID, region.entry, why)))
    return None


@stage_rule(Stage.GRID_MEMBER)
def member_rule(node: fx.Node, analysis: AnalysisView) -> NodeRole:
    region = analysis.grid_members[node]
    return outside_input_refusal(node, region, analysis) or NodeRole(
        Role.NONE, reason=f"runs on this rank's window of the grid entered at {region.entry.name}")


@stage_rule(Stage.GRID_EXIT)
def exit_rule(node: fx.Node, analysis: AnalysisView) -> NodeRole:
    region = analysis.grid_exits[node]
    return outside_input_refusal(node, region, analysis) or NodeRole(
        Role.MIXING, (SequenceDim(region.exits[node]),), (region.entry,), "flattens a grid window back into tokens",
        rewrite=Rewrite.LEAVE_GRID_WINDOW)


def entered(region: GridRegion) -> NodeRole:
    """The entry's own role; the region itself rides in its findings (the driver records it)."""
    source = region.entry.args[0]
    return NodeRole(Role.MIXING, (), (source,), f"enters a grid window (reach {region.radius} along "
                                             f"{region.units} steps of {region.unit} tokens)",
                    rewrite=Rewrite.ENTER_GRID_WINDOW, findings=Findings(grid_region=region))
