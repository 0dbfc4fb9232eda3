"""``dcp.explain(model, *args, **kwargs)``: run the compiled model once and say what DCP did."""

from __future__ import annotations

from typing import Any

from dcp_compile import dispatcher
from dcp_compile.record import ModelRecord


def explain(model: Any, *args: Any, **kwargs: Any) -> ModelRecord:
    """Call ``model`` (compiled with ``backend="dcp"``) and return the records of the graphs it ran.

    The call compiles what is not compiled yet; no backward is run. The result prints
    as a readable report (attention sites, sequence dimensions, collectives, every gather with its
    reason, pass timings); ``record[i].variants[v].passes`` holds each pass's before/after graph.
    """
    if not hasattr(model, "_torchdynamo_orig_callable") and not hasattr(model, "dynamo_ctx"):
        raise TypeError(
            "dcp.explain needs the compiled model: pass torch.compile(model, backend='dcp', "
            "dynamic=True), not the original module"
        )
    records: list = []
    previous = getattr(dispatcher._collectors, "records", None)
    dispatcher._collectors.records = records
    try:
        model(*args, **kwargs)  # with grad mode as the caller has it: the same graphs as training
    finally:
        dispatcher._collectors.records = previous
    if not records:
        raise RuntimeError(
            "dcp.explain: the call ran no graph compiled by the dcp backend; was the model "
            "compiled with torch.compile(..., backend='dcp')?"
        )
    return ModelRecord(records)
