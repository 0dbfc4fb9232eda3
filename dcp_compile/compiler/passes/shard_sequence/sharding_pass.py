"""The ``shard_sequence`` pass: plan, re-trace through the interpreter, record what it did."""

from __future__ import annotations

import logging

import torch.fx as fx

from dcp_compile.compiler.graph_capture import retrace
from dcp_compile.compiler.passes.context import PassContext
from dcp_compile.compiler.passes.shard_sequence.interpreter import ShardingInterpreter, describe_node
from dcp_compile.compiler.passes.shard_sequence.lowerings import CannotShard
from dcp_compile.compiler.passes.shard_sequence.plan import ShardPlan, plan_sharding

log = logging.getLogger(__name__)


def shard_sequence_pass(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    analysis = ctx.analysis.sequence
    plan = plan_sharding(analysis) if ctx.sp_size > 1 else ShardPlan()
    fallback_reason = None
    try:
        interpreter = ShardingInterpreter(gm, ctx, analysis, plan)
        sharded = retrace(interpreter.run, ctx.fake_inputs, ctx.fake_mode)
    except CannotShard as reason:
        log.warning("dcp: cannot shard this graph (%s); it runs unsharded on every rank of the "
                    "SP group (correct, but without sequence parallelism)", reason)
        fallback_reason = f"{reason} (at {describe_node(interpreter.current)})"
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
        ctx.variant_record.local_fallbacks = interpreter.local_fallbacks
        ctx.variant_record.no_attention = ctx.analysis.no_attention
    return sharded

