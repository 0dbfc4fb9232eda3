"""The ``dcp`` backend for ``torch.compile``.

``torch.compile(model, backend="dcp", dynamic=True, options={...})`` finds ``dcp_backend`` through
the ``torch_dynamo_backends`` entry point. For each graph dynamo hands over, the backend
re-traces it to ATen once, runs the analysis passes once (attention sites, sequence
dimensions), and returns a ``Dispatcher`` that builds and compiles a variant per
(SP size, recompute policy) on first use.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.fx as fx

from dcp_compile.compiler.dispatcher import Dispatcher
from dcp_compile.compiler.workarounds.free_integers import (
    IntegerSpecializations, describe, free_integer_inputs, input_names, specialized_inputs, value_without_guard,
)
from dcp_compile.compiler.graph_capture import capture_aten_graph, retrace
from dcp_compile.compiler.inspection import snapshots_requested
from dcp_compile.compiler.options import parse_options
from dcp_compile.compiler.progress import AnalysedGraph, NewGraph, compiling, report_compiled
from dcp_compile.compiler.passes import ANALYSIS_PASSES, VARIANT_PASSES, run_passes
from dcp_compile.compiler.passes.context import Analysis, PassContext
from dcp_compile.compiler.passes.shard_sequence import SCALAR_READS
from dcp_compile.compiler.record import GraphRecord
from dcp_compile.compiler.workarounds.specialised_sizes import new_graph_reason, remember
from dcp_compile.compiler.variant_selection import active_variant
from dcp_compile.runtime.process_groups import create_sp_groups

log = logging.getLogger(__name__)

_graph_ids = itertools.count()


def dcp_backend(gm: fx.GraphModule, example_inputs: list[Any],
                options: dict[str, Any] | None = None) -> Dispatcher | IntegerSpecializations:
    """Dynamo backend entry point (registered as ``"dcp"`` through the package's entry point)."""
    parsed = parse_options(options)
    start = time.perf_counter()
    if dist.is_available() and dist.is_initialized():
        # Every rank compiles the same graphs in the same order: create the SP groups here, so
        # that ranks choosing different variants later never wait on each other in new_group.
        create_sp_groups(extra_sizes=[b.variant.sp_size for b in parsed.buckets] + [parsed.sp_size or 1])
    why = new_graph_reason(gm, example_inputs)  # another graph of a function compiled before: why
    with compiling("a graph from dynamo", "ATen re-trace"):
        aten_gm, fake_inputs, fake_mode = capture_aten_graph(gm, example_inputs)
    free = free_integer_inputs(fake_inputs)
    if not free:
        dispatcher = analysed_dispatcher(aten_gm, fake_inputs, fake_mode, example_inputs, parsed, start, why=why)
        remember_graph(gm, example_inputs, dispatcher)
        return dispatcher
    names = input_names(gm, free)

    def build(key: tuple[int | None, ...]) -> Dispatcher:
        if all(value is None for value in key):
            return analysed_dispatcher(aten_gm, fake_inputs, fake_mode, example_inputs, parsed, time.perf_counter(),
                                       why=why)
        began = time.perf_counter()
        inputs = specialized_inputs(fake_inputs, free, key)
        specialised = retrace(fx.Interpreter(aten_gm).run, inputs, fake_mode)
        return analysed_dispatcher(specialised, inputs, fake_mode, example_inputs, parsed, began,
                                   specialization=describe(names, key), why=why)

    specializations = IntegerSpecializations(free, names, build)
    # Built now, inside dynamo's compile, like a static variant (see analysed_dispatcher).
    first = specializations.dispatcher_for([value_without_guard(example_inputs[i]) for i in free])
    remember_graph(gm, example_inputs, first)
    return specializations


def remember_graph(gm: fx.GraphModule, example_inputs: list[Any], dispatcher: Dispatcher) -> None:
    """Keep the graph's input sizes: a later graph of the same function is told apart by them."""
    sequence = dispatcher.analysis.sequence
    remember(gm, example_inputs, dispatcher.record.graph_id, sequence.length if sequence is not None else None)


def analysed_dispatcher(aten_gm: fx.GraphModule, fake_inputs: list[Any], fake_mode: Any, example_inputs: list[Any],
                        parsed: Any, start: float, specialization: str | None = None,
                        why: str | None = None) -> Dispatcher:
    """Run the analysis passes once on ``aten_gm`` and wrap it in a dispatcher of variants; ``why``:
    why dynamo handed over another graph of a function compiled before (specialised_sizes)."""
    record = GraphRecord(next(_graph_ids), specialization=specialization, new_graph_reason=why)
    if why is not None:
        report_compiled(NewGraph(record.graph_id, why))
    # Parameters' gradients stay partial (summed by the user's gradient sync); other inputs that
    # require grad get their full gradient on every rank (see collectives.replicated_input).
    analysis = Analysis(
        parameter_indices=frozenset(
            index for index, value in enumerate(example_inputs) if isinstance(value, torch.nn.Parameter)
        ),
        scalar_inputs=scalar_inputs(aten_gm),
    )
    ctx = PassContext(fake_inputs=fake_inputs, fake_mode=fake_mode, record=record, analysis=analysis,
                      snapshots=snapshots_requested())
    with compiling(f"graph {record.graph_id}", "analysis passes"):
        analysed = run_passes(aten_gm, ctx, ANALYSIS_PASSES, graph_id=record.graph_id,
                              disabled=parsed.disable_passes, debug_dir=parsed.debug_dir,
                              records=record.analysis_passes)
    sequence = analysis.sequence
    record.attention_sites = [site.describe() for site in analysis.attention_sites]
    record.sequence_length = str(sequence.length) if sequence is not None and sequence.length is not None else None
    record.classification = sequence.table() if sequence is not None else []
    record.graph = analysed
    record.trace_seconds = time.perf_counter() - start
    report_compiled(AnalysedGraph(record.graph_id, len(record.attention_sites), record.trace_seconds))
    dispatcher = Dispatcher(parsed, record, analysed, analysis, fake_inputs, fake_mode, VARIANT_PASSES)
    if not parsed.buckets and active_variant() is None:
        # Static mode has exactly one variant: build it now, inside dynamo's compile. Without the
        # guards its compile adds: they ask about this rank's chunk ("is it 1?"), so a rank with a
        # shorter last chunk would recompile alone, and a length would re-trace. The variant serves
        # every length, as the variants of buckets and dcp.use plans do (compiled on first use,
        # after dynamo installed its guards; the static variant only if a micro-batch runs it).
        with without_guards(fake_mode):
            dispatcher.compile_variant(dispatcher.static_variant, dispatcher.scalars_of(example_inputs))
    return dispatcher


def without_guards(fake_mode: Any) -> contextlib.AbstractContextManager:
    shape_env = getattr(fake_mode, "shape_env", None)
    return shape_env.suppress_guards() if shape_env is not None else contextlib.nullcontext()


def scalar_inputs(gm: fx.GraphModule) -> tuple[int, ...]:
    """Positions of the 0-d floating-point inputs the graph reads only as Python scalars."""
    positions = []
    for index, placeholder in enumerate(gm.graph.find_nodes(op="placeholder")):
        value = placeholder.meta.get("val")
        if (isinstance(value, torch.Tensor) and value.dim() == 0 and value.is_floating_point()
                and placeholder.users and all(user.target in SCALAR_READS for user in placeholder.users)):
            positions.append(index)
    return tuple(positions)
