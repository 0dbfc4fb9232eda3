"""A one-process stand-in for an SP world, so a single device runs any variant's per-rank work.

On torch's fake process group every collective returns at once without moving data: rank 0 then
computes exactly what it would in a real group of that size (its chunk of the tokens in
token-local ops, every position of its heads in attention), and the time measured is that
compute alone. What the collectives would cost is the cost model's communication term.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch.distributed as dist

from dcp_compile.runtime.process_groups import create_sp_groups


class ProfilingWorldError(RuntimeError):
    """``dcp.profile`` was called where it cannot set up its one-process world."""


@contextlib.contextmanager
def fake_world(world_size: int) -> Iterator[None]:
    """A fake process group of ``world_size`` ranks with this process as rank 0, and its SP groups."""
    if dist.is_initialized():
        if dist.get_backend() == "fake" and dist.get_world_size() >= world_size:
            create_sp_groups()
            yield
            return
        raise ProfilingWorldError(
            f"dcp.profile measures on a one-process fake world of {world_size} ranks, but torch.distributed "
            f"is already initialised ({dist.get_backend()}, {dist.get_world_size()} ranks). Profile before "
            "init_process_group (one process, e.g. rank 0 of a setup step) with path='cost.json', then load "
            "that file on every rank with dcp.CostModel.load('cost.json'): every rank must plan with the same "
            "numbers, which one measurement gives and many would not."
        )
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        create_sp_groups()
        yield
    finally:
        dist.destroy_process_group()
