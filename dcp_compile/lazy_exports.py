"""A package attribute that loads from its defining module on first access.

The namespaces (``dcp_compile``, ``.schedule``, ``.runtime``, ``.report``, ``.errors``) name what
they export without importing it, so ``import dcp_compile`` stays light and no package imports
one it must not (tests/test_import_graph.py). This module imports nothing of the package.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping
from typing import Any


def lazy_getattr(module_name: str, exports: Mapping[str, str]) -> Callable[[str], Any]:
    """A module ``__getattr__`` for ``module_name``: a name of ``exports`` (name -> the module
    that defines it) is imported on first access and kept in the module's globals."""

    def __getattr__(name: str) -> Any:
        if name in exports:
            value = getattr(importlib.import_module(exports[name]), name)
            setattr(sys.modules[module_name], name, value)
            return value
        raise AttributeError(f"module {module_name!r} has no attribute {name!r}")

    return __getattr__
