"""The pass pipeline: which passes run, what each declares about itself, and their snapshots.

Modelled on torchtitan's pass runner: passes are ``(gm, ctx) -> gm`` functions, any of them can be
disabled by name (``options={"disable_passes": [...]}``). What the dispatcher and the runner need to
know about a pass (does it run at SP 1, does it return a new graph, does it add graph inputs, what
it needs from earlier passes and what it leaves for later ones) is declared here, in one
:class:`GraphPass` record per pass, instead of attributes on the functions. A ``disable_passes``
entry that names no pass, or whose pass leaves something a pass still enabled needs, is refused
before anything runs (:func:`check_disabled`), with the reason and the fix.

Snapshots (each pass's graph before and after, as readable code) cost a ``print_readable`` of the
whole graph per pass; they are taken only when someone will read them: ``dcp.explain``, a debug
directory (``DCP_DEBUG_DIR``), or the structured trace for tlparse.
"""

from __future__ import annotations

import logging
import os
import re
import time
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any, Callable, Sequence

import torch.fx as fx
from torch._logging import trace_structured
from torch._logging import _internal as torch_logging_internal

from dcp_compile.compiler.passes.context import PassContext
from dcp_compile.compiler.record import PassRecord

log = logging.getLogger(__name__)

PassFunction = Callable[[fx.GraphModule, PassContext], fx.GraphModule]


@dataclass(frozen=True)
class GraphInput:
    """A graph input a pass appends to the compiled graph's signature; the dispatcher passes
    ``provide()`` for it on every call (e.g. the active packed micro-batch's ``cu_seqlens``)."""

    name: str
    provide: Callable[[], Any]


class Product(Enum):
    """What a pass leaves for the passes after it."""

    ATTENTION_SITES = "the attention sites (ctx.analysis.attention_sites)"
    SEQUENCE_ANALYSIS = "the sequence analysis (ctx.analysis.sequence)"
    ATTENTION_MARKERS = "dcp::sharded_attention markers in the graph"
    LOWERED_ATTENTION = "the markers lowered to all-to-all + attention"


@dataclass(frozen=True)
class GraphPass:
    function: PassFunction
    runs_without_sharding: bool = False  # also runs for SP 1 variants
    returns_new_graph: bool = False  # re-traces: may run on the shared analysed graph
    adds_input: GraphInput | None = None  # appended when ``adds_input_when(ctx)`` holds
    adds_input_when: Callable[[PassContext], bool] | None = None
    requires: frozenset[Product] = frozenset()  # from an earlier pass
    provides: frozenset[Product] = frozenset()
    # What a later pass must provide for this pass's graph to run (markers someone must lower).
    obliges: frozenset[Product] = frozenset()

    @property
    def name(self) -> str:
        return self.function.__name__

    def added_input(self, ctx: PassContext) -> GraphInput | None:
        if self.adds_input is None or (self.adds_input_when is not None and not self.adds_input_when(ctx)):
            return None
        return self.adds_input

    def disabled_by(self, disabled: Sequence[str]) -> bool:
        """A pass is named in ``disable_passes`` with or without its ``_pass`` suffix."""
        return self.name in disabled or self.name.removesuffix("_pass") in disabled


def check_disabled(passes: Sequence[GraphPass], disabled: Sequence[str]) -> None:
    """Refuse a ``disable_passes`` list that names no pass of ``passes`` (the whole pipeline, in
    order) or that disables a pass whose product an enabled pass still needs."""
    names = {graph_pass.name for graph_pass in passes} | {graph_pass.name.removesuffix("_pass") for graph_pass in passes}
    unknown = [name for name in disabled if name not in names]
    if unknown:
        valid = ", ".join(graph_pass.name.removesuffix("_pass") for graph_pass in passes)
        raise ValueError(f"dcp: disable_passes names no pass: {unknown}; the passes are: {valid}")
    provided: dict[Product, str] = {}
    owed: dict[Product, str] = {}
    for graph_pass in passes:
        if graph_pass.disabled_by(disabled):
            continue
        missing = sorted(graph_pass.requires - set(provided), key=lambda product: product.name)
        if missing:
            makers = [other.name for other in passes if other.provides & set(missing)]
            raise ValueError(
                f"dcp: disable_passes {list(disabled)} leaves {graph_pass.name} without "
                f"{', '.join(product.value for product in missing)} (made by {', '.join(makers)}); "
                f"enable those again, or disable {graph_pass.name} as well")
        provided.update((product, graph_pass.name) for product in graph_pass.provides)
        owed.update((product, graph_pass.name) for product in graph_pass.obliges)
    for product, by in owed.items():
        if product not in provided:
            makers = [other.name for other in passes if product in other.provides]
            raise ValueError(
                f"dcp: disable_passes {list(disabled)} leaves the graph of {by} unfinished: nothing makes "
                f"{product.value} (made by {', '.join(makers)}); enable it again, or disable {by} as well")


def readable(gm: fx.GraphModule) -> str:
    return gm.print_readable(print_output=False, include_stride=False, include_device=False)


def _debug_path(debug_dir: str, graph_id: int, variant: str, index: int, name: str) -> Path:
    safe_variant = re.sub(r"[^A-Za-z0-9_.=-]+", "_", variant)
    return Path(debug_dir) / f"graph{graph_id}" / safe_variant / f"{index:02d}_{name}.py"


def structured_trace_enabled() -> bool:
    """True when ``TORCH_TRACE`` (tlparse's input) is being written."""
    handler = getattr(torch_logging_internal, "LOG_TRACE_HANDLER", None)
    return bool(os.environ.get("TORCH_TRACE")) or getattr(handler, "root_dir", None) is not None


def run_passes(
    gm: fx.GraphModule,
    ctx: PassContext,
    passes: Sequence[GraphPass],
    *,
    variant: str = "analysis",
    disabled: Sequence[str] = (),
    graph_id: int = 0,
    debug_dir: str | None = None,
    records: list[PassRecord] | None = None,
) -> fx.GraphModule:
    debug_dir = debug_dir or os.environ.get("DCP_DEBUG_DIR")
    tracing = structured_trace_enabled()
    snapshots = ctx.snapshots or bool(debug_dir) or tracing
    for index, graph_pass in enumerate(passes):
        name = graph_pass.name
        if graph_pass.disabled_by(disabled):
            log.info("dcp: pass %s disabled", name)
            continue
        before = readable(gm) if snapshots else None
        start = time.perf_counter()
        gm = graph_pass.function(gm, ctx)
        seconds = time.perf_counter() - start
        after = readable(gm) if snapshots else None
        if records is not None:
            records.append(PassRecord(name, variant, before, after, seconds))
        log.debug("dcp: %s [%s] took %.3fs", name, variant, seconds)
        if tracing:
            trace_structured(
                "artifact",
                metadata_fn=lambda: {"name": f"dcp_{name}_{variant}", "encoding": "string"},
                payload_fn=lambda after=after: after,
            )
        if debug_dir:
            path = _debug_path(debug_dir, graph_id, variant, index, name)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(f"# dcp pass {name}, variant {variant}, {seconds * 1000:.1f} ms\n{after}")
    return gm
