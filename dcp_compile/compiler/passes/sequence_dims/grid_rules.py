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

from dataclasses import dataclass, field
from typing import Any

import sympy
import torch
import torch.fx as fx

from dcp_compile.compiler.passes.find_attention import SDPA
from dcp_compile.compiler.passes.sequence_dims import (
    MIXING, NONE, POINTWISE_EXTRA, RULES, SOURCE, TOKEN_LOCAL, VIEWS, NodeRole, RuleResult, SequenceAnalysis,
    SequenceDim, _divides, _equal, _pointwise, _product, _val, map_through_view, shape_of,
)

aten = torch.ops.aten

CONVOLUTIONS = {
    aten.conv1d.default, aten.conv2d.default, aten.conv3d.default, aten.convolution.default,
    aten.conv1d.padding, aten.conv2d.padding, aten.conv3d.padding, aten._convolution.default,
}
SPLITS_SEQUENCE = "a reshape that splits the sequence dimension (e.g. an unpatchify)"


class GridRegionRefused(Exception):
    """Raised while the sequence analysis runs, when a region's member reads a sequence-indexed
    value from outside the region: the analysis restarts without that region."""

    def __init__(self, entry: fx.Node, reason: str) -> None:
        super().__init__(reason)
        self.entry, self.reason = entry, reason


@dataclass
class GridRegion:
    entry: fx.Node  # the reshape that splits the tokens into a grid
    token_dim: int  # the tokens' dimension in the entry's input
    units: Any  # sympy: outermost grid steps (rows of an image, frames of a video)
    unit: Any  # sympy: tokens per outermost step
    radius: int = 0  # outermost steps a kept position reads on each side
    grid_dims: dict[fx.Node, SequenceDim] = field(default_factory=dict)  # member -> its outermost grid dimension
    exits: dict[fx.Node, int] = field(default_factory=dict)  # reshape back to tokens -> its token dimension
    size_reads: set[fx.Node] = field(default_factory=set)  # sym_size of members (read as the full grid's)
    outside_inputs: dict[fx.Node, set[fx.Node]] = field(default_factory=dict)  # member -> inputs from outside

    @property
    def members(self) -> set[fx.Node]:
        return set(self.grid_dims) - {self.entry}


def find_grid_region(entry: fx.Node, analysis: SequenceAnalysis) -> GridRegion | str:
    """The grid region ``entry`` opens, or why there is none."""
    source = entry.args[0]
    dims = analysis.dims_of(source)
    if len(dims) != 1 or not dims[0].plain:
        return "the tokens are not alone in their dimension"
    role = analysis.roles.get(source)
    if role is not None and role.token_order is not None:
        return "the tokens are permuted"
    token_dim = dims[0].dim
    in_shape, out_shape = shape_of(_val(source)), shape_of(_val(entry))
    split = len(out_shape) - len(in_shape) + 1
    if (split < 2 or in_shape[:token_dim] != out_shape[:token_dim]
            or in_shape[token_dim + 1:] != out_shape[token_dim + split:]
            or not _equal(_product(out_shape[token_dim:token_dim + split]), analysis.length)):
        return "the reshape does not split the tokens alone into a grid"
    units = out_shape[token_dim]
    if not _divides(units, analysis.length):
        return "the grid's outermost size does not divide the sequence length"
    region = GridRegion(entry, token_dim, units, sympy.cancel(analysis.length / units))
    grid = SequenceAnalysis(length=units, graph=analysis.graph, parameters=analysis.parameters)
    grid.roles[entry] = NodeRole(TOKEN_LOCAL, (SequenceDim(token_dim),))
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
    region.radius = max(reach[node.args[0]] for node in region.exits)
    return region


def _after(entry: fx.Node):
    node = entry.next
    while node.op != "root":
        yield node
        node = node.next


def _follow(node: fx.Node, region: GridRegion, grid: SequenceAnalysis, reach: dict[fx.Node, int],
            analysis: SequenceAnalysis) -> str | None:
    """Add ``node`` to the region (as a member, an exit or a size read), or say why it can't be."""
    if node.op != "call_function":
        return "the grid reaches the graph's outputs"
    if node in analysis.region_members or node in analysis.regions or node.target is SDPA:
        return "attention inside the grid"
    if node.target is aten.sym_size.int:
        region.size_reads.add(node)
        return None
    inputs = [n for n in node.all_input_nodes if isinstance(_val(n), (torch.Tensor, tuple, list))]
    outside = {n for n in inputs if n not in region.grid_dims}
    reach[node] = max(reach[n] for n in node.all_input_nodes if n in reach)
    if node.target in VIEWS:
        mapped = map_through_view(shape_of(_val(node.args[0])), shape_of(_val(node)),
                                  region.grid_dims[node.args[0]], region.units)
        if isinstance(mapped, str):
            return mapped
        if _equal(mapped.outer, 1) and _equal(mapped.inner, region.unit):
            region.exits[node] = mapped.dim  # all the tokens again, in their order
            return None
        result = RuleResult(TOKEN_LOCAL, (mapped,))
    elif node.target in CONVOLUTIONS:
        result, conv_reach = _convolution(node, region)
        if isinstance(result, str):
            return result
        reach[node] += conv_reach
    elif node.target in RULES:
        result = RULES[node.target](node, grid)
    elif isinstance(node.target, torch._ops.OpOverload) and (
            torch.Tag.pointwise in node.target.tags or node.target in POINTWISE_EXTRA):
        result = _pointwise(node, grid)
    else:
        return "no rule for it on a window of the grid"
    if result.role != TOKEN_LOCAL or len(result.dims) != 1:
        return result.reason or "it reads across the grid's outermost dimension"
    if not (_equal(result.dims[0].before, 0) and _equal(result.dims[0].after, 0)):
        return "it pads or concatenates along the grid's outermost dimension"
    for other in outside:
        if grid.roles.get(other) is not None and grid.roles[other].role == SOURCE:
            return "combines the grid with a value indexed by grid position from outside"
    grid.roles[node] = NodeRole(TOKEN_LOCAL, result.dims, result.element_dims)
    region.grid_dims[node] = result.dims[0]
    if outside:
        region.outside_inputs[node] = outside
    return None


def _convolution(node: fx.Node, region: GridRegion) -> tuple[RuleResult | str, int]:
    """A convolution keeps the grid dimension where it is; along it, it reads ``reach`` steps each
    side, which the window must hold. Only a stride-1 convolution padded to keep the size ("same")
    qualifies; one whose batch dimension holds the grid (frames folded into the batch) reads
    nothing across it."""
    source, weight = node.args[0], node.args[1]
    if source not in region.grid_dims or weight in region.grid_dims:
        return "the grid is the convolution's weight", 0
    grid_dim = region.grid_dims[source]
    if grid_dim.dim == 0:
        return RuleResult(TOKEN_LOCAL, (grid_dim,)), 0
    if grid_dim.dim == 1:
        return "a convolution over the grid's outermost dimension as channels", 0
    if not grid_dim.plain:
        return "a convolution over a dimension that folds the grid with another", 0
    spatial = grid_dim.dim - 2
    kernel_size = shape_of(_val(weight))[2 + spatial]
    if not kernel_size.is_Integer:
        return "a convolution with a symbolic kernel size", 0
    kernel_size = int(kernel_size)
    stride, padding, dilation, transposed = _convolution_arguments(node, len(shape_of(_val(weight))) - 2)
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
    return RuleResult(TOKEN_LOCAL, (grid_dim,)), span // 2


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


def check_outside_inputs(node: fx.Node, region: GridRegion, analysis: SequenceAnalysis) -> None:
    """A member's inputs from outside the region must be the same whole value on every rank (weights,
    a per-sample modulation): a sequence-indexed one would be a chunk, not the window's positions."""
    for other in region.outside_inputs.get(node, ()):
        if other in analysis.grid_members or other in analysis.grid_regions:
            raise GridRegionRefused(region.entry, f"{node.name} combines the window with another grid's "
                                                  f"({other.name}), whose window may differ")
        role = analysis.roles.get(other)
        if role is not None and (analysis.dims_of(other) or role.role not in (NONE, SOURCE)):
            raise GridRegionRefused(region.entry, f"{node.name} reads {other.name}, which is sequence-indexed, "
                                                  "from outside the grid")
        if role is not None and role.role == SOURCE:
            raise GridRegionRefused(region.entry, f"{node.name} reads {other.name}, a full sequence-indexed value")


def member_rule(node: fx.Node, analysis: SequenceAnalysis) -> RuleResult:
    region = analysis.grid_members[node]
    check_outside_inputs(node, region, analysis)
    return RuleResult(NONE, reason=f"runs on this rank's window of the grid entered at {region.entry.name}")


def exit_rule(node: fx.Node, analysis: SequenceAnalysis) -> RuleResult:
    region = analysis.grid_exits[node]
    check_outside_inputs(node, region, analysis)
    return RuleResult(MIXING, (SequenceDim(region.exits[node]),), (region.entry,),
                      "flattens a grid window back into tokens", rewrite="leave_grid_window")


def register(region: GridRegion, analysis: SequenceAnalysis) -> RuleResult:
    """Record the region on the analysis; the entry's own role."""
    analysis.grid_regions[region.entry] = region
    for member in region.members | region.size_reads:
        analysis.grid_members[member] = region
    for exit_node in region.exits:
        analysis.grid_exits[exit_node] = region
    source = region.entry.args[0]
    return RuleResult(MIXING, (), (source,), f"enters a grid window (reach {region.radius} along "
                                             f"{region.units} steps of {region.unit} tokens)",
                      rewrite="enter_grid_window")
