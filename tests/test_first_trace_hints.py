"""The model's first call is Dynamo's trace: its sizes are the hints every variant compiles with.

A first call so short that a rank of a later SP size gets one token (8 tokens at SP 8) makes that
variant's compile specialise the per-rank length to 1 (a size-1 hint is a constant to the shape
environment), and every later call of the variant at another length fails in a ``view``. Found by
the long-sequence replay (``benchmarks/replay.py --setup replay_long_cpu``), whose warm-up now
calls the longest micro-batch first. Such a variant is now traced at a hint that leaves every rank
two tokens (``dcp_compile/compiler/workarounds/trace_hints.py``).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import dcp_compile as dcp
from dcp_compile.compiler.variant_selection import use
from dcp_compile.demo.example_models import TinyGPT
from dcp_compile.device_profile.fake_world import fake_world
from dcp_compile.testing.process_world import run_in_process_world
from sharding_checks import sharding_problems


def run_calls(*calls: list[int], sp_size: int = 8) -> None:
    torch.manual_seed(0)
    torch._dynamo.reset()
    model = TinyGPT(256, 32, 1, 8)
    try:
        with fake_world(sp_size):
            compiled = torch.compile(model, backend="dcp", dynamic=True, options={"inner": "aot_eager",
                                                                                  "check_ranks": False})
            for lengths in calls:
                packed = dcp.pack_sequences([torch.randint(1, 256, (n,)) for n in lengths])
                with use(dcp.Variant(sp_size, "none"), sequence_lengths=lengths):
                    loss = compiled(packed.input_ids, packed.labels, packed.position_ids)
                loss.backward()
    finally:
        torch._dynamo.reset()


def test_a_long_first_trace_runs_later_calls_of_one_token_per_rank() -> None:
    run_calls([365], [8], [3, 2, 2])


def test_a_first_trace_of_one_token_per_rank_does_not_fix_the_variant_to_it() -> None:
    run_calls([8], [365], [8], [3, 2, 2])


def first_trace_worker(rank: int, world_size: int, lengths: list[int]) -> int:
    """TinyGPT at SP 2 called at ``lengths`` in order; each call's loss and SP-summed gradients
    against eager on the full batch, and every attention sharded."""
    torch.manual_seed(0)
    torch._dynamo.reset()
    model = TinyGPT(256, 32, 1, 8)
    compiled = torch.compile(model, backend="dcp", dynamic=True, options={"inner": "aot_eager", "sp_size": 2})
    for length in lengths:
        ids = torch.randint(1, 256, (1, length), generator=torch.Generator().manual_seed(length))
        model.zero_grad(set_to_none=True)
        expected = model(ids, ids)
        expected.backward()
        expected_grads = {name: p.grad.clone() for name, p in model.named_parameters()}
        records = dcp.explain(compiled, ids, ids)
        problems = sharding_problems(records, 0)
        assert not problems, (length, problems)
        model.zero_grad(set_to_none=True)
        loss = compiled(ids, ids)
        loss.backward()
        torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-5)
        for name, p in model.named_parameters():
            grad = p.grad.clone()
            dist.all_reduce(grad)
            torch.testing.assert_close(grad, expected_grads[name], rtol=1e-4, atol=1e-5, msg=lambda m, name=name: f"{name}: {m}")
    return len(lengths)


@pytest.mark.slow
def test_a_first_trace_of_one_token_per_rank_trains_at_parity_on_two_ranks() -> None:
    """Two gloo ranks, SP 2, a first call of 2 tokens (one a rank), then 37 and 2 again: the loss
    and the summed gradients as eager's on the full batch, every attention sharded."""
    assert run_in_process_world(first_trace_worker, 2, [2, 37, 2], timeout=600) == [3, 3]
