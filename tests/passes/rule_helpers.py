"""Tiny graphs for rule tests: a function traced by ``make_fx`` with symbolic sizes, its sequence
length, and the analysis of it (the driver run over the graph), so a test can call one rule on one
node and read what it answers, as torchtitan's pass tests call a pass on a captured graph."""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.fx as fx
from torch.fx.experimental.proxy_tensor import make_fx

from dcp_compile.compiler.passes.sequence_dims import SequenceAnalysis, expression
from dcp_compile.compiler.passes.sequence_dims.propagation import fx_to_networkx, propagate, propagate_node


def trace(function: Callable[..., Any], *inputs: torch.Tensor) -> fx.GraphModule:
    """The pre-dispatch ATen graph of ``function`` (``linear`` and SDPA kept), every size symbolic."""
    return make_fx(function, tracing_mode="symbolic", pre_dispatch=True)(*inputs)


def placeholder(gm: fx.GraphModule, index: int = 0) -> fx.Node:
    return list(gm.graph.find_nodes(op="placeholder"))[index]


def size(gm: fx.GraphModule, input_index: int, dim: int) -> Any:
    """The symbolic size of an input's dimension (a sympy expression)."""
    return expression(placeholder(gm, input_index).meta["val"].shape[dim])


def analysed(gm: fx.GraphModule, length: Any) -> SequenceAnalysis:
    """Every node's role with ``length`` as the sequence length (no attention sites needed)."""
    return propagate([], SequenceAnalysis(length=length, graph=fx_to_networkx(gm.graph)))


def analysed_before(gm: fx.GraphModule, length: Any, stop: fx.Node) -> SequenceAnalysis:
    """The roles of the nodes before ``stop`` only: what its rule sees when the driver reaches it."""
    analysis = SequenceAnalysis(length=length, graph=fx_to_networkx(gm.graph))
    for current in gm.graph.nodes:
        if current is stop:
            break
        propagate_node(current, analysis)
    return analysis


def nodes(gm: fx.GraphModule, target: Any) -> list[fx.Node]:
    return list(gm.graph.find_nodes(op="call_function", target=target))


def node(gm: fx.GraphModule, target: Any) -> fx.Node:
    (found,) = nodes(gm, target)
    return found
