"""``map_through_view`` and the size tests, on sympy shapes alone."""

from __future__ import annotations

import sympy

from dcp_compile.compiler.passes.sequence_dims import SequenceDim, map_through_view
from dcp_compile.compiler.passes.sequence_dims.symbolic import (
    SPLITS_SEQUENCE, UNMATCHED_RESHAPE, divides, equal,
)

B, S, H, W, D = sympy.symbols("B S H W D", positive=True, integer=True)


def test_splitting_the_features_keeps_the_sequence_where_it_is():
    assert map_through_view([B, S, D], [B, S, 4, D / 4], SequenceDim(1), S) == SequenceDim(1)


def test_flattening_the_batch_with_the_tokens_records_the_batch_as_outer():
    mapped = map_through_view([B, S, D], [B * S, D], SequenceDim(1), S)
    assert mapped == SequenceDim(0, outer=B, inner=sympy.Integer(1))


def test_flattening_the_tokens_with_the_features_records_them_as_inner():
    mapped = map_through_view([B, S, D], [B, S * D], SequenceDim(1), S)
    assert mapped == SequenceDim(1, outer=sympy.Integer(1), inner=D)


def test_splitting_the_tokens_into_a_grid_is_refused_with_its_reason():
    assert map_through_view([B, H * W, D], [B, H, W, D], SequenceDim(1), H * W) == SPLITS_SEQUENCE


def test_a_reshape_that_cannot_be_matched_says_so():
    assert map_through_view([B, S, D], [B, 2, S * D / 2 + 1], SequenceDim(1), S) == UNMATCHED_RESHAPE


def test_sizes_compare_as_polynomials():
    assert equal((H + 1) * W, H * W + W)
    assert divides(S, B * S) and not divides(S, B)
