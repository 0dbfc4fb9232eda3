"""Measured activation peak of one training step against the cost model's memory prediction, on CPU.

For each (model, recompute policy, SP size) point a *fresh* Python process builds a small model,
compiles it with ``backend="dcp"`` (inner compiler ``aot_eager``: AOTAutograd's min-cut
partitioner decides what the forward keeps, as under Inductor), and, at SP > 1, runs rank 0's
share of the group on a one-process fake world (:mod:`dcp_compile.device_profile.fake_world`,
as ``dcp.profile`` does: every collective returns a tensor of the size a real one would, its
pages written, so it is resident).

The measurement (DESIGN.md, "Performance evidence"): the process runs with
``MALLOC_MMAP_THRESHOLD_=65536``, so every block over 64 KiB is its own mapping and leaves the
resident set when it is freed. The model is built, compiled and warmed up (two full steps at
the measured length: both graphs compiled, parameter gradients allocated and then kept, zeroed,
with ``zero_grad(set_to_none=False)``, so the step's weight-gradient accumulation writes into
existing buffers), the inputs are made, and then:

1. ``before`` = ``VmRSS``: model, gradients, inputs, compiled code, Python: everything that is not
   the step's;
2. ``5`` is written to ``/proc/self/clear_refs``, which resets ``VmHWM`` (the peak resident set)
   to the present resident set;
3. one step (forward and backward) runs;
4. the activation peak is ``VmHWM - before``.

What that holds besides activations: one parameter-sized weight gradient at a time before it is
added to ``.grad`` (the models here are small: a few MiB), and allocator noise under 64 KiB per
block. The model's prediction of the same thing is the per-token part of its peak,
``memory_coefficients(sp, policy).bytes_per_token * tokens`` (the fixed part is model state and the
runtime's reserve, which ``before`` holds), for a :class:`ModelProfile` of the exact shape (fp32:
``dtype_bytes=4``).

Writes ``benchmarks/results/memory_peaks_cpu.md`` and ``.json``. Run::

    PYTHONPATH=. python benchmarks/memory_peaks.py                 # every point (about 30 min, 2 cores)
    PYTHONPATH=. python benchmarks/memory_peaks.py --models tinygpt --sp 1 2 --policies none full

``--regions`` compiles with ``options={"regions": True}`` (``--regions both``: each point also
compiled whole, beside it) and prices with ``memory_coefficients(..., regions=True)``;
``--tokens`` takes several lengths. The regional sweep is ``benchmarks/results/memory_peaks_regions_cpu.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
POLICIES = ("none", "attention", "selective", "full", "block", "offload", "lean")
SP_SIZES = (1, 2, 4)
MMAP_THRESHOLD = "65536"
MiB = 2**20


@dataclass(frozen=True)
class ModelSpec:
    """A small model and the length of the measured micro-batch (one sample)."""

    name: str
    hidden: int
    heads: int
    layers: int
    tokens: int
    vocab: int = 0  # TinyGPT
    patch_dim: int = 0  # VideoDiT
    text_tokens: int = 0
    clip: tuple[int, int, int] = (0, 0, 0)  # VideoDiT: frames, rows, columns of patches
    copied_v: bool = False  # TinyGPT with v copied out of its fused q/k/v projection (_with_copied_v)


MODELS = {
    "tinygpt": ModelSpec("tinygpt", hidden=128, heads=4, layers=2, tokens=8192, vocab=512),
    # The check of TinyGPT's misses under regional `attention` and `full` at SP 1 (its v is a view
    # of the fused q/k/v projection, which the attention's checkpoint then keeps whole).
    "tinygpt-copied-v": ModelSpec("tinygpt-copied-v", hidden=128, heads=4, layers=2, tokens=4096, vocab=512,
                                  copied_v=True),
    "videodit": ModelSpec("videodit", hidden=128, heads=4, layers=2, tokens=8 * 32 * 32, patch_dim=16,
                          text_tokens=120, clip=(8, 32, 32)),
    # 3 heads: SP 2 and 4 do not divide them, so self-attention runs as ring x2 / ring x4 (and the
    # cross-attention as padded Ulysses).
    "videodit-3heads": ModelSpec("videodit-3heads", hidden=96, heads=3, layers=2, tokens=4 * 32 * 32, patch_dim=16,
                                 text_tokens=120, clip=(4, 32, 32)),
}


def profile_of(spec: ModelSpec):
    """The cost model's profile of the same shape (fp32 activations)."""
    from dcp_compile.schedule.model_profile import ModelProfile

    if spec.vocab:  # TinyGPT
        return ModelProfile.transformer(
            "tinygpt", num_layers=spec.layers, hidden_size=spec.hidden, num_heads=spec.heads,
            ffn_hidden_size=4 * spec.hidden, vocab_size=spec.vocab, causal=True, rotary=True, dtype_bytes=4,
            fused_qkv=not spec.copied_v,  # TinyGPT's q, k, v are slices of one projection
        )
    return ModelProfile.transformer(
        spec.name, num_layers=spec.layers, hidden_size=spec.hidden, num_heads=spec.heads,
        ffn_hidden_size=4 * spec.hidden, causal=False, cross_attention_tokens=spec.text_tokens,
        output_channels=spec.patch_dim, adaptive_norm=True, dtype_bytes=4,
    )


def predicted_parts(spec: ModelSpec, sp: int, policy: str, regions: bool = False) -> tuple[float, float]:
    """(device, host) bytes the cost model prices for one step's activations of a rank.

    Device: ``memory_coefficients(sp, policy).peak(tokens) - fixed_bytes``, every per-token term and
    the capped ones (the tiled loss's chunk, the tiled MLP's under ``lean``: a share shorter than a
    chunk holds the share) without the model state. Host: what ``offload`` and ``lean`` keep in
    host memory (``host_activation_bytes_per_token * tokens / sp``, the blocks' inputs; 0 for the
    other policies). On a CPU the host and the device are one memory, so the peak measured there
    is predicted by their sum, less what the device part prices as copied back from the host
    (``ModelProfile.reloaded_bytes_per_token``): on a CPU ``prims.device_put`` to the CPU returns
    the very tensor, so those are the host's bytes. ``regions``: the variant was compiled in regions
    (``options={"regions": True}``), whose ``attention`` and ``full`` keep more (priced by
    ``memory_coefficients(..., regions=True)``)."""
    from dcp_compile.schedule.analytic import memory_coefficients

    profile = profile_of(spec)
    coefficients = memory_coefficients(profile, sp, policy, regions=regions)
    device = coefficients.peak(spec.tokens) - coefficients.fixed_bytes - profile.reloaded_bytes_per_token(policy) * spec.tokens / sp
    return device, profile.host_activation_bytes_per_token(policy) * spec.tokens / sp


def predicted_bytes(spec: ModelSpec, sp: int, policy: str, regions: bool = False) -> float:
    """What the step's activation peak measured on CPU should be: device plus host (one memory)."""
    return sum(predicted_parts(spec, sp, policy, regions))


# ---------------------------------------------------------------------------------------------
# One point, in its own process
# ---------------------------------------------------------------------------------------------
def _status(key: str) -> int:
    with open("/proc/self/status") as handle:
        for line in handle:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {key} in /proc/self/status")


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as handle:
        handle.write("5")


def _build(spec: ModelSpec):
    import torch

    from dcp_compile.demo.example_models import TinyGPT, VideoDiT, video_dit_inputs

    torch.manual_seed(0)
    if spec.vocab:
        model = TinyGPT(vocab=spec.vocab, hidden=spec.hidden, layers=spec.layers, heads=spec.heads)
        if spec.copied_v:
            _with_copied_v(model)
        ids = torch.randint(0, spec.vocab, (1, spec.tokens), generator=torch.Generator().manual_seed(0))
        return model, {"input_ids": ids, "labels": ids.clone()}
    model = VideoDiT(patch_dim=spec.patch_dim, hidden=spec.hidden, heads=spec.heads, layers=spec.layers)
    _, rows, columns = spec.clip
    if spec.tokens % (rows * columns):
        raise ValueError(f"{spec.name}: {spec.tokens} tokens is not a whole number of {rows}x{columns} frames")
    clip = (spec.tokens // (rows * columns), rows, columns)  # the length sets the frame count
    inputs = video_dit_inputs(clip, 1, torch.Generator().manual_seed(0), patch_dim=spec.patch_dim,
                              hidden=spec.hidden, text_tokens=spec.text_tokens)
    return model, inputs


def _with_copied_v(model: Any) -> None:
    """TinyGPT's blocks with ``v`` copied out of the fused q/k/v projection. In TinyGPT ``v`` is a
    view of the projection's output while ``q`` and ``k`` are rotated copies, so whatever keeps ``v``
    keeps the whole projection (3 hidden-wide where 1 is priced); with ``v`` its own tensor the
    attention's inputs are the 3 hidden-wide tensors the cost model prices."""
    import torch.nn.functional as F

    from dcp_compile.demo.example_models import Block, rotate

    class CopiedVBlock(Block):
        def forward(self, x, cos, sin):  # Block.forward with v.contiguous()
            batch, length, hidden = x.shape
            q, k, v = self.qkv(self.norm1(x)).view(batch, length, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
            q, k, v = rotate(q, cos, sin), rotate(k, cos, sin), v.contiguous()
            attention = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + self.proj(attention.transpose(1, 2).reshape(batch, length, hidden))
            return x + self.mlp(self.norm2(x))

    for block in model.blocks:
        block.__class__ = CopiedVBlock


def measure_point(spec: ModelSpec, sp: int, policy: str, inner: str = "aot_eager",
                  regions: bool = False) -> dict[str, Any]:
    """Run in a fresh process (``--point``): the activation peak of one step, in bytes; ``regions``
    compiles with ``options={"regions": True}`` (regional compilation, run-time checkpointing)."""
    import contextlib
    import gc

    import torch

    import dcp_compile as dcp
    from dcp_compile.device_profile.fake_world import fake_world
    from dcp_compile.variant import Variant

    if os.environ.get("MALLOC_MMAP_THRESHOLD_") != MMAP_THRESHOLD:
        raise RuntimeError(f"run with MALLOC_MMAP_THRESHOLD_={MMAP_THRESHOLD} (freed blocks must leave the resident set)")
    torch.set_num_threads(1)
    world = fake_world(sp) if sp > 1 else contextlib.nullcontext()
    with world:
        model, inputs = _build(spec)
        options = {"inner": inner, "check_ranks": False, "regions": regions}  # explicit: regions are the default
        options.update({"sp_size": 1} if sp == 1 else {"buckets": [{"max_len": None, "sp_size": sp}]})
        compiled = torch.compile(model, backend="dcp", dynamic=True, options=options)
        variant = Variant(sp, policy)

        def step() -> None:
            with dcp.use(variant):
                loss = compiled(**inputs)
            loss.backward()

        started = time.perf_counter()
        for _ in range(2):  # compile, then one warm step
            step()
            model.zero_grad(set_to_none=False)
        warm_seconds = time.perf_counter() - started
        gc.collect()
        before = _status("VmRSS")
        _reset_peak()
        started = time.perf_counter()
        step()
        seconds = time.perf_counter() - started
        peak = _status("VmHWM")
        after = _status("VmRSS")
        model.zero_grad(set_to_none=False)
    return {
        "model": spec.name, "sp": sp, "policy": policy, "tokens": spec.tokens, "inner": inner, "regions": regions,
        "rss_before": before, "vm_hwm": peak, "rss_after": after, "measured": peak - before,
        "step_seconds": seconds, "warmup_seconds": warm_seconds,
    }


def run_point(spec: ModelSpec, sp: int, policy: str, inner: str, timeout: float,
              regions: bool = False) -> dict[str, Any]:
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": MMAP_THRESHOLD, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    command = [sys.executable, str(Path(__file__).resolve()), "--point", spec.name, str(sp), policy,
               "--inner", inner, "--tokens", str(spec.tokens)] + (["--regions"] if regions else [])
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout, cwd=ROOT, check=False)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode or not lines:
        raise RuntimeError(f"point {spec.name} sp={sp} {policy} regions={regions} failed ({done.returncode}):\n{done.stderr[-4000:]}")
    return json.loads(lines[-1])


# ---------------------------------------------------------------------------------------------
# The table
# ---------------------------------------------------------------------------------------------
def with_prediction(row: dict[str, Any]) -> dict[str, Any]:
    """The row with the cost model's prediction of its activation peak, as the model prices it now."""
    spec = MODELS[row["model"]]
    if row["tokens"] != spec.tokens:
        spec = ModelSpec(**{**spec.__dict__, "tokens": row["tokens"]})
    device, host = predicted_parts(spec, row["sp"], row["policy"], row.get("regions", False))
    predicted = device + host
    return {**row, "predicted": predicted, "predicted_host": host, "error": (predicted - row["measured"]) / row["measured"]}


RING_MODELS = ("videodit-3heads",)  # whose self-attention runs as a ring at SP > 1

NOTES = [
    ("What the model prices per token of a rank's share: what backward keeps "
     "(`ModelProfile.saved_activation_bytes_per_token`) plus the largest working set of a phase of backward "
     "(`backward_working_bytes_per_token`: the head's, a layer's MLP's or attention's: what it rebuilds and "
     "the activation gradients alive meanwhile). With `aot_eager` every saved tensor lives until the end of "
     "the compiled backward (the saved tensors are the backward graph's inputs), which is what the model "
     "assumes; Inductor frees them as the backward goes, so there the model is an upper bound."),
    ("TinyGPT under `none` (-4% to -7%): its fused q/k/v projection stays whole because v is a view of it "
     "while q and k are rotated copies (5 hidden-wide tensors kept for the 3 priced), and the autograd of the "
     "q/k/v unbind builds a zero-filled buffer per q, k, v (the attention's backward then holds 12 hidden-wide "
     "gradients; the MLP's 10, priced, is the larger phase in the model). Both belong to this model's code."),
    ("The DiT at SP 1 (+8% to +10%): the attention output and the output projection's input are one tensor "
     "(the SDPA output's layout makes the reshape a view), priced as two, for the self- and the cross-attention; "
     "the per-sample text keys and values (120 tokens x 2 layers, under 1 MiB) are not per-token and not priced."),
    ("Ring rows (`videodit-3heads`: 3 heads at SP 2 and 4, self-attention as ring x2 / ring x4): "
     "`dcp::attention_block` computes each block's scores and probabilities in full, fp32 "
     "`[heads, S/r, S/r]` forward and backward (its backward holds four: at 4096 tokens and SP 2, "
     "4 x 48 MiB of the 243 MiB peak, measured with `torch.profiler`'s allocation events, the other 51 MiB "
     "against the model's 54 MiB (+7%); at SP 4, 4 x 12 MiB of 78 MiB, the other 30 MiB against 31.7 MiB). "
     "A quadratic buffer no per-token price can hold: "
     "the kernel, not the model, has to change (a per-block flash kernel that returns the log-sum-exp). "
     "The K/V blocks the ring keeps are priced (tests/test_memory_model.py compares with the compiled graphs)."),
    ("`block` rows: the model once priced a `block` backward as rebuilding `full`'s set plus the all-to-alls' "
     "outputs (`attention_kept_bytes_per_token(full)`), 14-17% over what `memory_peaks_block_cpu.md` measured "
     "(rows measured before the loss was tiled: not repriced); the rebuilt block holds q, k, v and the output as "
     "they arrive, in place of the local ones, so the extra is `attention_kept_bytes_per_token(none)` (the KV "
     "heads' replication only), priced so since 2026-12-06: `memory_peaks_lean_cpu.md`'s `block` rows at SP 2 "
     "read +2% to +4% (they read +17% to +18% before)."),
    ("`offload` and `lean` rows (`memory_peaks_lean_cpu.md`, TinyGPT's 2 layers): on a CPU `prims.device_put` to "
     "the CPU returns the very tensor, so the offload copies do not exist and `offload` measures what `block` does "
     "(104.3 / 57.1 / 100.2 MiB against 104.3 / 57.1 / 100.5 at 8192 SP 1, 8192 SP 2, 16384 SP 2). The prediction "
     "here is the device part plus the host part less the reloaded block inputs the device part prices (on a GPU "
     "they are copies; here they are the host's tensors)."),
    ("Tiled chunks in their phase: the tiled loss's chunk lives in the head's phase of backward and the tiled "
     "MLP's in an MLP's (`ModelProfile.backward_phases`, `MemoryCoefficients.phases`); they were once added beside "
     "the largest phase, which over-priced `full` by 10-12% and `lean` by 74-80% at these points."),
]


# The notes of a file with regional rows (``--regions``, ``memory_peaks_regions_cpu.md``).
REGION_NOTES = [
    NOTES[0],
    ("Regional rows (`compiled: regions`): the model is `memory_coefficients(sp, policy, regions=True)`. Under regions "
     "`attention` and `full` are `torch.utils.checkpoint` around regions at run time and a checkpoint keeps its inputs "
     "(`ModelProfile.regional_saved_bytes_per_token`): `attention` keeps each attention op's q, k, v (at SP 1 the "
     "whole-graph policy recomputes them; at SP > 1 they are the all-to-alls' outputs, kept either way); `full` keeps "
     "per attention the residual stream the region after it reads, the attention's q, k, v and its output as the next "
     "region receives it, plus the RoPE table and the tiled loss's input and targets (`dcp::tiled_cross_entropy` is an "
     "exchange region, never checkpointed). Backward rebuilds one region at a time "
     "(`ModelProfile.regional_backward_phases`). `none` checkpoints nothing and is priced as compiled whole."),
    ("What regions keep beside the whole graph (same points): at SP 1 `full` measured 1.17x (TinyGPT, 4096), 1.33x "
     "(TinyGPT, 8192) and 1.33x (DiT) the whole-graph peak, `attention` 1.17x, 1.19x and 1.14x; the whole-graph price "
     "of those regional points misses by -14%, -26% and -18% (`full`), -16%, -16% and -5% (`attention`). At SP 2 "
     "the two are alike (TinyGPT 0.94x-0.97x; DiT `full` 1.10x, 1.08x priced: a residual per cross-attention more)."),
    ("TinyGPT at SP 1 under regional `attention` and `full`: its v is a view of the fused q/k/v projection while q "
     "and k are rotated copies, so the attention's checkpoint keeps the whole projection: 5 hidden-wide tensors per "
     "layer, not 3. Priced since 2026-12-06 (`ModelProfile.attention_input_storage_bytes_per_token`: "
     "`transformer(fused_qkv=True)`, or read off the storages behind the attention's q, k, v by `ModelProfile.measure`; "
     "the stored rows' model column repriced with `--reprice` at b9ba983, their measurements unchanged); before, "
     "these rows read -7.3%, -7.4% (`attention`) and -11.6% (`full`). `tinygpt-copied-v` is TinyGPT with "
     "`v.contiguous()` in its blocks, priced without it. The whole-graph `none` rows' -7% at SP 1 has the same cause "
     "(v's view keeps the projection) and is not priced yet."),
    ("Regional `none` measured 4-5% below whole-graph `none` (TinyGPT; each region is partitioned apart): not "
     "investigated, priced as whole (-3% to +1%)."),
    ("Not measured: a ring layout (the SP size does not divide the heads) under regions, priced as `none` there "
     "(the ring's blocks are an exchange region, never recomputed: an upper bound); Inductor regions."),
]


REGIONS_RERUN = (
    "Rerun (about 30 min of wall time on this shared 2-core machine): `PYTHONPATH=. python benchmarks/memory_peaks.py "
    "--models tinygpt --tokens 4096 8192 --policies none attention full --sp 1 2 --regions both --stem "
    "memory_peaks_regions_cpu`, then with `--append`: `--models videodit --tokens 4096 --policies attention full --sp 1 2 "
    "--regions both` and `--models tinygpt-copied-v --tokens 4096 --policies attention full --sp 1 --regions`; "
    "`--reprice --stem memory_peaks_regions_cpu` reprices the stored rows with the present model.")


def write_tables(rows: list[dict[str, Any]], header: dict[str, Any], stem: str = "memory_peaks_cpu") -> None:
    RESULTS.mkdir(parents=True, exist_ok=True)
    regional = any(row.get("regions") for row in rows)  # a column saying how each point was compiled
    notes = REGION_NOTES if regional else NOTES
    header = {**header, "notes": notes}
    (RESULTS / f"{stem}.json").write_text(json.dumps({"header": header, "rows": rows}, indent=1) + "\n")
    lines = [
        "# Activation peak of one training step: measured on CPU vs the cost model",
        "",
        f"Written by `benchmarks/memory_peaks.py` (measured at commit {header['commit']}, {header['date']}); "
        f"{header['machine']}, torch {header['torch']}, inner compiler `{header['inner']}`, 1 thread. "
        + (REGIONS_RERUN if regional else
           "Rerun: `PYTHONPATH=. python benchmarks/memory_peaks.py` (and `--models videodit-3heads --policies none "
           "full --append` for the ring rows); `--reprice` reprices the stored rows with the present model."),
        "",
        "**Measured**: the peak resident set of a fresh process per point during one forward + backward, "
        "above its resident set just before the step (model built, compiled and warmed up by two steps, "
        "gradient buffers kept, inputs made), with `MALLOC_MMAP_THRESHOLD_=65536` and `VmHWM` reset by "
        "writing `5` to `/proc/self/clear_refs` before the step. SP > 1: rank 0's share on a one-process "
        "fake world (every collective returns a written buffer of the real size). **Model**: "
        "`memory_coefficients(sp, policy).peak(tokens) - fixed_bytes` (per-token and capped terms: the tiled "
        "loss's chunk, the tiled MLP's) for a `ModelProfile.transformer` of the same shape, fp32; for `offload` "
        "and `lean` plus the host bytes (`host_activation_bytes_per_token * tokens / sp`, column *host*): on a "
        "CPU the host memory they offload to is the same memory. Error = (model - measured) / measured: negative means the model "
        "under-prices (a plan it admits could not fit).",
    ]
    groups = [("Ulysses and SP 1", [r for r in rows if r["model"] not in RING_MODELS]),
              ("Ring layouts (the SP size does not divide the heads)", [r for r in rows if r["model"] in RING_MODELS])]
    for title, group in groups:
        if not group:
            continue
        lines += ["", f"## {title}", "",
                  "| model | tokens | policy | SP |" + (" compiled |" if regional else "")
                  + " measured MiB | model MiB | of it host | error | step s |",
                  "|---|---:|---|---:|" + ("---|" if regional else "") + "---:|---:|---:|---:|---:|"]
        for row in group:
            compiled = (" regions |" if row.get("regions") else " whole |") if regional else ""
            lines.append(
                f"| {row['model']} | {row['tokens']} | {row['policy']} | {row['sp']} |{compiled} {row['measured'] / MiB:.1f} | "
                f"{row['predicted'] / MiB:.1f} | {row.get('predicted_host', 0.0) / MiB:.1f} | "
                f"{100 * row['error']:+.1f}% | {row['step_seconds']:.1f} |")
        lines.append("")
        if regional:
            lines += [summary("Regional", [r for r in group if r.get("regions")]),
                      summary("Whole-graph", [r for r in group if not r.get("regions")])]
        else:
            lines.append(summary("", group))
    lines += ["", "## Notes", ""] + [f"- {note}" for note in notes]
    (RESULTS / f"{stem}.md").write_text("\n".join(lines) + "\n")


def summary(label: str, rows: list[dict[str, Any]]) -> str:
    """One line: the worst and median |error| of ``rows`` and how many are within 10%."""
    if not rows:
        return f"{label} points: none."
    errors = [abs(r["error"]) for r in rows]
    text = (f"worst |error| {100 * max(errors):.1f}%, median {100 * sorted(errors)[len(errors) // 2]:.1f}%, "
            f"{sum(e <= 0.10 for e in errors)} of {len(errors)} points within 10%.")
    return f"{label} points: {text}" if label else text[0].upper() + text[1:]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--point", nargs=3, metavar=("MODEL", "SP", "POLICY"), help=argparse.SUPPRESS)
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--policies", nargs="+", default=list(POLICIES), choices=list(POLICIES))
    parser.add_argument("--sp", nargs="+", type=int, default=list(SP_SIZES))
    parser.add_argument("--tokens", type=int, nargs="+", default=None,
                        help="override each model's micro-batch length (several: one point per length)")
    parser.add_argument("--regions", nargs="?", const="only", choices=("only", "both"), default=None,
                        help='compile with options={"regions": True}; "both": each point also compiled whole, beside it')
    parser.add_argument("--inner", default="aot_eager")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per point")
    parser.add_argument("--stem", default="memory_peaks_cpu", help="results file name (no extension)")
    parser.add_argument("--reprice", action="store_true",
                        help="measure nothing: reprice the rows of the existing results file with the present model")
    parser.add_argument("--append", action="store_true",
                        help="keep the existing results file's other rows (a point measured again replaces its row)")
    args = parser.parse_args(argv)
    if args.point:
        name, sp, policy = args.point
        spec = MODELS[name]
        if args.tokens:
            spec = ModelSpec(**{**spec.__dict__, "tokens": args.tokens[0]})
        print(json.dumps(measure_point(spec, int(sp), policy, args.inner, bool(args.regions))), flush=True)
        return

    if args.reprice:
        data = json.loads((RESULTS / f"{args.stem}.json").read_text())
        write_tables([with_prediction(row) for row in data["rows"]], data["header"], args.stem)
        return

    import torch

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT,
                            check=False).stdout.strip()
    header = {"commit": commit, "date": time.strftime("%Y-%m-%d"), "torch": torch.__version__, "inner": args.inner,
              "machine": f"{platform.machine()} CPU ({os.cpu_count()} cores)"}
    rows: list[dict[str, Any]] = []
    kept: list[dict[str, Any]] = []
    if args.append and (RESULTS / f"{args.stem}.json").exists():
        kept = json.loads((RESULTS / f"{args.stem}.json").read_text())["rows"]
    compiles = {None: (False,), "only": (True,), "both": (True, False)}[args.regions]
    for spec, policy, sp, regions in points(args.models, args.tokens, args.policies, args.sp, compiles):
        row = run_point(spec, sp, policy, args.inner, args.timeout, regions)
        try:
            row = with_prediction(row)
        except TypeError:  # a profile keyword this checkout's model lacks: measure now, reprice later
            row = {**row, "predicted": float("nan"), "error": float("nan")}
        rows.append(row)
        print(f"{spec.name:>9} {spec.tokens:>6} {policy:>9} sp={sp}{' regions' if regions else ''}: measured "
              f"{row['measured'] / MiB:8.1f} MiB, model {row['predicted'] / MiB:8.1f} MiB ({100 * row['error']:+.1f}%), "
              f"step {row['step_seconds']:.1f} s", flush=True)
        again = {point_key(r) for r in rows}
        write_tables([r for r in kept if point_key(r) not in again] + rows, header, args.stem)


def points(models: list[str], lengths: list[int] | None, policies: list[str], sp_sizes: list[int],
           compiles: tuple[bool, ...]) -> list[tuple[ModelSpec, str, int, bool]]:
    """Every (model at a length, policy, SP size, regions) to measure, a regional point beside its whole twin."""
    specs = [ModelSpec(**{**MODELS[name].__dict__, "tokens": tokens}) if tokens else MODELS[name]
             for name in models for tokens in (lengths or [0])]
    return [(spec, policy, sp, regions) for spec in specs for policy in policies for sp in sp_sizes for regions in compiles]


def point_key(row: dict[str, Any]) -> tuple:
    """What a row measured: a point measured again replaces its row (``--append``)."""
    return row["model"], row["tokens"], row["policy"], row["sp"], row.get("regions", False)


if __name__ == "__main__":
    main()
