"""Regional compilation: a variant's graph cut at its attention and communication, and the token-local
pieces between them compiled once for every variant that repeats them.

A variant compiled whole is a new Inductor graph for every SP size and recompute policy, so a
further variant cost about as much as the first (``benchmarks/results/compile_time.md``). Cut at
the ops that differ between variants (the all-to-alls, attention, dcp's own ops), what remains is
token-local code (norms, projections, MLPs, residuals) that is the same graph at every SP size,
differing only in how many tokens each rank holds. Each such region is compiled with fresh size
symbols (a symbol per symbolic dimension of its inputs, not the expression ``(s0 + 1) // 2`` the
variant's chunk has), keyed by its code, and reused by every region that has the same code: the
repeated blocks of one variant, and the same blocks in every other variant. The cut ops run as the
ATen ops they are (what the inner compiler would call for them anyway: collectives, SDPA and dcp's
custom ops are extern kernels under Inductor).

Recomputation is applied around the compiled regions at run time, with
``torch.utils.checkpoint``, so that it does not make new graphs either: ``attention`` recomputes
each attention op from its saved inputs, ``full`` recomputes every region from its inputs;
communication is never recomputed (its outputs are saved, as under every whole-graph policy
but ``block``). ``selective`` and ``block`` keep the whole-graph compile: ``selective`` picks ops
inside regions, and ``block`` recomputes a whole block, its all-to-alls included, from the
block's input, while a block spans several regions cut apart at exactly those all-to-alls
(checkpointing each region on its own would keep every region's inputs, the all-to-alls'
outputs among them, which is what ``block`` exists not to keep).

A region compiled with fresh symbols is only valid where the guards its compile added hold (a
size that must be at least 2, a stride): they are evaluated on every call, as dynamo's are, and a
region whose guards fail compiles again for the new shapes.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch
import torch.fx as fx
from torch.utils.checkpoint import checkpoint

from dcp_compile.compiler.progress import compile_stage
from dcp_compile.compiler.record import RegionCompiles
from dcp_compile.compiler.regions.cache import (
    INNER_REGION_COMPILERS, REGION_CACHE, GuardedCompile, compile_region, first_line,
)
from dcp_compile.compiler.regions.canonical_form import canonical_code, canonical_views, drop_unused_inputs
from dcp_compile.compiler.regions.fresh_symbols import UnsupportedRegion, fresh_inputs
from dcp_compile.compiler.regions.kept_for_backward import counting_kept_for_backward, note_checkpoint_inputs
from dcp_compile.compiler.regions.split import RegionKind, RegionPlan, describe_regions, split_into_regions
from dcp_compile.variant import RecomputePolicy

log = logging.getLogger(__name__)

# Recompute policies that regions apply at run time; the others compile the variant whole, for
# the reason given (the variant record's ``regions`` says it).
REGIONAL_POLICIES = (RecomputePolicy.NONE, RecomputePolicy.ATTENTION, RecomputePolicy.FULL)
WHOLE_GRAPH_REASONS = {
    RecomputePolicy.SELECTIVE: "picks ops inside regions",
    RecomputePolicy.BLOCK: ("recomputes whole blocks, their all-to-alls included, and a block spans several "
                            "regions cut at those all-to-alls: run-time checkpointing around each region would "
                            "keep the all-to-alls' outputs"),
    RecomputePolicy.OFFLOAD: "recomputes whole blocks as block does, and offloads their inputs at partitioning",
    RecomputePolicy.LEAN: "recomputes whole blocks as block does, and offloads their inputs at partitioning",
}


def whole_graph_reason(recompute: RecomputePolicy) -> str:
    """Why a variant under ``recompute`` is compiled whole under ``options={"regions": True}``."""
    return f"recompute={recompute} {WHOLE_GRAPH_REASONS.get(recompute, 'is not applied around regions')}"

MAX_COMPILES_PER_REGION = 8  # as dynamo's recompile limit: past it, a region runs uncompiled


class Region(torch.nn.Module):
    """One region of a variant, called by the parent graph; compiled at its first call."""

    def __init__(self, graph: fx.GraphModule, kind: RegionKind, inner: str, recomputed: bool,
                 uncompiled: list[str] | None = None, counts: RegionCompiles | None = None, label: str = "region"):
        super().__init__()
        self.graph_module = graph
        self.kind = kind
        self.inner = inner
        self.recomputed = recomputed
        self.compiled: list[GuardedCompile] = []
        self.uncompiled = uncompiled if uncompiled is not None else []  # the variant record's list
        self.counts = counts if counts is not None else RegionCompiles()  # the variant record's counts
        self.label = label  # "region 3 of 12", for the heartbeat of a long compile
        self.failed: set[tuple] = set()  # layouts of the calls whose compile failed: they run uncompiled

    def run(self, *args: Any) -> Any:
        if self.kind is not RegionKind.COMPILED:
            return self.graph_module(*args)
        for entry in self.compiled:
            if entry.accepts(args):
                return entry.compiled(*args)
        if any(isinstance(a, torch.Tensor) and a.numel() == 0 for a in args):
            # An empty share (a rank holding no token of a short sequence): nothing to compile for,
            # and a compile at size 0 specialises on it or fails (an integer modulo by zero) where
            # the other ranks' compiles succeed, which would leave them waiting in a collective.
            return self.graph_module(*args)
        layout = _layout(args)
        if layout in self.failed:
            return self.graph_module(*args)
        if len(self.compiled) >= MAX_COMPILES_PER_REGION:
            reason = (f"its guards failed on {MAX_COMPILES_PER_REGION} compiles (a size or stride that changes "
                      "from call to call in a way the compiles could not make symbolic)")
            log.warning("dcp: a region runs uncompiled from now on: %s", reason)
            self.uncompiled.append(reason)
            self.compiled.insert(0, GuardedCompile(None, self.graph_module))
            return self.graph_module(*args)
        try:
            entry = self.compile(args)
        except UnsupportedRegion as reason:
            log.warning("dcp: a region runs uncompiled (%s); the rest of the variant is compiled", reason)
            self.uncompiled.append(str(reason))
            entry = GuardedCompile(None, self.graph_module)
        except Exception as error:  # noqa: BLE001  a compile bug must not stop one rank of a group
            reason = f"its compile failed on this call's shapes ({first_line(error)})"
            log.warning("dcp: %s runs uncompiled at calls of these shapes: %s", self.label, reason)
            self.uncompiled.append(reason)
            self.failed.add(layout)
            return self.graph_module(*args)
        self.compiled.append(entry)
        return entry.compiled(*args)

    def compile(self, args: tuple) -> GuardedCompile:
        """``compile_region``, counted on the variant's record: a compile (and its time) or a reuse."""
        compiles_before, started = REGION_CACHE.compiles, time.perf_counter()
        with compile_stage(f"{self.inner}: {self.label}"):
            entry = compile_region(self.graph_module, args, self.inner, self.uncompiled)
        if REGION_CACHE.compiles > compiles_before:
            self.counts.compiled += 1
            self.counts.seconds += time.perf_counter() - started
        else:
            self.counts.reused += 1
        return entry

    def forward(self, *args: Any) -> Any:
        if self.recomputed and torch.is_grad_enabled() and any(
                isinstance(a, torch.Tensor) and a.requires_grad for a in args):
            note_checkpoint_inputs(args)
            return checkpoint(self.run, *args, use_reentrant=False)
        return self.run(*args)


def _layout(args: tuple) -> tuple:
    """What a compile depends on of a call: each tensor's sizes, strides and dtype, each other value."""
    return tuple((tuple(a.shape), a.stride(), a.dtype) if isinstance(a, torch.Tensor) else repr(a) for a in args)


def regional_module(gm: fx.GraphModule, inner: str, recompute: RecomputePolicy,
                    uncompiled: list[str] | None = None,
                    counts: RegionCompiles | None = None) -> tuple[fx.GraphModule, RegionPlan]:
    """The variant's graph as a parent of ``Region`` modules (compiled lazily, at their first call);
    a region that cannot be compiled says why in ``uncompiled`` (the variant record's list), and
    each compile or reuse is counted in ``counts`` (the record's, for the variant's log line)."""
    if recompute not in REGIONAL_POLICIES:
        raise UnsupportedRegion(whole_graph_reason(recompute))
    started = time.perf_counter()
    plan = split_into_regions(gm)
    for name, kind in plan.kinds.items():
        if kind is RegionKind.COMPILED and canonical_views(getattr(plan.parent, name)):
            drop_unused_inputs(plan.parent, name)
    compiled = [name for name, kind in plan.kinds.items() if kind is RegionKind.COMPILED]
    numbers = {name: number for number, name in enumerate(compiled, 1)}
    for name, kind in plan.kinds.items():
        recomputed = (recompute is RecomputePolicy.FULL and kind is not RegionKind.EXCHANGE) or (
            recompute is RecomputePolicy.ATTENTION and kind is RegionKind.ATTENTION)
        label = f"region {numbers[name]} of {len(compiled)}" if name in numbers else name
        setattr(plan.parent, name, Region(getattr(plan.parent, name), kind, inner, recomputed, uncompiled,
                                          counts, label))
    log.debug("dcp: split into %d regions in %.2fs", len(plan.kinds), time.perf_counter() - started)
    return plan.parent, plan


__all__ = ["INNER_REGION_COMPILERS", "MAX_COMPILES_PER_REGION", "REGIONAL_POLICIES", "REGION_CACHE",
           "WHOLE_GRAPH_REASONS", "GuardedCompile", "Region", "RegionKind", "RegionPlan", "UnsupportedRegion",
           "canonical_code", "canonical_views", "compile_region", "counting_kept_for_backward", "describe_regions",
           "fresh_inputs",
           "regional_module", "split_into_regions", "whole_graph_reason"]
