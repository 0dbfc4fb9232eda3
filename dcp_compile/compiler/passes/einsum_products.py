"""Batched matrix products spelled with ``einsum``, respelled as ``matmul`` before attention is found.

``einsum("b h i d, b h j d -> b h i j", q, k)``, softmax, ``einsum("b h i j, b h j d -> b h i d",
attn, v)`` is attention in any index names and layouts; the attention matchers know it in the
``q @ k.transpose(-2, -1)`` spelling only. A two-operand equation with one free index per operand
and one contracted index (the rest batch indices, present everywhere) is exactly a batched matmul:

    left  -> permute to [batch..., free_left, contracted]
    right -> permute to [batch..., free_right, contracted], then transpose(-2, -1)
              (or [batch..., contracted, free_right] when it already is, with no transpose)
    matmul, then permute to the equation's output order.

The permutes are omitted when they are the identity, so the scores product reads as
``q @ k.transpose(-2, -1)`` and ``attn @ v`` reads as itself. An ellipsis (``"...id,...jd->...ij"``)
stands for batch indices, spelled out from the operands' ranks first. Other equations are left alone.

The same product written as a broadcast multiply and a sum (``einops.reduce(q[:, :, :, None] *
k[:, :, None], "b h i j d -> b h i j", "sum")``, or ``(q.unsqueeze(-2) * k.unsqueeze(-3)).sum(-1)``)
reaches the graph as ``sum(permute*(mul(a, b)), dims)``: each operand's dims of static size 1 are
the broadcast ones, so the equation it spells is read off the shapes and, when it is a batched
matmul, emitted as one (``respell_summed_products``). Only batched matmuls are respelled: a masked
or weighted sum over the sequence (one operand without a free index) stays a sum, whose lowering
over the sequence is a local sum and an all-reduce.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.fx as fx

aten = torch.ops.aten
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class BatchedProduct:
    """An einsum equation read as ``[batch..., m, k] @ [batch..., k, n]``."""

    batch: tuple[str, ...]
    free_left: str
    free_right: str
    contracted: str
    left: tuple[str, ...]
    right: tuple[str, ...]
    output: tuple[str, ...]


def _indices(term: str) -> tuple[str, ...] | None:
    letters = tuple(term.replace(" ", ""))
    if not letters or not all(c.isalpha() for c in letters) or len(set(letters)) != len(letters):
        return None
    return letters


ELLIPSIS = "..."


def expand_ellipses(equation: str, ranks: tuple[int, ...]) -> str | None:
    """``equation`` with each ``...`` spelled as the batch letters it stands for, given the
    operands' ranks (``"...id,...jd->...ij"`` at rank 4: ``"ABid,ABjd->ABij"``); None when the
    operands' ellipses cover different numbers of dimensions (a broadcast over missing dims).
    Indices are letters of either case, so the fresh ones are letters the equation does not use."""
    equation = equation.replace(" ", "")
    if ELLIPSIS not in equation:
        return equation
    if "->" not in equation:
        return None
    inputs, output = equation.split("->")
    terms = inputs.split(",")
    if len(terms) != len(ranks):
        return None
    covered = {rank - len(term.replace(ELLIPSIS, "")) for term, rank in zip(terms, ranks) if ELLIPSIS in term}
    if len(covered) != 1 or min(covered) < 0 or any(term.count(ELLIPSIS) > 1 for term in terms + [output]):
        return None
    fresh = [c for c in "ABCDEFGHIJKLMNOPQRSTUVWXYZ" if c not in equation][:covered.pop()]
    spelled = "".join(fresh)
    return ",".join(term.replace(ELLIPSIS, spelled) for term in terms) + "->" + output.replace(ELLIPSIS, spelled)


def parse_batched_product(equation: str, ranks: tuple[int, ...] | None = None) -> BatchedProduct | None:
    """The batched matmul an einsum equation spells, or None (repeated or lone indices, ellipses
    without the operands' ``ranks`` to expand them)."""
    if ranks is not None:
        equation = expand_ellipses(equation, ranks) or ""
    if "->" not in equation or "." in equation:
        return None
    inputs, output_term = equation.split("->")
    terms = inputs.split(",")
    if len(terms) != 2:
        return None
    left, right, output = _indices(terms[0]), _indices(terms[1]), _indices(output_term)
    if left is None or right is None or output is None:
        return None
    batch = tuple(c for c in output if c in left and c in right)
    free_left = [c for c in left if c not in right and c in output]
    free_right = [c for c in right if c not in left and c in output]
    contracted = [c for c in left if c in right and c not in output]
    if len(free_left) != 1 or len(free_right) != 1 or len(contracted) != 1:
        return None
    if len(batch) + 2 != len(left) or len(batch) + 2 != len(right) or len(batch) + 2 != len(output):
        return None
    return BatchedProduct(batch, free_left[0], free_right[0], contracted[0], left, right, output)


def _permuted(graph: fx.Graph, node: fx.Node, have: tuple[str, ...], want: tuple[str, ...]) -> fx.Node:
    order = [have.index(c) for c in want]
    if order == list(range(len(order))):
        return node
    return graph.call_function(aten.permute.default, (node, order))


def emit_batched_product(graph: fx.Graph, product: BatchedProduct, left: fx.Node, right: fx.Node) -> fx.Node:
    """``product`` of ``left`` and ``right`` as ``matmul`` between the permutes it needs, spelled as
    the attention matchers read it (``q @ k.transpose(-2, -1)``, ``attn @ v``)."""
    b = product.batch
    lhs = _permuted(graph, left, product.left, b + (product.free_left, product.contracted))
    as_columns = b + (product.contracted, product.free_right)
    if [product.right.index(c) for c in as_columns] == list(range(len(as_columns))):
        rhs = right  # already [batch..., contracted, free_right]: attn @ v
    else:
        rows = _permuted(graph, right, product.right, b + (product.free_right, product.contracted))
        rhs = graph.call_function(aten.transpose.int, (rows, -2, -1))
    result = graph.call_function(aten.matmul.default, (lhs, rhs))
    return _permuted(graph, result, b + (product.free_left, product.free_right), product.output)


def respell_einsum_products(gm: fx.GraphModule) -> int:
    """Rewrite every two-operand batched-matmul ``einsum`` of ``gm`` as ``matmul``; how many."""
    rewritten = 0
    graph = gm.graph
    for node in list(graph.find_nodes(op="call_function", target=aten.einsum.default)):
        equation, operands = node.args[0], node.args[1]
        if not isinstance(equation, str) or len(operands) != 2 or not all(isinstance(o, fx.Node) for o in operands):
            continue
        values = [o.meta.get("val") for o in operands]
        if not all(isinstance(v, torch.Tensor) for v in values):
            continue
        product = parse_batched_product(equation, tuple(v.dim() for v in values))
        if product is None:
            continue
        with graph.inserting_before(node):
            result = emit_batched_product(graph, product, *operands)
        result.meta.update({k: v for k, v in node.meta.items() if k != "val"})
        node.replace_all_uses_with(result)
        graph.erase_node(node)
        rewritten += 1
    if rewritten:
        gm.recompile()
        log.info("dcp: %d einsum product(s) respelled as matmul", rewritten)
    return rewritten


SUM = aten.sum.dim_IntList
LETTERS = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"


@dataclass(frozen=True)
class SummedProduct:
    """``sum(permute*(mul(left, right)), dims)``: the nodes, and the product's equation read off the
    shapes (each operand spans the mul's dims where its size is not a static 1)."""

    chain: tuple[fx.Node, ...]  # the sum's input back to the mul, each used only by the next
    left: fx.Node
    right: fx.Node
    product: BatchedProduct
    squeeze_left: tuple[int, ...]  # the operands' broadcast dims (static size 1)
    squeeze_right: tuple[int, ...]
    unsqueeze: tuple[int, ...]  # positions of the sum's output of size 1 (kept or broadcast dims)


def _permutation(node: fx.Node) -> list[int] | None:
    """The dims of ``node``'s input at each of its dims, for a permute or transpose."""
    if node.target is aten.permute.default:
        return list(node.args[1])
    if node.target is aten.transpose.int:
        rank = node.meta["val"].dim()
        order = list(range(rank))
        a, b = node.args[1] % rank, node.args[2] % rank
        order[a], order[b] = order[b], order[a]
        return order
    return None


def _product_chain(source: fx.Node) -> tuple[tuple[fx.Node, ...], list[int]] | None:
    """The permutes from ``source`` back to a mul, each with one user, and the mul's dim at each
    dim of ``source``; None if ``source`` is not a permuted mul."""
    rank = source.meta["val"].dim()
    order, chain = list(range(rank)), [source]
    while len(chain[-1].users) == 1 and (permutation := _permutation(chain[-1])) is not None:
        order = [permutation[o] for o in order]
        chain.append(chain[-1].args[0])
    mul = chain[-1]
    if mul.target is not aten.mul.Tensor or len(mul.users) != 1:
        return None
    return tuple(chain), order


def _spans(value: torch.Tensor, rank: int) -> tuple[list[int], tuple[int, ...]]:
    """The mul dims an operand spans (right-aligned, as broadcasting reads it), and its own dims of
    static size 1, which it only broadcasts over."""
    offset, spans, ones = rank - value.dim(), [], []
    for dim, size in enumerate(value.shape):
        if isinstance(size, int) and size == 1:
            ones.append(dim)
        else:
            spans.append(dim + offset)
    return spans, tuple(ones)


def summed_product(node: fx.Node) -> SummedProduct | None:
    """The batched matmul a sum of a broadcast product spells, or None."""
    if node.op != "call_function" or node.target is not SUM or node.kwargs.get("dtype") is not None:
        return None
    source, dims = node.args[0], node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
    keepdim = bool(node.args[2] if len(node.args) > 2 else node.kwargs.get("keepdim", False))
    if not isinstance(source, fx.Node) or not isinstance(source.meta.get("val"), torch.Tensor) or not dims:
        return None
    rank = source.meta["val"].dim()
    found = _product_chain(source) if rank <= len(LETTERS) else None
    if found is None:
        return None
    chain, order = found
    operands = chain[-1].args
    values = [o.meta.get("val") if isinstance(o, fx.Node) else None for o in operands]
    if len(operands) != 2 or not all(isinstance(v, torch.Tensor) and v.is_floating_point() for v in values):
        return None
    if values[0].dtype != values[1].dtype:  # a matmul does not promote
        return None
    summed = {d % rank for d in ([dims] if isinstance(dims, int) else dims)}
    (left_spans, left_ones), (right_spans, right_ones) = (_spans(v, rank) for v in values)
    spanned = set(left_spans) | set(right_spans)
    kept = [order[d] for d in range(rank) if d not in summed]
    output = "".join(LETTERS[m] for m in kept if m in spanned)
    equation = "".join(LETTERS[m] for m in left_spans) + "," + "".join(LETTERS[m] for m in right_spans)
    product = parse_batched_product(f"{equation}->{output}")
    if product is None:
        return None
    final = [d for d in range(rank) if keepdim or d not in summed]  # the sum's output dims
    unsqueeze = tuple(p for p, d in enumerate(final) if d in summed or order[d] not in spanned)
    return SummedProduct(chain, operands[0], operands[1], product, left_ones, right_ones, unsqueeze)


INSERTING_VIEWS = {aten.unsqueeze.default, aten.reshape.default, aten.view.default, aten._unsafe_view.default}


def _same_sizes(a: tuple, b: tuple) -> bool:
    """Equal shapes, compared as expressions (no guard on a symbolic size)."""
    def expr(size: object) -> object:
        return size.node.expr if isinstance(size, torch.SymInt) else size

    return len(a) == len(b) and all(expr(x) == expr(y) for x, y in zip(a, b))


def _inserted_ones(node: fx.Node, dims: list[int]) -> fx.Node | None:
    """The input of ``node`` when ``node`` is a view that only inserts size-1 ``dims`` (``unsqueeze``,
    or einops' ``reshape`` to ``"b h i j 1"``)."""
    if node.target not in INSERTING_VIEWS or not isinstance(node.args[0], fx.Node):
        return None
    shape, source = node.meta["val"].shape, node.args[0].meta.get("val")
    kept = tuple(size for d, size in enumerate(shape) if d not in dims)
    return node.args[0] if isinstance(source, torch.Tensor) and _same_sizes(kept, tuple(source.shape)) else None


def _squeezed(graph: fx.Graph, node: fx.Node, dims: tuple[int, ...]) -> fx.Node:
    """``node`` without its broadcast ``dims``: a view that inserted them is stepped over (the
    matchers then see ``softmax(...) @ v``, not a view of it), else they are squeezed."""
    if not dims:
        return node
    source = _inserted_ones(node, list(dims))
    if source is not None:
        return source
    return graph.call_function(aten.squeeze.dims, (node, list(dims)))


def _erase_unused_views(graph: fx.Graph, node: fx.Node) -> None:
    """Drop the views ``_squeezed`` stepped over: the matchers ask for single-user softmaxes."""
    if not node.users and node.target in INSERTING_VIEWS:
        graph.erase_node(node)


def respell_summed_products(gm: fx.GraphModule) -> int:
    """Rewrite every sum of a broadcast product of ``gm`` that is a batched matmul (einops.reduce's
    spelling of ``q @ k^T`` and ``attn @ v``) as ``matmul``; how many."""
    rewritten = 0
    graph = gm.graph
    for node in list(graph.find_nodes(op="call_function", target=SUM)):
        found = summed_product(node)
        if found is None:
            continue
        with graph.inserting_before(node):
            left = _squeezed(graph, found.left, found.squeeze_left)
            right = _squeezed(graph, found.right, found.squeeze_right)
            result = emit_batched_product(graph, found.product, left, right)
            for position in found.unsqueeze:
                result = graph.call_function(aten.unsqueeze.default, (result, position))
        result.meta.update({k: v for k, v in node.meta.items() if k != "val"})
        node.replace_all_uses_with(result)
        graph.erase_node(node)
        for dead in found.chain:
            graph.erase_node(dead)
        for operand in {found.left, found.right}:
            _erase_unused_views(graph, operand)
        rewritten += 1
    if rewritten:
        gm.recompile()
        log.info("dcp: %d summed broadcast product(s) respelled as matmul", rewritten)
    return rewritten
