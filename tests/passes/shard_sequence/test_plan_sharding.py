"""``plan_sharding`` is a pure function of the analysis: called directly on tiny traced graphs."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from rule_helpers import analysed, node, size, trace

from dcp_compile.compiler.passes.sequence_dims import Rewrite, Role, SequenceAnalysis
from dcp_compile.compiler.passes.shard_sequence import LOWERINGS, OpForm, plan_sharding

aten = torch.ops.aten
SDPA = aten.scaled_dot_product_attention.default


def heads(x: torch.Tensor) -> torch.Tensor:
    return x.unflatten(-1, (2, -1)).transpose(1, 2)


def model(x: torch.Tensor, other: torch.Tensor):
    h = F.linear(x, torch.ones(8, 8))
    y = F.scaled_dot_product_attention(heads(h), heads(h), heads(h))
    return y.sum(), other * 2  # ``other`` has the tokens' size but never meets an attention


def test_the_region_holding_the_attention_is_sharded_and_the_other_is_not():
    gm = trace(model, torch.randn(2, 7, 8), torch.randn(2, 7, 8))
    analysis = analysed(gm, size(gm, 0, 1))
    plan = plan_sharding(analysis)
    assert plan.regions == 1
    assert {node(gm, aten.linear.default), node(gm, SDPA), node(gm, aten.sum.default)} <= plan.sharded_nodes
    assert node(gm, aten.mul.Tensor) not in plan.sharded_nodes
    assert analysis.roles[node(gm, aten.sum.default)].rewrite is Rewrite.SUM_OVER_SEQUENCE


def test_the_plan_reads_the_analysis_and_changes_nothing():
    gm = trace(model, torch.randn(2, 7, 8), torch.randn(2, 7, 8))
    analysis = analysed(gm, size(gm, 0, 1))
    before = dict(analysis.roles)
    assert plan_sharding(analysis).sharded_nodes == plan_sharding(analysis).sharded_nodes
    assert analysis.roles == before


def test_no_attention_length_plans_nothing():
    assert not plan_sharding(SequenceAnalysis(length=None)).sharded_nodes


def test_attention_every_rewrite_and_every_op_form_have_their_lowering():
    assert set(LOWERINGS) == set(Rewrite) | {Role.ATTENTION} | set(OpForm)
