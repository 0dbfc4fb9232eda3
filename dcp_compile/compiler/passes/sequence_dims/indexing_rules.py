"""Indexing and joint segments: slices, selects, splits, concatenations, padding and lookups.

An index along another dimension keeps the tokens apart. Along the sequence, only the forms with
an exact chunked equivalent are kept: a joint sequence (text + image tokens) is taken apart into
its segments (the sharded one is this rank's chunk, a replicated one is whole on every rank), and
picking one position (a CLS token) is a rewrite; anything else reads positions other ranks hold.
"""

from __future__ import annotations

import operator
from dataclasses import replace
from enum import Enum
from typing import Any

import sympy
import torch
import torch.fx as fx

from dcp_compile.compiler.passes.sequence_dims.model import (
    NO_FINDINGS, AnalysisView, Findings, NodeRole, Rewrite, Role, SequenceDim,
)
from dcp_compile.compiler.passes.sequence_dims.registry import argument, mixing, op_name, rule, single, sized_source
from dcp_compile.compiler.passes.sequence_dims.symbolic import (
    equal, expression, is_empty, normalize, shape_of, value_of,
)

aten = torch.ops.aten

def index_dim_rule(node: fx.Node, analysis: AnalysisView, dim_position: int, removes_dim: bool,
                   identity_check: bool) -> NodeRole:
    source = node.args[0]
    rank = value_of(source).dim()
    dim = normalize(node.args[dim_position] if len(node.args) > dim_position else 0, rank)
    dims = []
    for seq in analysis.dims_of(source):
        if seq.dim == dim:
            if identity_check and equal(shape_of(value_of(node))[dim], shape_of(value_of(source))[dim]):
                dims.append(seq)
                continue
            if seq.joint and node.target in (aten.slice.Tensor, aten.narrow.default):
                return joint_segment_rule(node, analysis, source, seq)
            if node.target is aten.select.int and seq.plain and isinstance(node.args[2], int):
                return mixing("selects one position of the sequence",
                              rewrite=Rewrite.SELECT_POSITION, aligned=(source,))
            return mixing(f"{op_name(node)} along the sequence dimension")
        dims.append(seq.moved(seq.dim - 1) if removes_dim and seq.dim > dim else seq)
    return NodeRole(Role.TOKEN_LOCAL, tuple(dims), (source,) if dims else ())


def size_argument(value: Any) -> Any:
    """An int or SymInt argument (a literal, or a node computing it) as a sympy expression."""
    if isinstance(value, fx.Node):
        value = value_of(value)
    if isinstance(value, (int, torch.SymInt)):
        return expression(value)
    return None


def slice_bound(value: Any, size: Any) -> Any:
    """A slice bound as an offset from the start: Python's ``x[:, :-text_len]`` counts from the
    end (a negative bound, known from its traced value), ``None``/huge ends mean the end."""
    if value is None or (isinstance(value, int) and value >= 2**62):
        return size
    expr = size_argument(value)
    if expr is None:
        return None
    traced = value_of(value) if isinstance(value, fx.Node) else value
    negative = traced < 0 if isinstance(traced, int) else (traced.node.hint is not None and traced.node.hint < 0)
    return sympy.expand(expr + size) if negative else expr


class Segment(Enum):
    """The three stretches of a joint sequence dimension ``before + L + after``."""

    LEADING = "leading"
    SHARDED = "sharded"
    TRAILING = "trailing"


TAKE_SEGMENT = {Segment.LEADING: Rewrite.TAKE_LEADING_SEGMENT, Segment.SHARDED: Rewrite.TAKE_SHARDED_SEGMENT,
                Segment.TRAILING: Rewrite.TAKE_TRAILING_SEGMENT}


def segment_bounds(seq: SequenceDim, length: Any) -> dict[Segment, tuple[Any, Any]]:
    return {Segment.LEADING: (sympy.Integer(0), seq.before), Segment.SHARDED: (seq.before, seq.before + length),
            Segment.TRAILING: (seq.before + length, seq.before + length + seq.after)}


def joint_segment_rule(node: fx.Node, analysis: AnalysisView, source: fx.Node, seq: SequenceDim) -> NodeRole:
    """Taking one segment back out of a joint sequence (``x[:, :text_len]`` after joint
    attention): the sharded segment is this rank's chunk, a replicated one is whole on every
    rank. Anything else (a slice across a boundary) reads positions other ranks hold."""
    size = seq.before + analysis.length + seq.after
    if node.target is aten.narrow.default:
        start = slice_bound(node.args[2], size)
        end = None if start is None or size_argument(node.args[3]) is None else start + size_argument(node.args[3])
    else:
        start = slice_bound(node.args[2], size) if len(node.args) > 2 and node.args[2] is not None else sympy.Integer(0)
        step = node.args[4] if len(node.args) > 4 else 1
        if step != 1:
            return mixing("a strided slice of a joint sequence dimension")
        end = slice_bound(node.args[3] if len(node.args) > 3 else None, size)
    if start is None or end is None:
        return mixing("a slice of a joint sequence dimension with unknown bounds")
    for segment, (low, high) in segment_bounds(seq, analysis.length).items():
        if equal(start, low) and equal(end, high):
            if segment is Segment.SHARDED:
                return NodeRole(Role.MIXING, (SequenceDim(seq.dim),), (source,), "the sharded segment of a joint sequence",
                                rewrite=TAKE_SEGMENT[segment])
            return NodeRole(Role.MIXING, (), (source,), f"the replicated {segment.value} segment of a joint sequence",
                            rewrite=TAKE_SEGMENT[segment])
    return mixing("a slice across the segments of a joint sequence dimension")


@rule(aten.slice.Tensor, aten.narrow.default)
def slice_rule(node: fx.Node, analysis: AnalysisView) -> NodeRole:
    return index_dim_rule(node, analysis, 1, False, True)


@rule(aten.select.int)
def select_rule(node: fx.Node, analysis: AnalysisView) -> NodeRole:
    return index_dim_rule(node, analysis, 1, True, False)


@rule(aten.split.Tensor, aten.split_with_sizes.default, aten.chunk.default, aten.unbind.int,
      aten.tensor_split.sections, aten.split.sizes)
def split_rule(node: fx.Node, analysis: AnalysisView) -> NodeRole:
    source = node.args[0]
    rank = value_of(source).dim()
    dim_position = 1 if node.target is aten.unbind.int else 2
    dim = normalize(node.args[dim_position] if len(node.args) > dim_position else node.kwargs.get("dim", 0), rank)
    dims = []
    for seq in analysis.dims_of(source):
        if seq.dim == dim:
            if seq.joint and node.target in (aten.split_with_sizes.default, aten.split.sizes):
                return joint_split_rule(node, analysis, source, seq)
            return mixing("splits along the sequence dimension")
        dims.append(seq.moved(seq.dim - 1) if node.target is aten.unbind.int and seq.dim > dim else seq)
    dims_tuple = tuple(dims)
    elements = tuple(dims_tuple for _ in value_of(node))
    return NodeRole(Role.TOKEN_LOCAL, dims_tuple, (source,), element_dims=elements)


@rule(operator.getitem)
def getitem_rule(node: fx.Node, analysis: AnalysisView) -> NodeRole:
    source, index = node.args
    if not isinstance(source, fx.Node) or not isinstance(index, int):
        return NodeRole(Role.NONE)
    dims = analysis.dims_of(source, index)
    positions = analysis.positions.get((source, index))  # a sort's indices: the positions they hold
    found = Findings(positions=((None, positions),)) if positions is not None else NO_FINDINGS
    return NodeRole(Role.TOKEN_LOCAL if dims else Role.NONE, dims, (source,) if dims else (), findings=found)


def joint_split_rule(node: fx.Node, analysis: AnalysisView, source: fx.Node, seq: SequenceDim) -> NodeRole:
    """``joint.split_with_sizes([text_len, image_len])``: each piece is one whole segment."""
    sizes = [size_argument(size) for size in node.args[1]]
    if any(size is None for size in sizes):
        return mixing("a split of a joint sequence dimension with unknown sizes")
    bounds = segment_bounds(seq, analysis.length)
    wanted = [(low, high) for low, high in bounds.values() if not equal(high - low, 0)]
    start, pieces = sympy.Integer(0), []
    for size in sizes:
        pieces.append((start, start + size))
        start = start + size
    if len(pieces) != len(wanted) or not all(equal(a, c) and equal(b, d) for (a, b), (c, d) in zip(pieces, wanted)):
        return mixing("a split across the segments of a joint sequence dimension")
    sharded = bounds[Segment.SHARDED]
    elements = tuple((SequenceDim(seq.dim),) if equal(low, sharded[0]) and equal(high, sharded[1]) else ()
                     for low, high in pieces)
    return NodeRole(Role.MIXING, (), (source,), "splits a joint sequence into its segments",
                    rewrite=Rewrite.SPLIT_SEGMENTS, element_dims=elements)


@rule(aten.cat.default, aten.stack.default)
def cat_rule(node: fx.Node, analysis: AnalysisView) -> NodeRole:
    tensors = [t for t in node.args[0] if isinstance(t, fx.Node)]
    out_rank = value_of(node).dim()
    raw_dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)
    dim = normalize(raw_dim, out_rank)
    if node.target is aten.cat.default:
        # An empty operand (a KV cache before its first update: [B, H, 0, D], or the legacy 1-D
        # ``tensor([])``) adds nothing: the cat is the identity on what remains. An operand empty
        # along the cat dimension but indexed by the sequence elsewhere (a rotary split's
        # ``x[..., rot_dim:]`` when the rotation covers the whole head) stays: it is chunked
        # along with the others, or the cat would mix a chunk with a full-length operand.
        tensors = [t for t in tensors
                   if not is_empty(t, dim) or any(seq.dim != dim for seq in analysis.dims_of(t))]
        if len(tensors) == 1 and analysis.dims_of(tensors[0]):
            return NodeRole(Role.TOKEN_LOCAL, analysis.dims_of(tensors[0]), (tensors[0],),
                            reason="concatenation with an empty tensor")
    seq_inputs = [t for t in tensors if analysis.dims_of(t)]
    if not seq_inputs:
        return sized_source(node, analysis)
    if node.target is aten.cat.default and len(seq_inputs) == 1:
        joint = joint_concatenation(node, analysis, tensors, seq_inputs[0], dim)
        if joint is not None:
            return joint
    mapped = set()
    for tensor in seq_inputs:
        for seq in analysis.dims_of(tensor):
            out_dim = seq.dim + (1 if node.target is aten.stack.default and seq.dim >= dim else 0)
            if node.target is aten.cat.default and seq.dim == dim:
                return mixing("concatenates along the sequence dimension")
            mapped.add(seq.moved(out_dim))
    if len(mapped) != 1 or len(seq_inputs) != len(tensors):
        return mixing("concatenates values that are not all sequence-indexed alike")
    return NodeRole(Role.TOKEN_LOCAL, tuple(mapped), tuple(tensors))


def joint_concatenation(node: fx.Node, analysis: AnalysisView, tensors: list[fx.Node], sharded: fx.Node,
                        dim: int) -> NodeRole | None:
    """Text tokens concatenated with the image tokens along the sequence (joint attention): the
    image chunk stays sharded, the text is replicated around it, no gather."""
    seq = single(analysis.dims_of(sharded))
    if seq is None or seq.dim != dim or not seq.unflattened:
        return None
    position = tensors.index(sharded)
    before = sum((shape_of(value_of(t))[dim] for t in tensors[:position]), sympy.Integer(0))
    after = sum((shape_of(value_of(t))[dim] for t in tensors[position + 1:]), sympy.Integer(0))
    joint = replace(seq, before=sympy.expand(seq.before + before), after=sympy.expand(seq.after + after))
    return NodeRole(Role.TOKEN_LOCAL, (joint,), (sharded,), reason="joint sequence: replicated segments around the chunk")


TABLE_GATHERED = "an embedding lookup into a sequence-indexed table (rows picked by id, not by position): the table is gathered"


@rule(aten.embedding.default)
def embedding_rule(node: fx.Node, analysis: AnalysisView) -> NodeRole:
    """Rows of the table picked per token: token-local in the ids. A table indexed by the
    sequence itself (a position table looked up by arbitrary ids) is read whole on every rank."""
    table, indices = node.args[:2]
    dims = analysis.dims_of(indices)
    if analysis.dims_of(table):
        if not dims:
            return mixing(TABLE_GATHERED)
        return NodeRole(Role.TOKEN_LOCAL, dims, (indices,), TABLE_GATHERED)
    return NodeRole(Role.TOKEN_LOCAL, dims, (indices,) if dims else ())


@rule(aten.flip.default, aten.roll.default)
def reorder_rule(node: fx.Node, analysis: AnalysisView) -> NodeRole:
    """``flip`` and ``roll`` reorder positions along the dimensions they name: along others the
    tokens stay where they are. A ``roll`` with no dimension rolls the flattened value."""
    source = node.args[0]
    rank = value_of(source).dim()
    named = argument(node, "dims", [])
    if not named:
        return mixing(f"{op_name(node)} of the flattened value")
    dims = analysis.dims_of(source)
    if any(seq.dim in {normalize(d, rank) for d in named} for seq in dims):
        return mixing(f"{op_name(node)} along the sequence dimension")
    return NodeRole(Role.TOKEN_LOCAL, dims, (source,))


@rule(aten.pad.default, aten.constant_pad_nd.default)
def pad_rule(node: fx.Node, analysis: AnalysisView) -> NodeRole:
    source = node.args[0]
    rank = value_of(source).dim()
    padding = list(node.args[1])
    padded = {rank - 1 - i // 2 for i, amount in enumerate(padding) if not (isinstance(amount, int) and amount == 0)}
    dims = []
    for seq in analysis.dims_of(source):
        if seq.dim not in padded:
            dims.append(seq)
            continue
        extended = padded_segments(node, seq, padding, rank)
        if extended is None:
            return mixing("pads the sequence dimension")
        dims.append(extended)
    return NodeRole(Role.TOKEN_LOCAL, tuple(dims), (source,))


def padded_segments(node: fx.Node, seq: SequenceDim, padding: list[Any], rank: int) -> SequenceDim | None:
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
    amounts = [size_value(amount) for amount in padding[index:index + 2]]
    if len(amounts) != 2 or not all(isinstance(amount, (int, torch.SymInt)) for amount in amounts):
        return None
    left, right = (expression(amount) for amount in amounts)
    if any(amount.is_number and amount < 0 for amount in (left, right)):
        return None
    return replace(seq, before=sympy.expand(seq.before + left), after=sympy.expand(seq.after + right))


def size_value(amount: Any) -> Any:
    """A padding amount as given: an int, or the SymInt a size node computed."""
    return value_of(amount) if isinstance(amount, fx.Node) else amount


