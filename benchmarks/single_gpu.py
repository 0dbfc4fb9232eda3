"""One device, real models, the real training step: DCP at SP 1 against static and bucket schedules.

Two workloads, each trained for the same steps (the same samples per optimizer step, from the same
initial weights, each schedule with its own weights and AdamW state, one step of each in turn,
the order rotating) under three schedules:

* **static** (the strong variant): one recompute policy and one micro-batch token budget, chosen
  so the longest sample of the dataset fits the memory cap; the step's samples sorted by length and
  packed to that budget;
* **bucket**: a published-profiler-style bucket table (``BucketParallelScheduler.profile_bucket``:
  per bucket, the largest power-of-two batch under the cap, the batch with the most samples per
  second kept), profiled under each recompute policy, the faster one kept per bucket: per-bucket
  batch size *and* recompute (the published system checkpoints every block; choosing per bucket is
  in the baseline's favour, as is giving it the same memory cap as the others instead of 70%);
* **dcp**: :class:`dcp.DataCentricSampler` at SP 1 with a cost model measured by ``dcp.profile``
  on this device, choosing recompute, accumulation and packing per micro-batch.

Workloads (``--models``):

* ``wan``: ``diffusers.WanTransformer3DModel`` with Wan2.1-T2V-1.3B's configuration (width 1536,
  12 heads of 128, FFN 8960, text width 4096), ``--layers`` of its 30, random weights, on a Zipf mix
  of images and videos as 16-channel latents (240 to 32,760 tokens: 480p x 81 frames). A DiT's
  samples cannot share a packed row (cross-attention to each sample's text), so a micro-batch runs
  one call per sample, its gradients accumulated (``--dit-batch``: one call per latent shape, its
  samples batched, which doubles the traces to compile), loss = MSE against a random target;
* ``llama``: ``transformers.LlamaForCausalLM`` with Llama-3.2-1B's configuration (width 2048, 32
  heads, 8 KV heads, FFN 8192, vocabulary 128,256, tied embeddings), ``--layers`` of its 16, on a
  long-tailed text mix (128 to 32,768 tokens); a micro-batch is one packed row (varlen attention).

Memory: with fewer layers than the real model the device would hold everything without recompute,
which would say nothing about a real job; so the cap is a stand-in, as in the CPU demo and replay:
the longest sample fits only with full recompute (``--memory-cap-gb`` sets it instead). bf16 on a
GPU, fp32 on a CPU; AdamW; inner compiler ``aot_eager`` by default (Inductor's compile time for
every variant would not fit the budget; ``--inner inductor`` to try).

Reports tokens/s per schedule (total over the timed steps), the per-step ratio DCP / each baseline
(geometric mean, 95% t-interval), peak allocated memory per schedule (CUDA), the loss check (the
three schedules' step losses must agree to rounding) and DCP / the better baseline against the 1.3x
goal. ``--budget-s`` bounds the whole run: each model gets its share, and the number of timed steps
is cut to what fits (stated). Writes ``single_gpu_<device>.md`` and ``.json`` to ``--out-dir``, rewritten
after every timed step with a status line (``complete`` or ``partial: ... N of M timed steps``), so a
run stopped by a signal (``timeout --signal=INT``) or a budget leaves a valid, partial page. The cost
model prices communication with the preset of the device found
(:func:`~dcp_compile.schedule.hardware.preset_for_device_name`).

    python benchmarks/single_gpu.py --out-dir $OUT                  # GPU (about 4 minutes)
    python benchmarks/single_gpu.py --tiny --out-dir /tmp/x          # CPU smoke run
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import random
import statistics
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

RESULTS = Path(__file__).resolve().parent / "results"
SCHEDULES = ("static", "bucket", "dcp")
PROFILED = ("none", "full")  # measured by dcp.profile; the others priced by the prior scaled to these
MEMORY_FRACTION = 0.9
GOAL = 1.3

WAN_1_3B = dict(patch_size=(1, 2, 2), num_attention_heads=12, attention_head_dim=128, in_channels=16, out_channels=16,
                text_dim=4096, freq_dim=256, ffn_dim=8960, cross_attn_norm=True, qk_norm="rms_norm_across_heads",
                eps=1e-6, rope_max_seq_len=1024)
WAN_TINY = dict(WAN_1_3B, num_attention_heads=2, attention_head_dim=16, text_dim=32, freq_dim=32, ffn_dim=64,
                in_channels=4, out_channels=4)
# (frames, height, width) of the latent, smallest first: tokens = frames * height/2 * width/2.
# No two sizes of a call equal (height, width, frames, channels, text): dynamo's duck sizing would
# give them one symbol and trace again at the first shape where they differ.
WAN_BUCKETS = ((1, 24, 40), (1, 48, 80), (1, 60, 104), (5, 30, 52), (5, 60, 104), (9, 60, 104), (21, 60, 104))
WAN_TINY_BUCKETS = ((1, 6, 10), (1, 10, 14), (3, 10, 14), (5, 10, 14), (7, 10, 14), (9, 10, 14))
LLAMA_1B = dict(hidden_size=2048, intermediate_size=8192, num_attention_heads=32, num_key_value_heads=8, head_dim=64,
                vocab_size=128256, tie_word_embeddings=True, rope_theta=500000.0, max_position_embeddings=131072,
                rms_norm_eps=1e-5)
LLAMA_TINY = dict(LLAMA_1B, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=16, vocab_size=256, max_position_embeddings=4096)
FULL_LAYERS = {"wan": 30, "llama": 16}
ZIPF_EXPONENT = 1.5


def say(started: float, text: str) -> None:
    print(f"[{time.perf_counter() - started:6.0f} s] {text}", flush=True)


# ---------------------------------------------------------------------------------------------
# Workloads: the model, its data, one micro-batch's calls
# ---------------------------------------------------------------------------------------------
@dataclass
class Call:
    """One forward/backward of a micro-batch: the compiled model's keyword inputs, what its loss
    is weighted by (its share of the step's loss), and a packed row's sequence lengths."""

    inputs: dict
    weight: float
    sequence_lengths: list[int] | None = None
    target: torch.Tensor | None = None


@dataclass
class Workload:
    name: str
    label: str
    model: torch.nn.Module
    lengths: list[int]  # tokens of every sample of the dataset
    profile_lengths: tuple[int, ...]
    held_out: tuple[int, ...]
    packed: bool
    make_profile_inputs: Callable[[Any], dict]
    groups: Callable[[Sequence[int]], list[tuple[Any, tuple[int, ...]]]]  # a micro-batch's calls: (trace, indices)
    call: Callable[[Sequence[int], float], Call]  # (one call's indices, step's loss denominator) -> its inputs
    supervised: list[int]  # what each sample counts in the step's loss
    prior: Any = None  # the cost model's analytic prior (None: dcp.profile counts it on the model)
    mix: str = ""  # how the lengths were drawn, for the page


def zipf_choice(rng: random.Random, count: int, exponent: float = ZIPF_EXPONENT) -> int:
    return rng.choices(range(count), [1 / (i + 1) ** exponent for i in range(count)])[0]


def wan_workload(args: argparse.Namespace, device: torch.device, dtype: torch.dtype) -> Workload:
    import diffusers

    config = WAN_TINY if args.tiny else WAN_1_3B
    buckets = WAN_TINY_BUCKETS if args.tiny else WAN_BUCKETS
    text_len = 12 if args.tiny else 512
    torch.manual_seed(0)
    model = diffusers.WanTransformer3DModel(**config, num_layers=args.layers).to(device=device, dtype=dtype).train()
    tokens_of = [f * (h // 2) * (w // 2) for f, h, w in buckets]
    rng = random.Random(args.seed)
    shapes: list[tuple[int, int, int]] = []
    while sum(tokens_of[buckets.index(s)] for s in shapes) < (args.steps + 3) * args.tokens_per_step:
        shapes.append(buckets[zipf_choice(rng, len(buckets))])
    lengths = [tokens_of[buckets.index(s)] for s in shapes]
    channels = config["in_channels"]

    def sample(index: int, shape: tuple[int, int, int]) -> tuple[torch.Tensor, ...]:
        g = torch.Generator().manual_seed(index)  # a sample's data depends on it alone, not on its batch
        return (torch.randn(1, channels, *shape, generator=g), torch.randint(0, 1000, (1,), generator=g).float(),
                torch.randn(1, text_len, config["text_dim"], generator=g), torch.randn(1, channels, *shape, generator=g))

    def inputs_of(parts: list[tuple[torch.Tensor, ...]]) -> tuple[dict, torch.Tensor]:
        latents, timesteps, text, target = (torch.cat(column) for column in zip(*parts))
        return ({"hidden_states": latents.to(device, dtype), "timestep": timesteps.to(device),
                 "encoder_hidden_states": text.to(device, dtype), "return_dict": False}, target.to(device, dtype))

    def groups(indices: Sequence[int]) -> list[tuple[Any, tuple[int, ...]]]:
        """One call per sample (``--dit-batch``: per latent shape, its samples batched). Dynamo
        traces one frame and more apart (and batch 1 and more): each trace is compiled for
        every recompute policy the plans use, which is what bounds the compile time."""
        if not args.dit_batch:
            return [((False, shapes[i][0] > 1), (i,)) for i in indices]
        by_shape: dict[tuple, list[int]] = {}
        for index in indices:
            by_shape.setdefault(shapes[index], []).append(index)
        return [((len(members) > 1, shape[0] > 1), tuple(members)) for shape, members in by_shape.items()]

    def call(members: Sequence[int], denominator: float) -> Call:
        inputs, target = inputs_of([sample(i, shapes[i]) for i in members])
        return Call(inputs, sum(lengths[i] for i in members) / denominator, target=target)

    by_tokens = {t: s for t, s in zip(tokens_of, buckets)}
    fit = tuple(sorted({tokens_of[0], tokens_of[2], tokens_of[4], tokens_of[5], tokens_of[-1]}))
    held = tuple(sorted(set(tokens_of) - set(fit)))
    import dcp_compile as dcp

    width = config["num_attention_heads"] * config["attention_head_dim"]
    in_blocks = sum(p.numel() for p in model.blocks.parameters())
    bytes_ = 2 if dtype == torch.bfloat16 else 4
    # ModelProfile.measure cannot count this model (diffusers calls SDPA with keyword arguments), so
    # the prior is the shape's: Wan's block is self-attention, cross-attention to the text, a GELU FFN.
    prior = dcp.ModelProfile.transformer(
        "wan", num_layers=args.layers, hidden_size=width, num_heads=config["num_attention_heads"],
        ffn_hidden_size=config["ffn_dim"], causal=False, cross_attention_tokens=text_len,
        output_channels=config["out_channels"] * 4, rotary=True, dtype_bytes=bytes_, gradient_dtype_bytes=bytes_,
        optimizer_bytes_per_parameter=2 * bytes_,
        extra_parameters=sum(p.numel() for p in model.parameters()) - in_blocks)
    return Workload(
        "wan", f"Wan 2.1 1.3B configuration ({args.layers} of {FULL_LAYERS['wan']} layers{', tiny width' if args.tiny else ''})",
        model, lengths, fit, held, False, lambda n: inputs_of([sample(n, by_tokens[n])])[0], groups, call,
        list(lengths), prior, f"Zipf (exponent {ZIPF_EXPONENT}) over latent shapes frames x height x width "
        + ", ".join(f"{f}x{h}x{w} ({t:,})" for (f, h, w), t in zip(buckets, tokens_of)) + ", smallest most common")


def llama_workload(args: argparse.Namespace, device: torch.device, dtype: torch.dtype) -> Workload:
    import transformers

    import dcp_compile as dcp
    from dcp_compile.runtime.huggingface import use_packed_attention

    config = transformers.LlamaConfig(**(LLAMA_TINY if args.tiny else LLAMA_1B), num_hidden_layers=args.layers)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).to(device=device, dtype=dtype).train()
    use_packed_attention(model)
    shortest, longest = (16, 256) if args.tiny else (128, 32768)
    grid = [shortest]
    while grid[-1] * 2 <= longest:
        grid.append(grid[-1] * 2)
    rng = random.Random(args.seed)
    lengths: list[int] = []
    while sum(lengths) < (args.steps + 3) * args.tokens_per_step:
        base = grid[zipf_choice(rng, len(grid))]
        lengths.append(max(shortest, min(longest, int(base * rng.uniform(0.8, 1.2)))))
    lengths[rng.randrange(len(lengths))] = longest  # the longest length is in the data
    vocab = config.vocab_size

    def tokens(index: int) -> torch.Tensor:
        return torch.randint(1, vocab, (lengths[index],), generator=torch.Generator().manual_seed(index))

    def row(sequences: list[torch.Tensor]) -> tuple[dict, list[int]]:
        packed = dcp.pack_sequences(sequences).to(device)
        return ({"input_ids": packed.input_ids, "labels": packed.labels, "position_ids": packed.position_ids},
                packed.sequence_lengths)

    def groups(indices: Sequence[int]) -> list[tuple[Any, tuple[int, ...]]]:
        return [("row", tuple(indices))]  # one packed row: one trace for every packing

    def call(indices: Sequence[int], denominator: float) -> Call:
        inputs, sequence_lengths = row([tokens(i) for i in indices])
        return Call(inputs, sum(lengths[i] - 1 for i in indices) / denominator, sequence_lengths)

    def profile_inputs(row_lengths: list[int]) -> dict:
        g = torch.Generator().manual_seed(sum(row_lengths))
        return row([torch.randint(1, vocab, (n,), generator=g) for n in row_lengths])[0]

    fit = (longest // 128, longest // 32, longest // 8, longest // 2, longest)
    held = (longest // 16, longest // 4)
    return Workload(
        "llama", f"Llama 3.2 1B configuration ({args.layers} of {FULL_LAYERS['llama']} layers{', tiny width' if args.tiny else ''})",
        model, lengths, tuple(max(2, n) for n in fit), tuple(max(3, n) for n in held), True, profile_inputs, groups,
        call, [n - 1 for n in lengths], None,
        f"Zipf (exponent {ZIPF_EXPONENT}) over {shortest:,}..{longest:,} in powers of two, shortest most common, "
        "each +-20%")


WORKLOADS = {"wan": wan_workload, "llama": llama_workload}


# ---------------------------------------------------------------------------------------------
# Schedules
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Batch:
    """A micro-batch of one schedule: dataset indices and a recompute policy."""

    indices: tuple[int, ...]
    recompute: str


def static_setup(cost_model, longest: int, cap: float) -> tuple[str, int]:
    policy = cost_model.fastest_feasible_recompute(longest, 1, cap)
    if policy is None:
        raise RuntimeError(f"the longest sample ({longest} tokens) fits under no recompute policy within "
                           f"{cap / 2**30:.2f} GiB; raise --memory-cap-gb or use fewer --layers")
    return policy.value, cost_model.token_capacity(1, policy, cap)


def static_schedule(indices: Sequence[int], lengths: Sequence[int], policy: str, budget: int) -> list[Batch]:
    """The step's samples sorted by length, packed in that order up to ``budget`` tokens."""
    batches: list[list[int]] = []
    tokens = 0
    for index in sorted(indices, key=lambda i: (lengths[i], i)):
        if batches and tokens + lengths[index] <= budget:
            batches[-1].append(index)
            tokens += lengths[index]
        else:
            batches.append([index])
            tokens = lengths[index]
    return [Batch(tuple(b), policy) for b in batches]


@dataclass(frozen=True)
class BucketRow:
    key: int
    batch_size: int
    recompute: str
    seconds: float


def bucket_table(cost_model, lengths: Sequence[int]) -> tuple[dict[int, BucketRow], list[int]]:
    """Per bucket of the dataset, the published profile under each policy; the faster kept."""
    from dcp_compile.schedule.published_schedulers import BucketParallelScheduler, bucketize

    keys = bucketize(lengths)
    table = {}
    for key in sorted(set(keys)):
        best = None
        for policy in ("none", "attention", "selective", "full"):  # every policy the cost model prices at SP 1 (block is full there)
            try:
                # max_length = the bucket's own: without recompute the longest sample may not fit.
                scheduler = BucketParallelScheduler(cost_model, 1, key, sp_size=1, recompute=policy,
                                                    memory_fraction=MEMORY_FRACTION)
                profile = scheduler.profile_bucket(key, float(key), fixed_sp=1)
            except ValueError:
                continue  # this bucket does not fit under this policy
            row = BucketRow(key, profile.batch_size, policy, profile.time)
            if best is None or row.batch_size / row.seconds > best.batch_size / best.seconds:
                best = row
        if best is None:
            raise RuntimeError(f"bucket of {key} tokens fits under no recompute policy")
        table[key] = best
    return table, keys


def bucket_schedule(indices: Sequence[int], keys: Sequence[int], table: dict[int, BucketRow]) -> list[Batch]:
    by_key: dict[int, list[int]] = {}
    for index in indices:
        by_key.setdefault(keys[index], []).append(index)
    batches = []
    for key, members in sorted(by_key.items()):
        row = table[key]
        batches += [Batch(tuple(members[s:s + row.batch_size]), row.recompute)
                    for s in range(0, len(members), row.batch_size)]
    return batches


# ---------------------------------------------------------------------------------------------
# Running a step
# ---------------------------------------------------------------------------------------------
def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_batches(compiled, workload: Workload, prepared: list[tuple[Batch, list[Call]]]) -> torch.Tensor:
    """Forward and backward of every call; returns the step's loss (weighted sum), not synchronised."""
    import dcp_compile as dcp

    total = None
    for batch, calls in prepared:
        variant = dcp.Variant(1, batch.recompute)
        for call in calls:
            with dcp.use(variant, sequence_lengths=call.sequence_lengths):
                output = compiled(**call.inputs)
            if call.target is not None:
                loss = (output[0].float() - call.target.float()).pow(2).mean()
            else:
                loss = output.loss
            weighted = loss * call.weight
            weighted.backward()
            total = weighted.detach() if total is None else total + weighted.detach()
    return total


@dataclass
class StepResult:
    seconds: float
    tokens: int
    loss: float
    peak_bytes: float | None
    microbatches: int
    calls: int
    recomputed_tokens: int


def timed_step(compiled, workload: Workload, optimizer, batches: list[Batch], denominator: float,
               device: torch.device) -> StepResult:
    from dcp_compile.device_profile.device_timing import DeviceStopwatch

    prepared = [(b, [workload.call(members, denominator) for _, members in workload.groups(b.indices)])
                for b in batches]  # inputs ready before the clock, as a loader's workers would have them
    synchronize(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    watch = DeviceStopwatch(device).start()
    loss = run_batches(compiled, workload, prepared)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    seconds = watch.elapsed()
    peak = float(torch.cuda.max_memory_allocated(device)) if device.type == "cuda" else None
    return StepResult(seconds, sum(workload.lengths[i] for b in batches for i in b.indices), float(loss), peak,
                      len(batches), sum(len(c) for _, c in prepared),
                      sum(workload.lengths[i] for b in batches if b.recompute != "none" for i in b.indices))


def paired_ratio(ratios: Sequence[float]) -> tuple[float, float, float]:
    """Geometric mean of per-step ratios and its 95% t-interval (the mean itself for one step)."""
    if not ratios:
        return math.nan, math.nan, math.nan
    logs = [math.log(r) for r in ratios]
    mean = sum(logs) / len(logs)
    if len(logs) < 2:
        return (math.exp(mean),) * 3
    from scipy.stats import t

    half = t.ppf(0.975, len(logs) - 1) * statistics.stdev(logs) / math.sqrt(len(logs))
    return math.exp(mean), math.exp(mean - half), math.exp(mean + half)


RANK_CHECK_CALLS = 50


def rank_check_host_time(call: Call, length: int, device: torch.device) -> dict:
    """Host time of the SP-group rank check (issue 22 item 4) for one of this model's calls, on a
    real world of one process (NCCL on a GPU, gloo on a CPU): ``sync`` (waited before the call) and
    ``async`` (issued before, settled after; the wait between is not counted), median of
    ``RANK_CHECK_CALLS`` calls. At SP 1 the dispatcher runs no check; this is what one would
    cost per call here."""
    import torch.distributed as dist

    import dcp_compile as dcp
    from dcp_compile.runtime.consistency import SettledAfterCall, check_sp_group_agrees, settle_pending_checks

    if dist.is_initialized():
        return {}
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    try:
        tensors = [v for v in call.inputs.values() if isinstance(v, torch.Tensor)]
        variant = dcp.Variant(1)
        sync, issue, settle = [], [], []
        for _ in range(RANK_CHECK_CALLS):
            start = time.perf_counter()
            check_sp_group_agrees(variant, tensors, dist.group.WORLD, (0,), graph_id=0, length=length, mode="sync")
            sync.append(time.perf_counter() - start)
        for _ in range(RANK_CHECK_CALLS):
            start = time.perf_counter()
            pending = check_sp_group_agrees(variant, tensors, dist.group.WORLD, (0,), graph_id=0, length=length,
                                            mode="async")
            issue.append(time.perf_counter() - start)
            synchronize(device)
            while pending is not None and not pending.completed():
                time.sleep(1e-5)
            start = time.perf_counter()
            with SettledAfterCall(pending):
                pass
            settle.append(time.perf_counter() - start)
        settle_pending_checks()
    finally:
        dist.destroy_process_group()
    return {"backend": backend, "sync_s": statistics.median(sync), "async_issue_s": statistics.median(issue),
            "async_settle_s": statistics.median(settle)}


# ---------------------------------------------------------------------------------------------
# One model
# ---------------------------------------------------------------------------------------------
def run_model(name: str, args: argparse.Namespace, device: torch.device, dtype: torch.dtype, started: float,
              deadline: float, on_step: Callable[[dict], None] | None = None) -> dict:
    """One model's profile, plans, compiles and timed steps; ``on_step`` gets the summary so far after each
    timed step (the caller rewrites its page with it, so a stopped run keeps its steps)."""
    import dcp_compile as dcp
    from dcp_compile.schedule.hardware import preset_for_device_name
    from dcp_compile.schedule.planner import PlannerConfig

    torch._dynamo.reset()
    workload = WORKLOADS[name](args, device, dtype)
    model = workload.model
    lengths = workload.lengths
    parameters = sum(p.numel() for p in model.parameters())
    say(started, f"{name}: built {workload.label}, {parameters / 1e6:.0f} M parameters; {len(lengths)} samples of "
                 f"{min(lengths)}..{max(lengths)} tokens")

    say(started, f"{name}: dcp.profile (SP 1, recompute {'/'.join(PROFILED)}, lengths "
                 f"{', '.join(map(str, workload.profile_lengths))}; held out {', '.join(map(str, workload.held_out))})")
    hardware = preset_for_device_name(torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu")
    cost_model = dcp.profile(model, workload.make_profile_inputs, lengths=workload.profile_lengths,
                             held_out=workload.held_out, sp_sizes=(1,), prior=workload.prior, recompute=PROFILED, causal=name == "llama",
                             hardware=hardware,
                             inner=args.inner, packed=workload.packed, repeats=args.profile_repeats, progress=False)
    torch._dynamo.reset()  # the profile's traces count toward the model's recompile limit: drop them
    held = cost_model.measured.held_out_summary()
    say(started, f"{name}: profiled; held-out error median {100 * held[0]:.0f}%, worst {100 * held[1]:.0f}%"
        if held else f"{name}: profiled")

    longest = max(lengths)
    state = cost_model.memory_coefficients(1, "full").fixed_bytes
    if args.memory_cap_gb:
        cap = args.memory_cap_gb * 2**30
        cap_text = f"{args.memory_cap_gb:g} GiB (--memory-cap-gb)"
    else:
        cap = state + 1.02 * (cost_model.peak_memory([longest], 1, "full") - state)
        cap_text = (f"{cap / 2**30:.2f} GiB, a stand-in: the longest sample ({longest} tokens) fits only with full "
                    "recompute, as device memory forces on the full-depth model")
    cost_model = replace(cost_model, hardware=replace(cost_model.hardware, memory_capacity=cap / MEMORY_FRACTION))
    static_policy, static_budget = static_setup(cost_model, longest, cap)
    table, keys = bucket_table(cost_model, lengths)
    sampler = dcp.DataCentricSampler(lengths, args.tokens_per_step, cost_model=cost_model, world_size=1, rank=0,
                                     seed=args.seed, memory_fraction=MEMORY_FRACTION, verify_plan=False,
                                     supervised_tokens=workload.supervised, max_sp_size=1,
                                     planner_config=PlannerConfig(pack_equal_lengths_only=not workload.packed))
    say(started, f"{name}: memory cap {cap / 2**30:.2f} GiB; static: recompute {static_policy}, {static_budget} tokens "
                 f"per micro-batch; bucket table: {len(table)} buckets")

    # Every step's three schedules, planned before anything runs (the plans depend on nothing measured later).
    planned = []
    for plan in itertools.islice(sampler, args.steps):
        indices = plan.indices
        planned.append((float(sum(workload.supervised[i] for i in indices)), {
            "static": static_schedule(indices, lengths, static_policy, static_budget),
            "bucket": bucket_schedule(indices, keys, table),
            "dcp": [Batch(tuple(mb.indices), str(mb.recompute)) for mb in plan.microbatches],
        }))

    compiled = torch.compile(model, backend="dcp", dynamic=True,
                             options={"inner": args.inner, "sp_size": 1, "check_ranks": False})
    # Compile before the clock: one call for each (trace, recompute policy) the planned steps use,
    # the shortest of its kind (one dynamo trace serves every length of a kind).
    needed: dict[tuple, tuple[int, ...]] = {}
    for _, schedules in planned:
        for batches in schedules.values():
            for batch in batches:
                for trace, members in workload.groups(batch.indices):
                    known = needed.get((trace, batch.recompute))
                    if known is None or sum(lengths[i] for i in members) < sum(lengths[i] for i in known):
                        needed[(trace, batch.recompute)] = members
    say(started, f"{name}: compiling (inner {args.inner}): {len(needed)} (trace, recompute) kinds the plans use: "
                 + ", ".join(f"{t} {p}" for t, p in needed))
    compile_start = time.perf_counter()
    for (_, policy), members in needed.items():
        run_batches(compiled, workload, [(Batch(members, policy), [workload.call(members, 1.0)])])
    model.zero_grad(set_to_none=True)
    synchronize(device)
    compile_seconds = time.perf_counter() - compile_start
    say(started, f"{name}: compiled in {compile_seconds:.0f} s")

    initial = {k: v.detach().clone() for k, v in model.state_dict().items()}
    weights = {s: initial if s == "dcp" else {k: v.clone() for k, v in initial.items()} for s in SCHEDULES}
    optimizers = {s: torch.optim.AdamW(model.parameters(), lr=args.lr, eps=1e-6) for s in SCHEDULES}
    results: dict[str, list[StepResult]] = {s: [] for s in SCHEDULES}
    plans = []
    round_seconds = None
    for step_index, (denominator, schedules) in enumerate(planned):
        if round_seconds is not None and time.perf_counter() + 1.2 * round_seconds > deadline:
            say(started, f"{name}: budget reached after {step_index} timed steps (of {args.steps} asked)")
            break
        order = SCHEDULES[step_index % 3:] + SCHEDULES[:step_index % 3]
        round_start = time.perf_counter()
        for schedule in order:
            model.load_state_dict(weights[schedule])
            results[schedule].append(timed_step(compiled, workload, optimizers[schedule], schedules[schedule],
                                                denominator, device))
            weights[schedule] = {k: v.detach().clone() for k, v in model.state_dict().items()}
        round_seconds = time.perf_counter() - round_start
        plans.append({s: [[list(b.indices), b.recompute] for b in schedules[s]] for s in SCHEDULES})
        say(started, f"{name}: step {step_index} ({results['dcp'][-1].tokens} tokens): " + ", ".join(
            f"{s} {results[s][-1].seconds:.3f} s loss {results[s][-1].loss:.5f}" for s in SCHEDULES))
        if on_step is not None:
            on_step(summarize(name, workload, results, cost_model, cap_text, static_policy, static_budget, table,
                              parameters, compile_seconds, held, plans, dtype, {}))
    del weights, optimizers
    rank_check = {}
    if args.rank_check and planned:
        first = planned[0][1]["dcp"][0]
        members = workload.groups(first.indices)[0][1]
        rank_check = rank_check_host_time(workload.call(members, 1.0), sum(lengths[i] for i in members), device)
        if rank_check:
            say(started, f"{name}: rank check per call on a {rank_check['backend']} world of 1: sync "
                         f"{1e6 * rank_check['sync_s']:.0f} us, async {1e6 * (rank_check['async_issue_s'] + rank_check['async_settle_s']):.0f} us")
    model.zero_grad(set_to_none=True)
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return summarize(name, workload, results, cost_model, cap_text, static_policy, static_budget, table, parameters,
                     compile_seconds, held, plans, dtype, rank_check)


def summarize(name, workload, results, cost_model, cap_text, static_policy, static_budget, table, parameters,
              compile_seconds, held, plans, dtype, rank_check) -> dict:
    rates = {s: sum(r.tokens for r in rs) / sum(r.seconds for r in rs) for s, rs in results.items() if rs}
    ratios = {s: paired_ratio([b.seconds / a.seconds for a, b in zip(results["dcp"], results[s])])
              for s in ("static", "bucket")}
    better = max(("static", "bucket"), key=lambda s: rates.get(s, 0.0))
    losses = [[results[s][i].loss for s in SCHEDULES] for i in range(len(results["dcp"]))]
    worst = max((max(row) - min(row)) / max(abs(statistics.mean(row)), 1e-12) for row in losses) if losses else math.nan
    tolerance = 2e-2 if dtype == torch.bfloat16 else 1e-4
    lengths = workload.lengths
    step_tokens = sum(r.tokens for r in results["dcp"])
    cap = cost_model.hardware.memory_capacity * MEMORY_FRACTION
    forced = sum(lengths[i] for plan in plans for batch in plan["dcp"] for i in batch[0]
                 if cost_model.fastest_feasible_recompute(lengths[i], 1, cap) != "none")
    predicted = {}
    for s in SCHEDULES:
        predicted[s] = sum(cost_model.time([lengths[i] for i in b[0]], 1, b[1]) for plan in plans for b in plan[s])
    return {
        "model": name, "label": workload.label,
        "data": f"{len(lengths)} samples of {min(lengths):,}..{max(lengths):,} tokens (median "
                f"{sorted(lengths)[len(lengths) // 2]:,}; {workload.mix})", "parameters": parameters, "steps": len(results["dcp"]),
        "compile_seconds": compile_seconds, "memory_cap": cap_text, "held_out_error": held,
        "static": {"recompute": static_policy, "token_budget": static_budget},
        "bucket_table": [row.__dict__ for row in table.values()],
        "tokens_per_s": rates, "ratio_dcp_over": {s: list(v) for s, v in ratios.items()}, "better_baseline": better,
        "losses": losses, "loss_max_relative_difference": worst, "loss_tolerance": tolerance,
        "losses_agree": bool(worst <= tolerance),
        "peak_bytes": {s: max((r.peak_bytes or 0.0) for r in rs) if rs and rs[0].peak_bytes is not None else None
                       for s, rs in results.items()},
        "recomputed_share": {s: sum(r.recomputed_tokens for r in rs) / max(sum(r.tokens for r in rs), 1)
                             for s, rs in results.items()},
        "forced_recompute_share": forced / max(step_tokens, 1),
        "predicted_seconds": predicted,
        "per_step": {s: [r.__dict__ for r in rs] for s, rs in results.items()},
        "rank_check": rank_check,
        "plans": plans,
    }


# ---------------------------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------------------------
def device_slug(device: torch.device) -> str:
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    return "".join(ch if ch.isalnum() else "-" for ch in name.lower()).strip("-")


def write_report(models: list[dict], args: argparse.Namespace, device: torch.device, dtype: torch.dtype,
                 skipped: list[str], total_seconds: float, status: str = "complete") -> Path:
    """single_gpu_<device>.md and .json with every model (or model so far) in ``models``, headed by ``status``."""
    from dcp_compile.device_profile.device_timing import device_name, software_versions
    from dcp_compile.device_profile.partial_results import DRY_RUN_LABEL, write_atomic

    versions = ", ".join(f"{k} {v}" for k, v in software_versions(device).items())
    dry = args.tiny and device.type != "cuda"
    label = [f"**{DRY_RUN_LABEL}** (`--tiny`: toy widths and lengths; it checks the script and measures nothing "
             "worth reading).", ""] if dry else []
    lines = [f"# One device, real models: DCP at SP 1 against static and bucket schedules ({device_name(device)})", "",
             *label, f"Status: {status}.", "",
             f"**Measured** on {device_name(device)} ({versions}), {str(dtype).removeprefix('torch.')}, AdamW, "
             f"inner compiler {args.inner}, {args.tokens_per_step:,} tokens per step, the same samples and loss weights "
             f"per step for every schedule, one step of each in turn from its own weights (the order rotating). "
             f"Run: `python benchmarks/single_gpu.py{' --tiny' if args.tiny else ''} --layers {args.layers} --steps "
             f"{args.steps} --budget-s {args.budget_s:g}` ({total_seconds:.0f} s in all, compiles and profiles "
             "included). Tokens/s: the timed steps' tokens over their seconds (forward, backward, optimizer). "
             "Ratios: per step, geometric mean with its 95% t-interval. "
             + ("Inner compiler aot_eager: Inductor's compile of every (trace, recompute) kind the plans use would not "
                "fit the budget (`--inner inductor` runs it). " if args.inner == "aot_eager" else "")
             + f"{args.layers} layers of each model, so the memory cap is a stand-in (below).", ""]
    for m in models:
        rates = m["tokens_per_s"]
        lines += [f"## {m['label']}", "",
                  f"{m['parameters'] / 1e6:.0f} M parameters; data: {m['data']}; {m['steps']} timed steps, compiled in "
                  f"{m['compile_seconds']:.0f} s. Memory cap: {m['memory_cap']}. Static: recompute "
                  f"{m['static']['recompute']}, {m['static']['token_budget']:,} tokens per micro-batch. Bucket table: "
                  + "; ".join(f"{r['key']}: batch {r['batch_size']}, {r['recompute']}" for r in m["bucket_table"])
                  + ".", "",
                  "| schedule | tokens/s | DCP / it (95% interval) | peak memory (GiB) | tokens recomputed | "
                  "predicted s (cost model) |", "|---|---:|---|---:|---:|---:|"]
        for s in SCHEDULES:
            ratio = m["ratio_dcp_over"].get(s)
            ratio_text = f"{ratio[0]:.2f}x ({ratio[1]:.2f}-{ratio[2]:.2f}x)" if ratio else "1"
            peak = m["peak_bytes"][s]
            lines.append(f"| {s} | {rates.get(s, math.nan):,.0f} | {ratio_text} | "
                         f"{'n/a (CPU)' if peak is None else f'{peak / 2**30:.2f}'} | "
                         f"{100 * m['recomputed_share'][s]:.0f}% | {m['predicted_seconds'][s]:.3f} |")
        better = m["better_baseline"]
        ratio = m["ratio_dcp_over"][better]
        met = ratio[0] >= GOAL
        reason = "" if met else (
            f" Why not: at SP 1, DCP gains only by not recomputing and by packing; "
            f"{100 * m['forced_recompute_share']:.0f}% of the tokens are in samples that need recompute under any "
            f"schedule (cost model, this cap), and the better baseline recomputes "
            f"{100 * m['recomputed_share'][better]:.0f}% of its tokens against DCP's "
            f"{100 * m['recomputed_share']['dcp']:.0f}%; the cost model predicted "
            f"{m['predicted_seconds'][better] / m['predicted_seconds']['dcp']:.2f}x.")
        lines += ["", f"Losses: max relative difference between schedules {m['loss_max_relative_difference']:.1e} "
                      f"(tolerance {m['loss_tolerance']:.0e}): {'agree' if m['losses_agree'] else 'DISAGREE'}.",
                  f"Ratio DCP / better baseline ({better}): {ratio[0]:.2f}x (95% interval {ratio[1]:.2f}-{ratio[2]:.2f}x); "
                  f"goal >= {GOAL}x: {'met' if met else 'not met'}.{reason}", ""]
    for name in skipped:
        lines += [f"## {name}: not run (the time budget was spent, or the run was stopped)", ""]
    checked = [m for m in models if m.get("rank_check")]
    if checked:
        lines += ["## The rank check's host time (issue 22 item 4)", "",
                  "At SP 1 the dispatcher checks no group (only SP > 1 calls are checked), so the steps above paid "
                  "none. Timed apart: `check_sp_group_agrees` on one of the model's calls, on a real world of one "
                  f"process, median of {RANK_CHECK_CALLS} calls; the share is what one check per call of DCP's "
                  "steps would add to them (calls per step x host time / step time).", "",
                  "| model | backend | sync per call (us) | async per call (us) | DCP calls per step | "
                  "sync share of a step | async share |", "|---|---|---:|---:|---:|---:|---:|"]
        for m in checked:
            check = m["rank_check"]
            steps = m["per_step"]["dcp"]
            calls = statistics.mean(r["calls"] for r in steps)
            seconds = statistics.mean(r["seconds"] for r in steps)
            asynchronous = check["async_issue_s"] + check["async_settle_s"]
            lines.append(f"| {m['model']} | {check['backend']} | {1e6 * check['sync_s']:.0f} | {1e6 * asynchronous:.0f} | "
                         f"{calls:.1f} | {100 * calls * check['sync_s'] / seconds:.2f}% | "
                         f"{100 * calls * asynchronous / seconds:.2f}% |")
        lines.append("")
    args.out_dir.mkdir(parents=True, exist_ok=True)
    slug = device_slug(device)
    path = args.out_dir / f"single_gpu_{slug}.md"
    write_atomic(path, "\n".join(lines))
    write_atomic(args.out_dir / f"single_gpu_{slug}.json", json.dumps(
        {"device": device_name(device), "software": software_versions(device), "status": status,
         "dry_run": dry, "label": label[0] if label else "", "inner": args.inner,
         "dtype": str(dtype), "tokens_per_step": args.tokens_per_step, "layers": args.layers, "tiny": args.tiny,
         "skipped": skipped, "models": models}, indent=1, default=str))
    return path


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["llama", "wan"], choices=sorted(WORKLOADS))
    parser.add_argument("--layers", type=int, default=None, help="transformer blocks (default 4; 2 with --tiny)")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per model at most (the budget may cut them)")
    parser.add_argument("--tokens-per-step", type=int, default=None, help="default 131072 (1024 with --tiny)")
    parser.add_argument("--inner", default="aot_eager", choices=["aot_eager", "inductor", "eager"])
    parser.add_argument("--profile-repeats", type=int, default=2)
    parser.add_argument("--memory-cap-gb", type=float, default=None)
    parser.add_argument("--budget-s", type=float, default=240.0, help="the whole run's wall-time budget")
    parser.add_argument("--dit-batch", action="store_true",
                        help="batch a DiT micro-batch's samples of one latent shape into one call (more traces to compile)")
    parser.add_argument("--no-rank-check", dest="rank_check", action="store_false",
                        help="skip the rank check's host-time measurement on a world of one process")
    parser.add_argument("--lr", type=float, default=1e-5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tiny", action="store_true", help="tiny widths and lengths (CPU smoke run)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out-dir", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    args.layers = args.layers or (2 if args.tiny else 4)
    args.tokens_per_step = args.tokens_per_step or (1024 if args.tiny else 131072)
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if device.type == "cpu":
        torch.set_num_threads(1)
    started = time.perf_counter()
    end = started + args.budget_s
    say(started, f"single-GPU benchmark on {device}: models {', '.join(args.models)}, {args.layers} layers, "
                 f"inner {args.inner}, budget {args.budget_s:.0f} s")
    from dcp_compile.device_profile.partial_results import Progress, interruptible

    models: list[dict] = []
    skipped: list[str] = []
    current: list[dict] = []  # the model being run: its summary after its last timed step
    progress = Progress(len(args.models) * args.steps, unit="timed steps (models x --steps)")

    def flush() -> Path:
        shown = models + current
        left = [n for n in args.models if n not in {m["model"] for m in shown} and n not in skipped]
        gone = skipped + (left if progress.stopped else [])
        return write_report(shown, args, device, dtype, gone, time.perf_counter() - started, progress.status())

    def on_step(summary: dict) -> None:
        current[:] = [summary]
        progress.done = sum(m["steps"] for m in models) + summary["steps"]
        flush()

    with interruptible(progress, flush):
        for position, name in enumerate(args.models):
            left = end - time.perf_counter()
            if left <= 0:
                skipped.append(name)
                say(started, f"{name}: skipped, the budget is spent")
                continue
            deadline = time.perf_counter() + left / (len(args.models) - position)
            models.append(run_model(name, args, device, dtype, started, deadline, on_step))
            current.clear()
            progress.done = sum(m["steps"] for m in models)
            flush()
    if progress.done < progress.total:
        progress.stopped = f"--budget-s {args.budget_s:g} s: the timed steps were cut to fit, or a model did not start"
    path = flush()
    print(path.read_text())
    say(started, f"wrote {path} ({progress.status()})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
