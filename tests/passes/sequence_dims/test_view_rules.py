"""View rules, called directly on reshape, permute and repeat nodes of tiny traced graphs."""

from __future__ import annotations

import torch
from rule_helpers import analysed, node, size, trace

from dcp_compile.compiler.passes.sequence_dims import Role, SequenceDim
from dcp_compile.compiler.passes.sequence_dims.symbolic import SPLITS_SEQUENCE
from dcp_compile.compiler.passes.sequence_dims.view_rules import permute_rule, repeat_rule, view_rule

aten = torch.ops.aten


def test_a_reshape_of_the_features_keeps_the_tokens():
    gm = trace(lambda x: x.view(x.shape[0], x.shape[1], 2, -1), torch.randn(2, 7, 8))
    role = view_rule(node(gm, aten.view.default), analysed(gm, size(gm, 0, 1)))
    assert role.role is Role.TOKEN_LOCAL and role.sequence_dims == (SequenceDim(1),)


def test_a_flatten_with_the_batch_keeps_the_tokens_as_rows():
    gm = trace(lambda x: x.reshape(-1, x.shape[-1]), torch.randn(2, 7, 8))
    analysis = analysed(gm, size(gm, 0, 1))
    (seq,) = view_rule(node(gm, aten.reshape.default), analysis).sequence_dims
    assert seq.dim == 0 and seq.outer == size(gm, 0, 0) and seq.inner == 1


def test_a_reshape_that_splits_the_tokens_is_sequence_mixing():
    gm = trace(lambda x, grid: x.view(x.shape[0], grid.shape[0], grid.shape[1], x.shape[2]),
               torch.randn(2, 12, 8), torch.randn(3, 4))
    # The length is the grid's product, which is x's token count at run time.
    role = view_rule(node(gm, aten.view.default), analysed(gm, size(gm, 0, 1)))
    assert role.role is Role.MIXING and role.reason in (SPLITS_SEQUENCE, "a reshape whose dimensions cannot be matched symbolically")


def test_a_transpose_moves_the_sequence_dimension():
    gm = trace(lambda x: x.transpose(0, 1), torch.randn(2, 7, 8))
    role = permute_rule(node(gm, aten.transpose.int), analysed(gm, size(gm, 0, 1)))
    assert role.role is Role.TOKEN_LOCAL and role.sequence_dims == (SequenceDim(0),)


def test_repeating_the_features_keeps_the_tokens_but_tiling_the_sequence_mixes():
    gm = trace(lambda x: (x.repeat(1, 1, 2), x.repeat(1, 2, 1)), torch.randn(2, 7, 8))
    analysis = analysed(gm, size(gm, 0, 1))
    features, tokens = sorted(gm.graph.find_nodes(op="call_function", target=aten.repeat.default),
                              key=lambda n: n.args[1][1])
    assert repeat_rule(features, analysis).role is Role.TOKEN_LOCAL
    assert repeat_rule(tokens, analysis).reason == "repeat along the sequence dimension"
