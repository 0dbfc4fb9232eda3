"""The lowering registry, and the narrow interface between the interpreter and its lowerings.

A lowering is ``(LoweringContext) -> Lowered``: it runs one node on this rank in the re-trace
the interpreter is making. It reads through the context (the node, its role, its inputs in the
layout it asks for, helpers that emit nodes) and returns what it produced; the interpreter alone
stores that into its maps and its record, so no lowering can leave the interpreter's state
half-updated. Keys: a ``Rewrite`` (which the analysis decides), ``Role.ATTENTION``, or an
``OpForm`` (an op the interpreter's generic paths cannot run as they stand, picked from the node
itself on one ``Path``). Each is registered next to the others of its layout family, so
``grep -rn Rewrite.X`` lands on the rule that decides the rewrite and on the code that carries it out.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Callable, Mapping, Union

import torch.fx as fx

from dcp_compile.compiler.passes.sequence_dims import GridRegion, Rewrite, Role, SequenceAnalysis, SequenceDim

if TYPE_CHECKING:
    from dcp_compile.compiler.passes.shard_sequence.interpreter import ShardingInterpreter
    from dcp_compile.compiler.passes.shard_sequence.plan import ShardPlan


class Path(Enum):
    """Where the interpreter runs a node: on chunks (the plan shards it), on full values, or on
    this rank's window of a token grid."""

    CHUNK = "chunk"
    FULL = "full"
    WINDOW = "window"


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
    SIZE_ON_WINDOW = "size_on_window"  # the whole grid's size, as traced
    VIEW_ON_WINDOW = "view_on_window"  # a view to the window's sizes


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


class LoweringContext:
    """A read-only view of the interpreter for one node: what a lowering may read and ask for.

    Asking for an input's chunk or full value may convert it (a slice, a gather with its
    reason): the interpreter does that and keeps the result, as for any other consumer. The
    context exposes no map and takes no assignment."""

    __slots__ = ("node", "role", "path", "reason", "_interpreter")

    def __init__(self, interpreter: ShardingInterpreter, node: fx.Node, path: Path, reason: str = "") -> None:
        for name, value in (("_interpreter", interpreter), ("node", node), ("path", path), ("reason", reason),
                            ("role", interpreter.analysis.roles.get(node))):
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
        """Where the plan keeps this node's result: full on the full and window paths and for a
        rewrite that reduces over the sequence, in chunks otherwise."""
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


LoweringKey = Union[Rewrite, Role, OpForm]
Lowering = Callable[[LoweringContext], Lowered]
LOWERINGS: dict[LoweringKey, Lowering] = {}


@dataclass(frozen=True)
class FormRule:
    """When ``form`` applies to a node on ``path``."""

    form: OpForm
    path: Path
    when: Callable[[LoweringContext], bool]


FORM_RULES: list[FormRule] = []  # in registration order: the first that holds wins


def select_form(context: LoweringContext) -> OpForm | None:
    """The first registered ``OpForm`` of the context's path that applies to its node."""
    return next((rule.form for rule in FORM_RULES if rule.path is context.path and rule.when(context)), None)


class CannotShard(Exception):
    """The graph uses a pattern the sharding pass does not handle; it will run unsharded."""


class WriteRefused(Exception):
    """An in-place write the analysis kept on chunks has no chunked form in this trace.

    On a gathered copy the write would never reach the buffer's chunk, so the op alone cannot fall
    back; the sharding pass re-traces with the whole buffer up to its last write (``members``) on
    the full sequence instead, each member's inputs gathered with ``reason`` (default deny: a
    gather with a reason, never a compile error)."""

    def __init__(self, members: frozenset[fx.Node], reason: str) -> None:
        super().__init__(reason)
        self.members, self.reason = members, reason


@dataclass
class GatherRecord:
    """An all-gather of ``node`` before ``op``; every one says why (issue 24: never a silent gather)."""

    node: str
    op: str
    reason: str

    def __post_init__(self) -> None:
        if not self.reason.strip():
            raise ValueError(f"dcp: the all-gather of {self.node} before {self.op} has no reason; the sequence "
                             "analysis must give every gathered op one (a rule returned an empty reason)")

    def __str__(self) -> str:
        return f"all-gather of {self.node} before {self.op}: {self.reason}"


def lowering(key: LoweringKey) -> Callable[[Lowering], Lowering]:
    """Register ``function`` as the lowering of ``key``."""

    def register(function: Lowering) -> Lowering:
        if key in LOWERINGS:
            raise ValueError(f"two lowerings registered for {key!r}: {LOWERINGS[key].__name__} and {function.__name__}")
        LOWERINGS[key] = function
        return function

    return register


def op_form(form: OpForm, path: Path, when: Callable[[LoweringContext], bool]) -> Callable[[Lowering], Lowering]:
    """Register ``function`` as the lowering of ``form``, which applies on ``path`` where ``when`` holds."""

    def register(function: Lowering) -> Lowering:
        lowering(form)(function)
        FORM_RULES.append(FormRule(form, path, when))
        return function

    return register
