"""The OpInfo sweep: every op of torch's OpInfo database, one dimension of its sample carried as the
sequence, compiled behind an attention at SP 2 on gloo ranks and compared with eager (outputs and
SP-summed gradients): at parity sharded, at parity with a gather whose reason is recorded, or
skipped with why (no float32 sample, random, a graph break or a failure of torch.compile itself,
no dimension the op accepts at another size), never silently wrong (issue 24).

This is how PyTorch tests DTensor's sharding rules (``test/distributed/tensor/test_dtensor_ops.py``
runs every OpInfo sample through DTensor); ``tests/opinfo_programs.py`` says how a sample carries
the sequence. The quick tier is a fixed set of ops of every kind; the slow tier sweeps the whole
database in shards (``DCP_OPINFO_LOG`` keeps a line per op as it is checked; ``python
tests/test_opinfo_sweep.py LOG...`` writes ``benchmarks/results/opinfo_sweep.md``).

First full run (2026-12-04, one case per op, SP 2; the table has every row): all 702 op_db entries
classified: 231 sharded, 308 gathered with a reason (one, ``nn.functional.embedding`` with a
sequence-indexed table, gathered with an empty reason: marked, a failure for the slow tier), 38
replicated (their graph had no attention), 121 skipped with why, 4 raising in dcp ("Invalid scalar type"
on int16/complex outputs, likely gloo's collectives); one silently wrong (``masked.mean``, fixed) and two
raising (``view_as``/``reshape_as``, fixed) are quick-tier regressions now. One process crashed once
with glibc's "corrupted double-linked list" while probing shard 3's ops (not reproduced alone).
Rerun of every op not skipped (2026-12-05, ``DCP_OPINFO_OPS``) after the decomposition and spatial
rules: 326 sharded, 213 gathered (each with its reason), 38 replicated, 4 raising, 0 silently wrong;
95 ops moved from gathered to sharded, none the other way.
"""

from __future__ import annotations

import collections
import json
import os
import time

import pytest
import torch

from dcp_compile.testing.process_world import run_in_process_world

from opinfo_programs import NO_REASON, select_cases, sweep_worker  # torch's OpInfo database needs expecttest (test extra)

# The quick tier: ops of every kind (elementwise, broadcast, reductions, scans, matmul, joins,
# shifts, sorts, norms), one graph on one 2-rank world.
QUICK_OPS = ["add", "sin", "where", "sum", "amax", "cumsum", "softmax", "matmul", "cat", "roll", "sort",
             "nn.functional.layer_norm"]
# Ops the full sweep once found silently wrong, checked in the quick tier.
REGRESSIONS = [
    "masked.mean",  # a sample with -inf entries: the sum rewrite's zero-valued gradient term was inf - inf = NaN
    "view_as", "reshape_as",  # raised on the ranks (view_as(chunk, [sizes])), then gathered the template without a reason
]
# Token-local only through their decomposition (decomposition_rules): stay sharded. ``tril``'s
# sample carries a matrix dimension: its decomposition reads positions, so it stays gathered.
DECOMPOSED = ["rsub", "nn.functional.prelu"]
READS_POSITIONS = ["tril"]
# A table indexed by the sequence: once gathered with an empty reason, now with its own.
EMBEDDING = ["nn.functional.embedding"]
SHARDS = 6
RESULTS = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "results", "opinfo_sweep.md")


def sweep(names: list[str] | None, per_op: int, batch: int, shard: tuple[int, int] | None = None) -> tuple[list, list]:
    cases, skips = select_cases(names, per_op=per_op, shard=shard)
    if os.environ.get("DCP_OPINFO_LOG"):
        with open(os.environ["DCP_OPINFO_LOG"], "a") as log:
            log.writelines(json.dumps({"name": s.name, "label": s.name, "kind": "skipped", "detail": s.why}) + "\n"
                           for s in skips)
    outcomes = run_in_process_world(sweep_worker, 2, cases, batch, timeout=60 * 60)[0] if cases else []
    return outcomes, skips


def wrong(outcomes: list[dict]) -> list[str]:
    """Silently wrong cases, and gathers with no reason (the issue asks for a reason on every one)."""
    return [f"{o['label']}: {o['detail']}" for o in outcomes if o["kind"] == "WRONG" or NO_REASON in o["detail"]]


@pytest.mark.slow
def test_quick_opinfo_sweep():
    names = QUICK_OPS + REGRESSIONS + DECOMPOSED + READS_POSITIONS + EMBEDDING
    outcomes, skips = sweep(names, per_op=1, batch=len(names))
    assert {o["name"] for o in outcomes} >= set(REGRESSIONS + DECOMPOSED + READS_POSITIONS + EMBEDDING), outcomes
    kind_of = {o["name"]: o for o in outcomes}
    assert all(kind_of[name]["kind"] == "sharded" for name in DECOMPOSED), [kind_of[n] for n in DECOMPOSED]
    assert all(kind_of[name]["kind"] == "gathered" and "reads the sequence length" in kind_of[name]["detail"]
               for name in READS_POSITIONS), [kind_of[n] for n in READS_POSITIONS]
    assert all(kind_of[name]["kind"] == "gathered" and "sequence-indexed table" in kind_of[name]["detail"]
               for name in EMBEDDING), [kind_of[n] for n in EMBEDDING]
    assert not wrong(outcomes), "silently wrong at SP 2:\n" + "\n".join(wrong(outcomes))
    kinds = collections.Counter(o["kind"] for o in outcomes)
    assert len(outcomes) + len(skips) >= len(names), (outcomes, skips)
    assert kinds["sharded"] >= 4 and kinds["gathered"] >= 4, kinds  # both paths were exercised
    assert all(o["detail"] for o in outcomes if o["kind"] == "gathered")  # every gather has its reason
    assert not [o for o in outcomes if NO_REASON in o["detail"] or o["kind"] == "raises"], outcomes


@pytest.mark.slow
@pytest.mark.parametrize("shard", range(SHARDS))
def test_opinfo_sweep(shard):
    started = time.monotonic()
    per_op = int(os.environ.get("DCP_OPINFO_CASES_PER_OP", "2"))  # dimensions tried per op
    # DCP_OPINFO_OPS=a,b,...: only these ops (by op_db name, variant included), to rerun the
    # rows a change touches; the table then overlays their log on the full run's.
    names = [name for name in os.environ.get("DCP_OPINFO_OPS", "").split(",") if name] or None
    outcomes, skips = sweep(names, per_op=per_op, batch=24, shard=(shard, SHARDS))
    if os.environ.get("DCP_OPINFO_WRITE"):
        write_shard(shard, outcomes, skips, time.monotonic() - started)
    assert not wrong(outcomes), "silently wrong at SP 2:\n" + "\n".join(wrong(outcomes))


def write_shard(shard: int, outcomes: list[dict], skips: list, seconds: float) -> None:
    """Each shard writes its rows beside the table; ``python tests/test_opinfo_sweep.py`` joins them."""
    path = f"{RESULTS}.shard{shard}.json"
    with open(path, "w") as handle:
        json.dump({"outcomes": outcomes, "skips": [s.__dict__ for s in skips], "seconds": seconds,
                   "torch": torch.__version__}, handle, indent=1)


def write_table(rows: list[dict], path: str, note: str) -> None:
    """The classification table: one row per op case (or skipped op), the WRONG ones first."""
    for row in rows:  # a gather recorded with an empty reason (a run before NO_REASON was marked)
        if any(gather.rstrip().endswith(":") for gather in row.get("gathers", [])) and NO_REASON not in row["detail"]:
            row["detail"] = f"{row['detail'].rstrip()} {NO_REASON}"
    kinds = collections.Counter(row["kind"] for row in rows)
    order = {"WRONG": 0, "raises": 1, "replicated": 2, "gathered": 3, "sharded": 4, "skipped": 5}
    lines = ["# OpInfo sweep at SP 2", "",
             f"Measured on CPU, torch {torch.__version__}, 2 gloo ranks, `tests/test_opinfo_sweep.py` "
             "(`python -m pytest -m slow tests/test_opinfo_sweep.py` with `DCP_OPINFO_LOG=run.jsonl`, then "
             "`python tests/test_opinfo_sweep.py run.jsonl` makes this table). " + note, "",
             "Every op of torch's OpInfo database (`op_db`): its float32 sample, one dimension of its first float "
             "tensor (and of every float argument of the same shape) carried as the sequence of an attention "
             "(the sample tiled to the run's length plus a per-token projection of the attention's output), "
             "compiled with `backend=\"dcp\"` and compared with eager at lengths 13 and 22: outputs and the "
             "SP-summed gradients of the projections (which run through the op's backward).", "",
             "- **sharded**: at parity, the op ran on the rank's chunk (no gather in it)",
             "- **gathered**: at parity, the sequence was gathered before the op; the reason is the record's",
             "- **replicated**: at parity, the whole variant fell back to running unsharded (the reason)",
             "- **raises**: dcp raised (loud, not wrong); **WRONG**: silently wrong (confirmed with the op alone)",
             "- **skipped**: not run through dcp, and why", "",
             "| result | count |", "| --- | --- |"]
    lines += [f"| {kind} | {kinds[kind]} |" for kind in sorted(kinds, key=lambda k: order.get(k, 9))]
    lines += ["", "| op (carried dimension of the sample's shape) | result | reason |", "| --- | --- | --- |"]
    for row in sorted(rows, key=lambda r: (order.get(r["kind"], 9), r["label"])):
        detail = row.get("detail", "").replace("|", "\\|").replace("\n", " ")[:240]
        lines.append(f"| `{row['label']}` | {row['kind']} | {detail} |")
    with open(path, "w") as handle:
        handle.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    # python tests/test_opinfo_sweep.py LOG.jsonl...: the table from DCP_OPINFO_LOG files (a later
    # file's rows for an op replace an earlier one's: a rerun of some ops after a fix);
    # without arguments, from the shards' DCP_OPINFO_WRITE files. DCP_OPINFO_NOTE is added to the header.
    import glob
    import sys

    by_name: dict[str, list[dict]] = {}
    if sys.argv[1:]:
        for log_path in sys.argv[1:]:
            rows_here: dict[str, list[dict]] = collections.defaultdict(list)
            for line in open(log_path):
                if line.strip():
                    row = json.loads(line)
                    rows_here[row["name"]].append(row)
            by_name.update(rows_here)
    else:
        for shard_path in sorted(glob.glob(f"{RESULTS}.shard*.json")):
            with open(shard_path) as handle:
                shard = json.load(handle)
            for row in shard["outcomes"] + [{"name": s["name"], "label": s["name"], "kind": "skipped", "detail": s["why"]}
                                            for s in shard["skips"]]:
                by_name.setdefault(row["name"], []).append(row)
    rows = [row for name_rows in by_name.values() for row in name_rows]
    write_table(rows, RESULTS, os.environ.get("DCP_OPINFO_NOTE", ""))
    print(len(by_name), "ops", collections.Counter(row["kind"] for row in rows))
