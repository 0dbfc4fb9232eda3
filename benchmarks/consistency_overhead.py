"""What the default-on rank checks cost, against a step of the demo model.

Two gloo ranks on this machine, the demo's ``TinyGPT`` (vocab 512, hidden 128, 2 layers, 4 heads)
and a micro-batch of its size (2 rows of 512 tokens, run at SP 2). Three measurements:

* **check per call**: ``check_sp_group_agrees`` (what the dispatcher runs before each SP>1 call:
  one all-gather of six int64s over the SP group, plus the integer-input digest), timed alone in
  a loop;
* **check per step**: ``check_world_agrees`` as ``sync_gradients`` runs it once per step;
* **step**: forward + backward of that micro-batch under ``dcp.use(Variant(2))`` with the checks
  on and with ``options={"check_ranks": False}``, alternating (each first every other time), median of
  each.

The ratio is ``(calls_per_step * check per call + check per step) / step`` with the demo's one call
per micro-batch. On a GPU the check is the same all-gather over NCCL plus one host sync; that is
not measured here (no GPU), so the report prices it from the cost model instead: an assumed
``GPU_CHECK_SECONDS`` against the predicted time of an 8k-token Llama-3-8B micro-batch at SP 2 on
an H200.

Writes ``benchmarks/results/consistency_overhead.md``. Run:
``PYTHONPATH=. python benchmarks/consistency_overhead.py [--repeats 30]``.
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
ROWS, LENGTH = 2, 512
GPU_CHECK_SECONDS = 100e-6  # assumed: a 48-byte NCCL all-gather on one node plus a host sync


def _median_seconds(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _interquartile(values: list[float]) -> float:
    quartiles = statistics.quantiles(values, n=4)
    return quartiles[2] - quartiles[0]


def _worker(rank: int, world_size: int, repeats: int) -> dict:
    import torch.distributed as dist

    import dcp_compile as dcp
    from dcp_compile.demo.example_models import TinyGPT
    from dcp_compile.demo.training_demo import HEADS, HIDDEN, LAYERS, VOCAB
    from dcp_compile.runtime.consistency import check_sp_group_agrees, check_world_agrees
    from dcp_compile.runtime.process_groups import sp_group

    dcp.runtime.create_sp_groups()
    torch.manual_seed(0)
    models, compiled = [], {}
    for checked in (True, False):
        torch.manual_seed(0)
        model = TinyGPT(VOCAB, HIDDEN, LAYERS, HEADS)
        models.append(model)
        compiled[checked] = torch.compile(model, backend="dcp", dynamic=True,
                                          options={"inner": "aot_eager", "check_ranks": checked})
    ids = torch.randint(0, VOCAB, (ROWS, LENGTH), generator=torch.Generator().manual_seed(0))
    variant = dcp.Variant(2)

    def step(checked: bool) -> None:
        with dcp.use(variant):
            compiled[checked](ids, ids).backward()

    for checked in (True, False):  # compile both, forward and backward
        step(checked)
        step(checked)
    step_times: dict[bool, list[float]] = {True: [], False: []}
    for repeat in range(repeats):
        for checked in ((True, False) if repeat % 2 == 0 else (False, True)):  # neither always goes first
            dist.barrier()
            start = time.perf_counter()
            step(checked)
            step_times[checked].append(time.perf_counter() - start)
    group = sp_group(2)
    dist.barrier()
    per_call = _median_seconds(lambda: check_sp_group_agrees(
        variant, [ids, ids], group.process_group, group.ranks, graph_id=0, length=LENGTH), repeats * 10)
    dist.barrier()
    per_step = _median_seconds(lambda: check_world_agrees("sync_gradients", [0, 1, 2], ["a", "b", "c"]), repeats * 10)
    return {
        "step_on": statistics.median(step_times[True]),
        "step_off": statistics.median(step_times[False]),
        "spread_off": _interquartile(step_times[False]),
        "spread_on": _interquartile(step_times[True]),
        "per_call": per_call,
        "per_step": per_step,
    }


def gpu_estimate() -> tuple[float, float]:
    """The cost model's seconds for an 8k-token Llama-3-8B micro-batch at SP 2 on an H200, and the ratio."""
    from dcp_compile.schedule.cost_model import CostModel, ModelProfile
    from dcp_compile.schedule.hardware import Hardware

    model = CostModel(ModelProfile.from_config("llama-3-8b"), Hardware.H200, optimizer_shards=8)
    seconds = model.time([8192], 2)
    return seconds, 2 * GPU_CHECK_SECONDS / seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--repeats", type=int, default=30)
    arguments = parser.parse_args()
    if arguments.repeats < 1:
        parser.error("--repeats must be >= 1")
    from dcp_compile.testing.process_world import run_in_process_world

    results = run_in_process_world(_worker, 2, arguments.repeats, timeout=900)
    worst = {key: max(r[key] for r in results) for key in results[0]}
    ratio = (worst["per_call"] + worst["per_step"]) / worst["step_off"]
    gpu_step, gpu_ratio = gpu_estimate()
    lines = [
        "# Rank-consistency checks: cost per call and per step",
        "",
        f"Library {library_version()}; {run_description.machine()}; 2 gloo ranks; "
        f"{arguments.repeats} alternating steps per setting; slower rank's median.",
        "",
        f"Demo model (TinyGPT 512/128/2 layers/4 heads), one micro-batch of {ROWS}x{LENGTH} tokens at SP 2, "
        "forward + backward (aot_eager).",
        "",
        "| measurement | seconds |",
        "|---|---|",
        f"| step, checks on (median; interquartile range) | {worst['step_on']:.4f} ({worst['spread_on']:.4f}) |",
        f"| step, `check_ranks=False` (median; interquartile range) | {worst['step_off']:.4f} ({worst['spread_off']:.4f}) |",
        f"| SP-group check, per compiled call | {worst['per_call'] * 1e6:.0f} us |",
        f"| world check in `sync_gradients`, per step | {worst['per_step'] * 1e6:.0f} us |",
        "",
        f"**Checks / step = {100 * ratio:.2f}%** (one call per micro-batch plus one sync check, against the "
        f"step with checks off; goal < 2%). Measured directly, the medians of the steps with and without the checks "
        f"differ by {1e3 * (worst['step_on'] - worst['step_off']):+.1f} ms ({100 * (worst['step_on'] / worst['step_off'] - 1):+.1f}%), "
        f"against an interquartile range of {1e3 * worst['spread_off']:.1f} ms of the steps themselves on this shared machine.",
        "",
        f"GPU, by the cost model (not measured): an 8k-token Llama-3-8B micro-batch at SP 2 on an H200 is "
        f"predicted at {gpu_step * 1e3:.0f} ms; with an assumed {GPU_CHECK_SECONDS * 1e6:.0f} us per check "
        f"(a 48-byte NCCL all-gather and a host sync) and two checks per micro-batch-step, the checks cost "
        f"{100 * gpu_ratio:.3f}% of it.",
        "",
    ]
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "consistency_overhead.md").write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
