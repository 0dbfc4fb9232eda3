"""Attention in the spellings model libraries use by hand: ``einsum`` (any index names and
layouts), with a learned relative-position or an ALiBi bias, causal and bidirectional, and a q/k
normalisation by ``torch.linalg.vector_norm`` over the head dimension. Found, sharded at parity
on 2 gloo ranks with no gather at all; a model with no attention it recognises warns that it
runs replicated."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import dcp_compile as dcp
from attention_spellings import VARIANTS, spellings_worker
from dcp_compile.compiler.passes.einsum_products import parse_batched_product
from dcp_compile.testing.process_world import run_in_process_world


def test_einsum_equations_that_are_batched_matmuls():
    scores = parse_batched_product("b h i d, b h j d -> b h i j")
    assert (scores.batch, scores.free_left, scores.free_right, scores.contracted) == (("b", "h"), "i", "j", "d")
    assert parse_batched_product("bqhc,bkhc->bhqk").batch == ("b", "h")
    assert parse_batched_product("bsd,de->bse") is None  # a projection: two free indices on the left
    assert parse_batched_product("...id,...jd->...ij") is None  # an ellipsis needs the operands' ranks
    spelled = parse_batched_product("...id,...jd->...ij", (4, 4))
    assert (len(spelled.batch), spelled.free_left, spelled.free_right, spelled.contracted) == (2, "i", "j", "d")
    values = parse_batched_product("...hqk,...khd->...qhd", (4, 4))
    assert (len(values.batch), values.free_left, values.free_right, values.contracted) == (2, "q", "d", "k")
    assert parse_batched_product("...id,jd->...ij", (4, 2)) is None  # a broadcast over missing dims
    assert parse_batched_product("bhqd,bhkd->bhqk", (4, 4)).batch == ("b", "h")


def test_einsum_attention_is_found_and_sharded_at_parity_with_no_gather():
    results = run_in_process_world(spellings_worker, 2, list(VARIANTS), [8, 7], timeout=900)
    for rank_results in results:
        for name, result in rank_results.items():
            assert not result["problems"], "\n".join(result["problems"])
            # 2 layers at 2 lengths, every site under the all-to-all; the bias, the causal mask
            # and the vector-norm q/k normalisation cost no gather.
            assert result["sharded_sites"] == result["attention_sites"] == 4, (name, result)
            assert result["gathers"] == [], (name, result["gathers"])


class Recurrent(nn.Module):
    """A sequence model with no attention: a causal mixing by cumulative sums."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x).cumsum(1)


def test_a_model_without_attention_warns_that_it_runs_replicated(fake_world):
    compiled = torch.compile(Recurrent(), backend="dcp", dynamic=True, options={"sp_size": 2, "inner": "eager"})
    with pytest.warns(UserWarning, match="runs replicated on every rank"):
        dcp.explain(compiled, torch.randn(2, 12, 8))
