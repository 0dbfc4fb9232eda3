"""The ``shard_sequence`` pass: plan, re-trace through the interpreter, record what it did."""

from __future__ import annotations

import logging

import torch.fx as fx

from dcp_compile.compiler.graph_capture import retrace
from dcp_compile.compiler.passes.context import PassContext
from dcp_compile.compiler.passes.sequence_dims import SequenceAnalysis
from dcp_compile.compiler.passes.shard_sequence.interpreter import ShardingInterpreter, describe_node
from dcp_compile.compiler.passes.shard_sequence.lowerings import CannotShard, WriteRefused
from dcp_compile.compiler.passes.shard_sequence.plan import ShardPlan, plan_sharding

log = logging.getLogger(__name__)


def _trace_refusing_writes(gm: fx.GraphModule, ctx: PassContext, analysis: SequenceAnalysis, plan: ShardPlan,
                           attempts: list[ShardingInterpreter]) -> tuple[ShardingInterpreter, fx.GraphModule]:
    """Re-trace until no in-place write refuses its chunk: each ``WriteRefused`` puts that
    buffer's members (up to its last write) on the full sequence, with the reason, and traces
    again. Bounded: each retry adds at least one new member, and a member never leaves. Every
    interpreter tried is appended to ``attempts`` (the last one names where a trace gave up)."""
    refused: dict[fx.Node, str] = {}
    while True:
        interpreter = ShardingInterpreter(gm, ctx, analysis, plan, refused)
        attempts.append(interpreter)
        try:
            return interpreter, retrace(interpreter.run, ctx.fake_inputs, ctx.fake_mode)
        except WriteRefused as refusal:
            new = {member: refusal.reason for member in refusal.members if member not in refused}
            if not new:
                raise CannotShard(refusal.reason) from None  # nothing left to take off the chunks
            log.info("dcp: %s", refusal.reason)
            refused.update(new)


def shard_sequence_pass(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    analysis = ctx.analysis.sequence
    plan = plan_sharding(analysis) if ctx.sp_size > 1 else ShardPlan()
    fallback_reason = None
    attempts: list[ShardingInterpreter] = []
    try:
        interpreter, sharded = _trace_refusing_writes(gm, ctx, analysis, plan, attempts)
    except CannotShard as reason:
        log.warning("dcp: cannot shard this graph (%s); it runs unsharded on every rank of the "
                    "SP group (correct, but without sequence parallelism)", reason)
        fallback_reason = f"{reason} (at {describe_node(attempts[-1].current)})"
        plan = ShardPlan()
        interpreter = ShardingInterpreter(gm, ctx, analysis, plan)
        sharded = retrace(interpreter.run, ctx.fake_inputs, ctx.fake_mode)
    if ctx.variant_record is not None:
        ctx.variant_record.gathers.extend(interpreter.gathers)
        ctx.variant_record.rewrites.extend(interpreter.rewrites)
        ctx.variant_record.sharded_regions = plan.regions
        ctx.variant_record.sharded_sites = interpreter.sharded_sites
        ctx.variant_record.rank_local_sites = interpreter.rank_local_sites
        ctx.variant_record.replicated_sites = interpreter.replicated_sites
        ctx.variant_record.unsharded_sites = interpreter.unsharded_sites
        ctx.variant_record.output_gathers = interpreter.output_gathers
        ctx.variant_record.fallback_reason = fallback_reason
        # A buffer whose write had no chunked form ran on the full sequence: said once per buffer.
        ctx.variant_record.local_fallbacks = interpreter.local_fallbacks + sorted(set(interpreter.refused_writes.values()))
        ctx.variant_record.no_attention = ctx.analysis.no_attention
    return sharded

