"""Reductions over the sequence with an exact chunked form: a local sum, product over the chunk,
loss sum or owning rank's position, then one all-reduce over the SP group."""

from __future__ import annotations

import networkx as nx
import torch
import torch.fx as fx

from dcp_compile.compiler import collectives
from dcp_compile.compiler.passes.sequence_dims import Rewrite
from dcp_compile.compiler.passes.shard_sequence.lowering_context import Lowered, LoweringContext
from dcp_compile.compiler.passes.shard_sequence.lowerings import lowering
from dcp_compile.compiler.sequence_chunks import chunk_start

aten = torch.ops.aten


def sum_over_group(context: LoweringContext, partial: torch.Tensor) -> torch.Tensor:
    """The sum of the ranks' ``partial``: when nothing sharded reads it downstream (a loss
    that is returned as it is), backward needs no collective for it."""
    if context.plan.sharded_nodes.isdisjoint(nx.descendants(context.analysis.graph, context.node)):
        return collectives.all_reduce_sum_for_replicated_use(partial, context.group, context.sp_size)
    return collectives.all_reduce_sum(partial, context.group)


@lowering(Rewrite.SUM_OVER_SEQUENCE)
def lower_sum_over_sequence(context: LoweringContext) -> Lowered:
    n = context.node
    source = n.args[0]
    local = context.chunk_of(source)
    seq = context.seq_of(source)
    rank = local.dim()
    if n.target in (aten.sum.default, aten.mean.default):
        dims, keepdim = list(range(rank)), False
    else:
        raw = n.args[1]
        dims = [d % rank for d in ([raw] if isinstance(raw, int) else raw)] or list(range(rank))
        keepdim = bool(n.args[2]) if len(n.args) > 2 else bool(n.kwargs.get("keepdim", False))
    dtype = n.kwargs.get("dtype")
    partial = local.sum(dims, keepdim=keepdim, dtype=dtype)
    total = sum_over_group(context, partial)
    if n.target in (aten.mean.default, aten.mean.dim):
        outer, inner = (1, 1) if seq.plain else context.factors(seq)  # tokens flattened with the batch
        count = context.length * outer * inner
        for d in dims:
            if d != seq.dim:
                count = count * local.shape[d]
        total = total / count
    return context.lowered(total, rewrite="local sum + all-reduce")


@lowering(Rewrite.CONTRACT_OVER_SEQUENCE)
def lower_contract_over_sequence(context: LoweringContext) -> Lowered:
    n = context.node
    partial = context.run_op(n.op, n.target, (context.chunk_of(n.args[0]), context.chunk_of(n.args[1])), n.kwargs)
    return context.lowered(collectives.all_reduce_sum(partial, context.group),
                           rewrite="local matmul over the chunk + all-reduce")


@lowering(Rewrite.LOSS_OVER_SEQUENCE)
def lower_loss_over_sequence(context: LoweringContext) -> Lowered:
    n = context.node
    logits, target = context.chunk_of(n.args[0]), context.chunk_of(n.args[1])
    op = n.target
    names = ["weight", "reduction", "ignore_index", "label_smoothing"]
    extra = {name: value for name, value in zip(names, n.args[2:])}
    extra.update({k: v for k, v in n.kwargs.items()})
    weight = context.full_of(extra.get("weight"), consumer=n) if isinstance(extra.get("weight"), fx.Node) else extra.get("weight")
    reduction = extra.get("reduction", 1)
    ignore_index = extra.get("ignore_index", -100)
    args = [logits, target, weight, 2, ignore_index]
    if op is aten.cross_entropy_loss.default:
        args.append(extra.get("label_smoothing", 0.0))
    local_sum = op(*args)
    if isinstance(local_sum, (tuple, list)):
        local_sum = local_sum[0]
    valid = target != ignore_index
    if weight is None:
        count = valid.sum().to(local_sum.dtype)
    else:
        count = torch.where(valid, weight[target.clamp(min=0)], 0).sum().to(local_sum.dtype)
    totals = sum_over_group(context, torch.stack([local_sum, count]))
    return context.lowered(totals[0] / totals[1] if reduction == 1 else totals[0],
                           rewrite=f"shard-local {op.__name__ if hasattr(op, '__name__') else op} + all-reduce")


@lowering(Rewrite.SELECT_POSITION)
def lower_select_position(context: LoweringContext) -> Lowered:
    n = context.node
    source, dim, index = n.args
    local = context.chunk_of(source)
    dim = dim % local.dim()
    position = index if index >= 0 else context.length + index
    start = chunk_start(context.length, context.sp_size, context.rank)
    positions = torch.arange(local.shape[dim], device=local.device) + start
    weight = (positions == position).to(local.dtype)
    shape = [1] * local.dim()
    shape[dim] = -1
    picked = (local * weight.view(shape)).sum(dim)
    return context.lowered(collectives.all_reduce_sum(picked, context.group),
                           rewrite="the owning rank's position + all-reduce")
