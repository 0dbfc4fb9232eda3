"""The sequence analysis' data: where the sequence is in a value, what a node does to it, and the
analysis' result. Every rule and lowering speaks these types; nothing here knows any op.

Rules read the analysis through :class:`ReadOnlyAnalysis` (the :class:`AnalysisView` they are
typed with) and return what they find besides a role in :class:`Findings`; the driver is the one
writer. An attempt that finds an earlier assumption wrong stops with a :class:`Refusal`.

Roles and rewrites are enums so that ``grep -rn "Rewrite.SUM_OVER_SEQUENCE"`` finds both the rule
that decides it and the lowering that carries it out (``shard_sequence``).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from enum import Enum
from types import MappingProxyType
from typing import Any, Callable, Mapping, Protocol, Union

import networkx as nx
import sympy
import torch.fx as fx

from dcp_compile.compiler.passes.find_attention import AttentionSite


class _NamedEnum(str, Enum):
    """An enum whose members print as their value (``dcp.explain`` shows ``sequence_mixing``)."""

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)


class Role(_NamedEnum):
    """What a node does to the sequence."""

    SOURCE = "source"  # creates a sequence dimension (an input, an arange, a patchify's flatten)
    TOKEN_LOCAL = "token_local"  # keeps every position apart: runs on a chunk
    ATTENTION = "attention"  # reads across positions inside attention only (Ulysses)
    MIXING = "sequence_mixing"  # reads across positions: gathered, unless a Rewrite applies
    NONE = "none"  # no sequence dimension in or out
    # A value computed from the set of this rank's tokens that is not indexed by them (per-expert
    # token counts of an MoE dispatch): it runs on the rank's tokens and is never gathered.
    TOKEN_SET = "token_set"


class Rewrite(_NamedEnum):
    """A sequence-mixing op with a cheap exact form on chunks; ``shard_sequence`` lowers each."""

    REPLICATED_QUERY_ATTENTION = "replicated_query_attention"
    REPLICATED_QUERY_REGION = "replicated_query_region"
    SELECT_POSITION = "select_position"
    TAKE_SHARDED_SEGMENT = "take_sharded_segment"
    TAKE_LEADING_SEGMENT = "take_leading_segment"
    TAKE_TRAILING_SEGMENT = "take_trailing_segment"
    SPLIT_SEGMENTS = "split_segments"
    SUM_OVER_SEQUENCE = "sum_over_sequence"
    CONTRACT_OVER_SEQUENCE = "contract_over_sequence"
    LOSS_OVER_SEQUENCE = "loss_over_sequence"
    INVERSE_PERMUTATION = "inverse_permutation"
    ENTER_GRID_WINDOW = "enter_grid_window"
    LEAVE_GRID_WINDOW = "leave_grid_window"


class _Inherit(Enum):
    INHERIT = "inherit"


# A rule's token order when it sets none: the one order its aligned inputs share (resolved by the
# propagation driver before the role is stored).
INHERIT = _Inherit.INHERIT
TokenOrder = Union[fx.Node, None, _Inherit]


@dataclass(frozen=True)
class SequenceDim:
    """Dimension ``dim`` has size ``outer * L * inner`` (row-major), L the sequence length.

    A *joint* dimension (joint attention: text tokens concatenated with image tokens) has size
    ``before + L + after``: only the L tokens of the long modality are sharded, the short
    segments around them are replicated, so a rank holds ``[before | its chunk of L | after]``.
    """

    dim: int
    outer: Any = sympy.Integer(1)
    inner: Any = sympy.Integer(1)
    before: Any = sympy.Integer(0)
    after: Any = sympy.Integer(0)

    @property
    def plain(self) -> bool:
        return self.outer == 1 and self.inner == 1 and self.before == 0 and self.after == 0

    @property
    def joint(self) -> bool:
        return self.outer == 1 and self.inner == 1 and not (self.before == 0 and self.after == 0)

    @property
    def unflattened(self) -> bool:
        """Not folded with another dimension (plain or joint)."""
        return self.outer == 1 and self.inner == 1

    def moved(self, dim: int) -> "SequenceDim":
        return replace(self, dim=dim)

    def __str__(self) -> str:
        if self.plain:
            return f"dim {self.dim}"
        if self.joint:
            return f"dim {self.dim} = {self.before} + L + {self.after} (replicated around the chunk)"
        return f"dim {self.dim} = {self.outer}*L*{self.inner}"


@dataclass
class NodeRole:
    """What a rule decides for one node, and what the analysis keeps for it (one record for both)."""

    role: Role
    sequence_dims: tuple[SequenceDim, ...] = ()  # of the output (of element 0 for tuples)
    aligned_inputs: tuple[fx.Node, ...] = ()  # inputs whose chunking must match this node's
    reason: str = ""
    rewrite: Rewrite | None = None
    element_dims: tuple[tuple[SequenceDim, ...], ...] | None = None  # per element of a tuple output
    # The sort whose order this value's token rows follow (None: token order); INHERIT only in a
    # rule's answer, never in the analysis.
    token_order: TokenOrder = INHERIT
    # Operands with no sequence dimension of their own that span it by broadcasting: the
    # propagation driver records them as sources of ``dim`` (see registry.pointwise).
    partners: tuple[tuple[fx.Node, SequenceDim], ...] = ()
    # What the rule found besides the role (positions, a grid region, a refusal): recorded on the
    # analysis by the driver (``registry.record_findings``), never kept in the analysis' roles.
    findings: "Findings" = field(default_factory=lambda: NO_FINDINGS)


@dataclass(frozen=True)
class TokenPositions:
    """An index tensor whose values are local row positions.

    ``sort`` is the permutation they belong to; ``inner`` the frame they address (positions into a
    token dimension ``outer * L * inner``: the ``[B*S*k]`` (token, expert) pairs have inner k,
    ``[B*S]`` tokens inner 1); ``inverse`` marks the inverse permutation (token order to sorted
    position) rather than the sort's own indices (sorted position to token order).
    """

    sort: fx.Node
    inner: Any
    inverse: bool = False


class RefusalKind(_NamedEnum):
    """What an attempt of the analysis assumed that a later node showed wrong."""

    GRID = "grid"  # a grid region reads a sequence-indexed value from outside: its entry gathers
    DISPATCH = "dispatch"  # a local token sort's counts or order are read beyond it: it sorts gathered tokens

    @property
    def consequence(self) -> str:
        """What the refused node does in the next attempt (logged with the refusal)."""
        return "gathers: no grid window" if self is RefusalKind.GRID else "sorts the gathered tokens"


@dataclass(frozen=True)
class Refusal:
    """Why an attempt stops: found only when the propagation reaches a node that reads what an
    earlier node assumed (a grid window, a local dispatch). The driver records ``reason`` for
    ``node`` (the grid's entry, the sort) and runs the next attempt without the assumption."""

    kind: RefusalKind
    node: fx.Node
    reason: str

    def error(self) -> Exception:
        """The exception :func:`propagation.propagate` raises for it (one attempt, for tests)."""
        return (GridRegionRefused if self.kind is RefusalKind.GRID else DispatchRefused)(self.node, self.reason)


@dataclass(frozen=True)
class Findings:
    """What a rule found besides the node's role. A rule only reads the analysis; the driver
    records these (``registry.record_findings``), so one caller writes and one place says how."""

    # (None: the node's own value, i: element i of its tuple) -> the positions it holds (token_sets)
    positions: tuple[tuple["int | None", TokenPositions], ...] = ()
    grid_region: "GridRegion | None" = None  # the grid region the node enters (grid_rules)
    refused_grid: "str | None" = None  # why the reshape opens no grid region (it keeps its view rule)
    refusal: Refusal | None = None  # an assumption of this attempt found wrong: the attempt stops

    def __bool__(self) -> bool:
        return bool(self.positions) or self.grid_region is not None or self.refused_grid is not None \
            or self.refusal is not None


NO_FINDINGS = Findings()


@dataclass(frozen=True)
class GridRegion:
    """A stretch that reshapes the tokens into a grid and back, run on each rank's window (see
    ``grid_rules``). Filled in by its discovery (``grid_rules.find_grid_region``), then a fact:
    nothing changes a region once an entry's rule has returned it."""

    entry: fx.Node  # the reshape that splits the tokens into a grid
    token_dim: int  # the tokens' dimension in the entry's input
    units: Any  # sympy: outermost grid steps (rows of an image, frames of a video)
    unit: Any  # sympy: tokens per outermost step
    radius: int = 0  # outermost steps a kept position reads on each side
    grid_dims: dict[fx.Node, SequenceDim] = field(default_factory=dict)  # member -> its outermost grid dimension
    exits: dict[fx.Node, int] = field(default_factory=dict)  # reshape back to tokens -> its token dimension
    size_reads: set[fx.Node] = field(default_factory=set)  # sym_size of members (read as the full grid's)
    outside_inputs: dict[fx.Node, set[fx.Node]] = field(default_factory=dict)  # member -> inputs from outside

    @property
    def members(self) -> set[fx.Node]:
        return set(self.grid_dims) - {self.entry}


class GridRegionRefused(Exception):
    """A grid region's member reads a sequence-indexed value from outside the region (its entry
    gathers next attempt). Raised only by ``propagation.propagate``, one attempt for tests: the
    driver reads the :class:`Refusal` an attempt returns and loops."""

    def __init__(self, entry: fx.Node, reason: str) -> None:
        super().__init__(reason)
        self.entry, self.reason = entry, reason


class DispatchRefused(Exception):
    """Counts of a local token sort (an MoE's per-expert group sizes) are read per token, beyond
    the dispatch (a capacity limit): which tokens drop then depends on every rank's tokens, so the
    sort runs on the gathered tokens next attempt. Raised only by ``propagation.propagate`` (see
    :class:`GridRegionRefused`)."""

    def __init__(self, sort: fx.Node, reason: str) -> None:
        super().__init__(reason)
        self.sort, self.reason = sort, reason


@dataclass
class Decompositions:
    """What the decomposition rule found per op and operand layout (see ``decomposition_rules``):
    a memo of a pure function of its key, so one analysis traces each decomposition once. Shared
    by the attempts of one analysis and the analyses of decompositions nested in it; never by two
    graphs' analyses (no module state)."""

    found: dict[Any, "NodeRole | str"] = field(default_factory=dict)

    def get(self, key: Any, compute: Callable[[], "NodeRole | str"]) -> "NodeRole | str":
        if key not in self.found:
            self.found[key] = compute()
        return self.found[key]


@dataclass
class SequenceAnalysis:
    length: Any  # sympy expression of the attention length, or None when there is no attention
    roles: dict[fx.Node, NodeRole] = field(default_factory=dict)
    graph: nx.DiGraph | None = None
    regions: dict[fx.Node, AttentionSite] = field(default_factory=dict)  # hand-written region output -> site
    region_members: dict[fx.Node, AttentionSite] = field(default_factory=dict)  # its other nodes -> site
    positions: dict[Any, TokenPositions] = field(default_factory=dict)  # node or (node, index) -> positions
    parameters: frozenset[fx.Node] = frozenset()  # placeholders holding the model's parameters
    # For a constant length only: the dimensions that hold the tokens on the way to an attention
    # (ties between dimensions of the length's size are broken by them; see token_hints).
    token_dims: dict[fx.Node, set[int]] | None = None
    # Token grids run on each rank's window (see grid_rules): entry -> region, its members (and
    # size reads of them) -> region, its exits -> region; entries refused on an earlier attempt.
    grid_regions: dict[fx.Node, GridRegion] = field(default_factory=dict)
    grid_members: dict[fx.Node, GridRegion] = field(default_factory=dict)
    grid_exits: dict[fx.Node, GridRegion] = field(default_factory=dict)
    refused_grids: dict[fx.Node, str] = field(default_factory=dict)
    # Members of buffers written in place whose writes no rule proved chunk-aligned, with why
    # (see inplace_writes): they run on the full sequence.
    written_aliases: dict[fx.Node, str] = field(default_factory=dict)
    # Token sorts that run on the gathered tokens instead of the rank's own, with why (see
    # DispatchRefused): the dispatch downstream of them is whole on every rank.
    refused_dispatches: dict[fx.Node, str] = field(default_factory=dict)
    # Decompositions this analysis is nested in (0 for a graph's; see decomposition_rules), and
    # the memo of what their rule found.
    depth: int = 0
    decompositions: Decompositions = field(default_factory=Decompositions)

    def dims_of(self, node: Any, index: int | None = None) -> tuple[SequenceDim, ...]:
        role = self.roles.get(node) if isinstance(node, fx.Node) else None
        if role is None:
            return ()
        if index is not None and role.element_dims is not None:
            return role.element_dims[index] if index < len(role.element_dims) else ()
        return role.sequence_dims

    def role_of(self, node: Any) -> Role | None:
        role = self.roles.get(node) if isinstance(node, fx.Node) else None
        return None if role is None else role.role

    def enter_grid(self, region: GridRegion) -> None:
        """Record a grid region found at its entry (``grid_rules``): its members and exits are
        classified as the region's from now on."""
        self.grid_regions[region.entry] = region
        for member in region.members | region.size_reads:
            self.grid_members[member] = region
        for exit_node in region.exits:
            self.grid_exits[exit_node] = region

    def table(self) -> list[tuple[str, str, str, str]]:
        rows = []
        for node, role in self.roles.items():
            if role.role is Role.NONE:
                continue
            dims = ", ".join(str(d) for d in role.sequence_dims) or "-"
            detail = role.rewrite and f"rewrite: {role.rewrite}" or role.reason
            if node in self.refused_grids and not role.rewrite:
                detail += f" (no grid window: {self.refused_grids[node]})"
            rows.append((node.name, str(node.target).replace("aten.", ""), role.role.value, f"{dims} {detail}".strip()))
        return rows


class AnalysisView(Protocol):
    """What a rule reads of the analysis; a rule is ``(node, AnalysisView) -> NodeRole`` and
    writes nothing (what it finds besides the role travels in ``NodeRole.findings``)."""

    @property
    def length(self) -> Any: ...
    @property
    def roles(self) -> Mapping[fx.Node, NodeRole]: ...
    @property
    def graph(self) -> nx.DiGraph | None: ...
    @property
    def regions(self) -> Mapping[fx.Node, AttentionSite]: ...
    @property
    def region_members(self) -> Mapping[fx.Node, AttentionSite]: ...
    @property
    def positions(self) -> Mapping[Any, TokenPositions]: ...
    @property
    def parameters(self) -> frozenset[fx.Node]: ...
    @property
    def token_dims(self) -> Mapping[fx.Node, set[int]] | None: ...
    @property
    def grid_regions(self) -> Mapping[fx.Node, GridRegion]: ...
    @property
    def grid_members(self) -> Mapping[fx.Node, GridRegion]: ...
    @property
    def grid_exits(self) -> Mapping[fx.Node, GridRegion]: ...
    @property
    def refused_grids(self) -> Mapping[fx.Node, str]: ...
    @property
    def written_aliases(self) -> Mapping[fx.Node, str]: ...
    @property
    def refused_dispatches(self) -> Mapping[fx.Node, str]: ...
    @property
    def depth(self) -> int: ...
    @property
    def decompositions(self) -> Decompositions: ...

    def dims_of(self, node: Any, index: int | None = None) -> tuple[SequenceDim, ...]: ...

    def role_of(self, node: Any) -> Role | None: ...


_MAPPINGS = ("roles", "regions", "region_members", "positions", "token_dims", "grid_regions", "grid_members",
             "grid_exits", "refused_grids", "written_aliases", "refused_dispatches")
_VALUES = ("length", "graph", "parameters", "depth", "decompositions")


class ReadOnlyAnalysis:
    """A :class:`SequenceAnalysis` as the rules see it: every fact readable, none writable (its
    dicts are read-only mappings, setting an attribute raises). ``decompositions`` is the one
    object reachable for writing: a memo of a pure function, no fact of the analysis."""

    __slots__ = ("_analysis",)

    def __init__(self, analysis: SequenceAnalysis) -> None:
        object.__setattr__(self, "_analysis", analysis)

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"a sequence rule reads the analysis and never sets {name!r}: return what it "
                             "found in NodeRole.findings")

    def __delattr__(self, name: str) -> None:
        raise AttributeError(f"a sequence rule never deletes {name!r} from the analysis")

    def dims_of(self, node: Any, index: int | None = None) -> tuple[SequenceDim, ...]:
        return self._analysis.dims_of(node, index)

    def role_of(self, node: Any) -> Role | None:
        return self._analysis.role_of(node)


def _mapping_property(name: str) -> property:
    def read(self: ReadOnlyAnalysis) -> Any:
        value = getattr(self._analysis, name)
        return None if value is None else MappingProxyType(value)
    return property(read, doc=f"``SequenceAnalysis.{name}``, read-only")


def _value_property(name: str) -> property:
    return property(lambda self: getattr(self._analysis, name), doc=f"``SequenceAnalysis.{name}``")


for _name in _MAPPINGS:
    setattr(ReadOnlyAnalysis, _name, _mapping_property(_name))
for _name in _VALUES:
    setattr(ReadOnlyAnalysis, _name, _value_property(_name))
del _name


def read_only(analysis: "SequenceAnalysis | ReadOnlyAnalysis") -> ReadOnlyAnalysis:
    """The view a rule gets of ``analysis`` (itself when it is a view already)."""
    return analysis if isinstance(analysis, ReadOnlyAnalysis) else ReadOnlyAnalysis(analysis)


def fx_to_networkx(graph: fx.Graph) -> nx.DiGraph:
    """The graph's data flow as a networkx DiGraph (an edge from each input node to its user)."""
    digraph = nx.DiGraph()
    for node in graph.nodes:
        digraph.add_node(node)
        for source in node.all_input_nodes:
            digraph.add_edge(source, node)
    return digraph
