"""``dcp::sharded_attention``: the marker the sharding pass leaves where attention goes.

After ``shard_sequence`` every attention's queries (and its keys/values, for self-attention) are
the rank's sequence chunk; attention itself cannot run on a chunk. The pass therefore writes this
op, which carries everything ``insert_all_to_all`` needs (the full sequence length as a SymInt,
which operands are chunks, and for joint attention the replicated text segments around the
chunk, or that the queries are a replicated stream's), and that pass replaces it. Its eager implementation refuses to run:
a graph that still holds it was not finished.
"""

from __future__ import annotations

from typing import Optional

import torch


@torch.library.custom_op("dcp::sharded_attention", mutates_args=())
def sharded_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: Optional[torch.Tensor],
    dropout_p: float,
    is_causal: bool,
    scale: Optional[float],
    enable_gqa: bool,
    full_length: int,
    key_is_chunk: bool,
    value_is_chunk: bool,
    query_joint: bool,
    key_joint: bool,
    before: int,
    after: int,
    query_replicated: bool = False,
) -> torch.Tensor:
    raise RuntimeError(
        "dcp::sharded_attention is a marker for the insert_all_to_all pass and cannot run; "
        "the pass pipeline was cut short (check DCP's disabled passes)"
    )


@sharded_attention.register_fake
def _(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, full_length,
      key_is_chunk, value_is_chunk, query_joint, key_joint, before, after, query_replicated=False):
    return query.new_empty((*query.shape[:-1], value.shape[-1]))
