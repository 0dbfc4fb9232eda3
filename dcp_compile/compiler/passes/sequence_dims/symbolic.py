"""Symbolic sizes: the sympy arithmetic every rule uses to compare a size with the sequence length.

Sizes are sympy expressions of dynamo's size symbols (``s0``, ``(s1//2)*(s2//2)``); two sizes are
the same when their difference expands to zero, and a size holds the sequence when dividing it by
the length leaves a polynomial. ``map_through_view`` follows a sequence dimension through a
reshape with those two tests alone.
"""

from __future__ import annotations

from typing import Any, Iterable

import sympy
import torch
import torch.fx as fx

from dcp_compile.compiler.passes.sequence_dims.model import SequenceDim

# Why a reshape loses the sequence dimension. The first is also what opens a grid region.
SPLITS_SEQUENCE = "a reshape that splits the sequence dimension (e.g. an unpatchify)"
UNMATCHED_RESHAPE = "a reshape whose dimensions cannot be matched symbolically"


def expression(size: Any) -> Any:
    """A size (int or SymInt) as a sympy expression."""
    if isinstance(size, torch.SymInt):
        return size.node.expr
    return sympy.Integer(int(size))


def shape_of(value: Any) -> list[Any] | None:
    if isinstance(value, torch.Tensor):
        return [expression(size) for size in value.shape]
    return None


def value_of(node: Any) -> Any:
    """The traced (fake) value of a node, or None for a literal argument."""
    return node.meta.get("val") if isinstance(node, fx.Node) else None


def product(sizes: Iterable[Any]) -> Any:
    result = sympy.Integer(1)
    for size in sizes:
        result = result * size
    return result


def divides(small: Any, large: Any) -> bool:
    """True when ``large / small`` is a polynomial (no denominator left)."""
    if small == 0:
        return False
    _, denominator = sympy.fraction(sympy.cancel(large / small))
    return denominator == 1


def equal(a: Any, b: Any) -> bool:
    return a == b or sympy.expand(a - b) == 0


def normalize(dim: int, rank: int) -> int:
    """A possibly negative dimension index as a non-negative one."""
    return dim % rank if rank else 0


def traced_size(size: Any) -> int:
    """The size a SymInt had when it was traced (its hint)."""
    if isinstance(size, torch.SymInt):
        hint = size.node.hint
        return int(hint) if hint is not None else 0
    return int(size)


def size_hint(expr: Any) -> int:
    """An expression at equal sizes for every symbol: products rank above their factors."""
    try:
        hints = {symbol: 64 for symbol in expr.free_symbols}
        return int(expr.xreplace(hints))
    except (TypeError, ValueError):
        return 0


def is_empty(node: fx.Node, dim: int) -> bool:
    """An operand with nothing along ``dim`` (or the legacy 1-D ``tensor([])``)."""
    value = value_of(node)
    if not isinstance(value, torch.Tensor):
        return False
    if value.dim() == 1 and equal(expression(value.shape[0]), 0):
        return True
    return value.dim() > dim and equal(expression(value.shape[dim]), 0)


def map_through_view(in_shape: list[Any], out_shape: list[Any], seq: SequenceDim, length: Any) -> SequenceDim | str:
    """Where a sequence dimension lands after a reshape, or why it cannot be followed."""
    i = j = 0
    while i < len(in_shape) and j < len(out_shape):
        group_in, group_out = [i], [j]
        product_in, product_out = in_shape[i], out_shape[j]
        while not equal(product_in, product_out):
            if divides(product_in, product_out) and i + 1 < len(in_shape) and not equal(product_in, 0):
                i += 1
                group_in.append(i)
                product_in = product_in * in_shape[i]
            elif j + 1 < len(out_shape):
                j += 1
                group_out.append(j)
                product_out = product_out * out_shape[j]
            else:
                return UNMATCHED_RESHAPE
        # Trailing size-1 dims join the current group lazily; skip them on both sides.
        if seq.dim in group_in:
            before = product(in_shape[d] for d in group_in if d < seq.dim)
            after = product(in_shape[d] for d in group_in if d > seq.dim)
            outer, inner = before * seq.outer, seq.inner * after
            # Find the output dimension of this group that holds the sequence factor.
            prefix = sympy.Integer(1)
            for index, out_dim in enumerate(group_out):
                size = out_shape[out_dim]
                if divides(prefix, outer):
                    remaining_outer = sympy.cancel(outer / prefix)
                    if divides(remaining_outer * length, size):
                        local_inner = sympy.cancel(size / (remaining_outer * length))
                        suffix = product(out_shape[d] for d in group_out[index + 1 :])
                        if equal(local_inner * suffix, inner):
                            return SequenceDim(out_dim, sympy.expand(remaining_outer), sympy.expand(local_inner))
                prefix = prefix * size
            return SPLITS_SEQUENCE
        i += 1
        j += 1
    return UNMATCHED_RESHAPE
