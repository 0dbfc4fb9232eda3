"""DataCentricBatchSampler: a DataLoader with workers yields this rank's planned steps, resumably.

* With ``num_workers=2`` and a ``collate_fn``, ``steps(loader)`` gives every step of the epoch in
  order, each micro-batch paired with the batch collated from exactly its indices; steps in which
  a rank runs nothing are still yielded; over all ranks every sample appears exactly once.
* Plans after the first are computed on the background planning thread.
* ``state_dict`` records what training consumed, not what the workers prefetched: a new process
  that loads it sees exactly the steps (and samples) an uninterrupted run would have seen next.
"""

from __future__ import annotations

import random
import threading

import torch
from torch.utils.data import DataLoader

import dcp_compile as dcp
from dcp_compile.schedule.cost_model import CostModel, ModelProfile
from dcp_compile.schedule.hardware import Hardware

WORLD_SIZE = 4
COST_MODEL = CostModel(ModelProfile.from_config("llama-3-8b"), Hardware.H200, optimizer_shards=WORLD_SIZE)


def lengths(count: int = 64, seed: int = 3) -> list[int]:
    """Short and long samples: long ones need SP, and some steps leave a rank without work."""
    rng = random.Random(seed)
    return [rng.choice([5, 7, 9, 12, 16, 30, 60]) for _ in range(count)]


class TokenDataset(torch.utils.data.Dataset):
    """Sample ``i`` is ``lengths[i]`` tokens all equal to ``i`` (so a batch names its samples)."""

    def __init__(self, sizes: list[int]) -> None:
        self.sizes = sizes

    def __len__(self) -> int:
        return len(self.sizes)

    def __getitem__(self, index: int) -> torch.Tensor:
        return torch.full((min(self.sizes[index], 8),), index, dtype=torch.long)


def collate(samples: list[torch.Tensor]) -> dict:
    return {"sample_ids": [int(s[0]) for s in samples], "worker": torch.utils.data.get_worker_info() is not None}


def make(rank: int, num_workers: int = 2, **kwargs) -> tuple[dcp.DataCentricBatchSampler, DataLoader]:
    sampler = dcp.DataCentricSampler(lengths(), tokens_per_step=120, cost_model=COST_MODEL,
                                     world_size=WORLD_SIZE, rank=rank, seed=3, max_tokens_per_rank=20, **kwargs)
    batches = dcp.DataCentricBatchSampler(sampler)
    loader = DataLoader(TokenDataset(lengths()), batch_sampler=batches, num_workers=num_workers, collate_fn=collate)
    return batches, loader


def test_workers_load_every_planned_micro_batch_in_order() -> None:
    seen = []
    ranks_without_work = 0
    for rank in range(WORLD_SIZE):
        batches, loader = make(rank)
        reference = [batches.sampler.plan(step, 0) for step in range(len(batches.sampler.steps(0)))]
        steps = list(batches.steps(loader))
        assert [s.plan for s in steps] == reference
        for step in steps:
            assert len(step) == len(step.plan.microbatches)
            ranks_without_work += len(step) == 0
            for mb, batch in step:
                assert batch["sample_ids"] == list(mb.indices)
                assert batch["worker"], "collation ran in a DataLoader worker"
                if mb.group_ranks[0] == rank:  # count each micro-batch once, on its group's first rank
                    seen += list(mb.indices)
        assert batches.state_dict()["epoch"] == 1 and batches.state_dict()["next_step"] == 0
    assert sorted(seen) == list(range(len(lengths())))
    assert ranks_without_work > 0, "the scenario should include a rank with no micro-batch in some step"


def test_next_plan_is_computed_on_the_background_thread() -> None:
    batches, loader = make(0, num_workers=0)
    threads = []
    plan = batches.sampler.plan

    def recording_plan(step, epoch=None):
        threads.append((step, threading.current_thread().name))
        return plan(step, epoch)

    batches.sampler.plan = recording_plan
    steps = list(batches.steps(loader))
    assert [s for s, _ in threads] == list(range(len(steps)))
    assert all(name.startswith("dcp-plan-ahead") for _, name in threads), threads


def test_resume_mid_epoch_with_exactly_the_unseen_samples() -> None:
    for rank in (0, 3):
        batches, loader = make(rank)
        uninterrupted = [(s.plan, [b["sample_ids"] for _, b in s]) for s in batches.steps(loader)]
        assert len(uninterrupted) > 4

        batches, loader = make(rank)
        consumed = []
        for step in batches.steps(loader):  # the workers prefetch beyond what training took
            consumed.append((step.plan, [b["sample_ids"] for _, b in step]))
            if len(consumed) == 3:
                state = batches.state_dict()
                break
        assert state["next_step"] == 3 and state["epoch"] == 0

        resumed_batches, resumed_loader = make(rank)
        resumed_batches.load_state_dict(state)
        rest = [(s.plan, [b["sample_ids"] for _, b in s]) for s in resumed_batches.steps(resumed_loader)]
        assert consumed + rest == uninterrupted


def test_state_of_other_data_is_refused() -> None:
    import pytest

    batches, _ = make(0, num_workers=0)
    state = batches.state_dict()
    other = dcp.DataCentricBatchSampler(dcp.DataCentricSampler(
        lengths(seed=5), tokens_per_step=120, cost_model=COST_MODEL, world_size=WORLD_SIZE, rank=0, seed=3,
        max_tokens_per_rank=20))
    with pytest.raises(ValueError, match="different data"):
        other.load_state_dict(state)
