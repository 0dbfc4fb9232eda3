"""One budget for every scheduler of a comparison, the contenders built from it, and their tuning.

A speed figure is evidence only if every scheduler in it plans with the same cost model, under the
same memory cap, and pays the same step. :class:`Budget` is that shared part; every contender of
a comparison (:func:`contenders`) is built from one, so a comparison cannot give DCP more memory
than a baseline (``tests/test_fair_comparison.py`` checks every entry point that compares).

Contenders, by family (each family a list of configurations; :func:`tune` keeps the one with the
least total step time over the run's steps, which favours the baselines: they are tuned on the
very steps they are then measured on, DCP is not tuned at all):

* ``dcp``: the planner.
* the published system (:mod:`.published_schedulers`): ``static-sp``, ``bucket-parallel``,
  ``dcp-inter``, at the budget's memory fraction (not their own 0.7).
* what a skilled user picks on this runtime (:mod:`.user_baselines`): ``static-sp+recompute`` at
  every SP size that holds the longest sample, ``packed-static-cp`` (Megatron Core's packing) at
  every such size, ``dynamic-cp`` (Megatron Core) over its recompute policy and per-rank threshold.
* ``fixed-lean``: the setup that trains the longest sample with the lean memory policies on every
  micro-batch, as ALST (arXiv 2506.13996) runs: static SP at every size that holds the longest
  sample under ``recompute=lean``, every micro-batch under ``lean``, best-fit packing.

:func:`ablation` builds the ladder that splits DCP's gain into its three choices.

A model that cannot pack samples of different lengths into one row (a DiT: each clip shape is a
call of its own) sets ``Budget.pack_equal_lengths_only``: every contender that packs then packs
equal lengths only (the planner's ``PlannerConfig(pack_equal_lengths_only=True)``, static SP's
``pack_equal_lengths_only``), and the families that pack mixed lengths into one row by design
(:data:`MIXED_PACKING_FAMILIES`) are left out. The published schedulers are planned as published.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Callable, Protocol, Sequence

from dcp_compile.variant import RECOMPUTE_POLICIES, RecomputePolicy

from .cost_model import CostModel
from .plan import Schedule
from .planner import Planner, PlannerConfig
from .published_schedulers import BucketParallelScheduler, DCPInterScheduler, StaticSPScheduler
from .step_time import step_time
from .user_baselines import DYNAMIC_CP_THRESHOLD_SHARES, BalancedStaticSP, PackedStaticCP, dynamic_cp_at_share

__all__ = ["ABLATION_RUNGS", "BASELINE_FAMILIES", "MIXED_PACKING_FAMILIES", "Budget", "PlannerScheduler", "Scheduler",
           "ablation", "contenders", "fixed_lean", "tune"]

BASELINE_FAMILIES = ("static-sp", "bucket-parallel", "dcp-inter", "static-sp+recompute", "packed-static-cp",
                     "dynamic-cp", "fixed-lean")
# Families whose micro-batches pack samples of mixed lengths into one row (Megatron Core's packing
# and dynamic CP): a model that runs one call per sample shape cannot train them as designed.
MIXED_PACKING_FAMILIES = ("packed-static-cp", "dynamic-cp")
ABLATION_RUNGS = ("static SP, one policy, dealt in order", "+ recompute per micro-batch",
                  "+ accumulation (micro-batches chosen per step)", "+ SP choice (DCP)")


class Scheduler(Protocol):
    name: str
    memory_cap: float

    def schedule(self, lengths: Sequence[int], spans: Sequence[float] | None = None) -> Schedule: ...


@dataclass(frozen=True)
class Budget:
    """What every scheduler of one comparison shares: the cost model (time, memory), the world, the
    memory cap (``memory_fraction`` of the cost model's device memory) and what the model can pack:
    ``pack_equal_lengths_only`` for a model that cannot pack samples of different lengths into one
    row (a DiT's clips of different shapes)."""

    cost_model: CostModel
    world_size: int
    memory_fraction: float = 0.9
    pack_equal_lengths_only: bool = False

    def __post_init__(self) -> None:
        if not 0 < self.memory_fraction <= 1:
            raise ValueError(f"memory_fraction must be in (0, 1], got {self.memory_fraction}")

    @property
    def memory_cap(self) -> float:
        return self.memory_fraction * self.cost_model.hardware.memory_capacity


class PlannerScheduler:
    """The DCP planner behind the scheduler interface (``config`` restricts it for the ablation; the
    budget's packing restriction applies on top of it)."""

    def __init__(self, budget: Budget, config: PlannerConfig | None = None, name: str = "dcp") -> None:
        self.name = name
        if budget.pack_equal_lengths_only:
            config = replace(config or PlannerConfig(), pack_equal_lengths_only=True)
        self.planner = Planner(budget.cost_model, budget.world_size, budget.memory_fraction, config=config)
        self.memory_cap = self.planner.memory_cap
        self.cost_model = budget.cost_model

    def schedule(self, lengths: Sequence[int], spans: Sequence[float] | None = None) -> Schedule:
        return self.planner.plan(lengths, spans)


def feasible_sizes(budget: Budget, max_length: int) -> list[int]:
    """SP sizes on which the longest sample fits under some policy."""
    sizes, size = [], 1
    while size <= budget.world_size:
        if budget.cost_model.fastest_feasible_recompute(max_length, size, budget.memory_cap) is not None:
            sizes.append(size)
        size *= 2
    return sizes


def fixed_lean(budget: Budget, max_length: int) -> list[Scheduler]:
    """ALST's way (arXiv 2506.13996): one SP size, the lean policies on every micro-batch; one
    configuration per SP size whose group holds the longest sample under ``lean``."""
    schedulers: list[Scheduler] = []
    for size in (2 ** k for k in range(budget.world_size.bit_length()) if 2 ** k <= budget.world_size):
        try:
            scheduler = BalancedStaticSP(budget.cost_model, budget.world_size, budget.memory_cap, size, max_length,
                                         per_microbatch_recompute=False, policies=(RecomputePolicy.LEAN,),
                                         pack_equal_lengths_only=budget.pack_equal_lengths_only)
        except ValueError:  # the longest sample does not fit this size even under lean
            continue
        scheduler.name = f"fixed-lean sp{size}"
        schedulers.append(scheduler)
    return schedulers


def contenders(budget: Budget, max_length: int) -> dict[str, list[Scheduler]]:
    """Every family's configurations under ``budget`` for a dataset whose longest sample has
    ``max_length`` tokens (a family no configuration of which can train it is left out, and so are
    :data:`MIXED_PACKING_FAMILIES` when the budget packs equal lengths only)."""
    cap = budget.memory_cap
    model, world = budget.cost_model, budget.world_size
    equal_only = budget.pack_equal_lengths_only
    families: dict[str, list[Scheduler]] = {"dcp": [PlannerScheduler(budget)]}
    fraction = budget.memory_fraction
    for family, build in (
        ("static-sp", lambda: [StaticSPScheduler(model, world, max_length, memory_fraction=fraction)]),
        ("bucket-parallel", lambda: [BucketParallelScheduler(model, world, max_length, memory_fraction=fraction)]),
        ("dcp-inter", lambda: [DCPInterScheduler(model, world, memory_fraction=fraction)]),
    ):
        try:
            families[family] = build()
        except ValueError:  # the published rule cannot place the longest sample under this cap
            pass
    sizes = feasible_sizes(budget, max_length)
    families["static-sp+recompute"] = [BalancedStaticSP(model, world, cap, s, max_length, pack_equal_lengths_only=equal_only)
                                       for s in sizes]
    families["fixed-lean"] = fixed_lean(budget, max_length)
    if equal_only:
        return {name: members for name, members in families.items() if members}
    families["packed-static-cp"] = [PackedStaticCP(model, world, cap, s, max_length) for s in sizes]
    dynamic = []
    for policy in RECOMPUTE_POLICIES:
        for share in DYNAMIC_CP_THRESHOLD_SHARES:
            try:
                dynamic.append(dynamic_cp_at_share(model, world, cap, max_length, share, recompute=policy))
            except ValueError:  # the policy cannot hold the longest sample, or the threshold is too small
                continue
    if dynamic:
        families["dynamic-cp"] = dynamic
    return {name: members for name, members in families.items() if members}


def tune(candidates: Sequence[Scheduler], items: Sequence[Any], cost: Callable[[Scheduler, Any], float]) -> tuple[Scheduler, float]:
    """The candidate with the least total ``cost(scheduler, item)`` over ``items`` (the run's steps;
    ties: the first), and that total. A candidate that cannot plan a step is out."""
    best: tuple[Scheduler, float] | None = None
    for candidate in candidates:
        total = 0.0
        try:
            for item in items:
                total += cost(candidate, item)
        except ValueError:
            continue
        if best is None or total < best[1]:
            best = (candidate, total)
    if best is None:
        raise ValueError("no candidate could plan every step; the comparison has no baseline of this family")
    return best


def ablation(budget: Budget, max_length: int, sp_size: int) -> dict[str, Scheduler]:
    """The ladder from static SP to DCP at SP size ``sp_size`` (the tuned static size), one freedom
    per rung: the step dealt to the groups in arrival order (``DistributedSampler``), each packing
    its share in order under one policy for all; the fastest policy per micro-batch; micro-batch
    counts and contents per group chosen per step (the planner restricted to that one size, which
    also tries the balanced static plan); every SP size (DCP)."""
    model, world, cap = budget.cost_model, budget.world_size, budget.memory_cap
    equal_only = budget.pack_equal_lengths_only
    return {
        ABLATION_RUNGS[0]: BalancedStaticSP(model, world, cap, sp_size, max_length, per_microbatch_recompute=False,
                                            balanced=False, pack_equal_lengths_only=equal_only),
        ABLATION_RUNGS[1]: BalancedStaticSP(model, world, cap, sp_size, max_length, balanced=False,
                                            pack_equal_lengths_only=equal_only),
        ABLATION_RUNGS[2]: PlannerScheduler(budget, PlannerConfig(sp_sizes=(sp_size,)), name=f"dcp at sp{sp_size} only"),
        ABLATION_RUNGS[3]: PlannerScheduler(budget),
    }


@dataclass
class Contender:
    """One family's tuned configuration and its plan of every step of the run."""

    family: str
    scheduler: Scheduler
    schedules: list[Schedule]
    configurations: int  # how many configurations the tuning tried


def plan_run(budget: Budget, steps: Sequence[tuple[Sequence[int], Sequence[float] | None]], max_length: int,
             with_ablation: bool = True) -> tuple[dict[str, Contender], dict[str, Contender]]:
    """Every family, tuned on the run's ``steps`` (``(lengths, spans)`` pairs) by its predicted step
    time (gradient all-reduce included, unoverlapped), and the ablation ladder at the tuned static
    SP size: ``(families, ablation)``."""

    def cost(scheduler: Scheduler, index: int) -> float:
        lengths, spans = steps[index]
        return step_time(scheduler.schedule(lengths, spans), lengths, budget.cost_model).unoverlapped

    def planned(family: str, scheduler: Scheduler, tried: int) -> Contender:
        schedules = []
        for lengths, spans in steps:
            schedule = scheduler.schedule(lengths, spans)
            schedule.validate(len(lengths))
            schedules.append(schedule)
        return Contender(family, scheduler, schedules, tried)

    families = {}
    for family, candidates in contenders(budget, max_length).items():
        try:
            chosen, _ = tune(candidates, range(len(steps)), cost)
        except ValueError:
            continue
        families[family] = planned(family, chosen, len(candidates))
    ablation_rungs: dict[str, Contender] = {}
    if with_ablation and "static-sp+recompute" in families:
        size = families["static-sp+recompute"].scheduler.sp_size
        for rung, scheduler in ablation(budget, max_length, size).items():
            try:
                ablation_rungs[rung] = planned(rung, scheduler, 1)
            except ValueError:
                break
    return families, ablation_rungs
