"""Integer inputs that no tensor's size explains, compiled per value.

Why: a graph break can hand an ``int`` argument of the model to the next graph as a symbolic
input of its own (Hugging Face's ``logits_to_keep=0`` reaches the decoder's last graph as ``s55``
after a logging call breaks the graph). Nothing ties that symbol to the sequence length, so
``hidden[:, -logits_to_keep:]`` is a slice with an unknown start: the passes must gather the
sequence before it, on every call, although at the only value training uses (0) the slice is the
whole sequence. PyTorch itself specialises sizes of 0 and 1 for the same reason (their meaning
differs). Such an input is a setting, not a size: the backend analyses and compiles the graph once
per value it sees (the slice then starts at 0 and stays sharded), up to
:data:`SPECIALIZATION_LIMIT` values; past that, one symbolic graph serves the rest (with a warning,
since it may gather).

Only inputs whose symbols appear in no tensor input's shape are specialised: a symbolic batch size
or sequence length is the point of ``dynamic=True`` and never becomes a constant here.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
import torch.fx as fx

log = logging.getLogger(__name__)

SPECIALIZATION_LIMIT = 4


def _symbols(value: Any) -> set[Any]:
    if isinstance(value, torch.SymInt):
        return set(value.node.expr.free_symbols)
    return set()


def free_integer_inputs(fake_inputs: Sequence[Any]) -> tuple[int, ...]:
    """Positions of the symbolic ``int`` inputs whose symbols no tensor input's shape uses."""
    sized: set[Any] = set()
    for value in fake_inputs:
        if isinstance(value, torch.Tensor):
            for size in (*value.shape, *(value.stride() if value.layout == torch.strided else ())):
                sized |= _symbols(size)
    return tuple(index for index, value in enumerate(fake_inputs)
                 if isinstance(value, torch.SymInt) and _symbols(value) and not (_symbols(value) & sized))


def value_without_guard(value: Any) -> int:
    """An int argument's value: a SymInt's hint (no guard installed), else the int itself."""
    if isinstance(value, torch.SymInt):
        hint = value.node.hint
        if hint is None:
            raise ValueError(f"the integer input {value} has no example value to specialise on")
        return int(hint)
    return int(value)


def specialized_inputs(fake_inputs: Sequence[Any], positions: Sequence[int], values: Sequence[int]) -> list[Any]:
    """The fake inputs with the free integers replaced by their values (the tracer then folds them)."""
    inputs = list(fake_inputs)
    for position, value in zip(positions, values):
        inputs[position] = int(value)
    return inputs


@dataclass
class IntegerSpecializations:
    """What the backend returns for a graph with free integer inputs: one dispatcher per value.

    ``build(values)`` analyses and wraps the graph for those values (``None``: symbolic). Every
    rank of an SP group passes the same values (they come from the same batch and model), so all
    of them build the same specialisations in the same order.
    """

    positions: tuple[int, ...]
    names: tuple[str, ...]
    build: Callable[[tuple[int, ...] | None], Callable[..., Any]]
    limit: int = SPECIALIZATION_LIMIT
    dispatchers: dict[tuple[int, ...] | None, Callable[..., Any]] = field(default_factory=dict)

    def dispatcher_for(self, values: tuple[int, ...]) -> Callable[..., Any]:
        dispatcher = self.dispatchers.get(values)
        if dispatcher is not None:
            return dispatcher
        specialised = [key for key in self.dispatchers if key is not None]
        if len(specialised) >= self.limit:
            if None not in self.dispatchers:
                log.warning("dcp: the integer inputs %s took more than %d values (%s, ...): one symbolic graph "
                            "serves every further value; it may gather where a value would have let it shard",
                            ", ".join(self.names), self.limit, ", ".join(map(str, specialised[: self.limit])))
                self.dispatchers[None] = self.build(None)
            return self.dispatchers[None]
        log.info("dcp: compiling a graph for the integer inputs %s = %s", ", ".join(self.names), values)
        dispatcher = self.dispatchers[values] = self.build(values)
        return dispatcher

    def __call__(self, *args: Any) -> Any:
        values = tuple(int(args[position]) for position in self.positions)
        return self.dispatcher_for(values)(*args)


def input_names(gm: fx.GraphModule, positions: Sequence[int]) -> tuple[str, ...]:
    """The placeholders' names (dynamo's, e.g. ``L_logits_to_keep_``) for messages."""
    placeholders = list(gm.graph.find_nodes(op="placeholder"))
    return tuple(str(placeholders[position].target) for position in positions)
