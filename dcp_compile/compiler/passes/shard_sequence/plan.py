"""Which nodes run on chunks: a pure function of the sequence analysis.

Layouts are decided per *sharding region*: the connected components of the graph formed by
"this op's output chunk lines up with that input's chunk" edges (``NodeRole.aligned_inputs``).
A region that contains an attention (or follows a gathered op whose output is still
sequence-indexed) is sharded; every other value stays full.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import networkx as nx
import torch.fx as fx

from dcp_compile.compiler.passes.sequence_dims import NodeRole, Role, SequenceAnalysis


@dataclass
class ShardPlan:
    """Which nodes run on chunks, decided from the sequence analysis."""

    sharded_nodes: set[fx.Node] = field(default_factory=set)
    regions: int = 0


def plan_sharding(analysis: SequenceAnalysis) -> ShardPlan:
    """Connected components of the alignment graph; those holding an attention are sharded."""
    plan = ShardPlan()
    if analysis.length is None:
        return plan
    alignment = nx.Graph()
    for node, role in analysis.roles.items():
        if node in analysis.region_members:
            continue  # follows its region's output (below)
        if role.role in (Role.TOKEN_LOCAL, Role.ATTENTION, Role.TOKEN_SET) or (role.role is Role.MIXING and role.rewrite):
            alignment.add_node(node)
            for source in role.aligned_inputs:
                alignment.add_edge(source, node)
    for component in nx.connected_components(alignment):
        # With an attention, or downstream of an op that ran on gathered inputs (its output is
        # full but still sequence-indexed): either way the token-local work runs on chunks again.
        if any(analysis.roles[n].role is Role.ATTENTION or _regathered(analysis.roles[n]) for n in component):
            plan.regions += 1
            plan.sharded_nodes.update(
                n for n in component
                if analysis.roles[n].role in (Role.TOKEN_LOCAL, Role.ATTENTION, Role.TOKEN_SET)
                or (analysis.roles[n].role is Role.MIXING and analysis.roles[n].rewrite)
            )
    plan.sharded_nodes.update(member for member, site in analysis.region_members.items()
                              if site.node in plan.sharded_nodes)
    return plan


def _regathered(role: NodeRole) -> bool:
    return role.role is Role.MIXING and not role.rewrite and bool(role.sequence_dims)
