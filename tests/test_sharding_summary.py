"""``dcp.report.sharding_summary``: the once-after-warm-up lines the examples print, from records alone."""

from __future__ import annotations

import dcp_compile as dcp
from dcp_compile.compiler.record import GraphRecord, ModelRecord, VariantRecord


def test_the_summary_counts_sites_gathers_graphs_and_explains_collectives() -> None:
    sharded = VariantRecord(dcp.Variant(2), attention_sites=2, sharded_sites=["a", "b"],
                            collectives={"all_to_all_single": 9}, output_gathers=1)
    local = VariantRecord(dcp.Variant(1), attention_sites=2)
    graphs = [GraphRecord(0, attention_sites=["a", "b"], variants={dcp.Variant(2): sharded, dcp.Variant(1): local}),
              GraphRecord(1)]
    text = dcp.report.sharding_summary(ModelRecord(graphs))
    assert text.splitlines()[0] == "dcp: 2 graph(s) ran, 1 with attention"
    assert "why several graphs:" in text
    assert "SP 2: attention sites sharded 2/2 (2 under the all-to-all) over 1 graph variant(s) | gathers 0" in text
    assert "all_to_all_single x9 (Ulysses around attention (4 per self-attention, 2 per cross-attention site), " \
           "1 returning a sharded output in full)" in text
    assert "NOT SHARDED" not in text


def test_an_unsharded_variant_is_named_and_sp1_only_runs_say_so() -> None:
    broken = VariantRecord(dcp.Variant(2), attention_sites=2, sharded_sites=["a"], fallback_reason="a reason")
    text = dcp.report.sharding_summary(ModelRecord([GraphRecord(0, attention_sites=["a", "b"], variants={dcp.Variant(2): broken})]))
    assert "NOT SHARDED" in text and "a reason" in text
    local = VariantRecord(dcp.Variant(1), attention_sites=2)
    text = dcp.report.sharding_summary(ModelRecord([GraphRecord(0, attention_sites=["a"], variants={dcp.Variant(1): local})]))
    assert "no SP>1 variant with attention has run yet" in text
