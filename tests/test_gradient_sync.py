"""Exact weighting: a DCP step over a gloo world equals one process on the step's global batch."""

from __future__ import annotations

import random

import pytest
import torch

from dcp_compile.schedule.cost_model import CostModel, ModelProfile
from dcp_compile.runtime.gradient_sync import sync_gradients
from dcp_compile.schedule.hardware import Hardware
from dcp_compile.testing.process_world import run_in_process_world
from dcp_compile.schedule.sampler import DataCentricSampler

VOCAB = 17
WIDTH = 8
NUM_SAMPLES = 46
TOKENS_PER_STEP = 310
MAX_TOKENS_PER_RANK = 48
STEPS = 3
LEARNING_RATE = 0.5


class TinyLM(torch.nn.Module):
    """Embedding + linear next-token model: per-token, so packing samples is concatenation."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, WIDTH)
        self.head = torch.nn.Linear(WIDTH, VOCAB)
        self.unused = torch.nn.Linear(2, 2)  # never gets a gradient: must count as zeros

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.embed(tokens)))


def make_dataset() -> list[torch.Tensor]:
    rng = random.Random(7)
    generator = torch.Generator().manual_seed(7)
    lengths = [rng.choice([3, 5, 9, 14, 22, 31, 40]) for _ in range(NUM_SAMPLES)]
    return [torch.randint(0, VOCAB, (n,), generator=generator) for n in lengths]


def make_model() -> TinyLM:
    torch.manual_seed(0)
    return TinyLM().double()


def make_sampler(dataset, world_size=None, rank=None) -> DataCentricSampler:
    return DataCentricSampler(
        [len(s) for s in dataset],
        tokens_per_step=TOKENS_PER_STEP,
        cost_model=CostModel(ModelProfile.from_config("llama-3-8b"), Hardware.H200, optimizer_shards=64),
        max_tokens_per_rank=MAX_TOKENS_PER_RANK,
        seed=3,
        world_size=world_size,
        rank=rank,
        supervised_tokens=[len(s) - 1 for s in dataset],
        max_sp_size=1,
    )


def mean_token_loss(model: TinyLM, samples: list[torch.Tensor]) -> torch.Tensor:
    """The model's loss on a packed micro-batch: mean next-token CE over its supervised tokens."""
    inputs = torch.cat([s[:-1] for s in samples])
    targets = torch.cat([s[1:] for s in samples])
    return torch.nn.functional.cross_entropy(model(inputs), targets)


def train_rank(rank: int, world_size: int) -> dict:
    dataset = make_dataset()
    model = make_model()
    sampler = make_sampler(dataset)
    assert (sampler.world_size, sampler.rank) == (world_size, rank)
    gradients, counts = [], []
    for step_index, step in zip(range(STEPS), sampler):
        counts.append(len(step.microbatches))
        for mb in step.microbatches:
            assert mb.sp_size == 1 and mb.group_ranks == (rank,)
            loss = mean_token_loss(model, [dataset[i] for i in mb.indices]) * mb.loss_scale
            loss.backward()
        sync_gradients(model)
        # Plain lists: tensors returned through the process-world queue would travel as shared
        # memory that dies with the child process.
        gradients.append({name: p.grad.tolist() for name, p in model.named_parameters()})
        with torch.no_grad():
            for p in model.parameters():
                p -= LEARNING_RATE * p.grad
        model.zero_grad(set_to_none=True)
    return {
        "gradients": gradients,
        "counts": counts,
        "parameters": {name: p.detach().tolist() for name, p in model.named_parameters()},
        "steps": [list(s) for s in sampler.steps(0)[:STEPS]],
    }


def reference_training(steps: list[list[int]]) -> tuple[list[dict], dict]:
    dataset = make_dataset()
    model = make_model()
    gradients = []
    for indices in steps:
        loss = mean_token_loss(model, [dataset[i] for i in indices])  # mean over the whole step
        loss.backward()
        gradients.append({name: (p.grad.clone() if p.grad is not None else torch.zeros_like(p)) for name, p in model.named_parameters()})
        with torch.no_grad():
            for p in model.parameters():
                if p.grad is not None:
                    p -= LEARNING_RATE * p.grad
        model.zero_grad(set_to_none=True)
    return gradients, {name: p.detach().clone() for name, p in model.named_parameters()}


def _tensor(values: list) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64)


def test_dcp_step_equals_mean_token_loss_over_the_global_batch() -> None:
    world_size = 4
    results = run_in_process_world(train_rank, world_size, timeout=240)
    steps = results[0]["steps"]
    assert all(r["steps"] == steps for r in results)
    counts = [[r["counts"][s] for r in results] for s in range(STEPS)]
    # The scenario must exercise unequal micro-batch counts across ranks.
    assert any(len(set(per_rank)) > 1 for per_rank in counts), counts
    expected_gradients, expected_parameters = reference_training(steps)
    for rank, result in enumerate(results):
        for step in range(STEPS):
            for name, expected in expected_gradients[step].items():
                torch.testing.assert_close(_tensor(result["gradients"][step][name]), expected, rtol=1e-10, atol=1e-12,
                                           msg=lambda m: f"rank {rank} step {step} {name}: {m}")
        for name, expected in expected_parameters.items():
            torch.testing.assert_close(_tensor(result["parameters"][name]), expected, rtol=1e-10, atol=1e-12)


def test_loss_scales_sum_to_one_and_cover_the_step() -> None:
    dataset = make_dataset()
    sampler = make_sampler(dataset, world_size=4, rank=0)
    for step in range(len(sampler)):
        plan = sampler.plan(step)
        scales = [mb.loss_scale for group in plan.groups for mb in group.microbatches]
        assert sum(scales) == pytest.approx(1.0, rel=1e-12)
        supervised = sum(len(dataset[i]) - 1 for i in plan.indices)
        for group in plan.groups:
            for mb in group.microbatches:
                assert mb.loss_scale == pytest.approx(sum(len(dataset[i]) - 1 for i in mb.indices) / supervised)


def test_single_process_sync_is_a_no_op() -> None:
    model = make_model()
    mean_token_loss(model, make_dataset()[:3]).backward()
    before = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    sync_gradients(model)
    for name, p in model.named_parameters():
        if name in before:
            assert torch.equal(p.grad, before[name])


def _sync_with_missing_gradients(rank: int, world_size: int) -> list[list[float]]:
    torch.manual_seed(0)
    layers = [torch.nn.Parameter(torch.zeros(3)) for _ in range(3)]
    if rank % 2 == 0:  # odd ranks never touch the parameters (no micro-batch this step)
        (layers[0] * (rank + 1)).sum().backward()
        (layers[2] * 2).sum().backward()
    sync_gradients(layers, bucket_bytes=8)  # tiny buckets: several all-reduces, same on every rank
    return [p.grad.tolist() for p in layers]


def test_missing_gradients_count_as_zeros() -> None:
    results = run_in_process_world(_sync_with_missing_gradients, 3, timeout=120)
    for result in results:
        assert result == [[4.0] * 3, [0.0] * 3, [4.0] * 3]  # ranks 0 and 2: (1 + 3), and 2 + 2
