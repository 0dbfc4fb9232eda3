"""Convolution, pooling and resampling: token-local along the batch (and, pooling and resampling,
the channel) dimension; over a spatial dimension they read neighbouring positions."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from rule_helpers import analysed, size, trace

from dcp_compile.compiler.passes.sequence_dims import Role, SequenceDim

aten = torch.ops.aten

CASES = {  # function, input shape, sequence dimension, role
    "conv over the batch": (lambda x, w: F.conv1d(x, w), (7, 3, 9), 0, Role.TOKEN_LOCAL),
    "conv over time": (lambda x, w: F.conv1d(x, w, stride=2), (2, 3, 9), 2, Role.MIXING),
    "conv over time, unbatched": (lambda x, w: F.conv1d(x, w), (3, 9), 1, Role.MIXING),
    "pooling per channel": (lambda x: F.avg_pool2d(x, 2), (2, 7, 4, 4), 1, Role.TOKEN_LOCAL),
    "max pooling with indices over the batch": (lambda x: F.max_pool1d(x, 2, return_indices=True)[0], (7, 3, 8), 0,
                                                Role.TOKEN_LOCAL),
    "pooling over positions": (lambda x: F.avg_pool1d(x, 2), (2, 3, 8), 2, Role.MIXING),
    "upsampling per sample": (lambda x: F.interpolate(x, scale_factor=2.0, mode="bilinear"), (7, 3, 4, 4), 0,
                              Role.TOKEN_LOCAL),
    "upsampling the positions": (lambda x: F.interpolate(x, scale_factor=2.0), (2, 3, 7), 2, Role.MIXING),
    "group norm per sample": (lambda x: F.group_norm(x, 2), (7, 4, 5), 0, Role.TOKEN_LOCAL),
    "group norm over positions": (lambda x: F.group_norm(x, 2), (2, 4, 7), 2, Role.MIXING),
}


@pytest.mark.parametrize("name", list(CASES))
def test_spatial_ops_keep_batch_and_channel_positions_apart(name):
    function, shape, dim, expected = CASES[name]
    weight = (torch.randn(4, 3, 3),) if "conv" in name else ()
    gm = trace(function, torch.randn(*shape), *weight)
    analysis = analysed(gm, size(gm, 0, dim))
    ops = [n for n in gm.graph.nodes if n.op == "call_function"
           and any(kind in str(n.target) for kind in ("conv", "pool", "upsample", "group_norm"))]
    assert ops, gm.graph
    for op in ops:
        role = analysis.roles[op]
        assert role.role is expected, (name, op, role)
        if expected is Role.TOKEN_LOCAL:
            assert role.sequence_dims == (SequenceDim(dim),), (name, op, role)
