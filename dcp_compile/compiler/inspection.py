"""``dcp.explain(model, *args, **kwargs)``: run the compiled model once and say what DCP did."""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Iterator

from dcp_compile.compiler.record import GraphRecord, ModelRecord

_collectors = threading.local()


def collecting_records() -> list[GraphRecord] | None:
    """The list ``explain`` is filling on this thread, or None outside ``explain``."""
    return getattr(_collectors, "records", None)


def snapshots_requested() -> bool:
    """Passes keep readable before/after graphs only while ``explain`` is collecting."""
    return collecting_records() is not None and getattr(_collectors, "snapshots", True)


@contextlib.contextmanager
def recording() -> Iterator[ModelRecord]:
    """Collect the records of the dcp graphs called inside the block (a training step), running
    nothing extra: what a training script prints after warm-up (``dcp.report.sharding_summary``), where
    ``explain`` would need one more forward. No before/after graph snapshots are kept."""
    record = ModelRecord()
    previous = (getattr(_collectors, "records", None), getattr(_collectors, "snapshots", True))
    _collectors.records, _collectors.snapshots = record.graphs, False
    try:
        yield record
    finally:
        _collectors.records, _collectors.snapshots = previous


def explain(model: Any, *args: Any, **kwargs: Any) -> ModelRecord:
    """Call ``model`` (compiled with ``backend="dcp"``) and return the records of the graphs it ran.

    The call compiles what is not compiled yet; no backward is run. The result prints
    as a readable report (attention sites, sequence dimensions, collectives, every gather with its
    reason, pass timings); ``record[i].variants[v].passes`` holds each pass's before/after graph
    for the variants this call compiled (``DCP_DEBUG_DIR`` keeps them for every compile).
    """
    if not hasattr(model, "_torchdynamo_orig_callable") and not hasattr(model, "dynamo_ctx"):
        raise TypeError(
            "dcp.explain needs the compiled model: pass torch.compile(model, backend='dcp', "
            "dynamic=True), not the original module"
        )
    records: list[GraphRecord] = []
    previous = (getattr(_collectors, "records", None), getattr(_collectors, "snapshots", True))
    _collectors.records, _collectors.snapshots = records, True
    try:
        model(*args, **kwargs)  # with grad mode as the caller has it: the same graphs as training
    finally:
        _collectors.records, _collectors.snapshots = previous
    if not records:
        raise RuntimeError(
            "dcp.explain: the call ran no graph compiled by the dcp backend; was the model "
            "compiled with torch.compile(..., backend='dcp')?"
        )
    return ModelRecord(records)
