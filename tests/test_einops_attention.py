"""Attention written through einops (``rearrange``, ``repeat``, ``einops.einsum``, ``einops.reduce``
of a broadcast product) and einx: found, sharded at parity on 2 gloo ranks with no gather (issue
34). A sum of a broadcast product that is a batched matmul is read as one; a missed attention's
warning names the largest ``[..., S, S]`` product, its line, and the two forms dcp finds."""

from __future__ import annotations

import warnings

import einops
import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

import dcp_compile as dcp
from dcp_compile.compiler.passes.einsum_products import respell_summed_products
from dcp_compile.testing.process_world import run_in_process_world
from einops_attention import SigmoidAttention, Stack, activations, einops_worker

aten = torch.ops.aten


def _matmuls(gm: torch.fx.GraphModule) -> int:
    return len(list(gm.graph.find_nodes(op="call_function", target=aten.matmul.default)))


def test_summed_broadcast_products_are_read_as_matmuls():
    def scores_and_pooled(q: torch.Tensor, k: torch.Tensor, w: torch.Tensor) -> tuple:
        tokens_first = einops.rearrange(q, "b h i d -> b i 1 h d") * einops.rearrange(k, "b h j d -> b 1 j h d")
        scores = einops.reduce(tokens_first, "b i j h d -> b h i j", "sum")
        kept = (q.unsqueeze(-2) * k.unsqueeze(-3)).sum(-1, keepdim=True)  # [b, h, i, j, 1]
        pooled = (q * w[..., None]).sum(2)  # a weighted sum over the tokens: no free index on w's side
        return scores, kept, pooled

    inputs = (torch.randn(2, 3, 5, 4), torch.randn(2, 3, 5, 4), torch.randn(2, 3, 5))
    gm = make_fx(scores_and_pooled, tracing_mode="symbolic")(*inputs)
    expected = gm(*inputs)
    assert respell_summed_products(gm) == 2 and _matmuls(gm) == 2
    assert len(list(gm.graph.find_nodes(op="call_function", target=aten.sum.dim_IntList))) == 1  # the pooling
    for got, want in zip(gm(*inputs), expected):
        assert got.shape == want.shape and torch.allclose(got, want, atol=1e-5)


def _check(results: list[dict]) -> None:
    for rank_results in results:
        for name, result in rank_results.items():
            assert not result["problems"], "\n".join(result["problems"])
            # 2 layers at 2 lengths, both causal GQA attentions under the all-to-all, no gather
            assert result["sharded_sites"] == result["attention_sites"] == 4, (name, result)
            assert result["gathers"] == [], (name, result["gathers"])


def test_einops_attention_is_found_and_sharded_at_parity_with_no_gather():
    # einops.reduce of broadcast products, heads by the Rearrange layer, GQA by einops.repeat
    _check(run_in_process_world(einops_worker, 2, ["einops_reduce"], [8, 7], timeout=600))


@pytest.mark.slow
def test_einops_einsum_tokens_first_and_einx_attention_are_found_and_sharded():
    # einx's ops run in the graph whole (allow_in_graph) and read every size as an int: each
    # length is a graph of its own with a constant length (a recompile per length), sharded all the same.
    names = ["einops_einsum", "einops_reduce_tokens_first", "einx"]
    _check(run_in_process_world(einops_worker, 2, names, [8, 7], timeout=600))


def test_a_missed_attention_warning_names_the_largest_scores_product_and_the_remedy(fake_world):
    compiled = torch.compile(Stack(SigmoidAttention), backend="dcp", dynamic=True,
                             options={"sp_size": 2, "inner": "eager"})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dcp.explain(compiled, activations(12))
    messages = [str(w.message) for w in caught if "runs replicated on every rank" in str(w.message)]
    assert len(messages) == 1, messages
    message = messages[0]
    # the [b, 4, S, S] scores, not the single-head [b, S, S] gate before them; with the model line
    assert "the largest product pairing" in message and "einops_attention.py:" in message, message
    assert "`weights = torch.sigmoid(torch.matmul(q, k.transpose(-2, -1))" in message, message
    suspect = message.split("though ")[1].split(" ")[0]
    assert f"If {suspect} belongs to an attention" in message, message
    assert "torch.nn.functional.scaled_dot_product_attention(q, k, v" in message, message
    assert "torch.softmax(f(q @ k.transpose(-2, -1)), dim=-1) @ v" in message, message
