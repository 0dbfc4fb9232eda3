"""Ops with no rule of their own, read through their decomposition (one rule for every op torch can
decompose), and the reason every gathered op carries."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from rule_helpers import analysed, node, size, trace

from dcp_compile.compiler.passes.sequence_dims import Role, SequenceDim
from dcp_compile.compiler.passes.sequence_dims.indexing_rules import TABLE_GATHERED
from dcp_compile.compiler.passes.sequence_dims.reduction_rules import reduction_rule
from dcp_compile.compiler.passes.shard_sequence.lowerings import GatherRecord

aten = torch.ops.aten

# (function of x, x's shape, the sequence dimension of x, the op's node, its output's sequence dimension)
TOKEN_LOCAL = {
    "rsub": (lambda x: torch.rsub(x, x * 2), (7, 5), 0, aten.rsub.Tensor, 0),
    "isclose": (lambda x: torch.isclose(x, x * 2), (7, 5), 0, aten.isclose.default, 0),
    "prelu": (lambda x: F.prelu(x, torch.ones(5)), (7, 5), 0, aten.prelu.default, 0),
    "logsigmoid": (lambda x: F.logsigmoid(x), (7, 5), 0, aten.log_sigmoid.default, 0),
    "hardswish": (lambda x: F.hardswish(x), (7, 5), 0, aten.hardswish.default, 0),
    "cosine over features": (lambda x: F.cosine_similarity(x, x + 1, dim=1), (7, 5), 0,
                             aten.cosine_similarity.default, 0),
    "tril of matrices indexed by the sequence": (lambda x: torch.tril(x), (7, 5, 5), 0, aten.tril.default, 0),
    "glu over features": (lambda x: F.glu(x, -1), (7, 4), 0, aten.glu.default, 0),
    "movedim": (lambda x: torch.movedim(x, 0, 2), (7, 4, 3), 0, aten.movedim.int, 2),
    "flip of features": (lambda x: torch.flip(x, [1]), (7, 3), 0, aten.flip.default, 0),
}
MIXING = {
    "tril with the sequence a matrix dimension": (lambda x: torch.tril(x), (7, 5), 0, aten.tril.default,
                                                  "reads the sequence length as a number"),
    "triu likewise": (lambda x: torch.triu(x), (5, 7), 1, aten.triu.default, "reads the sequence length"),
    "diff along the sequence": (lambda x: torch.diff(x, dim=0), (7, 4), 0, aten.diff.default, "its decomposition"),
    "cosine over the sequence": (lambda x: F.cosine_similarity(x, x + 1, dim=0), (7, 5), 0,
                                 aten.cosine_similarity.default, "over the sequence dimension"),
    "glu over the sequence": (lambda x: F.glu(x, 0), (8, 4), 0, aten.glu.default, "no sharding rule for glu"),
    "flip of the sequence": (lambda x: torch.flip(x, [0]), (7, 3), 0, aten.flip.default, "along the sequence"),
    "roll of the flattened value": (lambda x: torch.roll(x, 1), (7, 3), 0, aten.roll.default, "flattened"),
}


@pytest.mark.parametrize("name", list(TOKEN_LOCAL))
def test_an_op_whose_decomposition_keeps_the_tokens_apart_is_token_local(name):
    function, shape, dim, target, out_dim = TOKEN_LOCAL[name]
    gm = trace(function, torch.randn(*shape))
    role = analysed(gm, size(gm, 0, dim)).roles[node(gm, target)]
    assert role.role is Role.TOKEN_LOCAL and role.sequence_dims == (SequenceDim(out_dim),), (name, role)


@pytest.mark.parametrize("name", list(MIXING))
def test_an_op_whose_decomposition_reads_across_positions_stays_mixing(name):
    function, shape, dim, target, reason = MIXING[name]
    gm = trace(function, torch.randn(*shape))
    role = analysed(gm, size(gm, 0, dim)).roles[node(gm, target)]
    assert role.role is Role.MIXING and reason in role.reason, (name, role)


def test_a_split_of_other_dimensions_keeps_each_piece_indexed_by_the_sequence():
    gm = trace(lambda x: torch.hsplit(x, 2)[1], torch.randn(7, 4, 5))
    role = analysed(gm, size(gm, 0, 0)).roles[node(gm, aten.hsplit.int)]
    assert role.role is Role.TOKEN_LOCAL and role.element_dims == ((SequenceDim(0),), (SequenceDim(0),))


def test_broadcast_tensors_is_elementwise():
    gm = trace(lambda x, y: torch.broadcast_tensors(x, y)[1], torch.randn(7, 1, 5), torch.randn(3, 1))
    role = analysed(gm, size(gm, 0, 0)).roles[node(gm, aten.broadcast_tensors.default)]
    assert role.role is Role.TOKEN_LOCAL and role.element_dims == ((SequenceDim(0),), (SequenceDim(0),))


def test_a_reduction_reads_dim_and_keepdim_off_its_schema():
    # var.dim(self, dim, unbiased, keepdim): ``unbiased`` once passed for ``keepdim`` kept the
    # reduced dimension, so the sequence dimension after it was not moved.
    gm = trace(lambda x: aten.var.dim(x, [1], True, False), torch.randn(2, 5, 7))
    role = reduction_rule(node(gm, aten.var.dim), analysed(gm, size(gm, 0, 2)))
    assert role.role is Role.TOKEN_LOCAL and role.sequence_dims == (SequenceDim(1),)


def test_an_embedding_table_indexed_by_the_sequence_is_gathered_with_its_reason():
    table_ids = trace(lambda table, ids: F.embedding(ids, table), torch.randn(7, 4), torch.tensor([1, 0, 3]))
    role = analysed(table_ids, size(table_ids, 0, 0)).roles[node(table_ids, aten.embedding.default)]
    assert role.role is Role.MIXING and role.reason == TABLE_GATHERED
    both = trace(lambda table, ids: F.embedding(ids, table), torch.randn(7, 4), torch.tensor([1, 0, 3, 2, 2, 1, 0]))
    role = analysed(both, size(both, 0, 0)).roles[node(both, aten.embedding.default)]
    assert role.role is Role.TOKEN_LOCAL and role.reason == TABLE_GATHERED  # the ids stay chunked, the table whole


def test_every_op_reading_a_sequence_indexed_input_whole_has_a_reason():
    """The analysis names a reason wherever a sequence-indexed input is not kept on the chunk, and a
    gather without one is refused outright."""
    gm = trace(lambda table, ids, x: (F.embedding(ids, table), torch.cummax(x, 0).values, x.sum(0), torch.tril(x)),
               torch.randn(7, 4), torch.tensor([1, 0, 3]), torch.randn(7, 7))
    analysis = analysed(gm, size(gm, 0, 0))
    for current, role in analysis.roles.items():
        unaligned = [n for n in current.all_input_nodes if analysis.dims_of(n) and n not in role.aligned_inputs]
        if current.op == "call_function" and unaligned and role.role is not Role.SOURCE:
            assert role.reason, (current, role)
    with pytest.raises(ValueError, match="has no reason"):
        GatherRecord("x", "embedding", "")
