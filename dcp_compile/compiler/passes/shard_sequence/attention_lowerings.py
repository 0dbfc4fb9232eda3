"""Attention under Ulysses' head all-to-all: SDPA becomes ``dcp::sharded_attention`` (lowered by
``insert_all_to_all``); a hand-written region runs its own ops on the rank's heads; replicated
queries over sharded keys/values are cut to the rank's heads and the output is gathered over heads.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx

from dcp_compile.compiler import ulysses
from dcp_compile.compiler.passes import sharded_attention_op  # noqa: F401  (registers dcp::sharded_attention)
from dcp_compile.compiler.passes.find_attention import sdpa_argument
from dcp_compile.compiler.passes.sequence_dims import Rewrite, Role
from dcp_compile.compiler.passes.shard_sequence.lowering_context import Lowered, LoweringContext, Site
from dcp_compile.compiler.passes.shard_sequence.lowerings import CannotShard, lowering
from dcp_compile.compiler.sequence_chunks import chunk_lengths


@lowering(Role.ATTENTION)
def lower_attention(context: LoweringContext) -> Lowered:
    """Attention under Ulysses: ``dcp::sharded_attention`` (lowered by insert_all_to_all), or a
    hand-written region lowered here."""
    n = context.node
    aligned = set(context.role.aligned_inputs)
    if n in context.analysis.regions:
        return context.lowered(region_attention(context, n, aligned), site=Site.SHARDED)
    query, key, value = n.args[:3]
    mask = sdpa_argument(n, "attn_mask")
    if context.length is None:
        raise CannotShard("attention before the sequence length is known")
    seq = context.seq_of(query)
    key_seq = context.seq_of(key) if key in aligned else seq
    segmented = seq if seq.joint else key_seq
    before, after = context.segments(segmented) if segmented.joint else (0, 0)
    return context.lowered(torch.ops.dcp.sharded_attention(
        context.chunk_of(query),
        context.chunk_of(key) if key in aligned else context.full_of(key, consumer=n),
        context.chunk_of(value) if value in aligned else context.full_of(value, consumer=n),
        context.full_of(mask, "the mask of an attention is read in full", consumer=n) if mask is not None else None,
        float(sdpa_argument(n, "dropout_p")),
        bool(sdpa_argument(n, "is_causal")),
        sdpa_argument(n, "scale"),
        bool(sdpa_argument(n, "enable_gqa")),
        context.length,
        key in aligned,
        value in aligned,
        seq.joint,
        key_seq.joint,
        before,
        after,
    ), site=Site.SHARDED)


@lowering(Rewrite.REPLICATED_QUERY_ATTENTION)
def lower_replicated_query_attention(context: LoweringContext) -> Lowered:
    """Replicated queries over sharded keys/values: the marker, flagged so the lowering cuts
    the queries to the rank's heads and gathers the output over heads."""
    n = context.node
    query, key, value = n.args[:3]
    mask = sdpa_argument(n, "attn_mask")
    if context.length is None:
        raise CannotShard("attention before the sequence length is known")
    return context.lowered(torch.ops.dcp.sharded_attention(
        context.full_of(query, consumer=n),
        context.chunk_of(key),
        context.chunk_of(value),
        context.full_of(mask, "the mask of an attention is read in full", consumer=n) if mask is not None else None,
        float(sdpa_argument(n, "dropout_p")),
        False,
        sdpa_argument(n, "scale"),
        bool(sdpa_argument(n, "enable_gqa")),
        context.length,
        True,
        True,
        False,
        False,
        0,
        0,
        query_replicated=True,
    ), site=Site.SHARDED, rewrite=REPLICATED_QUERIES)


REPLICATED_QUERIES = "replicated queries over the sharded keys/values (keys/values to heads, output gathered over heads)"


def region_attention(context: LoweringContext, n: fx.Node, aligned: set[fx.Node]) -> Any:
    """A hand-written attention region under Ulysses, lowered here: its ops are arbitrary
    head-local elementwise functions of the scores, which no marker op could carry. q, k, v
    go to the rank's heads, the region's ops run there on those heads (masks and per-head
    biases cut to the same heads), and the output comes back to the rank's chunk."""
    if context.length is None:
        raise CannotShard("attention before the sequence length is known")
    site = context.analysis.regions[n]
    query = context.chunk_of(site.query)
    lengths = chunk_lengths(context.length, context.sp_size)
    query_layout, kv_layout = region_layouts(context, site, query, aligned, n)
    query_heads = ulysses.sequence_to_heads(query, query_layout, lengths, context.group)
    out = region_on_heads(context, site, n, aligned, query_heads, query_layout, kv_layout, lengths)
    return ulysses.heads_to_sequence(out, query.shape[1], query.shape[2], lengths, context.group)


@lowering(Rewrite.REPLICATED_QUERY_REGION)
def lower_replicated_query_region(context: LoweringContext) -> Lowered:
    """A hand-written attention whose queries are another, replicated stream's over the
    sharded keys/values: as ``replicated_query_attention`` for SDPA, the queries are cut to
    the rank's heads and the output is gathered over heads."""
    n = context.node
    if context.length is None:
        raise CannotShard("attention before the sequence length is known")
    site = context.analysis.regions[n]
    aligned = {site.key, site.value}
    query = context.full_of(site.query, consumer=n)
    lengths = chunk_lengths(context.length, context.sp_size)
    query_layout, kv_layout = region_layouts(context, site, query, aligned, n)
    query_heads = ulysses.select_heads(query, query_layout.of_rank(context.rank), False)
    out = region_on_heads(context, site, n, aligned, query_heads, query_layout, kv_layout, lengths)
    return context.lowered(ulysses.gather_heads(out, query.shape[1], context.sp_size, context.group),
                            site=Site.SHARDED, rewrite=REPLICATED_QUERIES)


def region_layouts(context: LoweringContext, site: Any, query: torch.Tensor, aligned: set[fx.Node],
                   n: fx.Node) -> tuple[ulysses.HeadLayout, ulysses.HeadLayout]:
    query_layout, kv_layout, _ = ulysses.plan_heads(query.shape[1], full_or_chunk(context, site.key, aligned, n).shape[1],
                                                    context.sp_size, enable_gqa=False)
    return query_layout, kv_layout


def region_on_heads(context: LoweringContext, site: Any, n: fx.Node, aligned: set[fx.Node], query_heads: torch.Tensor,
                    query_layout: ulysses.HeadLayout, kv_layout: ulysses.HeadLayout, lengths: list) -> torch.Tensor:
    """The region's ops on the rank's heads: keys/values from the all-to-all (or cut to the
    heads when every rank has them whole), masks and biases cut to the same heads."""

    def to_heads(node: fx.Node, layout: ulysses.HeadLayout) -> torch.Tensor:
        if node in aligned:
            return ulysses.sequence_to_heads(context.chunk_of(node), layout, lengths, context.group)
        full = context.full_of(node, "the keys/values of an attention are read in full", consumer=n)
        return ulysses.select_heads(full, layout.of_rank(context.rank), False)

    env = {site.query: query_heads, site.key: to_heads(site.key, kv_layout), site.value: to_heads(site.value, kv_layout)}

    def region_value(member: fx.Node, argument: Any) -> Any:
        if argument in env:
            return env[argument]
        full = context.full_of(argument, "a mask or bias of an attention is read in full", consumer=member)
        if isinstance(full, torch.Tensor) and full.dim() >= 3:
            return ulysses.heads_of_rank(full, query_layout, context.rank, full.dim() - 3)
        return full

    for member in site.region.nodes:
        args = fx.map_arg(member.args, lambda a: region_value(member, a))
        kwargs = fx.map_arg(member.kwargs, lambda a: region_value(member, a))
        env[member] = context.run_op(member.op, member.target, args, kwargs)
    return env[n]


def full_or_chunk(context: LoweringContext, node: fx.Node, aligned: set[fx.Node], consumer: fx.Node) -> torch.Tensor:
    return context.chunk_of(node) if node in aligned else context.full_of(node, consumer=consumer)
