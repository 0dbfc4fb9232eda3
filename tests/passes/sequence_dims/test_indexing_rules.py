"""Indexing and joint-segment rules, called directly on slice, select, split and cat nodes."""

from __future__ import annotations

import torch
from rule_helpers import analysed, node, nodes, size, trace

from dcp_compile.compiler.passes.sequence_dims import Rewrite, Role, SequenceDim
from dcp_compile.compiler.passes.sequence_dims.indexing_rules import cat_rule, select_rule, slice_rule, split_rule

aten = torch.ops.aten


def test_a_slice_of_the_features_keeps_the_tokens():
    gm = trace(lambda x: x[..., :4], torch.randn(2, 7, 8))
    role = slice_rule(node(gm, aten.slice.Tensor), analysed(gm, size(gm, 0, 1)))
    assert role.role is Role.TOKEN_LOCAL and role.sequence_dims == (SequenceDim(1),)


def test_picking_one_position_is_the_select_position_rewrite():
    gm = trace(lambda x: x[:, 0], torch.randn(2, 7, 8))
    select = node(gm, aten.select.int)
    role = select_rule(select, analysed(gm, size(gm, 0, 1)))
    assert role.rewrite is Rewrite.SELECT_POSITION and role.aligned_inputs == (select.args[0],)


def test_text_concatenated_before_the_tokens_is_a_joint_dimension():
    gm = trace(lambda x, text: torch.cat([text, x], dim=1), torch.randn(2, 7, 8), torch.randn(2, 3, 8))
    role = cat_rule(node(gm, aten.cat.default), analysed(gm, size(gm, 0, 1)))
    (seq,) = role.sequence_dims
    assert role.role is Role.TOKEN_LOCAL and seq.joint and seq.before == size(gm, 1, 1) and seq.after == 0


def test_each_segment_of_a_joint_sequence_is_taken_without_a_gather():
    def split_back(x, text):
        joint = torch.cat([text, x], dim=1) * 2
        return joint[:, : text.shape[1]], joint[:, text.shape[1]:], joint.split([text.shape[1], x.shape[1]], dim=1)

    gm = trace(split_back, torch.randn(2, 7, 8), torch.randn(2, 3, 8))
    analysis = analysed(gm, size(gm, 0, 1))
    leading, sharded = [n for n in nodes(gm, aten.slice.Tensor) if n.args[1] == 1]
    assert slice_rule(leading, analysis).rewrite is Rewrite.TAKE_LEADING_SEGMENT
    assert slice_rule(sharded, analysis).rewrite is Rewrite.TAKE_SHARDED_SEGMENT
    (split,) = nodes(gm, aten.split_with_sizes.default) or nodes(gm, aten.split.sizes)
    role = split_rule(split, analysis)
    assert role.rewrite is Rewrite.SPLIT_SEGMENTS and role.element_dims == ((), (SequenceDim(1),))


def test_concatenating_along_the_tokens_of_two_sharded_values_mixes():
    gm = trace(lambda x: torch.cat([x, x], dim=1), torch.randn(2, 7, 8))
    role = cat_rule(node(gm, aten.cat.default), analysed(gm, size(gm, 0, 1)))
    assert role.role is Role.MIXING and role.reason == "concatenates along the sequence dimension"
