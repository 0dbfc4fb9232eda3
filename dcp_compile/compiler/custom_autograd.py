"""User ``torch.autograd.Function``s keep their own backward through the ATen capture.

Dynamo records a custom ``autograd.Function`` as one ``autograd_function_apply`` call holding two
graphs: the user's forward and the user's backward. The pre-dispatch ATen re-trace
(:mod:`~dcp_compile.compiler.graph_capture`) would run that call as an ordinary autograd.Function,
which records the *forward* ops only: AOTAutograd then differentiates the forward formula and the
user's backward is lost. When the two differ (BLOOM's GeLU has a hand-approximated backward;
straight-through estimators, gradient clipping functions, fused kernels with their own backward)
the gradients come out silently wrong.

So before the re-trace each such call becomes ``dcp::custom_autograd_function``: a custom op whose
implementation runs the user's forward graph and whose registered autograd formula runs the user's
backward graph on the values the forward saved. The op carries only tensors and sizes; the two
graphs live in a process-local table, keyed by an integer the graph holds.

For the sharding passes the op is opaque, except that a function whose forward and backward are
both elementwise (every ATen op pointwise, every output of the inputs' broadcast shape) is
token-local, like the pointwise ops it is made of (:attr:`CustomFunction.elementwise`).
"""

from __future__ import annotations

import itertools
import logging
import operator
from dataclasses import dataclass, replace
from typing import Any, Sequence

import torch
import torch.fx as fx
from torch.utils._python_dispatch import TorchDispatchMode

log = logging.getLogger(__name__)

autograd_function_apply = torch.ops.higher_order.autograd_function_apply


@dataclass(frozen=True)
class SavedValue:
    """Where one value the user's forward saved for backward comes from."""

    kind: str  # "tensor input" | "size input" | "new tensor" | "constant"
    index: int = 0  # into the op's tensors, its sizes, or its extra outputs
    constant: Any = None


@dataclass(frozen=True)
class CustomFunction:
    """One captured ``autograd.Function``: the user's two graphs and how to call them."""

    name: str
    forward: fx.GraphModule
    backward: fx.GraphModule
    argument_slots: tuple[tuple[str, int], ...]  # per forward argument: ("tensor" | "size", index)
    output_count: int  # tensor outputs of the user's forward
    output_is_tuple: bool
    saved: tuple[SavedValue, ...]
    elementwise: bool

    def arguments(self, tensors: Sequence[torch.Tensor], sizes: Sequence[Any]) -> list[Any]:
        return [tensors[i] if kind == "tensor" else sizes[i] for kind, i in self.argument_slots]

    def run_forward(self, tensors: Sequence[torch.Tensor], sizes: Sequence[Any]) -> list[torch.Tensor]:
        """The user's outputs, then the saved tensors the forward created (copies of aliases)."""
        with torch.set_grad_enabled(torch.is_grad_enabled()):  # the body toggles grad mode itself
            outputs, saved = fx.Interpreter(self.forward).run(*self.arguments(tensors, sizes))
        outputs = list(outputs) if isinstance(outputs, (tuple, list)) else [outputs]
        new = [saved[position] for position, value in enumerate(self.saved) if value.kind == "new tensor"]
        results = outputs + new
        # A custom op's outputs may not alias its inputs or each other.
        unique: list[torch.Tensor] = []
        for result in results:
            if any(torch._C._is_alias_of(result, other) for other in itertools.chain(tensors, unique)):
                result = result.clone()
            unique.append(result)
        return unique

    def run_backward(self, grads: Sequence[torch.Tensor | None], outputs: Sequence[torch.Tensor],
                     tensors: Sequence[torch.Tensor], sizes: Sequence[Any],
                     extra: Sequence[torch.Tensor]) -> list[Any]:
        # autograd.Function materializes the gradient of an unused output as zeros; so do we.
        grads = [g if g is not None else torch.zeros_like(o) for g, o in zip(grads, outputs)]
        saved = []
        for value in self.saved:
            if value.kind == "tensor input":
                saved.append(tensors[value.index])
            elif value.kind == "size input":
                saved.append(sizes[value.index])
            elif value.kind == "new tensor":
                saved.append(extra[value.index])
            else:
                saved.append(value.constant)
        with torch.set_grad_enabled(torch.is_grad_enabled()):
            return list(fx.Interpreter(self.backward).run(*grads, *saved))


_FUNCTIONS: dict[int, CustomFunction] = {}
_KEYS = itertools.count()


def function_of(key: int) -> CustomFunction:
    return _FUNCTIONS[key]


@torch.library.custom_op("dcp::custom_autograd_function", mutates_args=())
def custom_autograd_function(key: int, tensors: list[torch.Tensor], sizes: list[int]) -> list[torch.Tensor]:
    return _FUNCTIONS[key].run_forward(tensors, sizes)


@custom_autograd_function.register_fake
def _(key, tensors, sizes):
    return _FUNCTIONS[key].run_forward(tensors, sizes)


def _setup_context(ctx: Any, inputs: tuple[Any, ...], output: list[torch.Tensor]) -> None:
    key, tensors, sizes = inputs
    function = _FUNCTIONS[key]
    ctx.key, ctx.sizes = key, list(sizes)
    ctx.tensor_count = len(tensors)
    ctx.output_shapes = [(o.shape, o.dtype, o.device) for o in output[: function.output_count]]
    ctx.save_for_backward(*tensors, *output[function.output_count:])


def _backward(ctx: Any, grads: list[torch.Tensor | None]) -> tuple[None, list[torch.Tensor | None], None]:
    function = _FUNCTIONS[ctx.key]
    stored = ctx.saved_tensors
    tensors, extra = stored[: ctx.tensor_count], stored[ctx.tensor_count:]
    outputs = [torch.empty(shape, dtype=dtype, device=device) for shape, dtype, device in ctx.output_shapes]
    input_grads = function.run_backward(grads[: function.output_count], outputs, tensors, ctx.sizes, extra)
    tensor_grads: list[torch.Tensor | None] = [None] * ctx.tensor_count
    for (kind, index), grad in zip(function.argument_slots, input_grads):
        if kind == "tensor":
            tensor_grads[index] = grad
    return None, tensor_grads, None


custom_autograd_function.register_autograd(_backward, setup_context=_setup_context)


class NotCapturable(Exception):
    """This ``autograd.Function`` call has a shape the op does not express (the reason says which)."""


def _example(value: Any) -> Any:
    return value.meta.get("example_value", value.meta.get("val")) if isinstance(value, fx.Node) else value


def _describe(gm: fx.GraphModule, node: fx.Node) -> CustomFunction:
    forward: fx.GraphModule = getattr(gm, node.args[0].target)
    backward: fx.GraphModule = getattr(gm, node.args[1].target)
    if node.kwargs.get("dirty_idx"):
        raise NotCapturable("it modifies an input in place (ctx.mark_dirty)")
    slots: list[tuple[str, int]] = []
    tensor_count = size_count = 0
    for argument in node.args[2:]:
        example = _example(argument)
        if isinstance(example, torch.Tensor):
            slots.append(("tensor", tensor_count))
            tensor_count += 1
        elif isinstance(example, (int, torch.SymInt)) and not isinstance(example, bool):
            slots.append(("size", size_count))
            size_count += 1
        else:
            raise NotCapturable(f"an argument of type {type(example).__name__}")
    placeholders = forward.graph.find_nodes(op="placeholder")
    (returned,) = forward.graph.find_nodes(op="output")[0].args
    outputs, saved_nodes = returned
    output_is_tuple = isinstance(outputs, (tuple, list))
    output_list = list(outputs) if output_is_tuple else [outputs]
    for output in output_list:
        if not isinstance(output, fx.Node) or not isinstance(_example(output), torch.Tensor):
            raise NotCapturable("its forward returns a value that is not a tensor")
    saved: list[SavedValue] = []
    new_tensors = 0
    for value in saved_nodes:
        if isinstance(value, fx.Node) and value.op == "placeholder":
            kind, index = slots[placeholders.index(value)]
            saved.append(SavedValue("tensor input" if kind == "tensor" else "size input", index))
        elif isinstance(value, fx.Node) and isinstance(_example(value), torch.Tensor):
            saved.append(SavedValue("new tensor", new_tensors))
            new_tensors += 1
        elif not isinstance(value, fx.Node):
            saved.append(SavedValue("constant", constant=value))
        else:
            raise NotCapturable("it saves a size computed inside its forward")
    return CustomFunction(
        name=_function_name(node),
        forward=forward,
        backward=backward,
        argument_slots=tuple(slots),
        output_count=len(output_list),
        output_is_tuple=output_is_tuple,
        saved=tuple(saved),
        elementwise=False,
    )


def _function_name(node: fx.Node) -> str:
    stack = node.meta.get("stack_trace") or ""
    last = [line.strip() for line in stack.strip().splitlines() if line.strip()][-1:] or ["autograd.Function"]
    return last[0]


_ELEMENTWISE_EXTRA = {
    torch.ops.aten._to_copy.default,
    torch.ops.aten.clone.default,
    torch.ops.aten.alias.default,
    torch.ops.aten.empty_like.default,
    torch.ops.aten.zeros_like.default,
    torch.ops.aten.detach.default,
}


class _OpRecorder(TorchDispatchMode):
    """Notes every ATen op that runs under it."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: set[Any] = set()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.ops.add(func)
        return func(*args, **(kwargs or {}))


def _is_elementwise(function: CustomFunction, tensors: Sequence[Any], sizes: Sequence[Any], fake_mode: Any) -> bool:
    """Every ATen op of the forward and backward is pointwise and every output has the inputs'
    broadcast shape: then the function commutes with cutting the sequence into chunks."""
    if not tensors:
        return False
    recorder = _OpRecorder()
    fake_mode = getattr(tensors[0], "fake_mode", fake_mode)  # dynamo's own, which made the examples
    try:
        shape = torch.broadcast_shapes(*(t.shape for t in tensors))
        with fake_mode, recorder:
            outputs = function.run_forward(tensors, sizes)
            user_outputs, extra = outputs[: function.output_count], outputs[function.output_count:]
            function.run_backward([torch.empty_like(o) for o in user_outputs], user_outputs, tensors, sizes, extra)
    except Exception as error:  # noqa: BLE001 - a function we cannot analyse is simply not elementwise
        log.debug("dcp: custom autograd.Function %s not analysed: %s", function.name, error)
        return False
    if any(o.shape != shape for o in outputs):
        return False
    return all(
        torch.Tag.pointwise in op.tags or op in _ELEMENTWISE_EXTRA
        for op in recorder.ops
        if isinstance(op, torch._ops.OpOverload)
    )


def capture_custom_autograd_functions(gm: fx.GraphModule, fake_mode: Any) -> int:
    """Replace each ``autograd_function_apply`` of dynamo's graph by ``dcp::custom_autograd_function``.

    Returns how many were replaced. A call the op cannot express is left as it is, with a warning
    that its backward will be the derivative of its forward.
    """
    replaced = 0
    for node in list(gm.graph.find_nodes(op="call_function", target=autograd_function_apply)):
        try:
            function = _describe(gm, node)
        except NotCapturable as reason:
            log.warning(
                "dcp: the custom autograd.Function at %s cannot keep its own backward (%s): gradients "
                "through it are the derivative of its forward, which differs from eager if its backward "
                "is not that derivative", _function_name(node), reason,
            )
            continue
        arguments = node.args[2:]
        tensor_args = [a for a, (kind, _) in zip(arguments, function.argument_slots) if kind == "tensor"]
        size_args = [a for a, (kind, _) in zip(arguments, function.argument_slots) if kind == "size"]
        examples = [_example(a) for a in tensor_args]
        function = replace(function, elementwise=_is_elementwise(
            function, examples, [_example(a) for a in size_args], fake_mode))
        key = next(_KEYS)
        _FUNCTIONS[key] = function
        with gm.graph.inserting_before(node):
            call = gm.graph.call_function(custom_autograd_function._opoverload, (key, tensor_args, size_args))
            call.meta = dict(node.meta)
            results = [gm.graph.call_function(operator.getitem, (call, i)) for i in range(function.output_count)]
        example = _example(node)
        examples_out = list(example) if isinstance(example, (tuple, list)) else [example]
        for result, value in zip(results, examples_out):
            result.meta["example_value"] = value
        if function.output_is_tuple:
            for user in list(node.users):
                if user.op == "call_function" and user.target is operator.getitem and isinstance(user.args[1], int):
                    user.replace_all_uses_with(results[user.args[1]])
                    gm.graph.erase_node(user)
            if node.users:
                with gm.graph.inserting_before(node):
                    packed = gm.graph.call_function(tuple, (results,))
                node.replace_all_uses_with(packed)
        else:
            node.replace_all_uses_with(results[0])
        gm.graph.erase_node(node)
        replaced += 1
    if replaced:
        gm.graph.eliminate_dead_code()
        gm.delete_all_unused_submodules()
        gm.recompile()
    return replaced
