"""The sampler: exactly once per epoch, resumable, identical on every rank, mismatches caught."""

from __future__ import annotations

import copy
import random

import pytest
import torch

from dcp_compile.schedule.cost_model import CostModel, ModelProfile
from dcp_compile.schedule.hardware import Hardware
from dcp_compile.schedule.plan import StepPlan
from dcp_compile.schedule.planner import PlanningError
from dcp_compile.testing.process_world import run_in_process_world
from dcp_compile.schedule.sampler import DataCentricSampler, PlanMismatchError

COST_MODEL = CostModel(ModelProfile.from_config("llama-3-8b"), Hardware.H200, optimizer_shards=64)


def dataset_lengths(count: int = 300, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    # Long-tailed: mostly short documents, a few that need sequence parallelism.
    return [min(131072, int(256 * rng.paretovariate(1.1))) for _ in range(count)]


def make_sampler(lengths, rank=0, world_size=8, seed=0, **kwargs) -> DataCentricSampler:
    return DataCentricSampler(
        lengths, tokens_per_step=200_000, cost_model=COST_MODEL, seed=seed,
        world_size=world_size, rank=rank, **kwargs,
    )


def global_indices(plan: StepPlan) -> list[int]:
    return [i for group in plan.groups for mb in group.microbatches for i in mb.indices]


def test_every_sample_exactly_once_per_epoch() -> None:
    lengths = dataset_lengths()
    sampler = make_sampler(lengths)
    for epoch in range(2):
        seen = []
        plans = list(sampler)
        assert len(plans) == len(sampler.steps(epoch)) > 3
        for plan in plans:
            assert plan.epoch == epoch
            indices = global_indices(plan)
            assert sorted(indices) == sorted(sampler.steps(epoch)[plan.step])
            assert plan.tokens == sum(lengths[i] for i in indices)
            assert plan.tokens <= sampler.tokens_per_step or len(indices) == 1
            seen += indices
        assert sorted(seen) == list(range(len(lengths)))  # the short last step is kept
    assert sampler.epoch == 2  # the iterator moves on to the next epoch by itself
    assert sampler.steps(0) != sampler.steps(1)  # reshuffled


def test_every_rank_of_a_group_gets_the_same_micro_batches() -> None:
    lengths = dataset_lengths()
    world = 8
    samplers = [make_sampler(lengths, rank=r, world_size=world) for r in range(world)]
    found_multi_rank_group = False
    for step in range(len(samplers[0])):
        plans = [s.plan(step) for s in samplers]
        assert len({p.plan_hash() for p in plans}) == 1
        for group in plans[0].groups:
            found_multi_rank_group |= group.sp_size > 1
            for rank in range(world):
                mine = plans[rank].microbatches
                if rank in group.ranks:
                    assert all(mb in mine for mb in group.microbatches)
                else:
                    assert not any(mb in mine for mb in group.microbatches)
        # Union over ranks (each group counted once) is the step; each rank's order is by SP size.
        for rank in range(world):
            sizes = [mb.sp_size for mb in plans[rank].microbatches]
            assert sizes == sorted(sizes, reverse=True)
    assert found_multi_rank_group, "the dataset should need sequence parallelism somewhere"


def test_resume_mid_epoch_gives_the_same_remaining_plans() -> None:
    lengths = dataset_lengths()
    uninterrupted = [p.plan_hash() for p in make_sampler(lengths, rank=3)]
    stop_after = 2
    first = make_sampler(lengths, rank=3)
    consumed = []
    for plan in first:
        consumed.append(plan.plan_hash())
        if plan.step == stop_after:
            state = copy.deepcopy(first.state_dict())  # written inside the step's loop body
            break
    resumed = make_sampler(lengths, rank=3)
    resumed.load_state_dict(state)
    rest = [p.plan_hash() for p in resumed]
    assert consumed + rest == uninterrupted
    assert resumed.epoch == 1


def test_resume_rejects_other_data_or_settings() -> None:
    lengths = dataset_lengths()
    state = make_sampler(lengths).state_dict()
    with pytest.raises(ValueError, match="seed"):
        make_sampler(lengths, seed=1).load_state_dict(state)
    with pytest.raises(ValueError, match="lengths_digest"):
        make_sampler(lengths[:-1] + [lengths[-1] + 1]).load_state_dict(state)


def test_set_epoch_and_len() -> None:
    lengths = dataset_lengths()
    sampler = make_sampler(lengths)
    sampler.set_epoch(5)
    assert len(sampler) == len(sampler.steps(5))
    assert [p.epoch for p in sampler] == [5] * len(sampler.steps(5))
    twin = make_sampler(lengths)
    twin.set_epoch(5)
    assert [p.plan_hash() for p in twin] == [sampler.plan(s, 5).plan_hash() for s in range(len(sampler.steps(5)))]


def test_step_plan_table_and_hash() -> None:
    sampler = make_sampler(dataset_lengths(), rank=1)
    plan = sampler.plan(0)
    text = str(plan)
    assert "step 0 (epoch 0)" in text and "predicted makespan" in text and "recompute" in text
    assert plan.plan_hash() in text or plan.plan_hash()[:12] in text
    assert plan.predicted_makespan == pytest.approx(max(plan.predicted_rank_times()))
    assert plan.lower_bound <= plan.predicted_makespan
    other = make_sampler(dataset_lengths(), rank=1, seed=9).plan(0)
    assert other.plan_hash() != plan.plan_hash()


def test_a_sample_too_long_for_the_world_is_refused_up_front() -> None:
    with pytest.raises(PlanningError, match="fits on no SP group"):
        make_sampler([1000, 40_000_000], world_size=2)
    # A per-rank token cap forces large samples onto large groups.
    sampler = make_sampler([1000, 7000], world_size=8, max_tokens_per_rank=1024)
    sizes = {len(mb.indices): mb.sp_size for mb in sampler.plan(0).groups[0].microbatches}
    assert all(mb.tokens <= 1024 * mb.sp_size for g in sampler.plan(0).groups for mb in g.microbatches)
    assert max(mb.sp_size for g in sampler.plan(0).groups for mb in g.microbatches) >= 8
    assert sizes


# --------------------------------------------------------------------------- bitwise resume
class _TinyModel(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(11, 6)
        self.head = torch.nn.Linear(6, 11)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.embed(tokens)))


def _train(sampler, model, optimizer, data, steps=None):
    losses = []
    for plan in sampler:
        total = torch.zeros((), dtype=torch.float64)
        for mb in plan.microbatches:
            tokens = torch.cat([data[i] for i in mb.indices])
            loss = torch.nn.functional.cross_entropy(model(tokens[:-1]), tokens[1:]) * mb.loss_scale
            loss.backward()
            total += loss.detach().double()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(total.item())
        if steps is not None and len(losses) == steps:
            break
    return losses


def test_resume_reproduces_losses_bitwise() -> None:
    generator = torch.Generator().manual_seed(0)
    lengths = [random.Random(i).randint(4, 60) for i in range(80)]
    data = [torch.randint(0, 11, (n,), generator=generator) for n in lengths]

    def fresh():
        torch.manual_seed(0)
        model = _TinyModel()
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
        sampler = DataCentricSampler(lengths, tokens_per_step=300, cost_model=COST_MODEL, seed=4, world_size=1, rank=0)
        return model, optimizer, sampler

    model, optimizer, sampler = fresh()
    reference = _train(sampler, model, optimizer, data)
    assert len(reference) > 5

    model, optimizer, sampler = fresh()
    head = _train(sampler, model, optimizer, data, steps=3)
    checkpoint = copy.deepcopy(
        {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "sampler": sampler.state_dict()}
    )
    model, optimizer, sampler = fresh()
    model.load_state_dict(checkpoint["model"])
    optimizer.load_state_dict(checkpoint["optimizer"])
    sampler.load_state_dict(checkpoint["sampler"])
    tail = _train(sampler, model, optimizer, data)
    assert head + tail == reference  # bitwise


# --------------------------------------------------------------------------- rank consistency
def _plan_with_seed_per_rank(rank: int, world_size: int) -> str:
    sampler = DataCentricSampler(
        dataset_lengths(60), tokens_per_step=20_000, cost_model=COST_MODEL,
        seed=0 if rank == 0 else 1, verify_plan=True,
    )
    try:
        next(iter(sampler))
    except PlanMismatchError as error:
        return str(error)
    return "no error"


def test_plan_hash_check_catches_a_rank_with_another_seed() -> None:
    messages = run_in_process_world(_plan_with_seed_per_rank, 2, timeout=120)
    for rank, message in enumerate(messages):
        assert "plan mismatch at epoch 0 step 0" in message, message
        assert "ranks [1] derived a different plan" in message, message
        assert f"this is rank {rank}" in message


def _plan_with_same_seed(rank: int, world_size: int) -> list[str]:
    sampler = DataCentricSampler(dataset_lengths(60), tokens_per_step=20_000, cost_model=COST_MODEL, seed=0, verify_plan=True)
    return [plan.plan_hash() for plan in sampler]


def test_plan_hash_check_passes_when_ranks_agree() -> None:
    hashes = run_in_process_world(_plan_with_same_seed, 2, timeout=120)
    assert hashes[0] == hashes[1] and len(hashes[0]) > 1


def _groups_before_and_after_iterating(rank: int, world_size: int) -> tuple[str, int]:
    from dcp_compile.runtime.process_groups import sp_group

    sampler = DataCentricSampler([100] * 8, tokens_per_step=400, cost_model=COST_MODEL, seed=0)
    try:
        sp_group(world_size)
        before = "groups existed"
    except ValueError as error:
        before = str(error)
    next(iter(sampler))
    return before, sp_group(world_size).sp_size


def test_iterating_the_sampler_creates_the_sp_groups_on_every_rank():
    # A rank whose first step holds no micro-batch compiles nothing then, so the backend cannot be
    # the one to create the groups (new_group needs every rank): the sampler does, where all start.
    for before, size in run_in_process_world(_groups_before_and_after_iterating, 2, timeout=120):
        assert "no process groups exist for SP size 2" in before
        assert size == 2
