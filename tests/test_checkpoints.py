"""Checkpoints through ``torch.distributed.checkpoint``: ``dcp.checkpoint.save_checkpoint`` / ``dcp.checkpoint.load_checkpoint``.

* **Bitwise resume.** On 2 gloo ranks, a TinyGPT (replicated, and sharded with
  ``dcp.shard_model``) compiled with ``backend="dcp"`` trains 4 data-centric steps through a
  DataLoader and saves a checkpoint after step 2. A *new* process world builds everything afresh,
  loads that checkpoint and trains on: it sees exactly the steps the first run saw after step 2
  and ends with parameters ``torch.equal`` to the uninterrupted run's.
* **Nothing half-written.** A rank killed (``os._exit``) while writing leaves only a
  ``.partial`` directory: the previous checkpoint is still the latest, loads intact, and the next
  save to the same path succeeds.
* Single-process checks: the errors name the problem and the fix.
"""

from __future__ import annotations

import os
import random
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

import dcp_compile as dcp
from dcp_compile.demo.example_models import TinyGPT
from dcp_compile.schedule.cost_model import CostModel, ModelProfile
from dcp_compile.schedule.hardware import Hardware
from padded_batches import pad_right
from dcp_compile.testing.process_world import ProcessWorldError, run_in_process_world

WORLD_SIZE = 2
VOCAB, HIDDEN, LAYERS, HEADS = 64, 32, 2, 4
TOTAL_STEPS, SAVED_AFTER = 4, 2


def sample_lengths() -> list[int]:
    rng = random.Random(3)
    return [rng.choice([5, 7, 9, 12, 16, 30, 60]) for _ in range(48)]


def make_dataset() -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(11)
    return [torch.randint(1, VOCAB, (n,), generator=generator) for n in sample_lengths()]


def make_model(sharded: bool) -> torch.nn.Module:
    torch.manual_seed(0)
    model = TinyGPT(VOCAB, HIDDEN, LAYERS, HEADS)
    return dcp.shard_model(model) if sharded else model


def full_parameters(model: torch.nn.Module) -> dict[str, np.ndarray]:
    """Full parameter values as numpy arrays: a rank's return value then travels by value, not as
    tensors shared through file descriptors that die with the rank."""
    from torch.distributed.tensor import DTensor

    return {name: (p.full_tensor() if isinstance(p, DTensor) else p).detach().numpy().copy()
            for name, p in model.named_parameters()}


def equal(a: np.ndarray, b: np.ndarray) -> bool:
    return torch.equal(torch.from_numpy(a), torch.from_numpy(b))


def train_rank(rank: int, world_size: int, directory: str, sharded: bool, resume: bool) -> dict:
    """Train up to TOTAL_STEPS steps; save after SAVED_AFTER; with ``resume``, start from the checkpoint."""
    dcp.runtime.create_sp_groups()
    lengths = sample_lengths()
    cost_model = CostModel(ModelProfile.from_config("llama-3-8b"), Hardware.H200, optimizer_shards=world_size)
    sampler = dcp.DataCentricSampler(lengths, tokens_per_step=120, cost_model=cost_model, seed=3,
                                     max_tokens_per_rank=32, supervised_tokens=[n - 1 for n in lengths])
    batches = dcp.DataCentricBatchSampler(sampler)
    loader = DataLoader(make_dataset(), batch_sampler=batches, num_workers=0, collate_fn=pad_right)
    model = make_model(sharded)
    compiled = torch.compile(model, backend="dcp", dynamic=True, options={"inner": "eager"})
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    step = 0
    if resume:
        info = dcp.checkpoint.load_checkpoint(dcp.checkpoint.latest_checkpoint(directory), model=model, optimizer=optimizer, batches=batches)
        step = info.step
    trained, sp_sizes = [], set()
    for loaded in batches.steps(loader):
        if sharded:
            dcp.begin_step(model)
        for mb, batch in loaded:
            sp_sizes.add(mb.sp_size)
            with dcp.use(mb):
                loss = compiled(**batch) * mb.loss_scale
            loss.backward()
        dcp.sync_gradients(model)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        step += 1
        trained.append(sorted(loaded.plan.indices))
        if step == SAVED_AFTER and not resume:
            dcp.checkpoint.save_checkpoint(dcp.checkpoint.checkpoint_path(directory, step), model=compiled, optimizer=optimizer,
                                batches=batches, step=step)
        if step == TOTAL_STEPS:
            break
    return {"trained": trained, "sp_sizes": sorted(sp_sizes), "parameters": full_parameters(model),
            "resumed_at": step - len(trained)}


@pytest.mark.parametrize("sharded", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["replicated", "fsdp2"])
def test_a_resumed_run_continues_bitwise_like_an_uninterrupted_one(tmp_path: Path, sharded: bool) -> None:
    uninterrupted = run_in_process_world(train_rank, WORLD_SIZE, str(tmp_path), sharded, False, timeout=600)
    assert dcp.checkpoint.latest_checkpoint(tmp_path) == dcp.checkpoint.checkpoint_path(tmp_path, SAVED_AFTER)
    resumed = run_in_process_world(train_rank, WORLD_SIZE, str(tmp_path), sharded, True, timeout=600)
    assert set().union(*(r["sp_sizes"] for r in uninterrupted)) >= {1, 2}, "plans should mix SP sizes"
    start = full_parameters(make_model(False))
    for rank in range(WORLD_SIZE):
        first, second = uninterrupted[rank], resumed[rank]
        assert second["resumed_at"] == SAVED_AFTER
        assert second["trained"] == first["trained"][SAVED_AFTER:], "the resumed run saw other samples"
        for name, value in first["parameters"].items():
            assert equal(second["parameters"][name], value), f"rank {rank} {name} differs after resuming"
        # Not vacuous: the steps after the checkpoint moved every parameter away from the start.
        assert all(not equal(value, start[name]) for name, value in first["parameters"].items())


# --- a crash while writing -----------------------------------------------------------------------


def _perturbed_model(seed: int) -> torch.nn.Module:
    model = make_model(sharded=True)
    with torch.no_grad():
        generator = torch.Generator().manual_seed(seed)
        for parameter in model.parameters():
            local = parameter.to_local()
            local.add_(torch.randn(local.shape, generator=generator))
    return model


def _save_then_crash(rank: int, world_size: int, directory: str) -> None:
    """Save step 1 completely; rank 1 dies right after writing its files for step 2."""
    from torch.distributed.checkpoint import FileSystemWriter

    dcp.checkpoint.save_checkpoint(dcp.checkpoint.checkpoint_path(directory, 1), model=_perturbed_model(1), step=1)
    if rank == 1:
        write_data = FileSystemWriter.write_data

        def write_then_die(self, *args, **kwargs):
            future = write_data(self, *args, **kwargs)
            future.wait()
            os._exit(17)  # a kill: no exception handler, no cleanup

        FileSystemWriter.write_data = write_then_die
    dcp.checkpoint.save_checkpoint(dcp.checkpoint.checkpoint_path(directory, 2), model=_perturbed_model(2), step=2)


def _load_latest_and_save_again(rank: int, world_size: int, directory: str) -> dict:
    model = make_model(sharded=True)
    info = dcp.checkpoint.load_checkpoint(dcp.checkpoint.latest_checkpoint(directory), model=model)
    loaded = full_parameters(model)
    dcp.checkpoint.save_checkpoint(dcp.checkpoint.checkpoint_path(directory, 2), model=_perturbed_model(2), step=2)
    return {"step": info.step, "parameters": loaded, "expected": full_parameters(_perturbed_model(1))}


def test_a_crash_while_saving_leaves_the_previous_checkpoint_intact(tmp_path: Path) -> None:
    # Either the parent sees rank 1's exit first, or rank 0's broken collective.
    with pytest.raises(ProcessWorldError, match=r"rank 1 died with exit code 17|rank 0 failed:[\s\S]*Connection"):
        run_in_process_world(_save_then_crash, WORLD_SIZE, str(tmp_path), timeout=300)
    assert (tmp_path / "step_000000002.partial").is_dir(), "rank 1 should have died mid-save"
    assert not dcp.checkpoint.checkpoint_path(tmp_path, 2).exists(), "a half-written checkpoint got its final name"
    assert dcp.checkpoint.latest_checkpoint(tmp_path) == dcp.checkpoint.checkpoint_path(tmp_path, 1)
    results = run_in_process_world(_load_latest_and_save_again, WORLD_SIZE, str(tmp_path), timeout=300)
    for result in results:
        assert result["step"] == 1
        for name, value in result["expected"].items():
            assert equal(result["parameters"][name], value), name
    assert dcp.checkpoint.latest_checkpoint(tmp_path) == dcp.checkpoint.checkpoint_path(tmp_path, 2)
    assert not (tmp_path / "step_000000002.partial").exists(), "the leftover was not cleaned up"


# --- one process: errors that name the problem and the fix ---------------------------------------


def test_one_process_round_trip_and_clear_errors(tmp_path: Path) -> None:
    model = make_model(sharded=False)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(**pad_right(make_dataset()[:3])).backward()
    optimizer.step()
    path = dcp.checkpoint.save_checkpoint(dcp.checkpoint.checkpoint_path(tmp_path, 7), model=model, optimizer=optimizer, step=7)

    restored = make_model(sharded=False)
    restored_optimizer = torch.optim.AdamW(restored.parameters(), lr=1e-2)
    assert dcp.checkpoint.load_checkpoint(path, model=restored, optimizer=restored_optimizer).step == 7
    for (name, value), other in zip(model.state_dict().items(), restored.state_dict().values()):
        assert torch.equal(value, other), name
    assert torch.equal(optimizer.state_dict()["state"][0]["exp_avg"], restored_optimizer.state_dict()["state"][0]["exp_avg"])

    with pytest.raises(FileExistsError, match="checkpoint_path"):
        dcp.checkpoint.save_checkpoint(path, model=model)
    cost_model = CostModel(ModelProfile.from_config("llama-3-8b"), Hardware.H200, optimizer_shards=WORLD_SIZE)
    sampler = dcp.DataCentricSampler(sample_lengths(), tokens_per_step=120, cost_model=cost_model, world_size=1, rank=0)
    with pytest.raises(ValueError, match=r"not \['batches'\]"):
        dcp.checkpoint.load_checkpoint(path, model=restored, batches=sampler)
    (tmp_path / "step_000000009.partial").mkdir()
    assert dcp.checkpoint.latest_checkpoint(tmp_path) == path
    with pytest.raises(FileNotFoundError, match="interrupted"):
        dcp.checkpoint.load_checkpoint(tmp_path / "step_000000009", model=restored)
