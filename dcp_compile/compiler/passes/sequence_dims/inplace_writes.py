"""In-place writes, read the way functionalisation reads them: default deny.

The analysis sees a pre-dispatch ATen graph, where ``out[:, : n - k] = x[:, k:]`` is a
``copy_`` into a ``slice`` view of ``out`` and later readers read ``out`` itself: the write is
an edge the data flow does not show. Functionalisation would turn it into
``out = slice_scatter(out, x[:, k:], 1, 0, n - k)``, which no rule proves token-local. This
module does the same bookkeeping on the graph as it is, from the op schemas alone (an argument
annotated as written, a return that aliases its input), with no list of ops:

* an *alias group* is a value together with every view taken of it (transitively) and every
  in-place op applied to any of them;
* a written group is left on chunks only where every member is proven token-local (or a
  source, or a write with an exact chunked rewrite) by the rules and its base is computed in
  the graph: then each write lands in the rank's chunk of the buffer, exactly as the full write
  lands in the full buffer;
* any other written group that touches the sequence runs on the full sequence: each member up
  to the last write is sequence-mixing (gathered, with the reason below); views taken after it
  and other readers follow their own rules on the written buffer (token-local ones take their
  chunk of it).

``propagation`` finds the alias groups once (they depend on the graph alone), runs the analysis,
asks :func:`unproven_writes` which members to force, and runs it again with them forced, until
nothing changes (forcing one group can unprove another).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx

from dcp_compile.compiler.passes.sequence_dims.model import AnalysisView, NodeRole, Role, SequenceAnalysis
from dcp_compile.compiler.passes.sequence_dims.registry import Stage, mixing, op_name, rule, stage_rule

aten = torch.ops.aten


def _schema(target: Any) -> Any:
    return target._schema if isinstance(target, torch._ops.OpOverload) else None


def written_arguments(node: fx.Node) -> list[fx.Node]:
    """The inputs an op writes in place (``copy_``'s ``self``, an ``out=`` tensor)."""
    schema = _schema(node.target) if node.op == "call_function" else None
    if schema is None:
        return []
    written = []
    for position, argument in enumerate(schema.arguments):
        if argument.alias_info is None or not argument.alias_info.is_write:
            continue
        value = node.args[position] if position < len(node.args) else node.kwargs.get(argument.name)
        values = value if isinstance(value, (list, tuple)) else [value]
        written += [v for v in values if isinstance(v, fx.Node)]
    return written


def viewed_argument(node: fx.Node) -> fx.Node | None:
    """The input a view op returns an alias of (``slice``, ``view``, ``split``'s pieces), else None."""
    if node.op != "call_function":
        return None
    if node.target is operator.getitem:
        source = node.args[0]
        return source if isinstance(source, fx.Node) and viewed_argument(source) is not None else None
    schema = _schema(node.target)
    if schema is None or not schema.returns or schema.returns[0].alias_info is None:
        return None
    if schema.returns[0].alias_info.is_write:
        return None  # an in-place op: its result aliases what it wrote (see written_arguments)
    source = node.args[0] if node.args else None
    return source if isinstance(source, fx.Node) else None


@dataclass(frozen=True)
class AliasGroup:
    """A buffer, its views and the in-place ops on them."""

    base: fx.Node
    members: frozenset[fx.Node]
    writes: tuple[fx.Node, ...]


def alias_groups(graph: fx.Graph) -> list[AliasGroup]:
    """The alias groups of ``graph`` that are written in place."""
    parent: dict[fx.Node, fx.Node] = {}

    def find(node: fx.Node) -> fx.Node:
        while parent.get(node, node) is not node:
            node = parent[node]
        return node

    def union(view: fx.Node, source: fx.Node) -> None:
        parent.setdefault(view, view)
        parent.setdefault(source, source)
        parent[find(view)] = find(source)

    writes = []
    for node in graph.nodes:
        source = viewed_argument(node)
        if source is not None:
            union(node, source)
        written = written_arguments(node)
        if written:
            writes.append(node)
            for target in written:
                union(node, target)
    groups: dict[fx.Node, set[fx.Node]] = {}
    for node in parent:
        groups.setdefault(find(node), set()).add(node)
    result = []
    for members in groups.values():
        group_writes = tuple(n for n in graph.nodes if n in members and n in writes)
        if not group_writes:
            continue
        # The base: the member that is no view of another and no write (the buffer itself).
        bases = [n for n in members if viewed_argument(n) is None and n not in writes]
        base = next((n for n in graph.nodes if n in bases), group_writes[0])
        result.append(AliasGroup(base, frozenset(members), group_writes))
    return result


def _proven(group: AliasGroup, analysis: SequenceAnalysis, order: dict[fx.Node, int]) -> bool:
    if group.base.op in ("placeholder", "get_attr"):
        return False  # a write into an input would reach only the rank's chunk of it
    last_write = max(order[w] for w in group.writes)
    for member in group.members:
        if order[member] > last_write:
            continue  # a view taken after the last write reads the buffer like any reader
        role = analysis.roles.get(member)
        if role is None:
            continue
        if role.rewrite is not None:
            continue  # a rewrite lowers the write exactly on chunks (an MoE's inverse permutation)
        if role.role not in (Role.TOKEN_LOCAL, Role.SOURCE) or not role.sequence_dims:
            return False
    return True


def _touches_sequence(group: AliasGroup, analysis: SequenceAnalysis) -> bool:
    nodes = set(group.members)
    for write in group.writes:
        nodes.update(write.all_input_nodes)
    return any(analysis.dims_of(n) for n in nodes)


def unproven_writes(analysis: SequenceAnalysis, graph: fx.Graph,
                    groups: list[AliasGroup] | None = None) -> dict[fx.Node, str]:
    """Members of written alias groups the rules did not prove token-local, with the reason
    each is run on the full sequence. Members already forced are left out. ``groups``: the
    graph's :func:`alias_groups` (a fact of the graph alone, which the driver finds once)."""
    forced: dict[fx.Node, str] = {}
    order = {n: i for i, n in enumerate(graph.nodes)}
    for group in alias_groups(graph) if groups is None else groups:
        if not _touches_sequence(group, analysis) or _proven(group, analysis, order):
            continue
        write = group.writes[0]
        reason = (f"written in place ({op_name(write)} into a view of {group.base.name}) where the write's "
                  "source and target chunks are not proven to line up: the buffer runs on the full sequence")
        last_write = max(order[w] for w in group.writes)
        for member in group.members:
            if member.op in ("placeholder", "get_attr") or member in analysis.written_aliases:
                continue
            if order[member] > last_write:
                continue  # a view taken after the last write only reads the written buffer: its own rule
            forced[member] = reason
    return forced


@stage_rule(Stage.WRITTEN_ALIAS)
def written_alias_rule(node: fx.Node, analysis: AnalysisView) -> NodeRole:
    """A member of an unproven written group: sequence-mixing, gathered with its reason."""
    return mixing(analysis.written_aliases[node])


@rule(aten.fill_.Scalar, aten.fill_.Tensor, aten.zero_.default, aten.fill.Scalar, aten.fill.Tensor)
def fill_rule(node: fx.Node, analysis: AnalysisView) -> NodeRole:
    """Filling a value with a scalar keeps its layout (a tensor fill value must be a scalar)."""
    value = node.args[1] if len(node.args) > 1 else None
    if isinstance(value, fx.Node) and analysis.dims_of(value):
        return mixing("fills with a sequence-indexed value")
    source = node.args[0]
    dims = analysis.dims_of(source)
    if not dims:
        return NodeRole(Role.NONE)
    return NodeRole(Role.TOKEN_LOCAL, dims, (source,))
