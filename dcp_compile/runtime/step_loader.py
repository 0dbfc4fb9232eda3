"""One item per optimizer step: a ``DataLoader`` view that training frameworks can iterate.

Why: the Hugging Face ``Trainer`` and Accelerate loops iterate a data loader whose items each feed
one ``training_step``, take its ``len()`` to count the steps of an epoch and call ``set_epoch``.
A data-centric step is a plan plus this rank's micro-batches (maybe none), so here one item is a
whole :class:`~dcp_compile.schedule.data_loading.LoadedStep`: every rank gets the same number of
items per epoch, whatever its micro-batch count, and the frameworks' per-item bookkeeping
(gradient accumulation, the optimizer step, checkpoints) lines up across ranks.

The workers still load and collate micro-batch by micro-batch
(:class:`~dcp_compile.schedule.data_loading.DataCentricBatchSampler`), and the position saved by
:meth:`DataCentricStepLoader.state_dict` is the steps handed out, not what the workers prefetched.
"""

from __future__ import annotations

from typing import Any, Callable, Iterator

from torch.utils.data import DataLoader

from dcp_compile.schedule.data_loading import DataCentricBatchSampler, LoadedStep
from dcp_compile.schedule.sampler import DataCentricSampler


class DataCentricStepLoader:
    """Iterate the rest of the current epoch as :class:`LoadedStep` s (one per optimizer step).

    ``dataset``, ``collate_fn`` and the remaining keyword arguments (``num_workers``,
    ``pin_memory``, ...) go to the ``DataLoader`` that loads each micro-batch; ``collate_fn``
    receives a micro-batch's samples, as with any ``DataLoader``.
    """

    def __init__(self, dataset: Any, sampler: DataCentricSampler, collate_fn: Callable | None = None,
                 plan_ahead: bool = True, **dataloader_kwargs: Any) -> None:
        self.dataset = dataset
        self.sampler = sampler
        self.batches = DataCentricBatchSampler(sampler, plan_ahead=plan_ahead)
        self.loader = DataLoader(dataset, batch_sampler=self.batches, collate_fn=collate_fn, **dataloader_kwargs)

    def __len__(self) -> int:
        """Steps in the current epoch (the same on every rank)."""
        return len(self.sampler.steps(self.position[0]))

    def __iter__(self) -> Iterator[LoadedStep]:
        return self.batches.steps(self.loader)

    @property
    def position(self) -> tuple[int, int]:
        """``(epoch, next step)`` of training: the steps handed out so far count as trained."""
        state = self.batches.state_dict()
        return int(state["epoch"]), int(state["next_step"])

    def set_epoch(self, epoch: int) -> None:
        """Start ``epoch`` from its first step, unless training is already inside it (a resumed
        run's position must survive the framework's ``set_epoch`` at the top of every epoch)."""
        if int(epoch) != self.position[0]:
            self.batches.set_epoch(epoch)

    def state_dict(self) -> dict[str, Any]:
        return self.batches.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.batches.load_state_dict(state)

    def supervised_tokens(self, step: LoadedStep) -> int:
        """Targets of the whole step over the world (what its ``loss_scale`` s are shares of)."""
        counts = self.sampler.supervised_tokens or self.sampler.lengths
        return sum(counts[index] for index in step.plan.indices)
