"""Which dimension holds the tokens, read backwards from the attention sites.

The sequence analysis finds sequence-indexed values by their sizes: a dimension whose size is the
attention length. A symbolic length (``dynamic=True``) cannot be matched by chance, but a constant
one can: a graph traced at 4096 tokens of a model 4096 wide, or Z-Image's tokens padded to 32 in a
model 32 wide, show the length at both the token and the feature dimension, and every activation
then looks like it had two sequence dimensions. Attention settles it: its queries, keys and values
hold the tokens at dimension -2. Walking back from them through the ops that move dimensions
around (views, permutes, linears, elementwise ops, norms) marks, for each value on the way, the
dimension that holds the tokens. The analysis uses these marks only to break ties between
dimensions of equal size.
"""

from __future__ import annotations

import math
import operator
from typing import Any, Iterator

import torch
import torch.fx as fx

from dcp_compile.compiler.passes.find_attention import SDPA, AttentionSite
from dcp_compile.compiler.passes.sequence_dims.registry import POINTWISE_EXTRA, VIEWS

aten = torch.ops.aten

TokenDims = dict[fx.Node, set[int]]

# Ops whose tensor inputs are aligned with the output from the right (besides pointwise ops).
_SAME_DIM_OPS = POINTWISE_EXTRA | {aten.type_as.default, aten.expand.default}
_VIEWS = VIEWS | {aten.view_as_complex.default, aten.view_as_real.default}
_SPLITS = {aten.split.Tensor, aten.split_with_sizes.default, aten.chunk.default}
_REDUCTIONS = {aten.mean.dim, aten.sum.dim_IntList, aten.amax.default, aten.var.correction}


def _shape(node: Any) -> tuple[Any, ...] | None:
    value = node.meta.get("val") if isinstance(node, fx.Node) else None
    if isinstance(value, torch.Tensor):
        return tuple(value.shape)
    return None


def _same(a: Any, b: Any) -> bool:
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001  (an undecidable symbolic comparison)
        return False


def _prefix(shape: tuple[Any, ...], end: int) -> Any:
    return math.prod(shape[:end]) if end else 1


def _view_source(node: fx.Node, dim: int) -> Iterator[tuple[fx.Node, int]]:
    """The input dimension a view's output dimension comes from: the one with the same size and
    the same product of sizes before it (a dimension merged or split by the view has none)."""
    source = node.args[0]
    in_shape, out_shape = _shape(source), _shape(node)
    if in_shape is None or out_shape is None:
        return
    if node.target is aten.view_as_real.default:  # complex [.., n] -> real [.., n, 2]
        if dim < len(in_shape):
            yield source, dim
        return
    if node.target is aten.view_as_complex.default:
        yield source, dim
        return
    before = _prefix(out_shape, dim)
    for index, size in enumerate(in_shape):
        if _same(size, out_shape[dim]) and _same(_prefix(in_shape, index), before):
            yield source, index
            return


def _aligned_inputs(node: fx.Node, dim: int) -> Iterator[tuple[fx.Node, int]]:
    out_shape = _shape(node)
    for source in node.all_input_nodes:
        shape = _shape(source)
        if shape is None or out_shape is None:
            continue
        index = dim - (len(out_shape) - len(shape))
        if index >= 0 and _same(shape[index], out_shape[dim]):
            yield source, index


def _reduction_source(node: fx.Node, dim: int) -> Iterator[tuple[fx.Node, int]]:
    source = node.args[0]
    shape = _shape(source)
    if shape is None:
        return
    raw = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
    reduced = {d % len(shape) for d in ([raw] if isinstance(raw, int) else (raw or range(len(shape))))}
    keepdim = bool(node.args[2]) if len(node.args) > 2 and isinstance(node.args[2], bool) else bool(node.kwargs.get("keepdim", False))
    kept = [d for d in range(len(shape)) if keepdim or d not in reduced]
    if dim < len(kept) and kept[dim] not in reduced:
        yield source, kept[dim]


def _sources(node: fx.Node, dim: int) -> Iterator[tuple[fx.Node, int]]:
    """The (input, dimension) pairs that hold the tokens when ``node``'s ``dim`` does."""
    if node.op != "call_function":
        return
    target = node.target
    if target is SDPA:
        rank = len(_shape(node) or ())
        if dim == rank - 2:
            yield node.args[0], dim
        return
    if target is operator.getitem:
        source, index = node.args
        if isinstance(source, fx.Node) and source.op == "call_function":
            if source.target in _SPLITS:
                split_dim = (source.args[2] if len(source.args) > 2 else source.kwargs.get("dim", 0))
                rank = len(_shape(source.args[0]) or ())
                if rank and dim != split_dim % rank:
                    yield source.args[0], dim
            elif source.target is aten.unbind.int:
                unbound = source.args[1] if len(source.args) > 1 else 0
                rank = len(_shape(source.args[0]) or ())
                if rank:
                    unbound %= rank
                    yield source.args[0], dim if dim < unbound else dim + 1
            elif source.target is aten.native_layer_norm.default and index == 0:
                yield source.args[0], dim
        return
    if target in _VIEWS:
        yield from _view_source(node, dim)
    elif target is aten.permute.default:
        yield node.args[0], node.args[1][dim] % len(node.args[1])
    elif target is aten.transpose.int:
        rank = len(_shape(node) or ())
        first, second = node.args[1] % rank, node.args[2] % rank
        yield node.args[0], second if dim == first else first if dim == second else dim
    elif target is aten.t.default:
        yield node.args[0], 1 - dim
    elif target is aten.linear.default:
        if dim < len(_shape(node) or ()) - 1:
            yield node.args[0], dim
    elif target in (aten.slice.Tensor, aten.narrow.default):
        yield node.args[0], dim
    elif target is aten.select.int:
        selected = node.args[1] % len(_shape(node.args[0]) or (1,))
        yield node.args[0], dim if dim < selected else dim + 1
    elif target in _REDUCTIONS:
        yield from _reduction_source(node, dim)
    elif target in _SAME_DIM_OPS or (isinstance(target, torch._ops.OpOverload) and torch.Tag.pointwise in target.tags):
        yield from _aligned_inputs(node, dim)


def token_dims_from_attention(sites: list[AttentionSite], length: Any) -> TokenDims:
    """For each value upstream of an attention's queries, keys or values over ``length`` tokens:
    the dimensions that hold the tokens on the way to it."""
    found: TokenDims = {}
    work: list[tuple[fx.Node, int]] = []
    for site in sites:
        for operand in (site.query, site.key, site.value):
            shape = _shape(operand)
            if shape is not None and len(shape) >= 2 and _same(shape[-2], length):
                work.append((operand, len(shape) - 2))
    while work:
        node, dim = work.pop()
        if dim in found.setdefault(node, set()):
            continue
        found[node].add(dim)
        work.extend(_sources(node, dim))
    return found
