"""Joint sequences (replicated text segments around this rank's chunk of the image tokens): each
segment is taken out of the rank's value locally, no gather."""

from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx

from dcp_compile.compiler.passes.sequence_dims import Rewrite, SequenceDim
from dcp_compile.compiler.passes.shard_sequence.interpreter import ShardingInterpreter
from dcp_compile.compiler.passes.shard_sequence.lowerings import lowering


def joint_parts(sharding: ShardingInterpreter, n: fx.Node) -> tuple[torch.Tensor, SequenceDim, Any, Any]:
    source = n.args[0]
    seq = sharding.seq_of(source)
    before, after = sharding.segments(seq)
    return sharding.as_chunk(source), seq, before, after


@lowering(Rewrite.TAKE_SHARDED_SEGMENT)
def lower_take_sharded_segment(sharding: ShardingInterpreter, n: fx.Node) -> Any:
    local, seq, before, after = joint_parts(sharding, n)
    sharding.rewrites.append(f"{n.name}: the chunk of a joint sequence (no gather)")
    return local.narrow(seq.dim, before, local.shape[seq.dim] - before - after)


@lowering(Rewrite.TAKE_LEADING_SEGMENT)
def lower_take_leading_segment(sharding: ShardingInterpreter, n: fx.Node) -> Any:
    local, seq, before, _ = joint_parts(sharding, n)
    sharding.rewrites.append(f"{n.name}: the replicated leading segment of a joint sequence (no gather)")
    return local.narrow(seq.dim, 0, before)


@lowering(Rewrite.TAKE_TRAILING_SEGMENT)
def lower_take_trailing_segment(sharding: ShardingInterpreter, n: fx.Node) -> Any:
    local, seq, _, after = joint_parts(sharding, n)
    sharding.rewrites.append(f"{n.name}: the replicated trailing segment of a joint sequence (no gather)")
    return local.narrow(seq.dim, local.shape[seq.dim] - after, after)


@lowering(Rewrite.SPLIT_SEGMENTS)
def lower_split_segments(sharding: ShardingInterpreter, n: fx.Node) -> Any:
    local, seq, before, after = joint_parts(sharding, n)
    pieces = [size for size, expr in ((before, seq.before), (local.shape[seq.dim] - before - after, None),
                                      (after, seq.after)) if expr is None or expr != 0]
    sharding.rewrites.append(f"{n.name}: a joint sequence split into its segments (no gather)")
    return list(torch.split_with_sizes(local, pieces, seq.dim))
