"""Long sequences under one budget: DCP against the fixed lean setup (ALST's way) and every family.

Issue 37's yardstick for the lean memory policies: a variable-length mix whose longest samples need
them (``recompute=offload`` and ``lean``: whole blocks recomputed, their inputs in host memory, the
MLPs over chunks of tokens), Llama-3-8B under ZeRO-3 with optimizer offload. ALST (arXiv
2506.13996) trains such data with one setup for every sample: the lean policies on every
micro-batch, at the SP size that holds the longest (the ``fixed-lean`` family of
:func:`dcp_compile.schedule.comparison.contenders`). DCP takes them per micro-batch, only where
nothing faster holds it. Every family plans the same steps under one
:class:`~dcp_compile.schedule.comparison.Budget` (one cost model, one memory cap), each baseline
tuned on those steps, DCP not; a step costs its makespan plus the gradient all-reduce.

Workload: ``benchmarks/workloads.json`` setup ``long_sequences`` (fixed before any run), every
seed of the file. Label: **simulated** (the analytic cost model on the H100 preset; no measured
time). Writes ``benchmarks/results/long_sequences.md`` / ``.json``. Run:
``PYTHONPATH=. python benchmarks/long_sequences.py``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parent))
import workloads  # noqa: E402

from dcp_compile.schedule.comparison import Budget, plan_run  # noqa: E402
from dcp_compile.schedule.cost_model import CostModel, ModelProfile  # noqa: E402
from dcp_compile.schedule.hardware import Hardware  # noqa: E402
from dcp_compile.schedule.planner import Planner  # noqa: E402
from dcp_compile.schedule.step_time import step_time  # noqa: E402
from dcp_compile.variant import RECOMPUTE_POLICIES  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
HARDWARE = {"H100": Hardware.H100, "H200": Hardware.H200}


def run_configuration(setup: dict[str, Any], world: int, name: str, seed: int) -> dict[str, Any]:
    """One (world, distribution, seed): every family's tokens/s and the policies its plans use."""
    cost_model = CostModel(ModelProfile.from_config(setup["text_model"]), HARDWARE[setup["hardware"]],
                           optimizer_shards=world, state_sharding=setup["state_sharding"])
    fraction = setup["memory_fraction"]
    budget = Budget(cost_model, world, fraction)
    planner = Planner(cost_model, world, fraction)
    context = setup["context_window"][str(world)]
    steps = workloads.steps(workloads.distribution(name), seed, setup["tokens_per_rank"] * world, setup["steps"], context)
    pairs = [(s.lengths, s.spans) for s in steps]
    families, _ = plan_run(budget, pairs, context, with_ablation=False)
    tokens = sum(sum(s.lengths) for s in steps)

    def measured(contender) -> dict[str, Any]:
        times = [step_time(schedule, s.lengths, cost_model) for schedule, s in zip(contender.schedules, steps)]
        policies = Counter(mb.recompute.value for schedule in contender.schedules for mb in schedule.microbatches)
        peak = max(cost_model.peak_memory([s.lengths[p] for p in mb.positions], mb.sp_size, mb.recompute)
                   for schedule, s in zip(contender.schedules, steps) for mb in schedule.microbatches)
        return {
            "scheduler": contender.scheduler.name,
            "tokens_per_s": tokens / sum(t.unoverlapped for t in times),
            "tokens_per_s_overlapped": tokens / sum(t.overlapped for t in times),
            "micro_batches_by_policy": dict(policies),
            "peak_memory": peak,
            "memory_cap": budget.memory_cap,
        }

    return {
        "world": world, "distribution": name, "seed": seed, "context_window": context, "tokens": tokens,
        "samples": sum(len(s.lengths) for s in steps), "longest": max(max(s.lengths) for s in steps),
        "capacity_by_policy": {policy.value: max(cost_model.token_capacity(size, policy, budget.memory_cap)
                                                 for size in planner.sizes)
                               for policy in RECOMPUTE_POLICIES},
        "families": {family: measured(c) for family, c in families.items()},
    }


def _spread(values: Sequence[float]) -> str:
    return f"{statistics.median(values):.3f}x ({min(values):.3f}-{max(values):.3f})"


def report(rows: list[dict[str, Any]], setup: dict[str, Any], seeds: Sequence[int], elapsed: float) -> str:
    lines = [
        "# Long sequences: DCP against the fixed lean setup (simulated)", "",
        f"**{setup['label']}**", "",
        f"{setup['text_model']} on {setup['hardware']} GPUs, bf16, ZeRO-3 with optimizer offload "
        f"(`state_sharding=\"{setup['state_sharding']}\"`), cap {setup['memory_fraction']} of the device's memory "
        f"for every scheduler. Workload (`benchmarks/workloads.json` setup `long_sequences`, fixed before this run): "
        f"{', '.join(setup['distributions'])}, {setup['tokens_per_rank']:,} tokens per rank per step, "
        f"{setup['steps']} steps per seed, seeds {list(seeds)}, context window {setup['context_window']} by world "
        "(longer documents split). A step costs its makespan plus one unoverlapped all-reduce of the gradients.", "",
        "`fixed-lean`: ALST's way, static SP at the size that holds the longest sample under `recompute=lean`, "
        "every micro-batch under `lean` (tuned over the sizes that hold it). The other families as in "
        "`fair_simulation.md`; each baseline tuned on the steps it is measured on, DCP not.", "",
        "| ranks | distribution | longest sample | block holds | lean holds | DCP / fixed-lean | DCP / best baseline "
        "(which) | DCP's micro-batches by policy |",
        "|---:|---|---:|---:|---:|---|---|---|",
    ]
    keys = sorted({(r["world"], r["distribution"]) for r in rows})
    for world, name in keys:
        group = [r for r in rows if (r["world"], r["distribution"]) == (world, name)]
        lean_ratio = [r["families"]["dcp"]["tokens_per_s"] / r["families"]["fixed-lean"]["tokens_per_s"]
                      for r in group if "fixed-lean" in r["families"]]
        best_ratio, best_names, policies = [], [], Counter()
        for r in group:
            baselines = {f: v for f, v in r["families"].items() if f != "dcp"}
            best = max(baselines, key=lambda f: baselines[f]["tokens_per_s"])
            best_ratio.append(r["families"]["dcp"]["tokens_per_s"] / baselines[best]["tokens_per_s"])
            best_names.append(baselines[best]["scheduler"])
            policies.update(r["families"]["dcp"]["micro_batches_by_policy"])
        capacity = group[0]["capacity_by_policy"]
        lines.append(
            f"| {world} | {name} | {max(r['longest'] for r in group):,} | {capacity['block']:,} | {capacity['lean']:,} | "
            f"{_spread(lean_ratio) if lean_ratio else 'cannot train it'} | {_spread(best_ratio)} "
            f"({', '.join(dict.fromkeys(best_names))}) | "
            + ", ".join(f"{p} {n}" for p, n in sorted(policies.items(), key=lambda kv: -kv[1])) + " |")
    lines += ["", "Ratios: tokens/s, median (min-max) over the seeds. 'holds': the most tokens one micro-batch "
              "holds at any SP size under that policy and the cap.", "",
              "## Every family (tokens/s, median over seeds)", "",
              "| ranks | distribution | family | tuned configuration | tokens/s | DCP / family | largest peak / cap |",
              "|---:|---|---|---|---:|---:|---:|"]
    for world, name in keys:
        group = [r for r in rows if (r["world"], r["distribution"]) == (world, name)]
        for family in group[0]["families"]:
            present = [r for r in group if family in r["families"]]
            rate = statistics.median(r["families"][family]["tokens_per_s"] for r in present)
            ratio = statistics.median(r["families"]["dcp"]["tokens_per_s"] / r["families"][family]["tokens_per_s"]
                                      for r in present)
            peak = max(r["families"][family]["peak_memory"] / r["families"][family]["memory_cap"] for r in present)
            configs = ", ".join(dict.fromkeys(r["families"][family]["scheduler"] for r in present))
            lines.append(f"| {world} | {name} | {family} | {configs} | {rate:,.0f} | {ratio:.3f}x | {peak:.2f} |")
    lines += ["", f"Run took {elapsed:.0f} s of planning on this machine."]
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out-dir", default=str(RESULTS))
    args = parser.parse_args(argv)
    spec = workloads.load()
    setup = dict(spec["setups"]["long_sequences"])
    seeds = spec["seeds"]
    from tqdm.auto import tqdm

    configurations = [(w, d, s) for w in setup["worlds"] for d in setup["distributions"] for s in seeds]
    started = time.perf_counter()
    rows = [run_configuration(setup, *c) for c in tqdm(configurations, desc="long sequences (simulated)")]
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    text = report(rows, setup, seeds, time.perf_counter() - started)
    (out / "long_sequences.md").write_text(text)
    (out / "long_sequences.json").write_text(json.dumps({"setup": setup, "seeds": seeds, "rows": rows}, indent=1))
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
