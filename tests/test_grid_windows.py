"""Token grids on windows: a feed-forward that convolves the latent grid (Sana's Mix-FFN, Sana-Video's
conv over frames) runs on each rank's window of rows or frames, fetched by a halo exchange, instead
of on all the tokens after an all-gather."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st
from torch import nn

import dcp_compile as dcp
from dcp_compile.compiler.grid_windows import _exchange_plan, window_units
from dcp_compile.compiler.sequence_chunks import chunk_length, chunk_start
from dcp_compile.testing.process_world import run_in_process_world
from sharding_checks import sharding_problems
from test_parity import run_parity


@settings(max_examples=200, deadline=None)
@given(units=st.integers(1, 12), unit=st.integers(1, 7), radius=st.integers(0, 3), sp_size=st.integers(1, 6))
def test_each_window_is_its_grid_steps_and_the_adjoint_counts_every_copy(units, unit, radius, sp_size):
    """Route every rank's chunk of ``arange(L)`` by the exchange plan, in process: each rank must
    receive exactly the tokens of its window, which must hold its chunk and ``radius`` whole steps
    around it (clipped at the grid's edges); sending the windows back must sum, for each token, the
    number of windows it is in."""
    length = units * unit
    tokens = torch.arange(length)
    chunks = [tokens[chunk_start(length, sp_size, r): chunk_start(length, sp_size, r) + chunk_length(length, sp_size, r)]
              for r in range(sp_size)]
    plans = [_exchange_plan(length, unit, radius, sp_size, r) for r in range(sp_size)]
    windows_holding = torch.zeros(length)
    returned = [torch.zeros(chunk_length(length, sp_size, r)) for r in range(sp_size)]
    for rank in range(sp_size):
        received = torch.cat([chunks[j][plans[j][0][rank][0]: plans[j][0][rank][0] + plans[j][0][rank][1]]
                              for j in range(sp_size)])
        assert [plans[rank][1][j] for j in range(sp_size)] == [plans[j][0][rank][1] for j in range(sp_size)]
        first, count = window_units(length, unit, radius, sp_size, rank)
        assert received.tolist() == list(range(first * unit, (first + count) * unit))
        start, size = chunk_start(length, sp_size, rank), chunk_length(length, sp_size, rank)
        if size:
            assert first == max(0, start // unit - radius)
            assert (first + count) * unit >= min(length, ((start + size - 1) // unit + 1 + radius) * unit)
        windows_holding[received] += 1
        # The adjoint, as return_grid_window_gradient routes it: a gradient of ones on the window,
        # each source's piece back to it, added at the offsets it was sent from.
        position = 0
        for source in range(sp_size):
            offset, piece = plans[source][0][rank]
            returned[source][offset: offset + piece] += 1
            position += piece
        assert position == count * unit
    assert torch.equal(torch.cat(returned), windows_holding)


def test_two_ranks_grid_convolutions():
    # 7 rows of 3 tokens on 2 ranks: 11 | 10 tokens, the boundary inside a row; 4 rows: 2 rows each.
    # Video: 7 and 4 frames of 3x5. Every attention sharded, 0 gathers (the zoo's default budget).
    run_parity(2, ["grid_conv_image", "grid_conv_video"], [7, 4])


@pytest.mark.slow
def test_four_ranks_chunks_shorter_than_the_halo():
    # 3 rows of 3 tokens on 4 ranks: chunks 3/2/2/2, each window holds tokens of three ranks.
    run_parity(4, ["grid_conv_image", "grid_conv_video"], [3, 5])


class _CumulativeRows(nn.Module):
    """A feed-forward that reads every earlier row (a cumulative sum over the grid's rows): no
    window holds that, so the tokens are gathered, as before."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(8, 24)

    def forward(self, latent: torch.Tensor) -> torch.Tensor:
        B, _, H, W = latent.shape
        x = latent.flatten(2).transpose(1, 2).repeat(1, 1, 2)
        q, k, v = self.qkv(x).view(B, H * W, 3, 2, 4).permute(2, 0, 3, 1, 4)
        x = x + torch.nn.functional.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(B, H * W, 8)
        grid = x.unflatten(1, (H, W)).cumsum(1)
        return x + grid.flatten(1, 2)


def _explain(model: nn.Module, *args) -> str:
    compiled = torch.compile(model, backend="dcp", dynamic=True, options={"inner": "eager", "sp_size": 2})
    return dcp.explain(compiled, *args)


def test_explain_shows_the_window_and_what_refuses_one(fake_world):
    from model_zoo import GridConvModel

    text = str(_explain(GridConvModel(), torch.randn(2, 4, 5, 3)))
    assert "window of the token grid (halo exchange of 1 step(s)" in text, text
    assert "gathers 0" in text, text
    refused = str(_explain(_CumulativeRows(), torch.randn(2, 4, 5, 3)))
    assert "gathers 1" in refused and "splits the sequence dimension" in refused, refused
    assert "no grid window: cumsum" in refused, refused


def _aot_autograd_worker(rank, world_size):
    """The window ops through AOT autograd with every recompute policy (a recomputed halo exchange
    must still be exact), sharded with no gather."""
    from model_zoo import ZOO, eager_reference
    from parity import compare, compiled_run

    problems = []
    for name in ("grid_conv_image", "grid_conv_video"):
        case = ZOO[name]
        model = case.build()
        compiled = torch.compile(model, backend="dcp", dynamic=True, options={"inner": "aot_eager"})
        for policy, length in (("none", 7), ("selective", 6), ("full", 5)):
            with dcp.use(dcp.Variant(2, policy)):
                actual = compiled_run(model, compiled, case, case.make_inputs(length))
                records = dcp.explain(compiled, **case.make_inputs(length))
            problems += compare(f"{name}-{policy}", length, eager_reference(case, length), actual, rtol=1e-4, atol=1e-5)
            problems += [f"{name}-{policy}@{length}: {p}" for p in sharding_problems(records, case.gather_budget)]
    if problems:
        raise AssertionError("\n".join(problems))
    return True


@pytest.mark.slow
def test_windows_through_aot_autograd_and_recompute_policies():
    assert run_in_process_world(_aot_autograd_worker, 2, timeout=1200) == [True, True]


def _inductor_worker(rank, world_size):
    """The window's sizes (Max/Min of the chunk bounds) through Inductor's code generation, forward
    and backward, sharded with no gather, at two lengths (the second runs the backward compiled at
    the first). Needs dcp's Inductor fixes, on by default (compiler/workarounds/inductor_patches.py): on torch
    2.13 Inductor cannot order these models' strides (tokens ``H*W``, pytorch/pytorch#172204), rank 1's
    chunk bounds meet a negative power in its value ranges, and the backward's saved activations
    would keep the first length's strides."""
    from model_zoo import ZOO, eager_reference
    from parity import compare, compiled_run

    problems = []
    for name in ("grid_conv_image", "grid_conv_video"):
        case = ZOO[name]
        model = case.build()
        compiled = torch.compile(model, backend="dcp", dynamic=True, options={"inner": "inductor"})
        for length in (7, 4):
            actual = compiled_run(model, compiled, case, case.make_inputs(length))
            records = dcp.explain(compiled, **case.make_inputs(length))
            problems += compare(f"{name}-inductor", length, eager_reference(case, length), actual, rtol=1e-4, atol=1e-5)
            problems += [f"{name}-inductor@{length}: {p}" for p in sharding_problems(records, case.gather_budget)]
            problems += [f"{name}-inductor@{length}: {v.variant} {v.inner_fallback}" for v in records.variant_records()
                         if v.inner_fallback]
    if problems:
        raise AssertionError("\n".join(problems))
    return True


@pytest.mark.slow
def test_windows_through_inductor():
    assert run_in_process_world(_inductor_worker, 2, timeout=1800) == [True, True]


@pytest.mark.slow
def test_inductor_stride_bug_falls_back_to_aot_eager_and_says_so(fake_world, monkeypatch, request):
    """A grid model's backward under Inductor hits pytorch/pytorch#172204 on torch 2.13 (also without
    dcp): with dcp's patch off (DCP_INDUCTOR_PATCHES=0; on, it compiles: test_inductor_patches.py),
    the variant runs under aot_eager instead, exact, and explain says why."""
    from model_zoo import GridConvModel

    monkeypatch.setenv("DCP_INDUCTOR_PATCHES", "0")
    # A compile cached by a patched run would skip the lowering, and with it the bug: a fresh cache.
    from torch._inductor.utils import fresh_cache

    fresh = fresh_cache()
    fresh.__enter__()
    request.addfinalizer(lambda: fresh.__exit__(None, None, None))

    torch.manual_seed(0)
    model = GridConvModel()
    compiled = torch.compile(model, backend="dcp", dynamic=True, options={"inner": "inductor", "sp_size": 1})
    latent = torch.randn(2, 4, 7, 3)
    compiled(latent).pow(2).mean().backward()
    got = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad()
    model(latent).pow(2).mean().backward()
    for name, p in model.named_parameters():
        torch.testing.assert_close(got[name], p.grad, rtol=1e-4, atol=1e-5)
    text = str(dcp.explain(compiled, latent))
    if torch.__version__.startswith(("2.11", "2.12", "2.13")):
        assert "aot_eager instead of inductor" in text and "172204" in text, text
