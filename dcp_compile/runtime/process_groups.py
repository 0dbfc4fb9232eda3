"""Sequence-parallel process groups: aligned blocks of consecutive ranks, created once.

A size need not divide the world: with 3 ranks the SP-2 group is ranks 0-1 and rank 2 is in no
SP-2 group (the planner gives it SP-1 micro-batches); a rank asking for a size whose blocks leave
it out gets an error that lists the blocks.

``new_group`` is itself a collective over the world: every rank must create every group, in the
same order, or the job hangs. So all groups of all the sizes a job may use are created together on
first use, and every rank then looks up the one block that contains it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch.distributed as dist

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SequenceParallelGroup:
    """The SP group of this rank for one SP size."""

    sp_size: int
    rank: int  # this process's rank inside the group
    ranks: tuple[int, ...]  # global ranks of the group, consecutive
    process_group: object | None  # None when sp_size == 1

    @property
    def group_name(self) -> str:
        return self.process_group.group_name  # type: ignore[union-attr]


_groups: dict[int, SequenceParallelGroup] = {}
_created_sizes: set[int] = set()
# The world the groups belong to, held (not its id: a destroyed world's id can come back for the
# next one, as dcp.profile's fake world and a later one did) and compared by identity.
_created_for_world: object | None = None


def current_world() -> object | None:
    """The default process group now (None without one): the world compiled collectives name groups of."""
    return dist.group.WORLD if dist.is_available() and dist.is_initialized() else None


def default_sp_sizes(world_size: int) -> list[int]:
    """Powers of two up to the world size (the planner's sizes), plus the world size itself."""
    sizes, size = [], 2
    while size <= world_size:
        sizes.append(size)
        size *= 2
    if world_size > 1 and world_size not in sizes:
        sizes.append(world_size)
    return sizes


def validate_sp_size(sp_size: object, world_size: int | None = None) -> int:
    """Return ``sp_size`` as an int or raise an error that names the value and the fix."""
    if isinstance(sp_size, bool) or not isinstance(sp_size, int):
        if isinstance(sp_size, float) and sp_size.is_integer():
            sp_size = int(sp_size)
        else:
            raise TypeError(
                f"dcp: sp_size must be a positive integer, got {sp_size!r} "
                f"({type(sp_size).__name__}); pass e.g. options={{'sp_size': 2}}"
            )
    if sp_size < 1:
        raise ValueError(f"dcp: sp_size must be >= 1, got {sp_size}")
    if sp_size > 1:
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError(
                f"dcp: sp_size={sp_size} needs an initialized torch.distributed process group; "
                "call torch.distributed.init_process_group('nccl' or 'gloo') before the first "
                "call of the compiled model (torchrun sets up the environment), or use sp_size=1"
            )
        world = dist.get_world_size() if world_size is None else world_size
        if sp_size > world:
            raise ValueError(f"dcp: sp_size={sp_size} is larger than the world ({world} ranks); use at most {world}")
    return sp_size


def blocks_of(sp_size: int, world_size: int) -> list[tuple[int, ...]]:
    """The SP groups of one size: aligned blocks of consecutive ranks; a partial last block is none."""
    return [tuple(range(block * sp_size, (block + 1) * sp_size)) for block in range(world_size // sp_size)]


def create_sp_groups(extra_sizes: list[int] = ()) -> None:
    """Create every SP group (all default sizes plus ``extra_sizes``) on every rank, in order.

    A collective over the world: call it on all ranks at the same point (the backend does, on
    each graph it compiles, and it is a no-op once the groups exist).
    """
    global _created_for_world
    world_size, rank = dist.get_world_size(), dist.get_rank()
    if _created_for_world is not current_world():
        _groups.clear()
        _created_sizes.clear()
        _created_for_world = current_world()
    sizes = sorted(set(default_sp_sizes(world_size)) | {s for s in extra_sizes if 1 < s <= world_size})
    for size in sizes:  # the same order on every rank
        if size in _created_sizes:
            continue
        for ranks in blocks_of(size, world_size):
            group = dist.new_group(list(ranks))
            if rank in ranks:
                _groups[size] = SequenceParallelGroup(size, rank - ranks[0], ranks, group)
        _created_sizes.add(size)
        log.debug("created SP groups of size %d", size)


def sp_group(sp_size: int) -> SequenceParallelGroup:
    """This rank's SP group of ``sp_size`` ranks."""
    if sp_size == 1:
        rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        return SequenceParallelGroup(1, 0, (rank,), None)
    validate_sp_size(sp_size)
    if sp_size not in _created_sizes or _created_for_world is not current_world():
        # Never created lazily: a forward call is no point where every rank is known to arrive
        # together. The backend creates every power-of-two size (and the buckets' sizes) up front.
        raise ValueError(
            f"dcp: no process groups exist for SP size {sp_size}. Groups are created when the dcp "
            f"backend compiles its first graph (every power of two up to the world, plus the buckets' "
            f"sizes); for another size call dcp.runtime.create_sp_groups([{sp_size}]) on every rank right after "
            "torch.distributed.init_process_group"
        )
    if sp_size not in _groups:
        world, rank = dist.get_world_size(), dist.get_rank()
        blocks = blocks_of(sp_size, world)
        raise ValueError(
            f"dcp: rank {rank} is in no SP group of size {sp_size}: with {world} ranks the SP-{sp_size} "
            f"groups are {[list(b) for b in blocks]} (aligned blocks of consecutive ranks) and ranks "
            f"{list(range(len(blocks) * sp_size, world))} are left out. Give this rank a smaller SP size "
            "(the DataCentricSampler's plans do)"
        )
    return _groups[sp_size]
