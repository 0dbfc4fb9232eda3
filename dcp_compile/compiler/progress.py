"""What a user sees while variants compile: one line per graph analysed and per variant compiled,
a heartbeat while one takes long, and a bar over a warm-up.

A first compile takes from seconds to minutes (one per SP size and recompute policy), and silence
that long looks like a hang. Each compiled variant is logged at INFO on this module's logger (so
``TORCH_LOGS="+dcp_compile"`` and the user's own logging config show it, with compile ids), and,
when no logging is set up to show INFO, also printed as one line on stderr, by rank 0 only (every
rank compiles the same variants, so N copies would say nothing more). While one graph's analysis or
one variant's compile runs longer than :data:`HEARTBEAT_SECONDS`, a timer thread adds a line every
:data:`HEARTBEAT_SECONDS` with the time so far and the stage it is in (variant passes, AOTAutograd's
trace, Inductor's forward or backward), the same way. ``DCP_PROGRESS=0`` silences the prints, the
heartbeat and the bar; the log records stay.

Under ``options={"regions": True}`` a variant's own compile only cuts its graph: its regions
compile at its first call, and may take most of the time. Its line is logged after that call,
with the regions it compiled, their time and the regions it found compiled already; the first
call beats meanwhile, naming the region that compiles.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

from dcp_compile.compiler.record import RegionCompiles

log = logging.getLogger(__name__)
T = TypeVar("T")

_active_bar: Any = None  # the warm-up's tqdm bar while one is drawn: lines go above it, not through it
HEARTBEAT_SECONDS = 10.0  # a compile silent this long gets a line, and another every as long again


@dataclass(frozen=True)
class AnalysedGraph:
    """One graph traced to ATen and analysed (attention found, sequence dimensions classified):
    done once per graph before any variant compiles, and often the longest silent part."""

    graph_id: int
    attention_sites: int
    seconds: float

    def line(self) -> str:
        return f"dcp: analysed graph {self.graph_id} ({self.attention_sites} attention sites) in {self.seconds:.1f}s"


@dataclass(frozen=True)
class NewGraph:
    """Why dynamo handed over another graph of a function compiled before (a micro-batch of 1
    sample: Dynamo specialises sizes of 0 and 1), said before its analysis and variants compile."""

    graph_id: int
    why: str

    def line(self) -> str:
        return f"dcp: graph {self.graph_id} is {self.why}"


@dataclass(frozen=True)
class CompiledVariant:
    """One variant of one graph, compiled: what the progress line says."""

    graph_id: int
    variant: str
    seconds: float
    inner: str
    regions: RegionCompiles | None = None  # compiled in regions: what its first call compiled and reused

    def line(self) -> str:
        regions = f" (+ {self.regions})" if self.regions is not None else ""
        return (f"dcp: compiled graph {self.graph_id} variant {self.variant} in {self.seconds:.1f}s{regions} "
                f"({self.inner})")


@dataclass(frozen=True)
class RegionsCompiledAgain:
    """Regions a variant compiled after its first call: a region's guards failed (new shapes or
    strides), or a call under other grad modes; each compile costs as much as the first."""

    graph_id: int
    variant: str
    regions: RegionCompiles

    def line(self) -> str:
        return (f"dcp: graph {self.graph_id} variant {self.variant} compiled regions again: {self.regions} "
                "(the guards of their earlier compiles did not hold for this call's shapes, strides or grad mode)")


def _is_rank_zero() -> bool:
    import torch.distributed as dist

    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


def shows_progress() -> bool:
    """True on rank 0 unless ``DCP_PROGRESS=0``."""
    return os.environ.get("DCP_PROGRESS", "1") != "0" and _is_rank_zero()


@dataclass(frozen=True)
class StillCompiling:
    """A heartbeat: what is compiling, for how long so far, and in which stage."""

    what: str  # "graph 0 variant sp=2/recompute=none", "analysis of graph 0"
    seconds: float
    stage: str

    def line(self) -> str:
        return f"dcp: compiling {self.what}: {self.seconds:.0f}s so far ({self.stage})"


def report_compiled(event: CompiledVariant | AnalysedGraph | NewGraph | StillCompiling | RegionsCompiledAgain) -> None:
    """Log the line at INFO; print it too when logging would not show it (the default)."""
    log.info("%s", event.line())
    if (log.isEnabledFor(logging.INFO) and log.hasHandlers()) or not shows_progress():
        return
    if _active_bar is not None:
        _active_bar.write(event.line(), file=sys.stderr)
    else:
        print(event.line(), file=sys.stderr, flush=True)


class _Heartbeat:
    """A daemon thread that reports a compile still running every ``HEARTBEAT_SECONDS``."""

    def __init__(self, what: str, stage: str) -> None:
        self.what, self.stage = what, stage
        self.start = time.perf_counter()
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._beat, name="dcp-compile-heartbeat", daemon=True)

    def _beat(self) -> None:
        interval = HEARTBEAT_SECONDS
        while not self.done.wait(interval):
            report_compiled(StillCompiling(self.what, time.perf_counter() - self.start, self.stage))


_heartbeat: _Heartbeat | None = None  # the compile under way (compiles run one at a time, on one thread)


@contextmanager
def compiling(what: str, stage: str) -> Iterator[None]:
    """Beat while the body runs, if it outlasts ``HEARTBEAT_SECONDS``; nested, only names the stage.

    A backward that AOTAutograd compiles later, at the first backward call, opens its own.
    """
    global _heartbeat
    if _heartbeat is not None:
        with compile_stage(stage):
            yield
        return
    if not shows_progress():
        yield
        return
    beat = _heartbeat = _Heartbeat(what, stage)
    beat.thread.start()
    try:
        yield
    finally:
        beat.done.set()
        _heartbeat = None
        beat.thread.join(timeout=1.0)  # no beat after the body's own closing line


@contextmanager
def compile_stage(stage: str) -> Iterator[None]:
    """Name the stage the current compile is in (for its heartbeat), for the duration of the body."""
    beat = _heartbeat
    if beat is None:
        yield
        return
    previous, beat.stage = beat.stage, stage
    try:
        yield
    finally:
        beat.stage = previous


@contextmanager
def _bar(total: int, description: str) -> Iterator[Any]:
    global _active_bar
    from tqdm.auto import tqdm

    # Redrawn at every variant (mininterval=0): compiles are slow enough, and a fast warm-up
    # would otherwise never show its last count before the bar is cleared.
    bar = tqdm(total=total, desc=description, unit="variant", file=sys.stderr, disable=not shows_progress(),
               leave=False, mininterval=0)
    previous, _active_bar = _active_bar, (bar if not bar.disable else None)
    try:
        yield bar
    finally:
        _active_bar = previous
        bar.close()


def compile_progress(items: Iterable[T], description: str = "dcp: compiling variants") -> Iterator[T]:
    """Iterate ``items`` (the variants a warm-up compiles up front) under a progress bar on rank 0;
    each variant's line is printed above the bar."""
    items = list(items)
    with _bar(len(items), description) as bar:
        for item in items:
            yield item
            bar.update(1)
