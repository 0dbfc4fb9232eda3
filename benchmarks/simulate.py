"""Cluster simulation: DCP against the published schedulers on 32 simulated H200s.

Four nodes of eight H200 (NVLink inside a node, one 400 Gb/s InfiniBand NIC per GPU across), bf16
with ZeRO-1. Two models: the Open-Sora v1.2-like 1.1B video DiT (STDiT3-XL/2) on the Open-Sora
bucket mix, and the Llama-3-8B-like LLM on long-tailed text, each with short-dominated, balanced
and long-dominated distributions (see ``benchmarks/planner.py``).

Iso-batch: ``DataCentricSampler`` cuts each epoch into steps of at most ``tokens_per_step`` tokens;
every scheduler trains exactly those samples in one optimizer step. A step costs its makespan
(from the cost model) plus one gradient all-reduce, the same for every scheduler. Throughput is
samples per second over the simulated steps; "% of bound" is the summed lower bound over the
summed makespan. The sweep covers several step sizes because the published schedulers' quality
depends on it: their profiled batches (up to the 70% memory cap) want very large steps.

Writes ``benchmarks/results/simulate.csv``, ``simulate.md`` and ``simulate.png``. Run:
``PYTHONPATH=. python benchmarks/simulate.py [--max-steps 12]``.
"""

from __future__ import annotations

import argparse
import csv
import statistics
import sys
import time
from pathlib import Path

from tqdm.auto import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))
from planner import RESULTS, Workload, cost_model_for, markdown_table, opensora_workload, workloads  # noqa: E402

from dcp_compile.schedule.cost_model import CostModel, ModelProfile  # noqa: E402
from dcp_compile.schedule.hardware import Hardware  # noqa: E402
from dcp_compile.schedule.published_schedulers import (  # noqa: E402
    BucketParallelScheduler,
    DCPInterScheduler,
    make_baselines,
)
from dcp_compile.schedule.sampler import DataCentricSampler  # noqa: E402

WORLD_SIZE = 32
STEP_TOKENS = {  # tokens per optimizer step to sweep, per model
    "stdit3-xl/2": (2_000_000, 8_000_000, 32_000_000),
    "llama-3-8b": (1_000_000, 4_000_000, 16_000_000),
}
DEFAULT_STEP_TOKENS = {"stdit3-xl/2": 8_000_000, "llama-3-8b": 4_000_000}
SCHEDULERS = ("static-sp", "bucket-parallel", "dcp-intra", "dcp-inter", "dcp")


def simulate(workload: Workload, tokens_per_step: int, max_steps: int) -> dict:
    cost_model = cost_model_for(workload, WORLD_SIZE)
    sampler = DataCentricSampler(
        workload.lengths, tokens_per_step, cost_model=cost_model, seed=0,
        world_size=WORLD_SIZE, rank=0, spans=workload.spans,
    )
    video = workload.model.startswith("stdit")
    baselines = make_baselines(cost_model, WORLD_SIZE, max(workload.lengths), bucket_sp_size=4 if video else None)
    sync = cost_model.hardware.all_reduce_seconds(cost_model.profile.parameter_bytes, WORLD_SIZE)
    makespan = {name: 0.0 for name in SCHEDULERS}
    synchronised = {name: 0.0 for name in SCHEDULERS}
    bound = 0.0
    samples = tokens = 0
    planning = []
    steps = sampler.steps(0)[:max_steps]
    for step_index, indices in enumerate(steps):
        lengths = [workload.lengths[i] for i in indices]
        spans = None if workload.spans is None else [workload.spans[i] for i in indices]
        start = time.perf_counter()
        plan = sampler.plan(step_index)
        planning.append(time.perf_counter() - start)
        makespan["dcp"] += plan.predicted_makespan
        synchronised["dcp"] += plan.predicted_makespan
        bound += plan.lower_bound
        for baseline in baselines:
            schedule = baseline.schedule(lengths, spans)
            schedule.validate(len(lengths))
            makespan[baseline.name] += schedule.makespan
            synchronised[baseline.name] += schedule.synchronised_makespan
        samples += len(indices)
        tokens += sum(lengths)
    total_sync = sync * len(steps)
    result = {
        "model": workload.model,
        "distribution": workload.name,
        "tokens_per_step": tokens_per_step,
        "steps": len(steps),
        "samples_per_step": round(samples / len(steps), 1),
        "sync_s_per_step": round(sync, 4),
        "plan_ms_median": round(1000 * statistics.median(planning), 1),
        "dcp_percent_of_bound": round(100 * bound / makespan["dcp"], 1),
    }
    for name in SCHEDULERS:
        seconds = makespan[name] + total_sync
        result[f"{name}_samples_per_s"] = round(samples / seconds, 3)
        result[f"{name}_tokens_per_s"] = round(tokens / seconds)
        result[f"{name}_speedup_vs_static"] = round((makespan["static-sp"] + total_sync) / seconds, 2)
        result[f"{name}_synchronised_speedup_vs_static"] = round(
            (synchronised["static-sp"] + total_sync) / (synchronised[name] + total_sync), 2
        )
        result[f"{name}_percent_of_bound"] = round(100 * bound / makespan[name], 1)
    best_baseline = max(SCHEDULERS[:-1], key=lambda name: result[f"{name}_samples_per_s"])
    result["best_baseline"] = best_baseline
    result["dcp_speedup_vs_best_baseline"] = round(
        result["dcp_samples_per_s"] / result[f"{best_baseline}_samples_per_s"], 2
    )
    return result


# The published benchmark (32 H100, STDiT3-XL/2, the three Zipf video mixes), M tokens/s.
PUBLISHED_M_TOKENS_PER_S = {
    "video short-dominated": {"bucket-parallel": 0.90, "dcp-inter": 2.24},
    "video balanced": {"bucket-parallel": 1.16, "dcp-inter": 2.06},
    "video long-dominated": {"bucket-parallel": 1.54, "dcp-inter": 1.97},
}
IMAGE_MULTIPLES = {"video short-dominated": 16, "video balanced": 2, "video long-dominated": 0}


def published_setting(distribution: str, num_videos: int = 20000) -> dict[str, dict[str, float]]:
    """Each published scheduler at its own batch on the published setting, M tokens/s.

    Accounting: one epoch of the Zipf mix (``num_videos`` videos: ten times the published 2000 so
    the ragged last rounds of DCP-inter's 15+ accumulation steps weigh like a steady state), each
    scheduler's own rounds, every round ends in a gradient sync (ring all-reduce of the bf16
    parameters) that all ranks wait for. ``utilisation``: busy GPU-seconds over 32 x wall time.
    """
    workload = opensora_workload(distribution, IMAGE_MULTIPLES[distribution], num_videos=num_videos)
    cost_model = CostModel(ModelProfile.from_config("stdit3-xl/2"), Hardware.H100, optimizer_shards=WORLD_SIZE)
    sync = cost_model.hardware.all_reduce_seconds(cost_model.profile.parameter_bytes, WORLD_SIZE)
    tokens = sum(workload.lengths)
    out = {}
    for scheduler in (
        BucketParallelScheduler(cost_model, WORLD_SIZE, max(workload.lengths), sp_size=4),
        DCPInterScheduler(cost_model, WORLD_SIZE, max_accumulation=5, min_accumulation=15, pyramid_recompute=True),
    ):
        schedule = scheduler.schedule(workload.lengths, workload.spans)
        schedule.validate(len(workload.lengths))
        rounds = len({microbatch.round for microbatch in schedule.microbatches})
        seconds = schedule.synchronised_makespan + rounds * sync
        busy = sum(m.predicted_time * m.sp_size for m in schedule.microbatches)
        out[scheduler.name] = {
            "m_tokens_per_s": tokens / seconds / 1e6, "utilisation": busy / (WORLD_SIZE * seconds), "rounds": rounds,
        }
    return out


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    default = [r for r in rows if r["tokens_per_step"] == DEFAULT_STEP_TOKENS[r["model"]]]
    figure, (left, right) = plt.subplots(1, 2, figsize=(15, 5.2))
    width = 0.16
    labels = [r["distribution"] for r in default]
    for offset, name in enumerate(SCHEDULERS):
        values = [r[f"{name}_speedup_vs_static"] for r in default]
        positions = [i + (offset - 2) * width for i in range(len(default))]
        bars = left.bar(positions, values, width, label=name)
        if name == "dcp":
            for x, v in zip(positions, values):
                left.text(x, v, f"{v:.2f}", ha="center", va="bottom", fontsize=7)
    left.axhline(1.0, color="gray", linewidth=0.8)
    left.set_xticks(range(len(default)), labels, rotation=20, ha="right", fontsize=8)
    left.set_ylabel("throughput speedup over static SP (iso-batch)")
    left.set_title(f"32 x H200, default step size (video {DEFAULT_STEP_TOKENS['stdit3-xl/2'] / 1e6:g}M, "
                   f"text {DEFAULT_STEP_TOKENS['llama-3-8b'] / 1e6:g}M tokens)", fontsize=9)
    left.legend(fontsize=8)

    for distribution in dict.fromkeys(r["distribution"] for r in rows):
        series = sorted((r for r in rows if r["distribution"] == distribution), key=lambda r: r["tokens_per_step"])
        xs = [r["tokens_per_step"] / 1e6 for r in series]
        right.plot(xs, [r["dcp_speedup_vs_best_baseline"] for r in series], marker="o", label=distribution)
    right.set_xscale("log")
    right.axhline(1.0, color="gray", linewidth=0.8)
    right.set_xlabel("tokens per optimizer step (millions)")
    right.set_ylabel("DCP speedup over the best published scheduler")
    right.set_title("sensitivity to the step size", fontsize=9)
    right.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=130)
    plt.close(figure)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-steps", type=int, default=12, help="steps simulated per configuration")
    parser.add_argument("--output", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    args.output.mkdir(parents=True, exist_ok=True)

    configurations = [(w, t) for w in workloads() for t in STEP_TOKENS[w.model]]
    rows = [simulate(w, t, args.max_steps) for w, t in tqdm(configurations, desc="simulating")]

    with open(args.output / "simulate.csv", "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    plot(rows, args.output / "simulate.png")

    header = ["model", "distribution", "tokens/step", "samples/step"] + [f"{n} vs static" for n in SCHEDULERS] + [
        "DCP % of bound", "DCP vs best baseline"
    ]
    table = markdown_table(header, [
        [r["model"], r["distribution"], f"{r['tokens_per_step'] / 1e6:g}M", f"{r['samples_per_step']:g}"]
        + [f"{r[f'{n}_speedup_vs_static']:.2f}x" for n in SCHEDULERS]
        + [f"{r['dcp_percent_of_bound']:.1f}%", f"{r['dcp_speedup_vs_best_baseline']:.2f}x ({r['best_baseline']})"]
        for r in rows
    ])
    default = [r for r in rows if r["tokens_per_step"] == DEFAULT_STEP_TOKENS[r["model"]]]
    geometric = statistics.geometric_mean([r["dcp_speedup_vs_static"] for r in default])
    best = statistics.geometric_mean([r["dcp_speedup_vs_best_baseline"] for r in default])
    report = (
        "# Cluster simulation: 32 x H200\n\n"
        f"4 nodes x 8 H200 (NVLink inside a node, 400 Gb/s InfiniBand across), bf16, ZeRO-1; iso-batch: every "
        f"scheduler trains the same samples per optimizer step (the sampler's steps), up to {args.max_steps} steps per "
        "configuration. Step time = makespan from the analytic cost model + one gradient all-reduce (the same for "
        "all). Speedups are samples/s over static SP (SP for the longest sample, every block checkpointed, samples "
        "packed in arrival order into a fixed per-micro-batch token budget). Baselines get the flattering accounting described in `dcp_compile/baseline_schedulers.py` (their "
        "rounds are not synchronised; `*_synchronised_speedup_vs_static` in the CSV has the published per-round "
        "sync).\n\n"
        f"At the default step sizes DCP is {geometric:.2f}x static SP (geometric mean over the six distributions) "
        f"and {best:.2f}x the best published scheduler of each row. The published system reports up to 2.88x "
        "over static configurations on 32 H200s, measured against a baseline with 15x fewer samples per optimizer "
        "step; these numbers are iso-batch and simulated (no measured kernels, no overlap of communication), so "
        "they bound what the plan can give rather than report a run.\n\n" + table + "\n\n![speedups](simulate.png)\n"
    )
    (args.output / "simulate.md").write_text(report)
    print(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
