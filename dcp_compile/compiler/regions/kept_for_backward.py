"""What a variant compiled in regions keeps for backward, measured at its first call.

A whole-graph variant's saved bytes are read off its partitioned forward graph. A regional variant
has no such graph: its compiled regions save what their own partitions return, the ops between
them (attention, collectives) save through eager autograd, and a checkpointed region keeps its
inputs instead of anything it computes. So the first call counts it as it happens: every tensor
autograd packs for backward outside a checkpoint (``saved_tensors_hooks``; inside one, the
checkpoint's own hooks take precedence and keep nothing), and the inputs of each checkpointed
region (what the checkpoint holds to recompute from), each storage once. Storages of the call's
inputs (parameters, the batch) are not counted: they live anyway, as the whole-graph count leaves
out graph inputs. The result is the runtime's own account, at the first call's length, which the
cost model's regional pricing (``ModelProfile.saved_activation_bytes(..., regions=True)``) is
tested against.
"""

from __future__ import annotations

import contextlib
import contextvars
from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator

import torch


@dataclass
class KeptForBackward:
    """Storages kept for backward during one call, by address (each counted once)."""

    excluded: set[int] = field(default_factory=set)  # storages of the call's inputs
    storages: dict[int, int] = field(default_factory=dict)  # address -> bytes

    def keep(self, tensor: Any) -> None:
        if not isinstance(tensor, torch.Tensor) or tensor.device.type == "meta":
            return
        storage = tensor.untyped_storage()
        address = storage.data_ptr()
        if address and address not in self.excluded:
            self.storages[address] = storage.nbytes()

    @property
    def total_bytes(self) -> int:
        return sum(self.storages.values())


_CURRENT: contextvars.ContextVar[KeptForBackward | None] = contextvars.ContextVar("dcp_kept_for_backward", default=None)


@contextlib.contextmanager
def counting_kept_for_backward(inputs: Iterable[Any]) -> Iterator[KeptForBackward]:
    """Count what the enclosed call keeps for backward, the storages of ``inputs`` left out."""
    account = KeptForBackward(excluded={value.untyped_storage().data_ptr() for value in inputs
                                        if isinstance(value, torch.Tensor) and value.device.type != "meta"})

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        account.keep(tensor)
        return tensor

    token = _CURRENT.set(account)
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            yield account
    finally:
        _CURRENT.reset(token)


def note_checkpoint_inputs(args: Iterable[Any]) -> None:
    """A checkpointed region is about to run: what it keeps is its tensor inputs."""
    account = _CURRENT.get()
    if account is not None:
        for value in args:
            account.keep(value)
