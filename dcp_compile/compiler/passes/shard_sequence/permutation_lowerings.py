"""Token permutations (an MoE dispatch on this rank's tokens): the inverse permutation is built on
the local rows."""

from __future__ import annotations

import torch

from dcp_compile.compiler.passes.sequence_dims import Rewrite
from dcp_compile.compiler.passes.shard_sequence.lowering_context import Lowered, LoweringContext
from dcp_compile.compiler.passes.shard_sequence.lowerings import lowering


@lowering(Rewrite.INVERSE_PERMUTATION)
def lower_inverse_permutation(context: LoweringContext) -> Lowered:
    index = context.chunk_of(context.node.args[1][0])
    positions = torch.arange(index.shape[0], device=index.device, dtype=index.dtype)
    return context.lowered(torch.empty_like(index).index_put((index,), positions),
                           rewrite="the inverse of this rank's token permutation (local)")
