"""Fake inputs for a region in a shape environment of its own, with a symbol per size expression."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


class UnsupportedRegion(Exception):
    """A region that cannot be compiled with fresh symbols: it runs as the ATen graph it is."""


@dataclass
class FreshInputs:
    fake_mode: Any
    values: list[Any]


def fresh_inputs(traced: list[Any], args: tuple) -> FreshInputs:
    """Fake inputs of a new shape environment for a region called with ``args``: each distinct size
    expression of the variant's trace (``traced``, the placeholders' values: ``s0``, the chunk
    ``(s1 + 1) // 2``) becomes a symbol of its own, hinted by ``args``; static sizes stay numbers.

    Sizes that are one expression in the trace are one symbol here, so the region keeps exactly
    the relations the variant's trace had between its inputs' sizes, and no others: a region of
    SP 2 (chunk ``(s1 + 1) // 2``) and of SP 1 (``s1``) then trace to the same graph."""
    import sympy
    from torch._dynamo.source import LocalSource
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv

    shape_env = ShapeEnv()
    fake_mode = FakeTensorMode(shape_env=shape_env)
    symbols: dict[sympy.Expr, sympy.Symbol] = {}

    def symbol_for(expression: sympy.Expr, hint: int, source: Any, positive: bool | None = True) -> sympy.Symbol:
        if expression not in symbols:
            symbols[expression] = shape_env.create_symbol(hint, source, dynamic_dim=DimDynamic.DYNAMIC,
                                                          do_not_specialize_zero_one=True, positive=positive)
        return symbols[expression]

    def expression_of(size: Any) -> sympy.Expr | None:
        return size.node.expr if isinstance(size, torch.SymInt) else None

    def data_dependent(size: Any) -> bool:
        """A size only the data decides (an unbacked symbol in the trace): here it is a size like any
        other, hinted by the call (the region's guards hold it to what the compile assumed), but it
        may be 0 or 1, which a trace's backed sizes are not."""
        return isinstance(size, torch.SymInt) and size.node.hint is None

    # Sizes first, everywhere, so that a stride can be written in the symbols of any input's sizes.
    for index, (value, arg) in enumerate(zip(traced, args)):
        source = LocalSource(f"t{index}")
        if isinstance(arg, torch.Tensor) and isinstance(value, torch.Tensor):
            for dim, size in enumerate(value.shape):
                expression = expression_of(size)
                if expression is not None:
                    symbol_for(expression, int(arg.shape[dim]), _size_source(source, dim),
                               positive=None if data_dependent(size) else True)
        elif isinstance(arg, int) and isinstance(value, torch.SymInt):
            symbol_for(expression_of(value), arg, source, positive=None)  # an int may be negative (a slice end)
    fresh: list[Any] = []
    for index, (value, arg) in enumerate(zip(traced, args)):
        if isinstance(arg, torch.Tensor):
            if not isinstance(value, torch.Tensor):
                raise UnsupportedRegion("a tensor input without its traced value")
            sizes = [_in_fresh(shape_env, symbols, size, int(actual)) for size, actual in zip(value.shape, arg.shape)]
            strides, offset = _fresh_layout(shape_env, symbols, value, arg, sizes, LocalSource(f"t{index}"))
            with fake_mode:
                if isinstance(offset, int) and offset == 0:
                    fake = torch.empty_strided(sizes, strides, dtype=arg.dtype, device=arg.device)
                else:  # a view into a larger buffer (a narrowed chunk): keep its offset, or its guard fails
                    extent = offset + 1 + sum((size - 1) * stride for size, stride in zip(sizes, strides))
                    fake = torch.empty(extent, dtype=arg.dtype, device=arg.device).as_strided(sizes, strides, offset)
            fresh.append(fake.requires_grad_(True) if arg.requires_grad else fake)
        elif isinstance(arg, int) and isinstance(value, torch.SymInt):
            fresh.append(_in_fresh(shape_env, symbols, value, arg))
        elif isinstance(value, (torch.SymFloat, torch.SymBool)):
            raise UnsupportedRegion(f"a symbolic {type(value).__name__} input")
        else:
            fresh.append(arg)
    return FreshInputs(fake_mode, fresh)


def _fresh_layout(shape_env: Any, symbols: dict, value: torch.Tensor, arg: torch.Tensor, sizes: list,
                  source: Any) -> tuple[list, Any]:
    """The strides and storage offset ``arg`` has at this call, in the fresh symbols.

    In order of preference: the traced expressions, where they give ``arg``'s values at this call's
    sizes (a stride ``192 * s`` of adaLN's ``chunk(6)`` view); ``arg``'s dense order (a kernel laid
    its output out otherwise than its fake did); else a symbol of its own for each stride that
    neither writes (the guards then bind it to the call's stride, no more)."""
    from torch._dynamo.source import TensorProperty, TensorPropertySource

    fresh_symbols = set(symbols.values())
    hints = {symbol: shape_env.backed_var_to_val[symbol] for symbol in fresh_symbols}

    def written(traced: Any) -> Any:
        """``traced`` in the fresh symbols, or None where no size writes it."""
        if not isinstance(traced, torch.SymInt):
            return int(traced)
        rewritten = traced.node.expr.xreplace(symbols)
        return None if rewritten.free_symbols - fresh_symbols else rewritten

    def at_this_call(expression: Any) -> int | None:
        return None if expression is None else int(expression.xreplace(hints)) if hasattr(expression, "xreplace") \
            else int(expression)

    def as_size(expression: Any, actual: int, where: Any) -> Any:
        if expression is None or at_this_call(expression) != actual:
            symbol = shape_env.create_symbol(actual, where, do_not_specialize_zero_one=True)
            return shape_env.create_symintnode(symbol, hint=actual)
        if isinstance(expression, int):
            return expression
        return shape_env.create_symintnode(expression, hint=actual)

    stride_sources = [TensorPropertySource(source, TensorProperty.STRIDE, dim) for dim in range(arg.dim())]
    traced_strides = [written(stride) for stride in value.stride()]
    if [at_this_call(stride) for stride in traced_strides] == list(arg.stride()):
        strides = [as_size(stride, actual, where)
                   for stride, actual, where in zip(traced_strides, arg.stride(), stride_sources)]
    else:
        order = sorted(range(arg.dim()), key=lambda dim: (arg.stride(dim), arg.shape[dim]))  # innermost first
        dense: list[Any] = [0] * arg.dim()
        running: Any = 1
        for dim in order:
            dense[dim] = running
            running = running * sizes[dim]
        if [int(s.node.hint) if isinstance(s, torch.SymInt) else int(s) for s in dense] == list(arg.stride()):
            strides = dense
        else:  # neither: each stride that no expression gives a symbol of its own
            strides = [as_size(stride, actual, where)
                       for stride, actual, where in zip(traced_strides, arg.stride(), stride_sources)]
    offset_source = TensorPropertySource(source, TensorProperty.STORAGE_OFFSET)
    actual_offset = arg.storage_offset()
    traced_offset = written(value.storage_offset())
    if actual_offset == 0 and at_this_call(traced_offset) != 0:
        offset: Any = 0
    else:
        offset = as_size(traced_offset, actual_offset, offset_source)
    return strides, offset


def _size_source(source: Any, dim: int) -> Any:
    from torch._dynamo.source import TensorProperty, TensorPropertySource

    return TensorPropertySource(source, TensorProperty.SIZE, dim)


def _in_fresh(shape_env: Any, symbols: dict, size: Any, actual: int) -> Any:
    """A traced size or stride written in the fresh symbols (a number where it is static)."""
    if not isinstance(size, torch.SymInt):
        return int(size)
    expression = size.node.expr
    if expression in symbols:
        return shape_env.create_symintnode(symbols[expression], hint=actual)
    rewritten = expression.xreplace(symbols)
    if rewritten.free_symbols - set(symbols.values()):
        raise UnsupportedRegion(f"a stride or size {expression} not written in the inputs' sizes")
    return shape_env.create_symintnode(rewritten, hint=actual)
