"""Reductions: scans, reductions, losses. Along another dimension they keep the tokens apart;
over the sequence, a sum or mean (and a loss reduced over the tokens) is a local reduction plus
one all-reduce (a rewrite); anything else over the sequence is gathered."""

from __future__ import annotations

import torch
import torch.fx as fx

from dcp_compile.compiler.passes.sequence_dims.model import AnalysisView, NodeRole, Rewrite, Role
from dcp_compile.compiler.passes.sequence_dims.registry import argument, mixing, op_name, rule, single
from dcp_compile.compiler.passes.sequence_dims.symbolic import normalize, value_of

aten = torch.ops.aten

SCANS = {aten.softmax.int, aten._softmax.default, aten.log_softmax.int, aten._log_softmax.default,
         aten.cumsum.default, aten.cumprod.default, aten.logcumsumexp.default}
REDUCTIONS = {aten.sum.dim_IntList, aten.mean.dim, aten.amax.default, aten.amin.default,
              aten.var.correction, aten.std.correction, aten.logsumexp.default, aten.any.dim,
              aten.all.dim, aten.norm.ScalarOpt_dim, aten.var.dim, aten.std.dim, aten.any.dims,
              aten.all.dims, aten.max.dim, aten.min.dim, aten.argmax.default, aten.argmin.default}
# amax.default (dim=[] reduces every dimension) is a REDUCTION: reduction_rule reads its dims.
FULL_REDUCTIONS = {aten.sum.default, aten.mean.default}
LOSSES = {aten.cross_entropy_loss.default, aten.nll_loss.default, aten.nll_loss_nd.default,
          aten.nll_loss2d.default}


@rule(*SCANS)
def scan_rule(node: fx.Node, analysis: AnalysisView) -> NodeRole:
    source = node.args[0]
    dim = normalize(node.args[1], value_of(source).dim())
    if any(seq.dim == dim for seq in analysis.dims_of(source)):
        return mixing(f"{op_name(node)} along the sequence dimension")
    return NodeRole(Role.TOKEN_LOCAL, analysis.dims_of(source), (source,))


@rule(*REDUCTIONS)
def reduction_rule(node: fx.Node, analysis: AnalysisView) -> NodeRole:
    source = node.args[0]
    rank = value_of(source).dim()
    # Read off the schema: ``norm.ScalarOpt_dim`` has ``p`` before ``dim``, ``var.dim`` has
    # ``unbiased`` before ``keepdim``.
    raw = argument(node, "dim")
    if raw is None or (isinstance(raw, (list, tuple)) and len(raw) == 0):
        reduced = set(range(rank))
    elif isinstance(raw, int):
        reduced = {normalize(raw, rank)}
    else:
        reduced = {normalize(d, rank) for d in raw}
    keepdim = bool(argument(node, "keepdim", False))
    dims = []
    for seq in analysis.dims_of(source):
        if seq.dim in reduced:
            # Plain or flattened with the batch (``[B*S, E]`` router probabilities of an MoE): the
            # rank's rows summed, then all-reduced; a joint dimension's replicated segments are not.
            rewrite = (Rewrite.SUM_OVER_SEQUENCE if node.target in (aten.sum.dim_IntList, aten.mean.dim)
                       and not seq.joint else None)
            return mixing(f"{op_name(node)} over the sequence dimension", rewrite=rewrite,
                          aligned=(source,) if rewrite else ())
        shift = 0 if keepdim else sum(1 for d in reduced if d < seq.dim)
        dims.append(seq.moved(seq.dim - shift))
    out = value_of(node)
    elements = None
    if isinstance(out, (tuple, list)):
        elements = tuple(tuple(dims) for _ in out)
    return NodeRole(Role.TOKEN_LOCAL, tuple(dims), (source,), element_dims=elements)


@rule(*FULL_REDUCTIONS)
def full_reduction_rule(node: fx.Node, analysis: AnalysisView) -> NodeRole:
    source = node.args[0]
    seq = single(analysis.dims_of(source))
    rewrite = Rewrite.SUM_OVER_SEQUENCE if seq is not None and not seq.joint else None
    return mixing(f"{op_name(node)} over every dimension", rewrite=rewrite,
                  aligned=(source,) if rewrite else ())


@rule(*LOSSES)
def loss_rule(node: fx.Node, analysis: AnalysisView) -> NodeRole:
    logits, target = node.args[:2]
    reduction = node.args[3] if len(node.args) > 3 else node.kwargs.get("reduction", 1)
    logits_seq, target_seq = single(analysis.dims_of(logits)), single(analysis.dims_of(target))
    if logits_seq is None or target_seq is None:
        return mixing("a loss whose inputs are not both sequence-indexed")
    if logits_seq.joint or target_seq.joint:
        return mixing("a loss over a joint (replicated + sharded) sequence")
    logits_rank = value_of(logits).dim()
    expected_target_dim = logits_seq.dim if logits_seq.dim == 0 else logits_seq.dim - 1
    if logits_seq.dim == 1 and logits_rank > 1 or target_seq.dim != expected_target_dim:
        return mixing("a loss over the class dimension of the sequence")
    if reduction == 0:
        return NodeRole(Role.TOKEN_LOCAL, (target_seq,), (logits, target))
    return mixing("a loss reduced over the sequence", rewrite=Rewrite.LOSS_OVER_SEQUENCE,
                  aligned=(logits, target))


