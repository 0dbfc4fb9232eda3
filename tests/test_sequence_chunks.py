"""The two symbolic properties of ``sequence_chunks`` that Inductor needs, which pull against each
other: a rank's own chunk must be provably non-negative from value ranges alone (Mochi's last-rank
backward slices at ``chunk + u`` with an unbacked ``u``), and the split sizes of a collective over
the whole sequence must add up to the length symbolically (a gathered image sequence ``s//2 +
(s+1)//2`` long is one whose strides Inductor cannot order, pytorch/pytorch#172204)."""

from __future__ import annotations

import pytest
import torch
from torch.fx.experimental.symbolic_shapes import ShapeEnv
from torch.utils._sympy.value_ranges import bound_sympy

from dcp_compile.compiler.sequence_chunks import chunk_length, chunk_lengths, chunk_start


@pytest.mark.parametrize("sp_size", range(1, 9))
def test_chunks_cover_the_sequence_in_order(sp_size: int) -> None:
    for length in range(0, 41):
        lengths = chunk_lengths(length, sp_size)
        assert sum(lengths) == length and min(lengths) >= 0
        assert max(lengths) - min(lengths) <= 1 and lengths == sorted(lengths, reverse=True)
        for rank in range(sp_size):
            assert chunk_length(length, sp_size, rank) == lengths[rank]
            assert chunk_start(length, sp_size, rank) == sum(lengths[:rank])


def _symbolic_length() -> tuple[ShapeEnv, torch.SymInt]:
    shape_env = ShapeEnv()
    length = shape_env.create_unbacked_symint()
    torch._check(length >= 0)
    return shape_env, length


@pytest.mark.parametrize("sp_size", [2, 3, 4, 8])
def test_every_own_chunk_is_non_negative_by_value_ranges(sp_size: int) -> None:
    shape_env, length = _symbolic_length()
    for rank in range(sp_size):
        own = chunk_length(length, sp_size, rank).node.expr
        assert bound_sympy(own, shape_env.var_to_range).lower >= 0, (rank, own)
    # The form the last rank had before: equal in value, unbounded below by value ranges.
    before = (length - chunk_start(length, sp_size, sp_size - 1)).node.expr
    assert bound_sympy(before, shape_env.var_to_range).lower < 0


@pytest.mark.parametrize("sp_size", [1, 2, 3, 4, 8])
def test_split_sizes_add_up_to_the_length_symbolically(sp_size: int) -> None:
    _, length = _symbolic_length()
    total = sum(chunk_lengths(length, sp_size), 0)
    assert total.node.expr == length.node.expr, total.node.expr
