"""Data-dependent sizes (``nonzero``, boolean indexing) in graphs dcp compiles through AOTAutograd
and Inductor.

A boolean-mask write between attentions (GLM-Image's ``prior_embedding[prior_token_drop] *= 0.0``):
dynamo cuts the graph at the masked read (its output size depends on the data) and hands over a
graph that starts with the write, ``index_put`` with a boolean index. That op's gradient for the
written values is ``grad[mask]``, a ``nonzero`` the forward never ran: the joint trace raised
``DynamicOutputShapeException`` in dynamo's shape environment (plain ``torch.compile`` with
``aot_eager`` raises the same). Dynamo then either cut the graph again and ran the write as eager
code (here) or, in GLM-Image, raised ``BackendCompilerFailed``. dcp allows data-dependent output
sizes while it compiles (``dcp_compile/compiler/workarounds/dynamic_output_shapes.py``). Parity on two gloo
ranks under ``aot_eager`` (the joint trace is the same for Inductor), at a length the SP size
divides and one it does not; every attention of every graph sharded, no fallback, and one gather
with its reason: the write into ``prior``, an input of the second graph (known, not yet proven safe on
chunks).

Joint attention over ``nonzero``-selected text with Inductor (Mochi; slow tier): see
:func:`test_joint_attention_over_selected_text_compiles_with_inductor`.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dcp_compile.testing.process_world import run_in_process_world
from tests.test_data_dependent_text import TEXT, SelectedTextJointAttention
from tests.test_data_dependent_text import WIDTH as TEXT_WIDTH

WIDTH, HEADS = 16, 2
MASKED_WRITES = (torch.ops.aten.index_put_.default, torch.ops.aten.index_put.default)
WRITE_INTO_INPUT = ("all-gather of view before index_put_: written in place (index_put_ into a view of arg3_1) "
                    "where the write's source and target chunks are not proven to line up: the buffer runs on "
                    "the full sequence")


class MaskedWriteBetweenAttentions(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(32, WIDTH)
        self.qkv1, self.qkv2 = nn.Linear(WIDTH, 3 * WIDTH), nn.Linear(WIDTH, 3 * WIDTH)
        self.out = nn.Linear(WIDTH, WIDTH)

    @staticmethod
    def _attend(qkv: nn.Linear, x: torch.Tensor) -> torch.Tensor:
        q, k, v = qkv(x).unflatten(-1, (3, HEADS, -1)).permute(2, 0, 3, 1, 4).unbind(0)
        return F.scaled_dot_product_attention(q, k, v).transpose(1, 2).flatten(2)

    def forward(self, x: torch.Tensor, ids: torch.Tensor, drop: torch.Tensor) -> torch.Tensor:
        hidden = x + self._attend(self.qkv1, x)
        prior = self.embed(ids)
        prior[drop] *= 0.0  # a boolean-mask read (dynamo cuts here) and write
        hidden = hidden + prior
        return self.out(hidden + self._attend(self.qkv2, hidden))


def _worker(rank: int, world_size: int, lengths: tuple[int, ...]) -> list[dict]:
    import dcp_compile as dcp

    torch.manual_seed(0)
    model = MaskedWriteBetweenAttentions()
    compiled = torch.compile(model, backend="dcp", dynamic=True, options={"inner": "aot_eager", "sp_size": world_size})
    drop = torch.tensor([True, False])
    results = []
    for length in lengths:
        generator = torch.Generator().manual_seed(length)
        x, ids = torch.randn(2, length, WIDTH, generator=generator), torch.randint(0, 32, (2, length), generator=generator)
        model.zero_grad()
        expected = model(x, ids, drop)
        expected.square().mean().backward()
        eager_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        model.zero_grad()
        record = dcp.explain(compiled, x, ids, drop)
        actual = compiled(x, ids, drop)
        actual.square().mean().backward()
        dcp.sync_gradients(model)
        variants = [v for graph in record.graphs for v in graph.variants.values()]
        results.append({
            "length": length,
            "output_error": (actual - expected).abs().max().item(),
            "grad_error": max((model.get_parameter(n).grad - g).abs().max().item() for n, g in eager_grads.items()),
            "sites": [(v.sp_size, len(v.sharded_sites), v.attention_sites) for v in variants],
            "fallbacks": [v.inner_fallback for v in variants if v.inner_fallback],
            "gathers": [str(g) for v in variants for g in v.gathers],
            # Before the fix dynamo caught the backend's exception and ran the write as eager code.
            "masked_writes": sum(node.target in MASKED_WRITES for graph in record.graphs for node in graph.graph.graph.nodes),
        })
    return results


@pytest.mark.slow
def test_masked_write_between_attentions_compiles_sharded_at_parity():
    for per_length in run_in_process_world(_worker, 2, (12, 7), timeout=600):
        for result in per_length:
            assert result["masked_writes"] == 1, result  # compiled by dcp, not run as eager code
            assert sorted(result["sites"]) == [(2, 1, 1), (2, 1, 1)], result  # each attention sharded
            assert result["fallbacks"] == [], result
            # One gather, by default deny: the write lands in a graph input (``prior``, made by the
            # graph before the cut), which the caller could read after the graph; on chunks it would
            # hold only this rank's rows. Under whole-graph compiles dynamo happened to give the
            # masked read's length its own symbol, so the value read as no sequence and nothing was
            # gathered; regions see the graph plain torch.compile sees (one duck-sized length).
            assert result["gathers"] == [WRITE_INTO_INPUT], result
            assert result["output_error"] < 1e-5 and result["grad_error"] < 1e-5, result


class FourHeadSelectedTextJointAttention(SelectedTextJointAttention):
    """Mochi's joint attention over each sample's ``nonzero``-selected text, with 4 heads: the SP
    size divides them, so the image chunk goes to the all-to-all as it is, a slice of
    ``[image chunk | u text]`` whose head stride holds the unbacked ``u``."""

    def _heads(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return x.unflatten(2, (3, 4, -1)).permute(2, 0, 3, 1, 4).unbind(0)


def _joint_worker(rank: int, world_size: int, lengths: tuple[int, ...], inner: str) -> list[dict]:
    import dcp_compile as dcp

    torch._dynamo.config.capture_dynamic_output_shape_ops = True  # this process only
    torch.manual_seed(0)
    model = FourHeadSelectedTextJointAttention()
    compiled = torch.compile(model, backend="dcp", dynamic=True, options={"inner": inner, "sp_size": world_size})
    results = []
    for length in lengths:
        generator = torch.Generator().manual_seed(length)
        video, text = torch.randn(2, length, TEXT_WIDTH, generator=generator), torch.randn(2, TEXT, TEXT_WIDTH, generator=generator)
        text_mask = torch.ones(2, TEXT, dtype=torch.bool)
        text_mask[1, -2:] = False
        model.zero_grad()
        expected = model(video, text, text_mask)
        sum(out.square().mean() for out in expected).backward()
        eager_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        model.zero_grad()
        record = dcp.explain(compiled, video, text, text_mask)
        actual = compiled(video, text, text_mask)
        sum(out.square().mean() for out in actual).backward()
        dcp.sync_gradients(model)
        variants = [v for graph in record.graphs for v in graph.variants.values()]
        results.append({
            "length": length,
            "output_error": max((a - e).abs().max().item() for a, e in zip(actual, expected)),
            "grad_error": max((model.get_parameter(n).grad - g).abs().max().item() for n, g in eager_grads.items()),
            "sites": [(v.sp_size, len(v.sharded_sites), v.attention_sites) for v in variants],
            "fallbacks": [v.inner_fallback for v in variants if v.inner_fallback],
            "gathers": [str(g) for v in variants for g in v.gathers],
        })
    return results


@pytest.mark.slow
def test_joint_attention_over_selected_text_traced_by_aot_autograd_on_every_rank():
    """Before ``ulysses._segments`` gathered the segments of an unbacked joint length by position,
    the last rank's AOTAutograd trace gave a slice a new unbacked size and raised on the attention
    (``Eq(u7 + 12, 0)``); rank 0 passed."""
    for per_length in run_in_process_world(_joint_worker, 2, (12, 7), "aot_eager", timeout=900):
        for result in per_length:
            assert result["sites"] == [(2, 2, 2)], result  # both samples' joint attentions sharded
            assert result["fallbacks"] == [] and result["gathers"] == [], result
            assert result["output_error"] < 1e-5 and result["grad_error"] < 1e-5, result


@pytest.mark.slow
def test_joint_attention_over_selected_text_compiles_with_inductor():
    """Every rank compiles forward and backward with Inductor. Before ``ulysses._segments``, rank
    0's forward raised ``GuardOnDataDependentSymNode`` (``Ne(6*u4 + 36, 36)``) on the view of the
    sliced chunk. Before the last rank's own chunk was one division (``S // 2``, not
    ``S - (S + 1) // 2``; ``sequence_chunks.chunk_length``), its backward (a slice of the model's
    own ``cat`` of its chunk and the selected text) raised ``Min(0, S + u - (S + 1)//2) < 0``:
    value ranges could not show the chunk non-negative, and the backward ran under ``aot_eager``."""
    outcomes = run_in_process_world(_joint_worker, 2, (12, 7), "inductor", timeout=1500)
    for per_length in outcomes:
        for result in per_length:
            assert result["sites"] == [(2, 2, 2)], result
            assert result["fallbacks"] == [] and result["gathers"] == [], result
            assert result["output_error"] < 1e-5 and result["grad_error"] < 1e-5, result
