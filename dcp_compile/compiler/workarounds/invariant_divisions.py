"""Inductor's CPU tiling analysis, cheaper on an SP>1 variant's index expressions.

On an SP>1 variant every sharded size is the chunk length ``(s+1)//P``, and Inductor's C++ backend
writes it into every index expression as ``FloorDiv(1 + s, P)``. Choosing a loop's tiling, it asks
for each index's stride along a vectorized loop variable (``stride_at_vec_range``), which first
runs ``simplify_index_in_vec_range``: a ``sympy.simplify`` of the whole index, slow on those
divisions. A division that does not involve the loop variable is a constant along that loop:
:func:`invariant_divisions_opaque` hands it to the simplification as a plain integer symbol and
puts it back afterwards, so the result is the same expression (the stride along the loop variable
cannot depend on how a constant is spelled).

Measured on the zoo Llama (``benchmarks/compile_time.py``'s model, one process each way, load about
22): the simplification took 6.1 -> 3.5 CPU s of the SP-2 variant's compile and 5.8 -> 3.3 s of
SP 2 with full recompute (the variants' whole compiles 53.0 -> 50.8 and 35.9 -> 33.5 CPU s), and
all 60 C++ kernels the two variants compiled were byte for byte the same with and without it.

Scoped to dcp's Inductor compiles, and off with ``DCP_INDUCTOR_PATCHES=0`` like dcp's other
Inductor patches.

Covers: Inductor's C++ tiling analysis on torch 2.13.0 running ``sympy.simplify`` over whole index
expressions (``simplify_index_in_vec_range``), slow on ``FloorDiv``; compile time only, results are
the same without it (no upstream issue filed).
Test: tests/test_invariant_divisions.py (strides equal to Inductor's own, the patch scoped).
"""

from __future__ import annotations

import contextlib
import functools
from typing import Callable, Iterator

import sympy

from dcp_compile.compiler.workarounds.inductor_patches import switched_off


def _division_kinds() -> tuple[type, ...]:
    from torch.utils._sympy import functions

    return tuple(getattr(functions, name) for name in ("FloorDiv", "ModularIndexing", "CeilDiv", "CleanDiv")
                 if hasattr(functions, name))


def with_invariant_divisions_opaque(simplify: Callable[[sympy.Expr, sympy.Expr, int], sympy.Expr]
                                    ) -> Callable[[sympy.Expr, sympy.Expr, int], sympy.Expr]:
    """``simplify(index, var, vec_length)`` with the divisions free of ``var`` as symbols meanwhile."""
    kinds = _division_kinds()

    @functools.lru_cache
    def simplified(index: sympy.Expr, var: sympy.Expr, vec_length: int) -> sympy.Expr:
        symbols: dict[sympy.Expr, sympy.Symbol] = {}

        def opaque(division: sympy.Expr) -> sympy.Symbol:
            return symbols.setdefault(division, sympy.Symbol(f"dcp_invariant_division{len(symbols)}", integer=True))

        if index.has(*kinds):
            index = index.replace(lambda e: isinstance(e, kinds) and not e.has(var), opaque)
        result = simplify(index, var, vec_length)
        # Newest first: a division of divisions was made opaque after the divisions inside it, so
        # putting it back brings their symbols, which the older entries then put back.
        for division, symbol in reversed(symbols.items()):
            result = result.xreplace({symbol: division})
        return result

    return simplified


@contextlib.contextmanager
def invariant_divisions_opaque() -> Iterator[None]:
    """For one Inductor compile: loop-invariant divisions opaque in its vector-range simplification."""
    from torch._inductor import sizevars

    original = getattr(sizevars, "simplify_index_in_vec_range", None)
    if original is None or switched_off():
        yield
        return
    sizevars.simplify_index_in_vec_range = with_invariant_divisions_opaque(original)
    try:
        yield
    finally:
        sizevars.simplify_index_in_vec_range = original
