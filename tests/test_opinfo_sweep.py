"""The OpInfo sweep: every op of torch's OpInfo database, one dimension of its sample carried as the
sequence, compiled behind an attention at SP 2 on gloo ranks and compared with eager (outputs and
SP-summed gradients): at parity sharded, at parity with a gather whose reason is recorded, or
skipped with why (no float32 sample, random, a graph break or a failure of torch.compile itself,
no dimension the op accepts at another size), never silently wrong (issue 24).

This is how PyTorch tests DTensor's sharding rules (``test/distributed/tensor/test_dtensor_ops.py``
runs every OpInfo sample through DTensor); ``tests/opinfo_programs.py`` says how a sample carries
the sequence. The quick tier is a fixed set of ops of every kind; the slow tier sweeps the whole
database in shards and writes ``benchmarks/results/opinfo_sweep.md`` (``DCP_OPINFO_WRITE=1``).
"""

from __future__ import annotations

import collections
import os
import time

import pytest
import torch

from dcp_compile.testing.process_world import run_in_process_world

from opinfo_programs import select_cases, sweep_worker  # torch's OpInfo database needs expecttest (test extra)

QUICK_OPS = ["add", "mul", "sin", "sigmoid", "where", "clamp", "sum", "mean", "amax", "cumsum", "softmax",
             "nn.functional.layer_norm", "matmul", "cat", "stack", "roll", "flip", "sort", "index_select",
             "nn.functional.pad", "transpose", "reshape", "nn.functional.conv1d", "diff", "tril"]
SHARDS = 6
RESULTS = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "results", "opinfo_sweep.md")


def sweep(names: list[str] | None, per_op: int, batch: int, shard: tuple[int, int] | None = None) -> tuple[list, list]:
    cases, skips = select_cases(names, per_op=per_op, shard=shard)
    outcomes = run_in_process_world(sweep_worker, 2, cases, batch, timeout=60 * 60)[0] if cases else []
    return outcomes, skips


def wrong(outcomes: list[dict]) -> list[str]:
    return [f"{o['label']}: {o['detail']}" for o in outcomes if o["kind"] == "WRONG"]


def test_quick_opinfo_sweep():
    outcomes, skips = sweep(QUICK_OPS, per_op=1, batch=len(QUICK_OPS))
    assert not wrong(outcomes), "silently wrong at SP 2:\n" + "\n".join(wrong(outcomes))
    kinds = collections.Counter(o["kind"] for o in outcomes)
    assert len(outcomes) + len(skips) >= len(QUICK_OPS), (outcomes, skips)
    assert kinds["sharded"] >= 5 and kinds["gathered"] >= 3, kinds  # both paths were exercised
    assert all(o["detail"] for o in outcomes if o["kind"] == "gathered")  # every gather has its reason


@pytest.mark.slow
@pytest.mark.parametrize("shard", range(SHARDS))
def test_opinfo_sweep(shard):
    started = time.monotonic()
    outcomes, skips = sweep(None, per_op=2, batch=24, shard=(shard, SHARDS))
    if os.environ.get("DCP_OPINFO_WRITE"):
        write_shard(shard, outcomes, skips, time.monotonic() - started)
    assert not wrong(outcomes), "silently wrong at SP 2:\n" + "\n".join(wrong(outcomes))


def write_shard(shard: int, outcomes: list[dict], skips: list, seconds: float) -> None:
    """Each shard writes its rows beside the table; ``python tests/test_opinfo_sweep.py`` joins them."""
    import json

    path = f"{RESULTS}.shard{shard}.json"
    with open(path, "w") as handle:
        json.dump({"outcomes": outcomes, "skips": [s.__dict__ for s in skips], "seconds": seconds,
                   "torch": torch.__version__}, handle, indent=1)
