"""Attention rules, called directly on SDPA nodes of tiny traced graphs."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from rule_helpers import analysed, node, size, trace

from dcp_compile.compiler.passes.sequence_dims import Rewrite, Role, SequenceDim
from dcp_compile.compiler.passes.sequence_dims.attention_rules import attention_rule

SDPA = torch.ops.aten.scaled_dot_product_attention.default


def heads(x: torch.Tensor) -> torch.Tensor:
    return x.unflatten(-1, (2, -1)).transpose(1, 2)  # [B, S, D] -> [B, H, S, D/H]


def test_queries_indexed_by_the_sequence_at_dim_minus_two_are_attention():
    gm = trace(lambda x: F.scaled_dot_product_attention(heads(x), heads(x), heads(x)), torch.randn(2, 7, 8))
    sdpa = node(gm, SDPA)
    role = attention_rule(sdpa, analysed(gm, size(gm, 0, 1)))
    assert role.role is Role.ATTENTION
    assert role.sequence_dims == (SequenceDim(2),)
    assert set(role.aligned_inputs) == set(sdpa.args[:3])


def test_tokens_in_the_batch_dimension_attend_rank_locally():
    """Temporal attention over each spatial token's frames: the tokens are the batch here."""
    def temporal(x):  # x: [S, F, D], frames F attend to each other per token
        q = x.unflatten(-1, (2, -1)).transpose(1, 2)  # [S, H, F, D/H]
        return F.scaled_dot_product_attention(q, q, q)

    gm = trace(temporal, torch.randn(7, 3, 8))
    role = attention_rule(node(gm, SDPA), analysed(gm, size(gm, 0, 0)))
    assert role.role is Role.TOKEN_LOCAL and role.sequence_dims == (SequenceDim(0),)
    assert "rank-local" in role.reason


def test_replicated_queries_over_sharded_keys_are_a_rewrite():
    gm = trace(lambda x, audio: F.scaled_dot_product_attention(heads(audio), heads(x), heads(x)),
               torch.randn(2, 7, 8), torch.randn(2, 5, 8))
    sdpa = node(gm, SDPA)
    role = attention_rule(sdpa, analysed(gm, size(gm, 0, 1)))
    assert role.role is Role.MIXING and role.rewrite is Rewrite.REPLICATED_QUERY_ATTENTION
    assert role.aligned_inputs == tuple(sdpa.args[1:3])


def test_attention_over_another_sequence_mixes_none_of_ours():
    gm = trace(lambda x, text: (x, F.scaled_dot_product_attention(heads(text), heads(text), heads(text))),
               torch.randn(2, 7, 8), torch.randn(2, 5, 8))
    assert attention_rule(node(gm, SDPA), analysed(gm, size(gm, 0, 1))).role is Role.NONE
