"""Token-permutation rules (an MoE dispatch on the rank's tokens), called directly."""

from __future__ import annotations

import torch
from rule_helpers import analysed, node, nodes, size, trace

from dcp_compile.compiler.passes.sequence_dims import Rewrite, Role
from dcp_compile.compiler.passes.sequence_dims.model import INHERIT
from dcp_compile.compiler.passes.sequence_dims.token_sets import (
    index_rule, inverse_permutation_rule, select_along_rule, token_count_rule,
)

aten = torch.ops.aten


def dispatch(x: torch.Tensor, router: torch.Tensor):
    rows = x.flatten(0, 1)  # [B*S, D]
    experts = (rows @ router).argmax(-1)  # [B*S]
    order = experts.argsort()
    counts = torch.histc(experts[order].float(), bins=4, min=0, max=3)
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.shape[0])
    return rows[order][inverse] * 2, counts


def test_the_dispatch_sorts_counts_and_restores_this_ranks_tokens():
    gm = trace(dispatch, torch.randn(2, 7, 8), torch.randn(8, 4))
    analysis = analysed(gm, size(gm, 0, 1))
    sort = node(gm, aten.argsort.default)
    role = select_along_rule(sort, analysis)
    assert role.role is Role.TOKEN_LOCAL and role.token_order is sort
    (put,) = nodes(gm, aten.index_put_.default) or nodes(gm, aten.index_put.default)
    by_index = {n.args[1][0]: n for n in nodes(gm, aten.index.Tensor) if n.args[1][0] is not sort}
    gathered = [n for n in nodes(gm, aten.index.Tensor) if n.args[1][0] is sort]
    assert gathered and all(index_rule(n, analysis).token_order is sort for n in gathered)  # rows in sorted order
    assert inverse_permutation_rule(put, analysis).rewrite is Rewrite.INVERSE_PERMUTATION
    assert token_count_rule(node(gm, aten.histc.default), analysis).role is Role.TOKEN_SET
    assert index_rule(by_index[put], analysis).token_order is None  # back in token order


def test_sorting_the_features_keeps_the_tokens_apart():
    gm = trace(lambda x: x.sort(-1).values, torch.randn(2, 7, 8))
    role = select_along_rule(node(gm, aten.sort.default), analysed(gm, size(gm, 0, 1)))
    assert role.role is Role.TOKEN_LOCAL and role.token_order is INHERIT  # the order of its input
