"""The import graph as a contract: no circle among the passes, rules that import only the analysis'
model, symbolic and registry modules, lowerings that import only their registry and interface
(they reach the interpreter through its read-only context), and no import from the compiler into
the report (a record does not know its renderer), and torch-version workarounds
(``compiler/workarounds``) that are leaves: the core imports them, they import only each other.

Edges are read from the source (``ast``), as a module names them: ``from a.b import c`` is an edge
to ``a.b.c`` when that is a module, else to ``a.b``. Imports under ``if TYPE_CHECKING:`` are not
edges (they never run).
"""

from __future__ import annotations

import ast
from pathlib import Path

import networkx as nx
import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "dcp_compile"
PASSES = "dcp_compile.compiler.passes"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES = {_module_name(path): path for path in PACKAGE.rglob("*.py")}


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(tree: ast.AST, module: str, is_package: bool) -> list[tuple[str, bool]]:
    """(imported module, imported inside a function) for every import that runs."""
    found: list[tuple[str, bool]] = []

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child):
                for orelse in child.orelse:
                    visit(orelse, in_function)
                continue
            nested = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if isinstance(child, ast.Import):
                found.extend((alias.name, in_function) for alias in child.names)
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    anchor = module.split(".") if is_package else module.split(".")[:-1]
                    anchor = anchor[: len(anchor) - (child.level - 1)]
                    base = ".".join(anchor + ([base] if base else []))
                for alias in child.names:
                    target = f"{base}.{alias.name}"
                    found.append((target if target in MODULES else base, in_function))
            visit(child, nested)

    visit(tree, False)
    return found


def _graph() -> tuple[nx.DiGraph, dict[str, list[tuple[str, bool]]]]:
    graph = nx.DiGraph()
    imports = {}
    for module, path in MODULES.items():
        imports[module] = _imports(ast.parse(path.read_text()), module, path.name == "__init__.py")
        graph.add_node(module)
        for target, _ in imports[module]:
            if target in MODULES:
                graph.add_edge(module, target)
    return graph, imports


GRAPH, IMPORTS = _graph()


def test_no_import_circle_inside_the_passes():
    passes = GRAPH.subgraph(m for m in GRAPH if m == PASSES or m.startswith(PASSES + "."))
    cycles = list(nx.simple_cycles(passes))
    assert not cycles, cycles


def test_the_compiler_does_not_import_the_report():
    offenders = [(module, target) for module, targets in IMPORTS.items() if module.startswith("dcp_compile.compiler")
                 for target, _ in targets if target == "dcp_compile.report" or target.startswith("dcp_compile.report.")]
    assert not offenders, offenders


def test_no_import_inside_a_function_in_the_passes():
    """An import inside a function is how a circle hides; the passes need none."""
    offenders = [(module, target) for module, targets in IMPORTS.items() if module.startswith(PASSES)
                 for target, in_function in targets if in_function and target.startswith("dcp_compile")]
    assert not offenders, offenders


def test_no_import_after_code_in_the_passes():
    offenders = [str(path.relative_to(ROOT)) for module, path in MODULES.items()
                 if module.startswith(PASSES) and "E402" in path.read_text()]
    assert not offenders, offenders


WORKAROUNDS = "dcp_compile.compiler.workarounds"


def _in_workarounds(module: str) -> bool:
    return module == WORKAROUNDS or module.startswith(WORKAROUNDS + ".")


def test_the_workarounds_are_leaves():
    """A workaround imports nothing of dcp's but another workaround (run or lazy), so it can go
    when torch changes without taking anything of the core with it."""
    offenders = [(module, target) for module, targets in IMPORTS.items() if _in_workarounds(module)
                 for target, _ in targets if target.startswith("dcp_compile") and not _in_workarounds(target)]
    assert not offenders, offenders


def test_every_workaround_is_imported_by_the_core():
    """A workaround no module outside the package imports is dead code (or a patch nobody turns on)."""
    workarounds = {m for m in MODULES if _in_workarounds(m) and m != WORKAROUNDS}
    assert workarounds
    used = {target for module, targets in IMPORTS.items() if not _in_workarounds(module) for target, _ in targets}
    assert workarounds <= used, sorted(workarounds - used)


SEQUENCE_DIMS = f"{PASSES}.sequence_dims"
RULE_MODULES = ["attention_rules", "view_rules", "indexing_rules", "reduction_rules", "matmul_rules", "token_sets",
                "elementwise_rules", "grid_rules", "schema_reductions", "inplace_writes", "decomposition_rules",
                "spatial_rules"]


@pytest.mark.parametrize("name", RULE_MODULES)
def test_rule_modules_import_only_the_model_the_symbolic_sizes_and_the_registry(name: str):
    allowed = {f"{SEQUENCE_DIMS}.{base}" for base in ("model", "symbolic", "registry")}
    inside = {target for target, _ in IMPORTS[f"{SEQUENCE_DIMS}.{name}"] if target.startswith(SEQUENCE_DIMS)}
    assert inside <= allowed, inside - allowed


SHARD_SEQUENCE = f"{PASSES}.shard_sequence"
LOWERING_MODULES = ["attention_lowerings", "segment_lowerings", "reduction_lowerings", "permutation_lowerings",
                    "grid_lowerings", "chunk_lowerings", "full_lowerings", "gather_lowerings"]


@pytest.mark.parametrize("name", LOWERING_MODULES)
def test_lowering_modules_import_only_the_registry_and_the_interface(name: str):
    """A lowering reads the interpreter through ``LoweringContext``, never the class."""
    allowed = {f"{SHARD_SEQUENCE}.lowerings", f"{SHARD_SEQUENCE}.lowering_context"}
    inside = {target for target, _ in IMPORTS[f"{SHARD_SEQUENCE}.{name}"] if target.startswith(SHARD_SEQUENCE)}
    assert inside <= allowed, inside - allowed


def test_the_package_init_imports_every_rule_and_lowering_module():
    """A rule module the package does not import would silently register nothing."""
    assert {f"{SEQUENCE_DIMS}.{name}" for name in RULE_MODULES} <= {t for t, _ in IMPORTS[SEQUENCE_DIMS]}
    assert {f"{SHARD_SEQUENCE}.{name}" for name in LOWERING_MODULES} <= {t for t, _ in IMPORTS[SHARD_SEQUENCE]}
    on_disk = {m.rsplit(".", 1)[1] for m in MODULES if m.startswith(SEQUENCE_DIMS + ".") and m.endswith("_rules")}
    assert on_disk <= set(RULE_MODULES), on_disk - set(RULE_MODULES)
    on_disk = {m.rsplit(".", 1)[1] for m in MODULES if m.startswith(SHARD_SEQUENCE + ".") and m.endswith("_lowerings")}
    assert on_disk <= set(LOWERING_MODULES), on_disk - set(LOWERING_MODULES)


@pytest.mark.parametrize("phase", ["planning_state", "levels", "placement", "local_search", "exact_search",
                                   "plan_tables"])
def test_the_planning_phases_read_the_tables_and_never_the_planner(phase: str):
    """The planner drives the phases; a phase calling back into it would be a circle in disguise."""
    source = MODULES[f"dcp_compile.schedule.{phase}"].read_text()
    assert "from .planner import" not in source and "schedule.planner import" not in source
