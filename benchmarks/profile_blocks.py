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
CPU, not what a GPU gives. Writes ``benchmarks/results/profile_<device>.md`` and ``.json``.
Run: ``PYTHONPATH=. python benchmarks/profile_blocks.py [--device cuda] [--models dit gpt]``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

import dcp_compile as dcp
from dcp_compile.demo.example_models import TinyGPT, VideoDiT, video_dit_inputs
from dcp_compile.device_profile.device_timing import device_name, software_versions
from dcp_compile.schedule.measured_costs import markdown_report

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


def dit_target(device: torch.device, gpu: bool) -> Target:
    hidden, heads, layers, text = (1152, 16, 2, 300) if gpu else (128, 4, 2, 32)
    torch.manual_seed(0)
    model = VideoDiT(PATCH_DIM, hidden, heads, layers).to(device)
    unit = PATCH_ROWS * PATCH_ROWS

    def make(length: int) -> dict:
        shape = (max(1, length // unit), PATCH_ROWS, PATCH_ROWS)
        inputs = video_dit_inputs(shape, 1, torch.Generator().manual_seed(length), PATCH_DIM, hidden, text)
        return {k: v.to(device) for k, v in inputs.items()}

    scale = 8 if gpu else 1
    lengths = tuple(unit * scale * n for n in (2, 4, 8, 16))  # GPU: 1k..8k tokens; CPU: 128..1024
    held = tuple(unit * scale * n for n in (3, 6, 12, 24))
    prior = dcp.ModelProfile.transformer("videodit", num_layers=layers, hidden_size=hidden, num_heads=heads,
                                         causal=False, cross_attention_tokens=text)
    return Target("dit", f"VideoDiT width {hidden}, {heads} heads, {layers} blocks, caption {text} tokens",
                  model, make, lengths, held, False, prior)


def gpt_target(device: torch.device, gpu: bool) -> Target:
    hidden, heads, layers, vocab = (2048, 16, 4, 32000) if gpu else (128, 4, 2, 512)
    torch.manual_seed(0)
    model = TinyGPT(vocab, hidden, layers, heads).to(device)

    def make(length: int) -> tuple:
        ids = torch.randint(1, vocab, (1, length), generator=torch.Generator().manual_seed(length)).to(device)
        return ids, ids

    lengths = (1024, 2048, 4096, 8192) if gpu else (128, 256, 512, 1024)
    held = tuple(3 * n // 2 for n in lengths)
    prior = dcp.ModelProfile.transformer("gpt", num_layers=layers, hidden_size=hidden, num_heads=heads,
                                         ffn_hidden_size=4 * hidden, vocab_size=vocab, causal=True)
    return Target("gpt", f"TinyGPT width {hidden}, {heads} heads, {layers} layers, vocabulary {vocab}",
                  model, make, lengths, held, True, prior)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--models", nargs="+", default=["dit", "gpt"], choices=["dit", "gpt"])
    parser.add_argument("--sp", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--recompute", nargs="+", default=[p.value for p in dcp.RecomputePolicy])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--inner", default=None, choices=["inductor", "aot_eager", "eager"],
                        help="inner compiler (default: inductor on a GPU, aot_eager on a CPU)")
    parser.add_argument("--out-dir", default=str(RESULTS))
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    gpu = device.type == "cuda"
    if not gpu:
        torch.set_num_threads(1)
    inner = args.inner or ("inductor" if gpu else "aot_eager")
    started = time.perf_counter()
    sections, summary, records = [], [], {}
    for name in args.models:
        target = (dit_target if name == "dit" else gpt_target)(device, gpu)
        print(f"profiling {target.description} on {device_name(device)} ...", flush=True)
        context = torch.autocast("cuda", dtype=torch.bfloat16) if gpu else torch.autocast("cpu", enabled=False)
        with context:
            cost_model = dcp.profile(target.model, target.make_inputs, lengths=target.lengths, held_out=target.held_out,
                                     sp_sizes=args.sp, recompute=args.recompute, causal=target.causal,
                                     prior=target.prior, inner=inner, repeats=args.repeats)
        measured = cost_model.measured
        median, worst = measured.held_out_summary()
        summary.append(f"| {name} | {target.description} | {len(measured.measurements)} | {len(measured.held_out)} | "
                       f"{100 * median:.1f}% | {100 * worst:.1f}% |")
        sections.append(markdown_report(measured, title=f"{name}: {target.description}").replace("# ", "## ", 1))
        records[name] = measured.to_dict()
        print(f"  held-out error median {100 * median:.1f}%, worst {100 * worst:.1f}% "
              f"({time.perf_counter() - started:.0f} s)", flush=True)
    versions = software_versions(device)
    tag = "cuda_" + device_name(device).lower().replace(" ", "-") if gpu else "cpu"
    goal = ("Goal on a GPU: median <= 10%, worst <= 20%." if gpu else
            "Measured on a shared CPU (one thread, other jobs running; every time is the process's CPU time, "
            "which the other jobs do not move, where the wall clock moved repeats by up to 8x): the GPU figures come from "
            "`bash benchmarks/gpu_check.sh` when a GPU is lent; the issue's goal (median <= 10%, worst <= 20%) is for them.")
    lines = [f"# Profiled cost model, held out: {device_name(device)}", "",
             "**Measured** (" + ", ".join(f"{k} {v}" for k, v in versions.items()) + f", inner compiler {inner}). "
             "Each variant's per-rank work is timed on this device on a fake process group (compute only); "
             "the fit never sees the held-out lengths.", "", goal, "",
             "| model | what | fitted points | held-out points | median error | worst error |",
             "|---|---|---:|---:|---:|---:|", *summary, "", *sections]
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"profile_{tag}.md").write_text("\n".join(lines) + "\n")
    (out / f"profile_{tag}.json").write_text(json.dumps({"device": device_name(device), "software": versions,
                                                        "models": records}, indent=2))
    print("\n".join(lines[:8 + len(summary)]))
    print(f"wrote {out / f'profile_{tag}.md'} in {time.perf_counter() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
