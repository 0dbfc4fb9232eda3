"""Token permutations (an MoE dispatch on this rank's tokens): the inverse permutation is built on
the local rows."""

from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx

from dcp_compile.compiler.passes.sequence_dims import Rewrite
from dcp_compile.compiler.passes.shard_sequence.interpreter import ShardingInterpreter
from dcp_compile.compiler.passes.shard_sequence.lowerings import lowering


@lowering(Rewrite.INVERSE_PERMUTATION)
def lower_inverse_permutation(sharding: ShardingInterpreter, n: fx.Node) -> Any:
    index = sharding.as_chunk(n.args[1][0])
    positions = torch.arange(index.shape[0], device=index.device, dtype=index.dtype)
    sharding.rewrites.append(f"{n.name}: the inverse of this rank's token permutation (local)")
    return torch.empty_like(index).index_put((index,), positions)
