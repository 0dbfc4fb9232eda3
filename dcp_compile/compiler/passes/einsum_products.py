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
        left, right = operands
        b = product.batch
        with graph.inserting_before(node):
            lhs = _permuted(graph, left, product.left, b + (product.free_left, product.contracted))
            as_columns = b + (product.contracted, product.free_right)
            if [product.right.index(c) for c in as_columns] == list(range(len(as_columns))):
                rhs = right  # already [batch..., contracted, free_right]: attn @ v
            else:
                rows = _permuted(graph, right, product.right, b + (product.free_right, product.contracted))
                rhs = graph.call_function(aten.transpose.int, (rows, -2, -1))
            result = graph.call_function(aten.matmul.default, (lhs, rhs))
            result = _permuted(graph, result, b + (product.free_left, product.free_right), product.output)
        result.meta.update({k: v for k, v in node.meta.items() if k != "val"})
        node.replace_all_uses_with(result)
        graph.erase_node(node)
        rewritten += 1
    if rewritten:
        gm.recompile()
        log.info("dcp: %d einsum product(s) respelled as matmul", rewritten)
    return rewritten
