"""The pass runner's contract: each pass declares what it needs and leaves, and ``disable_passes``
is checked against it before anything runs (an unknown name, or a pass a later one needs)."""

from __future__ import annotations

import pytest

from dcp_compile.compiler.options import parse_options
from dcp_compile.compiler.passes import ANALYSIS_PASSES, VARIANT_PASSES, Product


def test_every_product_a_pass_needs_is_made_by_an_earlier_pass():
    made: set[Product] = set()
    for graph_pass in ANALYSIS_PASSES + VARIANT_PASSES:
        assert graph_pass.requires <= made, graph_pass.name
        made |= graph_pass.provides
    assert {product for graph_pass in VARIANT_PASSES for product in graph_pass.obliges} <= made


@pytest.mark.parametrize("disabled", [(), ("recompute",), ("causal_masks_pass",), ("use_varlen_attention",),
                                      ("shard_sequence", "insert_all_to_all")])
def test_a_safe_list_is_accepted(disabled: tuple[str, ...]):
    assert parse_options({"disable_passes": list(disabled)}).disable_passes == disabled


def test_an_unknown_name_is_refused_with_the_pass_names():
    with pytest.raises(ValueError, match=r"names no pass: \['sequence_dim'\]; the passes are: .*sequence_dims"):
        parse_options({"disable_passes": ["sequence_dim"]})


@pytest.mark.parametrize("disabled, missing, needed_by", [
    (["sequence_dims"], "the sequence analysis", "shard_sequence_pass"),
    (["find_attention"], "the attention sites", "sequence_dims_pass"),
    (["shard_sequence"], "dcp::sharded_attention markers", "insert_all_to_all_pass"),
])
def test_disabling_a_pass_another_needs_is_refused_with_the_fix(disabled, missing, needed_by):
    with pytest.raises(ValueError, match=rf"leaves {needed_by} without {missing}.*disable {needed_by} as well"):
        parse_options({"disable_passes": disabled})


def test_disabling_the_lowering_of_the_markers_is_refused():
    with pytest.raises(ValueError, match="leaves the graph of shard_sequence_pass unfinished"):
        parse_options({"disable_passes": ["insert_all_to_all"]})
