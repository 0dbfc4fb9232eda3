"""Graph structure of the transformed graphs, on one process with a fake process group.

The fake group answers every collective instantly (with garbage), which is all a structural test
needs: the graphs, the records and the counts are exactly what a real world would compile.
"""

from __future__ import annotations

import pytest
import torch

import dcp_compile as dcp
from model_zoo import ZOO

A2A = "_c10d_functional.all_to_all_single.default("


def compile_and_explain(name: str, length: int = 12):
    case = ZOO[name]
    model = case.build()
    compiled = torch.compile(model, backend="dcp", dynamic=True, options={"sp_size": 2, "inner": "eager"})
    record = dcp.explain(compiled, **case.make_inputs(length))
    assert len(record) == 1, str(record)
    graph = record[0]
    (variant,) = graph.variants.values()
    return graph, variant


def inserted_all_to_alls(variant) -> int:
    (lowering,) = [p for p in variant.passes if p.name == "insert_all_to_all_pass"]
    return lowering.after.count(A2A) - lowering.before.count(A2A)


@pytest.mark.parametrize("name,self_attention,cross_attention", [
    ("gpt", 2, 0), ("vit", 2, 0), ("gqa", 2, 0), ("handwritten_attention", 2, 0), ("dit", 2, 2),
])
def test_four_all_to_alls_per_self_attention(fake_world, name, self_attention, cross_attention):
    graph, variant = compile_and_explain(name)
    assert len(graph.attention_sites) == self_attention + cross_attention
    assert variant.fallback_reason is None
    assert inserted_all_to_alls(variant) == 4 * self_attention + 2 * cross_attention


def test_handwritten_attention_becomes_sdpa(fake_world):
    graph, _ = compile_and_explain("handwritten_attention")
    assert all("(handwritten" in site for site in graph.attention_sites), graph.attention_sites


def test_no_attention_means_no_collectives(fake_world, caplog):
    with caplog.at_level("INFO", logger="dcp_compile"):
        graph, variant = compile_and_explain("no_attention")
    assert graph.sequence_length is None
    assert variant.collectives == {}
    assert any("no attention found" in message for message in caplog.messages)


def test_gathers_only_where_the_record_says_why(fake_world):
    # GPT: the loss is rewritten (one all-reduce); the logits output is the only gathered value.
    _, gpt = compile_and_explain("gpt")
    (shard,) = [p for p in gpt.passes if p.name == "shard_sequence_pass"]
    assert gpt.gathers == []
    assert shard.after.count(A2A) == 1  # the logits returned in full
    assert any("cross_entropy" in rewrite for rewrite in gpt.rewrites)
    # DiT: the unpatchify splits the sequence, so it is gathered first, with that reason.
    _, dit = compile_and_explain("dit")
    assert len(dit.gathers) == 1
    assert "splits the sequence" in dit.gathers[0].reason


def test_report_is_readable(fake_world):
    graph, _ = compile_and_explain("gpt")
    text = str(graph)
    assert "attention sites: 2" in text and "all_to_all_single x" in text and "rewrite" in text
