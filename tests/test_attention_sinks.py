"""Attention sinks (gpt-oss): a learned per-head logit concatenated to the scores before the
softmax and sliced off after is found as a hand-written attention region and runs on each rank's
heads under Ulysses (every key of those heads is there; the sink is cut to the same heads):
parity with eager on 2 gloo ranks, every site sharded, no gather."""

from __future__ import annotations

from attention_sinks import VARIANTS, sinks_worker
from dcp_compile.testing.process_world import run_in_process_world


def test_attention_sinks_are_found_and_sharded_at_parity_with_no_gather():
    results = run_in_process_world(sinks_worker, 2, list(VARIANTS), [8, 7], timeout=900)
    for rank_results in results:
        for name, result in rank_results.items():
            assert not result["problems"], "\n".join(result["problems"])
            assert result["sharded_sites"] == result["attention_sites"] == 4, (name, result)
            assert result["gathers"] == [], (name, result["gathers"])
