"""The interpreter that re-traces a graph with every sharded node on the rank's chunk.

It keeps each value in the layouts it has been asked for (``full`` and ``chunk``), converts
between them (slice, all-gather, or a cheap replay on full inputs), runs token-local ops on
chunks and hands attention, every ``Rewrite`` and every op its generic paths cannot run as they
stand (an ``OpForm``) to the lowering registered for it (``lowerings.LOWERINGS``). A lowering
reads a read-only ``LoweringContext`` and returns a ``Lowered`` record: this module is the only
one that writes the maps and the record. Outputs come back full on every rank.
"""

from __future__ import annotations

import logging
from typing import Any

import sympy
import torch
import torch.fx as fx

from dcp_compile.compiler import collectives
from dcp_compile.compiler.passes.context import PassContext
from dcp_compile.compiler.passes.find_attention import SDPA
from dcp_compile.compiler.passes.sequence_dims import GridRegion, Role, SequenceAnalysis, SequenceDim, expression
from dcp_compile.compiler.passes.sequence_dims.registry import METADATA_READS
from dcp_compile.compiler.passes.sequence_dims.inplace_writes import alias_groups
from dcp_compile.compiler.passes.shard_sequence.lowering_context import Layout, Lowered, LoweringContext, Path, Site
from dcp_compile.compiler.passes.shard_sequence.lowerings import (
    LOWERINGS, CannotShard, GatherRecord, LoweringKey, WriteRefused, select_form,
)
from dcp_compile.compiler.passes.shard_sequence.plan import ShardPlan
from dcp_compile.compiler.sequence_chunks import chunk_start
from dcp_compile.compiler.symbolic_sizes import SymbolicSizes, UnknownSymbol

aten = torch.ops.aten
log = logging.getLogger(__name__)


def _is_tensor(value: Any) -> bool:
    return isinstance(value, torch.Tensor)


def _row_major(value: torch.Tensor) -> bool:
    """Contiguity read off the size and stride expressions: no SymInt arithmetic (which would
    add nodes to, or guards on, the trace in progress)."""
    expected = sympy.Integer(1)
    for size, stride in reversed(list(zip(value.shape, value.stride()))):
        size_expr, stride_expr = expression(size), expression(stride)
        if size_expr == 1:
            continue
        if sympy.expand(stride_expr - expected) != 0:
            return False
        expected = expected * size_expr
    return True


def describe_node(n: fx.Node | None) -> str:
    """A node as a user can find it: its op and the model line that produced it."""
    if n is None:
        return "the graph's inputs"
    trace = (n.meta.get("stack_trace") or "").strip().splitlines()
    where = next((line.strip() for line in reversed(trace) if line.strip().startswith("File")), "")
    code = trace[-1].strip() if trace else ""
    return f"{n.name} = {_op_label(n)}" + (f", {where}: {code}" if where else "")


def _op_label(n: fx.Node) -> str:
    return str(n.target).replace("aten.", "").replace(".default", "")


REPLAY_LIMIT = 64  # ops replayed on full values for one gather avoided
NOT_REPLAYED = {SDPA, aten.linear.default, aten.mm.default, aten.bmm.default, aten.matmul.default,
                aten.addmm.default, aten.convolution.default, aten.conv2d.default, aten.conv3d.default,
                aten.embedding.default}


def _replay_order(node: fx.Node, full: dict, chunk: dict, limit: int,
                  written: frozenset[fx.Node] = frozenset()) -> list[fx.Node] | None:
    """The chunked ancestors of ``node`` to recompute on full values, in order; None when that
    would replay a differentiable value, an expensive op, more than ``limit`` ops, or a buffer
    written in place (a replay would recompute it without its writes)."""
    order: list[fx.Node] = []
    seen: set[fx.Node] = set()

    def visit(n: fx.Node) -> bool:
        if n in full or n in seen:
            return True
        seen.add(n)
        value = n.meta.get("val")
        if (n not in chunk or n.op != "call_function" or n.target in NOT_REPLAYED or n in written
            or (isinstance(value, torch.Tensor) and value.requires_grad)
                or (isinstance(value, (tuple, list)))):
            return False
        if not all(visit(source) for source in n.all_input_nodes):
            return False
        order.append(n)
        return len(order) <= limit

    return order if visit(node) else None


# Ops that only select from their one tensor input or copy it (no arithmetic): a chain of them
# ending at the graph's outputs is a returned selection of a value, e.g. a sliding-window K/V
# cache. Reshapes are left out on purpose: one that splits the sequence (a DiT's unpatchify) stays
# a recorded gather with its reason, the one gather a DiT's budget allows.
OUTPUT_TAIL_OPS = frozenset({
    aten.slice.Tensor, aten.narrow.default, aten.clone.default, aten.alias.default, aten.detach.default,
    aten.contiguous.default,
})


def _output_tail(gm: fx.GraphModule) -> set[fx.Node]:
    """Nodes of :data:`OUTPUT_TAIL_OPS` whose every use is the output or another such node."""
    tail: set[fx.Node] = set()
    for node in reversed(gm.graph.nodes):
        if (node.op == "call_function" and node.target in OUTPUT_TAIL_OPS and node.users
            and all(user.op == "output" or user in tail for user in node.users)):
            tail.add(node)
    return tail


class ShardingInterpreter(fx.Interpreter):
    def __init__(self, gm: fx.GraphModule, ctx: PassContext, analysis: SequenceAnalysis, plan: ShardPlan,
                 refused_writes: dict[fx.Node, str] | None = None):
        super().__init__(gm)
        # Members of written buffers whose write found no chunked form on an earlier trace
        # (``WriteRefused``): they run on the full sequence, their inputs gathered with the reason.
        self.refused_writes: dict[fx.Node, str] = dict(refused_writes or {})
        self.ctx, self.analysis, self.plan = ctx, analysis, plan
        self.sp_size, self.rank, self.group = ctx.sp_size, ctx.rank, ctx.group_name
        self.full: dict[fx.Node, Any] = {}
        self.chunk: dict[fx.Node, Any] = {}
        self.length: Any = None  # SymInt of the full sequence length, once seen
        self.gathers: list[GatherRecord] = []
        self.rewrites: list[str] = []
        self.output_gathers = 0  # outputs gathered outside autograd (no backward collective)
        self.symbolic = SymbolicSizes()
        placeholders = list(gm.graph.find_nodes(op="placeholder"))
        self.scalar_values = {placeholders[i]: value for i, value in ctx.scalar_values.items()}
        self.local_fallbacks: list[str] = []  # sharded ops run on gathered inputs instead
        self.output_tail = frozenset(_output_tail(gm))
        self.unsummed: set[fx.Node] = set()  # full values whose gradient reaches chunks unsummed
        self.replayed = 0
        self.current: fx.Node | None = None  # chunked ops also replayed on full values instead of a gather
        self.sharded_sites: list[str] = []
        self.rank_local_sites: list[str] = []
        self.replicated_sites: list[str] = []
        self.unsharded_sites: list[tuple[str, str]] = []
        self.grid_windows: dict[fx.Node, Any] = {}  # grid entry -> outermost steps in this rank's window
        # Buffers written in place on chunks (see sequence_dims/inplace_writes): write -> its
        # alias group, whose full copies (gathered before the write) go stale when it runs.
        groups = alias_groups(gm.graph)
        self.write_groups = {write: group.members for group in groups for write in group.writes}
        order = {node: index for index, node in enumerate(gm.graph.nodes)}
        # write -> the members of its buffer up to the buffer's last write (views taken later only read it)
        self.written_prefix = {write: frozenset(m for m in group.members
                                                if order[m] <= max(order[w] for w in group.writes)
                                                and m.op not in ("placeholder", "get_attr"))
                               for group in groups for write in group.writes}
        self.written = frozenset().union(*self.write_groups.values()) if self.write_groups else frozenset()

    # --- layout conversions --------------------------------------------------------------

    def _learn_length(self, value: torch.Tensor, seq: SequenceDim) -> None:
        if self.length is None and seq.plain and expression(value.shape[seq.dim]) == self.analysis.length:
            self.length = value.shape[seq.dim]
        elif self.length is None and seq.joint:
            self.length = value.shape[seq.dim] - self.segments(seq)[0] - self.segments(seq)[1]

    def segments(self, seq: SequenceDim) -> tuple[Any, Any]:
        """The replicated segments around the chunk of a joint dimension, as ints or SymInts."""
        return self.symbolic.evaluate(seq.before), self.symbolic.evaluate(seq.after)

    def seq_of(self, node: fx.Node, index: int | None = None) -> SequenceDim:
        dims = self.analysis.dims_of(node, index)
        if len(dims) != 1:
            raise CannotShard(f"{node.name} has {len(dims)} sequence dimensions")
        return dims[0]

    def narrow(self, value: torch.Tensor, seq: SequenceDim) -> torch.Tensor:
        self._learn_length(value, seq)
        if self.length is None:
            raise CannotShard("the sequence length is only available in flattened form")
        if seq.plain:
            return collectives.narrow_to_chunk(value, seq.dim, self.length, self.sp_size, self.rank)
        if seq.joint:
            before, after = self.segments(seq)
            middle = value.narrow(seq.dim, before, self.length)
            return torch.cat([value.narrow(seq.dim, 0, before),
                              collectives.narrow_to_chunk(middle, seq.dim, self.length, self.sp_size, self.rank),
                              value.narrow(seq.dim, before + self.length, after)], seq.dim)
        outer, inner = self.factors(seq)
        shape = value.shape
        split = value.reshape(*shape[: seq.dim], outer, self.length, inner, *shape[seq.dim + 1 :])
        local = collectives.narrow_to_chunk(split, seq.dim + 1, self.length, self.sp_size, self.rank)
        return local.flatten(seq.dim, seq.dim + 2)

    def factors(self, seq: SequenceDim) -> tuple[Any, Any]:
        """``outer`` and ``inner`` of a flattened sequence dimension (``[B*S, V]`` logits with a
        symbolic batch B), as ints or as SymInts of this trace."""
        return self.symbolic.evaluate(seq.outer), self.symbolic.evaluate(seq.inner)

    def gather(self, value: torch.Tensor, seq: SequenceDim) -> torch.Tensor:
        if self.length is None:
            raise CannotShard("a chunk must be gathered before the full length is known")
        if seq.plain:
            return collectives.gather_sequence(value, seq.dim, self.length, self.sp_size, self.group)
        if seq.joint:
            before, after = self.segments(seq)
            local = value.shape[seq.dim] - before - after
            middle = collectives.gather_sequence(value.narrow(seq.dim, before, local), seq.dim, self.length,
                                                 self.sp_size, self.group)
            return torch.cat([value.narrow(seq.dim, 0, before), middle,
                              value.narrow(seq.dim, before + local, after)], seq.dim)
        outer, inner = self.factors(seq)
        shape = value.shape
        split = value.reshape(*shape[: seq.dim], outer, -1, inner, *shape[seq.dim + 1 :])
        full = collectives.gather_sequence(split, seq.dim + 1, self.length, self.sp_size, self.group)
        return full.flatten(seq.dim, seq.dim + 2)

    def as_chunk(self, node: Any) -> Any:
        if not isinstance(node, fx.Node):
            return node
        if node in self.chunk:
            return self.chunk[node]
        value = self.full[node]
        if isinstance(value, (tuple, list)):
            chunked = type(value)(
                self.narrow(v, self.seq_of(node, i)) if _is_tensor(v) and self.analysis.dims_of(node, i) else v
                for i, v in enumerate(value)
            )
        else:
            chunked = self.narrow(value, self.seq_of(node))
        self.chunk[node] = chunked
        return chunked

    def as_full(self, node: Any, reason: str = "", consumer: fx.Node | None = None) -> Any:
        if not isinstance(node, fx.Node):
            return node
        if node in self.full:
            return self.full[node]
        role = self.analysis.roles.get(node)
        if role is not None and (role.token_order is not None or role.role is Role.TOKEN_SET):
            raise CannotShard(f"{node.name} holds this rank's tokens permuted locally (or counts of them); "
                              "gathering it would interleave the ranks' orders")
        replayed = self._replay_full(node)
        if replayed is not None:
            return replayed
        lowered = self._lower_form(LoweringContext(self, node, Path.GATHER, reason, consumer))
        if lowered is not None:
            if not lowered.output_gather:
                self.full[node] = lowered.value
            return lowered.value
        value = self.chunk[node]
        if isinstance(value, (tuple, list)):
            gathered = type(value)(
                self.gather(v, self.seq_of(node, i)) if _is_tensor(v) and self.analysis.dims_of(node, i) else v
                for i, v in enumerate(value)
            )
        else:
            gathered = self.gather(value, self.seq_of(node))
        self.full[node] = gathered
        if consumer is not None:
            record = GatherRecord(node.name, consumer.name, reason or self._gather_reason(node, consumer))
            self.gathers.append(record)
            log.info("dcp: %s", record)
        return gathered

    def _gather_reason(self, node: fx.Node, consumer: fx.Node) -> str:
        """The consumer's recorded reason; the analysis gives every op that reads a
        sequence-indexed input whole one (``registry._settle``), this names what is left."""
        role = self.analysis.roles.get(consumer)
        if role is not None and role.reason:
            return role.reason
        label = role.role.value if role is not None else "unclassified"
        return f"{_op_label(consumer)} ({label}) reads {node.name} whole"

    def _is_unsummed(self, node: fx.Node) -> bool:
        while node in self.output_tail:
            if node in self.unsummed:
                return True
            node = node.args[0]
        return False

    def _replay_full(self, node: fx.Node) -> Any:
        """The full value of a chunked ``node``, recomputed from full values instead of gathered.

        Position ids, masks and cache positions are cheap functions of full inputs that the
        sharded region also reads in chunks; a sequence-mixing consumer (a ``diff`` of position
        ids, a mask built from them) then gets them by replaying the few ops on the full inputs,
        which costs no collective. Only values that need no gradient are replayed: a replicated
        copy of a differentiable value would count its gradient once per rank.
        """
        order = _replay_order(node, self.full, self.chunk, REPLAY_LIMIT, self.written)
        if order is None:
            return None
        for n in order:
            args = fx.map_arg(n.args, lambda a: self.full[a])
            kwargs = fx.map_arg(n.kwargs, lambda a: self.full[a])
            self.full[n] = getattr(self, n.op)(n.target, args, kwargs)
        self.replayed += len(order)
        return self.full[node]

    def _is_parameter(self, n: fx.Node) -> bool:
        index = [p for p in self.module.graph.nodes if p.op == "placeholder"].index(n)
        return index in self.ctx.analysis.parameter_indices

    # --- nodes ---------------------------------------------------------------------------

    def run_node(self, n: fx.Node) -> Any:
        self.current = n
        with self._set_current_node(n):
            if n.op in ("placeholder", "get_attr"):
                value = super().run_node(n)
                if n.op == "placeholder":
                    self.symbolic.learn(value)
                if (n.op == "placeholder" and _is_tensor(value) and value.requires_grad
                    and self.sp_size > 1 and not self._is_parameter(n)):
                    value = collectives.replicated_input(value, self.group)
                self.full[n] = value
                role = self.analysis.roles.get(n)
                if role is not None and role.role is Role.SOURCE and _is_tensor(value):
                    self._learn_length(value, role.sequence_dims[0])
                return value
            if n.op == "output":
                return self._output(n)
            if n in self.refused_writes:
                value = self.run_full(n, reason=self.refused_writes[n])
                self.full[n] = value
                return value
            if n in self.analysis.region_members and n in self.plan.sharded_nodes:
                return None  # runs on the rank's heads when its region's output is reached
            if n in self.plan.sharded_nodes:
                try:
                    lowered = self._run_sharded(n)
                except (CannotShard, UnknownSymbol) as why:
                    if n in self.write_groups:
                        # On a gathered copy the write would never reach the buffer's chunk: the
                        # pass re-traces with the whole buffer, up to its last write, run full.
                        raise WriteRefused(self.written_prefix[n], (
                            f"the in-place write {describe_node(n)} has no chunked form ({why}): its buffer "
                            "runs on the full sequence")) from None
                    # No rule fits this op on chunks: gather its inputs, run it full, and let its
                    # consumers take their chunks of the result. The rest stays sharded.
                    self.local_fallbacks.append(f"{n.name} ({_op_label(n)}): {why}")
                    log.info("dcp: %s runs on gathered inputs: %s", n.name, why)
                    value = self.run_full(n, reason=f"no chunked form: {why}")
                    self.full[n] = value
                    return value
                if lowered.layout is Layout.FULL:
                    self.full[n] = lowered.value  # a rewrite reduces over the sequence: its result is full
                else:
                    self.chunk[n] = lowered.value
                for member in self.write_groups.get(n, ()):
                    self.full.pop(member, None)  # written on the chunk: a gathered copy is stale
                return lowered.value
            region = self.analysis.grid_members.get(n)
            if region is not None and region.entry in self.grid_windows:
                value = self._run_in_grid_window(n)
            else:
                value = self.run_full(n)
            self.full[n] = value
            self.symbolic.learn_created(n.meta.get("val"), value)
            role = self.analysis.roles.get(n)
            if role is not None and role.role is Role.SOURCE and _is_tensor(value):
                self._learn_length(value, role.sequence_dims[0])
            return value

    def _lower(self, key: LoweringKey, context: LoweringContext) -> Lowered:
        """``key``'s lowering of the context's node; its notes go to the record here, its value
        to the maps by the caller (the one place that stores either)."""
        lowered = LOWERINGS[key](context)
        if not isinstance(lowered, Lowered):
            raise TypeError(f"the lowering of {key!r} returned {type(lowered).__name__}, not Lowered")
        n = context.node
        if lowered.rewrite is not None:
            self.rewrites.append(f"{n.name}: {lowered.rewrite}")
        if lowered.site is Site.SHARDED:
            self.sharded_sites.append(n.name)
        elif lowered.site is Site.RANK_LOCAL:
            self.rank_local_sites.append(n.name)
        elif lowered.site is Site.REPLICATED:
            self.replicated_sites.append(n.name)
        elif lowered.site is Site.UNSHARDED:
            self.unsharded_sites.append((n.name, lowered.site_reason))
        if lowered.window_units is not None:
            self.grid_windows[n] = lowered.window_units
        if lowered.output_gather:
            self.output_gathers += 1
            self.unsummed.add(context.consumer)  # its gradient reaches the chunk unsummed
        return lowered

    def _lower_form(self, context: LoweringContext) -> Lowered | None:
        """The node through its ``OpForm`` on the context's path, None when it has none."""
        form = select_form(context)
        return None if form is None else self._lower(form, context)

    def _run_sharded(self, n: fx.Node) -> Lowered:
        role = self.analysis.roles[n]
        context = LoweringContext(self, n, Path.CHUNK)
        if role.role is Role.ATTENTION:
            return self._lower(Role.ATTENTION, context)
        if role.rewrite is not None:
            return self._lower(role.rewrite, context)
        lowered = self._lower_form(context)
        if lowered is not None:
            return lowered
        return context.lowered(self.run_generic(n, Path.CHUNK))

    def run_full(self, n: fx.Node, reason: str = "") -> Any:
        """``n`` on full inputs (gathered for it with ``reason``): its full value."""
        lowered = self._lower_form(LoweringContext(self, n, Path.FULL, reason))
        if lowered is not None:
            return lowered.value
        return self.run_generic(n, Path.FULL, reason)

    def _run_in_grid_window(self, n: fx.Node) -> Any:
        lowered = self._lower_form(LoweringContext(self, n, Path.WINDOW))
        if lowered is not None:
            return lowered.value
        return self.run_generic(n, Path.WINDOW)

    def run_generic(self, n: fx.Node, path: Path, reason: str = "") -> Any:
        """``n`` as any op runs on ``path``: its arguments in the path's layouts, then the op."""
        if path is Path.CHUNK:
            args, kwargs = self.chunk_args(n)
            return getattr(self, n.op)(n.target, args, kwargs)
        if path is Path.WINDOW:
            args, kwargs = fx.map_arg(n.args, self.as_full), fx.map_arg(n.kwargs, self.as_full)
            return getattr(self, n.op)(n.target, args, kwargs)
        args, kwargs = self.full_args(n, reason)
        return getattr(self, n.op)(n.target, args, kwargs)

    def chunk_args(self, n: fx.Node, metadata: tuple[int, ...] | None = None) -> tuple[tuple, dict]:
        """``n``'s arguments on chunks: aligned inputs in chunks, the rest full (a gather for
        ``n``), arguments read only for their metadata (``metadata``, by default the op's
        ``METADATA_READS``) in whichever layout is at hand."""
        aligned = set(self.analysis.roles[n].aligned_inputs)
        if metadata is None:
            metadata = METADATA_READS.get(n.target, ())
        args = tuple(self.any_layout(a) if i in metadata and a not in aligned else
                     fx.map_arg(a, lambda a: self.as_chunk(a) if a in aligned else self.as_full(a, consumer=n))
                     for i, a in enumerate(n.args))
        kwargs = fx.map_arg(n.kwargs, lambda a: self.as_chunk(a) if a in aligned else self.as_full(a, consumer=n))
        return args, kwargs

    def full_args(self, n: fx.Node, reason: str = "") -> tuple[tuple, dict]:
        """``n``'s arguments in full (each gather recorded with ``reason``); arguments read only
        for their dtype and device in any layout at hand."""
        metadata = METADATA_READS.get(n.target, ()) if n.op == "call_function" else ()
        args = tuple(self.any_layout(a) if i in metadata else fx.map_arg(a, lambda a: self.as_full(a, reason, consumer=n))
                     for i, a in enumerate(n.args))
        kwargs = fx.map_arg(n.kwargs, lambda a: self.as_full(a, reason, consumer=n))
        return args, kwargs

    def any_layout(self, node: Any) -> Any:
        """``node``'s value in whichever layout is at hand, full or chunk, for a read of its metadata."""
        if isinstance(node, fx.Node) and node not in self.full and node in self.chunk:
            return self.chunk[node]
        return self.as_full(node)

    # --- grid windows (see sequence_dims/grid_rules and grid_windows) --------------------------

    def window_arguments(self, region: GridRegion) -> tuple:
        return (self.length, self.symbolic.evaluate(region.unit), region.radius, self.sp_size, self.rank)

    def window_sizes(self, n: fx.Node, region: GridRegion, tokens_dim: int | None = None,
                     units: Any = None) -> list[Any]:
        """``n``'s sizes on this rank's window: the traced sizes, with the outermost grid steps
        (or, at an exit, the tokens) of the window instead of the whole grid's. ``units``: the
        window's steps, given at its entry (stored once the entry's lowering returns)."""
        sizes = [self.symbolic.evaluate(expression(size)) for size in n.meta["val"].shape]
        if units is None:
            units = self.grid_windows[region.entry]
        if tokens_dim is not None:
            sizes[tokens_dim] = units * self.symbolic.evaluate(region.unit)
        else:
            grid_dim = region.grid_dims[n]
            sizes[grid_dim.dim] = (self.symbolic.evaluate(grid_dim.outer) * units
                                   * self.symbolic.evaluate(grid_dim.inner))
        return sizes

    # --- outputs ---------------------------------------------------------------------------

    def _output(self, n: fx.Node) -> Any:
        scale = 1.0 / self.sp_size

        def finish(node: Any) -> Any:
            if not isinstance(node, fx.Node):
                return node
            if node in self.full:
                value = self.full[node]
                if _is_tensor(value) and value.requires_grad and self.sp_size > 1 and not self._is_unsummed(node):
                    return collectives.scale_gradient(value, scale)
                return value
            local = self.chunk[node]
            if isinstance(local, (tuple, list)):
                gathered = self.as_full(node, "a tuple-valued graph output is returned in full", n)
                return type(gathered)(collectives.scale_gradient(v, scale) if _is_tensor(v) and v.requires_grad else v
                                      for v in gathered)
            seq = self.seq_of(node)
            if not local.requires_grad:
                return self.as_full(node)
            if not seq.plain:
                return collectives.scale_gradient(self.as_full(node), scale)
            # The gather itself stays out of autograd: its gradient reaches ``local`` through
            # replicated_output, so backward issues no collective for it on any rank.
            full = self.gather(local.detach(), seq)
            self.output_gathers += 1
            start = chunk_start(self.length, self.sp_size, self.rank)
            return collectives.replicated_output(full, local, seq.dim, start)

        def with_traced_layout(node: Any) -> Any:
            """Outputs keep the memory layout eager gives them: code after a graph break may
            ``view`` them, which a gathered or re-concatenated value's strides would refuse."""
            value = finish(node)
            traced = node.meta.get("val") if isinstance(node, fx.Node) else None
            if _is_tensor(value) and _is_tensor(traced) and _row_major(traced) and not _row_major(value):
                return value.contiguous()
            return value

        return fx.map_arg(n.args[0], with_traced_layout)


