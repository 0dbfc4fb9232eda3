"""The data-centric sampler: an iterator of per-rank step plans, identical on every rank.

Each epoch the sampler shuffles the sample indices (seeded by ``seed`` and the epoch), cuts the
order into steps of at most ``tokens_per_step`` tokens (a sample longer than that is a step of
its own; the last, shorter step is kept, never dropped) and plans every step with
:class:`~dcp_compile.schedule.planner.Planner`. Everything is a pure function of
``(seed, epoch, step, lengths)`` and the cost model, so every rank computes the same global plan
and takes its own share; nothing is negotiated at run time. ``verify_plan`` (on by default)
checks that promise each step with one small all-gather of a plan digest, and iterating checks
first that the world the sampler planned for is the world it runs in (a sampler built before
``init_process_group`` plans for one rank).

Resuming: ``state_dict()`` records the epoch and the next step to run (a step counts as consumed
once the iterator has handed it out), so a checkpoint written inside the loop body of step ``k``
resumes at step ``k + 1`` with exactly the samples not yet seen.

Every rank must build the sampler from the same inputs, including the cost model: a model that
was calibrated on one rank must be saved and loaded on all of them (``CostModel.save``/``load``),
and ``Hardware.this_cpu(measure=True)`` must not be used for planning on several ranks.
"""

from __future__ import annotations

import hashlib
import logging
import random
from array import array
from collections import Counter
from typing import Any, Iterator, Sequence

from dcp_compile.errors import DCPError
from .cost_model import CostModel
from .plan import StepPlan
from .planner import Planner, PlannerConfig, PlanningError

log = logging.getLogger(__name__)

_STATE_VERSION = 1


class PlanMismatchError(DCPError, RuntimeError):
    """Ranks derived different plans for the same step."""


class DataCentricSampler:
    """Yields this rank's :class:`~dcp_compile.schedule.plan.StepPlan` for each step of an epoch.

    Args:
        lengths: tokens of every sample of the dataset (the attention length: for images and video,
            the number of patches).
        tokens_per_step: token budget of one optimizer step over the whole world.
        cost_model: the time/memory model to plan with; default ``CostModel.default()``.
        max_tokens_per_rank: the most tokens one rank may hold in a micro-batch; a longer sequence
            runs on a larger SP group.
        seed: shuffling seed (the same on every rank).
        world_size, rank: default to ``torch.distributed``'s, or 1 and 0 when it is not initialised.
        memory_fraction: share of device memory a plan may use.
        verify_plan: all-gather a digest of each step's plan and raise :class:`PlanMismatchError`
            naming the ranks that disagree (default on: one all-gather of one integer per step).
        spans: keys per query of each sample for the cost model (default: its length; see
            :func:`~dcp_compile.schedule.cost_model.video_attention_span`).
        supervised_tokens: tokens that count in each sample's loss (default: its length; a causal
            LM that shifts labels inside the sample supervises ``length - 1``). ``loss_scale`` is
            computed from these.
        max_sp_size: cap on the SP group size (default: the world).
        planner_config: advanced planner knobs.
    """

    def __init__(
        self,
        lengths: Sequence[int],
        tokens_per_step: int,
        cost_model: CostModel | None = None,
        max_tokens_per_rank: int | None = None,
        seed: int = 0,
        world_size: int | None = None,
        rank: int | None = None,
        memory_fraction: float = 0.9,
        verify_plan: bool = True,
        *,
        spans: Sequence[float] | None = None,
        supervised_tokens: Sequence[int] | None = None,
        max_sp_size: int | None = None,
        planner_config: PlannerConfig | None = None,
    ) -> None:
        self.lengths = [int(x) for x in lengths]
        if not self.lengths:
            raise ValueError("DataCentricSampler needs at least one sample length")
        if min(self.lengths) < 1:
            bad = next(i for i, x in enumerate(self.lengths) if x < 1)
            raise ValueError(f"sample {bad} has length {self.lengths[bad]}; every sample needs at least one token")
        if tokens_per_step < 1:
            raise ValueError(f"tokens_per_step must be >= 1, got {tokens_per_step}")
        self.spans = None if spans is None else [float(s) for s in spans]
        if self.spans is not None and len(self.spans) != len(self.lengths):
            raise ValueError(f"got {len(self.spans)} spans for {len(self.lengths)} samples; give one per sample")
        self.supervised_tokens = None if supervised_tokens is None else [int(s) for s in supervised_tokens]
        if self.supervised_tokens is not None and len(self.supervised_tokens) != len(self.lengths):
            raise ValueError(
                f"got {len(self.supervised_tokens)} supervised token counts for {len(self.lengths)} samples"
            )
        self.tokens_per_step = int(tokens_per_step)
        self.seed = int(seed)
        self._world_given = world_size is not None
        self.world_size, self.rank = _world_and_rank(world_size, rank)
        self.cost_model = cost_model or CostModel.default(self.world_size)
        self.max_tokens_per_rank = max_tokens_per_rank
        self.memory_fraction = memory_fraction
        self.verify_plan = verify_plan
        config = planner_config or PlannerConfig()
        if max_sp_size is not None:
            config = PlannerConfig(**{**config.__dict__, "max_sp_size": max_sp_size})
        self.planner = Planner(
            self.cost_model, self.world_size, memory_fraction=memory_fraction,
            max_tokens_per_rank=max_tokens_per_rank, config=config,
        )
        self._check_every_sample_fits()
        self._lengths_digest = hashlib.sha256(array("q", self.lengths).tobytes()).hexdigest()
        self.epoch = 0
        self._next_step = 0
        self._steps_cache: tuple[int, list[list[int]]] | None = None

    # ------------------------------------------------------------------ epoch structure
    def _check_every_sample_fits(self) -> None:
        longest = max(range(len(self.lengths)), key=self.lengths.__getitem__)
        try:
            self.planner.lower_bound([self.lengths[longest]], None if self.spans is None else [self.spans[longest]])
        except PlanningError as error:
            raise PlanningError(f"sample {longest}: {error}") from None

    def _rng(self, epoch: int) -> random.Random:
        digest = hashlib.sha256(f"dcp-sampler:{self.seed}:{epoch}".encode()).digest()
        return random.Random(int.from_bytes(digest[:8], "little"))

    def steps(self, epoch: int | None = None) -> list[list[int]]:
        """The dataset indices of every step of ``epoch`` (default: the current one)."""
        epoch = self.epoch if epoch is None else epoch
        if self._steps_cache is not None and self._steps_cache[0] == epoch:
            return self._steps_cache[1]
        order = list(range(len(self.lengths)))
        self._rng(epoch).shuffle(order)
        steps: list[list[int]] = []
        current: list[int] = []
        tokens = 0
        for index in order:
            length = self.lengths[index]
            if current and tokens + length > self.tokens_per_step:
                steps.append(current)
                current, tokens = [], 0
            current.append(index)
            tokens += length
        if current:
            steps.append(current)
        self._steps_cache = (epoch, steps)
        return steps

    def __len__(self) -> int:
        """Steps in the current epoch."""
        return len(self.steps())

    def set_epoch(self, epoch: int) -> None:
        """Start ``epoch`` from its first step."""
        self.epoch = int(epoch)
        self._next_step = 0

    # ------------------------------------------------------------------ planning
    def plan(self, step: int, epoch: int | None = None) -> StepPlan:
        """This rank's plan for ``step`` of ``epoch`` (no side effects, no communication)."""
        epoch = self.epoch if epoch is None else epoch
        steps = self.steps(epoch)
        if not 0 <= step < len(steps):
            raise IndexError(f"epoch {epoch} has {len(steps)} steps; step {step} does not exist")
        indices = steps[step]
        lengths = [self.lengths[i] for i in indices]
        spans = None if self.spans is None else [self.spans[i] for i in indices]
        supervised = None if self.supervised_tokens is None else [self.supervised_tokens[i] for i in indices]
        schedule = self.planner.plan(lengths, spans)
        return StepPlan.from_schedule(
            schedule,
            step=step,
            epoch=epoch,
            rank=self.rank,
            indices=indices,
            lengths=lengths,
            supervised_tokens=supervised,
            lower_bound=self.planner.lower_bound(lengths, spans),
        )

    def __iter__(self) -> Iterator[StepPlan]:
        self.prepare_world()
        epoch = self.epoch
        steps = self.steps(epoch)
        while self._next_step < len(steps) and self.epoch == epoch:
            step = self._next_step
            plan = self.plan(step, epoch)
            if self.verify_plan:
                self._verify(plan, len(steps))
            self._next_step = step + 1  # handed out = consumed (see the module docstring)
            yield plan
        if self.epoch == epoch and self._next_step >= len(steps):
            self.epoch = epoch + 1
            self._next_step = 0

    def prepare_world(self) -> None:
        """Where every rank starts iterating: check the world, then create the SP groups.

        The backend creates the groups when it compiles its first graph, but a rank whose first
        step holds no micro-batch compiles nothing then, and ``new_group`` must be called by every
        rank in the same order: creating them here (idempotent) saves the user a
        ``dcp.runtime.create_sp_groups()`` line.
        """
        self._check_world()
        import torch.distributed as dist

        if self.world_size > 1 and dist.is_available() and dist.is_initialized():
            from dcp_compile.runtime.process_groups import create_sp_groups

            create_sp_groups(extra_sizes=list(self.planner.sizes))

    def _check_world(self) -> None:
        """The world this sampler planned for is the one it runs in (or no world is initialised)."""
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            return
        world, rank = dist.get_world_size(), dist.get_rank()
        if (world, rank) == (self.world_size, self.rank):
            return
        if not self._world_given and self.world_size == 1:
            cause = ("it was built before torch.distributed.init_process_group, so it planned for a world of 1 "
                     "(every rank would train every sample). Build the sampler after init_process_group")
        else:
            cause = (f"it was built with world_size={self.world_size}, rank={self.rank}. Build it in the world "
                     "that runs it (leave world_size and rank unset to take torch.distributed's)")
        raise ValueError(f"dcp: DataCentricSampler planned for a world of {self.world_size} ranks (as rank "
                         f"{self.rank}) but runs on rank {rank} of a world of {world}: {cause}")

    def _verify(self, plan: StepPlan, num_steps: int) -> None:
        """All-gather a digest of the plan; raise on every rank if any rank disagrees."""
        import torch
        import torch.distributed as dist

        if self.world_size == 1 or not (dist.is_available() and dist.is_initialized()):
            return
        if dist.get_backend() == "fake":  # one process standing in for a world: no peers to ask
            return
        payload = f"{plan.plan_hash()}:{num_steps}:{self.world_size}"
        digest = int.from_bytes(hashlib.sha256(payload.encode()).digest()[:7], "little")
        device = torch.device("cpu")
        if dist.get_backend() == "nccl":
            device = torch.device("cuda", torch.cuda.current_device())
        local = torch.tensor([digest], dtype=torch.int64, device=device)
        gathered = [torch.zeros_like(local) for _ in range(dist.get_world_size())]
        dist.all_gather(gathered, local)
        values = [int(t.item()) for t in gathered]
        if len(set(values)) == 1:
            return
        counts = Counter(values)
        top = max(counts.values())
        # The majority's plan is the reference; on a tie, rank 0's.
        reference = values[0] if counts[values[0]] == top else next(v for v in values if counts[v] == top)
        mismatching = [r for r, v in enumerate(values) if v != reference]
        raise PlanMismatchError(
            f"plan mismatch at epoch {plan.epoch} step {plan.step}: ranks {mismatching} derived a different "
            f"plan than ranks {[r for r, v in enumerate(values) if v == reference]} (this is rank {self.rank}). "
            "Every rank must build DataCentricSampler from the same lengths, tokens_per_step, seed, "
            "max_tokens_per_rank, memory_fraction and cost model (save a calibrated cost model once and "
            "load the file on every rank), and resume from the same state_dict."
        )

    # ------------------------------------------------------------------ checkpointing
    def state_dict(self) -> dict[str, Any]:
        return {
            "version": _STATE_VERSION,
            "epoch": self.epoch,
            "next_step": self._next_step,
            "seed": self.seed,
            "tokens_per_step": self.tokens_per_step,
            "num_samples": len(self.lengths),
            "lengths_digest": self._lengths_digest,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("version") != _STATE_VERSION:
            raise ValueError(f"unsupported sampler state version {state.get('version')!r} (expected {_STATE_VERSION})")
        mismatches = [
            f"{key}: checkpoint {state[key]!r}, sampler {value!r}"
            for key, value in (
                ("seed", self.seed),
                ("tokens_per_step", self.tokens_per_step),
                ("num_samples", len(self.lengths)),
                ("lengths_digest", self._lengths_digest),
            )
            if state.get(key) != value
        ]
        if mismatches:
            raise ValueError(
                "the checkpoint was written by a sampler over different data or settings, so resuming "
                "would not continue with the samples not yet seen (" + "; ".join(mismatches) + "); build the "
                "sampler with the checkpoint's lengths, seed and tokens_per_step"
            )
        self.epoch = int(state["epoch"])
        self._next_step = int(state["next_step"])


def _world_and_rank(world_size: int | None, rank: int | None) -> tuple[int, int]:
    if world_size is None or rank is None:
        try:
            import torch.distributed as dist

            initialised = dist.is_available() and dist.is_initialized()
        except ImportError:  # pragma: no cover
            initialised = False
        if world_size is None:
            world_size = dist.get_world_size() if initialised else 1
        if rank is None:
            rank = dist.get_rank() if initialised else 0
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not in a world of {world_size}")
    return int(world_size), int(rank)
