"""DCP against every baseline under one budget, simulated: the planners' own cost model prices every plan.

Workloads, seeds, worlds, step sizes and memory caps come from ``benchmarks/workloads.json`` (setup
``simulated``), fixed before any run. For each memory cap, world, distribution and seed, every
scheduler of :func:`dcp_compile.schedule.comparison.contenders` plans the same steps (iso-batch)
under one :class:`~dcp_compile.schedule.comparison.Budget` (the same cost model and memory cap);
each baseline family is tuned on those steps (its best SP size, threshold, policy), DCP is not.
A step costs its makespan plus the gradient all-reduce, unoverlapped (what ``dcp.sync_gradients``
does) and overlapped the way DDP buckets it (:mod:`dcp_compile.schedule.step_time`). The ablation
splits DCP's gain over the tuned static SP into recompute, accumulation and SP choice.

Label: **simulated** (the analytic cost model of Llama-3-8B and STDiT3-XL/2 on the H100 preset;
no measured time). Writes ``benchmarks/results/fair_simulation.md`` / ``.json``. Run:
``PYTHONPATH=. python benchmarks/fair_simulation.py [--quick]``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parent))
import workloads  # noqa: E402

from dcp_compile.schedule.comparison import ABLATION_RUNGS, BASELINE_FAMILIES, Budget, plan_run  # noqa: E402
from dcp_compile.schedule.cost_model import CostModel, ModelProfile  # noqa: E402
from dcp_compile.schedule.hardware import Hardware  # noqa: E402
from dcp_compile.schedule.planner import Planner  # noqa: E402
from dcp_compile.schedule.step_time import step_time  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
HARDWARE = {"H100": Hardware.H100, "H200": Hardware.H200}


def cost_model_for(model: str, hardware: str, world: int) -> CostModel:
    """bf16 with ZeRO-1 over the world (the optimizer state sharded), as the published setting."""
    return CostModel(ModelProfile.from_config(model), HARDWARE[hardware], optimizer_shards=world)


def run_configuration(setup: dict[str, Any], fraction: float, world: int, name: str, seed: int) -> dict[str, Any]:
    """One (cap, world, distribution, seed): every family's and every rung's tokens/s."""
    dist = workloads.distribution(name)
    model = setup["video_model"] if dist.video else setup["text_model"]
    cost_model = cost_model_for(model, setup["hardware"], world)
    budget = Budget(cost_model, world, fraction)
    planner = Planner(cost_model, world, fraction)
    if dist.video:  # a clip longer than the world holds is not trained by this setup (workloads.json),
        # under the smallest cap compared, so that every cap trains the same clips
        context = max(Planner(cost_model, world, min(setup["memory_fractions"])).max_capacity)
        per_rank = setup["video_tokens_per_rank"]
    else:
        context = setup["context_window"][str(world)]
        per_rank = setup["tokens_per_rank"]
    row = {"memory_fraction": fraction, "world": world, "distribution": name, "model": model, "seed": seed,
           "context_window": context}
    if context <= 0 or max(planner.max_capacity) < context:
        static = cost_model.memory_coefficients(1, "full").fixed_bytes
        # The published system checkpoints whole blocks (keeps less per token): say whether it would fit.
        block = replace(cost_model, collectives_recomputed=True)
        published = max(block.token_capacity(s, "full", budget.memory_cap) for s in planner.sizes)
        return {**row, "families": {}, "ablation": {},
                "no_fit": (f"no plan fits: the model state ({static / 1e9:.1f} GB) leaves room for {max(planner.max_capacity):,} "
                           f"tokens under the {budget.memory_cap / 1e9:.0f} GB cap (whole-block checkpointing, as the "
                           f"published system runs: {published:,}), the context window is {context:,}")}
    steps = workloads.steps(dist, seed, per_rank * world, setup["steps"], context)
    pairs = [(s.lengths, s.spans) for s in steps]
    families, ablation = plan_run(budget, pairs, context)
    tokens = sum(sum(s.lengths) for s in steps)
    bound = sum(planner.lower_bound(s.lengths, s.spans) for s in steps)

    def measured(contender) -> dict[str, float]:
        times = [step_time(schedule, s.lengths, cost_model) for schedule, s in zip(contender.schedules, steps)]
        return {
            "scheduler": contender.scheduler.name,
            "memory_cap": contender.scheduler.memory_cap,
            "tokens_per_s": tokens / sum(t.unoverlapped for t in times),
            "tokens_per_s_overlapped": tokens / sum(t.overlapped for t in times),
            "compute_s": sum(t.compute for t in times),
            "configurations": contender.configurations,
        }

    return {
        **row, "tokens": tokens, "samples": sum(len(s.lengths) for s in steps),
        "steps": len(steps), "sync_s": step_time(families["dcp"].schedules[0], steps[0].lengths, cost_model).sync,
        "bound_s": bound,
        "families": {family: measured(c) for family, c in families.items()},
        "ablation": {rung: measured(c) for rung, c in ablation.items()},
        "dcp_chosen_from": [s.chosen_from for s in families["dcp"].schedules],
    }


def _spread(values: Sequence[float]) -> str:
    return f"{statistics.median(values):.3f}x ({min(values):.3f}-{max(values):.3f})"


def report(rows: list[dict[str, Any]], setup: dict[str, Any], elapsed: float) -> str:
    spec = workloads.load()
    lines = [
        "# DCP against every baseline under one budget (simulated)", "",
        f"**{setup['label']}**: {setup['text_model']} (text) and {setup['video_model']} (video) on "
        f"{setup['hardware']} GPUs (8 per node, NVLink inside, one 400 Gb/s InfiniBand NIC per GPU across), bf16, "
        "ZeRO-1. No time here was measured.", "",
        "Every scheduler of a row plans the same steps under one budget: the same cost model and the same memory cap "
        "(the fraction in the row, of the device's memory, for DCP and every baseline alike). Each baseline family "
        "is tuned on the very steps it is measured on (its best configuration of those listed below); DCP is not "
        "tuned. A step costs its makespan plus one all-reduce of the gradients over the world: *unoverlapped* "
        "after the last backward (what `dcp.sync_gradients` does) and *overlapped* the way DDP buckets it (25 MiB "
        "buckets, each reduced once every rank's last backward has produced it; `dcp_compile/schedule/step_time.py`).",
        "",
        f"Workloads (`benchmarks/workloads.json`, fixed before this run): {setup['steps']} steps per seed, seeds "
        f"{spec['seeds']}; text {setup['tokens_per_rank']:,} tokens per rank per step, context window "
        f"{setup['context_window']} by world; video {setup['video_tokens_per_rank']:,} tokens per rank per step, "
        "clips longer than the world holds under the smallest cap not trained (the same clips under every cap).", "",
        "- " + "\n- ".join(f"`{n}`: {d['source']}" for n, d in spec["distributions"].items()), "",
        "Families: `static-sp`, `bucket-parallel`, `dcp-inter`: the published system (VideoSys), whole-block "
        "checkpointing; `static-sp+recompute`: static SP at its best size, best-fit packing, longest-first "
        "balancing, the fastest recompute per micro-batch; `packed-static-cp`: Megatron Core's packing "
        "(`DpBalancedScheduler`) at its best CP size; `dynamic-cp`: Megatron Core's dynamic context parallelism "
        "(`DefaultDynamicCPScheduler`) at its best recompute policy and per-rank threshold "
        "(`dcp_compile/schedule/user_baselines.py` cites each).", "",
        "## DCP against the best baseline", "",
        "Tokens/s ratio DCP / best baseline of each seed (median, min-max over the seeds); the best baseline is "
        "picked per seed.", "",
        "| cap | ranks | distribution | best baseline (seeds) | DCP / best, unoverlapped | DCP / best, overlapped | "
        "DCP % of its bound |",
        "|---:|---:|---|---|---|---|---:|",
    ]
    no_fit = sorted({(r["memory_fraction"], r["world"], r["distribution"], r["no_fit"]) for r in rows if "no_fit" in r})
    rows = [r for r in rows if "no_fit" not in r]
    keys = sorted({(r["memory_fraction"], r["world"], r["distribution"]) for r in rows}, key=lambda k: (-k[0], k[1], k[2]))
    for fraction, world, name in keys:
        group = [r for r in rows if (r["memory_fraction"], r["world"], r["distribution"]) == (fraction, world, name)]
        ratios, ratios_overlapped, best_names, bounds = [], [], [], []
        for r in group:
            baselines = {f: v for f, v in r["families"].items() if f != "dcp"}
            best = max(baselines, key=lambda f: baselines[f]["tokens_per_s"])
            best_overlapped = max(baselines.values(), key=lambda v: v["tokens_per_s_overlapped"])
            ratios.append(r["families"]["dcp"]["tokens_per_s"] / baselines[best]["tokens_per_s"])
            ratios_overlapped.append(r["families"]["dcp"]["tokens_per_s_overlapped"] / best_overlapped["tokens_per_s_overlapped"])
            best_names.append(baselines[best]["scheduler"])
            bounds.append(100 * r["bound_s"] / r["families"]["dcp"]["compute_s"])
        lines.append(f"| {fraction} | {world} | {name} | {', '.join(dict.fromkeys(best_names))} | {_spread(ratios)} | "
                     f"{_spread(ratios_overlapped)} | {min(bounds):.0f}-{max(bounds):.0f}% |")
    lines += ["", "'% of its bound': the planner's lower bound on the compute makespan over DCP's compute makespan."]
    lines += [""] + [f"- cap {f}, {w} ranks, {n}: {reason}; not compared" for f, w, n, reason in no_fit]
    lines += ["",
              "## Every family (tokens/s, unoverlapped step, median over seeds; DCP / family)", "",
              "| cap | ranks | distribution | " + " | ".join(("dcp",) + BASELINE_FAMILIES) + " |",
              "|---:|---:|---|" + "---:|" * (1 + len(BASELINE_FAMILIES))]
    for fraction, world, name in keys:
        group = [r for r in rows if (r["memory_fraction"], r["world"], r["distribution"]) == (fraction, world, name)]
        cells = [f"{statistics.median(r['families']['dcp']['tokens_per_s'] for r in group):,.0f}"]
        for family in BASELINE_FAMILIES:
            present = [r for r in group if family in r["families"]]
            if not present:
                cells.append("cannot train it")
                continue
            rate = statistics.median(r["families"][family]["tokens_per_s"] for r in present)
            ratio = statistics.median(r["families"]["dcp"]["tokens_per_s"] / r["families"][family]["tokens_per_s"]
                                      for r in present)
            cells.append(f"{rate:,.0f} ({ratio:.2f}x)")
        lines.append(f"| {fraction} | {world} | {name} | " + " | ".join(cells) + " |")
    lines += ["", "A family that cannot train a row's longest sample under its cap is marked; the tuned "
              "configuration of each row is in the JSON (`scheduler`).", "",
              "## Where DCP's gain over static SP comes from (ablation, median over seeds)", "",
              "Each rung adds one freedom to the one before, at the tuned static SP size: one recompute policy for "
              "every micro-batch; the fastest policy per micro-batch; micro-batch contents and counts per group "
              "chosen by the planner (accumulation); every SP size (DCP). The ratio of consecutive rungs is that "
              "freedom's gain; their product is DCP / the first rung. (The split depends on the rungs' order.)", "",
              "| cap | ranks | distribution | static size | " + " | ".join(ABLATION_RUNGS) + " |",
              "|---:|---:|---|---:|" + "---:|" * len(ABLATION_RUNGS)]
    for fraction, world, name in keys:
        group = [r for r in rows if (r["memory_fraction"], r["world"], r["distribution"]) == (fraction, world, name)
                 and len(r["ablation"]) == len(ABLATION_RUNGS)]
        if not group:
            continue
        sizes = {r["families"]["static-sp+recompute"]["scheduler"] for r in group}
        cells = []
        for index, rung in enumerate(ABLATION_RUNGS):
            values = [r["ablation"][rung]["tokens_per_s"] for r in group]
            if index == 0:
                cells.append(f"{statistics.median(values):,.0f}")
            else:
                gains = [r["ablation"][rung]["tokens_per_s"] / r["ablation"][ABLATION_RUNGS[index - 1]]["tokens_per_s"]
                         for r in group]
                cells.append(f"{statistics.median(gains):.3f}x")
        lines.append(f"| {fraction} | {world} | {name} | {', '.join(sorted(sizes))} | " + " | ".join(cells) + " |")
    chosen = [c for r in rows for c in r["dcp_chosen_from"]]
    fallback = [c for c in chosen if c]
    lines += ["", f"DCP's plan came from a baseline candidate (the planner keeps a static-SP or dynamic-CP plan "
              f"when it is faster than its own) in {len(fallback)} of {len(chosen)} steps"
              + (f" ({', '.join(sorted(set(fallback)))})" if fallback else "") + ".", "",
              f"Run took {elapsed:.0f} s of planning on this machine."]
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one seed, one cap, 3 steps: a smoke run, not a result")
    parser.add_argument("--out-dir", default=str(RESULTS))
    args = parser.parse_args(argv)
    spec = workloads.load()
    setup = dict(spec["setups"]["simulated"])
    seeds = spec["seeds"]
    fractions = setup["memory_fractions"]
    if args.quick:
        seeds, fractions, setup["steps"] = seeds[:1], fractions[:1], 3
    from tqdm.auto import tqdm

    configurations = [(f, w, d, s) for f in fractions for w in setup["worlds"] for d in spec["distributions"] for s in seeds]
    started = time.perf_counter()
    rows = [run_configuration(setup, *c) for c in tqdm(configurations, desc="fair comparison (simulated)")]
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    name = "fair_simulation_quick" if args.quick else "fair_simulation"
    text = report(rows, setup, time.perf_counter() - started)
    (out / f"{name}.md").write_text(text)
    (out / f"{name}.json").write_text(json.dumps({"setup": setup, "seeds": seeds, "rows": rows}, indent=1))
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
