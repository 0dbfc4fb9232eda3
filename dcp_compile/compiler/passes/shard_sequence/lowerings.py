"""The lowering registry.

A lowering is ``(LoweringContext) -> Lowered`` (see ``lowering_context``): it runs one node on
this rank in the re-trace the interpreter is making, reading through the context and returning
what it produced, which the interpreter alone stores. Keys: a ``Rewrite`` (which the analysis decides), ``Role.ATTENTION``, or an
``OpForm`` (an op the interpreter's generic paths cannot run as they stand, picked from the node
itself on one ``Path``). Each is registered next to the others of its layout family, so
``grep -rn Rewrite.X`` lands on the rule that decides the rewrite and on the code that carries it out.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Union

import torch.fx as fx

from dcp_compile.compiler.passes.sequence_dims import Rewrite, Role
from dcp_compile.compiler.passes.shard_sequence.lowering_context import Lowered, LoweringContext, OpForm, Path


LoweringKey = Union[Rewrite, Role, OpForm]
Lowering = Callable[[LoweringContext], Lowered]
LOWERINGS: dict[LoweringKey, Lowering] = {}


@dataclass(frozen=True)
class FormRule:
    """When ``form`` applies to a node on ``path``."""

    form: OpForm
    path: Path
    when: Callable[[LoweringContext], bool]


FORM_RULES: list[FormRule] = []  # in registration order: the first that holds wins


def select_form(context: LoweringContext) -> OpForm | None:
    """The first registered ``OpForm`` of the context's path that applies to its node."""
    return next((rule.form for rule in FORM_RULES if rule.path is context.path and rule.when(context)), None)


class CannotShard(Exception):
    """The graph uses a pattern the sharding pass does not handle; it will run unsharded."""


class WriteRefused(Exception):
    """An in-place write the analysis kept on chunks has no chunked form in this trace.

    On a gathered copy the write would never reach the buffer's chunk, so the op alone cannot fall
    back; the sharding pass re-traces with the whole buffer up to its last write (``members``) on
    the full sequence instead, each member's inputs gathered with ``reason`` (default deny: a
    gather with a reason, never a compile error)."""

    def __init__(self, members: frozenset[fx.Node], reason: str) -> None:
        super().__init__(reason)
        self.members, self.reason = members, reason


@dataclass
class GatherRecord:
    """An all-gather of ``node`` before ``op``; every one says why (issue 24: never a silent gather)."""

    node: str
    op: str
    reason: str

    def __post_init__(self) -> None:
        if not self.reason.strip():
            raise ValueError(f"dcp: the all-gather of {self.node} before {self.op} has no reason; the sequence "
                             "analysis must give every gathered op one (a rule returned an empty reason)")

    def __str__(self) -> str:
        return f"all-gather of {self.node} before {self.op}: {self.reason}"


def lowering(key: LoweringKey) -> Callable[[Lowering], Lowering]:
    """Register ``function`` as the lowering of ``key``."""

    def register(function: Lowering) -> Lowering:
        if key in LOWERINGS:
            raise ValueError(f"two lowerings registered for {key!r}: {LOWERINGS[key].__name__} and {function.__name__}")
        LOWERINGS[key] = function
        return function

    return register


def op_form(form: OpForm, path: Path, when: Callable[[LoweringContext], bool]) -> Callable[[Lowering], Lowering]:
    """Register ``function`` as the lowering of ``form``, which applies on ``path`` where ``when`` holds."""

    def register(function: Lowering) -> Lowering:
        lowering(form)(function)
        FORM_RULES.append(FormRule(form, path, when))
        return function

    return register
