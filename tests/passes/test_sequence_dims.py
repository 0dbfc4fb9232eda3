"""sequence_dims_pass on a tiny language model: the role of each op, read off the analysis."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from pass_helpers import SDPA, analyse

from dcp_compile.compiler.passes.sequence_dims import Rewrite, Role, expression

aten = torch.ops.aten


class TinyLM(nn.Module):
    def __init__(self, vocab: int = 32, hidden: int = 16, heads: int = 2):
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.norm = nn.LayerNorm(hidden)
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.head = nn.Linear(hidden, vocab)
        self.heads = heads

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        batch, length = ids.shape
        x = self.norm(self.embed(ids)) + torch.arange(length, device=ids.device)[:, None] * 0.01
        q, k, v = self.qkv(x).view(batch, length, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        x = x + F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(batch, length, -1)
        x = x.cumsum(1) + x.cumsum(-1)  # over the sequence (mixing), over features (token-local)
        logits = self.head(x)
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), labels.reshape(-1))


@pytest.fixture(scope="module")
def analysed():
    torch.manual_seed(0)
    gm, analysis = analyse(TinyLM(), torch.randint(0, 32, (2, 12)), torch.randint(0, 32, (2, 12)))
    return gm, analysis.sequence


def nodes(gm, target):
    return [node for node in gm.graph.nodes if node.op == "call_function" and node.target == target]


def test_sequence_length_is_the_inputs_symbolic_length(analysed):
    gm, sequence = analysed
    tokens = [p for p in gm.graph.find_nodes(op="placeholder")
              if isinstance(p.meta["val"], torch.Tensor) and p.meta["val"].dtype == torch.int64]
    assert len(tokens) == 2  # ids and labels, [B, S]
    for placeholder in tokens:
        assert sequence.length == expression(placeholder.meta["val"].shape[1])
        assert sequence.roles[placeholder].role == Role.SOURCE
        assert [d.dim for d in sequence.roles[placeholder].sequence_dims] == [1]


def test_linear_and_norm_are_token_local(analysed):
    gm, sequence = analysed
    (norm,) = nodes(gm, aten.layer_norm.default)
    qkv = nodes(gm, aten.linear.default)[0]
    for node in (norm, qkv):
        role = sequence.roles[node]
        assert role.role == Role.TOKEN_LOCAL, (node, role)
        assert [d.dim for d in role.sequence_dims] == [1] and role.sequence_dims[0].plain


def test_sdpa_is_attention(analysed):
    gm, sequence = analysed
    (sdpa,) = nodes(gm, SDPA)
    role = sequence.roles[sdpa]
    assert role.role == Role.ATTENTION
    assert [d.dim for d in role.sequence_dims] == [2]  # [B, H, S, D]


def test_cumsum_over_the_sequence_is_sequence_mixing_with_its_reason(analysed):
    gm, sequence = analysed
    over_sequence, over_features = sorted(nodes(gm, aten.cumsum.default), key=lambda n: n.args[1] % 3)
    assert over_sequence.args[1] % 3 == 1
    role = sequence.roles[over_sequence]
    assert role.role == Role.MIXING
    assert role.reason == "cumsum along the sequence dimension"
    assert role.rewrite is None  # no shard-local rewrite: it is gathered
    assert sequence.roles[over_features].role == Role.TOKEN_LOCAL


def test_arange_over_the_length_is_a_source(analysed):
    gm, sequence = analysed
    (arange,) = nodes(gm, aten.arange.default)
    role = sequence.roles[arange]
    assert role.role == Role.SOURCE
    assert "creates the sequence dimension" in role.reason


def test_flattened_tokens_are_a_sequence_dim_with_the_batch_as_outer(analysed):
    gm, sequence = analysed
    (loss,) = nodes(gm, aten.cross_entropy_loss.default)
    logits, targets = loss.args[:2]
    batch = expression(logits.meta["val"].shape[0]) / sequence.length
    for flat in (logits, targets):  # [B*S, V] logits, [B*S] labels
        role = sequence.roles[flat]
        assert role.role == Role.TOKEN_LOCAL
        (dim,) = role.sequence_dims
        assert dim.dim == 0 and dim.inner == 1
        assert dim.outer != 1 and dim.outer == batch  # the symbolic batch, rows in batch-major order
    # The loss reduces over the sequence: mixing, with the shard-local rewrite named.
    assert sequence.roles[loss].role == Role.MIXING and sequence.roles[loss].rewrite is Rewrite.LOSS_OVER_SEQUENCE
