"""Which dimension of every value is the sequence, and what every op does to it.

The sequence length is read off the attention sites (the queries' length dimension), as a
symbolic expression: ``s0`` for text, ``(H//2)*(W//2)`` for an image model that forms its tokens
in the graph. A dimension of a value is a sequence dimension when its size is that expression,
or a product that contains it after a flatten (``[B*S, V]`` logits before the loss): such a
dimension is recorded as ``outer * L * inner`` in row-major order, which is all a shard or a
gather needs to address the right rows.

Every node gets a role:

* ``source``: creates a sequence dimension from values that have none (a graph input, an
  ``arange``, the flatten that turns a patch grid into tokens, the ``cat`` that prepends a CLS
  token). Computed on the full sequence, then sliced.
* ``token_local``: keeps each position separate (elementwise, linear over features, norms over
  features, views that keep the sequence factor): safe on a chunk.
* ``attention``: reads across the sequence but only inside attention (Ulysses handles it).
* ``sequence_mixing``: anything else that reads across positions; it needs the full sequence
  (an all-gather) unless a known rewrite applies (``rewrite`` names it).
* ``none``: no sequence dimension in or out.

The analysis is built on networkx: the FX graph becomes a DiGraph, and the roles are propagated in
its topological order.
"""

from __future__ import annotations

import logging
import operator
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Iterable

import networkx as nx
import sympy
import torch
import torch.fx as fx

from dcp_compile.compiler.custom_autograd import custom_autograd_function, function_of
from dcp_compile.compiler.passes.context import PassContext
from dcp_compile.compiler.passes.find_attention import SDPA, AttentionSite, sdpa_argument

aten = torch.ops.aten
log = logging.getLogger(__name__)

SOURCE, TOKEN_LOCAL, ATTENTION, MIXING, NONE = "source", "token_local", "attention", "sequence_mixing", "none"
# A value computed from the set of this rank's tokens that is not indexed by them (per-expert token
# counts of an MoE dispatch): it runs on the rank's tokens and is never gathered.
TOKEN_SET = "token_set"
INHERIT = object()  # a rule result's token order: that of its aligned inputs


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
    role: str
    sequence_dims: tuple[SequenceDim, ...] = ()  # of the output (of element 0 for tuples)
    element_dims: tuple[tuple[SequenceDim, ...], ...] | None = None  # per element of a tuple output
    aligned_inputs: tuple[fx.Node, ...] = ()  # inputs whose chunking must match this node's
    reason: str = ""
    rewrite: str | None = None
    token_order: fx.Node | None = None  # the sort whose order this value's token rows follow (None: token order)


@dataclass
class SequenceAnalysis:
    length: Any  # sympy expression of the attention length, or None when there is no attention
    roles: dict[fx.Node, NodeRole] = field(default_factory=dict)
    graph: nx.DiGraph | None = None
    regions: dict[fx.Node, AttentionSite] = field(default_factory=dict)  # hand-written region output -> site
    region_members: dict[fx.Node, AttentionSite] = field(default_factory=dict)  # its other nodes -> site
    positions: dict[Any, Any] = field(default_factory=dict)  # node or (node, index) -> TokenPositions
    parameters: frozenset[fx.Node] = frozenset()  # placeholders holding the model's parameters
    # For a constant length only: the dimensions that hold the tokens on the way to an attention
    # (ties between dimensions of the length's size are broken by them; see sequence_hints).
    token_dims: dict[fx.Node, set[int]] | None = None
    # Token grids run on each rank's window (see grid_regions): entry -> region, its members (and
    # size reads of them) -> region, its exits -> region; entries refused on an earlier attempt.
    grid_regions: dict[fx.Node, Any] = field(default_factory=dict)
    grid_members: dict[fx.Node, Any] = field(default_factory=dict)
    grid_exits: dict[fx.Node, Any] = field(default_factory=dict)
    refused_grids: dict[fx.Node, str] = field(default_factory=dict)

    def dims_of(self, node: Any, index: int | None = None) -> tuple[SequenceDim, ...]:
        role = self.roles.get(node) if isinstance(node, fx.Node) else None
        if role is None:
            return ()
        if index is not None and role.element_dims is not None:
            return role.element_dims[index] if index < len(role.element_dims) else ()
        return role.sequence_dims

    def table(self) -> list[tuple[str, str, str, str]]:
        rows = []
        for node, role in self.roles.items():
            if role.role == NONE:
                continue
            dims = ", ".join(str(d) for d in role.sequence_dims) or "-"
            detail = role.rewrite and f"rewrite: {role.rewrite}" or role.reason
            if node in self.refused_grids and not role.rewrite:
                detail += f" (no grid window: {self.refused_grids[node]})"
            rows.append((node.name, str(node.target).replace("aten.", ""), role.role, f"{dims} {detail}".strip()))
        return rows


# --- symbolic size helpers ----------------------------------------------------------------

def expression(size: Any) -> Any:
    if isinstance(size, torch.SymInt):
        return size.node.expr
    return sympy.Integer(int(size))


def shape_of(value: Any) -> list[Any] | None:
    if isinstance(value, torch.Tensor):
        return [expression(size) for size in value.shape]
    return None


def _product(sizes: Iterable[Any]) -> Any:
    result = sympy.Integer(1)
    for size in sizes:
        result = result * size
    return result


def _divides(small: Any, large: Any) -> bool:
    """True when ``large / small`` is a polynomial (no denominator left)."""
    if small == 0:
        return False
    _, denominator = sympy.fraction(sympy.cancel(large / small))
    return denominator == 1


def _equal(a: Any, b: Any) -> bool:
    return a == b or sympy.expand(a - b) == 0


def _contains_length(size: Any, length: Any) -> tuple[Any, Any] | None:
    """If ``size`` is ``k * length`` return (k, 1) else None."""
    if _equal(size, length):
        return sympy.Integer(1), sympy.Integer(1)
    if length.free_symbols and _divides(length, size):
        return sympy.cancel(size / length), sympy.Integer(1)
    return None


def map_through_view(in_shape: list[Any], out_shape: list[Any], seq: SequenceDim, length: Any) -> SequenceDim | str:
    """Where a sequence dimension lands after a reshape, or why it cannot be followed."""
    i = j = 0
    while i < len(in_shape) and j < len(out_shape):
        group_in, group_out = [i], [j]
        product_in, product_out = in_shape[i], out_shape[j]
        while not _equal(product_in, product_out):
            if _divides(product_in, product_out) and i + 1 < len(in_shape) and not _equal(product_in, 0):
                i += 1
                group_in.append(i)
                product_in = product_in * in_shape[i]
            elif j + 1 < len(out_shape):
                j += 1
                group_out.append(j)
                product_out = product_out * out_shape[j]
            else:
                return "a reshape whose dimensions cannot be matched symbolically"
        # Trailing size-1 dims join the current group lazily; skip them on both sides.
        if seq.dim in group_in:
            before = _product(in_shape[d] for d in group_in if d < seq.dim)
            after = _product(in_shape[d] for d in group_in if d > seq.dim)
            outer, inner = before * seq.outer, seq.inner * after
            # Find the output dimension of this group that holds the sequence factor.
            prefix = sympy.Integer(1)
            for index, out_dim in enumerate(group_out):
                size = out_shape[out_dim]
                if _divides(prefix, outer):
                    remaining_outer = sympy.cancel(outer / prefix)
                    if _divides(remaining_outer * length, size):
                        local_inner = sympy.cancel(size / (remaining_outer * length))
                        suffix = _product(out_shape[d] for d in group_out[index + 1 :])
                        if _equal(local_inner * suffix, inner):
                            return SequenceDim(out_dim, sympy.expand(remaining_outer), sympy.expand(local_inner))
                prefix = prefix * size
            return "a reshape that splits the sequence dimension (e.g. an unpatchify)"
        i += 1
        j += 1
    return "a reshape whose dimensions cannot be matched symbolically"


# --- op rules -------------------------------------------------------------------------------

@dataclass
class RuleResult:
    role: str
    dims: tuple[SequenceDim, ...] = ()
    aligned: tuple[fx.Node, ...] = ()
    reason: str = ""
    rewrite: str | None = None
    element_dims: tuple[tuple[SequenceDim, ...], ...] | None = None
    token_order: Any = INHERIT


Rule = Callable[[fx.Node, "SequenceAnalysis"], RuleResult]
RULES: dict[Any, Rule] = {}

POINTWISE_EXTRA = {
    aten.clone.default, aten.contiguous.default, aten._to_copy.default, aten.to.dtype,
    aten.to.dtype_layout, aten.to.device, aten.to.other, aten.detach.default, aten.alias.default,
    aten.lift_fresh_copy.default, aten.dropout.default, aten.where.self, aten.where.ScalarOther,
    aten.where.ScalarSelf, aten.masked_fill.Scalar, aten.masked_fill.Tensor,
    aten.zeros_like.default, aten.ones_like.default, aten.empty_like.default, aten.full_like.default,
    aten.rand_like.default, aten.randn_like.default, aten.copy.default, aten.copy_.default,
    aten.native_dropout.default, aten.feature_dropout.default, aten.alpha_dropout.default,
}
VIEWS = {
    aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.flatten.using_ints,
    aten.unflatten.int, aten.unsqueeze.default, aten.squeeze.dim, aten.squeeze.dims,
    aten.squeeze.default, aten.view_as.default, aten.reshape_as.default,
}
SCANS = {aten.softmax.int, aten._softmax.default, aten.log_softmax.int, aten._log_softmax.default,
         aten.cumsum.default, aten.cumprod.default, aten.logcumsumexp.default}
REDUCTIONS = {aten.sum.dim_IntList, aten.mean.dim, aten.amax.default, aten.amin.default,
              aten.var.correction, aten.std.correction, aten.logsumexp.default, aten.any.dim,
              aten.all.dim, aten.norm.ScalarOpt_dim, aten.var.dim, aten.std.dim, aten.any.dims,
              aten.all.dims, aten.max.dim, aten.min.dim, aten.argmax.default, aten.argmin.default}
FULL_REDUCTIONS = {aten.sum.default, aten.mean.default, aten.amax.default}
LOSSES = {aten.cross_entropy_loss.default, aten.nll_loss.default, aten.nll_loss_nd.default,
          aten.nll_loss2d.default}


def rule(*targets: Any) -> Callable[[Rule], Rule]:
    def register(function: Rule) -> Rule:
        for target in targets:
            RULES[target] = function
        return function

    return register


def _val(node: Any) -> Any:
    return node.meta.get("val") if isinstance(node, fx.Node) else None


def _tensor_inputs(node: fx.Node) -> list[fx.Node]:
    return [n for n in node.all_input_nodes if isinstance(_val(n), torch.Tensor)]


def _seq_inputs(node: fx.Node, analysis: SequenceAnalysis) -> list[fx.Node]:
    return [n for n in node.all_input_nodes if analysis.dims_of(n)]


def _single(dims: tuple[SequenceDim, ...]) -> SequenceDim | None:
    return dims[0] if len(dims) == 1 else None


def _mixing(reason: str, node: fx.Node, analysis: SequenceAnalysis, rewrite: str | None = None,
            aligned: tuple[fx.Node, ...] = ()) -> RuleResult:
    return RuleResult(MIXING, (), aligned, reason, rewrite)


def _normalize(dim: int, rank: int) -> int:
    return dim % rank if rank else 0


@rule(SDPA)
def _attention_rule(node: fx.Node, analysis: SequenceAnalysis) -> RuleResult:
    if not _seq_inputs(node, analysis):
        return RuleResult(NONE)  # over another sequence (an audio stream, text): it mixes no token of ours
    query, key, value = node.args[:3]
    rank = _val(query).dim()
    seq = _single(analysis.dims_of(query))
    if seq is not None and seq.dim < rank - 2:
        return _rank_local_attention(node, analysis, seq)
    if not analysis.dims_of(query):
        replicated = _replicated_query_attention(node, analysis)
        if replicated is not None:
            return replicated
    if seq is None or seq.dim != rank - 2 or not seq.unflattened:
        return _mixing("attention whose queries are not sequence-indexed on dim -2", node, analysis)
    aligned = [query]
    kv_layouts = set()
    for other in (key, value):
        other_seq = _single(analysis.dims_of(other))
        if other_seq is not None and other_seq.dim == rank - 2 and other_seq.unflattened:
            kv_layouts.add(other_seq)
            aligned.append(other)
        elif seq.joint:
            return _mixing("joint attention over keys/values that are not the same joint sequence", node, analysis)
    # Queries and keys/values share one layout, or image queries attend over joint keys/values
    # (text keys prepended, PRX): the segments are the keys'.
    if len(kv_layouts) > 1 or (seq.joint and kv_layouts != {seq}):
        return _mixing("joint attention whose queries and keys/values are segmented differently", node, analysis)
    return RuleResult(ATTENTION, (seq,), tuple(aligned))


def _replicated_query_attention(node: fx.Node, analysis: SequenceAnalysis) -> RuleResult | None:
    """Queries of another, replicated stream (LTX-2's audio tokens) attending over the sharded
    tokens: the keys and values go to the rank's heads through the usual all-to-all, the
    queries are cut to the same heads locally, and the output, whole over its own (short)
    sequence, is gathered over heads. The alternative, gathering the keys and values, moves
    ``sp_size`` times the bytes of the all-to-all."""
    query, key, value = node.args[:3]
    seq = _shared_sequence_dim(key, value, analysis)
    if seq is None or seq.dim != _val(query).dim() - 2 or not seq.plain or bool(sdpa_argument(node, "is_causal")):
        return None
    return _mixing("attention from replicated queries over the sharded keys/values", node, analysis,
                   rewrite="replicated_query_attention", aligned=(key, value))


def _shared_sequence_dim(key: fx.Node, value: fx.Node, analysis: SequenceAnalysis) -> SequenceDim | None:
    """The one sequence dimension keys and values share, if they do."""
    dims = {_single(analysis.dims_of(other)) for other in (key, value)}
    return dims.pop() if len(dims) == 1 else None


def _rank_local_attention(node: fx.Node, analysis: SequenceAnalysis, seq: SequenceDim) -> RuleResult:
    """Attention whose batch (or head) dimension holds the sharded tokens: temporal attention over
    the frames of each spatial position when a video model's spatial tokens are sharded. Every
    rank attends over its own positions' frames: it runs on the chunk with no collective at all."""
    query, key, value = node.args[:3]
    for other in (key, value):
        if _single(analysis.dims_of(other)) != seq:
            return _mixing("attention over a batch dimension that holds the sequence, with keys or values "
                           "laid out otherwise", node, analysis)
    aligned = [query, key, value]
    mask = node.args[3] if len(node.args) > 3 else node.kwargs.get("attn_mask")
    if isinstance(mask, fx.Node):
        if analysis.dims_of(mask):
            if _single(analysis.dims_of(mask)) != seq.moved(seq.dim + _val(mask).dim() - _val(query).dim()):
                return _mixing("attention whose mask is sequence-indexed differently", node, analysis)
            aligned.append(mask)
        else:
            position = seq.dim + _val(mask).dim() - _val(query).dim()
            if position >= 0 and not _equal(shape_of(_val(mask))[position], 1):
                return _mixing("attention whose mask spans the sharded tokens without saying so", node, analysis)
    return RuleResult(TOKEN_LOCAL, (seq,), tuple(aligned), reason="rank-local attention (over an unsharded dimension)")


def _region_rule(node: fx.Node, analysis: SequenceAnalysis) -> RuleResult:
    """The output of a hand-written attention region: attention over q, k, v like SDPA's."""
    site = analysis.regions[node]
    seq = _single(analysis.dims_of(site.query))
    if not analysis.dims_of(site.query):
        kv_seq = _shared_sequence_dim(site.key, site.value, analysis)
        if kv_seq is not None and kv_seq.dim == 2 and kv_seq.plain:
            # Replicated queries over the sharded keys/values (see _replicated_query_attention).
            return _mixing("attention from replicated queries over the sharded keys/values", node, analysis,
                           rewrite="replicated_query_region", aligned=(site.key, site.value))
    if seq is None or seq.dim != 2 or not seq.plain:
        return _mixing("attention whose queries are not sequence-indexed on dim -2", node, analysis)
    aligned = [site.query]
    for other in (site.key, site.value):
        other_seq = _single(analysis.dims_of(other))
        if other_seq is not None and other_seq.dim == 2 and other_seq.plain:
            aligned.append(other)
    return RuleResult(ATTENTION, (SequenceDim(2),), tuple(aligned))


def _pointwise(node: fx.Node, analysis: SequenceAnalysis) -> RuleResult:
    out = _val(node)
    out_value = out[0] if isinstance(out, (tuple, list)) else out
    out_rank = out_value.dim()
    mapped: dict[int, SequenceDim] = {}
    aligned = []
    for source in _seq_inputs(node, analysis):
        source_rank = _val(source).dim()
        for seq in analysis.dims_of(source):
            out_dim = seq.dim + out_rank - source_rank
            existing = mapped.get(out_dim)
            if existing is not None and existing != seq.moved(out_dim):
                return _mixing("combines sequence dimensions of different layouts", node, analysis)
            mapped[out_dim] = seq.moved(out_dim)
        aligned.append(source)
    if len(mapped) > 1:
        return _mixing("combines two sequence positions (an outer product)", node, analysis)
    dims = tuple(mapped.values())
    if len(dims) == 1:
        aligned += _broadcast_partners(node, analysis, dims[0], out_rank)
    elements = None
    if isinstance(out, (tuple, list)):
        elements = tuple(dims if isinstance(e, torch.Tensor) and e.dim() == out_rank else () for e in out)
    return RuleResult(TOKEN_LOCAL, dims, tuple(aligned), element_dims=elements)


def _broadcast_partners(node: fx.Node, analysis: SequenceAnalysis, seq: SequenceDim, out_rank: int) -> list[fx.Node]:
    """Operands with no sequence dimension of their own that still span the sequence.

    ``x + pos_embed`` where ``x`` is ``[B, (H//2)**2, D]`` and ``pos_embed`` a ``[1, 9, D]``
    buffer: broadcasting makes the sizes equal at run time although the expressions differ, so the
    buffer is sequence-indexed too and must be cut to the same chunk (a size of 1 broadcasts).
    The same holds for flattened tokens: a ``[B*L, 1, D]`` modulation built by
    ``repeat_interleave`` next to ``[B*L, F, D]`` activations is cut to the rows the rank holds,
    whatever its own expression, because an elementwise op pairs rows by index.
    """
    partners = []
    for source in _tensor_inputs(node):
        if analysis.dims_of(source):
            continue
        shape = shape_of(_val(source))
        position = seq.dim - (out_rank - len(shape))
        if position < 0 or _equal(shape[position], 1):
            continue
        role = analysis.roles.get(source)
        if role is not None and role.role not in (NONE, SOURCE):
            continue
        analysis.roles[source] = NodeRole(SOURCE, (seq.moved(position),),
                                          reason="spans the sequence by broadcasting")
        partners.append(source)
    return partners


def _view(node: fx.Node, analysis: SequenceAnalysis) -> RuleResult:
    source = node.args[0]
    seq = _single(analysis.dims_of(source))
    if seq is None:
        return _mixing("a reshape of a value with several sequence dimensions", node, analysis)
    if seq.joint:
        return _joint_view(node, analysis, source, seq)
    mapped = map_through_view(shape_of(_val(source)), shape_of(_val(node)), seq, analysis.length)
    if mapped == grid_regions.SPLITS_SEQUENCE and node not in analysis.refused_grids:
        region = grid_regions.find_grid_region(node, analysis)
        if isinstance(region, grid_regions.GridRegion):
            return grid_regions.register(region, analysis)
        analysis.refused_grids[node] = region
        log.info("dcp: %s gathers: no grid window: %s", node.name, region)
    if isinstance(mapped, str):
        return _mixing(mapped, node, analysis)
    return RuleResult(TOKEN_LOCAL, (mapped,), (source,))


def _joint_view(node: fx.Node, analysis: SequenceAnalysis, source: fx.Node, seq: SequenceDim) -> RuleResult:
    """A reshape keeps a joint dimension only when it leaves that dimension whole and in place
    relative to the rows before it (heads split or merged after it, size-1 dims added)."""
    in_shape, out_shape = shape_of(_val(source)), shape_of(_val(node))
    rows_before = _product(in_shape[: seq.dim])
    rows = sympy.Integer(1)
    for out_dim, size in enumerate(out_shape):
        if _equal(rows, rows_before) and _equal(size, in_shape[seq.dim]):
            return RuleResult(TOKEN_LOCAL, (seq.moved(out_dim),), (source,))
        rows = rows * size
    return _mixing("a reshape that folds a joint (text + image) sequence dimension", node, analysis)


def _permutation(node: fx.Node) -> list[int]:
    rank = _val(node.args[0]).dim()
    if node.target is aten.permute.default:
        return [_normalize(d, rank) for d in node.args[1]]
    if node.target is aten.t.default:
        return [1, 0] if rank == 2 else list(range(rank))
    if node.target is aten.mT.default:
        return list(range(rank - 2)) + [rank - 1, rank - 2]
    a, b = (_normalize(d, rank) for d in node.args[1:3])
    order = list(range(rank))
    order[a], order[b] = order[b], order[a]
    return order


@rule(aten.permute.default, aten.transpose.int, aten.t.default, aten.mT.default)
def _permute_rule(node: fx.Node, analysis: SequenceAnalysis) -> RuleResult:
    source = node.args[0]
    order = _permutation(node)
    dims = tuple(seq.moved(order.index(seq.dim)) for seq in analysis.dims_of(source))
    return RuleResult(TOKEN_LOCAL, dims, (source,))


@rule(aten.expand.default)
def _expand_rule(node: fx.Node, analysis: SequenceAnalysis) -> RuleResult:
    source = node.args[0]
    offset = _val(node).dim() - _val(source).dim()
    dims = tuple(seq.moved(seq.dim + offset) for seq in analysis.dims_of(source))
    return RuleResult(TOKEN_LOCAL, dims, (source,))


def _index_dim_rule(node: fx.Node, analysis: SequenceAnalysis, dim_position: int, removes_dim: bool,
                    identity_check: bool) -> RuleResult:
    source = node.args[0]
    rank = _val(source).dim()
    dim = _normalize(node.args[dim_position] if len(node.args) > dim_position else 0, rank)
    dims = []
    for seq in analysis.dims_of(source):
        if seq.dim == dim:
            if identity_check and _equal(shape_of(_val(node))[dim], shape_of(_val(source))[dim]):
                dims.append(seq)
                continue
            if seq.joint and node.target in (aten.slice.Tensor, aten.narrow.default):
                return _joint_segment_rule(node, analysis, source, seq)
            if node.target is aten.select.int and seq.plain and isinstance(node.args[2], int):
                return _mixing("selects one position of the sequence", node, analysis,
                               rewrite="select_position", aligned=(source,))
            return _mixing(f"{_op_name(node)} along the sequence dimension", node, analysis)
        dims.append(seq.moved(seq.dim - 1) if removes_dim and seq.dim > dim else seq)
    return RuleResult(TOKEN_LOCAL, tuple(dims), (source,) if dims else ())


def _size_argument(value: Any) -> Any:
    """An int or SymInt argument (a literal, or a node computing it) as a sympy expression."""
    if isinstance(value, fx.Node):
        value = _val(value)
    if isinstance(value, (int, torch.SymInt)):
        return expression(value)
    return None


def _slice_bound(value: Any, size: Any) -> Any:
    """A slice bound as an offset from the start: Python's ``x[:, :-text_len]`` counts from the
    end (a negative bound, known from its traced value), ``None``/huge ends mean the end."""
    if value is None or (isinstance(value, int) and value >= 2**62):
        return size
    expr = _size_argument(value)
    if expr is None:
        return None
    traced = _val(value) if isinstance(value, fx.Node) else value
    negative = traced < 0 if isinstance(traced, int) else (traced.node.hint is not None and traced.node.hint < 0)
    return sympy.expand(expr + size) if negative else expr


def _segment_bounds(seq: SequenceDim, length: Any) -> dict[str, tuple[Any, Any]]:
    return {"leading": (sympy.Integer(0), seq.before), "sharded": (seq.before, seq.before + length),
            "trailing": (seq.before + length, seq.before + length + seq.after)}


def _joint_segment_rule(node: fx.Node, analysis: SequenceAnalysis, source: fx.Node, seq: SequenceDim) -> RuleResult:
    """Taking one segment back out of a joint sequence (``x[:, :text_len]`` after joint
    attention): the sharded segment is this rank's chunk, a replicated one is whole on every
    rank. Anything else (a slice across a boundary) reads positions other ranks hold."""
    size = seq.before + analysis.length + seq.after
    if node.target is aten.narrow.default:
        start = _slice_bound(node.args[2], size)
        end = None if start is None or _size_argument(node.args[3]) is None else start + _size_argument(node.args[3])
    else:
        start = _slice_bound(node.args[2], size) if len(node.args) > 2 and node.args[2] is not None else sympy.Integer(0)
        step = node.args[4] if len(node.args) > 4 else 1
        if step != 1:
            return _mixing("a strided slice of a joint sequence dimension", node, analysis)
        end = _slice_bound(node.args[3] if len(node.args) > 3 else None, size)
    if start is None or end is None:
        return _mixing("a slice of a joint sequence dimension with unknown bounds", node, analysis)
    for segment, (low, high) in _segment_bounds(seq, analysis.length).items():
        if _equal(start, low) and _equal(end, high):
            if segment == "sharded":
                return RuleResult(MIXING, (SequenceDim(seq.dim),), (source,), "the sharded segment of a joint sequence",
                                  rewrite="take_sharded_segment")
            return RuleResult(MIXING, (), (source,), f"the replicated {segment} segment of a joint sequence",
                              rewrite=f"take_{segment}_segment")
    return _mixing("a slice across the segments of a joint sequence dimension", node, analysis)


@rule(aten.slice.Tensor, aten.narrow.default)
def _slice_rule(node, analysis):
    return _index_dim_rule(node, analysis, 1, False, True)


@rule(aten.select.int)
def _select_rule(node, analysis):
    return _index_dim_rule(node, analysis, 1, True, False)


@rule(aten.split.Tensor, aten.split_with_sizes.default, aten.chunk.default, aten.unbind.int,
      aten.tensor_split.sections, aten.split.sizes)
def _split_rule(node: fx.Node, analysis: SequenceAnalysis) -> RuleResult:
    source = node.args[0]
    rank = _val(source).dim()
    dim_position = 1 if node.target is aten.unbind.int else 2
    dim = _normalize(node.args[dim_position] if len(node.args) > dim_position else node.kwargs.get("dim", 0), rank)
    dims = []
    for seq in analysis.dims_of(source):
        if seq.dim == dim:
            if seq.joint and node.target in (aten.split_with_sizes.default, aten.split.sizes):
                return _joint_split_rule(node, analysis, source, seq)
            return _mixing("splits along the sequence dimension", node, analysis)
        dims.append(seq.moved(seq.dim - 1) if node.target is aten.unbind.int and seq.dim > dim else seq)
    dims_tuple = tuple(dims)
    elements = tuple(dims_tuple for _ in _val(node))
    return RuleResult(TOKEN_LOCAL, dims_tuple, (source,), element_dims=elements)


@rule(operator.getitem)
def _getitem_rule(node: fx.Node, analysis: SequenceAnalysis) -> RuleResult:
    source, index = node.args
    if not isinstance(source, fx.Node) or not isinstance(index, int):
        return RuleResult(NONE)
    dims = analysis.dims_of(source, index)
    if (source, index) in analysis.positions:
        analysis.positions[node] = analysis.positions[(source, index)]
    return RuleResult(TOKEN_LOCAL if dims else NONE, dims, (source,) if dims else ())


def _joint_split_rule(node: fx.Node, analysis: SequenceAnalysis, source: fx.Node, seq: SequenceDim) -> RuleResult:
    """``joint.split_with_sizes([text_len, image_len])``: each piece is one whole segment."""
    sizes = [_size_argument(size) for size in node.args[1]]
    if any(size is None for size in sizes):
        return _mixing("a split of a joint sequence dimension with unknown sizes", node, analysis)
    bounds = _segment_bounds(seq, analysis.length)
    wanted = [(low, high) for low, high in bounds.values() if not _equal(high - low, 0)]
    start, pieces = sympy.Integer(0), []
    for size in sizes:
        pieces.append((start, start + size))
        start = start + size
    if len(pieces) != len(wanted) or not all(_equal(a, c) and _equal(b, d) for (a, b), (c, d) in zip(pieces, wanted)):
        return _mixing("a split across the segments of a joint sequence dimension", node, analysis)
    sharded = bounds["sharded"]
    elements = tuple((SequenceDim(seq.dim),) if _equal(low, sharded[0]) and _equal(high, sharded[1]) else ()
                     for low, high in pieces)
    return RuleResult(MIXING, (), (source,), "splits a joint sequence into its segments",
                      rewrite="split_segments", element_dims=elements)


@rule(aten.cat.default, aten.stack.default)
def _cat_rule(node: fx.Node, analysis: SequenceAnalysis) -> RuleResult:
    tensors = [t for t in node.args[0] if isinstance(t, fx.Node)]
    out_rank = _val(node).dim()
    raw_dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)
    dim = _normalize(raw_dim, out_rank)
    if node.target is aten.cat.default:
        # An empty operand (a KV cache before its first update: [B, H, 0, D], or the legacy 1-D
        # ``tensor([])``) adds nothing: the cat is the identity on what remains. An operand empty
        # along the cat dimension but indexed by the sequence elsewhere (a rotary split's
        # ``x[..., rot_dim:]`` when the rotation covers the whole head) stays: it is chunked
        # along with the others, or the cat would mix a chunk with a full-length operand.
        tensors = [t for t in tensors
                   if not _is_empty(t, dim) or any(seq.dim != dim for seq in analysis.dims_of(t))]
        if len(tensors) == 1 and analysis.dims_of(tensors[0]):
            return RuleResult(TOKEN_LOCAL, analysis.dims_of(tensors[0]), (tensors[0],),
                              reason="concatenation with an empty tensor")
    seq_inputs = [t for t in tensors if analysis.dims_of(t)]
    if not seq_inputs:
        return _sized_source(node, analysis)
    if node.target is aten.cat.default and len(seq_inputs) == 1:
        joint = _joint_concatenation(node, analysis, tensors, seq_inputs[0], dim)
        if joint is not None:
            return joint
    mapped = set()
    for tensor in seq_inputs:
        for seq in analysis.dims_of(tensor):
            out_dim = seq.dim + (1 if node.target is aten.stack.default and seq.dim >= dim else 0)
            if node.target is aten.cat.default and seq.dim == dim:
                return _mixing("concatenates along the sequence dimension", node, analysis)
            mapped.add(seq.moved(out_dim))
    if len(mapped) != 1 or len(seq_inputs) != len(tensors):
        return _mixing("concatenates values that are not all sequence-indexed alike", node, analysis)
    return RuleResult(TOKEN_LOCAL, tuple(mapped), tuple(tensors))


def _joint_concatenation(node: fx.Node, analysis: SequenceAnalysis, tensors: list[fx.Node], sharded: fx.Node,
                         dim: int) -> RuleResult | None:
    """Text tokens concatenated with the image tokens along the sequence (joint attention): the
    image chunk stays sharded, the text is replicated around it, no gather."""
    seq = _single(analysis.dims_of(sharded))
    if seq is None or seq.dim != dim or not seq.unflattened:
        return None
    position = tensors.index(sharded)
    before = sum((shape_of(_val(t))[dim] for t in tensors[:position]), sympy.Integer(0))
    after = sum((shape_of(_val(t))[dim] for t in tensors[position + 1:]), sympy.Integer(0))
    joint = replace(seq, before=sympy.expand(seq.before + before), after=sympy.expand(seq.after + after))
    return RuleResult(TOKEN_LOCAL, (joint,), (sharded,), reason="joint sequence: replicated segments around the chunk")


def _is_empty(node: fx.Node, dim: int) -> bool:
    value = _val(node)
    if not isinstance(value, torch.Tensor):
        return False
    if value.dim() == 1 and _equal(expression(value.shape[0]), 0):
        return True
    return value.dim() > dim and _equal(expression(value.shape[dim]), 0)


@rule(aten.type_as.default)
def _type_as_rule(node: fx.Node, analysis: SequenceAnalysis) -> RuleResult:
    """``a.type_as(b)`` reads only ``b``'s dtype: it keeps ``a``'s layout, whatever ``b``'s shape."""
    source, other = node.args[:2]
    dims = analysis.dims_of(source)
    aligned = (source, other) if dims and analysis.dims_of(other) else (source,)
    return RuleResult(TOKEN_LOCAL if dims else NONE, dims, aligned if dims else ())


@rule(aten.embedding.default)
def _embedding_rule(node: fx.Node, analysis: SequenceAnalysis) -> RuleResult:
    indices = node.args[1]
    return RuleResult(TOKEN_LOCAL, analysis.dims_of(indices), (indices,) if analysis.dims_of(indices) else ())


def _leading_dims_rule(node: fx.Node, analysis: SequenceAnalysis, first: fx.Node, trailing: int,
                       others: Iterable[Any] = ()) -> RuleResult:
    """The op works on the last ``trailing`` dims of ``first``; the sequence must be before them."""
    for other in others:
        if isinstance(other, fx.Node) and analysis.dims_of(other):
            return _mixing(f"{_op_name(node)} contracts a sequence-indexed operand", node, analysis)
    rank = _val(first).dim()
    out = _val(node)
    out_rank = (out[0] if isinstance(out, (tuple, list)) else out).dim()
    dims = []
    for seq in analysis.dims_of(first):
        if seq.dim >= rank - trailing:
            return _mixing(f"{_op_name(node)} over the sequence dimension", node, analysis)
        dims.append(seq.moved(seq.dim + out_rank - rank))
    elements = None
    if isinstance(out, (tuple, list)):
        elements = tuple(tuple(dims) if isinstance(e, torch.Tensor) and e.dim() == out_rank else () for e in out)
    return RuleResult(TOKEN_LOCAL, tuple(dims), (first,), element_dims=elements)


@rule(aten.linear.default)
def _linear_rule(node, analysis):
    return _leading_dims_rule(node, analysis, node.args[0], 1, node.args[1:])


@rule(aten.matmul.default, aten.mm.default, aten.bmm.default)
def _matmul_rule(node, analysis):
    first, second = node.args[:2]
    if _val(first).dim() == 1:
        return _mixing("a vector-matrix product over the sequence", node, analysis)
    first_seq, second_seq = _single(analysis.dims_of(first)), _single(analysis.dims_of(second))
    first_rank, second_rank, out_rank = _val(first).dim(), _val(second).dim(), _val(node).dim()
    if (first_seq is not None and second_seq is not None and first_seq.plain and second_seq.plain
            and first_seq.dim == first_rank - 1 and second_seq.dim == second_rank - 2):
        # ``k^T @ v`` of linear attention: a sum over the sequence, done locally plus one all-reduce.
        return _mixing("a matrix product that sums over the sequence", node, analysis,
                       rewrite="contract_over_sequence", aligned=(first, second))
    if (first_seq is not None and second_seq is not None and first_seq.dim < first_rank - 2
            and second_seq.dim < second_rank - 2 and first_seq.dim - first_rank == second_seq.dim - second_rank
            and first_seq == second_seq.moved(first_seq.dim)):
        # Both operands batched over the same tokens (``bmm(row, expert_weight[token])``): one
        # small product per token.
        return RuleResult(TOKEN_LOCAL, (first_seq.moved(first_seq.dim + out_rank - first_rank),), (first, second))
    if first_seq is None and not analysis.dims_of(first) and second_seq is not None and second_seq.dim == second_rank - 1:
        # ``kv @ q^T`` with the tokens as columns: each output column is one token's.
        return RuleResult(TOKEN_LOCAL, (second_seq.moved(out_rank - 1),), (second,))
    return _leading_dims_rule(node, analysis, first, 1, (second,))


@rule(aten.addmm.default)
def _addmm_rule(node, analysis):
    bias, first, second = node.args[:3]
    return _leading_dims_rule(node, analysis, first, 1, (second, bias))


@rule(aten.layer_norm.default, aten.rms_norm.default, aten.native_layer_norm.default)
def _norm_rule(node, analysis):
    normalized = node.args[1]
    return _leading_dims_rule(node, analysis, node.args[0], len(normalized), node.args[2:])


@rule(*SCANS)
def _scan_rule(node: fx.Node, analysis: SequenceAnalysis) -> RuleResult:
    source = node.args[0]
    dim = _normalize(node.args[1], _val(source).dim())
    if any(seq.dim == dim for seq in analysis.dims_of(source)):
        return _mixing(f"{_op_name(node)} along the sequence dimension", node, analysis)
    return RuleResult(TOKEN_LOCAL, analysis.dims_of(source), (source,))


@rule(aten.topk.default, aten.sort.default, aten.sort.stable, aten.argsort.default, aten.argsort.stable,
      aten.kthvalue.default)
def _select_along_rule(node: fx.Node, analysis: SequenceAnalysis) -> RuleResult:
    """Sorting or picking the top-k along a feature dimension (a router over experts) keeps tokens apart."""
    source = node.args[0]
    rank = _val(source).dim()
    if node.target is aten.topk.default:
        dim = node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", -1)
    elif node.target is aten.kthvalue.default:
        dim = node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", -1)
    else:
        dim = node.kwargs.get("dim", -1)
        if len(node.args) > 1 and isinstance(node.args[1], int) and not isinstance(node.args[1], bool):
            dim = node.args[1]
    dim = _normalize(dim, rank)
    dims = analysis.dims_of(source)
    if any(seq.dim == dim for seq in dims):
        from dcp_compile.compiler.passes.token_permutations import sort_token_set

        return sort_token_set(node, analysis, source, dim) or _mixing(
            f"{_op_name(node)} along the sequence dimension", node, analysis)
    out = _val(node)
    elements = tuple(dims for _ in out) if isinstance(out, (tuple, list)) else None
    return RuleResult(TOKEN_LOCAL, dims, (source,), element_dims=elements)


@rule(aten.one_hot.default)
def _one_hot_rule(node: fx.Node, analysis: SequenceAnalysis) -> RuleResult:
    source = node.args[0]
    return RuleResult(TOKEN_LOCAL, analysis.dims_of(source), (source,))


@rule(*REDUCTIONS)
def _reduction_rule(node: fx.Node, analysis: SequenceAnalysis) -> RuleResult:
    source = node.args[0]
    rank = _val(source).dim()
    raw = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
    if raw is None or (isinstance(raw, (list, tuple)) and len(raw) == 0):
        reduced = set(range(rank))
    elif isinstance(raw, int):
        reduced = {_normalize(raw, rank)}
    else:
        reduced = {_normalize(d, rank) for d in raw}
    keepdim = bool(node.args[2]) if len(node.args) > 2 and isinstance(node.args[2], bool) else bool(node.kwargs.get("keepdim", False))
    dims = []
    for seq in analysis.dims_of(source):
        if seq.dim in reduced:
            rewrite = "sum_over_sequence" if node.target in (aten.sum.dim_IntList, aten.mean.dim) and seq.plain else None
            return _mixing(f"{_op_name(node)} over the sequence dimension", node, analysis, rewrite=rewrite,
                           aligned=(source,) if rewrite else ())
        shift = 0 if keepdim else sum(1 for d in reduced if d < seq.dim)
        dims.append(seq.moved(seq.dim - shift))
    out = _val(node)
    elements = None
    if isinstance(out, (tuple, list)):
        elements = tuple(tuple(dims) for _ in out)
    return RuleResult(TOKEN_LOCAL, tuple(dims), (source,), element_dims=elements)


@rule(*FULL_REDUCTIONS)
def _full_reduction_rule(node: fx.Node, analysis: SequenceAnalysis) -> RuleResult:
    if node.target is aten.amax.default:
        return _reduction_rule(node, analysis)
    source = node.args[0]
    seq = _single(analysis.dims_of(source))
    rewrite = "sum_over_sequence" if seq is not None and seq.plain else None
    return _mixing(f"{_op_name(node)} over every dimension", node, analysis, rewrite=rewrite,
                   aligned=(source,) if rewrite else ())


@rule(*LOSSES)
def _loss_rule(node: fx.Node, analysis: SequenceAnalysis) -> RuleResult:
    logits, target = node.args[:2]
    reduction = node.args[3] if len(node.args) > 3 else node.kwargs.get("reduction", 1)
    logits_seq, target_seq = _single(analysis.dims_of(logits)), _single(analysis.dims_of(target))
    if logits_seq is None or target_seq is None:
        return _mixing("a loss whose inputs are not both sequence-indexed", node, analysis)
    if logits_seq.joint or target_seq.joint:
        return _mixing("a loss over a joint (replicated + sharded) sequence", node, analysis)
    logits_rank = _val(logits).dim()
    expected_target_dim = logits_seq.dim if logits_seq.dim == 0 else logits_seq.dim - 1
    if logits_seq.dim == 1 and logits_rank > 1 or target_seq.dim != expected_target_dim:
        return _mixing("a loss over the class dimension of the sequence", node, analysis)
    if reduction == 0:
        return RuleResult(TOKEN_LOCAL, (target_seq,), (logits, target))
    return _mixing("a loss reduced over the sequence", node, analysis, rewrite="loss_over_sequence",
                   aligned=(logits, target))


@rule(aten.repeat_interleave.self_int, aten.repeat_interleave.self_Tensor)
def _repeat_interleave_rule(node: fx.Node, analysis: SequenceAnalysis) -> RuleResult:
    source = node.args[0]
    dim = node.args[2] if len(node.args) > 2 else node.kwargs.get("dim")
    if dim is None:
        return _mixing("repeat_interleave of a flattened sequence", node, analysis)
    dim = _normalize(dim, _val(source).dim())
    if any(seq.dim == dim for seq in analysis.dims_of(source)):
        return _mixing("repeat_interleave along the sequence dimension", node, analysis)
    return RuleResult(TOKEN_LOCAL, analysis.dims_of(source), (source,))


@rule(aten.view_as_complex.default, aten.view_as_real.default)
def _complex_view_rule(node: fx.Node, analysis: SequenceAnalysis) -> RuleResult:
    """Complex RoPE (``view_as_complex(x.reshape(..., -1, 2)) * freqs``): the pair of reals that
    becomes one complex number is the last dimension, never the sequence."""
    source = node.args[0]
    rank = _val(source).dim()
    dims = analysis.dims_of(source)
    if node.target is aten.view_as_complex.default and any(seq.dim == rank - 1 for seq in dims):
        return _mixing("view_as_complex over the sequence dimension", node, analysis)
    return RuleResult(TOKEN_LOCAL, dims, (source,))


@rule(aten.repeat.default)
def _repeat_rule(node: fx.Node, analysis: SequenceAnalysis) -> RuleResult:
    """``x.repeat(1, 2)`` tiles features; it keeps tokens apart unless it tiles the sequence."""
    source, repeats = node.args[:2]
    offset = len(repeats) - _val(source).dim()  # repeat may add leading dimensions
    dims = []
    for seq in analysis.dims_of(source):
        count = repeats[seq.dim + offset]
        if not (isinstance(count, int) and count == 1):
            return _mixing("repeat along the sequence dimension", node, analysis)
        dims.append(seq.moved(seq.dim + offset))
    return RuleResult(TOKEN_LOCAL, tuple(dims), (source,))


@rule(aten.pad.default, aten.constant_pad_nd.default)
def _pad_rule(node: fx.Node, analysis: SequenceAnalysis) -> RuleResult:
    source = node.args[0]
    rank = _val(source).dim()
    padding = list(node.args[1])
    padded = {rank - 1 - i // 2 for i, amount in enumerate(padding) if not (isinstance(amount, int) and amount == 0)}
    dims = []
    for seq in analysis.dims_of(source):
        if seq.dim not in padded:
            dims.append(seq)
            continue
        extended = _padded_segments(node, seq, padding, rank)
        if extended is None:
            return _mixing("pads the sequence dimension", node, analysis)
        dims.append(extended)
    return RuleResult(TOKEN_LOCAL, tuple(dims), (source,))


def _padded_segments(node: fx.Node, seq: SequenceDim, padding: list[Any], rank: int) -> SequenceDim | None:
    """Constant padding of the sequence dimension joins the replicated segments around the
    chunk: Mochi pads each sample's ``[video | its valid text]`` attention output with zeros to
    ``video + all text``. Every rank holds ``[before | chunk | after]``, so padding its own value
    on either end pads those segments, as it pads the full value. A negative constant amount
    (a crop, which could cut into the chunk) is refused; a symbolic amount is taken as the model
    computed it, a padding (``F.pad`` with a negative size would crop the full value too)."""
    mode = node.args[2] if len(node.args) > 2 else node.kwargs.get("mode", "constant")
    if not seq.unflattened or mode != "constant":
        return None
    index = 2 * (rank - 1 - seq.dim)
    amounts = [_size_value(amount) for amount in padding[index:index + 2]]
    if len(amounts) != 2 or not all(isinstance(amount, (int, torch.SymInt)) for amount in amounts):
        return None
    left, right = (expression(amount) for amount in amounts)
    if any(amount.is_number and amount < 0 for amount in (left, right)):
        return None
    return replace(seq, before=sympy.expand(seq.before + left), after=sympy.expand(seq.after + right))


def _size_value(amount: Any) -> Any:
    """A padding amount as given: an int, or the SymInt a size node computed."""
    return _val(amount) if isinstance(amount, fx.Node) else amount


@rule(aten.outer.default, aten.ger.default)
def _outer_rule(node: fx.Node, analysis: SequenceAnalysis) -> RuleResult:
    left, right = node.args[:2]
    if analysis.dims_of(right):
        return _mixing("an outer product with a sequence-indexed right operand", node, analysis)
    return RuleResult(TOKEN_LOCAL, analysis.dims_of(left), (left,))


@rule(custom_autograd_function._opoverload)
def _custom_autograd_function_rule(node: fx.Node, analysis: SequenceAnalysis) -> RuleResult:
    """A user's ``autograd.Function``: token-local when its forward and backward are elementwise."""
    function = function_of(node.args[0])
    if function.elementwise:
        return _pointwise(node, analysis)
    return _mixing(f"custom autograd.Function at {function.name} is not elementwise", node, analysis)


@rule(aten.sym_size.int)
def _sym_size_rule(node: fx.Node, analysis: SequenceAnalysis) -> RuleResult:
    return RuleResult(NONE)


def _op_name(node: fx.Node) -> str:
    return str(node.target).replace("aten.", "").replace(".default", "")


def _sized_source(node: fx.Node, analysis: SequenceAnalysis) -> RuleResult:
    """A value whose size at some dimension is the attention length, so indexed by tokens.

    Not a parameter: its sizes come from the model's configuration, never from the data, and a
    constant attention length may equal one of them (Z-Image pads its tokens to a multiple of 32
    and has a width of 32 in the zoo). A parameter that does span the tokens (a position table
    added to the activations) is found as a broadcast partner of the value it is added to."""
    value = _val(node)
    if not isinstance(value, torch.Tensor) or analysis.length is None or node in analysis.parameters:
        return RuleResult(NONE)
    dims = tuple(SequenceDim(d) for d, size in enumerate(shape_of(value)) if _equal(size, analysis.length))
    if not dims:
        return RuleResult(NONE)
    if analysis.token_dims is not None:
        # A constant length that another size may equal (a width of 32 at 32 tokens): a
        # computed value holds tokens where an attention reads them from; an input, unless
        # an attention reads its tokens from another of its dimensions.
        hinted = tuple(d for d in dims if d.dim in analysis.token_dims.get(node, ()))
        if node.op not in ("placeholder", "get_attr") or (node in analysis.token_dims and hinted):
            dims = hinted
        if not dims:
            return RuleResult(NONE)
    if len(dims) > 1:
        return RuleResult(MIXING, (), (), "creates a value with several sequence dimensions")
    return RuleResult(SOURCE, dims, (), "creates the sequence dimension")


def _classify(node: fx.Node, analysis: SequenceAnalysis) -> RuleResult:
    if node.op in ("placeholder", "get_attr"):
        return _sized_source(node, analysis)
    if node in analysis.grid_exits:
        return grid_regions.exit_rule(node, analysis)
    if node in analysis.grid_members:
        return grid_regions.member_rule(node, analysis)
    if node in analysis.regions:
        return _region_rule(node, analysis)
    if node in analysis.region_members:
        return RuleResult(ATTENTION, (), (), "inside a hand-written attention (runs on the rank's heads)")
    if node.op == "output":
        return RuleResult(NONE)
    has_seq_input = bool(_seq_inputs(node, analysis))
    target = node.target
    if has_seq_input and token_permutations.is_grouped_matmul(target):
        result = token_permutations.grouped_matmul_rule(node, analysis)
    elif target in RULES:
        result = RULES[target](node, analysis)
    elif target in VIEWS:
        result = _view(node, analysis) if has_seq_input else RuleResult(NONE)
    elif isinstance(target, torch._ops.OpOverload) and (
        torch.Tag.pointwise in target.tags or target in POINTWISE_EXTRA
    ):
        result = _pointwise(node, analysis) if has_seq_input else RuleResult(NONE)
    elif has_seq_input:
        result = _mixing(f"no sharding rule for {_op_name(node)}", node, analysis)
    else:
        result = RuleResult(NONE)
    if result.role == NONE or (result.role == TOKEN_LOCAL and not result.dims):
        if not has_seq_input or result.role == NONE:
            created = _sized_source(node, analysis)
            if created.role != NONE:
                return created
        if result.role == TOKEN_LOCAL and not result.dims:
            return RuleResult(NONE)
    elif result.role == TOKEN_LOCAL:
        # An op that keeps one sequence dimension but creates another (an expand of a mask, or a
        # bias over keys broadcast against a [B, 1, S, S] mask as Falcon's ALiBi is) mixes.
        value = _val(node)
        if isinstance(value, torch.Tensor) and analysis.length is not None:
            sized = {d for d, size in enumerate(shape_of(value)) if _equal(size, analysis.length)}
            if analysis.token_dims is not None:
                # A constant length: another size may equal it by coincidence (heads x head size
                # = 32 = the padded token count); only a dimension an attention reads its tokens
                # from counts as a second sequence dimension.
                sized &= analysis.token_dims.get(node, set())
            if sized - {d.dim for d in result.dims}:
                return RuleResult(MIXING, (), (), "creates a second sequence dimension")
    elif result.role == MIXING and not result.rewrite and not result.dims:
        # A sequence-mixing op runs on the full sequence, but its output (a cumsum of a mask, a
        # gathered unpatchify's neighbour) may still be indexed by it: record where, so that
        # token-local consumers take their chunk of it instead of broadcasting the full value.
        created = _sized_source(node, analysis)
        if created.role == SOURCE:
            result.dims = created.dims
    return result


def sequence_length_of(sites: list[AttentionSite]) -> Any:
    """The attention length expression shared by the self-attention sites (most common wins)."""
    # A single query (a pooling attention: one learned or mean token attending over the text) has
    # no sequence of its own to shard: length 1 would make every size-1 dimension a "sequence".
    sites = [site for site in sites if not _equal(expression(_val(site.query).shape[-2]), 1)]
    counts: dict[Any, int] = {}
    traced: dict[Any, int] = {}
    for site in sites:
        query, key = _val(site.query), _val(site.key)
        length = expression(query.shape[-2])
        if _equal(length, expression(key.shape[-2])):
            counts[length] = counts.get(length, 0) + 1
            traced[length] = _traced_size(query.shape[-2])
    if not counts:
        for site in sites:
            length = expression(_val(site.query).shape[-2])
            counts[length] = counts.get(length, 0) + 1
            traced[length] = _traced_size(_val(site.query).shape[-2])
    if not counts:
        return None
    # Most sites first; on a tie (a video model alternating spatial and temporal attention) the
    # longer length: sharding the spatial tokens leaves temporal attention rank-local, and a long
    # dimension splits evenly over more ranks. Two streams of one symbol each (LTX-2's video and
    # audio self-attentions) are told apart by the sizes they were traced at, not by graph order.
    return max(counts, key=lambda length: (counts[length], _size_hint(length), traced[length]))


def _size_hint(expr: Any) -> int:
    try:
        hints = {symbol: 64 for symbol in expr.free_symbols}  # any equal sizes: products beat factors
        return int(expr.xreplace(hints))
    except (TypeError, ValueError):
        return 0


def fx_to_networkx(graph: fx.Graph) -> nx.DiGraph:
    digraph = nx.DiGraph()
    for node in graph.nodes:
        digraph.add_node(node)
        for source in node.all_input_nodes:
            digraph.add_edge(source, node)
    return digraph


def long_segment_of(graph: fx.Graph, length: Any) -> Any:
    """The length to shard when attention runs over a concatenation of token streams.

    Joint attention (SD3, Flux, HunyuanVideo) attends over ``text + image`` tokens. Sharding the
    concatenation would gather at every split back into the two streams; sharding only the long
    stream keeps both streams' token-local work sharded (image) or replicated (text) and passes the
    text through the head all-to-all whole. The long stream is the operand of a concatenation
    that forms ``length`` whose size is largest (a product of symbols beats a single symbol,
    then the traced sizes decide). A single prepended token (a CLS token) is not a stream.
    """
    if length is None or not isinstance(length, sympy.Add):
        return length
    for node in graph.find_nodes(op="call_function", target=aten.cat.default):
        value = _val(node)
        if not isinstance(value, torch.Tensor):
            continue
        dim = _normalize(node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0), value.dim())
        if not _equal(expression(value.shape[dim]), length):
            continue
        parts = [_val(t).shape[dim] for t in node.args[0] if isinstance(t, fx.Node) and not _is_empty(t, dim)]
        if len(parts) < 2:
            continue
        longest = max(parts, key=lambda size: (_size_hint(expression(size)), _traced_size(size)))
        others = [size for size in parts if size is not longest]
        if not expression(longest).free_symbols or all(_equal(expression(size), 1) for size in others):
            continue
        return expression(longest)
    return length


def _traced_size(size: Any) -> int:
    if isinstance(size, torch.SymInt):
        hint = size.node.hint
        return int(hint) if hint is not None else 0
    return int(size)


def analyze_sequence_dims(gm: fx.GraphModule, sites: list[AttentionSite],
                          parameter_indices: frozenset[int] = frozenset()) -> SequenceAnalysis:
    length = long_segment_of(gm.graph, sequence_length_of(sites))
    placeholders = list(gm.graph.find_nodes(op="placeholder"))
    parameters = frozenset(placeholders[i] for i in parameter_indices if i < len(placeholders))
    graph = fx_to_networkx(gm.graph)
    refused: dict[fx.Node, str] = {}
    while True:
        # A grid region found to read a sequence-indexed value from outside only once the
        # propagation reaches that member is refused, and the analysis starts over without it.
        try:
            return _propagate(gm, sites, SequenceAnalysis(length=length, graph=graph, parameters=parameters,
                                                          refused_grids=dict(refused)))
        except grid_regions.GridRegionRefused as refusal:
            refused[refusal.entry] = refusal.reason
            log.info("dcp: %s gathers: no grid window: %s", refusal.entry.name, refusal.reason)


def _propagate(gm: fx.GraphModule, sites: list[AttentionSite], analysis: SequenceAnalysis) -> SequenceAnalysis:
    length = analysis.length
    if length is not None and not length.free_symbols:
        analysis.token_dims = token_dims_from_attention(sites, length)
    for site in sites:
        if site.region is not None:
            analysis.regions[site.node] = site
            analysis.region_members.update((member, site) for member in site.region.nodes[:-1])
    if length is None:
        return analysis
    for node in nx.topological_sort(analysis.graph):
        result = _token_set_inputs(node, analysis) or _classify(node, analysis)
        order = _token_order(result, analysis)
        if order is INHERIT:
            result = _mixing("combines token rows kept in different orders", node, analysis)
            order = None
        analysis.roles[node] = NodeRole(
            result.role, result.dims, result.element_dims, result.aligned, result.reason, result.rewrite, order
        )
    return analysis


def _token_set_inputs(node: fx.Node, analysis: SequenceAnalysis) -> RuleResult | None:
    """An op over token-set values alone (``cumsum`` of per-expert counts) stays a token-set value."""
    if node.op != "call_function":
        return None
    inputs = [n for n in node.all_input_nodes if n in analysis.roles]
    sets = [n for n in inputs if analysis.roles[n].role == TOKEN_SET]
    if not sets or any(analysis.dims_of(n) for n in inputs):
        return None
    return RuleResult(TOKEN_SET, (), tuple(sets), "computed from this rank's token set")


def _token_order(result: RuleResult, analysis: SequenceAnalysis) -> Any:
    """The order of the result's token rows: set by the permutation rules, else the one order its
    aligned inputs share (INHERIT when they disagree: combining two orders would pair wrong rows)."""
    if result.token_order is not INHERIT:
        return result.token_order
    if result.role not in (TOKEN_LOCAL, TOKEN_SET, ATTENTION) and not result.rewrite:
        return None
    orders = {analysis.roles[n].token_order for n in result.aligned if n in analysis.roles}
    if len(orders) > 1:
        return INHERIT
    return next(iter(orders), None)


def sequence_dims_pass(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    """Analysis only: classify every node; the graph is returned unchanged."""
    analysis = analyze_sequence_dims(gm, ctx.analysis.attention_sites, ctx.analysis.parameter_indices)
    ctx.analysis.sequence = analysis
    if analysis.length is not None:
        if not analysis.length.free_symbols:
            log.warning(
                "dcp: the attention length is the constant %s in this graph (compiled without "
                "dynamic=True?); sizes equal to it are taken for the sequence dimension",
                analysis.length,
            )
        counts: dict[str, int] = {}
        for role in analysis.roles.values():
            counts[role.role] = counts.get(role.role, 0) + 1
        log.info("dcp: sequence length %s; roles %s", analysis.length, counts)
    return gm


from dcp_compile.compiler.passes import grid_regions, token_permutations  # noqa: E402,F401  (registers its rules)
from dcp_compile.compiler.passes.sequence_hints import token_dims_from_attention  # noqa: E402  (uses VIEWS above)
