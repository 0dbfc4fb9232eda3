"""Recompute policy per variant, as partitioner tags. (Filled in by the variants work.)"""

from __future__ import annotations

import torch.fx as fx

from dcp_compile.passes.context import PassContext


def recompute_pass(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    return gm


recompute_pass.runs_without_sharding = True
