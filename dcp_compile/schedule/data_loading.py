"""A ``torch.utils.data.DataLoader`` over a :class:`DataCentricSampler`: workers load, a thread plans.

    batches = dcp.DataCentricBatchSampler(sampler)
    loader = DataLoader(dataset, batch_sampler=batches, num_workers=2, collate_fn=collate)
    for step in batches.steps(loader):          # one LoadedStep per optimizer step
        for mb, batch in step:                  # this rank's micro-batches, collated by a worker
            ...

Why an adapter and not the sampler itself as ``batch_sampler``: a DataLoader wants one index
list per batch, while a data-centric step is a *plan* (groups, SP sizes, loss scales) whose
micro-batch count differs per rank and may be zero. :class:`DataCentricBatchSampler` yields one
index list per micro-batch of this rank and remembers the plans it handed out, so
:meth:`DataCentricBatchSampler.steps` can put the loaded batches back into steps (the DataLoader
returns batches in order), including steps in which this rank runs nothing.

Three things the plain sampler iterator cannot do here:

* **Planning ahead.** The plan of step ``n + 1`` is computed in a background thread while step
  ``n`` is handed out (planning is pure: no collective, no randomness outside the seed).
* **No collective at prefetch time.** The DataLoader pulls indices whenever its workers have room,
  at moments that differ between ranks; a collective there (the sampler's plan check is an
  all-gather) would interleave with the model's collectives in a different order on each rank.
  The plan check runs in :meth:`steps`, when the step is handed to the training loop, which every
  rank reaches in the same order.
* **Resuming at what was trained, not what was prefetched.** The workers run ahead of training,
  so the position saved by :meth:`state_dict` is the steps :meth:`steps` handed out (a step
  counts as consumed once handed out, as with the sampler), in the sampler's own format:
  ``load_state_dict`` validates it against the data and settings, and a resumed run sees exactly
  the samples not yet seen. The state is plain integers and strings, so it can be saved with
  ``torch.distributed.checkpoint`` as part of the training state.
"""

from __future__ import annotations

import collections
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator

from .plan import MicroBatch, StepPlan
from .sampler import DataCentricSampler


@dataclass
class LoadedStep:
    """One optimizer step on this rank: its plan and each micro-batch with its collated batch."""

    plan: StepPlan
    batches: list[tuple[MicroBatch, Any]] = field(default_factory=list)

    def __iter__(self) -> Iterator[tuple[MicroBatch, Any]]:
        return iter(self.batches)

    def __len__(self) -> int:
        return len(self.batches)


class DataCentricBatchSampler:
    """``batch_sampler`` for a DataLoader: one index list per micro-batch of this rank, in plan order.

    Use :meth:`steps` on the DataLoader to get the batches back as steps (see the module
    docstring). ``plan_ahead`` (default on) plans the next step in a background thread.
    """

    def __init__(self, sampler: DataCentricSampler, plan_ahead: bool = True) -> None:
        self.sampler = sampler
        self.plan_ahead = plan_ahead
        state = sampler.state_dict()
        self._epoch = int(state["epoch"])  # the position of training (steps handed out by steps())
        self._next_step = int(state["next_step"])
        self._handed_plans: collections.deque[StepPlan] = collections.deque()
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ DataLoader side
    def __iter__(self) -> Iterator[list[int]]:
        """Index lists from the training position on; the DataLoader runs this ahead of training."""
        for plan in self._plans(self._epoch, self._next_step):
            with self._lock:
                self._handed_plans.append(plan)
            for microbatch in plan.microbatches:
                yield list(microbatch.indices)

    def _plans(self, epoch: int, start: int) -> Iterator[StepPlan]:
        count = len(self.sampler.steps(epoch))
        if not self.plan_ahead:
            for step in range(start, count):
                yield self.sampler.plan(step, epoch)
            return
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="dcp-plan-ahead") as planner:
            pending: Future[StepPlan] | None = planner.submit(self.sampler.plan, start, epoch) if start < count else None
            for step in range(start, count):
                plan = pending.result()
                pending = planner.submit(self.sampler.plan, step + 1, epoch) if step + 1 < count else None
                yield plan

    # ------------------------------------------------------------------ training side
    def steps(self, loader: Iterable[Any]) -> Iterator[LoadedStep]:
        """The rest of the current epoch as :class:`LoadedStep` s, pairing ``loader``'s batches
        (a DataLoader built with this batch sampler) with the plans they were loaded for."""
        self.sampler.prepare_world()  # on the training thread, where every rank arrives in order
        with self._lock:
            self._handed_plans.clear()
        epoch = self._epoch
        count = len(self.sampler.steps(epoch))
        batches = iter(loader)
        finished = False
        while self._next_step < count:
            loaded = None
            if not self._handed_plans and not finished:
                try:  # pull one batch: it makes the batch sampler hand out at least one more plan
                    loaded = next(batches)
                except StopIteration:
                    finished = True
            with self._lock:
                if not self._handed_plans:
                    raise RuntimeError("dcp: the DataLoader ended before the epoch's plans did; build it with "
                                       "batch_sampler=this DataCentricBatchSampler and no other sampler")
                plan = self._handed_plans.popleft()
            if plan.step != self._next_step or plan.epoch != epoch:
                raise RuntimeError(f"dcp: expected the plan of epoch {epoch} step {self._next_step}, got epoch "
                                   f"{plan.epoch} step {plan.step}; iterate a loader only through steps()")
            step = LoadedStep(plan)
            for microbatch in plan.microbatches:
                if loaded is None:
                    loaded = next(batches)
                step.batches.append((microbatch, loaded))
                loaded = None
            if loaded is not None:
                raise RuntimeError("dcp: the DataLoader returned a batch for a step with no micro-batch on this rank")
            if self.sampler.verify_plan:
                self.sampler._verify(plan, count)  # every rank reaches this point in the same order
            self._next_step += 1  # handed out = consumed, as with the sampler
            yield step
        if self._next_step >= count and self._epoch == epoch:
            self._epoch, self._next_step = epoch + 1, 0
            self.sampler.set_epoch(epoch + 1)

    def set_epoch(self, epoch: int) -> None:
        """Start ``epoch`` from its first step."""
        self.sampler.set_epoch(epoch)
        self._epoch, self._next_step = int(epoch), 0

    # ------------------------------------------------------------------ checkpointing
    def state_dict(self) -> dict[str, Any]:
        """The sampler's state at the training position (not the DataLoader's prefetch position)."""
        return {**self.sampler.state_dict(), "epoch": self._epoch, "next_step": self._next_step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume at ``state``'s position; the next :meth:`steps` starts there. Validated by the sampler."""
        self.sampler.load_state_dict(state)
        self._epoch, self._next_step = int(state["epoch"]), int(state["next_step"])
        with self._lock:
            self._handed_plans.clear()
