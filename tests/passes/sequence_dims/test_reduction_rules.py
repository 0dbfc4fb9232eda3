"""Reduction rules, called directly on sums, maxima, scans and losses of tiny traced graphs."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from rule_helpers import analysed, node, size, trace

from dcp_compile.compiler.passes.sequence_dims import Rewrite, Role, SequenceDim
from dcp_compile.compiler.passes.sequence_dims.reduction_rules import (
    full_reduction_rule, loss_rule, reduction_rule, scan_rule,
)

aten = torch.ops.aten


def test_a_sum_over_the_tokens_is_a_local_sum_plus_all_reduce():
    gm = trace(lambda x: x.sum(1), torch.randn(2, 7, 8))
    total = node(gm, aten.sum.dim_IntList)
    role = reduction_rule(total, analysed(gm, size(gm, 0, 1)))
    assert role.rewrite is Rewrite.SUM_OVER_SEQUENCE and role.aligned_inputs == (total.args[0],)


def test_a_mean_over_the_features_keeps_the_tokens():
    gm = trace(lambda x: x.mean(-1), torch.randn(2, 7, 8))
    role = reduction_rule(node(gm, aten.mean.dim), analysed(gm, size(gm, 0, 1)))
    assert role.role is Role.TOKEN_LOCAL and role.sequence_dims == (SequenceDim(1),)


def test_a_maximum_over_the_tokens_is_gathered():
    gm = trace(lambda x: x.amax(1), torch.randn(2, 7, 8))
    role = reduction_rule(node(gm, aten.amax.default), analysed(gm, size(gm, 0, 1)))
    assert role.role is Role.MIXING and role.rewrite is None


def test_a_full_sum_is_a_local_sum_plus_all_reduce():
    gm = trace(lambda x: x.sum(), torch.randn(2, 7, 8))
    assert full_reduction_rule(node(gm, aten.sum.default), analysed(gm, size(gm, 0, 1))).rewrite is Rewrite.SUM_OVER_SEQUENCE


def test_a_cumsum_along_the_tokens_mixes_with_its_reason():
    gm = trace(lambda x: x.cumsum(1), torch.randn(2, 7, 8))
    role = scan_rule(node(gm, aten.cumsum.default), analysed(gm, size(gm, 0, 1)))
    assert role.role is Role.MIXING and role.reason == "cumsum along the sequence dimension"


def test_a_mean_token_loss_is_a_shard_local_loss_plus_all_reduce():
    gm = trace(lambda logits, labels: F.cross_entropy(logits.flatten(0, 1), labels.flatten()),
               torch.randn(2, 7, 11), torch.randint(0, 11, (2, 7)))
    loss = node(gm, aten.cross_entropy_loss.default)
    role = loss_rule(loss, analysed(gm, size(gm, 0, 1)))
    assert role.rewrite is Rewrite.LOSS_OVER_SEQUENCE and role.aligned_inputs == tuple(loss.args[:2])
