"""Packed (varlen) against right-padded micro-batches: the same sequences, one training step each.

The planner packs short sequences of different lengths into one micro-batch and its cost model
counts only their tokens. This benchmark measures what that assumption is worth end to end:
``TinyGPT`` compiled with ``backend="dcp"`` trains on micro-batches of long-tailed lengths, each
run twice in alternation (ABAB, same weights):

* padded: ``[n, max_len]`` rows, right-padded, causal SDPA (labels -100 on the padding);
* packed: one ``[1, sum(len)]`` row (``dcp.pack_sequences``), ``dcp.use(..., sequence_lengths=)``,
  every attention the varlen kernel (Triton on CUDA, the plain-torch reference on CPU).

Both compute the same loss (checked per micro-batch). Reported per micro-batch mix: the padding
ratio (positions computed / tokens), the step times and packed speedup (median of per-pair
ratios). On CPU the reference varlen attention loops over the sequences in Python, so this is a
lower bound of what the Triton kernel gives on a GPU.

    PYTHONPATH=. python benchmarks/packed_vs_padded.py [--device cuda] [--repeats 7]
"""

from __future__ import annotations

import argparse
import csv
import os
import statistics
import sys
import time
from pathlib import Path

import torch

import dcp_compile as dcp
from dcp_compile.demo.training_demo import collate, long_tailed_lengths, pack
from dcp_compile.demo.example_models import TinyGPT

from run_description import library_version, machine  # noqa: E402  (benchmarks/ is on sys.path)

RESULTS = Path(__file__).resolve().parent / "results"
# (name, number of sequences, shortest, longest): mixes like the planner's packed micro-batches
MIXES = [
    ("4 short", 4, 16, 128),
    ("8 mixed", 8, 16, 512),
    ("16 long-tailed", 16, 16, 1024),
]


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def step(compiled, model, batch, packed: bool, device: torch.device) -> tuple[float, float]:
    """Seconds of forward + backward, and the loss."""
    _synchronize(device)
    start = time.perf_counter()
    if packed:
        row = pack(batch, range(len(batch)), device)
        with dcp.use(dcp.Variant(1), sequence_lengths=row.sequence_lengths):
            loss = compiled(row.input_ids, row.labels, row.position_ids)
    else:
        ids, labels = collate(batch, range(len(batch)), device)
        with dcp.use(dcp.Variant(1)):
            loss = compiled(ids, labels)
    loss.backward()
    _synchronize(device)
    elapsed = time.perf_counter() - start
    model.zero_grad(set_to_none=True)
    return elapsed, float(loss.detach())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--repeats", type=int, default=7, help="timed pairs per mix")
    parser.add_argument("--inner", default="aot_eager", choices=["aot_eager", "inductor"])
    parser.add_argument("--suffix", default="", help="appended to the result file names")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    torch.manual_seed(0)
    if device.type == "cpu":
        torch.set_num_threads(1)
    model = TinyGPT(vocab=512, hidden=128, layers=2, heads=4).to(device)
    compiled = torch.compile(model, backend="dcp", dynamic=True, options={"inner": args.inner})
    generator = torch.Generator().manual_seed(0)
    rows = []
    load_start = os.getloadavg()[0]
    started = time.perf_counter()
    for name, count, shortest, longest in MIXES:
        lengths = long_tailed_lengths(count, seed=count, shortest=shortest, longest=longest)
        batch = [torch.randint(1, 512, (n,), generator=generator) for n in lengths]
        for packed in (False, True):  # warm up: compile both, outside the timings
            step(compiled, model, batch, packed, device)
        times = {False: [], True: []}
        losses = {}
        for repeat in range(args.repeats):
            for packed in ((False, True) if repeat % 2 == 0 else (True, False)):
                seconds, losses[packed] = step(compiled, model, batch, packed, device)
                times[packed].append(seconds)
        ratios = [padded / packed for padded, packed in zip(times[False], times[True])]
        tokens = sum(lengths)
        rows.append({
            "mix": name, "sequences": count, "tokens": tokens, "longest": max(lengths),
            "padding_ratio": count * max(lengths) / tokens,
            "padded_ms": 1000 * statistics.median(times[False]), "packed_ms": 1000 * statistics.median(times[True]),
            "speedup": statistics.median(ratios), "speedup_min": min(ratios), "speedup_max": max(ratios),
            "loss_difference": abs(losses[False] - losses[True]),
        })
        r = rows[-1]
        print(f"{name:>16}: {tokens:>6} tokens, padding x{r['padding_ratio']:.2f}: padded {r['padded_ms']:.1f} ms, "
              f"packed {r['packed_ms']:.1f} ms, speedup {r['speedup']:.2f}x ({r['speedup_min']:.2f}-{r['speedup_max']:.2f}), "
              f"|loss diff| {r['loss_difference']:.1e}", flush=True)
    elapsed = time.perf_counter() - started
    write(rows, args, device, elapsed, load_start, os.getloadavg()[0])
    return 0


def write(rows: list[dict], args: argparse.Namespace, device: torch.device, elapsed: float,
          load_start: float, load_end: float) -> None:
    RESULTS.mkdir(exist_ok=True)
    stem = RESULTS / f"packed_vs_padded_{device.type}{args.suffix}"
    with open(stem.with_suffix(".csv"), "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    kernel = "Triton varlen kernel" if device.type == "cuda" else "plain-torch reference varlen attention (a Python loop over sequences)"
    lines = [
        "# Packed (varlen) vs right-padded micro-batches",
        "",
        f"Library at commit {library_version()}. Machine: {machine(device)}, {torch.get_num_threads()} thread(s); 1-minute load average {load_start:.1f} at the start, {load_end:.1f} at the end. "
        f"TinyGPT (vocab 512, hidden 128, 2 layers, 4 heads), `backend='dcp'`, inner `{args.inner}`, SP 1, forward + "
        f"backward. Packed attention: {kernel}. {args.repeats} timed pairs per mix in alternating order after a warm-up; "
        f"speedup = median of the per-pair ratios padded / packed (range in parentheses). Run took {elapsed:.0f} s: "
        f"`PYTHONPATH=. python benchmarks/packed_vs_padded.py {' '.join(sys.argv[1:])}`.",
        "",
        "| mix | sequences | tokens | longest | padding ratio (computed / tokens) | padded ms | packed ms | packed speedup | |loss difference| |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(f"| {r['mix']} | {r['sequences']} | {r['tokens']} | {r['longest']} | {r['padding_ratio']:.2f} | "
                     f"{r['padded_ms']:.1f} | {r['packed_ms']:.1f} | {r['speedup']:.2f}x ({r['speedup_min']:.2f}-"
                     f"{r['speedup_max']:.2f}) | {r['loss_difference']:.1e} |")
    lines += [
        "",
        "The losses agree (the padded batch's loss is the mean over its real tokens, the packed row's the same by "
        "construction of `dcp.pack_sequences`), so the two runs do the same training; the speedup is the padding "
        "they do not compute, minus what the varlen attention costs over padded SDPA.",
    ]
    stem.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print(f"wrote {stem}.md/.csv")


if __name__ == "__main__":
    raise SystemExit(main())
