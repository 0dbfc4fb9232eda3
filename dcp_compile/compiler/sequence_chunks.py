"""How a sequence of length L is cut into the contiguous chunks that the ranks of an SP group hold.

Rank r of a P-rank group holds ``(L + P - 1 - r) // P`` tokens (the last rank: the rest) starting
at the sum of the chunks before it: the first ``L % P`` ranks hold one token more, and ranks past the end of a short
sequence hold none. The formulas are plain integer arithmetic so that they work unchanged on
SymInts: the compiled graph computes every chunk boundary from the symbolic length instead of
branching on it, which is what keeps one trace valid for every length.
"""

from __future__ import annotations

from typing import TypeVar

IntLike = TypeVar("IntLike")


def chunk_length(length: IntLike, sp_size: int, rank: int) -> IntLike:
    """Tokens held by ``rank`` (0 <= rank < sp_size) of a sequence of ``length`` tokens: the size of
    the rank's own chunk.

    One division for every rank, the last included (``length // P``), so that value ranges prove
    it non-negative: Inductor lowers a slice of ``[own chunk | u selected tokens]`` (Mochi's
    joint attention over ``nonzero``-selected text) only when it can show ``chunk + u >= 0``,
    which ``length - (length + 1) // 2 + u`` does not let it."""
    return (length + (sp_size - 1 - rank)) // sp_size


def chunk_lengths(length: IntLike, sp_size: int) -> list[IntLike]:
    """Every rank's chunk, as the split sizes of a collective over the whole sequence.

    The last is written as what the others leave, ``length - start``: equal in value to
    :func:`chunk_length`, but the list then adds up to ``length`` symbolically too. A gathered or
    all-to-all'd sequence (whose size is the sum of the split sizes) is then ``length`` long, not
    ``s//2 + (s+1)//2``, which Inductor cannot order against other strides when ``s`` is a
    product of symbols (an image's ``H*W``)."""
    before = [chunk_length(length, sp_size, rank) for rank in range(sp_size - 1)]
    return before + [length - chunk_start(length, sp_size, sp_size - 1)]


def chunk_start(length: IntLike, sp_size: int, rank: int) -> IntLike:
    """Offset of ``rank``'s chunk: the sum of the chunks of the ranks before it."""
    start = 0
    for before in range(rank):
        start = start + chunk_length(length, sp_size, before)
    return start


def max_chunk_length(length: IntLike, sp_size: int) -> IntLike:
    return chunk_length(length, sp_size, 0)
