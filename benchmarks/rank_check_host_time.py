"""Host time the SP-group rank check adds to one compiled call: waited on (``sync``) or beside the
call (``async``).

Two gloo ranks on this machine. Per call, what the dispatcher does around the compiled graph:

* ``sync``: ``check_sp_group_agrees(..., mode="sync")``: the signature, one all-gather, a wait for
  the peers, the comparison, all before the call's first collective;
* ``async``: ``check_sp_group_agrees(..., mode="async")`` (the signature, the all-gather issued,
  the record kept) before the call, then ``SettledAfterCall`` after it (the comparison of the
  completed gather). Between the two, a stand-in for the call's work (matmuls until the gather has
  completed) runs, as the graph would; only the time inside the check's two halves is counted.

Inputs: a token-id tensor ``[2, 512]`` and a float tensor (a language model's call: one integer
digest) and, separately, float inputs only (a DiT's call: no digest). Median over ``--calls``
calls, the slower rank. Writes ``benchmarks/results/rank_check_host_time.md``:

    PYTHONPATH=. python benchmarks/rank_check_host_time.py [--calls 400]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

import run_description  # noqa: E402  (benchmarks/ is on sys.path when run as a script)
from run_description import library_version  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"


def _worker(rank: int, world_size: int, calls: int) -> dict:
    import torch.distributed as dist

    import dcp_compile as dcp
    from dcp_compile.runtime.consistency import SettledAfterCall, check_sp_group_agrees, settle_pending_checks
    from dcp_compile.runtime.process_groups import sp_group

    dcp.runtime.create_sp_groups()
    group = sp_group(2)
    variant = dcp.Variant(2)
    ids = torch.randint(0, 512, (2, 512), generator=torch.Generator().manual_seed(0))
    hidden = torch.randn(2, 512, 64)
    work_a, work_b = torch.randn(64, 64), torch.randn(64, 64)
    results = {}
    for inputs_name, args in (("token ids + floats (LM)", [ids, hidden]), ("floats only (DiT)", [hidden, hidden])):
        sync, issue, settle = [], [], []
        for _ in range(calls):
            start = time.perf_counter()
            check_sp_group_agrees(variant, args, group.process_group, group.ranks, graph_id=0, length=512, mode="sync")
            sync.append(time.perf_counter() - start)
        dist.barrier()
        for _ in range(calls):
            start = time.perf_counter()
            pending = check_sp_group_agrees(variant, args, group.process_group, group.ranks, graph_id=0,
                                            length=512, mode="async")
            issue.append(time.perf_counter() - start)
            while not pending.completed():  # the call's own work, not counted
                torch.mm(work_a, work_b)
            start = time.perf_counter()
            with SettledAfterCall(pending):
                pass
            settle.append(time.perf_counter() - start)
        settle_pending_checks()
        dist.barrier()
        results[(inputs_name, "sync")] = statistics.median(sync)
        results[(inputs_name, "issue")] = statistics.median(issue)
        results[(inputs_name, "settle")] = statistics.median(settle)
    return {f"{k[0]}|{k[1]}": v for k, v in results.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--calls", type=int, default=400)
    args = parser.parse_args()
    from dcp_compile.testing.process_world import run_in_process_world

    per_rank = run_in_process_world(_worker, 2, args.calls, timeout=900)
    worst = {key: max(r[key] for r in per_rank) for key in per_rank[0]}
    lines = [
        "# Host time of the SP-group rank check per compiled call",
        "",
        f"Measured: library {library_version()}; {run_description.machine()}; 2 gloo ranks; "
        f"median of {args.calls} calls, the slower rank. `PYTHONPATH=. python benchmarks/rank_check_host_time.py`.",
        "",
        "| inputs | sync: waited before the call (us) | async: issue (us) | async: settle after the call (us) | async total (us) |",
        "|---|---|---|---|---|",
    ]
    for inputs_name in dict.fromkeys(key.split("|")[0] for key in worst):
        sync, issue, settle = (worst[f"{inputs_name}|{part}"] * 1e6 for part in ("sync", "issue", "settle"))
        lines.append(f"| {inputs_name} | {sync:.0f} | {issue:.0f} | {settle:.0f} | {issue + settle:.0f} |")
    lines += [
        "",
        "`sync` is the default on gloo (a collective whose sizes differ between ranks aborts a gloo process, "
        "so the disagreement must be known before the call's first collective); `async` is the default on "
        "NCCL (`DCP_RANK_CHECK`, `dcp_compile/runtime/consistency.py`). The async figure is what the "
        "check keeps on the host: building the signature (one small tensor; an integer digest of a few ops "
        "per integer input), issuing the all-gather, and comparing the gathered rows after the call. On a "
        "GPU the sync check would also be a host synchronisation per call; the async one waits for nothing "
        "(a CUDA event), not measured here (no GPU).",
    ]
    out = RESULTS / "rank_check_host_time.md"
    out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
