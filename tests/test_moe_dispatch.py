"""Mixture-of-experts feed-forwards in five dispatch styles (tests/moe_dispatch.py) at SP 2 on
gloo ranks: outputs and SP-summed gradients equal eager's on the full batch, every attention site
sharded, and each style either on the rank's tokens with no gather or gathered with a reason:

* Mixtral's loop (``torch.where`` per expert breaks the graph; the expert graphs run whole),
  weights gathered per (token, expert) pair for a batched matmul, and a sorted dispatch with
  ``index_select`` / ``index_add_``: no gather at all (the load-balancing term's mean over the
  flattened tokens is a local sum and an all-reduce; its ``new_zeros(())`` accumulator reads no
  token);
* a capacity from the token count with positions by ``cumsum`` over the tokens: the positions
  are computed on the gathered tokens and the capacity from the whole sequence's size, so the
  same tokens drop as in eager;
* a capacity read off a local sort's per-expert counts, or off a running count over the sorted
  pairs: the sort is refused and the dispatch runs on the gathered tokens, with the reason that
  which tokens drop depends on the whole sequence.
"""

from __future__ import annotations

import pytest
import torch

from dcp_compile.compiler.passes.sequence_dims.propagation import CAPACITY_REASON
from dcp_compile.testing.process_world import run_in_process_world
from moe_dispatch import STYLES, activations, build, moe_worker

NO_GATHER = {"loop", "gathered_weights", "sorted_bmm"}


def check(results: list[dict], lengths: int) -> None:
    for rank_results in results:
        for style, result in rank_results.items():
            assert not result["problems"], "\n".join(result["problems"])
            assert result["sharded_sites"] == result["attention_sites"] == 2 * lengths, (style, result)
            if style in NO_GATHER:
                assert result["gathers"] == [], (style, result["gathers"])
            else:
                assert result["gathers"] and all(result["gathers"]), (style, result["gathers"])
            if style.startswith("sorted_") and style.endswith("capacity"):
                assert CAPACITY_REASON in result["gathers"], result["gathers"]


@pytest.mark.parametrize("style", ["capacity", "sorted_capacity", "sorted_cumsum_capacity"])
def test_the_capacity_styles_drop_tokens_at_the_tested_lengths(style):
    """Else the capacity tests below could not tell a capacity counted per rank from the right one."""
    model, unlimited = build(style), build(style)
    for block in unlimited.blocks:
        block.moe.capacity_factor = 100.0
    for length in (8, 7):
        assert not torch.allclose(model(activations(length)), unlimited(activations(length))), (style, length)


def test_sorted_dispatch_with_and_without_a_capacity_at_parity():
    styles = ["sorted_bmm", "sorted_capacity"]
    check(run_in_process_world(moe_worker, 2, styles, [8, 7], timeout=900), 2)


@pytest.mark.slow
def test_every_dispatch_style_at_parity():
    results = run_in_process_world(moe_worker, 2, list(STYLES), [8, 7], timeout=1800)
    check(results, 2)


@pytest.mark.slow
def test_the_capacity_zoo_case_at_parity_within_its_gather_budget():
    from parity import parity_worker

    results = run_in_process_world(parity_worker, 2, ["moe_capacity"], [13, 8], "eager", timeout=900)
    assert all(result["checked"] == 2 and result["sharded_variants"] >= 2 for result in results), results
