"""The sequence rules are registrations of pure functions: one rule per op (a second registration
raises, as a second lowering does), and a rule only reads the analysis (issue 35, item 1)."""

from __future__ import annotations

import pytest
import torch

from dcp_compile.compiler.passes.sequence_dims.registry import RULES, STAGE_RULES, Stage, rule, stage_rule

aten = torch.ops.aten


def test_a_second_rule_for_an_op_raises_and_keeps_the_first():
    first = RULES[aten.amax.default]
    with pytest.raises(ValueError, match="two sequence rules registered for aten.amax.default"):
        rule(aten.amax.default)(lambda node, analysis: None)
    assert RULES[aten.amax.default] is first


def test_a_rule_registration_that_collides_registers_none_of_its_ops():
    unused = aten.cummax.default  # no rule of its own (see test_registry)
    assert unused not in RULES
    with pytest.raises(ValueError):
        rule(unused, aten.amax.default)(lambda node, analysis: None)
    assert unused not in RULES


def test_a_second_rule_for_a_stage_raises():
    first = STAGE_RULES[Stage.GRID_ENTRY]
    with pytest.raises(ValueError, match="two rules registered"):
        stage_rule(Stage.GRID_ENTRY)(lambda node, analysis: None)
    assert STAGE_RULES[Stage.GRID_ENTRY] is first


def test_amax_has_the_reduction_rule():
    """``amax.default`` was registered twice (the full-reduction rule won, and handed it straight
    back to the reduction rule): it is one registration now."""
    assert RULES[aten.amax.default].__name__ == "reduction_rule"
