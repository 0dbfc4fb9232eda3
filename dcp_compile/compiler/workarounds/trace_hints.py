"""Trace a sharded variant at a length that leaves every rank two tokens or more.

The model's first call is Dynamo's trace, and its sizes are the hints of every variant's trace.
Where a size expression cannot be decided symbolically, the shape environment answers with the
hint. A first call so short that a rank of a larger SP size holds one token (8 tokens at SP 8)
makes those questions ("is this rank's chunk 1 long?") answer yes: the variant's reshapes bake a
1 where the rank's chunk goes, and every later call at another length fails in a ``view``
(``tests/test_first_trace_hints.py``). Torch's size-oblivious tracing does not cover it: the chunk
is an expression such as ``Max(1, (s + 7) // 8)``, not a symbol.

So the variant is traced with fresh fake inputs whose sizes are the same expressions with a larger
hint for the length's symbol (two tokens per rank), as regions trace at each call's sizes. The
shape environment's own hint is raised for the trace and restored after it.

Covers: the shape environment on torch 2.13.0 answering an undecidable size question from the
first call's hint, which size-oblivious tracing does not cover for ``Max(1, (s + 7) // 8)`` (no
upstream issue filed).
Test: tests/test_first_trace_hints.py (a first call of one token per rank fixed the variant to it).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import sympy
import torch

TOKENS_PER_RANK = 2  # the fewest for which no rank's chunk can be mistaken for a broadcast dim


@contextlib.contextmanager
def traced_with_room(fake_mode: Any, fake_inputs: list[Any], length: Any, sp_size: int) -> Iterator[list[Any]]:
    """The fake inputs to trace a variant of ``sp_size`` with: ``fake_inputs`` themselves, or, where
    the attention ``length`` (a symbol) is hinted below ``TOKENS_PER_RANK * sp_size``, copies
    hinted there (the shape environment hints the symbol there meanwhile)."""
    symbol = _raised_symbol(fake_mode, length, sp_size)
    if symbol is None:
        yield fake_inputs
        return
    shape_env = fake_mode.shape_env
    hints = shape_env.backed_var_to_val
    before = hints[symbol]
    raised = sympy.Integer(TOKENS_PER_RANK * sp_size)
    hints[symbol] = raised
    try:
        yield [_rehinted(value, symbol, shape_env, fake_mode) for value in fake_inputs]
    finally:
        hints[symbol] = before


def _raised_symbol(fake_mode: Any, length: Any, sp_size: int) -> sympy.Symbol | None:
    """The length's symbol where its hint is too short for ``sp_size`` and may be raised."""
    shape_env = getattr(fake_mode, "shape_env", None)
    if sp_size <= 1 or shape_env is None or not isinstance(length, sympy.Symbol):
        return None
    hint = shape_env.backed_var_to_val.get(length)
    wanted = TOKENS_PER_RANK * sp_size
    if hint is None or int(hint) >= wanted:
        return None
    allowed = shape_env.var_to_range.get(length)
    if allowed is not None and not (allowed.lower <= wanted <= allowed.upper):
        return None  # the trace's guards bound the length below: keep what they saw
    return length


def _rehinted(value: Any, symbol: sympy.Symbol, shape_env: Any, fake_mode: Any) -> Any:
    """``value`` with every size, stride and offset that reads ``symbol`` hinted anew."""
    def reads(size: Any) -> bool:
        return isinstance(size, torch.SymInt) and symbol in size.node.expr.free_symbols

    def again(size: Any) -> Any:
        if not reads(size):
            return size
        expression = size.node.expr
        return shape_env.create_symintnode(expression, hint=int(expression.xreplace(shape_env.backed_var_to_val)))

    if isinstance(value, torch.SymInt):
        return again(value)
    if not isinstance(value, torch.Tensor) or isinstance(value, torch.nn.Parameter):
        return value  # parameters never carry the length
    layout = [*value.shape, *value.stride(), value.storage_offset()]
    if not any(reads(size) for size in layout):
        return value
    sizes = [again(size) for size in value.shape]
    strides = [again(stride) for stride in value.stride()]
    offset = again(value.storage_offset())
    with fake_mode:
        if isinstance(offset, int) and offset == 0:
            fresh = torch.empty_strided(sizes, strides, dtype=value.dtype, device=value.device)
        else:
            extent = offset + 1 + sum((size - 1) * stride for size, stride in zip(sizes, strides))
            fresh = torch.empty(extent, dtype=value.dtype, device=value.device).as_strided(sizes, strides, offset)
    return fresh.requires_grad_(value.requires_grad)
