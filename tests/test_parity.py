"""Parity with eager on real gloo collectives: outputs on every rank, gradients summed over the SP
group, at lengths that divide the SP size and lengths that do not (odd, prime, shorter than P).

The transformed graphs run with ``inner="eager"`` here (compiling them is what costs time on two
CPU cores); ``test_variants.py`` runs the same passes under ``aot_eager`` and ``inductor``.
"""

from __future__ import annotations

import pytest

from dcp_compile.testing.process_world import run_in_process_world
from parity import parity_worker

CORE_CASES = ["gpt", "dit", "vit", "handwritten_attention", "gqa", "no_attention"]


def run_parity(world_size: int, cases: list[str], lengths: list[int]) -> None:
    results = run_in_process_world(parity_worker, world_size, cases, lengths, "eager", timeout=1200)
    assert all(result["checked"] == len(cases) * len(lengths) for result in results)
    if world_size > 1:  # every model with attention ran Ulysses at every length
        with_attention = [name for name in cases if name != "no_attention"]
        assert all(result["sharded_variants"] >= len(with_attention) * len(lengths) for result in results), results


def test_single_process_world():
    run_parity(1, ["gpt", "no_attention"], [12])


def test_two_ranks_every_model():
    run_parity(2, CORE_CASES, [12, 7])


@pytest.mark.slow
def test_four_ranks_uneven_and_shorter_than_sp():
    # 7 splits 2/2/2/1 and 3 splits 1/1/1/0: uneven chunks and an empty one; GQA: 2 KV heads at P=4.
    run_parity(4, ["gpt", "gqa"], [16, 7, 3])


@pytest.mark.slow
def test_four_ranks_image_and_handwritten_models():
    run_parity(4, ["dit", "vit", "handwritten_attention"], [16, 13])


def test_huggingface_models():
    pytest.importorskip("transformers", reason="the Hugging Face parity test needs `pip install .[hf]`")
    run_parity(2, ["hf_llama", "hf_gpt2"], [12, 7])


def test_two_ranks_folded_heads_with_alibi():
    # BLOOM's spelling (baddbmm of an ALiBi bias on [B*H, S, D], a [B, H, S, S] view around the
    # softmax): found as an attention region and sharded, no gather (zoo budget 0).
    run_parity(2, ["alibi"], [12, 7])


@pytest.mark.slow
def test_two_ranks_replicated_queries_over_sharded_tokens():
    # LTX-2's audio queries attend over the sharded video tokens: the keys and values go to the
    # rank's heads, the queries are cut to them, the output is gathered over (padded) heads.
    # Also written by hand (softmax(q @ k^T) @ v, a hand-written region) instead of SDPA.
    run_parity(2, ["two_stream", "two_stream_by_hand"], [12, 7])
