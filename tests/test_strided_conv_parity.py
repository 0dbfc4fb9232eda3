"""Strided convolutions over positions (an audio encoder's stride-2 downsampling) at odd and even
lengths on 2 gloo ranks: at parity with eager, every attention site sharded (or replicated over
another, unsharded length), and any gather carries its reason. Odd frame counts put the
frames' chunk boundary and the downsampled positions' boundary at different places."""

from __future__ import annotations

import importlib.util

import pytest

from audio_models import strided_models_worker
from dcp_compile.testing.process_world import run_in_process_world


@pytest.mark.slow
def test_strided_convolutions_over_positions_at_odd_and_even_lengths():
    with_transformers = importlib.util.find_spec("transformers") is not None
    results = run_in_process_world(strided_models_worker, 2, [15, 16, 31], with_transformers, timeout=900)
    for rank_results in results:
        for name, result in rank_results.items():
            assert not result["problems"], "\n".join(result["problems"])
            assert result["sharded_sites"] > 0, (name, result)
            assert all(result["gathers"]), (name, result["gathers"])
    # The convolutions run before the sequence exists (the encoder's subsampler): no gather at all.
    assert results[0]["strided_audio_encoder"]["gathers"] == []
    # Between attentions over the frames, the strided convolution gathers, with its reason.
    assert results[0]["downsampling_encoder"]["gathers"], results[0]["downsampling_encoder"]
