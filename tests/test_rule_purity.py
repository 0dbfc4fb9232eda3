"""The sequence rules are registrations of pure functions: one rule per op (a second registration
raises, as a second lowering does), and a rule only reads the analysis (issue 35, item 1)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

import dcp_compile.compiler.passes
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


# --- no module state under compiler/passes ------------------------------------------------------

PASSES = Path(dcp_compile.compiler.passes.__file__).resolve().parent
# Caches still kept at module level, each with why it is not analysis state (issue 35 item 1 is
# about the sequence analysis; these are left to their owners).
KNOWN_MODULE_CACHES = {
    ("use_varlen_attention.py", "_choose"): "the packed-attention kernel choice per call shape (runtime dispatch, "
                                            "a pure function of its key; not analysis state)",
}
_CACHES = {"lru_cache", "cache", "cached_property"}
_CONTAINERS = {"dict", "list", "set", "defaultdict", "OrderedDict", "Counter", "deque"}


def _module_state(path: Path) -> list[str]:
    """``global`` statements, module-level caches, and module-level mutable containers that are not
    upper-case tables (registries filled at import and constant op sets are named in capitals)."""
    tree = ast.parse(path.read_text())
    found = [f"global {', '.join(node.names)} (line {node.lineno})" for node in ast.walk(tree)
             if isinstance(node, ast.Global)]
    for statement in tree.body:
        if isinstance(statement, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for decorator in statement.decorator_list:
                name = decorator.func if isinstance(decorator, ast.Call) else decorator
                name = name.attr if isinstance(name, ast.Attribute) else getattr(name, "id", "")
                if name in _CACHES and (path.name, statement.name) not in KNOWN_MODULE_CACHES:
                    found.append(f"@{name} on {statement.name} (line {statement.lineno})")
        targets, value = [], None
        if isinstance(statement, ast.Assign):
            targets, value = statement.targets, statement.value
        elif isinstance(statement, ast.AnnAssign) and statement.value is not None:
            targets, value = [statement.target], statement.value
        mutable = isinstance(value, (ast.Dict, ast.List, ast.Set, ast.DictComp, ast.ListComp, ast.SetComp)) or (
            isinstance(value, ast.Call) and getattr(value.func, "id", getattr(value.func, "attr", "")) in _CONTAINERS)
        for target in targets:
            if mutable and isinstance(target, ast.Name) and target.id != "__all__" and not target.id.lstrip("_").isupper():
                found.append(f"{target.id} = a mutable {type(value).__name__} (line {statement.lineno})")
    return found


def test_no_module_level_caches_or_counters_under_passes():
    """Analysis state lives on the analysis: a module-global cache (the decomposition rule's
    ``_cache``) outlives the graph it was filled for, and a global counter (its ``_depth``) breaks
    the moment two analyses interleave."""
    found = {str(path.relative_to(PASSES)): state for path in sorted(PASSES.rglob("*.py"))
             if (state := _module_state(path))}
    assert not found, found


def test_the_decomposition_memo_belongs_to_one_analysis():
    from dcp_compile.compiler.passes.sequence_dims import decomposition_rules
    from dcp_compile.compiler.passes.sequence_dims.model import SequenceAnalysis

    assert not hasattr(decomposition_rules, "_cache") and not hasattr(decomposition_rules, "_depth")
    first, second = SequenceAnalysis(length=None), SequenceAnalysis(length=None)
    assert first.decompositions is not second.decompositions and first.depth == 0
