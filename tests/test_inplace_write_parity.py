"""In-place writes along the sequence on 2 gloo ranks: at parity with eager AND sharded (every
attention site under Ulysses), each write either kept on the chunk (it keeps tokens apart) or
gathered with a reason that names the write; never silently wrong.

The shift by slice assignment (``out = full_like(x, fill); out[:, : n - 1] = x[:, 1:]``, a
multi-token-prediction head's look-ahead) once gave a wrong loss with every site "sharded".
"""

from __future__ import annotations

from dcp_compile.testing.process_world import run_in_process_world
from sequence_programs import program_worker

WRITES_ALONG_THE_SEQUENCE = ["shift_slice_assign", "shift_right_slice_assign", "copy_into_view", "index_put_",
                             "index_put_accumulate", "roll"]
WRITES_THAT_KEEP_TOKENS_APART = ["feature_slice_assign", "inplace_scale"]


def test_writes_along_the_sequence_are_at_parity_and_gathered_with_a_reason():
    programs = [(name,) for name in WRITES_ALONG_THE_SEQUENCE + WRITES_THAT_KEEP_TOKENS_APART]
    results = run_in_process_world(program_worker, 2, programs, [8, 7, 1], timeout=900)
    for rank_results in results:
        for name, result in rank_results.items():
            assert not result["problems"], "\n".join(result["problems"])
            assert result["sharded_sites"] >= 2 * 2, (name, result)  # both sites, at the even and odd length
            if name in WRITES_THAT_KEEP_TOKENS_APART:
                assert result["gathers"] == [], (name, result["gathers"])
            else:
                assert result["gathers"] and all(result["gathers"]), (name, result["gathers"])
    reasons = results[0]["shift_slice_assign"]["gathers"]
    assert all("written in place (copy_" in reason for reason in reasons), reasons


def test_multi_token_prediction_labels_written_by_slice_assignment():
    # The held-out spelling: labels k tokens ahead written into full_like(ids, -100). The buffer
    # runs on the full ids (no gradient, no collective: the ids are whole on every rank); the
    # shifted labels reach each loss as this rank's chunk, so the losses stay shard-local.
    from sequence_programs import multi_token_prediction_worker

    (result, _) = run_in_process_world(multi_token_prediction_worker, 2, [8, 7], timeout=900)
    assert not result["problems"], "\n".join(result["problems"])
    assert result["sharded_sites"] == result["attention_sites"] == 4
    assert not any("loss" in reason for reason in result["gathers"]), result["gathers"]
