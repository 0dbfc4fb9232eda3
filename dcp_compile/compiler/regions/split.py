"""Where a variant's graph is cut: before and after every op that differs between variants."""

from __future__ import annotations

import enum
import itertools
import operator
from dataclasses import dataclass

import torch
import torch.fx as fx
from torch.fx.passes.split_module import split_module

from dcp_compile.compiler.passes.insert_all_to_all import LOWERED_SITE
from dcp_compile.compiler.passes.recompute import is_attention, is_collective


class RegionKind(enum.Enum):
    COMPILED = "compiled"  # token-local: compiled once per distinct code, shared across variants
    ATTENTION = "attention"  # one attention op: runs as it is; recomputed under attention and full
    EXCHANGE = "exchange"  # a collective or one of dcp's own ops: runs as it is; never recomputed


def kind_of(node: fx.Node) -> RegionKind:
    """Attention ops; what differs between SP sizes (a site's Ulysses or ring lowering, collectives,
    dcp's own ops, higher-order ops with subgraphs of their own); and the token-local rest."""
    if is_attention(node):
        return RegionKind.ATTENTION
    target = node.target
    if (node.meta.get(LOWERED_SITE) is not None or is_collective(node) or str(target).startswith("dcp.")
            or isinstance(target, torch._ops.HigherOrderOperator)):
        return RegionKind.EXCHANGE
    return RegionKind.COMPILED


@dataclass
class RegionPlan:
    """The variant's graph as a parent graph that calls one submodule per region, in order."""

    parent: fx.GraphModule
    kinds: dict[str, RegionKind]  # submodule name -> kind


def split_into_regions(gm: fx.GraphModule) -> RegionPlan:
    """Cut ``gm`` before and after every op that is not token-local (see ``kind_of``): each attention
    op a region of its own, consecutive exchange ops one region, consecutive token-local ops one.

    Region numbers only grow along the graph's order, so every region reads only regions before
    it, and the parent calls them in that order. A multi-output op's ``getitem`` nodes stay with it.
    """
    partition: dict[fx.Node, int] = {}
    kinds: dict[int, RegionKind] = {}
    numbers = itertools.count()
    open_region: int | None = None
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "output", "get_attr"):
            continue
        if node.target is operator.getitem and isinstance(node.args[0], fx.Node) and node.args[0] in partition \
                and kinds[partition[node.args[0]]] is not RegionKind.COMPILED:
            partition[node] = partition[node.args[0]]
            continue
        kind = kind_of(node)
        if kind is RegionKind.ATTENTION or open_region is None or kinds[open_region] is not kind:
            open_region = next(numbers)
            kinds[open_region] = kind
        partition[node] = open_region
        if kind is RegionKind.ATTENTION:
            open_region = None
    parent = split_module(gm, gm, lambda node: partition[node], keep_original_order=True, tuple_return=True)
    return RegionPlan(parent, {f"submod_{number}": kind for number, kind in kinds.items()
                               if hasattr(parent, f"submod_{number}")})


def describe_regions(plan: RegionPlan) -> str:
    counts = {kind: sum(1 for k in plan.kinds.values() if k is kind) for kind in RegionKind}
    return (f"{counts[RegionKind.COMPILED]} compiled region(s) (shared by code across variants), "
            f"{counts[RegionKind.ATTENTION]} attention op(s) and {counts[RegionKind.EXCHANGE]} exchange op(s) between them")
