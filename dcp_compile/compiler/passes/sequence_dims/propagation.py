"""The propagation driver: the attention length, then every node's role in topological order.

The sequence length is read off the attention sites (the queries' length dimension), as a
symbolic expression: ``s0`` for text, ``(H//2)*(W//2)`` for an image model that forms its tokens
in the graph. A dimension of a value is a sequence dimension when its size is that expression,
or a product that contains it after a flatten (``[B*S, V]`` logits before the loss): such a
dimension is recorded as ``outer * L * inner`` in row-major order, which is all a shard or a
gather needs to address the right rows.

The FX graph becomes a networkx DiGraph; each node's role comes from ``registry.classify`` (the
rules' precedence chain) once its inputs have theirs.
"""

from __future__ import annotations

import logging
from typing import Any

import networkx as nx
import sympy
import torch
import torch.fx as fx

from dcp_compile.compiler.passes.context import PassContext
from dcp_compile.compiler.passes.find_attention import AttentionSite
from dcp_compile.compiler.passes.sequence_dims.model import (
    INHERIT, Decompositions, Findings, NodeRole, Refusal, RefusalKind, Role, SequenceAnalysis, TokenOrder,
    fx_to_networkx,
)
from dcp_compile.compiler.passes.sequence_dims.registry import classify, mixing, record_findings
from dcp_compile.compiler.passes.sequence_dims.symbolic import (
    equal, expression, is_empty, normalize, size_hint, traced_size, value_of,
)
from dcp_compile.compiler.passes.sequence_dims.inplace_writes import alias_groups, unproven_writes
from dcp_compile.compiler.passes.sequence_dims.token_hints import token_dims_from_attention

aten = torch.ops.aten
log = logging.getLogger(__name__)


def sequence_length_of(sites: list[AttentionSite]) -> Any:
    """The attention length expression shared by the self-attention sites (most common wins)."""
    # A single query (a pooling attention: one learned or mean token attending over the text) has
    # no sequence of its own to shard: length 1 would make every size-1 dimension a "sequence".
    sites = [site for site in sites if not equal(expression(value_of(site.query).shape[-2]), 1)]
    counts: dict[Any, int] = {}
    traced: dict[Any, int] = {}
    for site in sites:
        query, key = value_of(site.query), value_of(site.key)
        length = expression(query.shape[-2])
        if equal(length, expression(key.shape[-2])):
            counts[length] = counts.get(length, 0) + 1
            traced[length] = traced_size(query.shape[-2])
    if not counts:
        for site in sites:
            length = expression(value_of(site.query).shape[-2])
            counts[length] = counts.get(length, 0) + 1
            traced[length] = traced_size(value_of(site.query).shape[-2])
    if not counts:
        return None
    # Most sites first; on a tie (a video model alternating spatial and temporal attention) the
    # longer length: sharding the spatial tokens leaves temporal attention rank-local, and a long
    # dimension splits evenly over more ranks. Two streams of one symbol each (LTX-2's video and
    # audio self-attentions) are told apart by the sizes they were traced at, not by graph order.
    return max(counts, key=lambda length: (counts[length], size_hint(length), traced[length]))


def long_segment_of(graph: fx.Graph, length: Any) -> Any:
    """The length to shard when attention runs over a concatenation of token streams.

    Joint attention (SD3, Flux, HunyuanVideo) attends over ``text + image`` tokens. Sharding the
    concatenation would gather at every split back into the two streams; sharding only the long
    stream keeps both streams' token-local work sharded (image) or replicated (text) and passes the
    text through the head all-to-all whole. The long stream is the operand of a concatenation
    that forms ``length`` whose size is largest (a product of symbols beats a single symbol,
    then the traced sizes decide). A single prepended token (a CLS token) is not a stream.
    """
    if length is None or not isinstance(length, sympy.Add):
        return length
    for node in graph.find_nodes(op="call_function", target=aten.cat.default):
        value = value_of(node)
        if not isinstance(value, torch.Tensor):
            continue
        dim = normalize(node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0), value.dim())
        if not equal(expression(value.shape[dim]), length):
            continue
        parts = [value_of(t).shape[dim] for t in node.args[0] if isinstance(t, fx.Node) and not is_empty(t, dim)]
        if len(parts) < 2:
            continue
        longest = max(parts, key=lambda size: (size_hint(expression(size)), traced_size(size)))
        others = [size for size in parts if size is not longest]
        if not expression(longest).free_symbols or all(equal(expression(size), 1) for size in others):
            continue
        return expression(longest)
    return length


def analyze_sequence_dims(gm: fx.GraphModule, sites: list[AttentionSite],
                          parameter_indices: frozenset[int] = frozenset()) -> SequenceAnalysis:
    """Every node's role, in attempts: each attempt classifies the graph under what earlier ones
    refused, and the loop ends at the first attempt that refuses nothing new.

    An attempt stops at a :class:`Refusal`: a grid region found to read a sequence-indexed value
    from outside once the propagation reaches that member (its entry gathers next time), or a
    local token sort whose counts or order are read beyond its dispatch (it sorts the gathered
    tokens next time). A finished attempt may still leave buffers written in place that the rules
    did not prove chunk-aligned: their members are forced onto the full sequence (see
    inplace_writes) and the next attempt runs with them.
    """
    length = long_segment_of(gm.graph, sequence_length_of(sites))
    placeholders = list(gm.graph.find_nodes(op="placeholder"))
    parameters = frozenset(placeholders[i] for i in parameter_indices if i < len(placeholders))
    graph = fx_to_networkx(gm.graph)
    refused: dict[RefusalKind, dict[fx.Node, str]] = {kind: {} for kind in RefusalKind}
    written: dict[fx.Node, str] = {}
    decompositions = Decompositions()  # what each decomposition proves does not change between attempts
    groups = alias_groups(gm.graph)  # buffers written in place: a fact of the graph alone
    while True:
        analysis = SequenceAnalysis(length=length, graph=graph, parameters=parameters,
                                    refused_grids=dict(refused[RefusalKind.GRID]), written_aliases=dict(written),
                                    refused_dispatches=dict(refused[RefusalKind.DISPATCH]),
                                    decompositions=decompositions)
        refusal = attempt(sites, analysis)
        if refusal is not None:
            refused[refusal.kind][refusal.node] = refusal.reason
            log.info("dcp: %s %s: %s", refusal.node.name, refusal.kind.consequence, refusal.reason)
            continue
        forced = unproven_writes(analysis, gm.graph, groups) if analysis.length is not None else {}
        if not forced:
            return analysis
        written.update(forced)
        log.info("dcp: %d values written in place run on the full sequence", len(forced))



def attempt(sites: list[AttentionSite], analysis: SequenceAnalysis) -> Refusal | None:
    """Every node's role, in topological order, recorded on ``analysis``; or the refusal that
    stopped the attempt at the node that found it (the roles after it are not classified)."""
    length = analysis.length
    if length is not None and not length.free_symbols:
        analysis.token_dims = token_dims_from_attention(sites, length)
    for site in sites:
        if site.region is not None:
            analysis.regions[site.node] = site
            analysis.region_members.update((member, site) for member in site.region.nodes[:-1])
    if length is None:
        return None
    for node in nx.topological_sort(analysis.graph):
        refusal = propagate_node(node, analysis).findings.refusal
        if refusal is not None:
            return refusal
    return None


def propagate(sites: list[AttentionSite], analysis: SequenceAnalysis) -> SequenceAnalysis:
    """One attempt (see :func:`attempt`), for a test that wants the analysis: a refusal raises
    (``GridRegionRefused`` / ``DispatchRefused``). The driver loops over attempts instead."""
    refusal = attempt(sites, analysis)
    if refusal is not None:
        raise refusal.error()
    return analysis


def propagate_node(node: fx.Node, analysis: SequenceAnalysis) -> NodeRole:
    """Classify one node whose inputs have their roles, and record its role and what its rules
    found (broadcast partners, positions, a grid region). A role whose findings hold a refusal is
    returned unrecorded: the attempt stops there."""
    result = classify(node, analysis)
    refusal = result.findings.refusal or local_dispatch_refusal(node, result, analysis)
    if refusal is not None:
        return NodeRole(result.role, result.sequence_dims, result.aligned_inputs, result.reason, result.rewrite,
                        findings=Findings(refusal=refusal))
    record_findings(node, result, analysis)
    order = token_order(result, analysis)
    if order is INHERIT:
        result = mixing("combines token rows kept in different orders")
        order = None
    role = NodeRole(result.role, result.sequence_dims, result.aligned_inputs, result.reason, result.rewrite,
                    result.element_dims, order)
    analysis.roles[node] = role
    return role


CAPACITY_REASON = ("a local token sort's counts or order are read beyond its dispatch (a capacity limit, a place "
                   "in an expert's group): which tokens drop depends on the whole sequence, so the dispatch "
                   "runs on the gathered tokens")


def local_dispatch_refusal(node: fx.Node, result: NodeRole, analysis: SequenceAnalysis) -> Refusal | None:
    """A dispatch on the rank's own tokens (a local sort, see ``token_sets``) is exact only while
    its values stay inside it. Token-set values (per-expert counts of the rank's rows) are exact
    only as group sizes of those rows (a grouped matmul's offsets, which its rule aligns): read any
    other way next to the tokens (``starts[expert_of_row]``, compared with a capacity) they would
    stand in for the whole sequence's counts. A value in the sort's order read across tokens (a
    ``cumsum`` of sorted one-hots for places in the experts' groups) would need a gather, which
    would interleave the ranks' orders. Either way the sort is refused and the next attempt runs
    it on the gathered tokens."""
    if result.role is Role.TOKEN_SET or node.op != "call_function":
        return None
    for source in node.all_input_nodes:
        role = analysis.roles.get(source)
        if role is None:
            continue
        if role.role is Role.TOKEN_SET and source not in result.aligned_inputs:
            sort = sort_behind(source, analysis)
        elif result.role is Role.MIXING and not result.rewrite and isinstance(role.token_order, fx.Node):
            sort = role.token_order
        else:
            continue
        if sort is not None and sort not in analysis.refused_dispatches:
            return Refusal(RefusalKind.DISPATCH, sort, CAPACITY_REASON)
    return None


def sort_behind(node: fx.Node, analysis: SequenceAnalysis) -> fx.Node | None:
    """The local sort a token-set value was counted from."""
    stack, seen = [node], set()
    while stack:
        current = stack.pop()
        if current in seen:
            continue
        seen.add(current)
        role = analysis.roles.get(current)
        if role is None:
            continue
        if isinstance(role.token_order, fx.Node):
            return role.token_order
        stack.extend(role.aligned_inputs)
    return None


def token_order(result: NodeRole, analysis: SequenceAnalysis) -> TokenOrder:
    """The order of the result's token rows: set by the permutation rules, else the one order its
    aligned inputs share (INHERIT when they disagree: combining two orders would pair wrong rows)."""
    if result.token_order is not INHERIT:
        return result.token_order
    if result.role not in (Role.TOKEN_LOCAL, Role.TOKEN_SET, Role.ATTENTION) and not result.rewrite:
        return None
    orders = {analysis.roles[n].token_order for n in result.aligned_inputs if n in analysis.roles}
    if len(orders) > 1:
        return INHERIT
    return next(iter(orders), None)


def sequence_dims_pass(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    """Analysis only: classify every node; the graph is returned unchanged."""
    analysis = analyze_sequence_dims(gm, ctx.analysis.attention_sites, ctx.analysis.parameter_indices)
    ctx.analysis.sequence = analysis
    if analysis.length is not None:
        if not analysis.length.free_symbols:
            log.warning(
                "dcp: the attention length is the constant %s in this graph (compiled without "
                "dynamic=True?); sizes equal to it are taken for the sequence dimension",
                analysis.length,
            )
        counts: dict[str, int] = {}
        for role in analysis.roles.values():
            counts[role.role.value] = counts.get(role.role.value, 0) + 1
        log.info("dcp: sequence length %s; roles %s", analysis.length, counts)
    return gm
