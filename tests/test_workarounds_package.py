"""``dcp_compile/compiler/workarounds/``: code that exists because of how torch behaves in one version.

Each module says, in its docstring, the torch version it was written against and the test that
fails without it (a path that exists), so that it can be dropped when torch changes; the package's
``__init__`` lists every module in one line; none imports the backend or the dispatcher (the core
imports the workarounds, never the reverse: see also tests/test_import_graph.py).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PACKAGE = REPO / "dcp_compile" / "compiler" / "workarounds"
MODULES = sorted(path for path in PACKAGE.glob("*.py") if path.name != "__init__.py")
TORCH_VERSION = re.compile(r"torch (<= ?)?2\.\d+")
TEST_PATH = re.compile(r"tests/test_\w+\.py")
FORBIDDEN = ("dcp_compile.compiler.backend", "dcp_compile.compiler.dispatcher")


def _docstring(path: Path) -> str:
    return ast.get_docstring(ast.parse(path.read_text())) or ""


def _imported_modules(path: Path) -> set[str]:
    """Every module an import names, run or lazy (inside a function), relative ones resolved."""
    package = "dcp_compile.compiler.workarounds"
    modules = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            modules.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            modules.add(base)
            modules.update(f"{base}.{alias.name}" for alias in node.names)
    return modules


def test_the_package_holds_the_workarounds():
    assert {path.stem for path in MODULES} >= {"inductor_patches", "invariant_divisions", "dynamic_output_shapes",
                                               "free_integers"}


@pytest.mark.parametrize("path", MODULES, ids=lambda path: path.stem)
def test_a_workaround_names_its_torch_version_and_a_test_that_exists(path: Path):
    doc = _docstring(path)
    covers = " ".join(doc[doc.find("Covers:"):].split()) if "Covers:" in doc else ""  # lines joined
    assert covers and "Test:" in covers, f"{path.name}: no 'Covers:' / 'Test:' lines in its docstring"
    assert TORCH_VERSION.search(covers), f"{path.name}: its 'Covers:' line names no torch version"
    assert "pytorch/pytorch#" in covers or "no upstream issue filed" in covers, \
        f"{path.name}: its 'Covers:' line names no upstream issue (or says none is filed)"
    tests = TEST_PATH.findall(covers[covers.find("Test:"):])
    assert tests, f"{path.name}: its 'Test:' line names no tests/test_*.py"
    missing = [test for test in tests if not (REPO / test).exists()]
    assert not missing, f"{path.name}: names tests that do not exist: {missing}"


@pytest.mark.parametrize("path", MODULES, ids=lambda path: path.stem)
def test_a_workaround_does_not_import_the_backend_or_the_dispatcher(path: Path):
    offenders = sorted(module for module in _imported_modules(path)
                       if any(module == f or module.startswith(f + ".") for f in FORBIDDEN))
    assert not offenders, f"{path.name} imports {offenders}"


def test_the_package_docstring_lists_every_workaround_with_its_test():
    doc = _docstring(PACKAGE / "__init__.py")
    assert "no upstream issue filed" in " ".join(doc.split())
    assert TORCH_VERSION.search(doc) or "2.13.0" in doc
    for path in MODULES:
        entry = re.search(rf"^- ``{path.stem}``:(.*?)(?=^- ``|^\S|\Z)", doc, re.M | re.S)
        assert entry, f"__init__.py lists no line for {path.stem}"
        tests = TEST_PATH.findall(entry.group(1))
        assert tests and all((REPO / test).exists() for test in tests), (path.stem, tests)
