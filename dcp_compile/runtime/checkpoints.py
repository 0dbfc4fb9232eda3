"""Training checkpoints through ``torch.distributed.checkpoint``: model, optimizer, sampler position.

    dcp.checkpoint.save_checkpoint(dcp.checkpoint.checkpoint_path("checkpoints", step), model=model,
                                   optimizer=optimizer, batches=batches, step=step)
    ...
    latest = dcp.checkpoint.latest_checkpoint("checkpoints")  # None on a first run
    if latest is not None:
        step = dcp.checkpoint.load_checkpoint(latest, model=model, optimizer=optimizer, batches=batches).step

Two "DCP"s meet here. In this module *data-centric* is this library and the *distributed
checkpoint* is PyTorch's ``torch.distributed.checkpoint`` (imported as ``torch_checkpoint``),
which every rank calls together and which writes each rank's shards of a sharded model
(``dcp.shard_model``: FSDP2 ``DTensor`` parameters and optimizer state) in parallel, and a
replicated model's tensors once. A checkpoint saved on one world size can be loaded on another:
the distributed checkpoint reshards, and the sampler's position does not depend on the world.

Why a wrapper and not ``torch_checkpoint.save`` in the training script:

* **Nothing half-written.** A job killed while writing (a preemption, an out-of-memory kill,
  a node failure) must not leave a directory that looks like a checkpoint. Every rank writes into
  ``<path>.partial``; once every rank has finished (a barrier) rank 0 renames it to ``<path>``,
  which on a POSIX file system is atomic: ``<path>`` either does not exist or is complete.
  :func:`latest_checkpoint` never returns a ``.partial`` directory, and the next save to the
  same path removes the leftover first. The file system must be shared by the ranks, as the
  distributed checkpoint itself requires.
* **The state that must travel together.** Model and optimizer go through
  ``torch.distributed.checkpoint.state_dict`` (which knows FSDP2, compiled wrappers and an
  optimizer that has not stepped yet); the :class:`~dcp_compile.DataCentricBatchSampler` (or the
  plain sampler) saves the *training* position, so a resumed run sees exactly the samples not yet
  seen; the step counter comes back as :attr:`CheckpointInfo.step`.
* **Saving between steps only.** An FSDP2 model inside a step (after ``dcp.begin_step``, before
  ``dcp.sync_gradients``) holds unsharded parameters and half-accumulated gradients; saving there
  would checkpoint a state no resumed run can reproduce, so it is refused.

A resumed run continues bitwise like an uninterrupted one when everything random in the step is
derived from the step (the data-centric sampler is; a diffusion example seeds its noise from the
step and sample), because RNG states are not saved: they differ per rank and per worker.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Mapping, Protocol

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as torch_checkpoint
from torch import nn

log = logging.getLogger(__name__)

PARTIAL_SUFFIX = ".partial"
_STEP_DIRECTORY = re.compile(r"^step_(\d+)$")
_METADATA_FILE = ".metadata"  # written last by torch.distributed.checkpoint's coordinator


class Stateful(Protocol):
    """What the distributed checkpoint saves and restores: ``state_dict`` / ``load_state_dict``."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> None: ...


@dataclass(frozen=True)
class CheckpointInfo:
    """What :func:`load_checkpoint` restored: where from, and the training step saved with it."""

    path: Path
    step: int


@dataclass
class _TrainingProgress:
    """The step counter, saved as a plain integer next to the tensors."""

    step: int = 0

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.step = int(state_dict["step"])


@dataclass
class _ModelState:
    """A model's state dict as ``torch.distributed.checkpoint.state_dict`` gives it (FSDP2-aware)."""

    model: nn.Module

    def state_dict(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        return get_model_state_dict(self.model)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import set_model_state_dict

        set_model_state_dict(self.model, state_dict)


@dataclass
class _OptimizerState:
    """An optimizer's state keyed by parameter names (not positions), so it reshards with the model."""

    model: nn.Module
    optimizer: torch.optim.Optimizer

    def state_dict(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        return get_optimizer_state_dict(self.model, self.optimizer)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

        set_optimizer_state_dict(self.model, self.optimizer, state_dict)


# ---------------------------------------------------------------------------------------------
# Paths
# ---------------------------------------------------------------------------------------------
def checkpoint_path(directory: str | os.PathLike[str], step: int) -> Path:
    """``directory/step_000000123``: one directory per saved step, found by :func:`latest_checkpoint`."""
    return Path(directory) / f"step_{int(step):09d}"


def latest_checkpoint(directory: str | os.PathLike[str]) -> Path | None:
    """The complete ``step_*`` checkpoint with the highest step under ``directory``, or ``None``.

    ``.partial`` directories (a save that did not finish) are never returned.
    """
    root = Path(directory)
    if not root.is_dir():
        return None
    complete = [
        (int(match.group(1)), entry) for entry in root.iterdir()
        if (match := _STEP_DIRECTORY.match(entry.name)) and (entry / _METADATA_FILE).is_file()
    ]
    return max(complete)[1] if complete else None


# ---------------------------------------------------------------------------------------------
# Save and load
# ---------------------------------------------------------------------------------------------
def save_checkpoint(
    path: str | os.PathLike[str],
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    batches: Stateful | None = None,
    step: int = 0,
    extra: Mapping[str, Stateful] | None = None,
) -> Path:
    """Write model, optimizer, sampler position and ``step`` to ``path``; every rank calls it.

    ``batches`` is a :class:`~dcp_compile.DataCentricBatchSampler` or a
    :class:`~dcp_compile.DataCentricSampler` (anything with ``state_dict``/``load_state_dict``
    of plain values, as is each entry of ``extra``, e.g. a learning-rate scheduler). The
    directory appears under its name only once complete (see the module docstring). Returns
    ``path``.
    """
    final = Path(path)
    _refuse_open_fsdp_step(model, "save")
    if final.exists():
        raise FileExistsError(
            f"checkpoint {final} already exists; save each checkpoint to a new path "
            "(dcp.checkpoint.checkpoint_path(directory, step) gives one per step) or delete the old one first"
        )
    partial = final.with_name(final.name + PARTIAL_SUFFIX)
    if _rank() == 0:
        if partial.exists():  # a save that was interrupted: never complete, safe to remove
            log.warning("removing %s, left by an interrupted save", partial)
            shutil.rmtree(partial)
        partial.parent.mkdir(parents=True, exist_ok=True)
    _barrier()
    with _single_process_quiet():
        torch_checkpoint.save(_state(model, optimizer, batches, _TrainingProgress(step), extra),
                              checkpoint_id=str(partial), no_dist=not _distributed())
    _barrier()  # every rank's files are written before the directory gets its final name
    if _rank() == 0:
        os.rename(partial, final)  # atomic: `final` is absent or complete
        _fsync_directory(final.parent)
    _barrier()  # no rank returns (and perhaps loads it, or prunes) before the rename
    log.info("saved checkpoint %s (step %d)", final, step)
    return final


def load_checkpoint(
    path: str | os.PathLike[str],
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    batches: Stateful | None = None,
    extra: Mapping[str, Stateful] | None = None,
) -> CheckpointInfo:
    """Restore what :func:`save_checkpoint` wrote into the given objects, in place; every rank calls it.

    Build ``model`` (sharded with ``dcp.shard_model`` or not, as when saving or not: the
    distributed checkpoint reshards), ``optimizer`` and ``batches`` exactly as for a fresh run,
    then load. Only the objects passed are restored.
    """
    source = Path(path)
    if not (source / _METADATA_FILE).is_file():
        partial = source.with_name(source.name + PARTIAL_SUFFIX)
        hint = (f"; {partial} exists: that save was interrupted and is not a checkpoint" if partial.exists() else "")
        raise FileNotFoundError(
            f"no complete checkpoint at {source}{hint}; pass a directory written by dcp.checkpoint.save_checkpoint "
            "(dcp.checkpoint.latest_checkpoint(directory) finds the newest one)"
        )
    _refuse_open_fsdp_step(model, "load")
    progress = _TrainingProgress()
    state = _state(model, optimizer, batches, progress, extra)
    _check_saved(source, state)
    with _single_process_quiet():
        torch_checkpoint.load(state, checkpoint_id=str(source), no_dist=not _distributed())
    log.info("loaded checkpoint %s (step %d)", source, progress.step)
    return CheckpointInfo(source, progress.step)


def _state(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    batches: Stateful | None,
    progress: _TrainingProgress,
    extra: Mapping[str, Stateful] | None,
) -> dict[str, Stateful]:
    """The objects to save or restore, by top-level key (``Stateful``: the distributed checkpoint
    calls ``state_dict`` when saving and ``load_state_dict`` after loading)."""
    module = _unwrap(model)
    state: dict[str, Stateful] = {"model": _ModelState(module), "progress": progress}
    if optimizer is not None:
        state["optimizer"] = _OptimizerState(module, optimizer)
    if batches is not None:
        state["batches"] = batches
    for name, value in (extra or {}).items():
        if name in state:
            raise ValueError(f"extra state name {name!r} is taken by dcp.checkpoint.save_checkpoint; choose another name")
        state[name] = value
    return state


def _check_saved(source: Path, state: Mapping[str, Stateful]) -> None:
    """Name the objects asked for that the checkpoint does not hold (instead of a missing-key error
    deep inside the distributed checkpoint)."""
    metadata = torch_checkpoint.FileSystemReader(str(source)).read_metadata()
    saved = {key.split(".", 1)[0] for key in metadata.state_dict_metadata}
    missing = sorted(set(state) - saved)
    if missing:
        raise ValueError(
            f"checkpoint {source} holds {sorted(saved)} but not {missing}; load without those arguments "
            "or from a checkpoint saved with them"
        )


def _unwrap(model: nn.Module) -> nn.Module:
    """The module whose parameter names the checkpoint uses: a ``torch.compile`` wrapper's original
    module, so a checkpoint of the compiled model loads into the plain one and back."""
    return getattr(model, "_orig_mod", model)


def _refuse_open_fsdp_step(model: nn.Module, action: str) -> None:
    from dcp_compile.runtime.fsdp import _STEP_OPEN, fsdp_modules, is_fsdp_model

    module = _unwrap(model)
    if is_fsdp_model(module) and getattr(fsdp_modules(module)[0], _STEP_OPEN, False):
        raise RuntimeError(
            f"dcp.{action}_checkpoint inside a step: dcp.begin_step(model) has gathered the parameters and "
            f"gradients are being accumulated; {action} between steps, after dcp.sync_gradients(model) and "
            "optimizer.step()"
        )


@contextlib.contextmanager
def _single_process_quiet() -> Iterator[None]:
    """Without a process group the distributed checkpoint warns that it assumes one process, which
    is what ``no_dist`` asked for; keep that warning out of the user's log."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _rank() -> int:
    return dist.get_rank() if _distributed() else 0


def _barrier() -> None:
    if _distributed():
        dist.barrier()


def _fsync_directory(directory: Path) -> None:
    """Make the rename durable (a crash right after it keeps the new name)."""
    try:
        descriptor = os.open(directory, os.O_RDONLY)
    except OSError:  # pragma: no cover - platforms without directory descriptors
        return
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)
