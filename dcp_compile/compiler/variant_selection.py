"""Which variant a call runs: length buckets, and the ``dcp.use`` context a training loop sets."""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterator, Sequence

from dcp_compile.variant import Variant

if TYPE_CHECKING:  # annotations only: importing the package changes nothing in torch
    import torch

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


def variant_of(plan: Any) -> Variant:
    """The Variant a ``dcp.use`` argument asks for: a Variant, or a MicroBatch's ``variant``."""
    if isinstance(plan, Variant):
        return plan
    variant = getattr(plan, "variant", None)
    if isinstance(variant, Variant):
        return variant
    raise TypeError(
        f"dcp.use() needs a dcp.schedule.MicroBatch (from a StepPlan) or a dcp.Variant(sp_size=..., "
        f"recompute=...), got {type(plan).__name__}"
    )


@contextlib.contextmanager
def use(plan: Any, sequence_lengths: Sequence[int] | None = None) -> Iterator[Variant]:
    """Run the compiled model with the variant of ``plan`` (a MicroBatch or a ``Variant``).

    ``sequence_lengths``: the batch is packed (batch 1, these sequences one after the other along
    the sequence dimension, see ``dcp.pack_sequences``); attention keeps them apart with the varlen
    kernel instead of padding.
    """
    variant = variant_of(plan)
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
