"""Reductions without a rule of their own: one rule reads the reduced dimensions off the schema
(``dim``/``keepdim`` or the reduction tag) and the output shape."""

from __future__ import annotations

import torch
from rule_helpers import analysed, node, size, trace

from dcp_compile.compiler.passes.sequence_dims import Role, SequenceDim
from dcp_compile.compiler.passes.sequence_dims.schema_reductions import reduced_dimensions, schema_reduction_rule

aten = torch.ops.aten


def test_a_vector_norm_over_the_head_dimension_keeps_the_tokens_apart():
    gm = trace(lambda q: q / torch.linalg.vector_norm(q, dim=-1, keepdim=True), torch.randn(2, 3, 7, 8))
    norm = node(gm, aten.linalg_vector_norm.default)
    role = schema_reduction_rule(norm, analysed(gm, size(gm, 0, 2)))
    assert role.role is Role.TOKEN_LOCAL and role.sequence_dims == (SequenceDim(2),)


def test_reductions_of_other_spellings_follow_from_the_same_rule():
    def reductions(x):
        return x.prod(-1), x.median(-1).values, torch.var_mean(x, dim=(0, 2))[0], x.count_nonzero(-1)

    gm = trace(reductions, torch.randn(2, 7, 8))
    analysis = analysed(gm, size(gm, 0, 1))
    for target, dim in [(aten.prod.dim_int, 1), (aten.median.dim, 1), (aten.var_mean.dim, 0),
                        (aten.count_nonzero.default, 1)]:
        role = schema_reduction_rule(node(gm, target), analysis)
        assert role.role is Role.TOKEN_LOCAL and role.sequence_dims == (SequenceDim(dim),), target


def test_a_reduction_over_the_sequence_mixes():
    gm = trace(lambda x: torch.linalg.vector_norm(x, dim=1), torch.randn(2, 7, 8))
    role = schema_reduction_rule(node(gm, aten.linalg_vector_norm.default), analysed(gm, size(gm, 0, 1)))
    assert role.role is Role.MIXING and "over the sequence" in role.reason


def test_an_op_with_a_dim_but_no_reduction_shape_is_not_taken():
    # renorm normalises each slice along dim, i.e. over every other dimension: default deny.
    gm = trace(lambda x: torch.renorm(x, 2, 2, 1.0), torch.randn(2, 7, 8))
    renorm = node(gm, aten.renorm.default)
    assert reduced_dimensions(renorm) is None
    assert analysed(gm, size(gm, 0, 1)).role_of(renorm) is Role.MIXING
