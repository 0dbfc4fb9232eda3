"""Scoped, version-gated fixes for Inductor bugs that dcp's graphs meet, on only while dcp compiles.

Inductor on torch <= 2.13 sorts symbolic strides with Python's ``sorted`` when a caller does not
hand it the shape environment (``ir.get_stride_order(strides)`` in ``GraphLowering.run_node``,
among others). SymPy cannot decide ``16*s22*s42 < 16`` without the symbols' ranges, so an image or
video model whose token count is a product of size symbols (``H*W``, ``T*H*W``) raises
``TypeError: cannot determine truth value of Relational``, with or without dcp
(pytorch/pytorch#172204; the fix proposed upstream, pytorch/pytorch#185871, recovers the shape
environment at the sort). :func:`stride_sort_with_shape_env` does the same for the duration of one
Inductor compile: a sort that works today runs exactly as before; only a sort that would raise
is redone by Inductor's own symbolic comparator (``argsort_sym``) with the shape environment of
the strides (or of the graph being lowered). The order only picks a layout (Inductor then fixes
the strides it chose), so it cannot change results.

The patch is on when torch is at most :data:`LAST_AFFECTED` and ``torch._inductor.ir.get_fill_order``
and ``torch._inductor.utils.argsort_sym`` exist; ``DCP_INDUCTOR_PATCHES=0`` turns it off (to see
torch as shipped). Where it is off and the bug strikes, ``compile_inductor`` still falls back to
``aot_eager`` for that variant and says so in ``dcp.explain``.
"""

from __future__ import annotations

import contextlib
import logging
import os
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

import torch

log = logging.getLogger(__name__)

LAST_AFFECTED = (2, 13)  # the newest torch release whose Inductor has the bug (pytorch/pytorch#172204)
RELATIONAL_ERROR = "cannot determine truth value of Relational"
ENV_SWITCH = "DCP_INDUCTOR_PATCHES"


@dataclass
class StrideSortPatch:
    """What one patched compile did: how many stride sorts needed the shape environment."""

    rescued: int = 0


_total = StrideSortPatch()  # over the process, for reports and tests


def rescued_stride_sorts() -> int:
    """Stride sorts the patch has redone with the shape environment in this process."""
    return _total.rescued


def _torch_release() -> tuple[int, int]:
    major, minor = torch.__version__.split("+")[0].split(".")[:2]
    return int(major), int("".join(ch for ch in minor if ch.isdigit()) or 0)


def stride_sort_patch_applies() -> bool:
    """The patch is needed and can be applied: torch <= 2.13, the functions it wraps exist, and
    ``DCP_INDUCTOR_PATCHES`` is not ``0``."""
    if os.environ.get(ENV_SWITCH, "1") == "0" or _torch_release() > LAST_AFFECTED:
        return False
    try:
        from torch._inductor import ir, utils
    except ImportError:
        return False
    return callable(getattr(ir, "get_fill_order", None)) and callable(getattr(utils, "argsort_sym", None))


def _shape_env_of(seq: Sequence[Any]) -> Any:
    """The shape environment of the strides' symbols, else of the graph Inductor is lowering."""
    for value in seq:
        if isinstance(value, torch.SymInt):
            return value.node.shape_env
    from torch._inductor.virtualized import V

    try:
        graph = V.graph
    except (AttributeError, AssertionError):
        return None
    sizevars = getattr(graph, "sizevars", None)
    return getattr(sizevars, "shape_env", None)


def _is_relational_error(error: TypeError) -> bool:
    return RELATIONAL_ERROR in str(error)


def fill_order_with_shape_env(original: Callable, patch: StrideSortPatch) -> Callable:
    """``get_fill_order`` that redoes a failing symbolic sort with the shape environment."""
    from torch._inductor.utils import argsort_sym

    def get_fill_order(seq: Sequence[Any], shape_env: Any = None) -> Sequence[int]:
        try:
            return original(seq, shape_env)
        except TypeError as error:
            if shape_env is not None or not _is_relational_error(error):
                raise
            found = _shape_env_of(seq)
            if found is None:
                raise
            patch.rescued += 1
            _total.rescued += 1
            return argsort_sym(found, seq)

    get_fill_order.__dcp_patch__ = original  # type: ignore[attr-defined]
    get_fill_order.__doc__ = original.__doc__
    return get_fill_order


@contextlib.contextmanager
def stride_sort_with_shape_env() -> Iterator[StrideSortPatch]:
    """Within the block, Inductor's symbolic stride sorts use the shape environment (see the module
    docstring); restored on exit. A no-op (still yielding a record) where the patch does not apply
    or is already on (a nested compile)."""
    patch = StrideSortPatch()
    if not stride_sort_patch_applies():
        yield patch
        return
    from torch._inductor import ir

    original = ir.get_fill_order
    if hasattr(original, "__dcp_patch__"):
        yield patch
        return
    ir.get_fill_order = fill_order_with_shape_env(original, patch)
    try:
        yield patch
    finally:
        ir.get_fill_order = original
        if patch.rescued:
            log.info("dcp: %d of Inductor's symbolic stride sorts used the shape environment "
                     "(dcp's scoped patch for pytorch/pytorch#172204)", patch.rescued)
