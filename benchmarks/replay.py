"""Plans replayed on measured compute: DCP against every baseline under one budget, all-reduce in the step.

Workloads, seeds, worlds, step sizes and the model come from ``benchmarks/workloads.json`` (setup
``replay_cpu``, ``replay_gpu`` on CUDA, ``replay_tiny`` with ``--tiny``), fixed before any run. For
each world, distribution and seed, every scheduler of
:func:`dcp_compile.schedule.comparison.contenders` plans the same steps under one
:class:`~dcp_compile.schedule.comparison.Budget` (the same profiled cost model, the same memory cap),
each baseline family tuned on those steps by the cost model, DCP not tuned; the ablation ladder
splits DCP's gain over static SP.

Then each plan is *replayed*: every distinct per-rank micro-batch of every plan runs on this device
at its per-rank shapes (the compiled variant of its SP size and policy, on a one-process fake
world, so the time is the rank's compute alone), timed in rounds over all of them in a shuffled
order (median of ``repeats``), on two clocks: the process CPU time (one thread; what a shared CPU
cannot disturb) and the wall clock. A rank's time is its micro-batches' measured compute plus their
modelled all-to-alls; a step is its slowest rank plus the gradient all-reduce, unoverlapped (what
``dcp.sync_gradients`` does) and overlapped as DDP buckets it (:mod:`dcp_compile.schedule.step_time`).

Video (``video-opensora``, the setup's ``video`` block): a VideoDiT, compiled the same way, trains
the published bucket mix scaled by a coarser patch (the setup's ``latent_scale``; clips longer than
its context window are not trained). A DiT's micro-batch cannot pack clips of different shapes into
one row: it runs one call per clip shape in it (that shape's clips stacked as a batch), each timed
once as above on the variant of the micro-batch's SP size and policy; a micro-batch's time is the
sum of its calls', each call's all-to-alls modelled. Every scheduler shares a budget that packs
equal lengths only (``Budget.pack_equal_lengths_only``): DCP plans with
``PlannerConfig(pack_equal_lengths_only=True)``, static SP with recompute packs equal lengths, the
families that pack mixed lengths into one row (packed static CP, dynamic CP) cannot train it; the
published schedulers plan as published and their mixed micro-batches run one call per shape.

Labels: compute **measured** (this device, named in the results), communication **modelled**: on a
GPU from the preset of the GPU found (``preset_for_device_name``); on a CPU the H100 preset's link
bandwidths slowed by this CPU's measured matmul rate over the H100's dense bf16 peak, so that bytes
weigh against compute as they would on the cluster (latencies stay the preset's). Memory is a
stand-in on a CPU (the context-window sample fits on 4 ranks with full recompute under the cap, or
as the setup's ``stand_in`` says).

``--setup replay_long_cpu`` (issue 37): the long-sequence mix, scaled, whose longest samples need
``recompute=lean`` under the cap; the ``fixed-lean`` family is ALST's setup (lean on every
micro-batch at the SP size that holds the longest). Writes ``replay_long_cpu.md`` / ``.json``.

Tables are rewritten after every (world, distribution, seed) block, each saying how far the run got;
SIGINT/SIGTERM leave a partial table. Writes ``replay_<device>.md`` / ``.json``. Run:
``PYTHONPATH=. python benchmarks/replay.py [--tiny | --setup NAME] [--device cuda]``; a long run split over
processes (``--worlds``, ``--distributions``, ``--seeds``, each with its own ``--out-dir``, the
profiles shared through ``--profile-cache`` and ``--video-profile-cache``) is put together with
``--merge``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import random
import re
import statistics
import sys
import time
from collections import Counter
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Iterator, Sequence

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import workloads  # noqa: E402

import dcp_compile as dcp  # noqa: E402
from dcp_compile.compiler.variant_selection import use  # noqa: E402
from dcp_compile.demo.example_models import TinyGPT, VideoDiT, video_dit_inputs  # noqa: E402
from dcp_compile.device_profile.device_timing import device_name, software_versions, synchronize  # noqa: E402
from dcp_compile.device_profile.fake_world import fake_world  # noqa: E402
from dcp_compile.device_profile.partial_results import DRY_RUN_LABEL, Progress, interruptible, write_atomic  # noqa: E402
from dcp_compile.schedule.comparison import (  # noqa: E402
    ABLATION_RUNGS, BASELINE_FAMILIES, MIXED_PACKING_FAMILIES, Budget, Contender, plan_run)
from dcp_compile.schedule.hardware import Hardware, preset_for_device_name  # noqa: E402
from dcp_compile.schedule.measured_costs import markdown_report  # noqa: E402
from dcp_compile.schedule.plan import Schedule, ScheduledMicroBatch  # noqa: E402
from dcp_compile.schedule.step_time import StepTime, step_time  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
BAND = (1.5, 1 / 1.5)  # link speed factors of the band: fast, slow


def plan_families(budget: Budget, steps: Sequence[tuple[list[int], list[float] | None]], context: int,
                  ablation: bool = True):
    """Every family tuned on ``steps`` and (unless the setup leaves it out) the ablation ladder,
    all under ``budget``."""
    return plan_run(budget, steps, context, with_ablation=ablation)


def setup_for(device: torch.device, tiny: bool, name: str | None = None) -> dict[str, Any]:
    spec = workloads.load()
    name = name or ("replay_tiny" if tiny else ("replay_gpu" if device.type == "cuda" else "replay_cpu"))
    if name not in spec["setups"] or "model" not in spec["setups"][name]:
        replayable = sorted(k for k, v in spec["setups"].items() if "model" in v and "tokens_per_rank" in v)
        raise SystemExit(f"replay: no replay setup {name!r} in benchmarks/workloads.json (replay setups: {replayable})")
    setup = dict(spec["setups"][name], name=name)
    setup.setdefault("seeds", spec["seeds"])
    return setup


def text_distribution(name: str, setup: dict[str, Any]) -> workloads.Distribution:
    """A text distribution of the setup, its documents scaled by the setup's ``length_scale`` if any."""
    return workloads.distribution(name, length_scale=setup.get("length_scale"))


def build_model(setup: dict[str, Any], device: torch.device, dtype: torch.dtype) -> TinyGPT:
    torch.manual_seed(0)
    m = setup["model"]
    return TinyGPT(m["vocab"], m["width"], m["layers"], m["heads"]).to(device, dtype)


def build_dit(video: dict[str, Any], device: torch.device, dtype: torch.dtype) -> VideoDiT:
    torch.manual_seed(0)
    m = video["model"]
    return VideoDiT(m["patch_dim"], m["width"], m["heads"], m["layers"]).to(device, dtype)


def dit_prior(video: dict[str, Any], dtype: torch.dtype) -> dcp.ModelProfile:
    """VideoDiT's analytic profile (as ``benchmarks/memory_peaks.py``'s, whose memory model was
    measured within 10% on this CPU): full attention, the caption's cross-attention, adaLN."""
    m = video["model"]
    return dcp.ModelProfile.transformer(
        "replay-videodit", num_layers=m["layers"], hidden_size=m["width"], num_heads=m["heads"],
        ffn_hidden_size=4 * m["width"], causal=False, cross_attention_tokens=m["caption_tokens"],
        output_channels=m["patch_dim"], adaptive_norm=True, dtype_bytes=2 if dtype == torch.bfloat16 else 4)


def video_distribution(name: str, video: dict[str, Any]) -> workloads.Distribution:
    return workloads.distribution(name, video["latent_scale"])


def shape_of_length(name: str, video: dict[str, Any]) -> dict[int, workloads.Shape]:
    """Each token count of the scaled mix and the first bucket's shape with that many tokens."""
    shapes: dict[int, workloads.Shape] = {}
    for tokens, _, shape in video_distribution(name, video).buckets:
        shapes.setdefault(tokens, shape)
    return shapes


def dit_inputs(video: dict[str, Any], device: torch.device, dtype: torch.dtype):
    """``make(shape, batch)``: VideoDiT inputs of ``batch`` clips of ``shape``, seeded by both."""
    m = video["model"]

    def make(shape: workloads.Shape, batch: int) -> dict[str, torch.Tensor]:
        generator = torch.Generator().manual_seed(hash((tuple(shape), batch)) % 2**31)
        inputs = video_dit_inputs(tuple(shape), batch, generator, m["patch_dim"], m["width"], m["caption_tokens"])
        return {key: value.to(device, dtype if value.is_floating_point() else value.dtype) for key, value in inputs.items()}

    return make


@contextlib.contextmanager
def dit_compile_settings() -> Iterator[None]:
    """How the DiT compiles: without Dynamo's duck sizing (a clip's tokens, the batch, the caption
    and the channels must not share a symbol because two of them happen to be equal, which would
    trace again at the next shape), and an error rather than a silent eager fallback (which would
    time every SP size as the whole model) if the recompile limit were ever hit."""
    import torch.fx.experimental._config as fx_config

    with fx_config.patch(use_duck_shape=False), torch._dynamo.config.patch(fail_on_recompile_limit_hit=True):
        yield


def packed_inputs(vocab: int, device: torch.device):
    def make(lengths: list[int]):
        generator = torch.Generator().manual_seed(sum(lengths))
        packed = dcp.pack_sequences([torch.randint(1, vocab, (n,), generator=generator) for n in lengths])
        return tuple(t.to(device) for t in (packed.input_ids, packed.labels, packed.position_ids))
    return make


def link_model(device: torch.device) -> tuple[Hardware, str]:
    """The links of the GPU found; on a CPU the H100 preset's, slowed by its matmul speed over the H100 peak."""
    if device.type == "cuda":
        hardware = preset_for_device_name(torch.cuda.get_device_name(device))
        return hardware, (f"{hardware.name} preset links ({hardware.intra_node_bandwidth / 1e9:.0f} GB/s one way in a "
                          f"node of {hardware.gpus_per_node}; {hardware.inter_node_bandwidth / 1e9:.0f} GB/s across)")
    size = 512
    a, b = torch.randn(size, size), torch.randn(size, size)
    best = math.inf
    for _ in range(10):
        start = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - start)
    h100 = Hardware.H100
    ratio = (2 * size**3 / best) / h100.peak_flops
    hardware = replace(h100, name="H100 links at this CPU's speed", peak_flops=2 * size**3 / best,
                       intra_node_bandwidth=h100.intra_node_bandwidth * ratio,
                       inter_node_bandwidth=h100.inter_node_bandwidth * ratio,
                       host_link_bandwidth=h100.host_link_bandwidth * ratio)
    return hardware, (f"H100 preset link bandwidths slowed by this CPU's measured matmul rate over the H100 bf16 peak "
                      f"({ratio:.2e}): {hardware.intra_node_bandwidth / 1e6:.2f} MB/s in a node of 8, "
                      f"{hardware.inter_node_bandwidth / 1e6:.2f} MB/s across, {hardware.host_link_bandwidth / 1e6:.2f} "
                      "MB/s to host memory (offloaded activations); latencies as the preset's")


def with_links(cost_model: dcp.CostModel, factor: float) -> dcp.CostModel:
    hw = cost_model.hardware
    return replace(cost_model, hardware=replace(hw, intra_node_bandwidth=hw.intra_node_bandwidth * factor,
                                                inter_node_bandwidth=hw.inter_node_bandwidth * factor))


Key = tuple[Any, int, dcp.RecomputePolicy]  # (what one call runs, SP size, policy)


@dataclass(frozen=True)
class Measured:
    clock: float  # the device's clock: process CPU time on a one-thread CPU, else the wall clock
    wall: float


class Replayer:
    """Times every distinct per-rank call on the device: each variant once to compile, then
    ``repeats`` rounds over all calls in a shuffled order (median), so a slow phase of a shared
    machine spreads over every scheduler's micro-batches alike.

    A micro-batch is given as its samples (``clips``: a text sample's length here, a clip's shape
    in :class:`DiTReplayer`); :meth:`calls` says which calls run it. TinyGPT packs a micro-batch
    into one row: one call, keyed by its sorted lengths."""

    kind = "text"

    def __init__(self, model: TinyGPT, device: torch.device, vocab: int, repeats: int, inner: str) -> None:
        self.model, self.device, self.repeats = model, device, repeats
        self.compiled = torch.compile(model, backend="dcp", dynamic=True, options={"inner": inner, "check_ranks": False})
        self.make = packed_inputs(vocab, device)
        self.cache: dict[Key, Measured] = {}
        self.failed: dict[Key, str] = {}
        self.cpu_clock = device.type == "cpu" and torch.get_num_threads() == 1

    @staticmethod
    def key(lengths: Sequence[int], sp_size: int, recompute: dcp.RecomputePolicy | str) -> Key:
        return tuple(sorted(lengths)), sp_size, dcp.RecomputePolicy.parse(recompute)

    @classmethod
    def calls(cls, clips: Sequence[Any], sp_size: int, recompute: dcp.RecomputePolicy | str) -> list[Key]:
        """The calls that run a micro-batch of ``clips``: one packed row."""
        return [cls.key(clips, sp_size, recompute)]

    @staticmethod
    def call_lengths(key: Key) -> list[int]:
        """The sample lengths one call runs (what its communication is priced on)."""
        return list(key[0])

    @staticmethod
    def compile_key(key: Key) -> tuple:
        """Calls of one compile key share a compiled graph (a new length never re-traces)."""
        return key[1:]

    def _step(self, key: Key):
        lengths, sp_size, recompute = key
        inputs = self.make(list(lengths))
        variant = dcp.Variant(sp_size, recompute)

        def step() -> None:
            with use(variant, sequence_lengths=list(lengths)):
                loss = self.compiled(*inputs)
            loss.backward()
            self.model.zero_grad(set_to_none=False)

        return step

    def _runs(self, key: Key, step) -> bool:
        """Run ``step``; a call the runtime cannot run is recorded in ``failed`` (its scheduler's
        plan is then not replayed, and the table says so) instead of ending the run."""
        try:
            step()
            return True
        except Exception as error:  # noqa: BLE001 - any failure of the compiled call: reported
            self.failed[key] = f"{type(error).__name__}: {str(error).strip().splitlines()[0][:200]}"
            self.model.zero_grad(set_to_none=False)
            print(f"  replay: {self.kind} call {key} failed: {self.failed[key]}", flush=True)
            return False

    def measure(self, keys: set[Key]) -> None:
        from tqdm.auto import tqdm

        todo = sorted(keys - set(self.cache) - set(self.failed), key=lambda k: (k[1], k[2].value, k[0]))
        if not todo:
            return
        warmed = set()
        # One call per compiled graph compiles it, the longest first: the model's first call is
        # Dynamo's trace, whose sizes are every variant's hints. A hint that left a rank one token
        # once specialised the variant to it (fixed: compiler/workarounds/trace_hints.py); the order stays, so
        # that runs before and after the fix compile alike.
        for key in sorted(todo, key=lambda k: (k[1], k[2].value, -sum(self.call_lengths(k)))):
            if self.compile_key(key) not in warmed and self._runs(key, self._step(key)):
                warmed.add(self.compile_key(key))
        todo = [key for key in todo if key not in self.failed]
        clocks: dict[Key, list[float]] = {key: [] for key in todo}
        walls: dict[Key, list[float]] = {key: [] for key in todo}
        rng = random.Random(len(self.cache))
        with tqdm(total=self.repeats * len(todo), desc=f"replay: timing {self.kind} calls", unit="call", leave=False,
                  mininterval=0.1 if sys.stderr.isatty() else 60.0) as bar:
            for _ in range(self.repeats):
                order = list(todo)
                rng.shuffle(order)
                for key in order:
                    bar.update()
                    if key in self.failed:
                        continue
                    step = self._step(key)
                    synchronize(self.device)
                    cpu0, wall0 = time.process_time(), time.perf_counter()
                    if not self._runs(key, step):
                        continue
                    synchronize(self.device)
                    cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
                    clocks[key].append(cpu if self.cpu_clock else wall)
                    walls[key].append(wall)
        for key in todo:
            if key not in self.failed:
                self.cache[key] = Measured(statistics.median(clocks[key]), statistics.median(walls[key]))

    def seconds(self, clips: Sequence[Any], sp_size: int, recompute: dcp.RecomputePolicy, wall: bool = False) -> float:
        """A micro-batch's measured compute: the sum of its calls'."""
        total = 0.0
        for key in self.calls(clips, sp_size, recompute):
            measured = self.cache[key]
            total += measured.wall if wall else measured.clock
        return total


class DiTReplayer(Replayer):
    """Times a VideoDiT's calls: a micro-batch runs one call per clip shape in it (a DiT cannot
    pack clips of different shapes into one row; our runtime runs one call per shape), that
    shape's clips stacked as a batch. A call is keyed by ``((shape, count), sp, policy)``; the
    batch of one clip and the stacked batch are two compiled graphs (Dynamo specialises a size 1)."""

    kind = "video"

    def __init__(self, model: VideoDiT, device: torch.device, make, repeats: int, inner: str) -> None:
        self.model, self.device, self.repeats = model, device, repeats
        self.compiled = torch.compile(model, backend="dcp", dynamic=True, options={"inner": inner, "check_ranks": False})
        self.make = make
        self.cache: dict[Key, Measured] = {}
        self.failed: dict[Key, str] = {}
        self.cpu_clock = device.type == "cpu" and torch.get_num_threads() == 1

    @classmethod
    def calls(cls, clips: Sequence[Any], sp_size: int, recompute: dcp.RecomputePolicy | str) -> list[Key]:
        """One call per distinct shape of ``clips`` (shapes), in a fixed order."""
        policy = dcp.RecomputePolicy.parse(recompute)
        counts = Counter(tuple(shape) for shape in clips)
        return [((shape, counts[shape]), sp_size, policy) for shape in sorted(counts)]

    @staticmethod
    def call_lengths(key: Key) -> list[int]:
        (shape, count), _, _ = key
        return [math.prod(shape)] * count

    @staticmethod
    def compile_key(key: Key) -> tuple:
        return (key[0][1] > 1,) + tuple(key[1:])

    def _step(self, key: Key):
        (shape, count), sp_size, recompute = key
        inputs = self.make(shape, count)
        variant = dcp.Variant(sp_size, recompute)

        def step() -> None:
            with dit_compile_settings(), use(variant):
                loss = self.compiled(**inputs)
            loss.backward()
            self.model.zero_grad(set_to_none=False)

        return step


def keys_of(schedule: Schedule, clips: Sequence[Any], replayer: Replayer) -> set[Key]:
    """The calls a replay of ``schedule`` times (a fully recomputed micro-batch's also without
    recompute: DCP-inter's pyramid sits between the two). ``clips``: the step's samples as the
    replayer takes them (lengths, or clip shapes)."""
    keys = set()
    for mb in schedule.microbatches:
        mb_clips = [clips[p] for p in mb.positions]
        keys.update(replayer.calls(mb_clips, mb.sp_size, mb.recompute))
        if mb.recompute == dcp.RecomputePolicy.FULL:
            keys.update(replayer.calls(mb_clips, mb.sp_size, dcp.RecomputePolicy.NONE))
    return keys


def replayed_step(schedule: Schedule, lengths: Sequence[int], clips: Sequence[Any], replayer: Replayer,
                  model: dcp.CostModel, wall: bool = False) -> StepTime:
    """The step with each micro-batch's measured compute plus its modelled communication (each
    call's all-to-alls: one packed row for text, one call per clip shape for a DiT)."""
    silent = model.without_communication()

    def seconds(mb: ScheduledMicroBatch) -> float:
        mb_lengths = [lengths[p] for p in mb.positions]
        mb_clips = [clips[p] for p in mb.positions]
        measured = replayer.seconds(mb_clips, mb.sp_size, mb.recompute, wall)
        if mb.recompute == dcp.RecomputePolicy.FULL:
            # DCP-inter's pyramid keeps some layers unchecked: its predicted time sits between full
            # and none; replay the same share between the two measured times.
            full, none = (model.time(mb_lengths, mb.sp_size, p) for p in ("full", "none"))
            kept = min(max((full - mb.predicted_time) / (full - none), 0.0), 1.0) if full > none else 0.0
            if kept > 1e-9 and schedule.scheduler == "dcp-inter":
                measured -= kept * (measured - replayer.seconds(mb_clips, mb.sp_size, dcp.RecomputePolicy.NONE, wall))
        communication = 0.0
        for key in replayer.calls(mb_clips, mb.sp_size, mb.recompute):
            call = replayer.call_lengths(key)
            communication += model.time(call, mb.sp_size, mb.recompute) - silent.time(call, mb.sp_size, mb.recompute)
        return measured + communication

    return step_time(schedule, lengths, model, seconds)


def clips_of(step: workloads.Step) -> list[Any]:
    """A step's samples as a replayer takes them: clip shapes for video, else lengths."""
    return list(step.shapes) if step.shapes is not None else list(step.lengths)


def block_rows(world: int, name: str, seed: int, steps, contenders: dict[str, Contender], ablation: bool,
               replayer: Replayer, model: dcp.CostModel) -> list[dict[str, Any]]:
    tokens = sum(sum(s.lengths) for s in steps)
    band = [with_links(model, f) for f in BAND]
    rows = []
    for label, contender in contenders.items():
        def total(cost_model: dcp.CostModel, wall: bool = False) -> list[StepTime]:
            return [replayed_step(schedule, s.lengths, clips_of(s), replayer, cost_model, wall)
                    for schedule, s in zip(contender.schedules, steps)]

        main, wall = total(model), total(model, wall=True)
        fast, slow = total(band[0]), total(band[1])
        predicted = [step_time(schedule, s.lengths, model) for schedule, s in zip(contender.schedules, steps)]
        rows.append({
            "world": world, "distribution": name, "seed": seed, "family": label, "ablation": ablation, "kind": replayer.kind,
            "scheduler": contender.scheduler.name, "memory_cap": contender.scheduler.memory_cap, "tokens": tokens,
            "tokens_per_s": tokens / sum(t.unoverlapped for t in main),
            "tokens_per_s_overlapped": tokens / sum(t.overlapped for t in main),
            "tokens_per_s_wall": tokens / sum(t.unoverlapped for t in wall),
            "tokens_per_s_fast_links": tokens / sum(t.unoverlapped for t in fast),
            "tokens_per_s_slow_links": tokens / sum(t.unoverlapped for t in slow),
            "tokens_per_s_predicted": tokens / sum(t.unoverlapped for t in predicted),
            "sync_s_per_step": main[0].sync, "compute_s": sum(t.compute for t in main),
            "configurations": contender.configurations,
            "chosen_from": [s.chosen_from for s in contender.schedules] if label == "dcp" else None,
        })
    return rows


def _spread(values: Sequence[float]) -> str:
    if not values:
        return "-"
    return f"{statistics.median(values):.2f}x ({min(values):.2f}-{max(values):.2f})"


def kinds_of(meta: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Per model kind ("text", "video"): its memory cap, memory capacity, profile and timed calls.
    Results files written before the video replay keep the text's at the top level."""
    if "kinds" in meta:
        return meta["kinds"]
    if "memory_cap" not in meta:
        return {}
    return {"text": {"memory_cap": meta["memory_cap"], "memory_capacity": meta["memory_capacity"],
                     "profile": meta.get("profile", ""), "timed": meta.get("micro_batches", 0)}}


def _workload_lines(setup: dict[str, Any], meta: dict[str, Any], kinds: dict[str, dict[str, Any]]) -> list[str]:
    lines = []
    if "text" in kinds:
        text = kinds["text"]
        lines += [
            f"Text model: TinyGPT width {setup['model']['width']} x {setup['model']['layers']} layers, "
            f"{setup['model']['heads']} heads, vocabulary {setup['model']['vocab']}, {meta['dtype']}. Workloads "
            f"(`benchmarks/workloads.json`, fixed before this run): {setup['steps']} steps per seed, seeds "
            f"{setup['seeds']}, {setup['tokens_per_rank']:,} tokens per rank per step, context window "
            f"{setup['context_window']:,} tokens; one memory cap for every scheduler: {text['memory_cap'] / 1e9:.3f} GB "
            f"({setup['memory_fraction']} of {text['memory_capacity'] / 1e9:.3f} GB"
            + (f"; {setup['stand_in_memory']}" if "stand_in_memory" in setup else "") + ").", ""]
        if "holds" in text:
            sizes = sorted({int(size) for held in text["holds"].values() for size in held})
            lines += ["Tokens one micro-batch holds under the cap (memory model), by policy and SP size:", "",
                      "| policy | " + " | ".join(f"SP {size}" for size in sizes) + " |", "|---|" + "---:|" * len(sizes),
                      *[f"| {policy} | " + " | ".join(f"{held[key]:,}" for key in sorted(held, key=int)) + " |"
                        for policy, held in text["holds"].items()], ""]
        lines += [f"- {what}: {setup[key]}." for key, what in (("model_reason", "Model"), ("length_reason", "Lengths"),
                                                                ("profile_reason", "Profile")) if key in setup]
        lines += [""] if any(key in setup for key in ("model_reason", "length_reason", "profile_reason")) else []
    if "video" in kinds:
        video, m = setup["video"], setup["video"]["model"]
        scale = video["latent_scale"]
        lines += [
            f"Video model: VideoDiT width {m['width']} x {m['layers']} blocks, {m['heads']} heads, patches of "
            f"{m['patch_dim']} channels, caption of {m['caption_tokens']} tokens, {meta['dtype']} ({video['model_reason']}). "
            f"Workload (`benchmarks/workloads.json`, setup `{setup.get('name', 'replay')}.video`, fixed before this run): "
            f"{setup['steps']} steps per seed, seeds {setup['seeds']}, {video['tokens_per_rank']:,} latent tokens per rank "
            f"per step ({video['tokens_reason']}), context window {video['context_window']:,} tokens "
            f"({video['context_reason']}); one memory cap for every scheduler: {kinds['video']['memory_cap'] / 1e9:.3f} GB "
            f"({setup['memory_fraction']} of {kinds['video']['memory_capacity'] / 1e9:.3f} GB; {video['stand_in_memory']}).",
            "",
            f"- Scaling: latent frames / {scale['frames']}, rows / {scale['rows']}, columns / {scale['columns']}, "
            f"rounded up: {video['scale_reason']}.",
            f"- Attention: {video['attention']}.",
            f"- Calls: {video['calls']}.",
            f"- Profile: {video['profile_reason']}.", ""]
    return lines


def report(rows: list[dict[str, Any]], meta: dict[str, Any], progress: Progress) -> str:
    setup = meta["setup"]
    spec = workloads.load()
    kinds = kinds_of(meta)
    video_names = {r["distribution"] for r in rows if r.get("kind") == "video"}
    lines = [
        f"# DCP against every baseline under one budget, replayed on {meta['device']}", "",
        f"**{meta['status']}**", "",
        f"**{setup['label']}.** Communication modelled: {meta['links']}. " + ", ".join(
            f"{k} {v}" for k, v in meta["software"].items()) + f"; inner compiler {meta['inner']}.", "",
        *_workload_lines(setup, meta, kinds),
        "- " + "\n- ".join(f"`{n}`: {spec['distributions'][n]['source']}" for n in setup["distributions"]), "",
        "Each baseline family is tuned on the very steps it is measured on (by the cost model); DCP is not. "
        "Families as in `benchmarks/results/fair_simulation.md`. A step: the slowest rank's measured compute plus "
        "modelled all-to-alls, plus the gradient all-reduce (modelled), *unoverlapped* after the last backward (what "
        "`dcp.sync_gradients` does) or *overlapped* as DDP buckets it.", "",
        "## DCP against the best baseline (tokens/s ratio; median and min-max over seeds)", "",
        "| ranks | distribution | best baseline | clock: unoverlapped | clock: overlapped | wall clock | "
        "links 1.5x slower..faster | predicted by the cost model |",
        "|---:|---|---|---|---|---|---|---|",
    ]
    main_rows = [r for r in rows if not r["ablation"]]
    blocks = sorted({(r["world"], r["distribution"]) for r in main_rows})
    for world, name in blocks:
        ratios: dict[str, list[float]] = {k: [] for k in ("tokens_per_s", "tokens_per_s_overlapped", "tokens_per_s_wall",
                                                          "tokens_per_s_slow_links", "tokens_per_s_fast_links",
                                                          "tokens_per_s_predicted")}
        best_names = []
        for seed in sorted({r["seed"] for r in main_rows if (r["world"], r["distribution"]) == (world, name)}):
            group = {r["family"]: r for r in main_rows if (r["world"], r["distribution"], r["seed"]) == (world, name, seed)}
            if "dcp" not in group or len(group) < 2:
                continue
            for metric in ratios:
                best = max(v[metric] for f, v in group.items() if f != "dcp")
                ratios[metric].append(group["dcp"][metric] / best)
            best_names.append(max((v for f, v in group.items() if f != "dcp"), key=lambda v: v["tokens_per_s"])["scheduler"])
        band = (f"{statistics.median(ratios['tokens_per_s_slow_links']):.2f}..{statistics.median(ratios['tokens_per_s_fast_links']):.2f}x"
                if ratios["tokens_per_s"] else "-")
        lines.append(f"| {world} | {name} | {', '.join(dict.fromkeys(best_names))} | {_spread(ratios['tokens_per_s'])} | "
                     f"{_spread(ratios['tokens_per_s_overlapped'])} | {_spread(ratios['tokens_per_s_wall'])} | {band} | "
                     f"{_spread(ratios['tokens_per_s_predicted'])} |")
    lines += ["", f"'clock': {meta['clock']}; 'wall clock': the same micro-batches timed by the wall clock in the same "
              "rounds. Both are reconstructed steps (measured micro-batches composed with modelled communication).", "",
              "## Every family (tokens/s on the clock, unoverlapped; median over seeds; DCP / family)", "",
              "| ranks | distribution | " + " | ".join(("dcp",) + BASELINE_FAMILIES) + " |",
              "|---:|---|" + "---:|" * (1 + len(BASELINE_FAMILIES))]
    for world, name in blocks:
        group = [r for r in main_rows if (r["world"], r["distribution"]) == (world, name)]
        dcp_rows = {r["seed"]: r for r in group if r["family"] == "dcp"}
        cells = [f"{statistics.median(r['tokens_per_s'] for r in dcp_rows.values()):,.0f}" if dcp_rows else "-"]
        for family in BASELINE_FAMILIES:
            present = [r for r in group if r["family"] == family and r["seed"] in dcp_rows]
            if not present:
                cells.append("packs mixed shapes: cannot train it" if name in video_names and family in MIXED_PACKING_FAMILIES
                             else "cannot train it")
                continue
            ratio = statistics.median(dcp_rows[r["seed"]]["tokens_per_s"] / r["tokens_per_s"] for r in present)
            cells.append(f"{statistics.median(r['tokens_per_s'] for r in present):,.0f} ({ratio:.2f}x)")
        lines.append(f"| {world} | {name} | " + " | ".join(cells) + " |")
    lines += ["", "## Where DCP's gain over static SP comes from (ablation; each rung's gain over the one before, "
              "median over seeds)", "",
              "| ranks | distribution | " + " | ".join(ABLATION_RUNGS) + " |", "|---:|---|" + "---:|" * len(ABLATION_RUNGS)]
    ablation_rows = [r for r in rows if r["ablation"]]
    for world, name in sorted({(r["world"], r["distribution"]) for r in ablation_rows}):
        seeds = sorted({r["seed"] for r in ablation_rows if (r["world"], r["distribution"]) == (world, name)})
        by_seed = {s: {r["family"]: r for r in ablation_rows if (r["world"], r["distribution"], r["seed"]) == (world, name, s)}
                   for s in seeds}
        by_seed = {s: v for s, v in by_seed.items() if len(v) == len(ABLATION_RUNGS)}
        if not by_seed:
            continue
        cells = [f"{statistics.median(v[ABLATION_RUNGS[0]]['tokens_per_s'] for v in by_seed.values()):,.0f} tokens/s"]
        for index in range(1, len(ABLATION_RUNGS)):
            cells.append(f"{statistics.median(v[ABLATION_RUNGS[index]]['tokens_per_s'] / v[ABLATION_RUNGS[index - 1]]['tokens_per_s'] for v in by_seed.values()):.3f}x")
        lines.append(f"| {world} | {name} | " + " | ".join(cells) + " |")
    chosen = [c for r in main_rows if r["family"] == "dcp" for c in (r["chosen_from"] or [])]
    timed = [f"{kinds['text']['timed']} distinct text micro-batches"] if "text" in kinds else []
    timed += [f"{kinds['video']['timed']} distinct video calls (clip shape, clips, SP size, policy)"] if "video" in kinds else []
    lines += ["", f"DCP's plan came from a baseline candidate in {sum(1 for c in chosen if c)} of {len(chosen)} steps.", ""]
    if video_names:
        lines += [f"Video ({', '.join(sorted(video_names))}): packed static CP and dynamic CP pack clips of mixed lengths "
                  "into one row, which a DiT cannot run: they are not compared. The published static SP, bucket parallel "
                  "and DCP-inter plan as published (priced on the cost model, which prices a micro-batch as one packed "
                  "call, as 'predicted' does for every family); their micro-batches of mixed shapes are replayed one "
                  "call per shape, as every video micro-batch is.", ""]
    if meta.get("not_replayed"):
        lines += ["Plans not replayed (a call the runtime could not run; that family's cell reads 'cannot train it'):", "",
                  *[f"- {line}" for line in meta["not_replayed"]], ""]
    lines += [" and ".join(timed) + f" timed; run time {meta['elapsed']:.0f} s.", ""]
    lines += [kinds[kind]["profile"] for kind in ("text", "video") if kind in kinds]
    return "\n".join(lines) + "\n"


def process_links(part: dict[str, Any]) -> list[str]:
    """Each process's link model in a results file (a merged file lists several)."""
    if "process_links" in part:
        return list(part["process_links"])
    links = part["links"]
    if links.startswith("process 1: "):  # a file merged before process_links was kept apart
        return [piece for piece in re.split(r"(?:^|; )process \d+: ", links) if piece]
    return [links]


def merge(paths: Sequence[str], out: Path, tag: str, setup: dict[str, Any]) -> int:
    """One page from results files of one setup (``setup``, as ``workloads.json`` has it now)
    written by several processes, each of some of its blocks (a merged file counts as the processes
    it merged). Each block's calls were timed within one process; each process measured its own CPU
    speed for the link model, so the page lists each process's links. A file whose setup differs
    from ``setup`` in anything but the blocks it ran is refused."""
    parts = [json.loads(Path(path).read_text()) for path in paths]
    for path, part in zip(paths, parts):
        theirs = part["setup"]
        differing = sorted(key for key in set(theirs) | set(setup) if key not in ("distributions", "worlds", "seeds", "video")
                           and theirs.get(key) != setup.get(key))
        if "video" in theirs and theirs["video"] != setup.get("video"):
            differing.append("video")
        if differing or not set(theirs["distributions"]) <= set(setup["distributions"]):
            raise SystemExit(f"replay --merge: {path} was run with another setup than {setup['name']} of "
                             f"benchmarks/workloads.json (differs in {differing or 'distributions'})")
    rows = [row for part in parts for row in part["rows"]]
    meta = {key: value for key, value in parts[0].items()
            if key not in ("rows", "memory_cap", "memory_capacity", "profile", "micro_batches", "kinds")}
    meta["setup"] = setup
    kinds: dict[str, dict[str, Any]] = {}
    for part in parts:
        for kind, info in kinds_of(part).items():
            if kind not in kinds:
                kinds[kind] = dict(info)
                continue
            kinds[kind]["timed"] += info["timed"]
            if info["profile"] not in kinds[kind]["profile"]:  # profiled apart: both are shown
                kinds[kind]["profile"] += "\n" + info["profile"]
    meta["kinds"] = kinds
    blocks = {(r["world"], r["distribution"], r["seed"]) for r in rows}
    wanted = {(w, d, s) for w in setup["worlds"] for d in setup["distributions"] for s in setup["seeds"]}
    missing = sorted(wanted - blocks)
    links = [link for part in parts for link in process_links(part)]
    meta["status"] = (f"{'complete' if not missing else 'partial'}: {len(blocks & wanted)} of {len(wanted)} (world, "
                      f"distribution, seed) blocks, replayed by {len(links)} processes (each block within one)"
                      + (f"; missing {missing}" if missing else ""))
    meta["micro_batches"] = sum(info["timed"] for info in kinds.values())
    meta["elapsed"] = sum(part["elapsed"] for part in parts)
    meta["process_links"] = links
    meta["not_replayed"] = [line for part in parts for line in part.get("not_replayed", [])]
    meta["links"] = "; ".join(f"process {i + 1}: {link}" for i, link in enumerate(links))
    write_atomic(out / f"replay_{tag}.md", report(rows, meta, Progress(0)))
    write_atomic(out / f"replay_{tag}.json", json.dumps({**meta, "rows": rows}, indent=1, default=str))
    print((out / f"replay_{tag}.md").read_text())
    return 0


def holds_by_policy(cost_model: dcp.CostModel, cap: float, world: int) -> dict[str, dict[int, int]]:
    """The most tokens one micro-batch holds under ``cap``, by policy and SP size up to ``world``."""
    sizes = [2**i for i in range(world.bit_length()) if 2**i <= world]
    return {policy.value: {size: int(cost_model.token_capacity(size, policy, cap)) for size in sizes}
            for policy in dcp.RecomputePolicy}


def results_tag(device: torch.device, setup_name: str, tiny: bool) -> str:
    """The results files' name after ``replay_``: the device, and the setup where it is not the
    device's default (``replay_long_cpu`` writes ``replay_long_cpu.md``)."""
    tag = ("cuda_" + device_name(device).lower().replace(" ", "-")) if device.type == "cuda" else "cpu"
    if setup_name in ("replay_cpu", "replay_gpu", "replay_tiny"):
        return tag + ("_tiny" if tiny else "")
    return setup_name.removeprefix("replay_").removesuffix("_cpu").removesuffix("_gpu") + "_" + tag


def text_cost_model(setup: dict[str, Any], model: TinyGPT, device: torch.device, dtype: torch.dtype,
                    hardware: Hardware, inner: str, cache: str | None) -> tuple[float | None, dcp.CostModel]:
    """TinyGPT's profiled cost model and, on a CPU, the stand-in memory cap."""
    context, vocab, m = setup["context_window"], setup["model"]["vocab"], setup["model"]
    print(f"replay on {device_name(device)} ({setup['name']}): profiling TinyGPT width {m['width']} ...", flush=True)
    prior = dcp.ModelProfile.transformer("replay-gpt", num_layers=m["layers"], hidden_size=m["width"],
                                         num_heads=m["heads"], ffn_hidden_size=4 * m["width"], vocab_size=vocab,
                                         causal=True, dtype_bytes=2 if dtype == torch.bfloat16 else 4)
    profile_lengths = setup.get("profile_lengths", [context // 16, context // 8, context // 4, context // 2, context])
    # Two policies are profiled unless the setup names more (each variant is a compile of its own: on
    # a lent GPU's minutes the replay's first block must come first); the others get the analytic
    # prior scaled to them.
    policies = list(setup.get("profile_policies", ["none", "full"]))
    # On a GPU each variant compiled is lease time: profile SP 1 and 8 (the others get the prior scaled).
    profile_sizes = (1, 8) if device.type == "cuda" else (1, 2, 4, 8)
    cost_model = dcp.profile(model, packed_inputs(vocab, device), lengths=profile_lengths,
                             held_out=setup.get("profile_held_out"),
                             sp_sizes=profile_sizes, recompute=policies, causal=True, prior=prior, hardware=hardware,
                             inner=inner, packed=True, repeats=max(1, setup["repeats"]), path=cache)
    cost_model = replace(cost_model, hardware=hardware)  # a cached profile keeps this run's link model
    return stand_in_cap(cost_model, context, device, **setup.get("stand_in", {})), cost_model


def video_cost_model(setup: dict[str, Any], name: str, model: VideoDiT, device: torch.device, dtype: torch.dtype,
                     hardware: Hardware, inner: str, cache: str | None) -> tuple[float | None, dcp.CostModel]:
    """VideoDiT's profiled cost model: single clips of the scaled mix's shapes (``profile_lengths``,
    ``profile_held_out``) at ``profile_sp_sizes``; and on a CPU the stand-in memory cap."""
    video = setup["video"]
    shapes = shape_of_length(name, video)
    missing = sorted((set(video["profile_lengths"]) | set(video["profile_held_out"])) - set(shapes))
    if missing:
        raise SystemExit(f"replay: profile lengths {missing} are no clip of the scaled {name} mix")
    make = dit_inputs(video, device, dtype)
    m = video["model"]
    print(f"replay on {device_name(device)} ({setup['name']}): profiling VideoDiT width {m['width']} at SP "
          f"{video['profile_sp_sizes']} ...", flush=True)
    with dit_compile_settings():
        cost_model = dcp.profile(model, lambda length: make(shapes[length], 1), lengths=video["profile_lengths"],
                                 held_out=video["profile_held_out"], sp_sizes=video["profile_sp_sizes"],
                                 recompute=["none", "full"], causal=False, prior=dit_prior(video, dtype),
                                 hardware=hardware, inner=inner, repeats=max(1, setup["repeats"]), path=cache)
    cost_model = replace(cost_model, hardware=hardware)
    return stand_in_cap(cost_model, video["context_window"], device), cost_model


def stand_in_cap(cost_model: dcp.CostModel, context: int, device: torch.device, sp_size: int = 4,
                 recompute: str = "full") -> float | None:
    """On a CPU, the stand-in memory cap: the context-window sample fits on ``sp_size`` ranks under
    ``recompute`` (the setup's ``stand_in``; 4 ranks with full recompute unless it says otherwise)
    with 2% to spare; None on a GPU (its own memory)."""
    if device.type != "cpu":
        return None
    state = cost_model.memory_coefficients(sp_size, recompute).fixed_bytes
    return state + 1.02 * (cost_model.peak_memory([context], sp_size, recompute) - state)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--tiny", action="store_true", help="the replay_tiny setup (a dry run: checks the pipeline)")
    parser.add_argument("--setup", default=None,
                        help="a replay setup of benchmarks/workloads.json (default: replay_cpu, replay_gpu on CUDA)")
    parser.add_argument("--inner", default=None, choices=["inductor", "aot_eager", "eager"],
                        help="inner compiler (default: aot_eager; Inductor compiles every SP size up to 32)")
    parser.add_argument("--profile-cache", default=None, help="TinyGPT's cost model JSON to reuse (dcp.profile's path=)")
    parser.add_argument("--video-profile-cache", default=None, help="VideoDiT's cost model JSON to reuse")
    parser.add_argument("--worlds", type=int, nargs="+", default=None, help="only these of the setup's worlds")
    parser.add_argument("--distributions", nargs="+", default=None, help="only these of the setup's distributions")
    parser.add_argument("--seeds", type=int, nargs="+", default=None, help="only these of the setup's seeds")
    parser.add_argument("--merge", nargs="+", default=None, metavar="JSON",
                        help="write one page from the rows of these results files (runs split over processes) and exit")
    parser.add_argument("--out-dir", default=str(RESULTS))
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cpu":
        torch.set_num_threads(1)
    setup = setup_for(device, args.tiny, args.setup)
    tag = results_tag(device, setup["name"], args.tiny)
    if args.merge:
        return merge(args.merge, Path(args.out_dir), tag, setup)
    for name, chosen in (("worlds", args.worlds), ("distributions", args.distributions), ("seeds", args.seeds)):
        if chosen:
            unknown = set(chosen) - set(setup[name])
            if unknown:
                raise SystemExit(f"replay: {sorted(unknown)} not among the setup's {name} {setup[name]} "
                                 f"(benchmarks/workloads.json, setup {setup['name']})")
            setup[name] = list(chosen)
    video_names = [d for d in setup["distributions"] if workloads.distribution(d).video]
    text_names = [d for d in setup["distributions"] if d not in video_names]
    if video_names and "video" not in setup:
        raise SystemExit(f"replay: setup {setup['name']} has no 'video' block for {video_names}")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    hardware, link_text = link_model(device)
    inner = args.inner or "aot_eager"
    started = time.perf_counter()
    kinds: dict[str, dict[str, Any]] = {}
    models: dict[str, Any] = {}
    cost_models: dict[str, dcp.CostModel] = {}
    for kind, names in (("text", text_names), ("video", video_names)):
        if not names:
            continue
        if kind == "text":
            model = build_model(setup, device, dtype)
            cap, cost_model = text_cost_model(setup, model, device, dtype, hardware, inner, args.profile_cache)
        else:
            model = build_dit(setup["video"], device, dtype)
            cap, cost_model = video_cost_model(setup, names[0], model, device, dtype, hardware, inner,
                                               args.video_profile_cache)
        if cap is not None:
            cost_model = replace(cost_model, hardware=replace(hardware, memory_capacity=cap / setup["memory_fraction"]))
        models[kind], cost_models[kind] = model, cost_model
        kinds[kind] = {"memory_capacity": cost_model.hardware.memory_capacity,
                       "memory_cap": setup["memory_fraction"] * cost_model.hardware.memory_capacity, "timed": 0,
                       "profile": markdown_report(cost_model.measured, title=(
                           "Profile used for planning" if kind == "text" else "Profile used for planning the video "
                           f"(VideoDiT width {setup['video']['model']['width']})"))}
        kinds[kind]["holds"] = holds_by_policy(cost_model, setup["memory_fraction"] * cost_model.hardware.memory_capacity,
                                               max(setup["worlds"]))
    meta: dict[str, Any] = {
        "device": device_name(device) + (f" ({DRY_RUN_LABEL})" if args.tiny else ""), "setup": setup,
        "links": link_text, "software": software_versions(device), "inner": inner, "dtype": str(dtype),
        "clock": ("process CPU time, one thread" if device.type == "cpu" else "wall clock with the device synchronised"),
        "micro_batches": 0, "kinds": kinds,
    }
    out = Path(args.out_dir)
    blocks = [(w, d, s) for w in setup["worlds"] for d in setup["distributions"] for s in setup["seeds"]]
    progress = Progress(total=len(blocks), unit="(world, distribution, seed) blocks")
    rows: list[dict[str, Any]] = []

    def flush() -> None:
        meta["elapsed"] = time.perf_counter() - started
        meta["status"] = progress.status()
        write_atomic(out / f"replay_{tag}.md", report(rows, meta, progress))
        write_atomic(out / f"replay_{tag}.json", json.dumps({**meta, "rows": rows}, indent=1, default=str))

    with interruptible(progress, flush), fake_world(max(setup["worlds"])):
        replayers: dict[str, Replayer] = {}
        if "text" in models:
            replayers["text"] = Replayer(models["text"], device, setup["model"]["vocab"], max(1, setup["repeats"]), inner)
        if "video" in models:
            replayers["video"] = DiTReplayer(models["video"], device, dit_inputs(setup["video"], device, dtype),
                                             max(1, setup["repeats"]), inner)
        for world, name, seed in blocks:
            kind = "video" if name in video_names else "text"
            replayer = replayers[kind]
            world_model = replace(cost_models[kind], optimizer_shards=world)
            budget = Budget(world_model, world, setup["memory_fraction"], pack_equal_lengths_only=kind == "video")
            kinds[kind]["memory_cap"] = budget.memory_cap
            if kind == "video":
                video = setup["video"]
                context, per_rank = video["context_window"], video["tokens_per_rank"]
                dist = video_distribution(name, video)
            else:
                context, per_rank = setup["context_window"], setup["tokens_per_rank"]
                dist = text_distribution(name, setup)
            steps = workloads.steps(dist, seed, per_rank * world, setup["steps"], context)
            # VideoDiT attends over every token of a clip: its span is its length (spans None).
            families, rungs = plan_families(budget, [(s.lengths, None) for s in steps], context,
                                            setup.get("ablation", True))
            keys = set()
            for contender in list(families.values()) + list(rungs.values()):
                for schedule, s in zip(contender.schedules, steps):
                    keys |= keys_of(schedule, clips_of(s), replayer)
            print(f"  {world} ranks, {name}, seed {seed}: {len(keys - set(replayer.cache))} new {kind} calls to time "
                  f"({time.perf_counter() - started:.0f} s)", flush=True)
            replayer.measure(keys)
            for group in (families, rungs):
                for label, contender in list(group.items()):
                    failed = sorted({key for schedule, s in zip(contender.schedules, steps)
                                     for key in keys_of(schedule, clips_of(s), replayer) if key in replayer.failed}, key=str)
                    if failed:
                        del group[label]
                        meta.setdefault("not_replayed", []).append(
                            f"{world} ranks, {name}, seed {seed}: {label} ({contender.scheduler.name}) not replayed: "
                            f"{len(failed)} of its calls fail on this runtime, e.g. {failed[0]}: {replayer.failed[failed[0]]}")
                        print(f"  {meta['not_replayed'][-1]}", flush=True)
            kinds[kind]["timed"] = len(replayer.cache)
            meta["micro_batches"] = sum(info["timed"] for info in kinds.values())
            rows += block_rows(world, name, seed, steps, families, False, replayer, world_model)
            rows += block_rows(world, name, seed, steps, rungs, True, replayer, world_model)
            progress.done += 1
            flush()
    print((out / f"replay_{tag}.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
