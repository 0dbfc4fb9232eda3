"""The registry: the precedence chain's fallbacks (default deny, elementwise with broadcast
partners), and the one-to-one link between a rewrite's rule and its lowering."""

from __future__ import annotations

import re
from pathlib import Path

import torch
from rule_helpers import analysed, analysed_before, node, size, trace

from dcp_compile.compiler.passes.sequence_dims import Rewrite, Role, SequenceDim, classify
from dcp_compile.compiler.passes.sequence_dims.propagation import propagate_node
from dcp_compile.compiler.passes.sequence_dims.registry import STAGE_RULES, Stage, pointwise
from dcp_compile.compiler.passes.shard_sequence import LOWERINGS

aten = torch.ops.aten
PASSES = Path(__file__).resolve().parents[3] / "dcp_compile" / "compiler" / "passes"


def test_an_op_with_no_rule_over_the_sequence_is_mixing_with_its_name():
    # cummax has neither a rule nor a decomposition to read (see decomposition_rules)
    gm = trace(lambda x: torch.cummax(x, 1).values, torch.randn(2, 7, 8))
    role = classify(node(gm, aten.cummax.default), analysed(gm, size(gm, 0, 1)))
    assert role.role is Role.MIXING and role.reason == "no sharding rule for cummax"


def test_a_buffer_broadcast_against_the_tokens_becomes_a_source():
    """``x + pos_embed``: patch tokens ``[B, H*W, D]`` plus a ``[1, 6, D]`` table whose size is
    another expression, equal at run time: the table spans the tokens and is cut to the same chunk."""
    gm = trace(lambda image: image.flatten(1, 2) + torch.ones(1, 6, 8), torch.randn(2, 2, 3, 8))
    add = node(gm, aten.add.Tensor)
    analysis = analysed_before(gm, size(gm, 0, 1) * size(gm, 0, 2), add)
    role = pointwise(add, analysis)
    (partner,) = [partner for partner, _ in role.partners]
    assert partner is node(gm, aten.ones.default) and partner in role.aligned_inputs
    assert analysis.roles[partner].role is Role.NONE  # the rule only reports it ...
    propagate_node(add, analysis)
    assert analysis.roles[partner].role is Role.SOURCE  # ... the driver records it
    assert analysis.roles[partner].sequence_dims == (SequenceDim(1),)


def test_every_link_of_the_chain_has_its_rule():
    assert set(STAGE_RULES) == set(Stage)


def test_every_rewrite_has_one_lowering_and_grep_finds_both():
    """``grep -rn Rewrite.X`` lands on the rule that decides X and on the lowering of X."""
    assert set(LOWERINGS) >= set(Rewrite)
    rules = "\n".join(path.read_text() for path in (PASSES / "sequence_dims").glob("*.py") if path.name != "model.py")
    lowerings = "\n".join(path.read_text() for path in (PASSES / "shard_sequence").glob("*_lowerings.py"))
    for rewrite in Rewrite:
        assert re.search(rf"Rewrite\.{rewrite.name}\b", rules), f"no rule produces Rewrite.{rewrite.name}"
        assert f"@lowering(Rewrite.{rewrite.name})" in lowerings, f"no lowering of Rewrite.{rewrite.name}"
