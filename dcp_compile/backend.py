"""The ``dcp`` backend for ``torch.compile``.

``torch.compile(model, backend="dcp", dynamic=True, options={...})`` finds ``dcp_backend`` through
the ``torch_dynamo_backends`` entry point. For each graph dynamo hands over, the backend
re-traces it to ATen once, runs the analysis passes once (attention sites, sequence
dimensions), and returns a ``Dispatcher`` that builds and compiles a variant per
(SP size, recompute policy) on first use.
"""

from __future__ import annotations

import itertools
import logging
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.fx as fx

from dcp_compile.config import parse_options
from dcp_compile.dispatcher import Dispatcher
from dcp_compile.graph_capture import capture_aten_graph
from dcp_compile.passes.context import PassContext
from dcp_compile.passes.find_attention import find_attention_pass
from dcp_compile.passes.insert_all_to_all import insert_all_to_all_pass
from dcp_compile.passes.pass_runner import run_passes
from dcp_compile.passes.recompute import recompute_pass
from dcp_compile.passes.sequence_dims import sequence_dims_pass
from dcp_compile.passes.shard_sequence import shard_sequence_pass
from dcp_compile.passes.use_varlen_attention import use_varlen_attention_pass
from dcp_compile.process_groups import create_sp_groups
from dcp_compile.record import GraphRecord

log = logging.getLogger(__name__)

ANALYSIS_PASSES = [find_attention_pass, sequence_dims_pass]
VARIANT_PASSES = [shard_sequence_pass, insert_all_to_all_pass, use_varlen_attention_pass, recompute_pass]

_graph_ids = itertools.count()

# Variants compile lazily, outside dynamo's frame, where a graph with symbolic floats (dynamo's
# default for float attributes such as a norm's eps) cannot be "tensorified" (that needs dynamo
# to restart its analysis). Floats are therefore specialized, as they were before torch 2.6: a
# changed float recompiles through dynamo's guards instead.
torch._dynamo.config.specialize_float = True


def dcp_backend(gm: fx.GraphModule, example_inputs: list[Any], options: dict[str, Any] | None = None) -> Dispatcher:
    """Dynamo backend entry point (registered as ``"dcp"`` through the package's entry point)."""
    parsed = parse_options(options)
    start = time.perf_counter()
    if dist.is_available() and dist.is_initialized():
        # Every rank compiles the same graphs in the same order: create the SP groups here, so
        # that ranks choosing different variants later never wait on each other in new_group.
        create_sp_groups(extra_sizes=[b.variant.sp_size for b in parsed.buckets] + [parsed.sp_size or 1])
    record = GraphRecord(next(_graph_ids))
    aten_gm, fake_inputs, fake_mode = capture_aten_graph(gm, example_inputs)
    ctx = PassContext(fake_inputs=fake_inputs, fake_mode=fake_mode, record=record)
    # Parameters' gradients stay partial (summed by the user's gradient sync); other inputs that
    # require grad get their full gradient on every rank (see collectives.replicated_input).
    ctx.analysis["parameter_indices"] = {
        index for index, value in enumerate(example_inputs) if isinstance(value, torch.nn.Parameter)
    }
    analysed = run_passes(aten_gm, ctx, ANALYSIS_PASSES, graph_id=record.graph_id,
                          disabled=parsed.disable_passes, debug_dir=parsed.debug_dir,
                          records=record.analysis_passes)
    sites = ctx.analysis.get("attention_sites", [])
    sequence = ctx.analysis.get("sequence")
    record.attention_sites = [site.describe() for site in sites]
    record.sequence_length = str(sequence.length) if sequence is not None and sequence.length is not None else None
    record.classification = sequence.table() if sequence is not None else []
    record.trace_seconds = time.perf_counter() - start
    dispatcher = Dispatcher(parsed, record, analysed, ctx.analysis, fake_inputs, fake_mode, VARIANT_PASSES)
    if not parsed.buckets:
        # Static mode has exactly one variant: build it now, inside dynamo's compile, so that
        # any guard the inner compiler adds is installed by dynamo.
        dispatcher.compile_variant(dispatcher.static_variant)
    return dispatcher
