"""The model's first call is Dynamo's trace: its sizes are the hints every variant compiles with.

A first call so short that a rank of a later SP size gets one token (8 tokens at SP 8) makes that
variant's compile specialise the per-rank length to 1 (a size-1 hint is a constant to the shape
environment), and every later call of the variant at another length fails in a ``view``. Found by
the long-sequence replay (``benchmarks/replay.py --setup replay_long_cpu``), whose warm-up now
calls the longest micro-batch first. Known defect: the fix compiles such a variant at a hint that
leaves every rank two tokens or more (fresh fake inputs, as regions build).
"""

from __future__ import annotations

import pytest
import torch

import dcp_compile as dcp
from dcp_compile.compiler.variant_selection import use
from dcp_compile.demo.example_models import TinyGPT
from dcp_compile.device_profile.fake_world import fake_world


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


@pytest.mark.xfail(strict=True, raises=RuntimeError, reason=(
    "known defect: a first trace of 8 tokens compiles the SP-8 variant for one token per rank; "
    "365 tokens then fail in a view ('shape [1, 32] is invalid'). An XPASS (fixed) fails the suite until this mark goes"))
def test_a_first_trace_of_one_token_per_rank_does_not_fix_the_variant_to_it() -> None:
    run_calls([8], [365])
