"""Trace once across ranks: Dynamo graphs counted per rank on two real gloo ranks.

Each zoo model runs a sequence of (batch size, length) micro-batches whose odd lengths give the
two ranks chunks of different lengths (7 -> 4 + 3), first micro-batch of batch size 1. After every
call each rank records how many graphs Dynamo has compiled. The backend compiles its static
variant inside Dynamo's compile (so that the inner compiler's guards are installed), where a guard
on the rank's own chunk length would make one rank recompile alone and the next collective pair
wrongly or hang. Asserted: every rank compiles the same graphs at the same calls, and dcp compiles
exactly the graphs plain ``torch.compile`` does on the same calls (the backend's passes add no
guard of their own: no length or batch size recompiles that would not without dcp), each call at
parity with eager (loss, and gradients summed over the ranks), chunks of one token or none included.

What dcp does not remove: Dynamo specialises a size of 1 (its 0/1 specialisation), so a batch of
1 costs a graph of its own, first or later, with or without dcp (``backed_size_oblivious`` still
guards ``Eq(batch, 1)`` in stride reasoning, and ``mark_unbacked`` batch sizes do not yet go
through dcp's re-trace). ``test_a_batch_of_one_costs_no_graph_of_its_own`` pins that gap as an
expected failure.
"""

from __future__ import annotations

import pytest
import torch

from dcp_compile.testing.process_world import run_in_process_world

# (batch size, tokens): odd lengths split unevenly over 2 ranks (9 -> 5 + 4), lengths that leave a
# rank one token (3 -> 2 + 1) or none (1 -> 1 + 0); batch size 1 first and again later. The DiT's
# grids stay at least 3 patches on a side (a side of 1 is Dynamo's 0/1 specialisation again).
CALLS = {"gpt": [(1, 9), (2, 15), (3, 21), (2, 9), (1, 25), (3, 35), (2, 3), (2, 1)],
         "dit": [(1, 9), (2, 15), (3, 21), (2, 9), (1, 25), (3, 35)],
         "gpt_quick": [(2, 15), (2, 3), (3, 9), (2, 2)]}  # one graph: chunks 8+7, 2+1, 5+4, 1+1


def _graph_counts(case, calls, backend: str, options: dict | None) -> tuple[list[int], float]:
    """Graphs compiled after each call, and (dcp) the largest error of the loss and of the
    gradients summed over the ranks against eager on the full batch."""
    import torch.distributed as dist
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    model = case.build()
    compiled = torch.compile(model, backend=backend, dynamic=True, **({"options": options} if options else {}))
    counts, error = [], 0.0
    for batch_size, tokens in calls:
        inputs = case.make_inputs(tokens, batch_size=batch_size)
        model.zero_grad()
        loss = case.loss_of(compiled(**inputs))
        loss.backward()
        counts.append(counters["stats"]["unique_graphs"])
        if backend == "dcp":
            reference = case.build()
            expected = case.loss_of(reference(**inputs))
            expected.backward()
            error = max(error, abs(loss.item() - expected.item()))
            for parameter, eager in zip(model.parameters(), reference.parameters()):
                summed = parameter.grad.clone()
                dist.all_reduce(summed)
                error = max(error, (summed - eager.grad).abs().max().item())
    torch._dynamo.reset()
    return counts, error


def _worker(rank: int, world_size: int, names: tuple[str, ...], inner: str) -> dict:
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    from model_zoo import ZOO

    result = {}
    for name in names:
        case = ZOO[name.removesuffix("_quick")]
        dcp_counts, error = _graph_counts(case, CALLS[name], "dcp", {"inner": inner, "sp_size": world_size})
        plain_counts, _ = _graph_counts(case, CALLS[name], "eager", None)
        result[name] = {"dcp": dcp_counts, "plain": plain_counts, "error": error}
    return result


def _check(results: list[dict], names: tuple[str, ...]) -> None:
    for name in names:
        per_rank = [result[name]["dcp"] for result in results]
        assert all(counts == per_rank[0] for counts in per_rank), f"{name}: graphs per call differ by rank {per_rank}"
        assert per_rank[0] == results[0][name]["plain"], (
            f"{name}: dcp compiled {per_rank[0]} graphs per call, plain torch.compile {results[0][name]['plain']}")
        assert all(result[name]["error"] < 1e-4 for result in results), [result[name]["error"] for result in results]


def test_every_rank_compiles_the_same_graphs():
    names = ("gpt_quick",)
    _check(run_in_process_world(_worker, 2, names, "eager", timeout=300), names)  # a lone recompile hangs


@pytest.mark.slow
def test_every_rank_compiles_the_same_graphs_through_aot_autograd():
    names = ("gpt", "dit")
    _check(run_in_process_world(_worker, 2, names, "aot_eager", timeout=1200), names)


@pytest.mark.slow
@pytest.mark.xfail(strict=True, reason="Dynamo's 0/1 specialisation: a batch of 1 is a graph of its own (module docstring)")
def test_a_batch_of_one_costs_no_graph_of_its_own():
    names = ("gpt",)
    for result in run_in_process_world(_worker, 2, names, "eager", timeout=600):
        assert result["gpt"]["dcp"][1] == 1, result  # the batch of 2 after the batch of 1
