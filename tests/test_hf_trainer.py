"""``dcp.huggingface.DataCentricTrainer``: the stock Trainer loop, data-centric steps, exact updates.

On 2 gloo ranks a tiny random Llama trains one epoch through the Trainer with
``gradient_accumulation_steps=2`` (two data-centric steps per optimizer update), gradient clipping
on, a checkpoint after every update. Its parameters must equal one process training each update's
global batch (the mean token loss over the samples of both steps, clipped, AdamW) to 1e-5; every
SP-2 variant the plans used must have run every attention site under Ulysses with no gather; and a
second Trainer resumed from the first checkpoint through ``train(resume_from_checkpoint=...)``
(the Trainer skips the trained steps through ``skip_first_batches``; the checkpoint folder's
sampler position must agree) must end at the same parameters. What the Trainer logs is the global
loss: every rank logs the first update's loss of the whole world (``logging_first_step``) and the
same ``train_loss``, which includes the later updates' loss never logged before training ended,
each equal to one process's full-batch loss. A Trainer that does not see the process group (on
CPU without ``use_cpu=True``: transformers' "parallel_mode != ParallelMode.DISTRIBUTED" warning)
is refused with the fix.

``tests/test_hf_versions.py`` runs this file and ``tests/test_accelerate.py`` with the oldest
transformers and accelerate that pyproject.toml declares.
"""

from __future__ import annotations

import multiprocessing
from pathlib import Path

import pytest
import torch

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
MAX_TOKENS_PER_RANK = 32  # long samples need SP 2 (a tiny model on a CPU would fit anything at SP 1)
ACCUMULATION = 2
SEED = 0


def tiny_llama() -> torch.nn.Module:
    return shared_tiny_llama(VOCAB)


def dataset() -> list[dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(5)
    return [{"input_ids": torch.randint(1, VOCAB, (n,), generator=generator)} for n in LENGTHS]


def collate(samples: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """A Trainer ``data_collator``: pad on the right, labels -100 there."""
    return pad_right([sample["input_ids"] for sample in samples])


def cost_model() -> CostModel:
    return CostModel(ModelProfile.from_config("llama-3-8b"), Hardware.H200, optimizer_shards=2)


def training_arguments(output_dir: str, use_cpu: bool = True):
    from transformers import TrainingArguments

    return TrainingArguments(
        output_dir=output_dir, num_train_epochs=1, gradient_accumulation_steps=ACCUMULATION, learning_rate=1e-3,
        lr_scheduler_type="constant", adam_epsilon=1e-6, max_grad_norm=1.0, weight_decay=0.0, seed=SEED,
        save_strategy="steps", save_steps=1, logging_steps=100, logging_first_step=True, report_to=[],
        use_cpu=use_cpu, disable_tqdm=True, dataloader_num_workers=0,
    )


def make_trainer(output_dir: str, **arguments):
    from dcp_compile.huggingface import DataCentricArguments, DataCentricTrainer

    return DataCentricTrainer(
        model=tiny_llama(), args=training_arguments(output_dir, **arguments), train_dataset=dataset(),
        data_collator=collate,
        dcp_args=DataCentricArguments(tokens_per_step=TOKENS_PER_STEP, cost_model=cost_model(),
                                      max_tokens_per_rank=MAX_TOKENS_PER_RANK, compile_options={"inner": "eager"}),
    )


def _refusal(output_dir: str) -> tuple[int, str]:
    """Without use_cpu=True on a CPU, recent accelerate releases give the Trainer a world of one
    process (older ones find the process group): the world it sees, and the error it gets."""
    try:
        trainer = make_trainer(output_dir, use_cpu=False)
    except ValueError as error:
        return training_arguments(output_dir, use_cpu=False).world_size, str(error)
    return trainer.args.world_size, "no error"


def _train(rank: int, world_size: int, output_dir: str) -> dict:
    multiprocessing.current_process()._config["daemon"] = False  # as under torchrun (DataLoader workers)
    refusal = _refusal(output_dir)
    trainer = make_trainer(output_dir)
    trainer.train()
    loader = trainer.step_loader
    sp_sizes = sorted({mb.sp_size for step in range(len(loader.sampler.steps(0)))
                       for mb in loader.sampler.plan(step, 0).microbatches})
    batch = collate(dataset()[:1])
    with dcp.use(dcp.Variant(1)):  # records of every variant compiled so far; this call runs SP 1 only
        record = dcp.explain(trainer.compiled_model, **batch)
    sharded = [v for v in record.variant_records() if v.sp_size == 2]
    finished = {name: p.detach().tolist() for name, p in trainer.model.named_parameters()}

    resumed = make_trainer(output_dir)
    resumed.train(resume_from_checkpoint=str(Path(output_dir) / "checkpoint-1"))
    return {
        "refusal": refusal,
        "train_loss": [entry["train_loss"] for entry in trainer.state.log_history if "train_loss" in entry],
        "updates": trainer.state.global_step,
        "sp_sizes": sp_sizes,
        "sharding_problems": sharding_problems(record, 0),
        "sp2_sites": [len(v.sharded_sites) for v in sharded],
        "logged_losses": [entry["loss"] for entry in trainer.state.log_history if "loss" in entry],
        "parameters": finished,
        "resumed": {name: p.detach().tolist() for name, p in resumed.model.named_parameters()},
        "resumed_updates": resumed.state.global_step,
    }


def reference(updates: list[list[int]]) -> tuple[dict[str, torch.Tensor], list[float]]:
    """One process: each update's loss is the mean token loss over its samples; clipped; AdamW."""
    from transformers import Trainer

    model = tiny_llama()
    optimizer_cls, kwargs = Trainer.get_optimizer_cls_and_kwargs(training_arguments("unused"), model)
    # weight_decay as the Trainer's parameter groups set it (torch's AdamW would default to 0.01)
    optimizer = optimizer_cls(model.parameters(), **{**kwargs, "weight_decay": 0.0})
    data = dataset()
    losses = []
    for indices in updates:
        loss = model(**collate([data[i] for i in indices])).loss
        loss.backward()
        losses.append(float(loss.detach()))
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
    return {name: p.detach().clone() for name, p in model.named_parameters()}, losses


def test_data_centric_trainer_epoch_equals_one_process_and_resumes(tmp_path: Path) -> None:
    results = run_in_process_world(_train, 2, str(tmp_path), timeout=900)
    steps = dcp.DataCentricSampler(list(LENGTHS), TOKENS_PER_STEP, cost_model(), MAX_TOKENS_PER_RANK, seed=SEED,
                                   world_size=2, rank=0).steps(0)
    updates = [sum(steps[i: i + ACCUMULATION], []) for i in range(0, len(steps), ACCUMULATION)]
    assert len(updates) >= 2, steps
    expected, losses = reference(updates)
    start = dict(tiny_llama().named_parameters())
    assert any(not torch.allclose(expected[n], start[n].detach()) for n in expected)  # training moved them
    for rank, result in enumerate(results):
        assert result["updates"] == len(updates) and result["resumed_updates"] == len(updates), result["updates"]
        assert 2 in result["sp_sizes"], f"rank {rank}: no SP-2 micro-batch was planned: {result['sp_sizes']}"
        assert not result["sharding_problems"], (rank, result["sharding_problems"])
        assert result["sp2_sites"] and all(sites == 2 for sites in result["sp2_sites"]), result["sp2_sites"]
        seen, refusal = result["refusal"]
        assert ("sees 1 process" in refusal and "use_cpu=True" in refusal) if seen == 1 else refusal == "no error", (
            seen, refusal)
        # the global loss on every rank: train_loss (the later updates' loss unlogged until the end), the first update's
        torch.testing.assert_close(torch.tensor(result["train_loss"]), torch.tensor([sum(losses) / len(losses)]),
                                   rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(torch.tensor(result["logged_losses"]), torch.tensor(losses[:1]),
                                   rtol=1e-5, atol=1e-6)
        for key in ("parameters", "resumed"):
            for name, value in expected.items():
                torch.testing.assert_close(torch.tensor(result[key][name]), value, rtol=1e-5, atol=1e-5,
                                           msg=lambda m: f"rank {rank} {key} {name}: {m}")
