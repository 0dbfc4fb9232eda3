"""One item per optimizer step, shaped like the ``DataLoader`` that training frameworks expect.

Why: the Hugging Face ``Trainer`` and Accelerate loops iterate a data loader whose items each feed
one ``training_step``, take its ``len()`` to count the steps of an epoch, call ``set_epoch`` and,
when a run resumes mid-epoch, hand it to ``accelerate.skip_first_batches``. A data-centric step is
a plan plus this rank's micro-batches (maybe none), so here one item is a whole
:class:`~dcp_compile.schedule.data_loading.LoadedStep`: every rank gets the same number of items
per epoch, whatever its micro-batch count, and the frameworks' per-item bookkeeping (gradient
accumulation, the optimizer step, checkpoints) lines up across ranks.

The shape is the ordinary ``DataLoader`` contract, so that code written for a ``DataLoader``
(``skip_first_batches`` rebuilds one from the loader's ``dataset``, ``batch_sampler``,
``collate_fn`` and worker settings; the Trainer reaches ``batch_sampler.set_epoch``) works on it
in every release:

* ``dataset`` (:class:`StepDataset`) maps a step key ``(epoch, step)`` to the loaded step: the plan,
  then each of this rank's micro-batches collated by the user's ``collate_fn``;
* ``batch_sampler`` (:class:`StepKeys`) yields ``[(epoch, step)]`` per step, from the loader's
  position to the end of the epoch, so skipping ``n`` batches skips ``n`` steps (nothing loaded);
* ``collate_fn`` unwraps the one step of each such "batch".

Workers load whole steps (plans are pure: no collective, no randomness outside the seed); in the
main process the next step's plan is computed in a background thread. The plan check across ranks
(an all-gather) and the position saved by :meth:`DataCentricStepLoader.state_dict` happen when a
step is handed to training (:meth:`DataCentricStepLoader.consume`), on the training thread, which
every rank reaches in the same order; never in a worker or at prefetch time.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Iterator

import torch
from torch.utils.data import DataLoader, Sampler, get_worker_info

from dcp_compile.schedule.data_loading import LoadedStep
from dcp_compile.schedule.plan import StepPlan
from dcp_compile.schedule.sampler import DataCentricSampler

StepKey = tuple[int, int]  # (epoch, step)

# What accelerate.skip_first_batches (and any code that rebuilds a DataLoader) reads off the loader.
_DATALOADER_SETTINGS = ("num_workers", "pin_memory", "timeout", "worker_init_fn", "multiprocessing_context",
                        "generator", "prefetch_factor", "persistent_workers", "pin_memory_device", "in_order")


class PinnableStep(LoadedStep):
    """A :class:`LoadedStep` the ``DataLoader``'s pin-memory thread can pin (it calls ``pin_memory()``)."""

    def pin_memory(self, device: Any = None) -> PinnableStep:
        return PinnableStep(self.plan, [(mb, _pin(batch)) for mb, batch in self.batches])


def _pin(data: Any) -> Any:
    """Pin every tensor of a collated batch (dicts, lists, tuples of tensors)."""
    if isinstance(data, torch.Tensor):
        return data.pin_memory()
    if isinstance(data, Mapping):
        pinned = {key: _pin(value) for key, value in data.items()}
        try:
            return type(data)(pinned)
        except TypeError:
            return pinned
    if isinstance(data, (list, tuple)):
        values = [_pin(value) for value in data]
        return type(data)(*values) if hasattr(data, "_fields") else type(data)(values)
    return data


def _single_step(items: list[PinnableStep]) -> PinnableStep:
    """The loader's ``collate_fn``: each "batch" is one step."""
    (step,) = items
    return step


class StepKeys(Sampler):
    """The loader's ``batch_sampler``: ``[(epoch, step)]`` per step, from the training position on.

    It owns the position (the steps handed to training so far), so ``set_epoch`` reaches it
    whether a framework calls it on the loader or, through a skip wrapper, on the batch sampler.
    """

    def __init__(self, sampler: DataCentricSampler) -> None:
        self.sampler = sampler
        state = sampler.state_dict()
        self.epoch, self.next_step = int(state["epoch"]), int(state["next_step"])

    def __iter__(self) -> Iterator[list[StepKey]]:
        epoch, start = self.epoch, self.next_step
        for step in range(start, len(self.sampler.steps(epoch))):
            yield [(epoch, step)]

    def __len__(self) -> int:
        """Steps in the current epoch (the same on every rank)."""
        return len(self.sampler.steps(self.epoch))

    def set_epoch(self, epoch: int) -> None:
        """Start ``epoch`` from its first step, unless training is already inside it (a resumed
        run's position must survive the framework's ``set_epoch`` at the top of every epoch)."""
        if int(epoch) != self.epoch:
            self.move_to(int(epoch), 0)

    def move_to(self, epoch: int, next_step: int) -> None:
        """Set the position; past the epoch's last step is the next epoch's first."""
        if next_step >= len(self.sampler.steps(epoch)):
            epoch, next_step = epoch + 1, 0
        self.epoch, self.next_step = epoch, next_step
        if self.sampler.epoch != epoch:
            self.sampler.set_epoch(epoch)


class StepDataset:
    """The loader's ``dataset``: ``(epoch, step)`` to the :class:`LoadedStep` of this rank.

    ``len()`` is the number of samples (what the Trainer reports as "Num examples").
    """

    def __init__(self, samples: Any, sampler: DataCentricSampler, collate_fn: Callable | None,
                 plan_ahead: bool = True) -> None:
        self.samples = samples
        self.sampler = sampler
        self.collate_fn = collate_fn if collate_fn is not None else torch.utils.data.default_collate
        self.plan_ahead = plan_ahead
        self._planner: ThreadPoolExecutor | None = None
        self._pending: tuple[StepKey, Future[StepPlan]] | None = None
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, key: StepKey) -> PinnableStep:
        plan = self._plan(*key)
        return PinnableStep(plan, [(mb, self.collate_fn([self.samples[i] for i in mb.indices]))
                                   for mb in plan.microbatches])

    def _plan(self, epoch: int, step: int) -> StepPlan:
        """The plan of ``step``; in the main process the next one is planned meanwhile."""
        if not self.plan_ahead or get_worker_info() is not None:  # workers already run ahead
            return self.sampler.plan(step, epoch)
        with self._lock:
            pending, self._pending = self._pending, None
            plan = pending[1].result() if pending is not None and pending[0] == (epoch, step) else None
            if plan is None:
                plan = self.sampler.plan(step, epoch)
            if step + 1 < len(self.sampler.steps(epoch)):
                if self._planner is None:
                    self._planner = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dcp-plan-ahead")
                self._pending = ((epoch, step + 1), self._planner.submit(self.sampler.plan, step + 1, epoch))
        return plan

    def __getstate__(self) -> dict[str, Any]:
        """Workers get the data and the sampler, not the main process' planning thread."""
        return {**self.__dict__, "_planner": None, "_pending": None, "_lock": None}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()


class DataCentricStepLoader:
    """Iterate the rest of the current epoch as :class:`LoadedStep` s (one per optimizer step).

    ``dataset``, ``collate_fn`` and the remaining keyword arguments (``num_workers``,
    ``pin_memory``, ...) describe how samples are loaded, as for any ``DataLoader``;
    ``collate_fn`` receives a micro-batch's samples. ``sampler`` is the data-centric sampler;
    ``dataset``, ``batch_sampler`` and ``collate_fn`` are the step-level ``DataLoader`` parts
    (module docstring), the user's samples are ``dataset.samples``.
    """

    def __init__(self, dataset: Any, sampler: DataCentricSampler, collate_fn: Callable | None = None,
                 plan_ahead: bool = True, **dataloader_kwargs: Any) -> None:
        self.sampler = sampler
        self.batch_sampler = StepKeys(sampler)
        self.dataset = StepDataset(dataset, sampler, collate_fn, plan_ahead)
        self.collate_fn = _single_step
        self.loader = DataLoader(self.dataset, batch_sampler=self.batch_sampler, collate_fn=self.collate_fn,
                                 **dataloader_kwargs)
        for name in _DATALOADER_SETTINGS:
            if hasattr(self.loader, name):
                setattr(self, name, getattr(self.loader, name))
        self._world_ready = False

    def __len__(self) -> int:
        """Steps in the current epoch (the same on every rank)."""
        return len(self.batch_sampler)

    def __iter__(self) -> Iterator[LoadedStep]:
        for step in self.loader:
            self.consume(step)
            yield step

    @property
    def position(self) -> tuple[int, int]:
        """``(epoch, next step)`` of training: the steps handed out so far count as trained."""
        return self.batch_sampler.epoch, self.batch_sampler.next_step

    def consume(self, step: LoadedStep) -> None:
        """Hand ``step`` to training: check its plan across ranks and move the position past it.

        Iterating the loader does this; a loop fed by a copy of the loader (the Trainer's
        ``skip_first_batches`` on resume) calls it itself. A step behind the position was
        consumed already and is left alone, so calling it twice is harmless.
        """
        plan = step.plan
        if (plan.epoch, plan.step) < self.position:
            return
        if not self._world_ready:  # SP groups: created by every rank in the same order, before the first step
            self.sampler.prepare_world()
            self._world_ready = True
        count = len(self.sampler.steps(plan.epoch))
        if self.sampler.verify_plan:
            self.sampler._verify(plan, count)  # every rank reaches this point in the same order
        self.batch_sampler.move_to(plan.epoch, plan.step + 1)

    def set_epoch(self, epoch: int) -> None:
        """Start ``epoch`` from its first step, unless training is already inside it."""
        self.batch_sampler.set_epoch(epoch)

    def state_dict(self) -> dict[str, Any]:
        """The sampler's settings and the training position (not the workers' prefetch position)."""
        epoch, next_step = self.position
        return {**self.sampler.state_dict(), "epoch": epoch, "next_step": next_step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume at ``state``'s position (validated against the data and settings by the sampler)."""
        self.sampler.load_state_dict(state)
        self.batch_sampler.move_to(int(state["epoch"]), int(state["next_step"]))

    def supervised_tokens(self, step: LoadedStep) -> int:
        """Targets of the whole step over the world (what its ``loss_scale`` s are shares of)."""
        counts = self.sampler.supervised_tokens or self.sampler.lengths
        return sum(counts[index] for index in step.plan.indices)
