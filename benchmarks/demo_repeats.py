"""The main job, run several times as a user runs it: over several seeds, every run reported.

Runs ``python -m dcp_compile demo --seed S`` once per seed in ``--seeds`` (times ``--runs-per-seed``)
in a row on this machine, each under its own optional extra load: ``--spinners`` busy-looping
processes started before the run and stopped after it (on top of whatever else the machine is
doing; the load average before and after each run is recorded). Reads what each run wrote with
``--json`` and reports every run, wins and losses, on both clocks:

* the **wall clock**: each step's elapsed time on this machine (slowest rank), what a user waits;
* the **CPU clock** (reconstructed): each rank's process CPU time per micro-batch, composed into
  steps along the plan with the waits its SP groups and gradient sync impose (what the step would
  take with a core per rank);

each as DCP / static SP tokens/s with its paired 95% interval over the steps, and the cost model's
prediction with its error on each. **Measured** on this CPU.

The results page keeps earlier runs: rows accumulate in ``OUT``'s JSON (each labelled with the
commit it ran at and its seed) and the table between the page's ``demo_repeats`` markers is
rewritten from all of them; text outside the markers (notes on earlier series) is kept as is.
Run: ``PYTHONPATH=. python benchmarks/demo_repeats.py [--seeds 0 1 2] [--spinners 0]`` (the demo runs from the
current directory's ``dcp_compile``: ``python -m`` puts it first on the path).
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Sequence

RESULTS = Path(__file__).resolve().parent / "results"
BEGIN = "<!-- demo_repeats: begin (generated from the JSON beside this file; edit outside the markers) -->"
END = "<!-- demo_repeats: end -->"
DEMO_FILES = ("dcp_compile/demo", "dcp_compile/schedule", "dcp_compile/compiler", "dcp_compile/runtime")


def load_average() -> float:
    return os.getloadavg()[0]


def spin() -> None:
    while True:
        pass


def start_spinners(count: int) -> list[multiprocessing.Process]:
    spinners = [multiprocessing.get_context("spawn").Process(target=spin, daemon=True) for _ in range(count)]
    for process in spinners:
        process.start()
    return spinners


def stop_spinners(spinners: list[multiprocessing.Process]) -> None:
    for process in spinners:
        process.terminate()
    for process in spinners:
        process.join()


def commit_label() -> str:
    """The commit the runs ran at, with ``+dirty`` when the code the demo runs had uncommitted
    changes (a row must say what code made it)."""
    root = Path(__file__).resolve().parent.parent
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True,
                              check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", *DEMO_FILES], cwd=root, capture_output=True,
                               text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head + ("+dirty" if dirty else "")


def significance(interval: Sequence[float]) -> str:
    """"above", "below" or "spans" 1.0: where a paired interval lies (a win or loss only when it
    leaves 1.0)."""
    _, low, high = interval
    if not (math.isfinite(low) and math.isfinite(high)):
        return "n/a"
    return "above" if low > 1 else "below" if high < 1 else "spans"


def _count(rows: list[dict], key: str) -> str:
    found = [significance(r[key]) for r in rows]
    return (f"interval above 1.0 (DCP faster) in {found.count('above')}, spanning 1.0 in {found.count('spans')}, "
            f"below 1.0 (static SP faster) in {found.count('below')}")


def _ratios(rows: list[dict], key: str) -> str:
    return ", ".join(f"{r[key]:.2f}x" for r in rows)


def _errors(rows: list[dict], key: str) -> str:
    return ", ".join(f"{100 * (r['predicted_speedup'] / r[key] - 1):+.0f}%" for r in rows)


def summary_lines(rows: list[dict]) -> list[str]:
    """Per series (commit): wins and losses on each clock, by total ratio and by paired interval."""
    lines = []
    for commit in dict.fromkeys(r["commit"] for r in rows):
        series = [r for r in rows if r["commit"] == commit]
        seeds = ", ".join(map(str, sorted({r["seed"] for r in series})))
        lines.append(
            f"- **{commit}** ({len(series)} runs, seeds {seeds}): wall clock DCP / static {_ratios(series, 'wall_speedup')}: "
            f"DCP ahead in {sum(r['wall_speedup'] > 1 for r in series)} of {len(series)}, "
            f"{_count(series, 'wall_paired_speedup')}. CPU clock (reconstructed) {_ratios(series, 'speedup')}: DCP "
            f"ahead in {sum(r['speedup'] > 1 for r in series)} of {len(series)}, {_count(series, 'paired_speedup')}. "
            f"Prediction over measured, CPU clock: {_errors(series, 'speedup')}; wall clock: "
            f"{_errors(series, 'wall_speedup')}."
        )
    return lines


def table_lines(rows: list[dict]) -> list[str]:
    lines = [
        "| commit | run | seed | steps | spinners | load before / after | wall clock: DCP / static, per step (95% interval) "
        "| CPU clock (reconstructed): DCP / static, per step (95% interval) | predicted (as planned / at probed speed) "
        "| busy-time error DCP / static | profile held-out median / worst | max loss difference | run s |",
        "|---|---:|---:|---:|---:|---|---|---|---|---|---|---:|---:|",
    ]
    for r in rows:
        paired, low, high = r["paired_speedup"]
        wall_paired, wall_low, wall_high = r["wall_paired_speedup"]
        held = r.get("profile_held_out") or (math.nan, math.nan)
        lines.append(
            f"| {r['commit']} | {r['run']} | {r['seed']} | {r['steps']} | {r['spinners']} | "
            f"{r['load_before']:.1f} / {r['load_after']:.1f} | {r['wall_speedup']:.2f}x, {wall_paired:.2f}x "
            f"({wall_low:.2f}-{wall_high:.2f}) | {r['speedup']:.2f}x, {paired:.2f}x ({low:.2f}-{high:.2f}) | "
            f"{r['predicted_speedup']:.2f}x / {r['probed_speedup']:.2f}x | "
            f"{100 * r['prediction_errors'][0]:+.0f}% / {100 * r['prediction_errors'][1]:+.0f}% | "
            f"{100 * held[0]:.0f}% / {100 * held[1]:.0f}% | {r['max_loss_difference']:.1e} | {r['seconds']:.0f} |")
    return lines


def generated_block(rows: list[dict], verdict: Sequence[str]) -> list[str]:
    lines = [
        BEGIN, "",
        "Every run, wins and losses, on both clocks. **Wall clock**: each step's elapsed time on this machine "
        "(slowest rank), what a user waits. **CPU clock** (reconstructed, not observed): each rank's process CPU "
        "time per micro-batch, composed into steps along the plan with the waits its SP groups and gradient sync "
        "impose (`dcp_compile/demo/dedicated_cores.py`): the step with a core per rank. Each ratio is DCP / static "
        "SP tokens/s over the run, then the geometric mean of the per-step ratios with its 95% t-interval (each "
        "step's two runs back to back); a run shows a difference only where that interval leaves 1.0. The "
        "prediction is the profiled cost model's, as it planned (profiled on the CPU clock).", "",
        *summary_lines(rows), "",
        *table_lines(rows),
    ]
    if verdict:
        lines += ["", "The last run's verdict block (from its JSON: the lines the demo prints last):", "", "```", *verdict,
                  "```"]
    return lines + ["", END]


def write(rows: list[dict], out: str, verdict: Sequence[str]) -> None:
    """Rewrite the generated block of OUT from every row (a run cut short still leaves the ones done);
    text outside the markers stays."""
    path = Path(out)
    text = path.read_text() if path.exists() else "# The demo, run repeatedly on this machine (measured)\n\n"
    block = "\n".join(generated_block(rows, verdict))
    if BEGIN in text and END in text:
        text = text[:text.index(BEGIN)] + block + text[text.index(END) + len(END):]
    else:
        text = text.rstrip("\n") + "\n\n" + block + "\n"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def run_once(seed: int, steps: int, spinner_count: int) -> tuple[dict[str, Any], float, float, float]:
    """One demo run: (its JSON, load before, load after, seconds)."""
    spinners = start_spinners(spinner_count)
    try:
        time.sleep(5 if spinners else 0)  # let the load average see them
        before = load_average()
        start = time.perf_counter()
        with tempfile.TemporaryDirectory() as folder:
            path = Path(folder) / "demo.json"
            done = subprocess.run([sys.executable, "-m", "dcp_compile", "demo", "--seed", str(seed), "--steps",
                                   str(steps), "--json", str(path)], capture_output=True, text=True)
            seconds = time.perf_counter() - start
            after = load_average()
            if done.returncode != 0 or not path.exists():
                print(done.stdout[-3000:], done.stderr[-3000:])
                raise SystemExit(f"seed {seed} failed (exit {done.returncode})")
            result = json.loads(path.read_text())
    finally:
        stop_spinners(spinners)
    return result, before, after, seconds


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2],
                        help="one run per seed (data draw, initial weights and sampler order)")
    parser.add_argument("--runs-per-seed", type=int, default=1)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--spinners", default="0",
                        help="busy processes during each run, comma-separated (the last repeats)")
    parser.add_argument("--out", default=str(RESULTS / "demo_runs_cpu.md"))
    parser.add_argument("--commit", help="the rows' commit label, for a run from an exported tree without git "
                        "(default: this checkout's HEAD, +dirty when the demo's code has uncommitted changes)")
    args = parser.parse_args(argv)
    spinner_counts = [int(n) for n in args.spinners.split(",")]
    raw = Path(args.out).with_suffix(".json")
    rows: list[dict] = json.loads(raw.read_text()) if raw.exists() else []  # earlier runs are kept
    commit = args.commit or commit_label()
    plan = [seed for seed in args.seeds for _ in range(args.runs_per_seed)]
    for index, seed in enumerate(plan):
        spinners = spinner_counts[min(index, len(spinner_counts) - 1)]
        result, before, after, seconds = run_once(seed, args.steps, spinners)
        row = {key: result[key] for key in ("speedup", "paired_speedup", "wall_speedup", "wall_paired_speedup",
                                            "predicted_speedup", "probed_speedup", "prediction_errors",
                                            "max_loss_difference", "profile_held_out", "memory_cap_bytes",
                                            "verdict")}
        row.update(commit=commit, run=index + 1, seed=seed, steps=args.steps, spinners=spinners,
                   load_before=before, load_after=after, seconds=seconds)
        rows.append(row)
        raw.write_text(json.dumps(rows, indent=1))
        write(rows, args.out, result["verdict"])
        print(f"seed {seed} ({spinners} spinners, load {before:.1f}->{after:.1f}): wall clock DCP / static "
              f"{row['wall_speedup']:.2f}x ({significance(row['wall_paired_speedup'])} 1.0), CPU clock "
              f"{row['speedup']:.2f}x ({significance(row['paired_speedup'])} 1.0), predicted "
              f"{row['predicted_speedup']:.2f}x, {seconds:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
