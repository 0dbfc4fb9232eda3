"""Parameters a graph break leaves in eager code: found, and their gradients made exact.

Every rank of an SP group runs the model's *eager* code (whatever Dynamo did not put in a graph:
the code around a graph break, a frame Dynamo skipped) on the same full tensors, and the gradient
that reaches that code is the full one on every rank (graph inputs all-reduce theirs, graph
outputs hand back their share scaled by 1/P). So each rank computes the *full* gradient of a
parameter used there, and the sync's sum over the group, right for the partial gradients of the
parameters inside the compiled graphs, would count it P times.

The fix is a gradient hook on such a parameter that divides each micro-batch's contribution by
that micro-batch's SP size (the SP size of the latest compiled call: a micro-batch's backward
follows its forward). The hooks are installed by the first ``dcp.sync_gradients`` (or
``dcp.watch_parameters``, to cover the first step as well); on a first step whose micro-batches
all ran at one SP size the accumulated gradients are divided at the sync instead, and a first step
of mixed SP sizes without ``watch_parameters`` is refused, naming the parameters.
"""

from __future__ import annotations

import weakref
from typing import Iterable

import torch

# id -> weak reference (a WeakSet would compare tensors with ==, which is elementwise)
_graph_parameters: dict[int, "weakref.ref[torch.nn.Parameter]"] = {}
_watched: dict[int, "weakref.ref[torch.nn.Parameter]"] = {}
_sp_sizes_since_sync: set[int] = set()
_current_sp_size = 1


def note_graph_call(values: Iterable[object], sp_size: int) -> None:
    """Called by the dispatcher on every call of a compiled graph, with the parameters it takes
    (the same graph serves every layer of a repeated block, each with its own parameters)."""
    global _current_sp_size
    _current_sp_size = sp_size
    _sp_sizes_since_sync.add(sp_size)
    for value in values:
        reference = _graph_parameters.get(id(value))
        if (reference is None or reference() is not value) and isinstance(value, torch.nn.Parameter):
            _graph_parameters[id(value)] = weakref.ref(value)


def _member(table: dict, parameter: torch.nn.Parameter) -> bool:
    reference = table.get(id(parameter))
    return reference is not None and reference() is parameter


def _is_dtensor(parameter: torch.nn.Parameter) -> bool:
    return type(parameter.data).__name__ == "DTensor" or type(parameter).__name__ == "DTensor"


def parameters_outside_graphs(named: Iterable[tuple[str, torch.nn.Parameter]]) -> list[str]:
    """Names of the parameters with a gradient that no dcp-compiled graph took as an input.

    Sharded parameters (FSDP2's DTensors) are swapped for unsharded ones during forward, so the
    graphs never see the registered objects: they are not judged here."""
    named = list(named)
    if any(_is_dtensor(parameter) for _, parameter in named) or not _graph_parameters:
        return []
    return [name for name, parameter in named if parameter.grad is not None and not _member(_graph_parameters, parameter)]


class ParametersOutsideGraphs(RuntimeError):
    """Parameters got full gradients from eager code in a step of mixed SP sizes before their
    gradient hooks were installed: they cannot be divided exactly afterwards."""


def _hook(parameter: torch.nn.Parameter):
    reference = weakref.ref(parameter)

    def divide_by_sp_size(gradient: torch.Tensor) -> torch.Tensor | None:
        owner = reference()
        if _current_sp_size == 1 or owner is None or _member(_graph_parameters, owner):
            return None
        return gradient / _current_sp_size

    return divide_by_sp_size


def watch_parameters(model: torch.nn.Module) -> None:
    """Install the gradient hooks on every trainable parameter of ``model`` (idempotent). A hook
    divides by the current SP size only for a parameter that no compiled graph uses, so the
    parameters inside graphs are untouched. ``dcp.sync_gradients`` calls this; call it yourself
    before the first step when a step mixes SP sizes and the model has graph breaks."""
    for parameter in model.parameters():
        if parameter.requires_grad and not _is_dtensor(parameter) and not _member(_watched, parameter):
            parameter.register_hook(_hook(parameter))
            _watched[id(parameter)] = weakref.ref(parameter)


def correct_parameters_outside_graphs(model: torch.nn.Module) -> list[str]:
    """Make the gradients of parameters used in eager code exact before the sync; their names.

    Watched parameters were divided as their gradients arrived. Unwatched ones (the first step)
    are divided now when every compiled call since the last sync ran at one SP size P; with mixed
    sizes the per-micro-batch split is lost and :class:`ParametersOutsideGraphs` is raised. Either
    way the hooks are installed for the steps that follow.
    """
    sizes = set(_sp_sizes_since_sync)
    _sp_sizes_since_sync.clear()
    named = list(model.named_parameters())
    outside = parameters_outside_graphs(named)
    unwatched = [(name, parameter) for name, parameter in named
                 if name in set(outside) and not _member(_watched, parameter)]
    watch_parameters(model)
    if not unwatched or sizes <= {1}:
        return outside
    if len(sizes) > 1:
        shown = ", ".join(name for name, _ in unwatched[:8]) + (f" and {len(unwatched) - 8} more" if len(unwatched) > 8 else "")
        raise ParametersOutsideGraphs(
            f"parameters {shown} got gradients from code outside the graphs the dcp backend compiled "
            f"(a Dynamo graph break left them in eager code) in a step that mixed SP sizes {sorted(sizes)}. "
            "Every rank of an SP group computes their full gradient, and this first step cannot be split "
            "per micro-batch any more. Fix: call `dcp.watch_parameters(model)` once before training (it "
            "divides each micro-batch's share as it arrives), or remove the graph break "
            "(`torch._dynamo.explain(model)(**inputs)` names it)."
        )
    (sp_size,) = sizes
    for _, parameter in unwatched:
        parameter.grad.div_(sp_size)
    return outside
