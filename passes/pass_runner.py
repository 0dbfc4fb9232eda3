"""Run passes in order, keeping each one's before/after graph on the compile record.

Modelled on torchtitan's pass runner: passes are ``(gm, ctx) -> gm`` functions, any of them can be
disabled by name (``options={"disable_passes": [...]}``), and every pass leaves a snapshot: on the
record, in ``DCP_DEBUG_DIR`` as readable code, and in ``torch._logging.trace_structured`` for tlparse.
"""

from __future__ import annotations

import logging
import os
import re
import time
from pathlib import Path
from typing import Callable, Sequence

import torch.fx as fx
from torch._logging import trace_structured

from dcp_compile.passes.context import PassContext
from dcp_compile.record import PassRecord

log = logging.getLogger(__name__)

GraphPass = Callable[[fx.GraphModule, PassContext], fx.GraphModule]


def readable(gm: fx.GraphModule) -> str:
    return gm.print_readable(print_output=False, include_stride=False, include_device=False)


def _debug_path(debug_dir: str, graph_id: int, variant: str, index: int, name: str) -> Path:
    safe_variant = re.sub(r"[^A-Za-z0-9_.=-]+", "_", variant)
    return Path(debug_dir) / f"graph{graph_id}" / safe_variant / f"{index:02d}_{name}.py"


def is_disabled(graph_pass: GraphPass, disabled: Sequence[str]) -> bool:
    """A pass is named in ``disable_passes`` with or without its ``_pass`` suffix."""
    name = graph_pass.__name__
    return name in disabled or name.removesuffix("_pass") in disabled


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
    for index, graph_pass in enumerate(passes):
        name = graph_pass.__name__
        if is_disabled(graph_pass, disabled):
            log.info("dcp: pass %s disabled", name)
            continue
        before = readable(gm)
        start = time.perf_counter()
        gm = graph_pass(gm, ctx)
        seconds = time.perf_counter() - start
        after = readable(gm)
        record = PassRecord(name, variant, before, after, seconds)
        if records is not None:
            records.append(record)
        log.debug("dcp: %s [%s] took %.3fs", name, variant, seconds)
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
