"""The vocabulary the compiler and the scheduler share: recompute policies and variants.

The scheduler prices a ``Variant`` by name and the compiler builds it; both read the names from
here, so the planner can never choose a policy the compiler does not build, and neither package
imports the other.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class RecomputePolicy(str, enum.Enum):
    """What a variant's backward recomputes instead of keeping from the forward.

    * ``none``: keep every activation the backward needs;
    * ``attention``: recompute each attention and what makes its queries, keys and values back to
      (and including) their projections (the projections' inputs stay saved);
    * ``selective``: ``attention``, plus every op that is not a matrix product (norms, activation
      functions, elementwise ops, views): only matmul outputs are kept, not the block inputs (a
      residual stream is recomputed from the matmul outputs that sum to it);
    * ``full``: checkpoint per block (each repeated module ``blocks.N`` is one recompute region):
      each block's input is kept and the block recomputed from it in backward. The ops outside
      the blocks form one region of their own: what they hand every block (a RoPE table built
      once) is kept like a block input, and what the head needs (final norm, output head, loss)
      is recomputed, together with the last block, from the last block's input; the last block's
      output is not kept.

    Collective outputs are kept under every policy (re-sending an all-to-all costs more than
    storing its result). The values are strings, so ``policy == "full"`` and JSON work as before.
    """

    NONE = "none"
    ATTENTION = "attention"
    SELECTIVE = "selective"
    FULL = "full"

    def __str__(self) -> str:
        return self.value

    def __hash__(self) -> int:  # equal to its name as a string, so hash like it (dict keys)
        return hash(self.value)

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)

    @classmethod
    def parse(cls, value: "RecomputePolicy | str | None") -> "RecomputePolicy":
        """A policy from its name (``None`` means ``none``), with an error that lists the names."""
        if value is None:
            return cls.NONE
        try:
            return cls(value)
        except ValueError:
            names = ", ".join(policy.value for policy in cls)
            raise ValueError(f"dcp: unknown recompute policy {value!r}; use one of {names}") from None


RECOMPUTE_POLICIES: tuple[RecomputePolicy, ...] = tuple(RecomputePolicy)


@dataclass(frozen=True)
class Variant:
    """What one compiled graph is specialized for: an SP size, a recompute policy, packing."""

    sp_size: int = 1
    recompute: RecomputePolicy = RecomputePolicy.NONE
    packed: bool = False  # several sequences concatenated in one row: attention runs varlen over them
    # Packed only, set by the dispatcher from the measured kernel table per call (never by a plan):
    # None runs the dcp:: varlen op, "flex" FlexAttention with a document mask.
    attention: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "recompute", RecomputePolicy.parse(self.recompute))
        if not isinstance(self.sp_size, int) or self.sp_size < 1:
            raise ValueError(f"dcp: sp_size must be a positive int, got {self.sp_size!r}")
        if not isinstance(self.packed, bool):
            raise TypeError(f"dcp: Variant.packed must be a bool, got {self.packed!r} (memory_budget is gone: "
                            "recompute='selective' now keeps exactly the matmul outputs)")
        if self.attention is not None and not (self.packed and isinstance(self.attention, str)):
            raise ValueError(f"dcp: Variant.attention ({self.attention!r}) names a packed micro-batch's attention "
                             "implementation: the dispatcher sets it; leave it None")

    def __str__(self) -> str:
        attention = f"/{self.attention}" if self.attention else ""
        return f"sp={self.sp_size}/recompute={self.recompute.value}{'/packed' if self.packed else ''}{attention}"
