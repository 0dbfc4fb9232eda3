"""Run every token-local op on the rank's chunk of the sequence.

Layouts are decided per *sharding region*: the connected components of the graph formed by
"this op's output chunk lines up with that input's chunk" edges (token-local ops, attention's
queries and self-attention keys/values, and the inputs of the known rewrites). A region that
contains an attention is sharded; every other value stays full. Inside a sharded region:

* values that are created full (graph inputs, ``arange`` positions, a patchify's flatten, the
  output of a sequence-mixing op) are sliced to the rank's chunk where a sharded op first reads
  them: slicing is a view, so "as early as possible" costs nothing;
* token-local ops run on chunks (views get ``-1`` for the sequence size, so one graph serves
  every length);
* attention becomes ``dcp::sharded_attention``, for ``insert_all_to_all`` to lower;
* sums/means over the sequence, a loss over the sequence, and picking one position (a CLS token)
  are rewritten into a local reduction plus one all-reduce;
* anything else that reads a chunked value across positions gets an all-gather first, recorded
  with its reason.

Graph outputs are full on every rank: a chunked output is gathered, a full one carries a
gradient scale of 1/P (see ``dcp_compile.compiler.collectives``).

The rewrite happens by re-tracing the graph through an interpreter, so every new node gets its
symbolic shape from the ops themselves.
"""

from __future__ import annotations

import logging
import operator
from dataclasses import dataclass, field
from typing import Any

import networkx as nx
import sympy
import torch
import torch.fx as fx

from dcp_compile.compiler import collectives, grid_windows
from dcp_compile.compiler.graph_capture import retrace
from dcp_compile.compiler.passes import sharded_attention_op  # noqa: F401  (registers dcp::sharded_attention)
from dcp_compile.compiler.passes.context import PassContext
from dcp_compile.compiler.passes.find_attention import SDPA, sdpa_argument
from dcp_compile.compiler.passes.grid_regions import GridRegion
from dcp_compile.compiler.passes.sequence_dims import (
    ATTENTION, MIXING, SOURCE, TOKEN_LOCAL, TOKEN_SET, VIEWS, SequenceAnalysis, SequenceDim, expression,
)
from dcp_compile.compiler.symbolic_sizes import SymbolicSizes, UnknownSymbol
from dcp_compile.compiler import ulysses
from dcp_compile.compiler.sequence_chunks import chunk_lengths, chunk_start

aten = torch.ops.aten
log = logging.getLogger(__name__)
SCALAR_READS = (aten.item.default, aten._local_scalar_dense.default)


class CannotShard(Exception):
    """The graph uses a pattern the sharding pass does not handle; it will run unsharded."""


@dataclass
class GatherRecord:
    node: str
    op: str
    reason: str

    def __str__(self) -> str:
        return f"all-gather of {self.node} before {self.op}: {self.reason}"


@dataclass
class ShardPlan:
    """Which nodes run on chunks, decided from the sequence analysis."""

    sharded_nodes: set[fx.Node] = field(default_factory=set)
    regions: int = 0


def plan_sharding(analysis: SequenceAnalysis) -> ShardPlan:
    """Connected components of the alignment graph; those holding an attention are sharded."""
    plan = ShardPlan()
    if analysis.length is None:
        return plan
    alignment = nx.Graph()
    for node, role in analysis.roles.items():
        if node in analysis.region_members:
            continue  # follows its region's output (below)
        if role.role in (TOKEN_LOCAL, ATTENTION, TOKEN_SET) or (role.role == MIXING and role.rewrite):
            alignment.add_node(node)
            for source in role.aligned_inputs:
                alignment.add_edge(source, node)
    for component in nx.connected_components(alignment):
        # With an attention, or downstream of an op that ran on gathered inputs (its output is
        # full but still sequence-indexed): either way the token-local work runs on chunks again.
        if any(analysis.roles[n].role == ATTENTION or _regathered(analysis.roles[n]) for n in component):
            plan.regions += 1
            plan.sharded_nodes.update(
                n for n in component
                if analysis.roles[n].role in (TOKEN_LOCAL, ATTENTION, TOKEN_SET)
                or (analysis.roles[n].role == MIXING and analysis.roles[n].rewrite)
            )
    plan.sharded_nodes.update(member for member, site in analysis.region_members.items()
                              if site.node in plan.sharded_nodes)
    return plan


def _regathered(role: Any) -> bool:
    return role.role == MIXING and not role.rewrite and bool(role.sequence_dims)


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


def _replay_order(node: fx.Node, full: dict, chunk: dict, limit: int) -> list[fx.Node] | None:
    """The chunked ancestors of ``node`` to recompute on full values, in order; None when that
    would replay a differentiable value, an expensive op, or more than ``limit`` ops."""
    order: list[fx.Node] = []
    seen: set[fx.Node] = set()

    def visit(n: fx.Node) -> bool:
        if n in full or n in seen:
            return True
        seen.add(n)
        value = n.meta.get("val")
        if (n not in chunk or n.op != "call_function" or n.target in NOT_REPLAYED
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


# Selections along a dimension other than the sequence (a sample of the batch, a range of them).
BATCH_SELECTIONS = frozenset({aten.select.int, aten.slice.Tensor, aten.narrow.default})


def _output_tail(gm: fx.GraphModule) -> set[fx.Node]:
    """Nodes of :data:`OUTPUT_TAIL_OPS` whose every use is the output or another such node."""
    tail: set[fx.Node] = set()
    for node in reversed(gm.graph.nodes):
        if (node.op == "call_function" and node.target in OUTPUT_TAIL_OPS and node.users
                and all(user.op == "output" or user in tail for user in node.users)):
            tail.add(node)
    return tail


class ShardingInterpreter(fx.Interpreter):
    def __init__(self, gm: fx.GraphModule, ctx: PassContext, analysis: SequenceAnalysis, plan: ShardPlan):
        super().__init__(gm)
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
        self.output_tail = _output_tail(gm)
        self.unsummed: set[fx.Node] = set()  # full values whose gradient reaches chunks unsummed
        self.replayed = 0
        self.current: fx.Node | None = None  # chunked ops also replayed on full values instead of a gather
        self.sharded_sites: list[str] = []
        self.rank_local_sites: list[str] = []
        self.replicated_sites: list[str] = []
        self.unsharded_sites: list[tuple[str, str]] = []
        self.grid_windows: dict[fx.Node, Any] = {}  # grid entry -> outermost steps in this rank's window

    # --- layout conversions --------------------------------------------------------------

    def _learn_length(self, value: torch.Tensor, seq: SequenceDim) -> None:
        if self.length is None and seq.plain and expression(value.shape[seq.dim]) == self.analysis.length:
            self.length = value.shape[seq.dim]
        elif self.length is None and seq.joint:
            self.length = value.shape[seq.dim] - self._segments(seq)[0] - self._segments(seq)[1]

    def _segments(self, seq: SequenceDim) -> tuple[Any, Any]:
        """The replicated segments around the chunk of a joint dimension, as ints or SymInts."""
        return self.symbolic.evaluate(seq.before), self.symbolic.evaluate(seq.after)

    def _seq_of(self, node: fx.Node, index: int | None = None) -> SequenceDim:
        dims = self.analysis.dims_of(node, index)
        if len(dims) != 1:
            raise CannotShard(f"{node.name} has {len(dims)} sequence dimensions")
        return dims[0]

    def _narrow(self, value: torch.Tensor, seq: SequenceDim) -> torch.Tensor:
        self._learn_length(value, seq)
        if self.length is None:
            raise CannotShard("the sequence length is only available in flattened form")
        if seq.plain:
            return collectives.narrow_to_chunk(value, seq.dim, self.length, self.sp_size, self.rank)
        if seq.joint:
            before, after = self._segments(seq)
            middle = value.narrow(seq.dim, before, self.length)
            return torch.cat([value.narrow(seq.dim, 0, before),
                              collectives.narrow_to_chunk(middle, seq.dim, self.length, self.sp_size, self.rank),
                              value.narrow(seq.dim, before + self.length, after)], seq.dim)
        outer, inner = self._factors(seq)
        shape = value.shape
        split = value.reshape(*shape[: seq.dim], outer, self.length, inner, *shape[seq.dim + 1 :])
        local = collectives.narrow_to_chunk(split, seq.dim + 1, self.length, self.sp_size, self.rank)
        return local.flatten(seq.dim, seq.dim + 2)

    def _factors(self, seq: SequenceDim) -> tuple[Any, Any]:
        """``outer`` and ``inner`` of a flattened sequence dimension (``[B*S, V]`` logits with a
        symbolic batch B), as ints or as SymInts of this trace."""
        return self.symbolic.evaluate(seq.outer), self.symbolic.evaluate(seq.inner)

    def _gather(self, value: torch.Tensor, seq: SequenceDim) -> torch.Tensor:
        if self.length is None:
            raise CannotShard("a chunk must be gathered before the full length is known")
        if seq.plain:
            return collectives.gather_sequence(value, seq.dim, self.length, self.sp_size, self.group)
        if seq.joint:
            before, after = self._segments(seq)
            local = value.shape[seq.dim] - before - after
            middle = collectives.gather_sequence(value.narrow(seq.dim, before, local), seq.dim, self.length,
                                                 self.sp_size, self.group)
            return torch.cat([value.narrow(seq.dim, 0, before), middle,
                              value.narrow(seq.dim, before + local, after)], seq.dim)
        outer, inner = self._factors(seq)
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
                self._narrow(v, self._seq_of(node, i)) if _is_tensor(v) and self.analysis.dims_of(node, i) else v
                for i, v in enumerate(value)
            )
        else:
            chunked = self._narrow(value, self._seq_of(node))
        self.chunk[node] = chunked
        return chunked

    def as_full(self, node: Any, reason: str = "", consumer: fx.Node | None = None) -> Any:
        if not isinstance(node, fx.Node):
            return node
        if node in self.full:
            return self.full[node]
        role = self.analysis.roles.get(node)
        if role is not None and (role.token_order is not None or role.role == TOKEN_SET):
            raise CannotShard(f"{node.name} holds this rank's tokens permuted locally (or counts of them); "
                              "gathering it would interleave the ranks' orders")
        replayed = self._replay_full(node)
        if replayed is not None:
            return replayed
        selected = self._selected_from_full_source(node, reason, consumer)
        if selected is not None:
            return selected
        value = self.chunk[node]
        if consumer is not None and consumer in self.output_tail and _is_tensor(value) and self.sp_size > 1:
            seq = self._seq_of(node)
            if seq.plain:
                return self._gathered_for_output(node, value, seq, consumer)
        if isinstance(value, (tuple, list)):
            gathered = type(value)(
                self._gather(v, self._seq_of(node, i)) if _is_tensor(v) and self.analysis.dims_of(node, i) else v
                for i, v in enumerate(value)
            )
        else:
            gathered = self._gather(value, self._seq_of(node))
        self.full[node] = gathered
        if consumer is not None:
            record = GatherRecord(node.name, consumer.name, reason or self.analysis.roles[consumer].reason)
            self.gathers.append(record)
            log.info("dcp: %s", record)
        return gathered

    def _selected_from_full_source(self, node: fx.Node, reason: str, consumer: fx.Node | None) -> Any:
        """A selection across the batch (``hidden[i]``) of a chunked value, in full, from one gather.

        A model that unpatchifies each sample on its own (``hidden[i][text:]`` per ``i``) would
        otherwise gather every sample's selection separately: the same bytes in B collectives.
        When the source has two or more such selections, or is gathered already, it is gathered
        once and each selection is taken from it.
        """
        if node.op != "call_function" or node.target not in BATCH_SELECTIONS:
            return None
        source = node.args[0]
        if not isinstance(source, fx.Node) or source not in self.chunk or not _is_tensor(self.chunk[source]):
            return None
        seq = self._seq_of(source)
        rank = self.chunk[source].dim()
        dim = node.args[1] % rank
        if not seq.plain or dim == seq.dim:
            return None
        # Selections whose own consumers run on full values (they will be gathered too).
        siblings = [user for user in source.users if user.op == "call_function" and user.target in BATCH_SELECTIONS
                    and user.args[1] % rank == dim and any(c not in self.plan.sharded_nodes for c in user.users)]
        if source not in self.full and len(siblings) < 2:
            return None
        full = self.as_full(source, reason, consumer)
        args = fx.map_arg(node.args[1:], self.as_full)
        kwargs = fx.map_arg(node.kwargs, self.as_full)
        self.full[node] = self.call_function(node.target, (full, *args), kwargs)
        return self.full[node]

    def _gathered_for_output(self, node: fx.Node, local: torch.Tensor, seq: SequenceDim, consumer: fx.Node) -> Any:
        """``node`` in full for a consumer whose result is only reshaped into graph outputs.

        A sliding-window K/V cache keeps ``keys[:, :, -window:]`` of each layer and returns it:
        a slice along the sequence, so it needs the full keys, but only to hand them back, like
        a returned full cache. It is gathered the way an output is (outside autograd, its
        gradient handed to this rank's chunk without a sum over ranks) and counted as an output
        gather, not as a gather the computation needs. Not cached: a computing consumer of the
        same value gets its own, summed gather.
        """
        full = self._gather(local.detach(), seq)
        self.output_gathers += 1
        self.unsummed.add(consumer)
        if not local.requires_grad:
            return full
        return collectives.replicated_output(full, local, seq.dim, chunk_start(self.length, self.sp_size, self.rank))

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
        order = _replay_order(node, self.full, self.chunk, REPLAY_LIMIT)
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
                if role is not None and role.role == SOURCE and _is_tensor(value):
                    self._learn_length(value, role.sequence_dims[0])
                return value
            if n.op == "output":
                return self._output(n)
            if n in self.analysis.region_members and n in self.plan.sharded_nodes:
                return None  # runs on the rank's heads when its region's output is reached
            if n in self.plan.sharded_nodes:
                try:
                    value = self._run_sharded(n)
                except (CannotShard, UnknownSymbol) as why:
                    # No rule fits this op on chunks: gather its inputs, run it full, and let its
                    # consumers take their chunks of the result. The rest stays sharded.
                    self.local_fallbacks.append(f"{n.name} ({_op_label(n)}): {why}")
                    log.info("dcp: %s runs on gathered inputs: %s", n.name, why)
                    value = self._run_full(n, reason=f"no chunked form: {why}")
                    self.full[n] = value
                    return value
                role = self.analysis.roles[n]
                if role.rewrite and not role.sequence_dims and not any(role.element_dims or ()):
                    self.full[n] = value  # a rewrite reduces over the sequence: its result is full
                else:
                    self.chunk[n] = value
                return value
            region = self.analysis.grid_members.get(n)
            if region is not None and region.entry in self.grid_windows:
                value = self._run_in_grid_window(n, region)
            else:
                value = self._run_full(n)
            self.full[n] = value
            self.symbolic.learn_created(n.meta.get("val"), value)
            role = self.analysis.roles.get(n)
            if role is not None and role.role == SOURCE and _is_tensor(value):
                self._learn_length(value, role.sequence_dims[0])
            return value

    def _run_full(self, n: fx.Node, reason: str = "") -> Any:
        if n.op == "call_function" and n.target is aten.sym_size.int:
            return self._sym_size(n)
        if (n.op == "call_function" and n.target is operator.getitem and n.args[0] in self.chunk
                and not self.analysis.dims_of(n.args[0], n.args[1])):
            return self.chunk[n.args[0]][n.args[1]]  # an element that is whole on every rank
        if n.op == "call_function" and n.target in SCALAR_READS and n.args[0] in self.scalar_values:
            return self.scalar_values[n.args[0]]
        if self.sp_size > 1 and n.op == "call_function" and (n.target is SDPA or n in self.analysis.regions):
            query = self.analysis.regions[n].query if n in self.analysis.regions else n.args[0]
            if not self.analysis.dims_of(query) and expression(query.meta["val"].shape[-2]) != self.analysis.length:
                # Over another, unsharded sequence (a text encoder's tokens, an audio stream):
                # every rank computes it whole, as eager does; nothing to shard.
                self.replicated_sites.append(n.name)
            else:
                role = self.analysis.roles.get(n)
                self.unsharded_sites.append((n.name, role.reason if role is not None and role.reason else
                                             "its region holds no sequence-sharded value"))
        args = fx.map_arg(n.args, lambda a: self.as_full(a, reason, consumer=n))
        kwargs = fx.map_arg(n.kwargs, lambda a: self.as_full(a, reason, consumer=n))
        target = n.target
        if target in (aten.view.default, aten._unsafe_view.default):
            target = aten.reshape.default  # a gathered value need not be viewable where the original was
        return getattr(self, n.op)(target, args, kwargs)

    def _sym_size(self, n: fx.Node) -> Any:
        source, dim = n.args
        if source in self.full:
            return self.full[source].size(dim)
        seq = self._seq_of(source)
        if dim % self.chunk[source].dim() != seq.dim:
            return self.chunk[source].size(dim)
        if seq.joint:
            before, after = self._segments(seq)
            return before + self.length + after
        outer, inner = self._factors(seq)
        return self.length * outer * inner

    def _run_sharded(self, n: fx.Node) -> Any:
        role = self.analysis.roles[n]
        aligned = set(role.aligned_inputs)
        if role.role == ATTENTION:
            return self._attention(n, aligned)
        if role.rewrite:
            return getattr(self, f"_rewrite_{role.rewrite}")(n)
        args = fx.map_arg(n.args, lambda a: self.as_chunk(a) if a in aligned else self.as_full(a, consumer=n))
        kwargs = fx.map_arg(n.kwargs, lambda a: self.as_chunk(a) if a in aligned else self.as_full(a, consumer=n))
        target = n.target
        if target is SDPA:
            self.rank_local_sites.append(n.name)  # attention over a dimension this rank holds whole
        if target in VIEWS or target is aten.expand.default:
            args = self._local_sizes(n, args)
            if target in (aten.view.default, aten._unsafe_view.default):
                target = aten.reshape.default  # a chunk may not be viewable where the full value was
        elif target in (aten.slice.Tensor, aten.narrow.default):
            source_seq = self._seq_of(n.args[0])
            dim = args[1] % args[0].dim()
            if dim == source_seq.dim:  # a slice that keeps the whole sequence
                return args[0]
        return getattr(self, n.op)(target, args, kwargs)

    def _local_sizes(self, n: fx.Node, args: tuple) -> tuple:
        """Replace the sequence entry of a size list by -1; a view then fits any chunk."""
        target = n.target
        if target in (aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.expand.default):
            sizes, offset = list(args[1]), 0
        elif target is aten.unflatten.int:
            sizes, offset = list(args[2]), args[1] % (args[0].dim())
        elif target in (aten.view_as.default, aten.reshape_as.default):
            # The full-size template is not this rank's shape: reshape to the output's own sizes.
            sizes = self._output_sizes(n)
            return (args[0], sizes)
        else:
            return args
        out_dim = self._seq_of(n).dim - offset
        if not 0 <= out_dim < len(sizes):
            return args
        static = n.meta["val"].shape
        for index, size in enumerate(sizes):
            if index != out_dim and isinstance(size, int) and size == -1 and target is not aten.expand.default:
                # A second inferred size (``ids.view(-1, S)`` with a symbolic batch): spell it out.
                sizes[index] = self.symbolic.evaluate(expression(static[index + offset]))
        sizes[out_dim] = -1
        if target is aten.unflatten.int:
            return (args[0], args[1], sizes, *args[3:])
        return (args[0], sizes, *args[2:])

    def _output_sizes(self, n: fx.Node) -> list[Any]:
        """The output's sizes on this rank: the traced sizes, -1 at the sequence dimension."""
        seq = self._seq_of(n)
        sizes = [self.symbolic.evaluate(expression(size)) for size in n.meta["val"].shape]
        sizes[seq.dim] = -1
        return sizes

    def _attention(self, n: fx.Node, aligned: set[fx.Node]) -> Any:
        if n in self.analysis.regions:
            return self._region_attention(n, aligned)
        query, key, value = n.args[:3]
        mask = sdpa_argument(n, "attn_mask")
        if self.length is None:
            raise CannotShard("attention before the sequence length is known")
        self.sharded_sites.append(n.name)
        seq = self._seq_of(query)
        key_seq = self._seq_of(key) if key in aligned else seq
        segmented = seq if seq.joint else key_seq
        before, after = self._segments(segmented) if segmented.joint else (0, 0)
        return torch.ops.dcp.sharded_attention(
            self.as_chunk(query),
            self.as_chunk(key) if key in aligned else self.as_full(key, consumer=n),
            self.as_chunk(value) if value in aligned else self.as_full(value, consumer=n),
            self.as_full(mask, "the mask of an attention is read in full", consumer=n) if mask is not None else None,
            float(sdpa_argument(n, "dropout_p")),
            bool(sdpa_argument(n, "is_causal")),
            sdpa_argument(n, "scale"),
            bool(sdpa_argument(n, "enable_gqa")),
            self.length,
            key in aligned,
            value in aligned,
            seq.joint,
            key_seq.joint,
            before,
            after,
        )

    def _rewrite_replicated_query_attention(self, n: fx.Node) -> Any:
        """Replicated queries over sharded keys/values: the marker, flagged so the lowering cuts
        the queries to the rank's heads and gathers the output over heads."""
        query, key, value = n.args[:3]
        mask = sdpa_argument(n, "attn_mask")
        if self.length is None:
            raise CannotShard("attention before the sequence length is known")
        self.sharded_sites.append(n.name)
        self.rewrites.append(f"{n.name}: replicated queries over the sharded keys/values "
                             "(keys/values to heads, output gathered over heads)")
        return torch.ops.dcp.sharded_attention(
            self.as_full(query, consumer=n),
            self.as_chunk(key),
            self.as_chunk(value),
            self.as_full(mask, "the mask of an attention is read in full", consumer=n) if mask is not None else None,
            float(sdpa_argument(n, "dropout_p")),
            False,
            sdpa_argument(n, "scale"),
            bool(sdpa_argument(n, "enable_gqa")),
            self.length,
            True,
            True,
            False,
            False,
            0,
            0,
            query_replicated=True,
        )

    def _region_attention(self, n: fx.Node, aligned: set[fx.Node]) -> Any:
        """A hand-written attention region under Ulysses, lowered here: its ops are arbitrary
        head-local elementwise functions of the scores, which no marker op could carry. q, k, v
        go to the rank's heads, the region's ops run there on those heads (masks and per-head
        biases cut to the same heads), and the output comes back to the rank's chunk."""
        if self.length is None:
            raise CannotShard("attention before the sequence length is known")
        site = self.analysis.regions[n]
        query = self.as_chunk(site.query)
        lengths = chunk_lengths(self.length, self.sp_size)
        query_layout, kv_layout = self._region_layouts(site, query, aligned, n)
        query_heads = ulysses.sequence_to_heads(query, query_layout, lengths, self.group)
        out = self._region_on_heads(site, n, aligned, query_heads, query_layout, kv_layout, lengths)
        return ulysses.heads_to_sequence(out, query.shape[1], query.shape[2], lengths, self.group)

    def _rewrite_replicated_query_region(self, n: fx.Node) -> Any:
        """A hand-written attention whose queries are another, replicated stream's over the
        sharded keys/values: as ``replicated_query_attention`` for SDPA, the queries are cut to
        the rank's heads and the output is gathered over heads."""
        if self.length is None:
            raise CannotShard("attention before the sequence length is known")
        site = self.analysis.regions[n]
        aligned = {site.key, site.value}
        query = self.as_full(site.query, consumer=n)
        lengths = chunk_lengths(self.length, self.sp_size)
        query_layout, kv_layout = self._region_layouts(site, query, aligned, n)
        query_heads = ulysses.select_heads(query, query_layout.of_rank(self.rank), False)
        out = self._region_on_heads(site, n, aligned, query_heads, query_layout, kv_layout, lengths)
        self.rewrites.append(f"{n.name}: replicated queries over the sharded keys/values "
                             "(keys/values to heads, output gathered over heads)")
        return ulysses.gather_heads(out, query.shape[1], self.sp_size, self.group)

    def _region_layouts(self, site: Any, query: torch.Tensor, aligned: set[fx.Node],
                        n: fx.Node) -> tuple[ulysses.HeadLayout, ulysses.HeadLayout]:
        query_layout, kv_layout, _ = ulysses.plan_heads(query.shape[1], self._full_or_chunk(site.key, aligned, n).shape[1],
                                                        self.sp_size, enable_gqa=False)
        return query_layout, kv_layout

    def _region_on_heads(self, site: Any, n: fx.Node, aligned: set[fx.Node], query_heads: torch.Tensor,
                         query_layout: ulysses.HeadLayout, kv_layout: ulysses.HeadLayout, lengths: list) -> torch.Tensor:
        """The region's ops on the rank's heads: keys/values from the all-to-all (or cut to the
        heads when every rank has them whole), masks and biases cut to the same heads."""

        def to_heads(node: fx.Node, layout: ulysses.HeadLayout) -> torch.Tensor:
            if node in aligned:
                return ulysses.sequence_to_heads(self.as_chunk(node), layout, lengths, self.group)
            full = self.as_full(node, "the keys/values of an attention are read in full", consumer=n)
            return ulysses.select_heads(full, layout.of_rank(self.rank), False)

        env = {site.query: query_heads, site.key: to_heads(site.key, kv_layout), site.value: to_heads(site.value, kv_layout)}

        def region_value(member: fx.Node, argument: Any) -> Any:
            if argument in env:
                return env[argument]
            full = self.as_full(argument, "a mask or bias of an attention is read in full", consumer=member)
            if _is_tensor(full) and full.dim() >= 3:
                return ulysses.heads_of_rank(full, query_layout, self.rank, full.dim() - 3)
            return full

        for member in site.region.nodes:
            args = fx.map_arg(member.args, lambda a: region_value(member, a))
            kwargs = fx.map_arg(member.kwargs, lambda a: region_value(member, a))
            env[member] = getattr(self, member.op)(member.target, args, kwargs)
        self.sharded_sites.append(n.name)
        return env[n]

    def _full_or_chunk(self, node: fx.Node, aligned: set[fx.Node], consumer: fx.Node) -> torch.Tensor:
        return self.as_chunk(node) if node in aligned else self.as_full(node, consumer=consumer)

    # --- grid windows (see passes/grid_regions and grid_windows) --------------------------

    def _window_arguments(self, region: GridRegion) -> tuple:
        return (self.length, self.symbolic.evaluate(region.unit), region.radius, self.sp_size, self.rank)

    def _window_sizes(self, n: fx.Node, region: GridRegion, tokens_dim: int | None = None) -> list[Any]:
        """``n``'s sizes on this rank's window: the traced sizes, with the outermost grid steps
        (or, at an exit, the tokens) of the window instead of the whole grid's."""
        sizes = [self.symbolic.evaluate(expression(size)) for size in n.meta["val"].shape]
        units = self.grid_windows[region.entry]
        if tokens_dim is not None:
            sizes[tokens_dim] = units * self.symbolic.evaluate(region.unit)
        else:
            grid_dim = region.grid_dims[n]
            sizes[grid_dim.dim] = (self.symbolic.evaluate(grid_dim.outer) * units
                                   * self.symbolic.evaluate(grid_dim.inner))
        return sizes

    def _rewrite_enter_grid_window(self, n: fx.Node) -> Any:
        region = self.analysis.grid_regions[n]
        local = self.as_chunk(n.args[0])
        if self.length is None:
            raise CannotShard("the sequence length is unknown where the grid is entered")
        arguments = self._window_arguments(region)
        _, units = grid_windows.window_units(*arguments)
        window = grid_windows.exchange_grid_window(local, region.token_dim, *arguments, self.group)
        self.grid_windows[n] = units
        self.rewrites.append(f"{n.name}: this rank's window of the token grid (halo exchange of "
                             f"{region.radius} step(s) of {region.unit} tokens each side, no gather)")
        return window.reshape(self._window_sizes(n, region))

    def _run_in_grid_window(self, n: fx.Node, region: GridRegion) -> Any:
        if n.target is aten.sym_size.int:
            return self.symbolic.evaluate(expression(n.meta["val"]))  # the whole grid's size, as traced
        args = fx.map_arg(n.args, self.as_full)
        kwargs = fx.map_arg(n.kwargs, self.as_full)
        target = n.target
        if target in VIEWS:
            return args[0].reshape(self._window_sizes(n, region))
        if target is aten.expand.default:
            return args[0].expand(self._window_sizes(n, region))
        return getattr(self, n.op)(target, args, kwargs)

    def _rewrite_leave_grid_window(self, n: fx.Node) -> Any:
        region = self.analysis.grid_exits[n]
        if region.entry not in self.grid_windows:  # the entry ran on gathered tokens
            return self._narrow(self._run_full(n), self._seq_of(n))
        tokens_dim = region.exits[n]
        window = self.as_full(n.args[0]).reshape(self._window_sizes(n, region, tokens_dim))
        return grid_windows.own_tokens_of_grid_window(window, tokens_dim, *self._window_arguments(region))

    # --- rewrites: the sequence-mixing ops with a cheap exact form -------------------------

    def _total(self, partial: torch.Tensor, n: fx.Node) -> torch.Tensor:
        """The sum of the ranks' ``partial``: when nothing sharded reads it downstream (a loss
        that is returned as it is), backward needs no collective for it."""
        if self.plan.sharded_nodes.isdisjoint(nx.descendants(self.analysis.graph, n)):
            return collectives.all_reduce_sum_for_replicated_use(partial, self.group, self.sp_size)
        return collectives.all_reduce_sum(partial, self.group)

    def _rewrite_sum_over_sequence(self, n: fx.Node) -> Any:
        source = n.args[0]
        local = self.as_chunk(source)
        seq = self._seq_of(source)
        rank = local.dim()
        if n.target in (aten.sum.default, aten.mean.default):
            dims, keepdim = list(range(rank)), False
        else:
            raw = n.args[1]
            dims = [d % rank for d in ([raw] if isinstance(raw, int) else raw)] or list(range(rank))
            keepdim = bool(n.args[2]) if len(n.args) > 2 else bool(n.kwargs.get("keepdim", False))
        dtype = n.kwargs.get("dtype")
        partial = local.sum(dims, keepdim=keepdim, dtype=dtype)
        total = self._total(partial, n)
        self.rewrites.append(f"{n.name}: local sum + all-reduce")
        if n.target in (aten.mean.default, aten.mean.dim):
            count = self.length
            for d in dims:
                if d != seq.dim:
                    count = count * local.shape[d]
            total = total / count
        return total

    def _joint_parts(self, n: fx.Node) -> tuple[torch.Tensor, SequenceDim, Any, Any]:
        source = n.args[0]
        seq = self._seq_of(source)
        before, after = self._segments(seq)
        return self.as_chunk(source), seq, before, after

    def _rewrite_take_sharded_segment(self, n: fx.Node) -> Any:
        local, seq, before, after = self._joint_parts(n)
        self.rewrites.append(f"{n.name}: the chunk of a joint sequence (no gather)")
        return local.narrow(seq.dim, before, local.shape[seq.dim] - before - after)

    def _rewrite_take_leading_segment(self, n: fx.Node) -> Any:
        local, seq, before, _ = self._joint_parts(n)
        self.rewrites.append(f"{n.name}: the replicated leading segment of a joint sequence (no gather)")
        return local.narrow(seq.dim, 0, before)

    def _rewrite_take_trailing_segment(self, n: fx.Node) -> Any:
        local, seq, _, after = self._joint_parts(n)
        self.rewrites.append(f"{n.name}: the replicated trailing segment of a joint sequence (no gather)")
        return local.narrow(seq.dim, local.shape[seq.dim] - after, after)

    def _rewrite_split_segments(self, n: fx.Node) -> Any:
        local, seq, before, after = self._joint_parts(n)
        pieces = [size for size, expr in ((before, seq.before), (local.shape[seq.dim] - before - after, None),
                                           (after, seq.after)) if expr is None or expr != 0]
        self.rewrites.append(f"{n.name}: a joint sequence split into its segments (no gather)")
        return list(torch.split_with_sizes(local, pieces, seq.dim))

    def _rewrite_inverse_permutation(self, n: fx.Node) -> Any:
        index = self.as_chunk(n.args[1][0])
        positions = torch.arange(index.shape[0], device=index.device, dtype=index.dtype)
        self.rewrites.append(f"{n.name}: the inverse of this rank's token permutation (local)")
        return torch.empty_like(index).index_put((index,), positions)

    def _rewrite_contract_over_sequence(self, n: fx.Node) -> Any:
        partial = getattr(self, n.op)(n.target, (self.as_chunk(n.args[0]), self.as_chunk(n.args[1])), n.kwargs)
        self.rewrites.append(f"{n.name}: local matmul over the chunk + all-reduce")
        return collectives.all_reduce_sum(partial, self.group)

    def _rewrite_loss_over_sequence(self, n: fx.Node) -> Any:
        logits, target = self.as_chunk(n.args[0]), self.as_chunk(n.args[1])
        op = n.target
        names = ["weight", "reduction", "ignore_index", "label_smoothing"]
        extra = {name: value for name, value in zip(names, n.args[2:])}
        extra.update({k: v for k, v in n.kwargs.items()})
        weight = self.as_full(extra.get("weight"), consumer=n) if isinstance(extra.get("weight"), fx.Node) else extra.get("weight")
        reduction = extra.get("reduction", 1)
        ignore_index = extra.get("ignore_index", -100)
        args = [logits, target, weight, 2, ignore_index]
        if op is aten.cross_entropy_loss.default:
            args.append(extra.get("label_smoothing", 0.0))
        local_sum = op(*args)
        if isinstance(local_sum, (tuple, list)):
            local_sum = local_sum[0]
        valid = target != ignore_index
        if weight is None:
            count = valid.sum().to(local_sum.dtype)
        else:
            count = torch.where(valid, weight[target.clamp(min=0)], 0).sum().to(local_sum.dtype)
        totals = self._total(torch.stack([local_sum, count]), n)
        self.rewrites.append(f"{n.name}: shard-local {op.__name__ if hasattr(op, '__name__') else op} + all-reduce")
        return totals[0] / totals[1] if reduction == 1 else totals[0]

    def _rewrite_select_position(self, n: fx.Node) -> Any:
        source, dim, index = n.args
        local = self.as_chunk(source)
        dim = dim % local.dim()
        position = index if index >= 0 else self.length + index
        start = chunk_start(self.length, self.sp_size, self.rank)
        positions = torch.arange(local.shape[dim], device=local.device) + start
        weight = (positions == position).to(local.dtype)
        shape = [1] * local.dim()
        shape[dim] = -1
        picked = (local * weight.view(shape)).sum(dim)
        self.rewrites.append(f"{n.name}: the owning rank's position + all-reduce")
        return collectives.all_reduce_sum(picked, self.group)

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
            seq = self._seq_of(node)
            if not local.requires_grad:
                return self.as_full(node)
            if not seq.plain:
                return collectives.scale_gradient(self.as_full(node), scale)
            # The gather itself stays out of autograd: its gradient reaches ``local`` through
            # replicated_output, so backward issues no collective for it on any rank.
            full = self._gather(local.detach(), seq)
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


def shard_sequence_pass(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    analysis = ctx.analysis.sequence
    plan = plan_sharding(analysis) if ctx.sp_size > 1 else ShardPlan()
    fallback_reason = None
    try:
        interpreter = ShardingInterpreter(gm, ctx, analysis, plan)
        sharded = retrace(interpreter.run, ctx.fake_inputs, ctx.fake_mode)
    except CannotShard as reason:
        log.warning("dcp: cannot shard this graph (%s); it runs unsharded on every rank of the "
                    "SP group (correct, but without sequence parallelism)", reason)
        fallback_reason = f"{reason} (at {describe_node(interpreter.current)})"
        plan = ShardPlan()
        interpreter = ShardingInterpreter(gm, ctx, analysis, plan)
        sharded = retrace(interpreter.run, ctx.fake_inputs, ctx.fake_mode)
    if ctx.variant_record is not None:
        ctx.variant_record.gathers.extend(interpreter.gathers)
        ctx.variant_record.rewrites.extend(interpreter.rewrites)
        ctx.variant_record.sharded_regions = plan.regions
        ctx.variant_record.sharded_sites = interpreter.sharded_sites
        ctx.variant_record.rank_local_sites = interpreter.rank_local_sites
        ctx.variant_record.replicated_sites = interpreter.replicated_sites
        ctx.variant_record.unsharded_sites = interpreter.unsharded_sites
        ctx.variant_record.output_gathers = interpreter.output_gathers
        ctx.variant_record.fallback_reason = fallback_reason
        ctx.variant_record.local_fallbacks = interpreter.local_fallbacks
    return sharded

