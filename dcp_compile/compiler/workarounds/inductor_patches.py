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

A second fix (below) gives a negative power an unknown value range instead of an error. Both are on
by default where torch is at most :data:`LAST_AFFECTED` and the functions they wrap exist.

A third fix is dcp's own, not a torch bug's (below, :func:`symbolic_forward_output_strides`): the
strides of the activations the compiled backward receives are handed to it symbolically, not as
their values at the length the variant was compiled at. Without it a model with a convolution over
its tokens (a grid model, on CPU) compiled forward and backward and matched eager at its first
length, and its backward then asserted that length's stride at the next one (``expected size 2==2,
stride 320==336``), also with a single size symbol and with the two fixes above off. It is on
wherever torch has what it reads, and keys the compile's cache entries by a tag
(:func:`caches_keyed_by_the_fix`) so that an entry written without it is not reused.

``DCP_INDUCTOR_PATCHES=0`` turns all three off (Inductor as shipped: a model that meets the sort bug
then runs that variant under ``aot_eager``, exact, and ``dcp.explain`` says so).

Covers: Inductor on torch <= 2.13 (written against 2.13.0) sorting symbolic strides without the
shape environment (pytorch/pytorch#172204, fix proposed in pytorch/pytorch#185871), and its value
range analysis raising on a negative power (no upstream issue filed); the third fix is dcp's own.
Test: tests/test_inductor_patches.py (a conv model compiles with Inductor at two lengths, no
fallback; with ``DCP_INDUCTOR_PATCHES=0`` it falls back to ``aot_eager``: tests/test_grid_windows.py).
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
    """What one patched compile did: stride sorts that needed the shape environment, negative powers
    whose value range was left unknown."""

    rescued: int = 0
    unknown_ranges: int = 0
    symbolic_strides: int = 0  # forward outputs whose strides the backward reads symbolically (over the process only)


_total = StrideSortPatch()  # over the process, for reports and tests


def rescued_stride_sorts() -> int:
    """Stride sorts the patch has redone with the shape environment in this process."""
    return _total.rescued


def unknown_value_ranges() -> int:
    """Negative powers whose value range the patch left unknown in this process."""
    return _total.unknown_ranges


def symbolic_saved_strides() -> int:
    """Forward outputs whose strides the backward was handed symbolically in this process."""
    return _total.symbolic_strides


def switched_off() -> bool:
    """``DCP_INDUCTOR_PATCHES=0``: Inductor as shipped (the fixes are on unless switched off)."""
    return os.environ.get(ENV_SWITCH, "1") == "0"


def _torch_release() -> tuple[int, int]:
    major, minor = torch.__version__.split("+")[0].split(".")[:2]
    return int(major), int("".join(ch for ch in minor if ch.isdigit()) or 0)


def stride_sort_patch_applies() -> bool:
    """The patch is not switched off (``DCP_INDUCTOR_PATCHES=0``), is needed (torch <= 2.13) and can
    be applied (the functions it wraps exist)."""
    if switched_off() or _torch_release() > LAST_AFFECTED:
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
def _stride_sort_patch(patch: StrideSortPatch) -> Iterator[None]:
    if not stride_sort_patch_applies():
        yield
        return
    from torch._inductor import ir

    original = ir.get_fill_order
    if hasattr(original, "__dcp_patch__"):
        yield
        return
    ir.get_fill_order = fill_order_with_shape_env(original, patch)
    try:
        yield
    finally:
        ir.get_fill_order = original


# --- value ranges of a negative power ------------------------------------------------------------
# Sharded windows (a conv over the token grid, each rank's chunk bounds ``Max(0, (5*s + 1)//10 - 1)``)
# give Inductor size expressions with a true division, which SymPy writes as a power -1; the value
# range analysis then calls ``pow_by_natural`` with a negative exponent and ``safe_pow`` raises
# ``ValueError: Exponent must be non-negative`` out of ``evaluate_expr`` (torch 2.13: seen on rank 1
# of Sana at SP 2, in the backward). An unknown range is always sound: the analysis only loses a
# bound it could not compute.
NEGATIVE_EXPONENT = "Exponent must be non-negative"


def value_range_patch_applies() -> bool:
    if switched_off() or _torch_release() > LAST_AFFECTED:
        return False
    try:
        from torch.utils._sympy.value_ranges import SymPyValueRangeAnalysis, ValueRanges
    except ImportError:
        return False
    return isinstance(SymPyValueRangeAnalysis.__dict__.get("pow_by_natural"), classmethod) and hasattr(ValueRanges, "unknown_int")


@contextlib.contextmanager
def _value_range_patch(patch: StrideSortPatch) -> Iterator[None]:
    if not value_range_patch_applies():
        yield
        return
    from torch.utils._sympy.value_ranges import SymPyValueRangeAnalysis, ValueRanges

    original = SymPyValueRangeAnalysis.__dict__["pow_by_natural"]
    if hasattr(original.__func__, "__dcp_patch__"):
        yield
        return

    def pow_by_natural(cls: Any, a: Any, b: Any) -> Any:
        try:
            return original.__func__(cls, a, b)
        except ValueError as error:
            if NEGATIVE_EXPONENT not in str(error):
                raise
            patch.unknown_ranges += 1
            _total.unknown_ranges += 1
            return ValueRanges.unknown_int()

    pow_by_natural.__dcp_patch__ = original  # type: ignore[attr-defined]
    SymPyValueRangeAnalysis.pow_by_natural = classmethod(pow_by_natural)
    try:
        yield
    finally:
        SymPyValueRangeAnalysis.pow_by_natural = original


@contextlib.contextmanager
def stride_sort_with_shape_env() -> Iterator[StrideSortPatch]:
    """dcp's scoped Inductor fixes for one compile (the name is the first of them): symbolic stride
    sorts use the shape environment, and a negative power's value range is unknown instead of an
    error (see above); restored on exit. Each is a no-op where it does not apply or is already on
    (a nested compile); the record counts what each did."""
    patch = StrideSortPatch()
    with _stride_sort_patch(patch), _value_range_patch(patch):
        yield patch
    if patch.rescued or patch.unknown_ranges:
        log.info("dcp: Inductor compile needed dcp's scoped fixes: %d symbolic stride sorts used the shape "
                 "environment (pytorch/pytorch#172204), %d negative powers got an unknown value range",
                 patch.rescued, patch.unknown_ranges)


scoped_inductor_fixes = stride_sort_with_shape_env


# --- symbolic strides for the activations the backward receives -----------------------------------
# Inductor may give a forward output a layout other than the one its fake tensor has (on CPU, with
# oneDNN, layout optimisation is on for any graph with a convolution, even a dynamic one, and turns
# every 4-d tensor that feeds a convolution channels-last: a grid model's attention output
# ``[B, heads, S, head_dim]`` saved for the backward). AOTAutograd then restrides the backward's
# placeholder to the strides Inductor reports, which ``set_tracing_context_output_strides``
# evaluates at this compile's sizes (``TracingContext.output_strides``: "real_stride can't be
# symbolic"), so the compiled backward asserts this length's strides (``stride 320==336``) at every
# other length. Under dynamo that is a guard and a recompile; a dcp variant is compiled once, with its
# guards suppressed, for every length, so the backward fails at the next length instead. Read back as
# the symbolic expressions Inductor printed (what dynamo's DDP optimizer gets with
# ``fakify_first_call``), the same strides hold at every length. Not tied to LAST_AFFECTED: the
# concrete restride is torch's design, not a bug a release fixes; it needs the names it reads.


def symbolic_output_strides_apply() -> bool:
    """The fix is not switched off and torch has what it reads."""
    if switched_off():
        return False
    from torch._guards import TracingContext
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    return callable(getattr(ShapeEnv, "deserialize_symexpr", None)) and hasattr(TracingContext, "report_output_strides")


def symbolic_forward_output_strides(compiled: Any, example_inputs: Sequence[Any]) -> int:
    """After Inductor compiled a forward graph: the strides it reports for the graph's outputs (the
    backward's saved activations among them) become symbolic in ``TracingContext.output_strides``,
    where AOTAutograd reads them to restride the backward's inputs. Returns how many outputs had
    a symbolic stride; 0 where there is nothing to do (no tracing context, static strides, the fix off)."""
    from torch._guards import TracingContext

    printed = getattr(compiled, "output_strides", None)
    context = TracingContext.try_get()
    reported = getattr(context, "output_strides", None)
    if not printed or reported is None or len(reported) != len(printed) or not symbolic_output_strides_apply():
        return 0
    from torch._inductor.utils import shape_env_from_inputs

    shape_env = shape_env_from_inputs(example_inputs)
    if shape_env is None:
        return 0
    made = 0
    for index, exprs in enumerate(printed):
        if exprs is None or reported[index] is None:
            continue
        strides = tuple(shape_env.deserialize_symexpr(expr) for expr in exprs)
        if any(isinstance(stride, torch.SymInt) and not stride.node.expr.is_number for stride in strides):
            reported[index] = strides
            made += 1
    _total.symbolic_strides += made
    return made


CACHE_TAG = "dcp-symbolic-saved-strides-2"  # 2: regions apply the fix too


@contextlib.contextmanager
def caches_keyed_by_the_fix() -> Iterator[None]:
    """Key the compile's AOTAutograd and Inductor cache entries with a tag naming the fix
    (``torch.compiler.config.cache_key_tag``), so an entry written without it, whose backward
    asserts one length's strides, is never served to a compile that relies on it."""
    config = torch.compiler.config
    if not symbolic_output_strides_apply() or not hasattr(config, "cache_key_tag"):
        yield
        return
    tag = config.cache_key_tag
    if CACHE_TAG in tag:
        yield
        return
    with config.patch(cache_key_tag=f"{tag}+{CACHE_TAG}" if tag else CACHE_TAG):
        yield
