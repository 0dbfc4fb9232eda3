"""Loop-invariant divisions, opaque in Inductor's vector-range index simplification, give the same
strides as Inductor's own simplification (dcp_compile/compiler/workarounds/invariant_divisions.py)."""

from __future__ import annotations

import sympy
from torch._inductor import sizevars
from torch.utils._sympy.functions import FloorDiv, ModularIndexing

from dcp_compile.compiler.workarounds.invariant_divisions import invariant_divisions_opaque, with_invariant_divisions_opaque

ks0, ks1 = sympy.symbols("ks0 ks1", integer=True, positive=True)
x0, x1, x2, x3 = sympy.symbols("x0 x1 x2 x3", integer=True, nonnegative=True)
CHUNK = FloorDiv(1 + ks1, 2)  # an SP-2 variant's chunk length, as Inductor writes it
INDICES = [
    x3 + 8 * x2 + 8 * x1 * CHUNK + 32 * x0 * CHUNK,
    4 + x3 + 8 * x1 + 32 * x2 + 32 * x0 * CHUNK,
    FloorDiv(x2, 16) * CHUNK + ModularIndexing(x2, 1, 32) + FloorDiv(1 + ks0, 2) * x1,  # divisions of the loop variable too
    # A division of divisions: the last rank's ``(H // 2) * (W // 2)`` grid halved again (diffusers' DiT at SP 2)
    x3 + x2 * sympy.Max(1, FloorDiv(FloorDiv(ks1, 2) * FloorDiv(ks1, 2), 2)),
]


def test_strides_along_each_loop_variable_are_inductors_own():
    original = sizevars.simplify_index_in_vec_range
    patched = with_invariant_divisions_opaque(original)
    for index in INDICES:
        for var in (x2, x3):
            ours = sizevars.stride_at(patched(index, var, 16), var)
            theirs = sizevars.stride_at(original(index, var, 16), var)
            assert sympy.simplify(ours - theirs) == 0, (index, var, ours, theirs)
            assert not any(symbol.name.startswith("dcp_invariant_division") for symbol in ours.free_symbols), ours


def test_the_patch_is_scoped_and_switched_off_with_dcp_inductor_patches(monkeypatch):
    original = sizevars.simplify_index_in_vec_range
    with invariant_divisions_opaque():
        assert sizevars.simplify_index_in_vec_range is not original
    assert sizevars.simplify_index_in_vec_range is original
    monkeypatch.setenv("DCP_INDUCTOR_PATCHES", "0")
    with invariant_divisions_opaque():
        assert sizevars.simplify_index_in_vec_range is original
