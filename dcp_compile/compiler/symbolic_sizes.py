"""Turn a size expression of the analysed graph into a size of the graph being traced.

The analysis speaks sympy (``s0``, ``s1*s0``, ``(s2//2)**2``); a re-trace needs SymInts that the
tracer knows how to compute from the graph's inputs. Every symbol dynamo allocated is the size of
some graph input (or a SymInt input itself), so an expression is rebuilt with SymInt arithmetic
from those: the traced graph then computes, say, a flattened ``[B*S, V]`` split as
``reshape(B, S, V)`` for any batch size, instead of one baked into the graph.
"""

from __future__ import annotations

from typing import Any

import sympy
import torch
from torch.utils._sympy.functions import CleanDiv, FloorDiv, Mod, PythonMod


class UnknownSymbol(Exception):
    """A size depends on a symbol that no graph input carries."""


class SymbolicSizes:
    def __init__(self) -> None:
        self.symbols: dict[sympy.Symbol, Any] = {}

    def learn(self, value: Any) -> None:
        """Remember where each plain symbol of a graph input's sizes can be read."""
        if isinstance(value, torch.SymInt):
            self._learn_one(value)
        elif isinstance(value, torch.Tensor):
            for size in value.shape:
                self._learn_one(size)

    def _learn_one(self, size: Any) -> None:
        if isinstance(size, torch.SymInt) and isinstance(size.node.expr, sympy.Symbol):
            self.symbols.setdefault(size.node.expr, size)

    def learn_created(self, traced: Any, value: Any) -> None:
        """Sizes an op creates (``nonzero``'s row count: an unbacked symbol of the analysed graph)
        are created anew by the re-trace: read each such symbol off the op's new output."""
        if isinstance(traced, (tuple, list)) and isinstance(value, (tuple, list)):
            for traced_item, value_item in zip(traced, value):
                self.learn_created(traced_item, value_item)
            return
        if isinstance(traced, torch.SymInt):
            pairs = [(traced, value)]
        elif isinstance(traced, torch.Tensor) and isinstance(value, torch.Tensor) and traced.dim() == value.dim():
            pairs = list(zip(traced.shape, value.shape))
        else:
            return
        for old, new in pairs:
            if isinstance(old, torch.SymInt) and isinstance(old.node.expr, sympy.Symbol):
                self.symbols.setdefault(old.node.expr, new)

    def evaluate(self, expr: Any) -> Any:
        """An int for a constant, otherwise a SymInt computed from the graph's inputs."""
        if isinstance(expr, int):
            return expr
        expr = sympy.sympify(expr)
        if not expr.free_symbols:
            return int(expr)
        if isinstance(expr, sympy.Symbol):
            if expr not in self.symbols:
                raise UnknownSymbol(f"size {expr} is carried by no graph input")
            return self.symbols[expr]
        args = [self.evaluate(arg) for arg in expr.args] if not isinstance(expr, sympy.Pow) else None
        if isinstance(expr, sympy.Add):
            return _fold(args, lambda a, b: a + b)
        if isinstance(expr, sympy.Mul):
            return _fold(args, lambda a, b: a * b)
        if isinstance(expr, sympy.Pow):
            base, exponent = expr.args
            if not (exponent.is_Integer and int(exponent) >= 1):
                raise UnknownSymbol(f"size {expr} has a non-integer power")
            value = self.evaluate(base)
            return _fold([value] * int(exponent), lambda a, b: a * b)
        if isinstance(expr, (FloorDiv, CleanDiv)):
            return args[0] // args[1]
        if isinstance(expr, (Mod, PythonMod)):
            return args[0] % args[1]
        raise UnknownSymbol(f"size {expr} uses {type(expr).__name__}, which dcp cannot rebuild")


def _fold(values: list[Any], combine: Any) -> Any:
    result = values[0]
    for value in values[1:]:
        result = combine(result, value)
    return result
