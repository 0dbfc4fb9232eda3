"""Parity with eager on real gloo collectives: outputs on every rank, gradients summed over the SP
group, at lengths that divide the SP size and lengths that do not (odd, prime, shorter than P)."""

from __future__ import annotations

import pytest

from dcp_compile.process_world import run_in_process_world
from parity import parity_worker

CORE_CASES = ["gpt", "dit", "vit", "handwritten_attention", "gqa", "no_attention"]


@pytest.mark.parametrize("world_size,lengths", [
    (1, [12, 7]),
    (2, [12, 7, 13, 1]),
    (4, [16, 13, 7, 3]),
])
def test_zoo_parity(world_size, lengths):
    results = run_in_process_world(parity_worker, world_size, CORE_CASES, lengths, timeout=900)
    assert all(r["checked"] == len(CORE_CASES) * len(lengths) for r in results)


def test_huggingface_parity():
    pytest.importorskip("transformers", reason="the Hugging Face parity test needs `pip install .[hf]`")
    results = run_in_process_world(parity_worker, 2, ["hf_llama", "hf_gpt2"], [12, 7, 17], timeout=900)
    assert all(r["checked"] == 6 for r in results)
