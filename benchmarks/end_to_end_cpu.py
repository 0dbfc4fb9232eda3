"""Measured end to end on this CPU: DCP vs static SP vs the published DCP-inter schedule.

Four gloo processes (one CPU thread each) train TinyGPT (the demo's 2-layer, width-128 decoder:
a stand-in, not a DiT) on a Zipf mix of sample lengths {16, 64, 256, 1024, 4096} (weights
1/(rank+1)^1.2, shortest most common), with a stand-in memory cap of 1024 tokens per rank in a
micro-batch (a 4096-token sample needs SP 4). Every optimizer step trains the same samples (the
sampler's step) three ways, from the same weights, in rotating order:

* ``dcp``: the sampler's plan (SP size per micro-batch, packed rows);
* ``static-sp4``: SP 4 for everything, the samples packed in arrival order up to its own budget
  (4 x 1024 tokens per micro-batch);
* ``dcp-inter``: the published DCP-inter schedule (profiled per-bucket SP and batch, accumulation
  from the 1.2/1.0 penalty search with max 5 / min 15) on the same cost model, run iso-batch (one
  sync per step) and without recompute (CPU memory is no constraint; in its favour).

Recompute is off for all three. The cost model is calibrated at start (the demo's design, timed
on these processes); its predicted busy time per step is compared with the measured busy time
(the slowest rank's forward+backward before the gradient sync). Throughput is tokens over the
whole step (sync and optimizer included). The machine is shared with other jobs: numbers are
measured under load, and intervals are 95% t-intervals over the steps.

Writes ``benchmarks/results/end_to_end_cpu.md`` and ``.json``. Run:
``PYTHONPATH=. python benchmarks/end_to_end_cpu.py [--steps 6]``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import random
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

import dcp_compile as dcp
from dcp_compile.demo import training_demo as demo
from dcp_compile.demo.example_models import TinyGPT
from dcp_compile.schedule.published_schedulers import DCPInterScheduler
from dcp_compile.testing.process_world import run_in_process_world

RESULTS = Path(__file__).resolve().parent / "results"
WORLD_SIZE = 4
LENGTHS = (16, 64, 256, 1024, 4096)
MAX_TOKENS_PER_RANK = 1024
TOKENS_PER_STEP = 24_576
SCHEDULES = ("dcp", "static-sp4", "dcp-inter")


def zipf_dataset(seed: int, total_tokens: int) -> list[torch.Tensor]:
    rng = random.Random(seed)
    weights = [1 / (rank + 1) ** 1.2 for rank in range(len(LENGTHS))]
    generator = torch.Generator().manual_seed(seed)
    samples, tokens = [], 0
    while tokens < total_tokens:
        length = rng.choices(LENGTHS, weights)[0]
        samples.append(torch.randint(1, demo.VOCAB, (length,), generator=generator))
        tokens += length
    return samples


def dcp_inter_microbatches(scheduler: DCPInterScheduler, indices: list[int], lengths: list[int], supervised: int) -> list[dcp.MicroBatch]:
    step_lengths = [lengths[i] for i in indices]
    schedule = scheduler.schedule(step_lengths)
    schedule.validate(len(step_lengths))
    out = []
    for mb in sorted(schedule.microbatches, key=lambda m: (m.round, m.first_rank)):
        chosen = tuple(indices[p] for p in mb.positions)
        out.append(dcp.MicroBatch(
            indices=chosen, variant=dcp.Variant(mb.sp_size, "none"),
            loss_scale=sum(lengths[i] - 1 for i in chosen) / supervised,
            group_ranks=tuple(range(mb.first_rank, mb.first_rank + mb.sp_size)),
            predicted_time=0.0, tokens=sum(lengths[i] for i in chosen)))
    return out


def rank_busy_prediction(cost_model: dcp.CostModel, microbatches: list[dcp.MicroBatch], lengths: list[int]) -> float:
    loads = [0.0] * WORLD_SIZE
    for mb in microbatches:
        seconds = cost_model.time([lengths[i] for i in mb.indices], mb.sp_size, "none")
        for rank in mb.group_ranks:
            loads[rank] += seconds
    return max(loads)


def worker(rank: int, world_size: int, steps: int, seed: int) -> dict:
    device = torch.device("cpu")
    dcp.create_sp_groups()
    dataset = zipf_dataset(seed, (steps + 2) * TOKENS_PER_STEP)
    lengths = [len(s) for s in dataset]
    torch.manual_seed(seed)
    model = TinyGPT(demo.VOCAB, demo.HIDDEN, demo.LAYERS, demo.HEADS)
    compiled = torch.compile(model, backend="dcp", dynamic=True, options={"inner": "aot_eager"})
    sizes = demo.sp_sizes_for(world_size)
    demo.warm_up(compiled, model, [dcp.Variant(s, "none") for s in sorted(sizes, reverse=True)], device)
    cost_model = demo.calibrate(demo.tinygpt_cost_model(), compiled, model, sizes, device, seed)
    sampler = dcp.DataCentricSampler(
        lengths, tokens_per_step=TOKENS_PER_STEP, cost_model=cost_model, max_tokens_per_rank=MAX_TOKENS_PER_RANK,
        seed=seed, verify_plan=True, supervised_tokens=[n - 1 for n in lengths], max_sp_size=world_size,
    )
    inter = DCPInterScheduler(cost_model, world_size, max_tokens_per_rank=MAX_TOKENS_PER_RANK)
    optimizer = torch.optim.AdamW(model.parameters(), lr=demo.LEARNING_RATE)
    rows = []
    for step in itertools.islice(sampler, steps):
        every = [mb for group in step.groups for mb in group.microbatches]
        indices = [i for mb in every for i in mb.indices]
        supervised = sum(lengths[i] - 1 for i in indices)
        plans = {
            "dcp": every,
            "static-sp4": demo.static_microbatches(indices, lengths, MAX_TOKENS_PER_RANK * world_size, world_size,
                                                   dcp.Variant(world_size, "none")),
            "dcp-inter": dcp_inter_microbatches(inter, indices, lengths, supervised),
        }
        start_weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
        row = {"step": step.step, "tokens": step.tokens}
        order = SCHEDULES[step.step % 3:] + SCHEDULES[: step.step % 3]
        kept = None
        for name in order:
            model.load_state_dict(start_weights)
            work = [(mb, mb.variant, mb.group_ranks[0] == rank) for mb in plans[name] if rank in mb.group_ranks]
            elapsed, busy, share = demo.run_step(compiled, model, optimizer, dataset, work, device)
            seconds, busy_all, loss = demo._gather_step(elapsed, busy, share, device)
            predicted = step.predicted_makespan if name == "dcp" else rank_busy_prediction(cost_model, plans[name], lengths)
            row[name] = {"seconds": seconds, "busy": max(busy_all), "predicted_busy": predicted, "loss": loss,
                         "microbatches": len(plans[name])}
            if name == "dcp":
                kept = {k: v.detach().clone() for k, v in model.state_dict().items()}
        model.load_state_dict(kept)
        rows.append(row)
    return {"rows": rows, "calibration_max_error": cost_model.calibration.max_relative_error}


def interval(values: list[float]) -> tuple[float, float]:
    """Mean and 95% t half-width."""
    mean = statistics.fmean(values)
    if len(values) < 2:
        return mean, math.nan
    from scipy import stats

    return mean, stats.t.ppf(0.975, len(values) - 1) * statistics.stdev(values) / math.sqrt(len(values))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    start = time.perf_counter()
    results = run_in_process_world(worker, WORLD_SIZE, args.steps, args.seed, timeout=1800)
    result = results[0] if isinstance(results, list) else results
    rows = result["rows"]
    lines = [
        "# Measured end to end on CPU: DCP vs static SP 4 vs published DCP-inter (4 gloo ranks, under load)\n",
        __doc__.split("\n\n", 1)[1].split("Writes")[0].strip() + "\n",
        f"{len(rows)} steps of ~{TOKENS_PER_STEP:,} tokens; wall time {time.perf_counter() - start:.0f} s; "
        f"cost-model calibration max error {100 * result['calibration_max_error']:.0f}%.\n",
        "| schedule | micro-batches/step | tokens/s (mean +- 95%) | speedup vs static-sp4 per step (mean +- 95%) "
        "| predicted busy / measured busy (mean) |",
        "|---|---|---|---|---|",
    ]
    summary = {}
    for name in SCHEDULES:
        throughput = interval([r["tokens"] / r[name]["seconds"] for r in rows])
        speedup = interval([r["static-sp4"]["seconds"] / r[name]["seconds"] for r in rows])
        error = statistics.fmean(r[name]["predicted_busy"] / r[name]["busy"] for r in rows)
        count = statistics.fmean(r[name]["microbatches"] for r in rows)
        summary[name] = {"tokens_per_s": throughput, "speedup_vs_static": speedup, "predicted_over_measured": error}
        lines.append(f"| {name} | {count:.1f} | {throughput[0]:,.0f} +- {throughput[1]:,.0f} | "
                     f"{speedup[0]:.2f}x +- {speedup[1]:.2f} | {error:.2f} |")
    losses = max(abs(r[a]["loss"] - r["dcp"]["loss"]) for r in rows for a in SCHEDULES)
    lines.append(f"\nLosses of the three schedules on the same step from the same weights differ by at most "
                 f"{losses:.2e} (same samples, same arithmetic up to float order).")
    report = "\n".join(lines) + "\n"
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "end_to_end_cpu.md").write_text(report)
    (RESULTS / "end_to_end_cpu.json").write_text(json.dumps({"rows": rows, "summary": summary}, indent=1))
    print(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
