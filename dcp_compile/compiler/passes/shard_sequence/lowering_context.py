"""The narrow interface between the sharding interpreter and its lowerings.

A lowering reads a ``LoweringContext`` (a read-only view of the interpreter for one node) and
returns a ``Lowered`` record; the interpreter alone stores what it says into its value maps and
its record, so no lowering can leave the interpreter's state half-updated. ``Path`` says where
the interpreter runs the node, ``OpForm`` names the ops its generic paths cannot run as they stand.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Mapping

import torch.fx as fx

from dcp_compile.compiler.passes.sequence_dims import GridRegion, SequenceAnalysis, SequenceDim

if TYPE_CHECKING:
    from dcp_compile.compiler.passes.shard_sequence.interpreter import ShardingInterpreter
    from dcp_compile.compiler.passes.shard_sequence.plan import ShardPlan


class Path(Enum):
    """Where the interpreter runs a node: on chunks (the plan shards it), on full values, on this
    rank's window of a token grid, or (``GATHER``) to turn its chunk into its full value."""

    CHUNK = "chunk"
    FULL = "full"
    WINDOW = "window"
    GATHER = "gather"  # a chunked value asked for in full: what to do in place of its plain gather


class OpForm(Enum):
    """An op the interpreter's generic path cannot run as it stands. Unlike a ``Rewrite`` (decided
    by the analysis, one per role), the interpreter picks it from the node on one ``Path``: the
    first registered form whose ``when`` holds."""

    VIEW_ON_CHUNK = "view_on_chunk"  # sizes with -1 at the sequence: one graph fits every chunk
    SLICE_ON_CHUNK = "slice_on_chunk"  # a slice along the sequence that keeps all of it
    RANK_LOCAL_ATTENTION = "rank_local_attention"  # over a dimension this rank holds whole
    SIZE_OF_FULL = "size_of_full"  # a size read of a value held in chunks
    WHOLE_ELEMENT = "whole_element"  # an element of a chunked tuple that no rank holds in part
    SCALAR_READ = "scalar_read"  # a scalar input's value, known at compile time
    WHOLE_ATTENTION = "whole_attention"  # an attention every rank computes whole
    VIEW_ON_FULL = "view_on_full"  # a reshape: a gathered value need not be viewable where the original was
    SIZE_ON_WINDOW = "size_on_window"  # the whole grid's size, as traced
    VIEW_ON_WINDOW = "view_on_window"  # a view to the window's sizes
    SELECTION_OF_GATHERED_SOURCE = "selection_of_gathered_source"  # one gather for a batch's selections
    GATHER_FOR_OUTPUT = "gather_for_output"  # gathered as an output is: only reshaped into outputs


class Layout(Enum):
    """Which of the interpreter's maps holds a value: this rank's chunk, or the full value."""

    CHUNK = "chunk"
    FULL = "full"


class Site(Enum):
    """How an attention site ran, for the variant record."""

    SHARDED = "sharded"
    RANK_LOCAL = "rank_local"
    REPLICATED = "replicated"
    UNSHARDED = "unsharded"


@dataclass(frozen=True)
class Lowered:
    """What a lowering produced; the interpreter stores it (a lowering never writes its maps)."""

    value: Any
    layout: Layout
    rewrite: str | None = None  # the record's line for a rewrite (after the node's name)
    site: Site | None = None  # an attention site this node ran
    site_reason: str = ""  # why an unsharded site ran whole
    window_units: Any = None  # at a grid entry: the outermost grid steps in this rank's window
    output_gather: bool = False  # gathered as an output (counted so, gradient unsummed, not kept)


class LoweringContext:
    """A read-only view of the interpreter for one node: what a lowering may read and ask for.

    Asking for an input's chunk or full value may convert it (a slice, a gather with its
    reason): the interpreter does that and keeps the result, as for any other consumer. The
    context exposes no map and takes no assignment."""

    __slots__ = ("_interpreter", "consumer", "node", "path", "reason", "role")

    def __init__(self, interpreter: ShardingInterpreter, node: fx.Node, path: Path, reason: str = "",
                 consumer: fx.Node | None = None) -> None:
        """``reason``: why inputs gathered for ``node`` are (or, on ``Path.GATHER``, why
        ``node`` is) read in full; ``consumer``: on ``Path.GATHER``, the node asking for it."""
        for name, value in (("_interpreter", interpreter), ("node", node), ("path", path), ("reason", reason),
                            ("consumer", consumer), ("role", interpreter.analysis.roles.get(node))):
            object.__setattr__(self, name, value)

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"a lowering context is read-only: return {name} in a Lowered instead")

    def __delattr__(self, name: str) -> None:
        raise AttributeError("a lowering context is read-only")

    # --- what the lowering reads ---------------------------------------------------------

    @property
    def analysis(self) -> SequenceAnalysis:
        return self._interpreter.analysis

    @property
    def plan(self) -> ShardPlan:
        return self._interpreter.plan

    @property
    def length(self) -> Any:
        """The full sequence length (an int or a SymInt of this trace), None until seen."""
        return self._interpreter.length

    @property
    def sp_size(self) -> int:
        return self._interpreter.sp_size

    @property
    def rank(self) -> int:
        return self._interpreter.rank

    @property
    def group(self) -> str:
        return self._interpreter.group

    @property
    def layout(self) -> Layout:
        """Where the plan keeps this node's result: full off the chunk path, and for a rewrite
        that reduces over the sequence; in chunks otherwise."""
        if self.path is not Path.CHUNK:
            return Layout.FULL
        role = self.role
        if role.rewrite and not role.sequence_dims and not any(role.element_dims or ()):
            return Layout.FULL
        return Layout.CHUNK

    def lowered(self, value: Any, **notes: Any) -> Lowered:
        """``value`` in the layout the plan gives this node, with the record's ``notes``."""
        return Lowered(value, self.layout, **notes)

    def seq_of(self, node: fx.Node, index: int | None = None) -> SequenceDim:
        return self._interpreter.seq_of(node, index)

    def segments(self, seq: SequenceDim) -> tuple[Any, Any]:
        return self._interpreter.segments(seq)

    def factors(self, seq: SequenceDim) -> tuple[Any, Any]:
        return self._interpreter.factors(seq)

    def evaluate(self, expr: Any) -> Any:
        """A size expression of the analysis as an int or a SymInt of this trace."""
        return self._interpreter.symbolic.evaluate(expr)

    def window_units(self, entry: fx.Node) -> Any:
        """The outermost grid steps of this rank's window entered at ``entry``; None when the
        entry ran on gathered tokens."""
        return self._interpreter.grid_windows.get(entry)

    def window_arguments(self, region: GridRegion) -> tuple:
        return self._interpreter.window_arguments(region)

    def window_sizes(self, region: GridRegion, tokens_dim: int | None = None, units: Any = None) -> list[Any]:
        """The node's sizes on this rank's window (``units``: the window's steps, at its entry)."""
        return self._interpreter.window_sizes(self.node, region, tokens_dim, units)

    @property
    def scalar_values(self) -> Mapping[fx.Node, Any]:
        """Scalar inputs whose values are baked into this compile (read-only)."""
        return MappingProxyType(self._interpreter.scalar_values)

    @property
    def output_tail(self) -> frozenset[fx.Node]:
        """Nodes only reshaped into the graph's outputs (a returned slice of a K/V cache)."""
        return self._interpreter.output_tail

    def holds_full(self, node: Any) -> bool:
        """Whether ``node``'s full value is at hand (reading it then converts nothing)."""
        return node in self._interpreter.full

    def holds_chunk(self, node: Any) -> bool:
        """Whether ``node``'s chunk is at hand (reading it then converts nothing)."""
        return node in self._interpreter.chunk

    # --- what the lowering asks for --------------------------------------------------------

    def chunk_of(self, node: Any) -> Any:
        """``node``'s chunk on this rank (sliced from its full value once, if need be)."""
        return self._interpreter.as_chunk(node)

    def full_of(self, node: Any, reason: str = "", consumer: fx.Node | None = None) -> Any:
        """``node``'s full value; a gather for ``consumer`` is recorded with ``reason``."""
        return self._interpreter.as_full(node, reason, consumer)

    def any_layout(self, node: Any) -> Any:
        """``node`` in whichever layout is at hand, for a read of its metadata."""
        return self._interpreter.any_layout(node)

    def narrow(self, value: Any, seq: SequenceDim) -> Any:
        return self._interpreter.narrow(value, seq)

    def gather(self, value: Any, seq: SequenceDim) -> Any:
        """An all-gather of a chunk ``value`` (no record: the caller says what it is)."""
        return self._interpreter.gather(value, seq)

    def chunk_args(self, metadata: tuple[int, ...] | None = None) -> tuple[tuple, dict]:
        """The node's arguments as the chunk path maps them: aligned inputs in chunks, the rest
        full (gathered for this node, with its reason), metadata reads in any layout."""
        return self._interpreter.chunk_args(self.node, metadata)

    def full_args(self) -> tuple[tuple, dict]:
        """The node's arguments as the full path maps them (gathers recorded with ``reason``)."""
        return self._interpreter.full_args(self.node, self.reason)

    def run_op(self, op: str, target: Any, args: tuple, kwargs: dict) -> Any:
        """Emit one op into the trace."""
        return getattr(self._interpreter, op)(target, args, kwargs)

    def call(self, target: Any, args: tuple, kwargs: dict | None = None) -> Any:
        return self._interpreter.call_function(target, args, kwargs or {})

    def run_generic(self) -> Any:
        """The node run by its path's generic form (as if it had no lowering)."""
        return self._interpreter.run_generic(self.node, self.path, self.reason)

    def run_full(self) -> Any:
        """The node run on full inputs (its full path, forms included): its full value."""
        return self._interpreter.run_full(self.node, self.reason)
