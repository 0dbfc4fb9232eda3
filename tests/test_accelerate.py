"""``dcp.accelerate``: an Accelerate loop with data-centric steps is exact and resumes exactly.

On 2 gloo ranks a tiny random Llama trains one epoch through an ``Accelerator`` (model prepared
by ``dcp.accelerate.prepare_model``, optimizer and scheduler by ``accelerator.prepare``, the data
by ``dcp.accelerate.prepare_data``), clipping with ``accelerator.clip_grad_norm_`` and saving
``accelerator.save_state`` after the first step. The parameters must equal one process training
each step's global batch; a second loop that ``load_state`` s the first checkpoint must continue
with the samples not yet seen and end at the same parameters; the SP-2 variants must be sharded.
The example script (a diffusers video DiT) is run by ``tests/test_examples.py``.
"""

from __future__ import annotations

import multiprocessing
from pathlib import Path

import pytest
import torch

pytest.importorskip("accelerate")
pytest.importorskip("transformers")

import dcp_compile as dcp
from dcp_compile.schedule.cost_model import CostModel, ModelProfile
from dcp_compile.schedule.hardware import Hardware
from padded_batches import pad_right
from dcp_compile.testing.process_world import run_in_process_world
from sharding_checks import sharding_problems
from tiny_models import tiny_llama as shared_tiny_llama

VOCAB = 64
LENGTHS = (12, 40, 20, 48, 16, 36, 9, 27, 30, 14)
TOKENS_PER_STEP = 96
MAX_TOKENS_PER_RANK = 32
LR, EPS = 1e-3, 1e-6


def tiny_llama() -> torch.nn.Module:
    return shared_tiny_llama(VOCAB)


def dataset() -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(5)
    return [torch.randint(1, VOCAB, (n,), generator=generator) for n in LENGTHS]


def make_sampler(**world) -> dcp.DataCentricSampler:
    cost_model = CostModel(ModelProfile.from_config("llama-3-8b"), Hardware.H200, optimizer_shards=2)
    return dcp.DataCentricSampler(list(LENGTHS), TOKENS_PER_STEP, cost_model, MAX_TOKENS_PER_RANK, seed=0,
                                  supervised_tokens=[n - 1 for n in LENGTHS], **world)


def train(directory: str, resume: bool) -> tuple[torch.nn.Module, torch.nn.Module, list[int]]:
    """The loop of dcp_compile.runtime.accelerate_glue's docstring; returns the model, the compiled
    model and the steps this call trained."""
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    model, compiled = dcp.accelerate.prepare_model(accelerator, tiny_llama(), options={"inner": "eager"})
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS, weight_decay=0.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    optimizer, scheduler = accelerator.prepare(optimizer, scheduler)
    loader = dcp.accelerate.prepare_data(accelerator, dataset(), make_sampler(), collate_fn=pad_right)
    if resume:
        accelerator.load_state(directory)
    trained = []
    for step in loader:
        trained.append(step.plan.step)
        for mb, batch in step:
            with dcp.use(mb):
                loss = compiled(**batch).loss
            accelerator.backward(loss * mb.loss_scale)
        dcp.sync_gradients(model)
        accelerator.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        if step.plan.step == 0 and not resume:
            accelerator.save_state(directory)
    return model, compiled, trained


def _world(rank: int, world_size: int, directory: str) -> dict:
    multiprocessing.current_process()._config["daemon"] = False
    model, compiled, trained = train(directory, resume=False)
    with dcp.use(dcp.Variant(1)):  # the records of every variant compiled so far
        record = dcp.explain(compiled, **pad_right(dataset()[:1]))
    resumed, _, resumed_steps = train(directory, resume=True)
    return {
        "trained": trained,
        "resumed_steps": resumed_steps,
        "sharding_problems": sharding_problems(record, 0),
        "sp2_sites": [len(v.sharded_sites) for v in record.variant_records() if v.sp_size == 2],
        "parameters": {n: p.detach().tolist() for n, p in model.named_parameters()},
        "resumed": {n: p.detach().tolist() for n, p in resumed.named_parameters()},
    }


def test_an_accelerate_loop_equals_one_process_and_resumes_from_save_state(tmp_path: Path) -> None:
    results = run_in_process_world(_world, 2, str(tmp_path / "state"), timeout=900)
    steps = make_sampler(world_size=2, rank=0).steps(0)
    model = tiny_llama()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS, weight_decay=0.0)
    data = dataset()
    for indices in steps:
        model(**pad_right([data[i] for i in indices])).loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
    for rank, result in enumerate(results):
        assert result["trained"] == list(range(len(steps))), result["trained"]
        assert result["resumed_steps"] == list(range(1, len(steps))), result["resumed_steps"]
        assert not result["sharding_problems"], result["sharding_problems"]
        assert result["sp2_sites"] and all(sites == 2 for sites in result["sp2_sites"]), result["sp2_sites"]
        for key in ("parameters", "resumed"):
            for name, value in model.named_parameters():
                torch.testing.assert_close(torch.tensor(result[key][name]), value.detach(), rtol=1e-5, atol=1e-5,
                                           msg=lambda m: f"rank {rank} {key} {name}: {m}")
