"""The lowering registry: one function per ``Rewrite`` (and one for ``Role.ATTENTION``).

A lowering is ``(sharding, node) -> value``: it runs ``node`` on the rank's chunks in the
re-trace ``sharding`` (a ``ShardingInterpreter``) is making. Each is registered with
``@lowering(Rewrite.X)`` next to the others of its layout family, so ``grep -rn Rewrite.X``
lands on the rule that decides the rewrite and on the code that carries it out.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Union

import torch.fx as fx

from dcp_compile.compiler.passes.sequence_dims import Rewrite, Role

LoweringKey = Union[Rewrite, Role]
Lowering = Callable[[Any, fx.Node], Any]  # (ShardingInterpreter, node) -> the node's value on this rank
LOWERINGS: dict[LoweringKey, Lowering] = {}


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
