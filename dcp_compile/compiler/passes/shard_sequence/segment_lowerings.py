"""Joint sequences (replicated text segments around this rank's chunk of the image tokens): each
segment is taken out of the rank's value locally, no gather."""

from __future__ import annotations

from typing import Any

import torch

from dcp_compile.compiler.passes.sequence_dims import Rewrite, SequenceDim
from dcp_compile.compiler.passes.shard_sequence.lowering_context import Lowered, LoweringContext
from dcp_compile.compiler.passes.shard_sequence.lowerings import lowering
def joint_parts(context: LoweringContext) -> tuple[torch.Tensor, SequenceDim, Any, Any]:
    source = context.node.args[0]
    seq = context.seq_of(source)
    before, after = context.segments(seq)
    return context.chunk_of(source), seq, before, after


@lowering(Rewrite.TAKE_SHARDED_SEGMENT)
def lower_take_sharded_segment(context: LoweringContext) -> Lowered:
    local, seq, before, after = joint_parts(context)
    return context.lowered(local.narrow(seq.dim, before, local.shape[seq.dim] - before - after),
                           rewrite="the chunk of a joint sequence (no gather)")


@lowering(Rewrite.TAKE_LEADING_SEGMENT)
def lower_take_leading_segment(context: LoweringContext) -> Lowered:
    local, seq, before, _ = joint_parts(context)
    return context.lowered(local.narrow(seq.dim, 0, before),
                           rewrite="the replicated leading segment of a joint sequence (no gather)")


@lowering(Rewrite.TAKE_TRAILING_SEGMENT)
def lower_take_trailing_segment(context: LoweringContext) -> Lowered:
    local, seq, _, after = joint_parts(context)
    return context.lowered(local.narrow(seq.dim, local.shape[seq.dim] - after, after),
                           rewrite="the replicated trailing segment of a joint sequence (no gather)")


@lowering(Rewrite.SPLIT_SEGMENTS)
def lower_split_segments(context: LoweringContext) -> Lowered:
    local, seq, before, after = joint_parts(context)
    pieces = [size for size, expr in ((before, seq.before), (local.shape[seq.dim] - before - after, None),
                                      (after, seq.after)) if expr is None or expr != 0]
    return context.lowered(list(torch.split_with_sizes(local, pieces, seq.dim)),
                           rewrite="a joint sequence split into its segments (no gather)")
