"""Parameters a graph break leaves in eager code: found, and their gradients made exact.

Every rank of an SP group runs the model's *eager* code (whatever Dynamo did not put in a graph:
the code around a graph break, a frame Dynamo skipped) on the same full tensors: the graphs
return full outputs, so eager code never sees a chunk. The gradient that reaches that code is
the full one on every rank too (graph inputs all-reduce theirs; graph outputs hand back their
share scaled by 1/P, which the next graph's input all-reduce makes whole again). So each rank
computes the *full* gradient of a parameter used there, and a sum over the group, right for the
partial gradients of the parameters inside the compiled graphs, would count it P times.

The fix is a gradient hook on such a parameter that divides its gradient by the SP size of the
backward it arrives in. The hooks are installed without any call from the user: the first
compiled call at an SP size > 1 finds the module being called (the outermost ``nn.Module`` call
on the Python stack: the ``torch.compile``-d model) and hooks all its trainable parameters, before
the first backward. A hook leaves alone a parameter that a compiled graph took as an input (its
gradient is already partial) and divides only in a backward that runs the compiled graphs of an
SP > 1 call: each call's output autograd nodes are remembered, and the engine says whether the
current backward will run them (an eager reference backward on the same model is not divided).
One backward that mixes SP sizes (losses of micro-batches of different SP sizes summed before
one ``backward``) cannot be split per micro-batch: the hook refuses it, naming the parameter.

``dcp.runtime.watch_parameters(model)`` installs the same hooks explicitly (a model compiled as a function
rather than called as a module), and ``dcp.sync_gradients`` does so too and, for a first step
whose parameters were not hooked yet, divides the accumulated gradients at the sync.
"""

from __future__ import annotations

import collections
import sys
import weakref
from typing import Any, Iterable

import torch

from dcp_compile.errors import DCPError

# id -> weak reference (a WeakSet would compare tensors with ==, which is elementwise)
_graph_parameters: dict[int, "weakref.ref[torch.nn.Parameter]"] = {}
_watched: dict[int, "weakref.ref[torch.nn.Parameter]"] = {}
_watched_modules: "weakref.WeakSet[torch.nn.Module]" = weakref.WeakSet()
_sp_sizes_since_sync: set[int] = set()
_graphs_called = False
# SP size -> output autograd nodes of the latest compiled calls at that size (a backward that will
# run one of them is a backward of that SP size). Strong references: autograd nodes take no weak
# ones; a node's saved tensors are freed by its backward, and a newer call replaces it.
_RECENT_CALLS = 8
_recent_nodes: dict[int, "collections.deque[tuple[Any, ...]]"] = {}
# backward (graph task id) -> SP sizes of the compiled outputs it has started on (the loss itself
# may be a compiled output: the root node of a backward is not among the nodes it "will run").
_started_tasks: "collections.OrderedDict[int, set[int]]" = collections.OrderedDict()
_MODULE_CALL = (torch.nn.Module._call_impl.__code__.co_filename, "_call_impl")
_RESUMED_FORWARD = "torch_dynamo_resume_in_forward_at_"  # Dynamo's name for the rest of a forward after a break


def note_graph_call(values: Iterable[object], sp_size: int) -> None:
    """Called by the dispatcher on every call of a compiled graph, with the parameters it takes
    (the same graph serves every layer of a repeated block, each with its own parameters). At an
    SP size > 1 the module being called gets its parameters hooked (once per module)."""
    global _graphs_called
    _graphs_called = True
    _sp_sizes_since_sync.add(sp_size)
    for value in values:
        reference = _graph_parameters.get(id(value))
        if (reference is None or reference() is not value) and isinstance(value, torch.nn.Parameter):
            _graph_parameters[id(value)] = weakref.ref(value)
    if sp_size > 1:
        module = calling_module()
        if module is not None and module not in _watched_modules:
            watch_parameters(module)


def note_graph_outputs(outputs: Any, sp_size: int) -> Any:
    """Remember the autograd nodes of a compiled call's outputs under its SP size; returns
    ``outputs`` unchanged. Called by the dispatcher after every call."""
    values = outputs if isinstance(outputs, (tuple, list)) else (outputs,)
    nodes = tuple(value.grad_fn for value in values
                  if isinstance(value, torch.Tensor) and value.grad_fn is not None)
    if nodes:
        _recent_nodes.setdefault(sp_size, collections.deque(maxlen=_RECENT_CALLS)).append(nodes)
        for node in nodes:
            node.register_prehook(_started(sp_size))
    return outputs


def _started(sp_size: int):
    def record(grad_outputs: Any) -> None:
        _started_tasks.setdefault(torch._C._current_graph_task_id(), set()).add(sp_size)
        while len(_started_tasks) > 64:
            _started_tasks.popitem(last=False)

    return record


def backward_sp_sizes() -> set[int]:
    """SP sizes of the compiled calls whose outputs the current backward runs (empty: a backward
    of eager code only). Only valid inside a backward."""
    sizes = set(_started_tasks.get(torch._C._current_graph_task_id(), ()))
    for sp_size, calls in _recent_nodes.items():
        if sp_size not in sizes and any(torch._C._will_engine_execute_node(node) for nodes in calls for node in nodes):
            sizes.add(sp_size)
    return sizes


def calling_module() -> torch.nn.Module | None:
    """The outermost ``nn.Module`` being called on this thread's Python stack (the model the user
    called: its ``torch.compile`` wrapper, the module itself, or the module whose bound
    ``forward`` was compiled, resumed after a graph break or not), or None."""
    frame = sys._getframe(1)
    found = None
    while frame is not None:
        code = frame.f_code
        if ((code.co_name == _MODULE_CALL[1] and code.co_filename == _MODULE_CALL[0])
                or code.co_name == "forward" or code.co_name.startswith(_RESUMED_FORWARD)):
            module = frame.f_locals.get("self")
            if isinstance(module, torch.nn.Module):
                found = module
        frame = frame.f_back
    return found


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
    if any(_is_dtensor(parameter) for _, parameter in named) or not _graphs_called:
        return []
    return [name for name, parameter in named if parameter.grad is not None and not _member(_graph_parameters, parameter)]


class ParametersOutsideGraphs(DCPError, RuntimeError):
    """Parameters got full gradients from eager code in a way that cannot be divided exactly:
    one backward over micro-batches of mixed SP sizes, or a step of mixed SP sizes before their
    gradient hooks were installed."""


def _hook(parameter: torch.nn.Parameter, name: str | None = None):
    reference = weakref.ref(parameter)

    def divide_by_sp_size(gradient: torch.Tensor) -> torch.Tensor | None:
        owner = reference()
        if owner is None or _member(_graph_parameters, owner):
            return None
        sizes = backward_sp_sizes()
        if len(sizes) > 1:
            raise ParametersOutsideGraphs(
                f"parameter {name or tuple(owner.shape)} got its gradient from code outside the graphs the dcp "
                f"backend compiled (a Dynamo graph break left it in eager code) in one backward over compiled "
                f"calls of SP sizes {sorted(sizes)}. Every rank of an SP group computes its full gradient, and "
                "one backward over micro-batches of different SP sizes cannot be split per micro-batch. Fix: "
                "call backward once per micro-batch (loss.backward() inside the loop, as in docs/training.md), "
                "or remove the graph break (`torch._dynamo.explain(model)(**inputs)` names it).")
        sp_size = max(sizes, default=1)
        return None if sp_size == 1 else gradient / sp_size

    return divide_by_sp_size


def _display_name(name: str) -> str:
    return name.replace("_orig_mod.", "")


def watch_parameters(model: torch.nn.Module) -> None:
    """Install the gradient hooks on every trainable parameter of ``model`` (idempotent). A hook
    divides by the SP size of the backward only for a parameter that no compiled graph uses, so
    the parameters inside graphs are untouched. The first compiled call at an SP size > 1 does
    this for the module being called; call it yourself when the compiled object is a function
    that calls the model (no module call on the stack)."""
    _watched_modules.add(model)
    for name, parameter in model.named_parameters():
        if parameter.requires_grad and not _is_dtensor(parameter) and not _member(_watched, parameter):
            parameter.register_hook(_hook(parameter, _display_name(name)))
            _watched[id(parameter)] = weakref.ref(parameter)


def correct_parameters_outside_graphs(model: torch.nn.Module) -> list[str]:
    """Make the gradients of parameters used in eager code exact before the sync; their names.

    Watched parameters were divided as their gradients arrived. Unwatched ones (a model whose
    compiled calls found no module to watch, before its first sync) are divided now when every
    compiled call since the last sync ran at one SP size P; with mixed sizes the per-micro-batch
    split is lost and :class:`ParametersOutsideGraphs` is raised. Either way the hooks are
    installed for the steps that follow.
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
        shown = ", ".join(_display_name(name) for name, _ in unwatched[:8])
        shown += f" and {len(unwatched) - 8} more" if len(unwatched) > 8 else ""
        raise ParametersOutsideGraphs(
            f"parameters {shown} got gradients from code outside the graphs the dcp backend compiled "
            f"(a Dynamo graph break left them in eager code) in a step that mixed SP sizes {sorted(sizes)}. "
            "Every rank of an SP group computes their full gradient, and this first step cannot be split "
            "per micro-batch any more. Fix: call `dcp.runtime.watch_parameters(model)` once before training (it "
            "divides each micro-batch's share as it arrives), or remove the graph break "
            "(`torch._dynamo.explain(model)(**inputs)` names it)."
        )
    (sp_size,) = sizes
    for _, parameter in unwatched:
        parameter.grad.div_(sp_size)
    return outside
