"""The callable dynamo gets back: picks a variant per call and runs its compiled graph.

One dynamo trace serves every length; this object is what makes different lengths run different
variants. Per call it reads the active ``dcp.use`` plan, or else the batch's attention length and
the bucket table, or else the static variant; then one dictionary lookup finds the compiled
variant. Variants compile lazily, on the first call that needs them, from the one symbolic graph.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import logging
import time
from typing import Any, Callable, Iterator

import sympy
import torch
import torch.distributed as dist
import torch.fx as fx

from dcp_compile.compiler.options import DCPOptions
from dcp_compile.compiler.inner_compilers import INNER_COMPILERS, floats_already_specialized
from dcp_compile.compiler.inspection import collecting_records, snapshots_requested
from dcp_compile.compiler.key_value_outputs import find_returned_key_values, warn_once_if_key_values_returned
from dcp_compile.compiler.progress import (
    CompiledVariant, RegionsCompiledAgain, compile_stage, compiling, report_compiled,
)
from dcp_compile.compiler.passes.context import Analysis, PassContext
from dcp_compile.compiler.passes.pipeline import GraphInput, GraphPass, run_passes
from dcp_compile.runtime.consistency import PendingCheck, SettledAfterCall, check_sp_group_agrees
from dcp_compile.runtime.graph_parameters import note_graph_call, note_graph_outputs
from dcp_compile.runtime.process_groups import current_world, sp_group
from dcp_compile.compiler.record import GraphRecord, RegionCompiles, VariantRecord
from dcp_compile.compiler.regions import (
    INNER_REGION_COMPILERS, REGIONAL_POLICIES, counting_kept_for_backward, describe_regions, regional_module,
    whole_graph_reason,
)
from dcp_compile.compiler.self_check import check_first_call
from dcp_compile.compiler.variant_selection import BucketTable, active_sequence_boundaries, active_variant
from dcp_compile.compiler.passes.use_varlen_attention import packed_sites
from dcp_compile.compiler.workarounds.trace_hints import traced_with_room
from dcp_compile.kernels.attention_choice import VarlenKernel, choose_packed_attention
from dcp_compile.variant import Variant

log = logging.getLogger(__name__)

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
                 analysis: Analysis, fake_inputs: list[Any], fake_mode: Any,
                 variant_passes: tuple[GraphPass, ...]):
        self.options = options
        self.record = record
        self.analysed = analysed
        self.analysis = analysis
        self.fake_inputs = fake_inputs
        self.fake_mode = fake_mode
        self.variant_passes = variant_passes
        # Keyed by the variant and the values of the graph's scalar inputs (baked per compile).
        self.compiled: dict[tuple[Variant, tuple[float, ...]], Callable] = {}
        self.world: object | None = current_world()  # the world self.compiled's collectives belong to
        self.added_inputs: dict[Variant, tuple[GraphInput, ...]] = {}  # declared by the variant's passes
        self.checked: set[tuple[Variant, tuple[float, ...]]] = set()  # options={"check": True}: first calls done
        sequence = analysis.sequence
        self.read_length = make_length_reader(sequence.length if sequence else None, fake_inputs)
        self.buckets = BucketTable(list(options.buckets))
        self.static_variant = Variant(options.sp_size or world_size(), options.recompute)
        self.packed_sites = packed_sites(analysed)  # what the packed kernel choice reads per call
        self.packed_reasons: dict[Variant, str] = {}  # why each packed variant's kernel was chosen (first call)
        # Variants compiled in regions whose line waits for their first call (the regions compile then).
        self.unreported: set[tuple[Variant, tuple[float, ...]]] = set()

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

    def scalars_of(self, args: Any) -> tuple[float, ...]:
        return tuple(float(args[index]) for index in self.analysis.scalar_inputs)

    def with_packed_attention(self, variant: Variant, args: tuple) -> Variant:
        """A packed call's variant with the attention implementation the measured table picks for its
        sequences (``sequence_lengths`` are on the host: no device sync; cached per shape)."""
        boundaries = active_sequence_boundaries()
        if boundaries is None or not self.packed_sites:
            return variant
        # an accelerator if any argument is on one (0-d CPU inputs carry dynamo's Python floats)
        device = next((arg.device for arg in args if isinstance(arg, torch.Tensor) and arg.device.type != "cpu"),
                      torch.device("cpu"))
        choice = choose_packed_attention(self.packed_sites, boundaries, device, self.options.inner)
        chosen = dataclasses.replace(variant, attention=VarlenKernel.FLEX.value) \
            if choice.kernel is VarlenKernel.FLEX else variant
        self.packed_reasons.setdefault(chosen, str(choice))
        return chosen

    def __call__(self, *args: Any) -> Any:
        variant, reason = self.select(args)
        if variant.packed:
            variant = self.with_packed_attention(variant, args)
        pending = self.check_ranks(variant, args) if self.options.check_ranks and variant.sp_size > 1 else None
        scalars = self.scalars_of(args) if self.analysis.scalar_inputs else ()
        world = current_world()
        if world is not self.world:
            # A variant compiled in another process-group world (dcp.profile's fake one, say) names
            # that world's groups in its collectives: compile again for this one.
            if self.world is not None:
                self.compiled.clear()
                self.checked.clear()
            self.world = world
        compiled = self.compiled.get((variant, scalars))
        if compiled is None:
            compiled = self.compile_variant(variant, scalars)
        variant_record = self.record.variants[variant]
        variant_record.calls += 1
        note_graph_call([args[index] for index in self.analysis.parameter_indices], variant.sp_size)
        self.record.dispatches.append((self.read_length(args) if self.read_length and reason != "static" else "-", str(variant), reason))
        records = collecting_records()
        if records is not None and self.record not in records:
            records.append(self.record)
        added = self.added_inputs[variant]
        if variant_record.compiled_in_regions and self.leaves_a_rank_empty(args, variant):
            # A sequence shorter than the SP size leaves the last ranks no token. A region's views
            # write the chunk's length as -1, which a tensor of no elements cannot resolve, and a
            # compile at length 0 specialises on it: every rank of the group (all read the same
            # length) runs the variant's graph as the ATen ops it is, the same collectives in the
            # same order as its regions.
            compiled = variant_record.graph

        def run() -> Any:
            return compiled(*args, *(graph_input.provide() for graph_input in added)) if added else compiled(*args)

        if variant_record.compiled_in_regions and variant_record.saved_activation_bytes is None and (
                torch.is_grad_enabled() and any(isinstance(a, torch.Tensor) and a.requires_grad for a in args)):
            run = counted_at_first_run(run, args, variant_record)

        # the rank check issued beside this call is compared by its end; a regional variant's call
        # reports the regions it compiled (a whole-graph call skips that bookkeeping)
        reporting = (self.regions_reported(variant, scalars, variant_record) if variant_record.compiled_in_regions
                     else contextlib.nullcontext())
        with SettledAfterCall(pending), reporting:
            if self.options.check and not variant.packed and (variant, scalars) not in self.checked:
                self.checked.add((variant, scalars))
                group = sp_group(variant.sp_size).process_group if variant.sp_size > 1 else None
                check_first_call(self.analysed, variant, args, run, self.analysis.parameter_indices, group)
            return note_graph_outputs(run(), variant.sp_size)  # which backward runs it (eager parameters)

    def leaves_a_rank_empty(self, args: tuple, variant: Variant) -> bool:
        """The call's sequence is shorter than the SP size: the last rank's chunk, ``length // P``, is 0."""
        if variant.sp_size == 1 or variant.packed or self.read_length is None:
            return False
        length = self.read_length(args)
        return isinstance(length, int) and length < variant.sp_size

    def check_ranks(self, variant: Variant, args: tuple) -> PendingCheck | None:
        """The SP group agrees on the variant and the inputs (raises on all); the check is issued
        beside the call and settled by its end (``DCP_RANK_CHECK=sync``: waited on here)."""
        group = sp_group(variant.sp_size)
        length = self.read_length(args) if self.read_length is not None else None
        return check_sp_group_agrees(variant, args, group.process_group, group.ranks, graph_id=self.record.graph_id,
                                     length=length, parameter_indices=self.analysis.parameter_indices)

    def compile_variant(self, variant: Variant, scalars: tuple[float, ...] = ()) -> Callable:
        start = time.perf_counter()
        with compiling(f"graph {self.record.graph_id} variant {variant}", "variant passes"):
            compiled = self._compile_variant(variant, scalars)
        variant_record = self.record.variants[variant]
        variant_record.compile_seconds = time.perf_counter() - start
        if variant_record.compiled_in_regions:  # its regions compile at its first call: said after it
            self.unreported.add((variant, scalars))
        else:
            report_compiled(self.compiled_line(variant_record))
        return compiled

    def compiled_line(self, variant_record: VariantRecord, regions: RegionCompiles | None = None) -> CompiledVariant:
        inner_name = "aot_eager, inductor failed" if variant_record.inner_fallback else self.options.inner
        return CompiledVariant(self.record.graph_id, str(variant_record.variant), variant_record.compile_seconds,
                               inner_name, regions)

    @contextlib.contextmanager
    def regions_reported(self, variant: Variant, scalars: tuple[float, ...],
                         variant_record: VariantRecord) -> Iterator[None]:
        """Around a call of a variant compiled in regions: its first call beats while regions compile
        and then logs the variant's line with them; a later call that compiles regions says so."""
        first = (variant, scalars) in self.unreported
        before = dataclasses.replace(variant_record.region_compiles)
        what = f"graph {self.record.graph_id} variant {variant}"
        with compiling(what, "first call: regions compile as they are reached") if first else contextlib.nullcontext():
            yield
        compiled = variant_record.region_compiles.since(before)
        if first:
            self.unreported.discard((variant, scalars))
            report_compiled(self.compiled_line(variant_record, compiled))
        elif compiled.compiled:
            report_compiled(RegionsCompiledAgain(self.record.graph_id, str(variant), compiled))

    def _compile_variant(self, variant: Variant, scalars: tuple[float, ...]) -> Callable:
        if (variant, scalars) != (variant, ()) and any(key[0] == variant for key in self.compiled):
            log.warning("dcp: graph %d variant %s recompiles for new values of its float inputs %s "
                        "(a float attribute of the model changed)", self.record.graph_id, variant, scalars)
        if variant.sp_size > 1 and self.record.returned_key_values is None:  # once per graph
            found = find_returned_key_values(self.analysed, self.analysis.attention_sites, self.record.graph_id)
            self.record.returned_key_values = len(found.positions) if found is not None else 0
            warn_once_if_key_values_returned(found, variant.sp_size)
        group = sp_group(variant.sp_size)
        variant_record = VariantRecord(variant, attention_sites=len(self.analysis.attention_sites))
        rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        variant_record.debug_path = f"rank{rank}/graph{self.record.graph_id}/{variant}".replace('/recompute=', '_recompute=')
        self.record.variants[variant] = variant_record
        sequence = self.analysis.sequence
        with traced_with_room(self.fake_mode, self.fake_inputs, sequence.length if sequence is not None else None,
                              variant.sp_size) as fake_inputs:
            ctx = PassContext(
                fake_inputs=fake_inputs, fake_mode=self.fake_mode, sp_size=variant.sp_size,
                rank=group.rank, group_name=group.group_name if variant.sp_size > 1 else None,
                recompute=variant.recompute, packed=variant.packed, packed_attention=variant.attention,
                packed_attention_reason=self.packed_reasons.get(variant, ""),
                record=self.record, variant_record=variant_record, analysis=self.analysis,
                scalar_values=dict(zip(self.analysis.scalar_inputs, scalars)), snapshots=snapshots_requested(),
                loss_chunk=self.options.loss_chunk, mlp_chunk=self.options.mlp_chunk,
            )
            passes = [p for p in self.variant_passes
                      if (variant.sp_size > 1 or p.runs_without_sharding) and not p.disabled_by(self.options.disable_passes)]
            analysed = self.analysed
            if not (passes and passes[0].returns_new_graph):
                # Later passes edit in place (recompute tags, varlen attention): without a pass that
                # re-traces first, a variant works on its own copy of the shared analysed graph (node
                # meta copied shallowly: fake values shared, tags not). The analysis refers to the
                # original nodes, which only the re-tracing pass reads.
                analysed = fx.GraphModule(self.analysed, copy.deepcopy(self.analysed.graph))
            gm = run_passes(
                analysed, ctx, passes, variant=str(variant), disabled=self.options.disable_passes,
                graph_id=self.record.graph_id, debug_dir=self.options.debug_dir, records=variant_record.passes,
            )
            self.added_inputs[variant] = tuple(filter(None, (p.added_input(ctx) for p in passes)))
            variant_record.graph = gm
            variant_record.collectives = count_collectives(gm)
            compiled = self.regional(gm, variant, variant_record) if self.options.regions else None
            if compiled is None:
                inner = INNER_COMPILERS[self.options.inner]
                with floats_already_specialized(self.fake_mode), compile_stage(f"{self.options.inner}"):
                    compiled = inner(gm, ctx.fake_inputs, variant_record)
        self.compiled[(variant, scalars)] = compiled
        return compiled

    def regional(self, gm: fx.GraphModule, variant: Variant, variant_record: VariantRecord) -> Callable | None:
        """The variant as compiled regions shared with other variants (``options={"regions": True}``),
        or ``None`` where regions do not apply (the record says why)."""
        if self.options.inner not in INNER_REGION_COMPILERS:
            variant_record.regions = f"not used: inner={self.options.inner} compiles nothing to share"
            return None
        if variant.recompute not in REGIONAL_POLICIES:
            variant_record.regions = f"not used: {whole_graph_reason(variant.recompute)}"
            return None
        parent, plan = regional_module(gm, self.options.inner, variant.recompute, variant_record.uncompiled_regions,
                                       variant_record.region_compiles)
        variant_record.regions = describe_regions(plan)
        variant_record.compiled_in_regions = True
        return parent


def counted_at_first_run(run: Callable[[], Any], args: tuple, variant_record: VariantRecord) -> Callable[[], Any]:
    """``run``, whose first run under grad (the self-check may run it once more) records what the
    regional variant keeps for backward (``regions.kept_for_backward``)."""
    def counted() -> Any:
        if variant_record.saved_activation_bytes is not None:
            return run()
        with counting_kept_for_backward(args) as account:
            result = run()
        variant_record.saved_activation_bytes = account.total_bytes
        variant_record.saved_at_first_call = True
        return result
    return counted


# dcp's own ops that communicate inside (the halo exchange of a token grid's window).
COMMUNICATING_OPS = ("dcp.exchange_grid_window",)


def count_collectives(gm: fx.GraphModule) -> dict[str, int]:
    counts: dict[str, int] = {}
    for node in gm.graph.nodes:
        if node.op == "call_function" and (
                ("_c10d_functional" in str(node.target) and "wait_tensor" not in str(node.target))
                or str(node.target).startswith(COMMUNICATING_OPS)):
            name = str(node.target).split(".")[-2] if str(node.target).count(".") >= 2 else str(node.target)
            counts[name] = counts.get(name, 0) + 1
    return counts
