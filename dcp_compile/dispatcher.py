"""The callable dynamo gets back: picks a variant per call and runs its compiled graph.

One dynamo trace serves every length; this object is what makes different lengths run different
variants. Per call it reads the active ``dcp.use`` plan, or else the batch's attention length and
the bucket table, or else the static variant; then one dictionary lookup finds the compiled
variant. Variants compile lazily, on the first call that needs them, from the one symbolic graph.
"""

from __future__ import annotations

import copy
import logging
import threading
import time
from typing import Any, Callable

import sympy
import torch
import torch.distributed as dist
import torch.fx as fx
from torch._functorch import config as functorch_config

from dcp_compile.config import DCPOptions
from dcp_compile.inner_compilers import INNER_COMPILERS
from dcp_compile.passes.context import PassContext
from dcp_compile.passes.pass_runner import is_disabled, run_passes
from dcp_compile.process_groups import sp_group
from dcp_compile.record import GraphRecord, VariantRecord
from dcp_compile.variants import BucketTable, Variant, active_sequence_boundaries, active_variant

log = logging.getLogger(__name__)

_collectors = threading.local()


def collecting_records() -> list[GraphRecord] | None:
    return getattr(_collectors, "records", None)


def make_length_reader(length: Any, fake_inputs: list[Any]) -> Callable[[tuple], int] | None:
    """A function from the runtime arguments to the attention length, built once."""
    if length is None:
        return None
    locations: dict[sympy.Symbol, Callable[[tuple], int]] = {}
    for index, value in enumerate(fake_inputs):
        if isinstance(value, torch.SymInt) and isinstance(value.node.expr, sympy.Symbol):
            locations.setdefault(value.node.expr, lambda args, i=index: int(args[i]))
        elif isinstance(value, torch.Tensor):
            for dim, size in enumerate(value.shape):
                if isinstance(size, torch.SymInt) and isinstance(size.node.expr, sympy.Symbol):
                    locations.setdefault(size.node.expr, lambda args, i=index, d=dim: args[i].shape[d])
    if isinstance(length, sympy.Integer):
        constant = int(length)
        return lambda args: constant
    if isinstance(length, sympy.Symbol) and length in locations:
        return locations[length]
    symbols = list(length.free_symbols)
    if not all(symbol in locations for symbol in symbols):
        return None
    readers = [locations[symbol] for symbol in symbols]

    def read(args: tuple) -> int:
        values = {symbol: sympy.Integer(reader(args)) for symbol, reader in zip(symbols, readers)}
        return int(length.xreplace(values))

    return read


def world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


class Dispatcher:
    def __init__(self, options: DCPOptions, record: GraphRecord, analysed: fx.GraphModule,
                 analysis: dict[str, Any], fake_inputs: list[Any], fake_mode: Any,
                 variant_passes: list[Callable]):
        self.options = options
        self.record = record
        self.analysed = analysed
        self.analysis = analysis
        self.fake_inputs = fake_inputs
        self.fake_mode = fake_mode
        self.variant_passes = variant_passes
        self.compiled: dict[Variant, Callable] = {}
        sequence = analysis.get("sequence")
        self.read_length = make_length_reader(sequence.length if sequence else None, fake_inputs)
        self.buckets = BucketTable(list(options.buckets))
        self.static_variant = Variant(options.sp_size or world_size(), options.recompute, options.memory_budget)

    def select(self, args: tuple) -> tuple[Variant, str]:
        variant = active_variant()
        if variant is not None:
            return variant, "dcp.use"
        if self.buckets:
            if self.read_length is None:
                return self.buckets.buckets[-1].variant, "no attention length: last bucket"
            length = self.read_length(args)
            bucket = self.buckets.select(length)
            return bucket.variant, f"bucket max_len={bucket.max_len}"
        return self.static_variant, "static"

    def __call__(self, *args: Any) -> Any:
        variant, reason = self.select(args)
        compiled = self.compiled.get(variant)
        if compiled is None:
            compiled = self.compile_variant(variant)
        variant_record = self.record.variants[variant]
        variant_record.calls += 1
        self.record.dispatches.append((self.read_length(args) if self.read_length and reason != "static" else "-", str(variant), reason))
        records = collecting_records()
        if records is not None and self.record not in records:
            records.append(self.record)
        if variant.packed:
            return compiled(*args, active_sequence_boundaries())
        return compiled(*args)

    def compile_variant(self, variant: Variant) -> Callable:
        start = time.perf_counter()
        group = sp_group(variant.sp_size)
        variant_record = VariantRecord(variant)
        rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        variant_record.debug_path = f"rank{rank}/graph{self.record.graph_id}/{variant}".replace('/recompute=', '_recompute=')
        self.record.variants[variant] = variant_record
        ctx = PassContext(
            fake_inputs=self.fake_inputs, fake_mode=self.fake_mode, sp_size=variant.sp_size,
            rank=group.rank, group_name=group.group_name if variant.sp_size > 1 else None,
            recompute=variant.recompute, memory_budget=variant.memory_budget, packed=variant.packed,
            record=self.record, variant_record=variant_record, analysis=self.analysis,
        )
        passes = self.variant_passes if variant.sp_size > 1 else [p for p in self.variant_passes if getattr(p, "runs_without_sharding", False)]
        analysed = self.analysed
        enabled = [p for p in passes if not is_disabled(p, self.options.disable_passes)]
        if not (enabled and getattr(enabled[0], "returns_new_graph", False)):
            # Later passes edit in place (recompute tags, varlen attention): without a pass that
            # re-traces first, a variant works on its own copy of the shared analysed graph (node
            # meta copied shallowly: fake values shared, tags not). The analysis refers to the
            # original nodes, which only the re-tracing pass reads.
            analysed = fx.GraphModule(self.analysed, copy.deepcopy(self.analysed.graph))
        gm = run_passes(
            analysed, ctx, passes, variant=str(variant), disabled=self.options.disable_passes,
            graph_id=self.record.graph_id, debug_dir=self.options.debug_dir, records=variant_record.passes,
        )
        variant_record.graph = gm
        variant_record.collectives = count_collectives(gm)
        inner = INNER_COMPILERS[self.options.inner]
        budget = variant.memory_budget if variant.recompute == "selective" else 1.0
        with functorch_config.patch(activation_memory_budget=budget):
            compiled = inner(gm, ctx.fake_inputs, variant_record)
        self.compiled[variant] = compiled
        variant_record.compile_seconds = time.perf_counter() - start
        log.info("dcp: graph %d variant %s compiled in %.2fs (%s)", self.record.graph_id, variant,
                 variant_record.compile_seconds, self.options.inner)
        return compiled


def count_collectives(gm: fx.GraphModule) -> dict[str, int]:
    counts: dict[str, int] = {}
    for node in gm.graph.nodes:
        if node.op == "call_function" and "_c10d_functional" in str(node.target) and "wait_tensor" not in str(node.target):
            name = str(node.target).split(".")[-2] if str(node.target).count(".") >= 2 else str(node.target)
            counts[name] = counts.get(name, 0) + 1
    return counts
