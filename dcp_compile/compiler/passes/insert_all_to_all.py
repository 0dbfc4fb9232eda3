"""Lower ``dcp::sharded_attention`` to Ulysses: all-to-all, full-sequence attention, all-to-all.

Four all-to-alls per self-attention (q, k, v, output); cross-attention keys/values come from a
full context every rank already has, so each rank just takes its heads: two all-to-alls. The
layouts and their laws live in ``dcp_compile.compiler.ulysses``.
"""

from __future__ import annotations

import inspect
import logging
from typing import Any

import torch
import torch.fx as fx

from dcp_compile.compiler.graph_capture import splice_traced
from dcp_compile.compiler.passes import sharded_attention_op  # noqa: F401
from dcp_compile.compiler.passes.context import PassContext
from dcp_compile.compiler.ulysses import plan_site, ulysses_attention

log = logging.getLogger(__name__)
SHARDED_ATTENTION = torch.ops.dcp.sharded_attention.default


_MARKER_PARAMETERS = list(inspect.signature(sharded_attention_op.sharded_attention._init_fn).parameters)


def _marker_arguments(node: fx.Node) -> list[Any]:
    """The marker's arguments in schema order, whether given by position or keyword."""
    values = list(node.args) + [None] * (len(_MARKER_PARAMETERS) - len(node.args))
    for name, value in node.kwargs.items():
        values[_MARKER_PARAMETERS.index(name)] = value
    return values


def _lower_marker(gm: fx.GraphModule, marker: fx.Node, ctx: PassContext) -> None:
    """Replace one marker by its Ulysses lowering, traced on the marker's own inputs."""
    values = _marker_arguments(marker)
    graph_positions = [i for i, value in enumerate(values) if isinstance(value, fx.Node)]

    def lower(*graph_values: Any) -> torch.Tensor:
        arguments = list(values)
        for position, value in zip(graph_positions, graph_values):
            arguments[position] = value
        return ulysses_attention(*arguments, sp_size=ctx.sp_size, rank=ctx.rank, group=ctx.group_name,
                                 packed=ctx.packed)

    splice_traced(gm, marker, lower, [values[i] for i in graph_positions], ctx.fake_mode)
    _record_layout(marker.name, values, ctx)


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
    for marker in markers:
        _lower_marker(gm, marker, ctx)
    gm.graph.eliminate_dead_code()
    gm.recompile()
    log.info("dcp: Ulysses all-to-all around %d attention site(s)", len(markers))
    return gm
