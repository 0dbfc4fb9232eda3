"""The main job, run several times as a user runs it: does it show the same winner every time?

Runs ``python -m dcp_compile demo`` ``--runs`` times in a row on this machine, each under its own
extra load: ``--spinners`` busy-looping processes started before the run and stopped after it (on
top of whatever else the machine is doing; the load average before and after each run is
recorded). Reads what each run wrote with ``--json``: DCP's speedup over static SP on the
demo's clock (each rank's process CPU time, composed along the plan), the per-step paired ratio
and its interval, the same on the wall clock, the cost model's prediction and its errors.
**Measured** on this CPU.

Writes ``benchmarks/results/demo_runs_cpu.md``. Run:
``PYTHONPATH=. python benchmarks/demo_repeats.py [--runs 5] [--spinners 0,2,4,6,8]``.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


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


def write(rows: list[dict], out: str, planned: int, misses: str) -> None:
    """The results page so far (rewritten after every run: a run cut short still leaves the ones done)."""
    winners = {"DCP" if r["speedup"] > 1 else "static SP" for r in rows}
    ratio_errors = [r["predicted_speedup"] / r["speedup"] - 1 for r in rows]
    busy_errors = [abs(e) for r in rows for e in r["prediction_errors"]]
    lines = [
        "# The demo, run repeatedly on this machine (measured)", "",
        f"`python -m dcp_compile demo` (2 gloo processes, one CPU thread each, 6 steps) run {len(rows)} times (of "
        f"{planned} planned) in a row on a shared 2-core machine, each run under its own extra load: busy-looping "
        "processes (spinners) started before it and stopped after it, on top of whatever else the machine ran; the "
        "load average (1 min) before and after each run is its background.", "",
        "The demo's clock is each rank's process CPU time per micro-batch, composed along the plan with the waits "
        "its SP groups and gradient sync impose (`dcp_compile/demo/dedicated_cores.py`): the step on cores of its "
        "own. The wall clock, which also counts the time the machine gave to other processes, is shown beside it.",
        "",
        f"- On the demo's clock DCP won {sum(r['speedup'] > 1 for r in rows)} of {len(rows)} runs"
        + (f": the same winner ({winners.pop()}) every time." if len(winners) == 1 else ": not the same winner every time."),
        f"- On the wall clock DCP won {sum(r['wall_speedup'] > 1 for r in rows)} of {len(rows)} runs.",
        f"- Predicted (by the profiled cost model, as it planned) over measured speedup: {', '.join(f'{100 * e:+.0f}%' for e in ratio_errors)}; "
        f"busy-time prediction errors: worst {100 * max(busy_errors):.0f}% over both schedules and all runs.", "",
        "| run | spinners | load before / after | DCP / static (CPU clock) | per step, paired (95% interval) | "
        "wall clock: DCP / static, paired (95% interval) | predicted (as planned / at the probed compute speed) | busy-time error "
        "DCP / static | profile held-out median / worst | max loss difference | run s |",
        "|---:|---:|---|---:|---|---|---|---|---|---:|---:|",
    ]
    for r in rows:
        paired, low, high = r["paired_speedup"]
        wall_paired, wall_low, wall_high = r["wall_paired_speedup"]
        held = r.get("profile_held_out") or (float("nan"), float("nan"))
        lines.append(
            f"| {r['run']} | {r['spinners']} | {r['load_before']:.1f} / {r['load_after']:.1f} | {r['speedup']:.2f}x | "
            f"{paired:.2f}x ({low:.2f}-{high:.2f}) | {r['wall_speedup']:.2f}x, {wall_paired:.2f}x "
            f"({wall_low:.2f}-{wall_high:.2f}) | {r['predicted_speedup']:.2f}x / {r['probed_speedup']:.2f}x | "
            f"{100 * r['prediction_errors'][0]:+.0f}% / {100 * r['prediction_errors'][1]:+.0f}% | "
            f"{100 * held[0]:.0f}% / {100 * held[1]:.0f}% | {r['max_loss_difference']:.1e} | {r['seconds']:.0f} |")
    if misses:
        lines += ["", "The last run's prediction, by kind of micro-batch (what it printed):", "", "```", misses.strip(), "```"]
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--spinners", default="0,2,4,6,8",
                        help="busy processes during each run, comma-separated (the last repeats)")
    parser.add_argument("--out", default=str(RESULTS / "demo_runs_cpu.md"))
    parser.add_argument("--resume", action="store_true",
                        help="keep the runs already in OUT's JSON and run the rest (a series stopped part way)")
    args = parser.parse_args(argv)
    spinner_counts = [int(n) for n in args.spinners.split(",")]
    raw = Path(args.out).with_suffix(".json")
    rows = json.loads(raw.read_text()) if args.resume and raw.exists() else []
    for run in range(len(rows), args.runs):
        spinners = start_spinners(spinner_counts[min(run, len(spinner_counts) - 1)])
        try:
            time.sleep(5 if spinners else 0)  # let the load average see them
            before = load_average()
            start = time.perf_counter()
            with tempfile.TemporaryDirectory() as folder:
                path = Path(folder) / "demo.json"
                done = subprocess.run([sys.executable, "-m", "dcp_compile", "demo", "--json", str(path)],
                                      capture_output=True, text=True)
                seconds = time.perf_counter() - start
                after = load_average()
                if done.returncode != 0 or not path.exists():
                    print(done.stdout[-3000:], done.stderr[-3000:])
                    raise SystemExit(f"run {run + 1} failed (exit {done.returncode})")
                result = json.loads(path.read_text())
        finally:
            stop_spinners(spinners)
        row = {key: result[key] for key in ("speedup", "paired_speedup", "wall_speedup", "wall_paired_speedup",
                                            "predicted_speedup", "probed_speedup", "prediction_errors",
                                            "max_loss_difference", "profile_held_out")}
        row.update(run=run + 1, spinners=len(spinners), load_before=before, load_after=after, seconds=seconds)
        rows.append(row)
        out = done.stdout
        misses = out[out.index("Where the prediction misses"):] if "Where the prediction misses" in out else ""
        write(rows, args.out, args.runs, misses)
        raw.write_text(json.dumps(rows, indent=1))
        print(f"run {run + 1} ({len(spinners)} spinners, load {before:.1f}->{after:.1f}): DCP {row['speedup']:.2f}x "
              f"static SP on the CPU clock (wall {row['wall_speedup']:.2f}x), predicted {row['predicted_speedup']:.2f}x, "
              f"{seconds:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
