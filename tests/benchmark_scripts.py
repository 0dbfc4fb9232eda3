"""A benchmark script loaded as a module by the tests that check it (``benchmarks/`` is no package)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def load_benchmark(script: str) -> ModuleType:
    """``benchmarks/<script>.py`` executed as the module ``<script>_benchmark``, registered in
    ``sys.modules`` first (its dataclasses look their module up there)."""
    spec = importlib.util.spec_from_file_location(f"{script}_benchmark", BENCHMARKS / f"{script}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module
