"""The main job, run several times as a user runs it: does it show the same winner every time?

Runs ``python -m dcp_compile demo`` ``--runs`` times in a row on this machine (whatever else it
is doing: the load average before and after each run is recorded) and reads what each run
printed: DCP's measured speedup over static SP, the per-step paired ratio and its interval, the
cost model's predicted speedup, and its busy-time errors. **Measured** on this CPU.

Writes ``benchmarks/results/demo_runs_cpu.md``. Run: ``PYTHONPATH=. python benchmarks/demo_repeats.py [--runs 5]``.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
SPEEDUP = re.compile(r"DCP trained (\d+\.\d+)x the tokens/s of static SP over (\d+) steps \(measured; the profiled "
                     r"cost model predicted (\d+\.\d+)x at the machine's probed speed, (\d+\.\d+)x as profiled\)")
PAIRED = re.compile(r"Step by step .*?: (\d+\.\d+)x, 95% interval (\d+\.\d+)-(\d+\.\d+)x")
ERRORS = re.compile(r"at the probed speed: DCP ([+-]\d+)%, static SP ([+-]\d+)%; as profiled: DCP ([+-]\d+)%, "
                    r"static SP ([+-]\d+)%")
HELD_OUT = re.compile(r"held-out error median (\d+)%, worst (\d+)%")


def load_average() -> float:
    return os.getloadavg()[0]


def write(rows: list[dict], out: str, planned: int, misses: str) -> None:
    """The results page so far (rewritten after every run: a run cut short still leaves the ones done)."""
    winners = {"DCP" if r["measured"] > 1 else "static SP" for r in rows}
    ratio_errors = [r["predicted"] / r["measured"] - 1 for r in rows]
    busy_errors = [abs(r[key]) for r in rows for key in ("dcp_error", "static_error")]
    lines = [
        "# The demo, run repeatedly on this machine (measured)", "",
        f"`python -m dcp_compile demo` (2 gloo processes, one CPU thread each, TinyGPT of width 256, 6 steps) run {len(rows)} times (of {planned} planned) "
        f"in a row on a shared 2-core machine; the load average (1 min) before and after each run is its background. "
        f"Winner of each run: **{' / '.join(sorted(winners))}**. Predicted (at the probed speed) over measured "
        f"speedup: {', '.join(f'{100 * e:+.0f}%' for e in ratio_errors)}; busy-time prediction errors at the probed "
        f"speed: worst {max(busy_errors)}% over both schedules and all runs.", "",
        "| run | load before / after | measured DCP / static | per step, paired (95% interval) | predicted "
        "(probed speed / as profiled) | busy-time error DCP / static (probed; as profiled) | profile held-out "
        "median / worst | wall s |",
        "|---:|---|---:|---|---|---|---|---:|",
    ]
    for r in rows:
        lines.append(f"| {r['run']} | {r['load_before']:.1f} / {r['load_after']:.1f} | {r['measured']:.2f}x | "
                     f"{r['paired']:.2f}x ({r['low']:.2f}-{r['high']:.2f}) | {r['predicted']:.2f}x / "
                     f"{r['profiled']:.2f}x | {r['dcp_error']:+d}% / {r['static_error']:+d}% ({r['dcp_raw']:+d}% / "
                     f"{r['static_raw']:+d}%) | {r['held_median']}% / {r['held_worst']}% | "
                     f"{r['seconds']:.0f} |")
    if misses:
        lines += ["", "The last run's prediction, by kind of micro-batch (what it printed):", "", "```", misses.strip(), "```"]
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--out", default=str(RESULTS / "demo_runs_cpu.md"))
    args = parser.parse_args(argv)
    rows = []
    for run in range(args.runs):
        before = load_average()
        start = time.perf_counter()
        done = subprocess.run([sys.executable, "-m", "dcp_compile", "demo"], capture_output=True, text=True)
        seconds = time.perf_counter() - start
        out = done.stdout
        if done.returncode != 0 or not SPEEDUP.search(out):
            print(done.stdout[-3000:], done.stderr[-3000:])
            raise SystemExit(f"run {run} failed (exit {done.returncode})")
        measured, steps, predicted, profiled = SPEEDUP.search(out).groups()
        paired, low, high = PAIRED.search(out).groups()
        dcp_error, static_error, dcp_raw, static_raw = ERRORS.search(out).groups()
        held_median, held_worst = HELD_OUT.search(out).groups()
        row = dict(run=run + 1, load_before=before, load_after=load_average(), seconds=seconds, measured=float(measured),
                   paired=float(paired), low=float(low), high=float(high), predicted=float(predicted),
                   profiled=float(profiled), dcp_error=int(dcp_error), static_error=int(static_error),
                   dcp_raw=int(dcp_raw), static_raw=int(static_raw), held_median=int(held_median),
                   held_worst=int(held_worst))
        rows.append(row)
        misses = out[out.index("Where the prediction misses"):] if "Where the prediction misses" in out else ""
        write(rows, args.out, args.runs, misses)
        print(f"run {run + 1}: DCP {measured}x static SP (paired {paired}x, {low}-{high}), predicted {predicted}x "
              f"(as profiled {profiled}x), "
              f"busy-time error DCP {dcp_error}%, static {static_error}%, load {before:.1f}->{row['load_after']:.1f}, "
              f"{seconds:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
