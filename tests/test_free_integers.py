"""Integer inputs that no tensor size explains get a graph of their own at 0 and 1
(``compiler/workarounds/free_integers``).

A graph break ahead of a model's body hands an ``int`` argument over as a symbolic input of its
own (Hugging Face's ``logits_to_keep=0``): ``h[:, -keep:]`` is then a slice with an unknown
start, which the passes could only gather. Compiled for the value 0 the slice is the whole
sequence and stays sharded; 3 stays symbolic, a tail the passes gather correctly. Parity on two
gloo ranks at both values, the sharding of each, and which values get a graph of their own.
"""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dcp_compile.compiler.workarounds.free_integers import IntegerSpecializations
from dcp_compile.testing.process_world import run_in_process_world


class KeepLastLogits(nn.Module):
    """One causal attention block and an LM head over the last ``keep`` positions (0: all)."""

    def __init__(self, vocab: int = 64, hidden: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.head = nn.Linear(hidden, vocab)
        self.heads = heads

    def forward(self, ids: torch.Tensor, keep: int = 0) -> torch.Tensor:
        torch._dynamo.graph_break()  # as logging in transformers' forward does: `keep` arrives symbolic
        h = self.embed(ids)
        b, s, d = h.shape
        q, k, v = self.qkv(h).view(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        h = h + F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, d)
        return self.head(h[:, -keep:])


def _worker(rank: int, world_size: int) -> dict:
    import dcp_compile as dcp

    torch.manual_seed(0)
    model = KeepLastLogits()
    compiled = torch.compile(model, backend="dcp", dynamic=True, options={"inner": "eager", "sp_size": world_size})
    ids = torch.randint(0, 64, (2, 11), generator=torch.Generator().manual_seed(1))
    out: dict = {}
    for keep in (0, 3):
        model.zero_grad()
        expected = model(ids, keep)
        expected.square().mean().backward()
        eager_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        model.zero_grad()
        records = dcp.explain(compiled, ids, keep)
        actual = compiled(ids, keep)
        actual.square().mean().backward()
        dcp.sync_gradients(model)  # the SP group's partial gradients summed: full-batch gradients
        torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-6)
        for name, p in model.named_parameters():
            torch.testing.assert_close(p.grad, eager_grads[name], rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")
        (record,) = [r for r in records.graphs if r.attention_sites]
        (variant,) = [v for v in record.variants.values() if v.sp_size > 1]
        out[keep] = {"specialization": record.specialization, "sharded": len(variant.sharded_sites),
                     "gathers": len(variant.gathers), "fallback": variant.fallback_reason}
    return out


def test_a_free_integer_is_compiled_per_value_sharded_and_at_parity() -> None:
    results = run_in_process_world(_worker, 2, timeout=600)
    for result in results:
        assert result[0]["specialization"] == "L_keep_=0", result
        assert result[0]["fallback"] is None and result[0]["sharded"] == 1 and result[0]["gathers"] == 0, result
        # 3 stays symbolic: a slice with a start the passes cannot place, gathered, attention still sharded.
        assert result[3]["specialization"] is None, result
        assert result[3]["fallback"] is None and result[3]["sharded"] == 1 and result[3]["gathers"] <= 1, result


def test_only_zeros_and_ones_are_baked_in_and_past_the_limit_the_symbolic_graph_serves() -> None:
    built: list[tuple] = []

    def build(key: tuple):
        built.append(key)
        return lambda *args: key

    specializations = IntegerSpecializations((1, 2), ("L_keep_", "L_frames_"), build, limit=2)
    calls = [(0, 7), (0, 9), (1, 1), (5, 6), (0, 1), (1, 8)]
    answers = [specializations("x", a, b) for a, b in calls]
    # 7, 9, 5, 6 and 8 never get a graph of their own; (0, 1) and (1, 8) would be third and fourth
    # 0/1 combinations, past the limit of 2, so the symbolic graph serves them.
    assert answers == [(0, None), (0, None), (1, 1), (None, None), (None, None), (None, None)]
    assert built == [(0, None), (1, 1), (None, None)]


def test_the_limit_warns_once(caplog: pytest.LogCaptureFixture) -> None:
    specializations = IntegerSpecializations((0,), ("L_keep_",), lambda key: (lambda *args: key), limit=1)
    with caplog.at_level(logging.WARNING, logger="dcp_compile.compiler.workarounds.free_integers"):
        answers = [specializations(keep) for keep in (0, 1, 1, 0)]
    assert answers == [(0,), (None,), (None,), (0,)]
    assert len([r for r in caplog.records if "more than 1 combinations" in r.getMessage()]) == 1
