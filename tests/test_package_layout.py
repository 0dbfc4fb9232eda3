"""The package's shape is a contract: one-way imports, no side effects on import."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "dcp_compile"


def _imported_modules(path: Path) -> set[str]:
    modules = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            modules.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            modules.add(node.module)
    return modules


@pytest.mark.parametrize("package, forbidden", [
    ("schedule", "dcp_compile.compiler"),      # the scheduler prices variants by name only
    ("kernels", "dcp_compile.compiler"),       # compiler -> kernels, never back
    ("compiler/passes", "dcp_compile.compiler.backend"),
    ("compiler/passes", "dcp_compile.compiler.dispatcher"),
    ("compiler/passes", "dcp_compile.schedule"),
    ("compiler", "dcp_compile.schedule"),
    ("compiler/workarounds", "dcp_compile.compiler.backend"),     # torch workarounds are leaves the core imports
    ("compiler/workarounds", "dcp_compile.compiler.dispatcher"),
    ("compiler/workarounds", "dcp_compile.compiler.passes"),
])
def test_imports_point_one_way(package: str, forbidden: str):
    offenders = [
        f"{path.relative_to(PACKAGE)} imports {module}"
        for path in sorted((PACKAGE / package).rglob("*.py"))
        for module in _imported_modules(path)
        if module == forbidden or module.startswith(forbidden + ".")
    ]
    assert not offenders, offenders


def test_importing_the_passes_loads_no_scheduler_and_changes_no_torch_setting():
    script = (
        "import sys, torch\n"
        "before = dict(torch._dynamo.config.get_config_copy())\n"
        "import dcp_compile.compiler.passes, dcp_compile\n"
        "loaded = sorted(m for m in sys.modules if m.startswith('dcp_compile.schedule'))\n"
        "assert not loaded, loaded\n"
        "after = dict(torch._dynamo.config.get_config_copy())\n"
        "changed = sorted(k for k in before if before[k] != after[k])\n"
        "assert not changed, changed\n"
        "import torch.distributed as dist\n"
        "assert not dist.is_initialized()\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr


def test_no_package_dir_renaming():
    pyproject = (PACKAGE.parent / "pyproject.toml").read_text()
    assert "package-dir" not in pyproject


TEST_FIXTURES = ("real_models", "tiny_models", "padded_batches", "sharding_checks")


def test_test_models_and_fixtures_are_not_shipped():
    """The real-model zoo (tiny random configs of transformers and diffusers models), the tiny Llama
    the integration tests train, their collate and the sharding assertion are test fixtures: in
    tests/, beside the tests and benchmarks that import them; no shipped module imports them.
    ``dcp_compile.testing`` keeps the process world, which the shipped demo runs its ranks in."""
    for fixture in TEST_FIXTURES:
        assert not (PACKAGE / "testing" / f"{fixture}.py").exists(), fixture
        assert (PACKAGE.parent / "tests" / f"{fixture}.py").exists(), fixture
    offenders = [str(path.relative_to(PACKAGE)) for path in sorted(PACKAGE.rglob("*.py"))
                 if any(module.split(".")[-1] in TEST_FIXTURES for module in _imported_modules(path))]
    assert not offenders, offenders
    assert sorted(path.name for path in (PACKAGE / "testing").glob("*.py")) == ["__init__.py", "process_world.py"]
