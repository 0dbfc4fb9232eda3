"""Lower ``dcp::sharded_attention`` to Ulysses: all-to-all, full-sequence attention, all-to-all.

Four all-to-alls per self-attention (q, k, v, output); cross-attention keys/values come from a
full context every rank already has, so each rank just takes its heads: two all-to-alls. The
layouts and their laws live in ``dcp_compile.compiler.ulysses``.
"""

from __future__ import annotations

import inspect
import logging
from typing import Any, Hashable

import torch
import torch.fx as fx

from dcp_compile.compiler.graph_capture import copy_traced, retrace, site_meta
from dcp_compile.compiler.passes import sharded_attention_op  # noqa: F401
from dcp_compile.compiler.passes.context import PassContext
from dcp_compile.compiler.ulysses import plan_site, ulysses_attention

log = logging.getLogger(__name__)
SHARDED_ATTENTION = torch.ops.dcp.sharded_attention.default
# Node meta naming the site whose lowering (layouts, all-to-alls, attention) a node belongs to:
# regional compilation runs a lowering as it is and compiles only what lies between lowerings.
LOWERED_SITE = "dcp_lowered_site"


_MARKER_PARAMETERS = list(inspect.signature(sharded_attention_op.sharded_attention._init_fn).parameters)


def _marker_arguments(node: fx.Node) -> list[Any]:
    """The marker's arguments in schema order, whether given by position or keyword."""
    values = list(node.args) + [None] * (len(_MARKER_PARAMETERS) - len(node.args))
    for name, value in node.kwargs.items():
        values[_MARKER_PARAMETERS.index(name)] = value
    return values


def _lower_marker(gm: fx.GraphModule, marker: fx.Node, ctx: PassContext,
                  traced: dict[Hashable, fx.GraphModule]) -> None:
    """Replace one marker by its Ulysses lowering, traced on the marker's own inputs, or copied
    from an earlier site of the same signature (``traced``)."""
    values = _marker_arguments(marker)
    graph_positions = [i for i, value in enumerate(values) if isinstance(value, fx.Node)]
    inputs = [values[i] for i in graph_positions]

    def lower(*graph_values: Any) -> torch.Tensor:
        arguments = list(values)
        for position, value in zip(graph_positions, graph_values):
            arguments[position] = value
        return ulysses_attention(*arguments, sp_size=ctx.sp_size, rank=ctx.rank, group=ctx.group_name,
                                 packed=ctx.packed)

    signature = site_signature(values)
    subgraph = traced.get(signature) if signature is not None else None
    if subgraph is None:
        subgraph = retrace(lower, [node.meta["val"] for node in inputs], ctx.fake_mode)
        if signature is not None:
            traced[signature] = subgraph
    previous = marker.prev
    result = copy_traced(gm, marker, subgraph, inputs, prefix=f"_dcp_{marker.name}", stamp=site_meta(marker))
    node = previous.next
    while node is not marker:  # the copy sits right before the marker
        node.meta[LOWERED_SITE] = marker.name
        node = node.next
    marker.replace_all_uses_with(result)
    gm.graph.erase_node(marker)
    _record_layout(marker.name, values, ctx)


def _meta_signature(value: Any) -> Hashable:
    """What a trace reads of one graph input: its sizes, strides, offset, dtype, device (symbolic
    sizes by their expressions), or the value of a symbolic integer."""
    def expression(size: Any) -> Hashable:
        return size.node.expr if isinstance(size, torch.SymInt) else size

    if isinstance(value, torch.Tensor):
        return ("tensor", tuple(map(expression, value.shape)), tuple(map(expression, value.stride())),
                expression(value.storage_offset()), value.dtype, value.device, value.requires_grad)
    if isinstance(value, (torch.SymInt, int)):
        return ("int", expression(value))
    raise TypeError(type(value).__name__)


def site_signature(values: list[Any]) -> Hashable | None:
    """A key under which two sites' Ulysses lowerings are the same graph of their inputs: the
    constant arguments, each graph input's metadata, and which inputs are the same node. None
    (trace the site on its own) where an argument is of a kind not compared here."""
    nodes = [value for value in values if isinstance(value, fx.Node)]
    try:
        parts = []
        for value in values:
            if isinstance(value, fx.Node):
                parts.append(("node", nodes.index(value), _meta_signature(value.meta.get("val"))))
            elif value is None or isinstance(value, (bool, int, float, str)):
                parts.append(("constant", type(value).__name__, value))
            else:
                return None
        identities = [id(node.meta.get("val")) for node in nodes]
        parts.append(tuple(identities.index(identity) for identity in identities))
        signature = tuple(parts)
        hash(signature)
    except TypeError:
        return None
    return signature


def _record_layout(site: str, values: list[Any], ctx: PassContext) -> None:
    """Name the site's layout on the variant record (Ulysses, ring, or ring x Ulysses)."""
    if ctx.variant_record is None:
        return
    query, key = (value.meta["val"] if isinstance(value, fx.Node) else value for value in values[:2])
    if query.dim() == 3:  # [N, S, D]: N is the head dimension, as ulysses_attention reads it
        query, key = query.unsqueeze(0), key.unsqueeze(0)
    plan = plan_site(query, key, values[4], *values[9:13], bool(values[15]), ctx.sp_size, ctx.packed)
    ctx.variant_record.attention_layouts.append((site, plan.describe(), plan.padded_head_slots))


def insert_all_to_all_pass(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    markers = list(gm.graph.find_nodes(op="call_function", target=SHARDED_ATTENTION))
    if not markers:
        return gm
    traced: dict[Hashable, fx.GraphModule] = {}  # attention layers alike: one trace for all (the pass's cost)
    for marker in markers:
        _lower_marker(gm, marker, ctx, traced)
    gm.graph.eliminate_dead_code()
    gm.recompile()
    log.info("dcp: Ulysses all-to-all around %d attention site(s)", len(markers))
    return gm
