"""Load the Triton kernel modules lazily, compiled for a GPU or interpreted for CPU tensors.

Why a loader instead of a plain ``import``:

* triton is optional, so ``dcp_compile.kernels`` must import without it; the modules holding
  ``@triton.jit`` functions are only loaded the first time a Triton kernel is actually needed.
* ``triton.jit`` decides *when the decorator runs* (i.e. at module import) whether it builds a
  compiled ``JITFunction`` or an interpreter ``InterpretedFunction``, based on
  ``TRITON_INTERPRET``. A process that has imported the kernels compiled could then never run them
  on CPU tensors, and a test that sets ``TRITON_INTERPRET`` after the first import would silently
  get compiled kernels. So each kernel module is loaded once per mode, under its own module name,
  with the mode pinned while its decorators run. CPU tensors always get the interpreted copy
  (compiled Triton cannot run on CPU); CUDA tensors get the compiled copy unless
  ``TRITON_INTERPRET`` is set at call time (useful to debug a kernel on a GPU box).
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import os
import sys
import threading
from pathlib import Path
from types import ModuleType
from typing import Iterator

import torch

log = logging.getLogger(__name__)

_lock = threading.Lock()
_loaded: dict[tuple[str, bool], ModuleType] = {}


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "on", "yes")


def interpret_requested() -> bool:
    """Whether the user asked for the Triton interpreter (``TRITON_INTERPRET``), read now."""
    import triton

    knobs = getattr(triton, "knobs", None)
    if knobs is not None:
        return bool(knobs.runtime.interpret)
    return _env_flag("TRITON_INTERPRET")


def use_interpreter(device: torch.device) -> bool:
    """CPU (or any non-CUDA) tensors can only run interpreted; CUDA follows TRITON_INTERPRET."""
    return device.type != "cuda" or interpret_requested()


@contextlib.contextmanager
def _pinned_interpret_mode(interpret: bool) -> Iterator[None]:
    """Make ``triton.jit`` build interpreted (or compiled) functions while a module executes."""
    import triton

    knobs = getattr(triton, "knobs", None)
    if knobs is not None:  # triton >= 3.4: knobs.runtime is what jit consults
        with knobs.runtime.scope():
            knobs.runtime.interpret = interpret
            yield
        return
    previous = os.environ.get("TRITON_INTERPRET")  # older triton reads the variable directly
    os.environ["TRITON_INTERPRET"] = "1" if interpret else "0"
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = previous


def triton_module(name: str, device: torch.device) -> ModuleType:
    """The kernel module ``kernels/<name>.py`` built for running on ``device``."""
    interpret = use_interpreter(device)
    key = (name, interpret)
    module = _loaded.get(key)
    if module is not None:
        return module
    with _lock:
        module = _loaded.get(key)
        if module is not None:
            return module
        path = Path(__file__).with_name(f"{name}.py")
        mode = "interpreted" if interpret else "compiled"
        module_name = f"{__package__ or 'dcp_compile.kernels'}.{name}__{mode}"
        spec = importlib.util.spec_from_file_location(module_name, path)
        if spec is None or spec.loader is None:
            raise ImportError(f"cannot load Triton kernel module {path}")
        module = importlib.util.module_from_spec(spec)
        sys.modules[module_name] = module
        try:
            with _pinned_interpret_mode(interpret):
                spec.loader.exec_module(module)
        except BaseException:
            sys.modules.pop(module_name, None)
            raise
        log.debug("loaded Triton kernels %s (%s)", name, mode)
        _loaded[key] = module
        return module
