"""In-place writes: alias groups read off the op schemas, and default deny for the written
buffers the rules do not prove chunk-aligned (the shift by slice assignment of a multi-token-
prediction head was once classified token-local)."""

from __future__ import annotations

import torch
from rule_helpers import node, size, trace

from dcp_compile.compiler.passes.sequence_dims import Role, SequenceAnalysis
from dcp_compile.compiler.passes.sequence_dims.inplace_writes import alias_groups, unproven_writes
from dcp_compile.compiler.passes.sequence_dims.propagation import fx_to_networkx, propagate

aten = torch.ops.aten


def analysed_with_writes(gm, length) -> SequenceAnalysis:
    """The driver's loop: propagate, force the unproven written buffers, until nothing changes."""
    written: dict = {}
    while True:
        analysis = propagate([], SequenceAnalysis(length=length, graph=fx_to_networkx(gm.graph),
                                                  written_aliases=dict(written)))
        forced = unproven_writes(analysis, gm.graph)
        if not forced:
            return analysis
        written.update(forced)


def shift_by_slice_assignment(x):
    n = x.shape[1]
    out = torch.full_like(x * 2, 0.5)
    out[:, : n - 1] = x[:, 1:]
    return out + 1


def test_a_write_into_a_slice_joins_the_buffer_its_view_and_the_write():
    gm = trace(shift_by_slice_assignment, torch.randn(2, 7, 8))
    (group,) = alias_groups(gm.graph)
    assert group.base is node(gm, aten.full_like.default)
    assert [w.target for w in group.writes] == [aten.copy_.default]
    assert node(gm, aten.copy_.default).args[0] in group.members


def test_the_shift_by_slice_assignment_runs_on_the_full_sequence_with_a_reason():
    gm = trace(shift_by_slice_assignment, torch.randn(2, 7, 8))
    analysis = analysed_with_writes(gm, size(gm, 0, 1))
    buffer = analysis.roles[node(gm, aten.full_like.default)]
    assert buffer.role is Role.MIXING and "written in place (copy_" in buffer.reason
    # Its readers take their chunk of the written buffer (it is still indexed by the sequence).
    assert buffer.sequence_dims and analysis.role_of(node(gm, aten.add.Tensor)) is Role.TOKEN_LOCAL


def test_index_put_along_the_sequence_is_default_denied():
    def scatter_rows(x):
        out = torch.zeros_like(x)
        out.index_put_((torch.arange(x.shape[1]).flip(0),), x.transpose(0, 1))
        return out

    gm = trace(lambda x: scatter_rows(x.transpose(0, 1)), torch.randn(2, 7, 8))
    analysis = analysed_with_writes(gm, size(gm, 0, 1))
    assert analysis.role_of(node(gm, aten.zeros_like.default)) is Role.MIXING


def test_writes_that_keep_tokens_apart_stay_on_the_chunk():
    def feature_writes(x):
        out = x.clone()
        out[..., :4] = 0.0
        out.mul_(2.0)
        return out

    gm = trace(feature_writes, torch.randn(2, 7, 8))
    analysis = analysed_with_writes(gm, size(gm, 0, 1))
    assert not analysis.written_aliases
    assert analysis.role_of(node(gm, aten.clone.default)) is Role.TOKEN_LOCAL
    assert analysis.role_of(node(gm, aten.mul_.Tensor)) is Role.TOKEN_LOCAL


def test_a_write_into_a_graph_input_is_never_left_on_the_chunk():
    def write_input(x):
        x.mul_(2.0)
        return x + 1

    gm = trace(write_input, torch.randn(2, 7, 8))
    analysis = analysed_with_writes(gm, size(gm, 0, 1))
    assert analysis.role_of(node(gm, aten.mul_.Tensor)) is Role.MIXING


def test_a_view_taken_after_the_last_write_only_reads_the_buffer():
    # The feature writes are proven on chunks; the later shift is a read of the written buffer
    # (its own rule gathers it), not a reason to run the buffer and its writes on the full sequence.
    def write_then_shift(x):
        out = torch.zeros_like(x)
        out[..., :4] = x[..., :4]
        return out[:, 1:] * 2

    gm = trace(write_then_shift, torch.randn(2, 7, 8))
    analysis = analysed_with_writes(gm, size(gm, 0, 1))
    assert not analysis.written_aliases
    assert analysis.role_of(node(gm, aten.zeros_like.default)) is Role.TOKEN_LOCAL
