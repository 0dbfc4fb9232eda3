"""Why dynamo hands the backend another graph of a function it compiled before, when the answer is
a size of 0 or 1.

Dynamo specialises every dimension of size 0 or 1, even under ``dynamic=True`` and
``torch._dynamo.mark_dynamic``: after graphs with a symbolic batch, a micro-batch of 1 sample is a
new trace and a new graph, whose variants (and regions: the 1 is a constant in their code) compile
once more. Without a word, that looked like dcp recompiling for nothing. The backend sees only the
graph, so it keeps, per dynamo frame, the sizes of the inputs of each graph it was handed since the
frame's first compile, and names the dimensions that were symbolic in an earlier graph and are 0 or
1 in this one (or the reverse: an earlier graph was specialised to 1 and this one is symbolic).

Covers: Dynamo on torch 2.13.0 specialising every dimension of size 0 or 1, even under
``dynamic=True`` and ``mark_dynamic`` (its documented 0/1 specialisation; no upstream issue filed):
this module says why the new graph came, it does not avoid it.
Test: tests/test_progress.py (``test_a_micro_batch_of_one_sample_says_why_it_is_a_new_graph``).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx

Size = int | str  # a static size, or the symbolic size's expression
SPECIALISED = (0, 1)  # the sizes Dynamo never keeps symbolic


@dataclass(frozen=True)
class EarlierGraph:
    """A graph compiled for the same dynamo frame: its id, its inputs' sizes, its sequence symbols."""

    graph_id: int
    sizes: dict[str, tuple[Size, ...]]  # tensor input (dynamo's source name) -> sizes
    sequence_symbols: frozenset[str]


@dataclass(frozen=True)
class SpecialisedDimension:
    """One dimension that is a constant 0 or 1 in one graph and symbolic in the other."""

    source: str
    dim: int
    size: int  # 0 or 1, in whichever graph has the constant
    symbol: str  # the size in the other graph
    constant_now: bool  # the new graph has the constant (a micro-batch of 1 after larger ones)
    is_sequence: bool  # the new constant replaced (part of) the earlier graph's attention length

    def what(self) -> str:
        if self.is_sequence:
            return f"a sequence of {self.size} token{'s' if self.size != 1 else ''}"
        if self.dim == 0:
            return f"a micro-batch of {self.size} sample{'s' if self.size != 1 else ''}"
        return f"a dimension of size {self.size}"

    def where(self, earlier_graph: int) -> str:
        earlier = self.symbol if self.constant_now else self.size
        return f"{readable_source(self.source)} dim {self.dim}, {earlier} in graph {earlier_graph}"


_frames: dict[int, list[EarlierGraph]] = {}  # dynamo frame id -> graphs compiled since its first compile


def readable_source(source: str) -> str:
    """``L['input_ids']`` (or ``L['kwargs']['input_ids']``) as ``input_ids``; another source as dynamo
    writes it."""
    keys = re.fullmatch(r"L(?:\['\w+'\])+", source) and re.findall(r"\['(\w+)'\]", source)
    return keys[-1] if keys else source


def frame_compile(gm: fx.GraphModule) -> tuple[int, int] | None:
    """(frame id, compile of that frame) dynamo gave this graph, or None outside dynamo."""
    compile_id = gm.meta.get("dynamo_compile_id") if hasattr(gm, "meta") else None
    if compile_id is None or compile_id.frame_id is None:
        return None
    return compile_id.frame_id, compile_id.frame_compile_id


def input_sizes(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> dict[str, tuple[Size, ...]]:
    """Each tensor input's sizes (an int, or the symbol's expression), by dynamo's source name: the
    traced (fake) value's, whose sizes are symbols where the graph is dynamic; ``example_inputs``
    are the real tensors."""
    sizes: dict[str, tuple[Size, ...]] = {}
    for node, real in zip(gm.graph.find_nodes(op="placeholder"), example_inputs):
        value = node.meta.get("example_value", real)
        source = getattr(node.meta.get("grapharg"), "source", None)
        if source is None or not isinstance(value, torch.Tensor) or isinstance(real, torch.nn.Parameter):
            continue  # parameters: static sizes, and many of them
        name = source.name() if callable(source.name) else source.name
        sizes[name] = tuple(str(size.node.expr) if isinstance(size, torch.SymInt) else int(size)
                            for size in value.shape)
    return sizes


def specialised_dimensions(now: dict[str, tuple[Size, ...]], earlier: EarlierGraph) -> list[SpecialisedDimension]:
    """Dimensions that are 0 or 1 in one graph and symbolic in the other, one per distinct symbol
    (a batch of 1 shows in every input that has the batch: the first names it)."""
    found: dict[tuple[int, str], SpecialisedDimension] = {}
    for source, sizes in now.items():
        before = earlier.sizes.get(source)
        if before is None or len(before) != len(sizes):
            continue
        for dim, (old, new) in enumerate(zip(before, sizes)):
            if isinstance(old, str) and new in SPECIALISED:
                size, symbol, constant_now = int(new), old, True
            elif isinstance(new, str) and old in SPECIALISED:
                size, symbol, constant_now = int(old), new, False
            else:
                continue
            is_sequence = constant_now and symbol in earlier.sequence_symbols
            found.setdefault((size, symbol), SpecialisedDimension(source, dim, size, symbol, constant_now, is_sequence))
    return list(found.values())


def new_graph_reason(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> str | None:
    """Why dynamo handed over this graph although it compiled the same function before, or None
    for a function's first graph (the sizes are kept for its next ones by ``remember``)."""
    frame = frame_compile(gm)
    if frame is None:
        return None
    frame_id, compile_number = frame
    if compile_number == 0:  # a frame's first compile (ids restart after torch._dynamo.reset())
        _frames[frame_id] = []
        return None
    earlier_graphs = _frames.get(frame_id, [])
    if not earlier_graphs:
        return None
    now = input_sizes(gm, example_inputs)
    for earlier in reversed(earlier_graphs):
        dimensions = specialised_dimensions(now, earlier)
        if dimensions:
            return describe(dimensions, earlier.graph_id)
    return (f"a new graph for the function of graph {earlier_graphs[-1].graph_id}: dynamo compiled it again "
            "(TORCH_LOGS=recompiles says which of its guards failed)")


def describe(dimensions: list[SpecialisedDimension], earlier: int) -> str:
    """The reason as a user reads it: what the batch is, what Dynamo did, what runs which graph."""
    first = dimensions[0]
    specialises = (f"Dynamo specialises a dimension of size {first.size} "
                   f"({'; '.join(d.where(earlier) for d in dimensions)})")
    if first.constant_now:
        return (f"a new graph for {first.what()}: {specialises}; its variants compile once more, other sizes "
                f"keep running graph {earlier}")
    return (f"a new graph for sizes other than {first.size}: graph {earlier} was traced for {first.what()} "
            f"and {specialises}; its variants compile once more, {first.what()} keeps running graph {earlier}")


def remember(gm: fx.GraphModule, example_inputs: Sequence[Any], graph_id: int, sequence_length: Any) -> None:
    """Keep this graph's input sizes for the frame's next graphs to be compared with."""
    frame = frame_compile(gm)
    if frame is None:
        return
    symbols = frozenset(str(symbol) for symbol in getattr(sequence_length, "free_symbols", ()))
    _frames.setdefault(frame[0], []).append(EarlierGraph(graph_id, input_sizes(gm, example_inputs), symbols))

