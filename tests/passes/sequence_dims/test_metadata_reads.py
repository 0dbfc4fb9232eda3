"""Factories by example (``x.new_zeros(size)`` and its kin) read only their input's dtype and
device: their result depends on no token, so the rule never makes them sequence-mixing (which
would gather their input); a result sized by the sequence is a fresh source of it."""

from __future__ import annotations

import torch
from rule_helpers import analysed, node, size, trace

from dcp_compile.compiler.passes.sequence_dims import Role, SequenceDim
from dcp_compile.compiler.passes.sequence_dims.registry import FACTORIES_BY_EXAMPLE, METADATA_READS, RULES

aten = torch.ops.aten


def test_every_factory_by_example_has_the_metadata_rule():
    for target in FACTORIES_BY_EXAMPLE:
        assert RULES[target].__name__ == "metadata_read_rule", target
        assert METADATA_READS[target] == (0,), target
    assert RULES[aten.type_as.default].__name__ == "type_as_rule"  # b of a.type_as(b): metadata only


def test_a_factory_by_example_of_a_shape_without_the_sequence_reads_no_token():
    gm = trace(lambda x: (x.new_zeros(()), x.new_ones(3), x.new_full((x.shape[0], 4), 0.5), x.new_empty((2,))),
               torch.randn(2, 7, 8))
    analysis = analysed(gm, size(gm, 0, 1))
    for target in (aten.new_zeros.default, aten.new_ones.default, aten.new_full.default, aten.new_empty.default):
        role = analysis.roles[node(gm, target)]
        assert role.role is Role.NONE and not role.sequence_dims, (target, role)


def test_a_factory_by_example_sized_by_the_sequence_is_a_source():
    gm = trace(lambda x: x.new_zeros(x.shape[:2]), torch.randn(2, 7, 8))
    role = analysed(gm, size(gm, 0, 1)).roles[node(gm, aten.new_zeros.default)]
    assert role.role is Role.SOURCE and role.sequence_dims == (SequenceDim(1),)
