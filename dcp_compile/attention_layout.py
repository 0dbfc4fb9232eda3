"""How an SP group splits one attention: over heads (Ulysses), over key blocks (ring), or both.

Shared by the compiler (which builds the layout) and the scheduler (which prices it), so the two
never disagree about what an attention at SP ``P`` with ``H`` query heads costs.

Ulysses gives each rank ``H/P`` whole heads; when ``P`` does not divide ``H`` the heads would be
padded to ``P * ceil(H/P)`` slots and ranks would compute attention for repeated heads (2 query
heads at SP 4: every rank computes one head, twice the total work). Instead the group is factored
as ``P = u * r``: an all-to-all over ``u`` ranks splits the heads (``u`` the largest number that
divides ``P``, the query heads and the KV heads), and ``r`` ranks pass K/V blocks around a ring, each
computing its queries against every block with online-softmax merging. Each rank then computes
exactly ``1/P`` of a bidirectional attention (``H/u`` heads x ``S/r`` queries x ``S`` keys).
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass


class AttentionLayoutKind(str, enum.Enum):
    ULYSSES = "ulysses"  # all-to-all over heads only (today's path; heads may be padded)
    HYBRID = "hybrid"  # all-to-all over u ranks, ring over r ranks
    RING = "ring"  # ring over all P ranks (no head split)

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class AttentionLayout:
    """``sp_size = ulysses * ring``: ranks that split heads times ranks that pass K/V around."""

    sp_size: int
    ulysses: int
    ring: int

    @property
    def kind(self) -> AttentionLayoutKind:
        if self.ring == 1:
            return AttentionLayoutKind.ULYSSES
        return AttentionLayoutKind.RING if self.ulysses == 1 else AttentionLayoutKind.HYBRID

    def describe(self) -> str:
        if self.kind is AttentionLayoutKind.ULYSSES:
            return f"Ulysses x{self.ulysses}"
        if self.kind is AttentionLayoutKind.RING:
            return f"ring x{self.ring}"
        return f"ring x{self.ring} over Ulysses x{self.ulysses}"

    def head_slots_per_rank(self, query_heads: int) -> int:
        """Query heads each rank computes attention for (padded slots included)."""
        return math.ceil(query_heads / self.ulysses)

    def padded_head_slots(self, query_heads: int) -> int:
        """Head slots over the whole group that repeat a real head (work thrown away)."""
        return self.head_slots_per_rank(query_heads) * self.ulysses - query_heads

    def attention_work_fraction(self, query_heads: int) -> float:
        """One rank's share of a bidirectional attention's score elements (``1/P`` when nothing
        is padded; ``ceil(H/P)/H`` for padded Ulysses)."""
        return self.head_slots_per_rank(query_heads) / (query_heads * self.ring)

    def ring_elements_per_local_token(self, key_value_width: int) -> float:
        """Elements one rank sends around the ring per token it holds, forward, one attention:
        after the head all-to-all a rank holds ``S/r`` positions of ``1/u`` of the K/V heads
        (``S/P`` tokens' worth of K/V) and passes that block on ``r - 1`` times. Backward sends
        the same volume again (the K/V gradients travel back). ``key_value_width``: K plus V
        elements per token over all KV heads."""
        return (self.ring - 1) * key_value_width

    def collective_steps(self) -> int:
        """Collectives issued per attention, forward only (each pays a latency)."""
        return (4 if self.ulysses > 1 else 0) + (self.ring - 1)


def choose_attention_layout(query_heads: int, key_heads: int, sp_size: int) -> AttentionLayout:
    """Ulysses over every rank when ``sp_size`` divides the query heads (today's path; GQA KV heads
    that do not divide are replicated, which costs traffic, not attention work); otherwise the
    largest head all-to-all that needs no padding, ring over the rest."""
    if sp_size <= 1 or query_heads % sp_size == 0:
        return AttentionLayout(sp_size, sp_size, 1)
    ulysses = math.gcd(sp_size, math.gcd(query_heads, key_heads))
    return AttentionLayout(sp_size, ulysses, sp_size // ulysses)
