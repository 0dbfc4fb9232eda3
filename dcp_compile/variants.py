"""Variants (an SP size and a recompute policy), length buckets, and the ``dcp.use`` context."""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import threading
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

RECOMPUTE_POLICIES = ("none", "attention", "selective", "full")


@dataclass(frozen=True)
class Variant:
    """What one compiled graph is specialized for."""

    sp_size: int = 1
    recompute: str = "none"
    memory_budget: float | None = None  # for recompute="selective": fraction of activation memory kept
    packed: bool = False  # several sequences concatenated in one row: attention runs varlen over them

    def __post_init__(self) -> None:
        if self.recompute not in RECOMPUTE_POLICIES:
            raise ValueError(
                f"dcp: unknown recompute policy {self.recompute!r}; use one of {', '.join(RECOMPUTE_POLICIES)}"
            )
        if self.recompute == "selective":
            budget = 0.5 if self.memory_budget is None else self.memory_budget
            if not 0.0 <= budget <= 1.0:
                raise ValueError(f"dcp: memory_budget must be in [0, 1], got {budget}")
            object.__setattr__(self, "memory_budget", float(budget))
        elif self.memory_budget is not None:
            object.__setattr__(self, "memory_budget", None)

    def __str__(self) -> str:
        extra = f"({self.memory_budget:g})" if self.recompute == "selective" else ""
        return f"sp={self.sp_size}/recompute={self.recompute}{extra}{'/packed' if self.packed else ''}"

    @classmethod
    def of(cls, plan: Any) -> "Variant":
        """A Variant from anything with ``sp_size`` and ``recompute`` attributes."""
        if isinstance(plan, Variant):
            return plan
        try:
            sp_size, recompute = plan.sp_size, plan.recompute
        except AttributeError:
            raise TypeError(
                f"dcp.use() needs an object with sp_size and recompute attributes (a MicroBatch "
                f"or dcp.Variant(sp_size=..., recompute=...)), got {type(plan).__name__}"
            ) from None
        return cls(int(sp_size), recompute or "none", getattr(plan, "memory_budget", None), bool(getattr(plan, "packed", False)))


@dataclass(frozen=True)
class Bucket:
    """Sequences with length <= max_len (None: no bound) run ``variant``."""

    max_len: int | None
    variant: Variant


class BucketTable:
    """Length → variant, for code that runs outside ``dcp.use``. Boundaries are inclusive."""

    def __init__(self, buckets: list[Bucket]):
        self.buckets = sorted(buckets, key=lambda b: float("inf") if b.max_len is None else b.max_len)
        self._bounds = [b.max_len for b in self.buckets]

    def __bool__(self) -> bool:
        return bool(self.buckets)

    def select(self, length: int) -> Bucket:
        for bucket in self.buckets:
            if bucket.max_len is None or length <= bucket.max_len:
                return bucket
        largest = self.buckets[-1].max_len
        raise ValueError(
            f"dcp: sequence length {length} is longer than every bucket (the largest has "
            f"max_len={largest}); add a bucket with a larger max_len, or one with max_len=None "
            "to catch every longer sequence"
        )


_active = threading.local()


def _stack() -> list[tuple[Variant, "torch.Tensor | None"]]:
    stack = getattr(_active, "stack", None)
    if stack is None:
        stack = _active.stack = []
    return stack


def active_variant() -> Variant | None:
    stack = getattr(_active, "stack", None)
    return stack[-1][0] if stack else None


def active_sequence_boundaries() -> "torch.Tensor | None":
    """``cu_seqlens`` of the packed micro-batch ``dcp.use`` was given, or None."""
    stack = getattr(_active, "stack", None)
    return stack[-1][1] if stack else None


def sequence_boundaries(sequence_lengths: Sequence[int]) -> "torch.Tensor":
    """Cumulative lengths ``[0, l0, l0 + l1, ...]`` as a CPU int32 tensor (flash-attn's cu_seqlens)."""
    import torch

    lengths = [int(length) for length in sequence_lengths]
    if not lengths or any(length < 1 for length in lengths):
        raise ValueError(f"dcp.use: sequence_lengths must be positive lengths, one per packed sequence; got {lengths}")
    return torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32)


@contextlib.contextmanager
def use(plan: Any, sequence_lengths: Sequence[int] | None = None) -> Iterator[Variant]:
    """Run the compiled model with the variant of ``plan`` (a MicroBatch or a ``Variant``).

    ``sequence_lengths``: the batch is packed (batch 1, these sequences one after the other along
    the sequence dimension, see ``dcp.pack_sequences``); attention keeps them apart with the varlen
    kernel instead of padding. Taken from ``plan.sequence_lengths`` when ``plan.packed`` is true.
    """
    if sequence_lengths is None and getattr(plan, "packed", False):
        sequence_lengths = getattr(plan, "sequence_lengths", None)
        if sequence_lengths is None:
            raise TypeError(f"dcp.use: {type(plan).__name__} says packed=True but has no sequence_lengths")
    variant = Variant.of(plan)
    boundaries = None
    if sequence_lengths is not None:
        boundaries = sequence_boundaries(sequence_lengths)
        variant = dataclasses.replace(variant, packed=True)
    stack = _stack()
    stack.append((variant, boundaries))
    try:
        yield variant
    finally:
        stack.pop()
