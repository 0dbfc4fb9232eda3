"""Graphs with no attention: a piece of a model's forward cut off by a graph break (a timestep
embedding before the blocks, a loss after them) says why it has none and stays quiet; a graph
that could hold an attention the finder missed, or a whole model without attention, warns that it
runs replicated (issue 24)."""

from __future__ import annotations

import warnings

import torch
import torch.nn as nn
import torch.nn.functional as F

import dcp_compile as dcp
from dcp_compile.compiler.passes.no_attention import explain_no_attention

REPLICATED = "runs replicated on every rank"


class PreludeBreakBlocks(nn.Module):
    """An embedding computed in one graph (a graph break ends it), attention in the next."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(8, 16)
        self.qkv = nn.Linear(16, 48)
        self.out = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.silu(self.embed(x))
        torch._dynamo.graph_break()  # as a model's data-dependent Python would
        b, n, _ = h.shape
        q, k, v = self.qkv(h).view(b, n, 3, 2, 8).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v)
        return self.out(a.transpose(1, 2).reshape(b, n, 16))


def _explained(model: nn.Module, *inputs: torch.Tensor) -> tuple[dcp.compiler.record.ModelRecord, list[str]]:
    compiled = torch.compile(model, backend="dcp", dynamic=True, options={"sp_size": 2, "inner": "eager"})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        record = dcp.explain(compiled, *inputs)
    return record, [str(w.message) for w in caught if REPLICATED in str(w.message)]


def test_a_graph_break_piece_without_attention_says_why_and_stays_quiet(fake_world):
    record, replicated_warnings = _explained(PreludeBreakBlocks(), torch.randn(2, 11, 8))
    without = [graph for graph in record.graphs if not graph.attention_sites]
    with_attention = [graph for graph in record.graphs if graph.attention_sites]
    assert len(without) == 1 and len(with_attention) == 1, [str(graph) for graph in record.graphs]
    summary = [line for line in record.summary_lines() if f"graph {without[0].graph_id} " in line]
    assert summary and all("none was missed" in line and "graph break" in line for line in summary), summary
    assert replicated_warnings == []  # parameters and a dynamic length, but a piece of a model with attention


def test_a_missed_attention_warns_naming_the_suspect():
    # softmax(q @ k^T) with a transposed value product the finder does not take as attention: a suspect.
    def scores_only(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        return torch.softmax(q @ k.transpose(-1, -2), dim=-1).sum(-1)

    from torch.fx.experimental.proxy_tensor import make_fx

    gm = make_fx(scores_only, tracing_mode="symbolic")(torch.randn(2, 9, 4), torch.randn(2, 9, 4))
    finding = explain_no_attention(gm)
    assert finding.suspect is not None and "could be one" in finding.reason
    assert finding.should_warn(whole_model_with_sequence=False)  # even in a piece of a model


def test_a_token_local_piece_is_not_a_suspect():
    from torch.fx.experimental.proxy_tensor import make_fx

    gm = make_fx(lambda x, w: F.layer_norm(F.silu(x @ w), (4,)).log_softmax(-1), tracing_mode="symbolic")(
        torch.randn(2, 9, 4), torch.randn(4, 4))
    finding = explain_no_attention(gm)
    assert finding.suspect is None and finding.piece is None and "none was missed" in finding.reason
    assert finding.should_warn(whole_model_with_sequence=True)  # a whole model without attention still warns


def test_a_submodule_frame_called_from_resumed_code_is_a_piece():
    """A submodule whose forward dynamo compiles as a frame of its own (HunyuanVideo 1.5's adaLN
    norm, called eagerly from its parent's code after a graph break) holds no attention either:
    the parent's resumed code is among the callers of the compile."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from dcp_compile.compiler.passes.no_attention import graph_piece

    gm = make_fx(lambda x, w: F.layer_norm(x @ w, (4,)), tracing_mode="symbolic")(torch.randn(2, 9, 4), torch.randn(4, 4))
    assert graph_piece(gm) is None

    def torch_dynamo_resume_in_forward_at_7():  # the name dynamo gives the code after a break
        return graph_piece(gm), explain_no_attention(gm)

    piece, finding = torch_dynamo_resume_in_forward_at_7()
    assert piece is not None and "resumed forward_at_7" in piece
    assert not finding.should_warn(whole_model_with_sequence=True) and piece in finding.reason


def test_a_submodule_frame_run_from_an_eager_parent_forward_is_a_piece():
    """Z-Image's and HiDream's blocks: dynamo runs the parent's forward eagerly inside the compiled
    call (after a break it could not resume from) and compiles each submodule's frame alone. A
    model's ``forward`` between the graph's compile and the compiled call's entry says so."""
    import os

    from torch.fx.experimental.proxy_tensor import make_fx

    from dcp_compile.compiler.passes.no_attention import graph_piece

    gm = make_fx(lambda x, w: F.layer_norm(x @ w, (4,)), tracing_mode="symbolic")(torch.randn(2, 9, 4), torch.randn(4, 4))

    class Parent(nn.Module):
        def forward(self) -> tuple:
            return graph_piece(gm), explain_no_attention(gm)

    assert Parent()()[0] is None  # a module called outside any compiled call: a whole frame
    namespace = {"parent": Parent()}
    # the compiled call's entry, as dynamo's eval_frame.py wraps the model's __call__
    exec(compile("def _fn():\n    return parent()\n", os.path.join("torch", "_dynamo", "eval_frame.py"), "exec"), namespace)
    piece, finding = namespace["_fn"]()
    assert piece is not None and "Parent.forward, run eagerly inside the compiled call" in piece
    assert not finding.should_warn(whole_model_with_sequence=True)
