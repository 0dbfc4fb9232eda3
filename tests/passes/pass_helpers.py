"""What the pass tests share: running the analysis passes on a captured graph, and compiling a
variant with the dcp backend to read its record."""

from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx

import dcp_compile as dcp
from dcp_compile.compiler.graph_capture import capture_aten_graph
from dcp_compile.compiler.passes import ANALYSIS_PASSES, run_passes
from dcp_compile.compiler.passes.context import Analysis, PassContext
from dcp_compile.compiler.record import VariantRecord
from dcp_compile.variant import Variant

A2A = "torch.ops._c10d_functional.all_to_all_single.default("
SDPA = torch.ops.aten.scaled_dot_product_attention.default


def analyse(model: torch.nn.Module, *inputs: Any) -> tuple[fx.GraphModule, Analysis]:
    """The pre-dispatch ATen graph of ``model(*inputs)`` after the analysis passes (find_attention,
    sequence_dims), and what they found. No process group needed: nothing is sharded."""
    captured: dict[str, Any] = {}

    def backend(gm: fx.GraphModule, example_inputs: list[Any]):
        aten_gm, fake_inputs, fake_mode = capture_aten_graph(gm, example_inputs)
        ctx = PassContext(fake_inputs=fake_inputs, fake_mode=fake_mode)
        captured["graph"] = run_passes(aten_gm, ctx, ANALYSIS_PASSES)
        captured["analysis"] = ctx.analysis
        return gm.forward

    torch._dynamo.reset()
    torch.compile(model, backend=backend, dynamic=True, fullgraph=True)(*inputs)  # grad mode on, as in training
    torch._dynamo.reset()
    return captured["graph"], captured["analysis"]


def compile_variants(model: torch.nn.Module, inputs: tuple, variants: list[Variant],
                     sequence_lengths: list[int] | None = None) -> dict[Variant, VariantRecord]:
    """Compile ``model`` with the dcp backend (eager inner compiler; one dynamo trace) and build
    each of ``variants`` on ``inputs``: their records, with each pass's before/after graph text.
    A packed variant is called with ``sequence_lengths`` (the sequences packed in the one row)."""
    compiled = torch.compile(model, backend="dcp", dynamic=True, options={"inner": "eager", "sp_size": 2})
    records = {}
    for variant in variants:
        with dcp.use(variant, sequence_lengths=sequence_lengths if variant.packed else None):
            record = dcp.explain(compiled, *inputs)
        assert len(record) == 1, str(record)
        records[variant] = record[0].variants[variant]
    return records


def pass_record(variant: VariantRecord, name: str):
    (record,) = [p for p in variant.passes if p.name == name]
    return record


def call_targets(gm: fx.GraphModule) -> list[Any]:
    return [node.target for node in gm.graph.nodes if node.op == "call_function"]
