"""Plans replayed on measured compute: DCP against static SP, bucket parallel and DCP-inter at 8 and 32 ranks.

Every scheduler plans the same steps (the same samples per optimizer step, iso-batch) with the
same cost model, measured by ``dcp.profile`` on this device. Then each plan is *replayed*: every
micro-batch of every rank is run on this device at its per-rank shapes (the compiled variant of
its SP size and recompute policy, on a one-process fake world, so the time is the rank's compute
alone; every distinct micro-batch of every plan is timed in rounds over all of them, in a shuffled
order, median of ``--repeats``, so a slow phase of a shared machine hits every scheduler alike),
and each rank's busy time is the sum of its micro-batches' measured times plus their modelled
all-to-alls. A step takes its slowest rank. The gradient all-reduce (one per step for
every scheduler, iso-batch) is left out of the step and shown beside it: on a CPU stand-in it is
out of proportion (a toy model's gradient over links slowed to the CPU's speed).

Labels: compute **measured** (this device, named in the results), communication **modelled**:
on a GPU the H200 preset (NVLink 4: 450 GB/s one way per GPU inside a node of 8, NVIDIA's H200 SXM
datasheet; one 400 Gb/s InfiniBand NDR NIC per GPU across nodes, 50 GB/s), on a CPU the same link
bandwidths slowed by this CPU's measured matmul speed over the H200's dense bf16 peak (989 TFLOP/s),
so that bytes weigh against compute as they would on the cluster (latencies stay the preset's). Each table shows the
communication band: the whole replay again with every link 1.5x faster and 1.5x slower (+-50%
bandwidth).

The model: a GPT-style decoder (``dcp_compile.demo.example_models.TinyGPT``: RoPE, causal SDPA,
cross-entropy; packed rows, varlen attention), at width 128 x 2 layers on a CPU and width 2048 x
4 layers (16 heads, a Llama-1B-wide block stack) on a GPU; samples are a long-tailed text mix (a
Zipf mix of lengths from ``--shortest`` to ``--longest``). Memory is a stand-in on a CPU: the
longest sample fits on 4 ranks with full recompute within the published profiler's share of
memory, as device memory forces on the cluster; on a GPU it is the device's (measured activation
peaks from the profile).

Writes ``benchmarks/results/replay_<device>.md`` and ``.json``. Run:
``PYTHONPATH=. python benchmarks/replay.py [--steps 3] [--worlds 8 32]``.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Sequence

import torch

import dcp_compile as dcp
from dcp_compile.compiler.variant_selection import use
from dcp_compile.demo.example_models import TinyGPT
from dcp_compile.device_profile.device_timing import device_name, software_versions, time_step
from dcp_compile.device_profile.fake_world import fake_world
from dcp_compile.schedule.hardware import Hardware
from dcp_compile.schedule.measured_costs import markdown_report
from dcp_compile.schedule.plan import Schedule
from dcp_compile.schedule.planner import Planner
from dcp_compile.schedule.published_schedulers import (
    PUBLISHED_MEMORY_FRACTION,
    BucketParallelScheduler,
    DCPInterScheduler,
    StaticSPScheduler,
)

RESULTS = Path(__file__).resolve().parent / "results"
VOCAB = 1024
H200_BF16_PEAK = 989e12
SCHEDULERS = ("dcp", "static-sp", "bucket-parallel", "dcp-inter")
BAND = (1.5, 1.0, 1 / 1.5)  # link speed factors: the band's fast end, the model, its slow end


@dataclass(frozen=True)
class Setup:
    device: torch.device
    hidden: int
    layers: int
    heads: int
    dtype: torch.dtype
    shortest: int
    longest: int
    tokens_per_step: int


def setup_for(device: torch.device, args: argparse.Namespace) -> Setup:
    if device.type == "cuda":
        return Setup(device, 2048, 4, 16, torch.bfloat16, args.shortest or 128, args.longest or 32768,
                     args.tokens_per_step or 1 << 20)
    return Setup(device, 128, 2, 4, torch.float32, args.shortest or 32, args.longest or 2048,
                 args.tokens_per_step or 1 << 14)


def zipf_lengths(count: int, shortest: int, longest: int, seed: int = 0) -> list[int]:
    """Lengths on a log grid from shortest to longest, weights 1/(rank+1)^1.2 (shortest most common),
    jittered by +-20% so packed rows differ."""
    rng = random.Random(seed)
    grid = []
    length = shortest
    while length <= longest:
        grid.append(length)
        length *= 2
    weights = [1 / (i + 1) ** 1.2 for i in range(len(grid))]
    lengths = []
    for _ in range(count):
        base = rng.choices(grid, weights)[0]
        lengths.append(max(shortest, min(longest, int(base * rng.uniform(0.8, 1.2)))))
    return lengths


def build_model(setup: Setup) -> TinyGPT:
    torch.manual_seed(0)
    return TinyGPT(VOCAB, setup.hidden, setup.layers, setup.heads).to(setup.device, setup.dtype)


def packed_inputs(setup: Setup):
    def make(lengths: list[int]):
        generator = torch.Generator().manual_seed(sum(lengths))
        packed = dcp.pack_sequences([torch.randint(1, VOCAB, (n,), generator=generator) for n in lengths])
        return tuple(t.to(setup.device) for t in (packed.input_ids, packed.labels, packed.position_ids))
    return make


def link_model(device: torch.device) -> tuple[Hardware, str]:
    """The H200 preset's links, on a CPU slowed by its measured matmul speed over the H200 peak."""
    if device.type == "cuda":
        return Hardware.H200, "H200 preset links (NVLink 4 450 GB/s in a node of 8; 400 Gb/s InfiniBand NDR across)"
    size = 512
    a, b = torch.randn(size, size), torch.randn(size, size)
    best = math.inf
    for _ in range(10):
        start = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - start)
    ratio = (2 * size**3 / best) / H200_BF16_PEAK
    h200 = Hardware.H200
    hardware = replace(
        h200, name="H200 links at this CPU's speed", peak_flops=2 * size**3 / best,
        intra_node_bandwidth=h200.intra_node_bandwidth * ratio, inter_node_bandwidth=h200.inter_node_bandwidth * ratio,
    )
    return hardware, (f"H200 preset link bandwidths slowed by this CPU's measured matmul rate over the H200 bf16 peak "
                      f"({ratio:.2e}): {hardware.intra_node_bandwidth / 1e6:.2f} MB/s in a node of 8, "
                      f"{hardware.inter_node_bandwidth / 1e6:.2f} MB/s across; latencies as the preset's "
                      "(10 us / 25 us: a CPU's per-call overheads are not slower than a GPU's by that ratio)")


def with_links(cost_model: dcp.CostModel, factor: float) -> dcp.CostModel:
    hw = cost_model.hardware
    return replace(cost_model, hardware=replace(hw, intra_node_bandwidth=hw.intra_node_bandwidth * factor,
                                                inter_node_bandwidth=hw.inter_node_bandwidth * factor))


class Replayer:
    """Times every distinct per-rank micro-batch of every plan on the device: all of them once to
    warm up, then ``repeats`` rounds over all of them in a shuffled order (median), so a slow
    phase of a shared machine spreads over every scheduler's micro-batches alike."""

    def __init__(self, model: TinyGPT, setup: Setup, repeats: int, inner: str) -> None:
        self.model, self.setup, self.repeats = model, setup, repeats
        self.compiled = torch.compile(model, backend="dcp", dynamic=True, options={"inner": inner, "check_ranks": False})
        self.make = packed_inputs(setup)
        self.cache: dict[tuple, float] = {}

    @staticmethod
    def key(lengths: Sequence[int], sp_size: int, recompute: dcp.RecomputePolicy | str) -> tuple:
        return tuple(sorted(lengths)), sp_size, dcp.RecomputePolicy.parse(recompute)

    def measure(self, keys: set[tuple]) -> None:
        from tqdm.auto import tqdm

        keys = sorted(keys - set(self.cache), key=lambda k: (k[1], k[2].value, k[0]))
        steps = {key: self._step(key) for key in keys}
        times: dict[tuple, list[float]] = {key: [] for key in keys}
        rng = random.Random(0)
        rounds = [None] + list(range(self.repeats))  # a warm-up round, then the timed ones
        with tqdm(total=len(rounds) * len(keys), desc="replay: timing micro-batches", unit="mb", leave=False) as bar:
            for round_index in rounds:
                order = list(keys)
                rng.shuffle(order)
                for key in order:
                    timing = time_step(steps[key], self.setup.device, repeats=1, warmup=0)
                    if round_index is not None:
                        times[key].append(timing.seconds)
                    bar.update()
        for key, values in times.items():
            self.cache[key] = statistics.median(values)

    def _step(self, key: tuple):
        lengths, sp_size, recompute = key
        inputs = self.make(list(lengths))
        variant = dcp.Variant(sp_size, recompute)

        def step() -> None:
            with use(variant, sequence_lengths=list(lengths)):
                loss = self.compiled(*inputs)
            loss.backward()
            self.model.zero_grad(set_to_none=False)

        return step

    def seconds(self, lengths: Sequence[int], sp_size: int, recompute: dcp.RecomputePolicy) -> float:
        return self.cache[self.key(lengths, sp_size, recompute)]


def keys_of(schedule: Schedule, lengths: Sequence[int]) -> set[tuple]:
    """The distinct micro-batches a replay of ``schedule`` times (a fully recomputed one also
    without recompute: DCP-inter's pyramid sits between the two)."""
    keys = set()
    for mb in schedule.microbatches:
        mb_lengths = [lengths[p] for p in mb.positions]
        keys.add(Replayer.key(mb_lengths, mb.sp_size, mb.recompute))
        if mb.recompute == dcp.RecomputePolicy.FULL:
            keys.add(Replayer.key(mb_lengths, mb.sp_size, dcp.RecomputePolicy.NONE))
    return keys


def replay(schedule: Schedule, lengths: Sequence[int], replayer: Replayer, cost_models: Sequence[dcp.CostModel]) -> dict:
    """Per link speed of ``cost_models``: (makespan, busy compute) of ``schedule`` with measured compute."""
    out = []
    for model in cost_models:
        silent = model.without_communication()
        loads = [0.0] * schedule.world_size
        compute = [0.0] * schedule.world_size
        for mb in schedule.microbatches:
            mb_lengths = [lengths[p] for p in mb.positions]
            measured = replayer.seconds(mb_lengths, mb.sp_size, mb.recompute)
            if mb.recompute == dcp.RecomputePolicy.FULL:
                # DCP-inter's pyramid keeps some layers unchecked: its predicted time sits between
                # full and none; replay the same share between the two measured times.
                full, none = (model.time(mb_lengths, mb.sp_size, policy) for policy in ("full", "none"))
                kept = min(max((full - mb.predicted_time) / (full - none), 0.0), 1.0) if full > none else 0.0
                if kept > 1e-9:
                    measured -= kept * (measured - replayer.seconds(mb_lengths, mb.sp_size, dcp.RecomputePolicy.NONE))
            communication = model.time(mb_lengths, mb.sp_size, mb.recompute) - silent.time(mb_lengths, mb.sp_size, mb.recompute)
            for rank in mb.ranks:
                loads[rank] += measured + communication
                compute[rank] += measured
        out.append((max(loads), sum(compute)))
    return out


def schedules_for(planner: Planner, world: int, lengths: Sequence[int], longest: int) -> dict[str, tuple[Schedule, list[int]]]:
    """Each scheduler's plan of one step; static SP gets the step sorted by length (its strong variant)."""
    cost_model = planner.cost_model
    ordered = sorted(lengths)
    static = StaticSPScheduler(cost_model, world, longest)
    return {
        "dcp": (planner.plan(lengths), list(lengths)),
        "static-sp": (static.schedule(ordered), ordered),
        "bucket-parallel": (BucketParallelScheduler(cost_model, world, longest).schedule(lengths), list(lengths)),
        "dcp-inter": (DCPInterScheduler(cost_model, world).schedule(lengths), list(lengths)),
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--worlds", type=int, nargs="+", default=[8, 32])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--shortest", type=int, default=0)
    parser.add_argument("--longest", type=int, default=0)
    parser.add_argument("--tokens-per-step", type=int, default=0)
    parser.add_argument("--profile-recompute", nargs="+", default=None,
                        help="policies dcp.profile measures for planning (default: all on a GPU, none and full on a CPU; "
                             "the replay times every micro-batch's own policy either way)")
    parser.add_argument("--inner", default=None, choices=["inductor", "aot_eager", "eager"],
                        help="inner compiler of the profile and the replay (default: inductor on a GPU, aot_eager on a CPU)")
    parser.add_argument("--profile-cache", default=None, help="a cost model JSON to reuse (dcp.profile's path=)")
    parser.add_argument("--out-dir", default=str(RESULTS))
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cpu":
        torch.set_num_threads(1)
    setup = setup_for(device, args)
    model = build_model(setup)
    hardware, link_text = link_model(device)
    started = time.perf_counter()

    profile_lengths = [setup.longest // 16, setup.longest // 8, setup.longest // 4, setup.longest // 2, setup.longest]
    print(f"replay on {device_name(device)}: profiling TinyGPT width {setup.hidden} x {setup.layers} layers ...", flush=True)
    prior = dcp.ModelProfile.transformer("replay-gpt", num_layers=setup.layers, hidden_size=setup.hidden,
                                         num_heads=setup.heads, ffn_hidden_size=4 * setup.hidden, vocab_size=VOCAB,
                                         causal=True, dtype_bytes=2 if setup.dtype == torch.bfloat16 else 4)
    inner = args.inner or ("inductor" if device.type == "cuda" else "aot_eager")
    policies = args.profile_recompute or ([p.value for p in dcp.RecomputePolicy] if device.type == "cuda" else ["none", "full"])
    cost_model = dcp.profile(model, packed_inputs(setup), lengths=profile_lengths, sp_sizes=(1, 2, 4, 8),
                             recompute=policies, causal=True, prior=prior, hardware=hardware, inner=inner,
                             packed=True, repeats=args.repeats, path=args.profile_cache)
    cost_model = replace(cost_model, hardware=hardware)  # a cached profile keeps this run's link model
    if device.type == "cpu":
        # A stand-in memory: the longest sample fits on 4 ranks with full recompute within the
        # published profiler's cap (a share of device memory), as device memory forces on a cluster.
        state = cost_model.memory_coefficients(4, "full").fixed_bytes
        cap = state + 1.02 * (cost_model.peak_memory([setup.longest], 4, "full") - state)
        cost_model = replace(cost_model, hardware=replace(hardware, memory_capacity=cap / PUBLISHED_MEMORY_FRACTION))
    profile_text = markdown_report(cost_model.measured, title="Profile used by the replay")

    lengths_pool = zipf_lengths(4000, setup.shortest, setup.longest)
    rows = []
    with fake_world(max(args.worlds)):
        replayer = Replayer(model, setup, args.repeats, inner)
        plans = []  # (world, band, bound, tokens, sync, [(name, schedule, ordered) per step])
        for world in args.worlds:
            cost_model_w = replace(cost_model, optimizer_shards=world)
            band = [with_links(cost_model_w, f) for f in BAND]
            sampler = dcp.DataCentricSampler(lengths_pool, setup.tokens_per_step, cost_model=cost_model_w,
                                             world_size=world, rank=0, seed=0, verify_plan=False)
            planner = Planner(cost_model_w, world)
            steps = []
            bound = sync = 0.0
            tokens = 0
            for indices in sampler.steps(0)[: args.steps]:  # the sampler's cut of the epoch
                lengths = [lengths_pool[i] for i in indices]
                tokens += sum(lengths)
                bound += planner.lower_bound(lengths)
                sync += band[1].hardware.all_reduce_seconds(band[1].profile.parameter_bytes, world)
                steps.append([(name, schedule, ordered) for name, (schedule, ordered)
                              in schedules_for(planner, world, lengths, setup.longest).items()])
            plans.append((world, band, bound, tokens, sync, steps))
        keys = set().union(*(keys_of(schedule, ordered) for *_, steps in plans for step in steps
                             for _, schedule, ordered in step))
        print(f"  {len(keys)} distinct micro-batches to time ({time.perf_counter() - started:.0f} s)", flush=True)
        replayer.measure(keys)
        for world, band, bound, tokens, sync, steps in plans:
            totals = {name: [0.0] * len(BAND) for name in SCHEDULERS}
            busy = {name: 0.0 for name in SCHEDULERS}
            for step in steps:
                for name, schedule, ordered in step:
                    replayed = replay(schedule, ordered, replayer, band)
                    for i, (makespan, _) in enumerate(replayed):
                        totals[name][i] += makespan
                    busy[name] += replayed[1][1]
            for name in SCHEDULERS:
                seconds = totals[name]
                rows.append({
                    "world": world, "scheduler": name, "tokens": tokens,
                    "tokens_per_s": tokens / seconds[1], "tokens_per_s_fast_links": tokens / seconds[0],
                    "tokens_per_s_slow_links": tokens / seconds[2],
                    "utilisation": busy[name] / (world * seconds[1]),
                    "bound_ratio": bound / seconds[1] if bound else math.nan,
                    "sync_s_per_step": sync / len(steps), "step_s": seconds[1] / len(steps),
                })
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tag = "cuda_" + device_name(device).lower().replace(" ", "-") if device.type == "cuda" else "cpu"
    versions = software_versions(device)
    lines = [f"# Plans replayed on measured compute: {device_name(device)}", "",
             "**Replayed: measured compute, modelled communication.** Each micro-batch of each rank was run on this "
             f"device at its per-rank shapes (fake process group: no data moved), timed by "
             f"{cost_model.measured.clock.value}; the all-to-alls and the gradient "
             f"all-reduce are modelled: {link_text}. Band: links 1.5x faster / slower.", "",
             f"Model: TinyGPT width {setup.hidden} x {setup.layers} layers, {setup.heads} heads, {setup.dtype}; "
             f"samples: Zipf text lengths {setup.shortest}..{setup.longest}, {setup.tokens_per_step:,} tokens per "
             f"step, {args.steps} steps per world size, the same samples per step for every scheduler; inner "
             f"compiler {inner}. "
             + ", ".join(f"{k} {v}" for k, v in versions.items()) + ".", "",
             "| ranks | scheduler | tokens/s (band: slow..fast links) | DCP / it | utilisation | of DCP's bound | "
             "step s (+ modelled all-reduce s) |",
             "|---:|---|---|---:|---:|---:|---|"]
    for world in args.worlds:
        mine = [r for r in rows if r["world"] == world]
        dcp_rate = next(r["tokens_per_s"] for r in mine if r["scheduler"] == "dcp")
        for r in mine:
            lines.append(f"| {world} | {r['scheduler']} | {r['tokens_per_s']:,.0f} ({r['tokens_per_s_slow_links']:,.0f}.."
                         f"{r['tokens_per_s_fast_links']:,.0f}) | {dcp_rate / r['tokens_per_s']:.2f}x | "
                         f"{100 * r['utilisation']:.0f}% | {100 * r['bound_ratio']:.0f}% | {r['step_s']:.3f} "
                         f"(+ {r['sync_s_per_step']:.3f}) |")
    lines += ["", "Utilisation: measured compute over ranks x step time. 'Of DCP's bound': the planner's lower bound "
              "(priced by the profiled cost model) over the replayed step time. Step time without the gradient "
              "all-reduce, which is the same for every scheduler; its modelled time is shown beside it.", "",
              profile_text]
    (out / f"replay_{tag}.md").write_text("\n".join(lines) + "\n")
    (out / f"replay_{tag}.json").write_text(json.dumps({"device": device_name(device), "software": versions,
                                                       "rows": rows}, indent=2))
    print("\n".join(lines[:len(lines) - 1]))
    print(f"wrote {out / f'replay_{tag}.md'} in {time.perf_counter() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
