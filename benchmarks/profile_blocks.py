"""How well a profiled cost model predicts: ``dcp.profile`` on a DiT block stack and a GPT block stack, held out.

For each model, ``dcp.profile`` times the per-rank work of every variant (SP 1, 2, 4, 8 x each
recompute policy) on this device at a few lengths, fits the cost model, and measures lengths the
fit did not see (midpoints, and 1.5x past the longest). The held-out error is what the planner's
numbers are worth on this device. Goal on a GPU: median <= 10%, worst <= 20%.

Models (measured, on the device named in the results):

* ``dit``: :class:`~dcp_compile.demo.example_models.VideoDiT`, an STDiT3-like block stack: full 3-D
  self-attention over the clip's latent tokens, cross-attention to a fixed caption (300 tokens on
  a GPU, as T5's in Open-Sora), adaLN-single. On a GPU at STDiT3-XL/2's width (1152, 16 heads), 2
  blocks, bf16 autocast; STDiT3 alternates spatial and temporal attention, this block attends over
  every token (as Wan and Open-Sora 2.0 do).
* ``gpt``: :class:`~dcp_compile.demo.example_models.TinyGPT` (RoPE, causal SDPA, cross-entropy),
  on a GPU at width 2048 (16 heads, a Llama-1B-wide stack), 4 layers, bf16.

On a CPU both run at toy width (one thread): the figures say how the method behaves on a shared
CPU, not what a GPU gives. ``--tiny`` (``gpu_check.sh --dry-run``) shrinks them further (one block,
short lengths, one repeat) to check the script, not to measure.

Each (SP size, model) is profiled apart, SP 1 of every model first, and the tables are rewritten
after each, saying how many of the planned rows they hold: a run stopped by ``--budget-s`` or by a
signal (``timeout --signal=INT``) leaves a valid, partial table. Communication is priced with the
preset of the device found (:func:`~dcp_compile.schedule.hardware.preset_for_device_name`).
Writes ``benchmarks/results/profile_<device>.md`` and ``.json`` (``--out-dir`` to change).
Run: ``PYTHONPATH=. python benchmarks/profile_blocks.py [--device cuda] [--models dit gpt]``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

import dcp_compile as dcp
from dcp_compile.demo.example_models import TinyGPT, VideoDiT, video_dit_inputs
from dcp_compile.device_profile import MEASURED_POLICIES
from dcp_compile.device_profile.device_timing import device_name, software_versions
from dcp_compile.device_profile.partial_results import DRY_RUN_LABEL, Progress, interruptible, write_atomic
from dcp_compile.schedule.hardware import Hardware, preset_for_device_name
from dcp_compile.schedule.measured_costs import MeasuredCosts, markdown_report

RESULTS = Path(__file__).resolve().parent / "results"
PATCH_DIM = 16
PATCH_ROWS = 8  # a DiT sample of n tokens is (n / 64) frames of 8 x 8 patches


@dataclass(frozen=True)
class Target:
    name: str
    description: str
    model: torch.nn.Module
    make_inputs: Callable[[int], Any]
    lengths: tuple[int, ...]
    held_out: tuple[int, ...]
    causal: bool
    prior: dcp.ModelProfile


def dit_target(device: torch.device, gpu: bool, tiny: bool = False) -> Target:
    hidden, heads, layers, text = (1152, 16, 2, 300) if gpu else (64, 2, 1, 8) if tiny else (128, 4, 2, 32)
    torch.manual_seed(0)
    model = VideoDiT(PATCH_DIM, hidden, heads, layers).to(device)
    unit = PATCH_ROWS * PATCH_ROWS

    def make(length: int) -> dict:
        shape = (max(1, length // unit), PATCH_ROWS, PATCH_ROWS)
        inputs = video_dit_inputs(shape, 1, torch.Generator().manual_seed(length), PATCH_DIM, hidden, text)
        return {k: v.to(device) for k, v in inputs.items()}

    scale = 8 if gpu else 1
    steps = (1, 2, 4) if tiny else (2, 4, 8, 16)
    lengths = tuple(unit * scale * n for n in steps)  # GPU: 1k..8k tokens; CPU: 128..1024; tiny: 64..256
    held = tuple(unit * scale * n for n in ((3,) if tiny else (3, 6, 12, 24)))
    prior = dcp.ModelProfile.transformer("videodit", num_layers=layers, hidden_size=hidden, num_heads=heads,
                                         causal=False, cross_attention_tokens=text)
    return Target("dit", f"VideoDiT width {hidden}, {heads} heads, {layers} blocks, caption {text} tokens",
                  model, make, lengths, held, False, prior)


def gpt_target(device: torch.device, gpu: bool, tiny: bool = False) -> Target:
    hidden, heads, layers, vocab = (2048, 16, 4, 32000) if gpu else (64, 2, 1, 128) if tiny else (128, 4, 2, 512)
    torch.manual_seed(0)
    model = TinyGPT(vocab, hidden, layers, heads).to(device)

    def make(length: int) -> tuple:
        ids = torch.randint(1, vocab, (1, length), generator=torch.Generator().manual_seed(length)).to(device)
        return ids, ids

    lengths = (1024, 2048, 4096, 8192) if gpu else (32, 64, 128) if tiny else (128, 256, 512, 1024)
    held = (48,) if tiny and not gpu else tuple(3 * n // 2 for n in lengths)
    prior = dcp.ModelProfile.transformer("gpt", num_layers=layers, hidden_size=hidden, num_heads=heads,
                                         ffn_hidden_size=4 * hidden, vocab_size=vocab, causal=True)
    return Target("gpt", f"TinyGPT width {hidden}, {heads} heads, {layers} layers, vocabulary {vocab}",
                  model, make, lengths, held, True, prior)


def merged(first: MeasuredCosts | None, more: MeasuredCosts) -> MeasuredCosts:
    """One model's profiles of several SP sizes as one record (each variant is fitted on its own
    points, so profiling SP sizes apart changes no fit)."""
    if first is None:
        return more
    return replace(first, fits=first.fits + more.fits, measurements=first.measurements + more.measurements,
                   held_out=first.held_out + more.held_out,
                   notes=tuple(dict.fromkeys(first.notes + more.notes)))


def error_cells(measured: MeasuredCosts) -> str:
    summary = measured.held_out_summary()
    if summary is None:
        return "- | -"
    return f"{100 * summary[0]:.1f}% | {100 * summary[1]:.1f}%"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--models", nargs="+", default=["dit", "gpt"], choices=["dit", "gpt"])
    parser.add_argument("--sp", type=int, nargs="+", default=None, help="SP sizes, in the order run (default 1 2 4 8; "
                        "1 2 with --tiny)")
    parser.add_argument("--recompute", nargs="+", default=None,
                        help="recompute policies (default every policy dcp.profile measures: all but block, "
                             "whose compute is full's; none full with --tiny)")
    parser.add_argument("--repeats", type=int, default=None, help="timed rounds (default 5; 1 with --tiny)")
    parser.add_argument("--inner", default=None, choices=["inductor", "aot_eager", "eager"],
                        help="inner compiler (default: inductor on a GPU, aot_eager on a CPU)")
    parser.add_argument("--budget-s", type=float, default=None,
                        help="start no (SP size, model) row that the time left would not fit (the last row's time "
                             "as the estimate); the tables say the run stopped there")
    parser.add_argument("--tiny", action="store_true",
                        help="smallest widths and lengths, one repeat (the dry run of gpu_check.sh: checks the "
                             "script, measures nothing worth reading)")
    parser.add_argument("--out-dir", default=str(RESULTS))
    args = parser.parse_args(argv)
    args.sp = args.sp or ([1, 2] if args.tiny else [1, 2, 4, 8])
    args.recompute = args.recompute or (["none", "full"] if args.tiny else [p.value for p in MEASURED_POLICIES])
    args.repeats = args.repeats or (1 if args.tiny else 5)
    device = torch.device(args.device)
    gpu = device.type == "cuda"
    if not gpu:
        torch.set_num_threads(1)
    inner = args.inner or ("inductor" if gpu else "aot_eager")
    hardware = preset_for_device_name(torch.cuda.get_device_name(device) if gpu else "cpu")
    started = time.perf_counter()
    targets = {name: (dit_target if name == "dit" else gpt_target)(device, gpu, args.tiny) for name in args.models}
    rows = [(sp, name) for sp in args.sp for name in args.models]  # SP 1 of every model first
    progress = Progress(len(rows), unit="(SP size, model) rows")
    measured: dict[str, MeasuredCosts | None] = {name: None for name in args.models}
    row_lines: list[str] = []
    out = Path(args.out_dir)
    versions = software_versions(device)
    tag = "cuda_" + device_name(device).lower().replace(" ", "-") if gpu else "cpu"

    def flush() -> None:
        write_tables(out, tag, device, versions, inner, hardware, args, targets, measured, row_lines, progress)

    flush()  # an empty table that says so, before the first (long) compile
    last_row_s = 0.0
    with interruptible(progress, flush):
        for sp, name in rows:
            elapsed = time.perf_counter() - started
            if args.budget_s is not None and elapsed + last_row_s > args.budget_s:
                progress.stopped = (f"--budget-s {args.budget_s:g} s: {elapsed:.0f} s spent, the last row took "
                                    f"{last_row_s:.0f} s")
                print(progress.status(), flush=True)
                break
            target = targets[name]
            print(f"profiling {target.description}, SP {sp}, on {device_name(device)} ...", flush=True)
            row_start = time.perf_counter()
            torch._dynamo.reset()  # each row compiles afresh: earlier rows' traces must not hit the recompile limit
            context = torch.autocast("cuda", dtype=torch.bfloat16) if gpu else torch.autocast("cpu", enabled=False)
            with context:
                cost_model = dcp.profile(target.model, target.make_inputs, lengths=target.lengths,
                                         held_out=target.held_out, sp_sizes=[sp], recompute=args.recompute,
                                         causal=target.causal, prior=target.prior, hardware=hardware, inner=inner,
                                         repeats=args.repeats, progress=False)
            last_row_s = time.perf_counter() - row_start
            row = cost_model.measured
            measured[name] = merged(measured[name], row)
            row_lines.append(f"| {name} | {sp} | {len(row.measurements)} | {len(row.held_out)} | {error_cells(row)} | "
                             f"{last_row_s:.0f} |")
            progress.done += 1
            flush()
            print(f"  SP {sp}: held-out error {error_cells(row).replace(' | ', ' median, worst ')} "
                  f"({last_row_s:.0f} s; {time.perf_counter() - started:.0f} s in all)", flush=True)
    flush()
    print((out / f"profile_{tag}.md").read_text().split("\n## ")[0])
    print(f"wrote {out / f'profile_{tag}.md'} in {time.perf_counter() - started:.0f} s ({progress.status()})")
    return 0


def write_tables(out: Path, tag: str, device: torch.device, versions: dict, inner: str, hardware: Hardware,
                 args: argparse.Namespace, targets: dict[str, Target], measured: dict[str, MeasuredCosts | None],
                 row_lines: list[str], progress: Progress) -> None:
    """profile_<tag>.md and .json with every row measured so far (rewritten after each row)."""
    gpu = device.type == "cuda"
    goal = ("Goal on a GPU: median <= 10%, worst <= 20%." if gpu else
            "Measured on a shared CPU (one thread, other jobs running; every time is the process's CPU time, "
            "which the other jobs do not move, where the wall clock moved repeats by up to 8x): the GPU figures come from "
            "`bash benchmarks/gpu_check.sh` when a GPU is lent; the issue's goal (median <= 10%, worst <= 20%) is for them.")
    label = ([f"**{DRY_RUN_LABEL}** (`--tiny`: toy sizes, one repeat; it checks the script and measures nothing "
              "worth reading).", ""] if args.tiny and not gpu else [])
    summary = [f"| {name} | {targets[name].description} | {len(m.measurements)} | {len(m.held_out)} | "
               f"{error_cells(m)} |" for name, m in measured.items() if m is not None]
    sections = [markdown_report(m, title=f"{name}: {targets[name].description}").replace("# ", "## ", 1)
                for name, m in measured.items() if m is not None]
    lines = [f"# Profiled cost model, held out: {device_name(device)}", "", *label,
             f"Status: {progress.status()}.", "",
             "**Measured** (" + ", ".join(f"{k} {v}" for k, v in versions.items()) + f", inner compiler {inner}, "
             f"{args.repeats} timed rounds; communication priced with the {hardware.name} preset). "
             "Each variant's per-rank work is timed on this device on a fake process group (compute only); "
             "the fit never sees the held-out lengths. Each SP size of each model is profiled apart, SP "
             + " then ".join(map(str, args.sp)) + ".", "", goal, "",
             "| model | what | fitted points | held-out points | median error | worst error |",
             "|---|---|---:|---:|---:|---:|", *summary, "",
             "By row, in the order run:", "",
             "| model | SP | fitted points | held-out points | median error | worst error | seconds |",
             "|---|---:|---:|---:|---:|---:|---:|", *row_lines, "", *sections]
    write_atomic(out / f"profile_{tag}.md", "\n".join(lines) + "\n")
    write_atomic(out / f"profile_{tag}.json", json.dumps({
        "device": device_name(device), "software": versions, "status": progress.status(),
        "complete": progress.complete, "dry_run": bool(args.tiny and not gpu), "label": label[0] if label else "",
        "hardware_preset": hardware.name, "inner": inner, "sp_sizes": args.sp, "recompute": args.recompute,
        "models": {name: m.to_dict() for name, m in measured.items() if m is not None}}, indent=2))


if __name__ == "__main__":
    sys.exit(main())
