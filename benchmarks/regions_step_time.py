"""Step time of regional compilation against whole-graph variants and plain ``torch.compile``.

Regional compilation (``options={"regions": True}``) runs the ops between compiled regions
(attention, collectives, dcp's ops) from Python and checks every compiled region's guards on every
call; a whole-graph variant is one compiled graph. This measures what that costs a training step:
a ``TinyGPT`` (``dcp_compile.demo.example_models``) forward + backward at SP 1 (one process, no
communication), under each of

* ``plain``: ``torch.compile(model, dynamic=True)`` with the same inner compiler;
* ``dcp whole``: ``backend="dcp"``, one compiled graph per variant (the default);
* ``dcp regions``: ``backend="dcp"``, ``options={"regions": True}``;

for recompute ``none`` and ``full``. All configurations are compiled first, then timed in rounds
that visit them in turn (so the machine's load moves them alike); the table gives each one's median
step (CPU time of the process, one torch thread) and its ratio to ``plain``. *Measured* on the CPU that runs it (one torch thread): the Python
work per step is the same on a GPU, where steps are longer and its share smaller.

    PYTHONPATH=. python benchmarks/regions_step_time.py --out benchmarks/results/regions_step_time_cpu.md
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
from pathlib import Path

import torch

from dcp_compile.demo.example_models import TinyGPT


def build(width: int, layers: int) -> TinyGPT:
    torch.manual_seed(0)
    return TinyGPT(vocab=256, hidden=width, layers=layers, heads=8)


def step(compiled, ids: torch.Tensor) -> float:
    """CPU seconds of one forward + backward: on one torch thread, what other jobs on a shared
    machine do not move (the wall clock moved these medians by more than their differences)."""
    start = time.process_time()
    compiled(ids, ids).backward()
    return time.process_time() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--inner", default="inductor", choices=["inductor", "aot_eager"])
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    ids = torch.randint(0, 256, (1, args.tokens))
    configurations = {}
    for recompute in ("none", "full"):
        for name, options in (("dcp whole", {}), ("dcp regions", {"regions": True})):
            model = build(args.width, args.layers)
            compiled = torch.compile(model, backend="dcp", dynamic=True,
                                     options={"inner": args.inner, "sp_size": 1, "recompute": recompute, **options})
            configurations[f"{name}, recompute={recompute}"] = compiled
    configurations["plain"] = torch.compile(build(args.width, args.layers), backend=args.inner, dynamic=True)
    for name, compiled in configurations.items():  # compile and warm up
        for _ in range(3):
            step(compiled, ids)
        print(f"compiled: {name}", flush=True)
    load_before = os.getloadavg()[0]
    times: dict[str, list[float]] = {name: [] for name in configurations}
    for _ in range(args.rounds):
        for name, compiled in configurations.items():
            times[name].append(step(compiled, ids))
    load_after = os.getloadavg()[0]
    plain = statistics.median(times["plain"])
    lines = [
        "# Step time: regional compilation, whole-graph variants and plain torch.compile",
        "",
        f"**Measured** on {platform.processor() or platform.machine()} (one torch thread), torch {torch.__version__}, "
        f"by `benchmarks/regions_step_time.py`: TinyGPT width {args.width}, {args.layers} layers, 8 heads, "
        f"{args.tokens} tokens, forward + backward at SP 1, inner compiler `{args.inner}`, median of {args.rounds} "
        "steps (CPU time of the process) per configuration, taken in rounds that visit every configuration in "
        "turn. Load average (1 min) "
        f"{load_before:.1f} before the timed rounds and {load_after:.1f} after, on {os.cpu_count()} CPUs.",
        "",
        "| configuration | median step (CPU ms) | ratio to plain | spread (min-max, CPU ms) |",
        "| --- | ---: | ---: | --- |",
    ]
    for name, samples in times.items():
        median = statistics.median(samples)
        lines.append(f"| {name} | {median * 1e3:.2f} | {median / plain:.3f}x | {min(samples) * 1e3:.2f}-"
                     f"{max(samples) * 1e3:.2f} |")
    report = "\n".join(lines) + "\n"
    print(report)
    if args.out:
        args.out.write_text(report)


if __name__ == "__main__":
    main()
