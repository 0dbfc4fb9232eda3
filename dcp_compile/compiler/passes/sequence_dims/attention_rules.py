"""Attention: the sites Ulysses shards, and the attention forms that need no all-to-all.

Queries sequence-indexed at dim -2 are attention (the head all-to-all runs around it); queries
whose batch or head dimension holds the tokens attend rank-locally; replicated queries of another
stream over the sharded keys/values are a rewrite (keys/values to heads, output gathered over heads).
"""

from __future__ import annotations

import torch.fx as fx

from dcp_compile.compiler.passes.find_attention import SDPA, sdpa_argument
from dcp_compile.compiler.passes.sequence_dims.model import AnalysisView, NodeRole, Rewrite, Role, SequenceDim
from dcp_compile.compiler.passes.sequence_dims.registry import (
    Stage, mixing, rule, sequence_inputs, single, stage_rule,
)
from dcp_compile.compiler.passes.sequence_dims.symbolic import equal, shape_of, value_of


@rule(SDPA)
def attention_rule(node: fx.Node, analysis: AnalysisView) -> NodeRole:
    if not sequence_inputs(node, analysis):
        return NodeRole(Role.NONE)  # over another sequence (an audio stream, text): it mixes no token of ours
    query, key, value = node.args[:3]
    rank = value_of(query).dim()
    seq = single(analysis.dims_of(query))
    if seq is not None and seq.dim < rank - 2:
        return rank_local_attention(node, analysis, seq)
    if not analysis.dims_of(query):
        replicated = replicated_query_attention(node, analysis)
        if replicated is not None:
            return replicated
    if seq is None or seq.dim != rank - 2 or not seq.unflattened:
        return mixing("attention whose queries are not sequence-indexed on dim -2")
    aligned = [query]
    kv_layouts = set()
    for other in (key, value):
        other_seq = single(analysis.dims_of(other))
        if other_seq is not None and other_seq.dim == rank - 2 and other_seq.unflattened:
            kv_layouts.add(other_seq)
            aligned.append(other)
        elif seq.joint:
            return mixing("joint attention over keys/values that are not the same joint sequence")
    # Queries and keys/values share one layout, or image queries attend over joint keys/values
    # (text keys prepended, PRX): the segments are the keys'.
    if len(kv_layouts) > 1 or (seq.joint and kv_layouts != {seq}):
        return mixing("joint attention whose queries and keys/values are segmented differently")
    return NodeRole(Role.ATTENTION, (seq,), tuple(aligned))


def replicated_query_attention(node: fx.Node, analysis: AnalysisView) -> NodeRole | None:
    """Queries of another, replicated stream (LTX-2's audio tokens) attending over the sharded
    tokens: the keys and values go to the rank's heads through the usual all-to-all, the
    queries are cut to the same heads locally, and the output, whole over its own (short)
    sequence, is gathered over heads. The alternative, gathering the keys and values, moves
    ``sp_size`` times the bytes of the all-to-all."""
    query, key, value = node.args[:3]
    seq = shared_sequence_dim(key, value, analysis)
    if seq is None or seq.dim != value_of(query).dim() - 2 or not seq.plain or bool(sdpa_argument(node, "is_causal")):
        return None
    return mixing("attention from replicated queries over the sharded keys/values",
                  rewrite=Rewrite.REPLICATED_QUERY_ATTENTION, aligned=(key, value))


def shared_sequence_dim(key: fx.Node, value: fx.Node, analysis: AnalysisView) -> SequenceDim | None:
    """The one sequence dimension keys and values share, if they do."""
    dims = {single(analysis.dims_of(other)) for other in (key, value)}
    return dims.pop() if len(dims) == 1 else None


def rank_local_attention(node: fx.Node, analysis: AnalysisView, seq: SequenceDim) -> NodeRole:
    """Attention whose batch (or head) dimension holds the sharded tokens: temporal attention over
    the frames of each spatial position when a video model's spatial tokens are sharded. Every
    rank attends over its own positions' frames: it runs on the chunk with no collective at all."""
    query, key, value = node.args[:3]
    for other in (key, value):
        if single(analysis.dims_of(other)) != seq:
            return mixing("attention over a batch dimension that holds the sequence, with keys or values "
                          "laid out otherwise")
    aligned = [query, key, value]
    mask = node.args[3] if len(node.args) > 3 else node.kwargs.get("attn_mask")
    if isinstance(mask, fx.Node):
        if analysis.dims_of(mask):
            if single(analysis.dims_of(mask)) != seq.moved(seq.dim + value_of(mask).dim() - value_of(query).dim()):
                return mixing("attention whose mask is sequence-indexed differently")
            aligned.append(mask)
        else:
            position = seq.dim + value_of(mask).dim() - value_of(query).dim()
            if position >= 0 and not equal(shape_of(value_of(mask))[position], 1):
                return mixing("attention whose mask spans the sharded tokens without saying so")
    return NodeRole(Role.TOKEN_LOCAL, (seq,), tuple(aligned), reason="rank-local attention (over an unsharded dimension)")


@stage_rule(Stage.ATTENTION_REGION)
def region_rule(node: fx.Node, analysis: AnalysisView) -> NodeRole:
    """The output of a hand-written attention region: attention over q, k, v like SDPA's."""
    site = analysis.regions[node]
    seq = single(analysis.dims_of(site.query))
    if not analysis.dims_of(site.query):
        kv_seq = shared_sequence_dim(site.key, site.value, analysis)
        if kv_seq is not None and kv_seq.dim == 2 and kv_seq.plain:
            # Replicated queries over the sharded keys/values (see replicated_query_attention).
            return mixing("attention from replicated queries over the sharded keys/values",
                          rewrite=Rewrite.REPLICATED_QUERY_REGION, aligned=(site.key, site.value))
    if seq is None or seq.dim != 2 or not seq.plain:
        return mixing("attention whose queries are not sequence-indexed on dim -2")
    aligned = [site.query]
    for other in (site.key, site.value):
        other_seq = single(analysis.dims_of(other))
        if other_seq is not None and other_seq.dim == 2 and other_seq.plain:
            aligned.append(other)
    return NodeRole(Role.ATTENTION, (SequenceDim(2),), tuple(aligned))
