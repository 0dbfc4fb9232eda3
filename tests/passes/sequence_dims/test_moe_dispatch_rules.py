"""Rules an MoE's dispatch styles need, called on tiny traced graphs: expert weights gathered per
(token, expert) pair next to the pairs' rows, rows picked by ``index_select`` and added back by
``index_add_`` in a local sort's order, a gathered op's output over the flattened tokens, and a
capacity read off a local sort's counts (the sort is refused: it runs on the gathered tokens)."""

from __future__ import annotations

import pytest
import torch
from rule_helpers import analysed, node, size, trace

from dcp_compile.compiler.passes.sequence_dims import Role, SequenceAnalysis
from dcp_compile.compiler.passes.sequence_dims.model import DispatchRefused
from dcp_compile.compiler.passes.sequence_dims.propagation import CAPACITY_REASON, fx_to_networkx, propagate

aten = torch.ops.aten


def test_expert_weights_gathered_per_pair_are_cut_with_the_rows():
    """``bmm(rows, w[ids])`` with ids not (yet) known to be sequence-indexed: the batch of gathered
    weights spans the tokens, so it is cut to the rows' chunk (it once stayed full next to chunked
    rows: "Expected size for first two dimensions of batch2 tensor")."""
    gm = trace(lambda x, ids, w: torch.bmm(x.reshape(-1, 1, 8), w[ids]),
               torch.randn(2, 7, 8), torch.randint(0, 4, (14,)), torch.randn(4, 8, 5))
    analysis = analysed(gm, size(gm, 0, 1))
    weights, bmm = node(gm, aten.index.Tensor), node(gm, aten.bmm.default)
    assert analysis.roles[bmm].role is Role.TOKEN_LOCAL and weights in analysis.roles[bmm].aligned_inputs
    assert analysis.roles[weights].role is Role.SOURCE
    assert analysis.roles[weights].sequence_dims == analysis.roles[bmm].sequence_dims


def test_a_gathered_op_over_the_flattened_tokens_keeps_them():
    """``cumsum`` over ``[B*S, E]`` runs gathered; its output is still indexed by the flattened
    tokens, so the elementwise product with a chunked value takes its chunk of it."""
    gm = trace(lambda x: x.flatten(0, 1).cumsum(0) * x.flatten(0, 1), torch.randn(2, 7, 4))
    analysis = analysed(gm, size(gm, 0, 1))
    cumsum, mul = node(gm, aten.cumsum.default), node(gm, aten.mul.Tensor)
    assert analysis.roles[cumsum].role is Role.MIXING
    (seq,) = analysis.roles[cumsum].sequence_dims
    assert seq.dim == 0 and not seq.unflattened
    assert analysis.roles[mul].role is Role.TOKEN_LOCAL and cumsum in analysis.roles[mul].aligned_inputs


def sorted_combine(x: torch.Tensor, router: torch.Tensor) -> torch.Tensor:
    tokens = x.flatten(0, 1)
    ids, order = (tokens @ router).topk(2, dim=-1)[1].reshape(-1).sort()
    token = order // 2
    rows = tokens.index_select(0, token) * (ids[:, None] + 1)
    return tokens.new_zeros(tokens.shape).index_add_(0, token, rows)


def test_rows_picked_and_added_back_in_a_local_sorts_order_stay_on_the_tokens():
    gm = trace(sorted_combine, torch.randn(2, 7, 8), torch.randn(8, 4))
    analysis = analysed(gm, size(gm, 0, 1))
    sort = node(gm, aten.sort.default)
    picked, added = node(gm, aten.index_select.default), node(gm, aten.index_add_.default)
    assert analysis.roles[picked].role is Role.TOKEN_LOCAL and analysis.roles[picked].token_order is sort
    assert analysis.roles[added].role is Role.TOKEN_LOCAL and analysis.roles[added].token_order is None
    buffer = node(gm, aten.new_zeros.default)  # cut to the rank's tokens like a broadcast partner
    assert analysis.roles[buffer].role is Role.SOURCE and buffer in analysis.roles[added].aligned_inputs


def sorted_capacity(x: torch.Tensor, router: torch.Tensor) -> torch.Tensor:
    tokens = x.flatten(0, 1)
    ids, order = (tokens @ router).argmax(-1).sort(stable=True)
    counts = torch.histc(ids.float(), bins=4, min=0, max=3).long()
    starts = counts.cumsum(0) - counts
    place = torch.arange(ids.shape[0]) - starts[ids]
    rows = tokens.index_select(0, order) * (place < (tokens.shape[0] + 3) // 4)[:, None]
    return tokens.new_zeros(tokens.shape).index_add_(0, order, rows)


def test_a_capacity_read_off_a_local_sorts_counts_refuses_the_sort():
    gm = trace(sorted_capacity, torch.randn(2, 7, 8), torch.randn(8, 4))
    sort = node(gm, aten.sort.stable)
    graph = fx_to_networkx(gm.graph)
    with pytest.raises(DispatchRefused) as refusal:
        propagate([], SequenceAnalysis(length=size(gm, 0, 1), graph=graph))
    assert refusal.value.sort is sort and refusal.value.reason == CAPACITY_REASON
    analysis = propagate([], SequenceAnalysis(length=size(gm, 0, 1), graph=graph,
                                              refused_dispatches={sort: CAPACITY_REASON}))
    assert analysis.roles[sort].role is Role.MIXING and analysis.roles[sort].reason == CAPACITY_REASON
    assert not any(role.role is Role.TOKEN_SET for role in analysis.roles.values())
    assert analysis.roles[node(gm, aten.index_add_.default)].role is not Role.TOKEN_LOCAL


def sorted_running_count(x: torch.Tensor, router: torch.Tensor) -> torch.Tensor:
    tokens = x.flatten(0, 1)
    ids, order = (tokens @ router).argmax(-1).sort(stable=True)
    chosen = torch.nn.functional.one_hot(ids, 4)
    place = (chosen.cumsum(0) * chosen).sum(-1) - 1  # a scan across the sorted rows
    rows = tokens.index_select(0, order) * (place < 3)[:, None]
    return tokens.new_zeros(tokens.shape).index_add_(0, order, rows)


def test_a_scan_across_a_local_sorts_rows_refuses_the_sort():
    gm = trace(sorted_running_count, torch.randn(2, 7, 8), torch.randn(8, 4))
    with pytest.raises(DispatchRefused) as refusal:
        propagate([], SequenceAnalysis(length=size(gm, 0, 1), graph=fx_to_networkx(gm.graph)))
    assert refusal.value.sort is node(gm, aten.sort.stable)
