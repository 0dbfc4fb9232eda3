"""Integer inputs that no tensor's size explains, compiled per value when that value is 0 or 1.

Why: a graph break can hand an ``int`` argument of the model to the next graph as a symbolic
input of its own (Hugging Face's ``logits_to_keep=0`` reaches the decoder's last graph as ``s55``
after a logging call breaks the graph). Nothing ties that symbol to the sequence length, so
``hidden[:, -logits_to_keep:]`` is a slice with an unknown start: the passes must gather the
sequence before it, on every call, although at the only value training uses (0) the slice is the
whole sequence. PyTorch specialises sizes of 0 and 1 for the same reason: their meaning differs
(``-0`` is the start, a size of 1 broadcasts). The backend does the same for these inputs: a 0 or
a 1 is baked into a graph of its own (analysed and compiled for it), any other value stays
symbolic, so data-dependent ints (a caption length, a frame count passed as an ``int``) never
cause a compile per value. At most :data:`SPECIALIZATION_LIMIT` graphs per dynamo graph.

Only inputs whose symbols appear in no tensor input's shape are considered: a symbolic batch size
or sequence length is the point of ``dynamic=True`` and never becomes a constant here.

Covers: Dynamo on torch 2.13.0 handing an ``int`` argument across a graph break as a free symbolic
input that no tensor size explains (no upstream issue filed).
Test: tests/test_free_integers.py (``logits_to_keep=0`` compiled per value, sharded, at parity).
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


SPECIALIZED_VALUES = (0, 1)

Key = tuple  # per free input: its value if it is baked in (0 or 1), else None (symbolic)


def key_of(values: Sequence[int]) -> Key:
    return tuple(value if value in SPECIALIZED_VALUES else None for value in values)


def specialized_inputs(fake_inputs: Sequence[Any], positions: Sequence[int], key: Key) -> list[Any]:
    """The fake inputs with the baked free integers replaced by their values (the tracer folds them)."""
    inputs = list(fake_inputs)
    for position, value in zip(positions, key):
        if value is not None:
            inputs[position] = int(value)
    return inputs


@dataclass
class IntegerSpecializations:
    """What the backend returns for a graph with free integer inputs: one dispatcher per key.

    ``build(key)`` analyses and wraps the graph with the key's 0s and 1s baked in (an all-None
    key: the symbolic graph). Every rank of an SP group passes the same values (they come from the
    same batch and model), so all of them build the same graphs in the same order.
    """

    positions: tuple[int, ...]
    names: tuple[str, ...]
    build: Callable[[Key], Callable[..., Any]]
    limit: int = SPECIALIZATION_LIMIT
    dispatchers: dict[Key, Callable[..., Any]] = field(default_factory=dict)

    def dispatcher_for(self, values: Sequence[int]) -> Callable[..., Any]:
        key = key_of(values)
        dispatcher = self.dispatchers.get(key)
        if dispatcher is not None:
            return dispatcher
        symbolic = tuple(None for _ in self.positions)
        if key != symbolic and len([k for k in self.dispatchers if k != symbolic]) >= self.limit:
            if symbolic not in self.dispatchers:
                log.warning("dcp: the integer inputs %s took more than %d combinations of 0/1 values: one symbolic "
                            "graph serves the rest; it may gather where a value would have let it shard",
                            ", ".join(self.names), self.limit)
            key = symbolic
            if key in self.dispatchers:
                return self.dispatchers[key]
        if key != symbolic:
            log.info("dcp: compiling a graph for the integer inputs %s", describe(self.names, key))
        dispatcher = self.dispatchers[key] = self.build(key)
        return dispatcher

    def __call__(self, *args: Any) -> Any:
        return self.dispatcher_for([int(args[position]) for position in self.positions])(*args)


def describe(names: Sequence[str], key: Key) -> str | None:
    """``L_logits_to_keep_=0`` for the baked inputs of ``key`` (None if none is baked)."""
    baked = [f"{name}={value}" for name, value in zip(names, key) if value is not None]
    return ", ".join(baked) or None


def input_names(gm: fx.GraphModule, positions: Sequence[int]) -> tuple[str, ...]:
    """The placeholders' names (dynamo's, e.g. ``L_logits_to_keep_``) for messages."""
    placeholders = list(gm.graph.find_nodes(op="placeholder"))
    return tuple(str(placeholders[position].target) for position in positions)
