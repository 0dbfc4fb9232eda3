"""Grid regions: ``find_grid_region`` on a tiny Mix-FFN (tokens to a grid, a 3x3 depthwise conv,
back to tokens), and the reasons it refuses a grid."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from rule_helpers import analysed, node, size, trace

from dcp_compile.compiler.passes.sequence_dims import GridRegion, Rewrite, Role
from dcp_compile.compiler.passes.sequence_dims.grid_rules import find_grid_region

aten = torch.ops.aten


def convolved_grid(image: torch.Tensor) -> torch.Tensor:
    b, h, w, c = image.shape
    tokens = image.flatten(1, 2)  # [B, H*W, C]: the sequence
    grid = tokens.unflatten(1, (h, w)).permute(0, 3, 1, 2)  # [B, C, H, W]
    return F.conv2d(grid, torch.ones(c, 1, 3, 3), padding=1, groups=c)  # a 3x3 depthwise conv


def mix_ffn(image: torch.Tensor) -> torch.Tensor:
    return convolved_grid(image).flatten(2).transpose(1, 2)  # back to [B, H*W, C]


def entry_of(gm):
    return node(gm, aten.unflatten.int) if list(gm.graph.find_nodes(op="call_function", target=aten.unflatten.int)) \
        else next(n for n in gm.graph.find_nodes(op="call_function", target=aten.view.default))


def test_a_convolution_over_the_rows_is_a_grid_region_of_reach_one():
    gm = trace(mix_ffn, torch.randn(2, 3, 4, 8))
    length = size(gm, 0, 1) * size(gm, 0, 2)
    analysis = analysed(gm, length)
    entry = entry_of(gm)
    region = find_grid_region(entry, analysis)
    assert isinstance(region, GridRegion), region
    assert region.radius == 1 and region.units == size(gm, 0, 1) and region.unit == size(gm, 0, 2)
    assert len(region.exits) == 1
    # The propagation found the same region: the entry and exit are the grid-window rewrites.
    assert analysis.roles[entry].rewrite is Rewrite.ENTER_GRID_WINDOW
    (exit_node,) = region.exits
    assert analysis.roles[exit_node].rewrite is Rewrite.LEAVE_GRID_WINDOW
    assert analysis.roles[node(gm, aten.conv2d.default)].role is Role.NONE  # runs on the window


def test_a_grid_that_reaches_the_outputs_is_refused():
    gm = trace(convolved_grid, torch.randn(2, 3, 4, 8))
    analysis = analysed(gm, size(gm, 0, 1) * size(gm, 0, 2))
    why = find_grid_region(entry_of(gm), analysis)
    assert why.endswith("the grid reaches the graph's outputs"), why
    assert analysis.roles[entry_of(gm)].role is Role.MIXING and entry_of(gm) in analysis.refused_grids
