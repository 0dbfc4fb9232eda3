"""Which parameters the dcp-compiled graphs use, to catch the ones a graph break left in eager code.

Every rank of an SP group runs the model's *eager* code (whatever Dynamo did not put in a graph:
the code around a graph break, a frame Dynamo skipped) on the same full tensors, so each rank
computes the *full* gradient of a parameter used there. The gradient sync sums over the group,
which is right for the partial gradients of parameters inside the compiled graphs and counts
those eager parameters P times. Nothing inside the graphs can correct that (the backward of eager
code never passes through them), so the sync refuses it instead of returning a wrong gradient.
"""

from __future__ import annotations

import weakref
from typing import Iterable

import torch

# id -> weak reference (a WeakSet would compare tensors with ==, which is elementwise)
_graph_parameters: dict[int, "weakref.ref[torch.nn.Parameter]"] = {}
_sharded_calls_since_sync = 0


def note_graph_call(values: Iterable[object], sp_size: int) -> None:
    """Called by the dispatcher on every call of a compiled graph, with the parameters it takes
    (the same graph serves every layer of a repeated block, each with its own parameters)."""
    global _sharded_calls_since_sync
    if sp_size > 1:
        _sharded_calls_since_sync += 1
    for value in values:
        reference = _graph_parameters.get(id(value))
        if (reference is None or reference() is not value) and isinstance(value, torch.nn.Parameter):
            _graph_parameters[id(value)] = weakref.ref(value)


def _in_graphs(parameter: torch.nn.Parameter) -> bool:
    reference = _graph_parameters.get(id(parameter))
    return reference is not None and reference() is parameter


def parameters_outside_graphs(named: Iterable[tuple[str, torch.nn.Parameter]]) -> list[str]:
    """Names of the parameters with a gradient that no dcp-compiled graph took as an input.

    Sharded parameters (FSDP2's DTensors) are swapped for unsharded ones during forward, so the
    graphs never see the registered objects: they are not judged here."""
    named = list(named)
    if any(type(parameter.data).__name__ == "DTensor" or type(parameter).__name__ == "DTensor" for _, parameter in named):
        return []
    return [name for name, parameter in named if parameter.grad is not None and not _in_graphs(parameter)]


class ParametersOutsideGraphs(RuntimeError):
    """Parameters got gradients from eager code while SP > 1 variants ran: they would be counted
    once per rank of the SP group."""


def check_parameters_in_graphs(named: Iterable[tuple[str, torch.nn.Parameter]]) -> None:
    """Raise :class:`ParametersOutsideGraphs` if, since the last sync, SP > 1 variants ran and a
    parameter has a gradient but was never an input of a dcp-compiled graph; then start over."""
    global _sharded_calls_since_sync
    calls, _sharded_calls_since_sync = _sharded_calls_since_sync, 0
    if not calls or not _graph_parameters:
        return
    outside = parameters_outside_graphs(named)
    if outside:
        shown = ", ".join(outside[:8]) + (f" and {len(outside) - 8} more" if len(outside) > 8 else "")
        raise ParametersOutsideGraphs(
            f"parameters {shown} got gradients from code outside the graphs the dcp backend compiled "
            "(a Dynamo graph break left them in eager code). Every rank of an SP group runs that code on "
            "the full tensors, so summing gradients over the group would count them once per rank. "
            "Fix: remove the graph break (`torch._dynamo.explain(model)(**inputs)` names it; a "
            "data-dependent `if tensor:` or a graph break inside a for loop makes Dynamo run the "
            "whole frame eagerly), or compile with fullgraph=True to be told where it is."
        )
