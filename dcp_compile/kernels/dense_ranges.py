"""Which token ranges of a packed row the CPU varlen attention computes densely.

One rule, read by two parties: the reference kernel (:mod:`.varlen_attention_reference`), which
runs it, and the cost model, which must count the scores the kernel really computes. A Python loop
over many short sequences costs more in per-op overhead than their attention, so when the row's
``T^2`` scores are within 2x of the sequences' ``sum L^2`` (or the row is short) the kernel makes
one masked pass over the whole row: then it computes ``T^2`` scores, not ``sum L^2``. Under a causal
mask the kernel's query blocks skip the keys past their last query, so it computes between half
those counts and the counts; the profile's per-key term absorbs the factor.
"""

from __future__ import annotations

from typing import Sequence

WHOLE_ROW_TOKENS = 512  # rows this short are always computed in one masked pass


def computes_whole_row(total: int, squares: float, sequences: int) -> bool:
    """Whether a row of ``total`` tokens packing ``sequences`` non-empty sequences whose squared
    lengths sum to ``squares`` is computed in one masked pass. It depends on these three sums
    alone, so a planner that keeps them per micro-batch can count the scores without the bounds."""
    return sequences > 1 and (total <= WHOLE_ROW_TOKENS or total * total <= 2 * squares)


def scores_from_sums(total: int, squares: float, sequences: int) -> float:
    """Scores per head the kernel computes for such a row: ``total^2`` or ``squares``."""
    return float(total * total) if computes_whole_row(total, squares, sequences) else float(squares)


def dense_ranges(bounds: Sequence[tuple[int, int]], total: int) -> tuple[list[tuple[int, int]], bool]:
    """The ranges to compute densely for sequences at ``bounds`` in a row of ``total`` tokens, and
    whether that is the whole row at once."""
    bounds = [(start, end) for start, end in bounds if end > start]
    squares = sum((end - start) ** 2 for start, end in bounds)
    if computes_whole_row(total, squares, len(bounds)):
        return [(0, total)], True
    return list(bounds), False


def dense_scores(lengths: Sequence[int]) -> float:
    """Scores per head the kernel computes for a row packing ``lengths`` (masked ones included)."""
    bounds, start = [], 0
    for length in lengths:
        bounds.append((start, start + int(length)))
        start += int(length)
    ranges, _ = dense_ranges(bounds, start)
    return float(sum((end - begin) ** 2 for begin, end in ranges))
