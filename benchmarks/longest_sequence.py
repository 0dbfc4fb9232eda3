"""The longest sequence one GPU trains: measured, beside what the cost model's memory model predicts.

Issue 37's last line: a Llama-3-8B-shaped ``transformers.LlamaForCausalLM`` (width 4096, 32 heads with
8 KV heads, SwiGLU 14,336, vocabulary 128,256, RoPE theta 500,000; random weights, nothing
downloaded), ``--layers`` of its 32 layers, bf16 parameters and gradients, compiled with
``torch.compile(model, backend="dcp", dynamic=True)`` at SP 1, trains forward and backward on ONE
packed sequence of L tokens under each recompute policy of ``--policies`` (default ``lean``, then
``offload``, then ``block``: see :mod:`dcp_compile.variant` and docs/cost-model.md). Per policy, in
that order, while the time budget lasts:

1. **calibration** (measured): after a warm-up call that compiles the variant, two steps at
   ``--calibration`` lengths (default 16,384 and 32,768 tokens); each step's peak is
   ``torch.cuda.max_memory_allocated()`` less the memory allocated before it (parameters,
   gradients, inputs), so the two give a measured slope (bytes per token) and intercept;
2. **predictions**: the cost model's (**modelled**: ``ModelProfile.transformer`` of this exact shape
   and layer count, bf16 activations, parameters and gradients, no optimizer state; the hardware
   preset of the GPU found, ``preset_for_device_name``; the cap the device's whole memory,
   ``torch.cuda.mem_get_info()[1]``) longest sequence, ``CostModel.token_capacity(1, policy, cap)``,
   and the length the measured slope reaches in the memory free for the step;
3. **tries** (measured): one step at the smaller of the two (rounded down to a multiple of 1,024);
   a ``torch.OutOfMemoryError`` is caught, recorded, and its memory freed; then, where time is
   left, one try about 10% longer after a fit, 10% shorter after an OOM (``--tries``; more tries
   bisect between the longest fit and the shortest OOM). A try whose estimated time does not fit
   what is left of the budget is not run (said in the table), except the first try of a policy,
   which is shortened to what the time allows and labelled a lower bound (time-capped).

Every try records its tokens, fit or OOM, the measured peak above the step's start, the seconds
it took, the estimate made before it, and the modelled peak at that length. The allocator runs
with ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`` unless the environment sets it (as
long-sequence training does: without it, fragmentation ends a long run before the memory does).

Time per try on an H100 (why ``--layers 1``): attention dominates. Causal flash attention's forward
over L tokens costs ``2 L^2 h`` FLOPs per layer (``4 L^2 h`` for QK^T and PV, halved by the mask;
h = 4,096), its backward 2.5 times that, and the whole-block recompute of ``block``/``offload``/
``lean`` runs the forward once more: ``9 L^2 h`` per layer per step (the shorthand
``3.5 x 2 L^2 h x layers / 2`` is half of the forward and backward, ``7 L^2 h``, without the recompute). The model places lean at ~825K tokens on an
H100 with one layer (its ~95 KB per token on the device do not depend on the layer count):
2.5e16 FLOPs, 63 s at 400 TFLOP/s (torch's SDPA measured 425 fwd+bwd on an H200) and ~100 s at 250
(the project's Triton varlen kernel measured 225; benchmarks/results/kernels_nvidia-h200.csv),
plus ~8 s of matmuls (the 525M-parameter head and the layer: forward, backward, recompute); the
cost model says 68 s. ``offload`` and ``block`` (~300K tokens) take 10-15 s a try, a calibration
step under 1 s; before the first try come the imports, the model and lean's compile (aot_eager),
about 30 s. Two layers would double the attention. So under gpu_check.sh's default 120 s (110 s
for this script, counted from its start) lean's first try is most likely time-capped, to about
650-750K tokens on an H100 (a measured lower bound) and nothing is left for the other policies;
``GPU_CHECK_BUDGET_LONGEST_SEQUENCE=240`` gives an H100 lean's whole try and the 10% longer one
and the cheaper policies. An H200 places ~1.5M tokens under lean (3.3 times the attention work:
200-330 s a try): ``GPU_CHECK_BUDGET_LONGEST_SEQUENCE=420`` for its whole try.

What one layer says about 32: under ``offload`` and ``lean`` the device's activation bytes per token
hardly depend on the layer count (the block inputs wait in host memory; the device holds two of
them and one layer's working set), but the model state of 32 layers does, and so does the host
memory the offloaded inputs take (8 KB per token per layer); under ``block`` every layer's input
stays on the device. The page gives the 32-layer state and the longest sequence it leaves (modelled)
in this run's setting and in the project's documented one (benchmarks/results/capacity.md: ZeRO-3
with the optimizer offloaded), beside ALST's measured 500K tokens on one H100 (arXiv 2506.13996).

``--tiny`` (or ``--device cpu``): a tiny Llama in fp32 on the CPU, a pipeline check labelled "dry run on
CPU": OOM cannot happen there, so the memory is a stand-in (the first policy's measured line at
``--stand-in-tokens``), a "fit" is a measured peak within it, and the peak is
measured as benchmarks/memory_peaks.py does (``VmHWM`` reset through ``/proc/self/clear_refs``, the
process run with ``MALLOC_MMAP_THRESHOLD_=65536``: the script starts itself again with it). On a CPU
host and device are one memory: the modelled peak there is the device's plus the offloaded inputs,
less what the device part prices as copied back (as memory_peaks.py predicts it).

Writes ``longest_sequence_<gpu>.md`` and ``.json`` (``<gpu>``: the device's name in lower case with
dashes; ``cpu`` on a CPU) to ``--out-dir``, rewritten after every step, with a status line; SIGINT or
SIGTERM (gpu_check.sh's time limit) leaves a valid page marked partial. The budget is ``--budget-s``,
cut to ``GPU_CHECK_STEP_BUDGET_S`` less 10 s where that is set. Run::

    python benchmarks/longest_sequence.py --out-dir $OUT                  # GPU, up to --budget-s (600 s)
    python benchmarks/longest_sequence.py --tiny --out-dir /tmp/x         # CPU dry run, 30-60 s on 2 busy cores
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

PROCESS_STARTED = time.perf_counter()  # the step's time limit counts the imports too
MMAP_THRESHOLD = "65536"
if (__name__ == "__main__" and os.environ.get("MALLOC_MMAP_THRESHOLD_") != MMAP_THRESHOLD
        and ("--tiny" in sys.argv or "cpu" in sys.argv)):  # a CPU run: start again before torch is imported
    os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, "MALLOC_MMAP_THRESHOLD_": MMAP_THRESHOLD})

import torch  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import dcp_compile as dcp  # noqa: E402
from dcp_compile.device_profile.device_timing import device_name, software_versions, synchronize  # noqa: E402
from dcp_compile.device_profile.partial_results import DRY_RUN_LABEL, Progress, interruptible, write_atomic  # noqa: E402
from dcp_compile.schedule.cost_model import CostModel, ModelProfile, StateSharding  # noqa: E402
from dcp_compile.schedule.hardware import Hardware, preset_for_device_name  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
FULL_LAYERS = 32
ALST_ONE_H100 = 500_000  # tokens, Llama-3-8B on one H100, measured (arXiv 2506.13996, Table 1)
DOCUMENTED_CAPACITY_FRACTION = 0.9  # the planner's default cap, as benchmarks/results/capacity.md uses it
LLAMA_3_8B = dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
                  head_dim=128, vocab_size=128256, tie_word_embeddings=False, rope_theta=500000.0,
                  max_position_embeddings=1 << 21, rms_norm_eps=1e-5)
LLAMA_TINY = dict(LLAMA_3_8B, hidden_size=64, intermediate_size=224, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=16, vocab_size=256)
SAFETY = 1.3  # a try starts only if 1.3 x its estimated seconds (+5 s) fit what is left
FAILURES = ("OOM", "over the stand-in cap")
STOPPED = "stopped while running: the run ended before this step did"
GB = 1e9


# ---------------------------------------------------------------------------------------------
# Records
# ---------------------------------------------------------------------------------------------
@dataclass
class Step:
    """One forward+backward (or one that was not run, and why): measured where it ran."""

    policy: str
    kind: str  # "calibration" or "try"
    tokens: int
    result: str  # "fit", "OOM", "over the stand-in cap", "error: ...", "not run: ..."
    peak_bytes: float | None = None  # measured: the step's peak above what was allocated before it
    allocated_peak_bytes: float | None = None  # measured: torch.cuda.max_memory_allocated (CUDA only)
    before_bytes: float | None = None  # measured: allocated (CUDA) or resident (CPU) before the step
    seconds: float | None = None  # measured wall clock of the step, synchronised
    estimated_seconds: float | None = None  # estimated before the step (tries)
    modelled_peak_bytes: float = 0.0  # modelled: the same quantity as peak_bytes
    note: str = ""

    @property
    def ran(self) -> bool:
        return not self.result.startswith(("not run", "stopped"))


@dataclass
class PolicyResult:
    """What one policy measured and what the model predicted for it."""

    policy: str
    steps: list[Step] = field(default_factory=list)
    measured_bytes_per_token: float | None = None
    measured_intercept_bytes: float | None = None
    modelled_bytes_per_token: float = 0.0  # the model's slope between the calibration lengths
    modelled_intercept_bytes: float = 0.0
    free_bytes: float | None = None  # memory the step may take (measured on CUDA; the stand-in on CPU)
    modelled_longest: int | None = None
    measured_slope_longest: int | None = None
    warm_up_seconds: float | None = None  # the variant's compile and first step, at a short length

    def tries(self) -> list[Step]:
        return [s for s in self.steps if s.kind == "try" and s.ran]

    @property
    def longest_fit(self) -> int | None:
        fits = [s.tokens for s in self.steps if s.ran and s.result == "fit"]
        return max(fits) if fits else None

    @property
    def shortest_failure(self) -> int | None:
        failed = [s.tokens for s in self.steps if s.result in FAILURES]
        return min(failed) if failed else None


@dataclass
class Run:
    """Everything the page shows; rewritten after every step."""

    device: str
    software: dict[str, str]
    dry_run: bool
    layers: int
    dtype: str
    inner: str
    memory_capacity_bytes: float
    cap_note: str
    state_modelled_bytes: float
    args: dict[str, Any]
    allocator: str
    policies: list[PolicyResult] = field(default_factory=list)
    full_depth: dict[str, Any] = field(default_factory=dict)
    build_seconds: float = 0.0
    status: str = ""


# ---------------------------------------------------------------------------------------------
# Model, inputs, cost model
# ---------------------------------------------------------------------------------------------
def llama_config(tiny: bool, layers: int):
    import transformers

    return transformers.LlamaConfig(**(LLAMA_TINY if tiny else LLAMA_3_8B), num_hidden_layers=layers)


def build_model(config, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    """Random weights made on the device itself (a 128K-entry vocabulary initialised on the host
    would take longer than a try), in ``dtype``, switched to packed (varlen) attention."""
    import transformers

    from dcp_compile.runtime.huggingface import use_packed_attention

    torch.manual_seed(0)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = transformers.LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(previous)
    model.to(device=device, dtype=dtype).train()
    return use_packed_attention(model)


def profile_for(config, layers: int, dtype_bytes: int) -> ModelProfile:
    """The cost model's profile of exactly what runs: this shape and layer count, activations,
    parameters and gradients in the run's dtype, no optimizer state (no optimizer steps here).
    Built from the shape, not ``ModelProfile.from_config``: under transformers 5 a Llama config
    keeps its RoPE theta in ``rope_parameters``, which the config reader does not see."""
    return ModelProfile.transformer(
        f"llama-3-8b shape, {layers} of {FULL_LAYERS} layers", num_layers=layers, hidden_size=config.hidden_size,
        num_heads=config.num_attention_heads, num_kv_heads=config.num_key_value_heads,
        ffn_hidden_size=config.intermediate_size, gated_mlp=True, vocab_size=config.vocab_size, causal=True,
        rotary=True, dtype_bytes=dtype_bytes, gradient_dtype_bytes=dtype_bytes, optimizer_bytes_per_parameter=0,
    )


def packed_inputs(tokens: int, vocab: int, device: torch.device) -> tuple[dict[str, torch.Tensor], list[int]]:
    """ONE sequence of ``tokens`` tokens as a packed row (``dcp.pack_sequences``)."""
    ids = torch.randint(1, vocab, (tokens,), generator=torch.Generator().manual_seed(tokens))
    packed = dcp.pack_sequences([ids]).to(device)
    inputs = {"input_ids": packed.input_ids, "labels": packed.labels, "position_ids": packed.position_ids}
    return inputs, packed.sequence_lengths


def modelled_step_bytes(cost_model: CostModel, tokens: int, policy: str, one_memory: bool) -> float:
    """The modelled peak of one step above what is allocated before it: every per-token and capped
    term, without the model state and the runtime's reserve. ``one_memory`` (a CPU): plus the
    offloaded block inputs, less the reloaded ones the device part counts (memory_peaks.py's rule)."""
    coefficients = cost_model.memory_coefficients(1, policy)
    device_part = coefficients.peak(tokens) - coefficients.fixed_bytes
    if not one_memory:
        return device_part
    profile = cost_model.profile
    return (device_part - profile.reloaded_bytes_per_token(policy) * tokens
            + profile.host_activation_bytes_per_token(policy) * tokens)


def modelled_capacity(step_bytes: Callable[[int], float], free: float) -> int:
    """The most tokens whose modelled step fits ``free`` bytes (the modelled peak grows with them)."""
    if step_bytes(1) > free:
        return 0
    high = 2
    while step_bytes(high) <= free:
        high *= 2
    low = high // 2
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if step_bytes(middle) <= free else (low, middle)
    return low


# ---------------------------------------------------------------------------------------------
# Measuring one step
# ---------------------------------------------------------------------------------------------
def _status_bytes(key: str) -> int:
    with open("/proc/self/status") as handle:
        for line in handle:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {key} in /proc/self/status")


def _reset_resident_peak() -> None:
    with open("/proc/self/clear_refs", "w") as handle:
        handle.write("5")


class Stepper:
    """Runs one forward+backward of the compiled model on one packed sequence under a policy and
    measures its peak above the step's start; catches an OOM and frees what it held."""

    def __init__(self, model: torch.nn.Module, device: torch.device, inner: str, vocab: int) -> None:
        self.model, self.device, self.vocab = model, device, vocab
        self.compiled = torch.compile(model, backend="dcp", dynamic=True,
                                      options={"inner": inner, "sp_size": 1, "check_ranks": False})

    def _forward_backward(self, policy: str, inputs: dict[str, torch.Tensor], lengths: list[int]) -> None:
        with dcp.use(dcp.Variant(1, policy), sequence_lengths=lengths):
            loss = self.compiled(**inputs).loss
        loss.backward()

    def _before(self) -> float:
        gc.collect()
        if self.device.type == "cuda":
            synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            return float(torch.cuda.memory_allocated(self.device))
        before = _status_bytes("VmRSS")
        _reset_resident_peak()
        return float(before)

    def _peak(self) -> tuple[float, float | None]:
        """(the step's peak as measured, max_memory_allocated on CUDA)."""
        if self.device.type == "cuda":
            allocated = float(torch.cuda.max_memory_allocated(self.device))
            return allocated, allocated
        return float(_status_bytes("VmHWM")), None

    def free_bytes(self) -> float:
        """What the next step may allocate: the device's free memory and the allocator's cached blocks."""
        gc.collect()
        torch.cuda.empty_cache()
        free, _ = torch.cuda.mem_get_info(self.device)
        return float(free + torch.cuda.memory_reserved(self.device) - torch.cuda.memory_allocated(self.device))

    def warm_up(self, policy: str, tokens: int) -> float:
        """Compile the policy's variant (forward and backward) at a short length; seconds taken."""
        inputs, lengths = packed_inputs(tokens, self.vocab, self.device)
        started = time.perf_counter()
        self._forward_backward(policy, inputs, lengths)
        synchronize(self.device)
        self.model.zero_grad(set_to_none=False)  # gradients stay allocated: part of every "before"
        return time.perf_counter() - started

    def measure(self, policy: str, kind: str, tokens: int) -> Step:
        inputs, lengths = packed_inputs(tokens, self.vocab, self.device)
        step = Step(policy, kind, tokens, "fit")
        failure = None
        step.before_bytes = self._before()
        started = time.perf_counter()
        try:
            self._forward_backward(policy, inputs, lengths)
            synchronize(self.device)
        except RuntimeError as error:  # an OOM (also where a wrapper re-raised it), or another failure: recorded
            text = str(error).strip()
            oom = isinstance(error, torch.OutOfMemoryError) or "out of memory" in text.lower()
            failure = ("OOM" if oom else f"error: {type(error).__name__}", (text.splitlines() or [""])[0][:300])
        step.seconds = time.perf_counter() - started
        peak, allocated = self._peak()
        step.peak_bytes, step.allocated_peak_bytes = peak - step.before_bytes, allocated
        if failure is not None:
            step.result, step.note = failure
            print(f"  {policy} {kind} at {tokens:,} tokens: {failure[0]}: {failure[1]}", flush=True)
        del inputs
        self._release()
        return step

    def _release(self) -> None:
        """Drop what a step (or its failure's traceback) held: gradients zeroed in place, cache emptied."""
        self.model.zero_grad(set_to_none=False)
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()


# ---------------------------------------------------------------------------------------------
# The procedure
# ---------------------------------------------------------------------------------------------
class Budget:
    """Seconds left of the run's budget, counted from ``started`` (default: now)."""

    def __init__(self, seconds: float, started: float | None = None) -> None:
        self.seconds, self.started = seconds, time.perf_counter() if started is None else started

    def left(self) -> float:
        return self.seconds - (time.perf_counter() - self.started)


def step_budget(requested: float) -> float:
    """``--budget-s``, cut to gpu_check.sh's limit for the step less 10 s (to write the page)."""
    limit = os.environ.get("GPU_CHECK_STEP_BUDGET_S")
    return min(requested, float(limit) - 10) if limit else requested


def round_down(tokens: float, multiple: int) -> int:
    return max(multiple, int(tokens // multiple) * multiple)


def fit_slope(calibration: list[Step]) -> tuple[float, float] | None:
    """(bytes per token, intercept) through the two calibration steps, if both fit."""
    fitted = [s for s in calibration if s.result == "fit" and s.peak_bytes is not None]
    if len(fitted) < 2:
        return None
    a, b = fitted[0], fitted[-1]
    slope = (b.peak_bytes - a.peak_bytes) / (b.tokens - a.tokens)
    return slope, a.peak_bytes - slope * a.tokens


class Procedure:
    """Calibrate, predict and try, one policy after another, within the budget."""

    def __init__(self, args: argparse.Namespace, stepper: Stepper, cost_model: CostModel, run: Run,
                 budget: Budget, flush: Callable[[], None], progress: Progress) -> None:
        self.args, self.stepper, self.cost_model, self.run = args, stepper, cost_model, run
        self.budget, self.flush, self.progress = budget, flush, progress
        self.one_memory = stepper.device.type != "cuda"
        self.stand_in_free: float | None = None  # CPU: set from the first measured slope (stand_in)

    def modelled(self, tokens: int, policy: str) -> float:
        return modelled_step_bytes(self.cost_model, tokens, policy, self.one_memory)

    def record(self, result: PolicyResult, step: Step) -> None:
        step.modelled_peak_bytes = self.modelled(step.tokens, step.policy)
        if (self.one_memory and step.kind == "try" and step.result == "fit" and step.peak_bytes is not None
                and self.stand_in_free is not None and step.peak_bytes > self.stand_in_free):
            step.result = "over the stand-in cap"
        result.steps.append(step)
        self.progress.done += 1
        self.flush()
        measured = "-" if step.peak_bytes is None else f"{step.peak_bytes / GB:.2f} GB"
        took = "" if step.seconds is None else f" in {step.seconds:.1f} s"
        print(f"{step.policy} {step.kind} {step.tokens:,} tokens: {step.result}, peak {measured} "
              f"(modelled {step.modelled_peak_bytes / GB:.2f} GB){took}", flush=True)

    def not_run(self, result: PolicyResult, kind: str, tokens: int, why: str, estimate: float | None = None) -> None:
        self.record(result, Step(result.policy, kind, tokens, f"not run: {why}", estimated_seconds=estimate))

    def estimate(self, result: PolicyResult, tokens: int) -> float:
        """Seconds a step of ``tokens`` should take: the longer calibration step's measured time,
        scaled by the cost model's time ratio (which knows attention grows as L^2)."""
        reference = max((s for s in result.steps if s.kind == "calibration" and s.result == "fit"),
                        key=lambda s: s.tokens)
        ratio = self.cost_model.time([tokens], 1, result.policy) / self.cost_model.time([reference.tokens], 1, result.policy)
        return reference.seconds * ratio

    def affordable(self, estimate: float) -> bool:
        return SAFETY * estimate + 5 <= self.budget.left()

    def policy(self, name: str) -> PolicyResult:
        result = PolicyResult(name)
        self.run.policies.append(result)
        short, long_ = self.args.calibration
        if self.budget.left() < (5 if self.args.tiny else 20):  # a variant's compile and warm-up
            for tokens in (short, long_):
                self.not_run(result, "calibration", tokens, "time budget spent")
            for _ in range(self.args.tries):
                self.not_run(result, "try", 0, "time budget spent")
            return result
        result.warm_up_seconds = self.stepper.warm_up(name, self.args.warm_up_tokens)
        print(f"{name}: variant compiled and warmed up in {result.warm_up_seconds:.1f} s", flush=True)
        for tokens in (short, long_):
            self.record(result, self.stepper.measure(name, "calibration", tokens))
        self.predict(result)
        self.flush()
        self.tries(result)
        return result

    def predict(self, result: PolicyResult) -> None:
        short, long_ = self.args.calibration
        model_short, model_long = self.modelled(short, result.policy), self.modelled(long_, result.policy)
        result.modelled_bytes_per_token = (model_long - model_short) / (long_ - short)
        result.modelled_intercept_bytes = model_short - result.modelled_bytes_per_token * short
        slope = fit_slope([s for s in result.steps if s.kind == "calibration"])
        if slope is not None and slope[0] <= 0:
            slope = None
        if self.one_memory:
            result.free_bytes = self.stand_in(result, slope)
            result.modelled_longest = modelled_capacity(lambda n: self.modelled(n, result.policy), result.free_bytes)
        else:
            result.free_bytes = self.stepper.free_bytes()
            result.modelled_longest = self.cost_model.token_capacity(1, result.policy, self.run.memory_capacity_bytes)
        if slope is not None:
            result.measured_bytes_per_token, result.measured_intercept_bytes = slope
            result.measured_slope_longest = int((result.free_bytes - slope[1]) / slope[0])

    def stand_in(self, result: PolicyResult, slope: tuple[float, float] | None) -> float:
        """CPU: the stand-in memory for a step, fixed at the first policy: its measured line at
        ``--stand-in-tokens`` (the model's step there where no slope was measured)."""
        if self.stand_in_free is None:
            tokens = self.args.stand_in_tokens
            self.stand_in_free = (slope[1] + slope[0] * tokens if slope is not None
                                  else self.modelled(tokens, result.policy))
        return self.stand_in_free

    def first_length(self, result: PolicyResult) -> int | None:
        candidates = [n for n in (result.modelled_longest, result.measured_slope_longest) if n]
        if not candidates or result.measured_bytes_per_token is None:
            return None
        return round_down(min(candidates), self.args.round_to)

    def tries(self, result: PolicyResult) -> None:
        tokens = self.first_length(result)
        if tokens is None:
            for _ in range(self.args.tries):
                self.not_run(result, "try", 0, "no measured slope (a calibration step failed)")
            return
        for index in range(self.args.tries):
            estimate = self.estimate(result, tokens)
            note = ""
            if not self.affordable(estimate):
                capped = self.time_capped_length(result) if index == 0 else None
                if capped is None:
                    for _ in range(index, self.args.tries):
                        self.not_run(result, "try", tokens, f"estimated {estimate:.0f} s, {self.budget.left():.0f} s left",
                                     estimate)
                    return
                note = (f"time-capped: {tokens:,} tokens would take about {estimate:.0f} s, "
                        f"{self.budget.left():.0f} s were left; a fit here is a lower bound")
                tokens, estimate = capped, self.estimate(result, capped)
            running = Step(result.policy, "try", tokens, STOPPED, estimated_seconds=estimate, note=note)
            result.steps.append(running)  # what a kill in the middle of the try leaves on the page
            self.flush()
            step = self.stepper.measure(result.policy, "try", tokens)
            result.steps.remove(running)
            step.estimated_seconds, step.note = estimate, "; ".join(filter(None, [note, step.note]))
            self.record(result, step)
            if step.result.startswith("error") or note:
                for _ in range(index + 1, self.args.tries):
                    self.not_run(result, "try", 0, "after an error" if not note else "time-capped")
                return
            tokens = self.next_length(result)
            if tokens in {s.tokens for s in result.tries()}:
                for _ in range(index + 1, self.args.tries):
                    self.not_run(result, "try", tokens, f"converged: {tokens:,} was tried")
                return

    def next_length(self, result: PolicyResult) -> int:
        """~10% longer after a fit, ~10% shorter after a failure; halfway between the longest try
        that fit and the shortest that failed once there are both."""
        tries = result.tries()
        fits = [s.tokens for s in tries if s.result == "fit"]
        failures = [s.tokens for s in tries if s.result in FAILURES]
        if fits and failures and min(failures) > max(fits):
            return round_down((max(fits) + min(failures)) / 2, self.args.round_to)
        factor = 1.1 if tries[-1].result == "fit" else 0.9
        return round_down(tries[-1].tokens * factor, self.args.round_to)

    def time_capped_length(self, result: PolicyResult) -> int | None:
        """The longest length whose estimated time fits what is left (above the calibration's)."""
        low, high = self.args.calibration[1], self.first_length(result) or 0
        if high <= low or not self.affordable(self.estimate(result, low)):
            return None
        while high - low > self.args.round_to:
            middle = (low + high) // 2
            low, high = (middle, high) if self.affordable(self.estimate(result, middle)) else (low, middle)
        return round_down(low, self.args.round_to)


# ---------------------------------------------------------------------------------------------
# What all 32 layers would hold (modelled)
# ---------------------------------------------------------------------------------------------
def full_depth(hardware: Hardware, capacity: float, run_profile: ModelProfile, lean: PolicyResult | None,
               reserved: float) -> dict[str, Any]:
    """The 32-layer model's state and the longest sequence under lean, modelled: in this run's
    setting (bf16 parameters and gradients, no optimizer state, the state on the device), and in
    the project's documented one (capacity.md: ZeRO-3 with the optimizer offloaded, fp32 gradients
    and Adam, cap 0.9 of the preset's memory); and with the measured slope in place of the model's."""
    this_setting = CostModel(profile_like(run_profile, FULL_LAYERS), hardware)
    documented = CostModel(ModelProfile.from_config("llama-3-8b"), hardware, optimizer_shards=1,
                           state_sharding=StateSharding.SHARDED_OFFLOAD)
    documented_cap = DOCUMENTED_CAPACITY_FRACTION * hardware.memory_capacity
    documented_tokens = documented.token_capacity(1, "lean", documented_cap)
    out: dict[str, Any] = {
        "this_setting_state_bytes": this_setting.model_state_bytes(),
        "this_setting_lean_tokens": this_setting.token_capacity(1, "lean", capacity),
        "documented_state_bytes": documented.model_state_bytes(),
        "documented_host_state_bytes": documented.host_state_bytes(),
        "documented_cap_bytes": documented_cap,
        "documented_lean_tokens": documented_tokens,
        "documented_host_bytes": documented.host_state_bytes()
        + documented.profile.host_activation_bytes_per_token("lean") * documented_tokens,
        "host_bytes_per_token_32_layers": documented.profile.host_activation_bytes_per_token("lean"),
        "alst_one_h100_tokens": ALST_ONE_H100,
    }
    if lean is not None and lean.measured_bytes_per_token:
        free = capacity - reserved - out["documented_state_bytes"]
        out["measured_slope_documented_tokens"] = int((free - lean.measured_intercept_bytes) / lean.measured_bytes_per_token)
    return out


def profile_like(profile: ModelProfile, layers: int) -> ModelProfile:
    """The same shape and dtypes with ``layers`` layers (the 32-layer model of this run's setting)."""
    dtype = profile.activation_dtype_bytes
    return ModelProfile.transformer(
        f"llama-3-8b shape, {layers} layers", num_layers=layers, hidden_size=profile.hidden_size,
        num_heads=profile.num_heads, num_kv_heads=profile.num_kv_heads, ffn_hidden_size=profile.ffn_hidden_size,
        gated_mlp=profile.gated_mlp, vocab_size=profile.vocab_size, causal=True, rotary=True, dtype_bytes=dtype,
        gradient_dtype_bytes=dtype, optimizer_bytes_per_parameter=0)


# ---------------------------------------------------------------------------------------------
# The page
# ---------------------------------------------------------------------------------------------
def _gb(value: float | None) -> str:
    return "-" if value is None else f"{value / GB:.2f}"


def _tokens(value: int | None) -> str:
    return "-" if not value else f"{value:,}"


def _ratio(measured: float | None, modelled: float) -> str:
    return "-" if measured is None or not modelled else f"{measured / modelled:.2f}"


def headline_rows(run: Run) -> list[str]:
    lines = ["| policy | longest fit, **measured** | shortest OOM, **measured** | longest, **modelled** | "
             "longest by the measured slope | tries run |", "|---|---:|---:|---:|---:|---:|"]
    for p in run.policies:
        lines.append(f"| {p.policy} | {_tokens(p.longest_fit)} | {_tokens(p.shortest_failure)} | "
                     f"{_tokens(p.modelled_longest)} | {_tokens(p.measured_slope_longest)} | {len(p.tries())} |")
    return lines


def slope_rows(run: Run) -> list[str]:
    lines = ["| policy | KB per token, **measured** | KB per token, **modelled** | measured / modelled | "
             "intercept GB, measured | intercept GB, modelled | memory for the step GB |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for p in run.policies:
        measured = None if p.measured_bytes_per_token is None else p.measured_bytes_per_token / 1e3
        lines.append(f"| {p.policy} | {'-' if measured is None else f'{measured:.1f}'} | "
                     f"{p.modelled_bytes_per_token / 1e3:.1f} | {_ratio(p.measured_bytes_per_token, p.modelled_bytes_per_token)} | "
                     f"{_gb(p.measured_intercept_bytes)} | {_gb(p.modelled_intercept_bytes)} | {_gb(p.free_bytes)} |")
    return lines


def step_rows(run: Run) -> list[str]:
    lines = ["| policy | step | tokens | result | peak above start GB, **measured** | **modelled** | "
             "measured / modelled | peak allocated GB | seconds | estimated s | note |",
             "|---|---|---:|---|---:|---:|---:|---:|---:|---:|---|"]
    for p in run.policies:
        for s in p.steps:
            estimate = "-" if s.estimated_seconds is None else f"{s.estimated_seconds:.1f}"
            seconds = "-" if s.seconds is None else f"{s.seconds:.2f}"
            lines.append(f"| {s.policy} | {s.kind} | {_tokens(s.tokens)} | {s.result} | {_gb(s.peak_bytes)} | "
                         f"{_gb(s.modelled_peak_bytes) if s.ran else '-'} | {_ratio(s.peak_bytes, s.modelled_peak_bytes)} | "
                         f"{_gb(s.allocated_peak_bytes)} | {seconds} | {estimate} | {s.note.replace('|', '/')} |")
    return lines


def full_depth_lines(run: Run) -> list[str]:
    f = run.full_depth
    if not f:
        return []
    slope = f.get("measured_slope_documented_tokens")
    dry = [f"In this dry run: the Llama-3-8B shape on the H100 preset ({DRY_RUN_LABEL}: no measured slope).", ""]
    return [
        f"## With all {FULL_LAYERS} layers (**modelled**)", "", *(dry if run.dry_run else []),
        f"This run trains {run.layers} of {FULL_LAYERS} layers. Under `offload` and `lean` the device's activation "
        "bytes per token hardly depend on the layer count (the block inputs wait in host memory; the device holds "
        "two of them and one layer's working set), so the measured slope above stands for 32 layers too; the model "
        "state does not, nor does the host memory the offloaded inputs take "
        f"({f['host_bytes_per_token_32_layers'] / 1e3:.0f} KB per token with 32 layers). Under `block` every "
        "layer's input stays on the device: its slope grows with the layers.", "",
        f"* This run's setting (bf16 parameters and gradients on the device, no optimizer state), 32 layers: state "
        f"{f['this_setting_state_bytes'] / GB:.1f} GB, longest sequence under lean {_tokens(f['this_setting_lean_tokens'])} "
        "tokens (modelled, the same cap as the tries).",
        f"* The project's documented setting (benchmarks/results/capacity.md, `dcp.shard_model(model, "
        f"reshard_after_forward=True, offload=True)`: ZeRO-3 with the optimizer offloaded, fp32 gradients and Adam), "
        f"one GPU: device state {f['documented_state_bytes'] / GB:.1f} GB, host state "
        f"{f['documented_host_state_bytes'] / GB:.0f} GB; longest sequence under lean "
        f"{_tokens(f['documented_lean_tokens'])} tokens (modelled, cap {f['documented_cap_bytes'] / GB:.0f} GB = "
        f"{DOCUMENTED_CAPACITY_FRACTION} of the preset's memory), with {f['documented_host_bytes'] / GB:.0f} GB of host "
        "memory (state and offloaded inputs)"
        + (f"; with the measured lean slope and intercept in place of the model's (same state, this run's cap): "
           f"{_tokens(slope)} tokens (measured slope, modelled state)." if slope else "."),
        f"* ALST (arXiv 2506.13996, Table 1), **measured**: Llama-3-8B, 32 layers, {f['alst_one_h100_tokens']:,} tokens "
        "on one H100 (ZeRO-3 with the optimizer offloaded, tiled loss and MLP, checkpoints offloaded to host memory).", "",
    ]


def markdown(run: Run) -> str:
    label = ([f"**{DRY_RUN_LABEL}**: a tiny Llama in fp32 on the CPU; OOM cannot happen there, so the memory is a "
              "stand-in, a fit means a measured peak within it and an \"OOM\" one over it. The CPU's reference "
              "attention kernel builds each query block's scores (`[heads, rows, L]`, at most 2^18 of them, "
              "dcp_compile/kernels/varlen_attention_reference.py), which the model, priced for flash attention, "
              "does not count. It checks the script and measures nothing worth reading.", ""] if run.dry_run else [])
    versions = ", ".join(f"{k} {v}" for k, v in run.software.items())
    what = "tiny Llama (width 64)" if run.args["tiny"] else "Llama-3-8B shape"
    lines = [
        f"# Longest sequence one {'device' if run.dry_run else 'GPU'} trains: {what}, {run.layers} of {FULL_LAYERS} "
        f"layers, SP 1 ({run.device})", "", *label, f"Status: {run.status}", "",
        f"**Measured** on {run.device} ({versions}): `transformers.LlamaForCausalLM`, random weights, {run.dtype}, "
        f"`torch.compile(backend=\"dcp\", dynamic=True)`, inner compiler {run.inner}, ONE packed sequence per step "
        f"(forward and backward, no optimizer step), allocator `{run.allocator}`. A step's peak is "
        + ("`VmHWM` less `VmRSS` before it (MALLOC_MMAP_THRESHOLD_=65536). " if run.dry_run else
           "`torch.cuda.max_memory_allocated()` less the memory allocated before it (parameters, gradients, inputs). ")
        + f"Model built in {run.build_seconds:.0f} s; each policy's variant compiled and warmed up at "
        f"{run.args['warm_up_tokens']:,} tokens in " + ", ".join(
            f"{p.policy} {p.warm_up_seconds:.0f} s" for p in run.policies if p.warm_up_seconds is not None) + ".", "",
        f"**Modelled**: the cost model's memory terms for this shape and layer count (bf16 or the run's dtype for "
        f"activations, parameters and gradients; no optimizer state; state {run.state_modelled_bytes / GB:.2f} GB); "
        f"{run.cap_note}", "",
        "## Longest sequence", "", *headline_rows(run), "",
        "A try starts at the smaller of the modelled longest and the measured slope's longest (rounded down to "
        f"{run.args['round_to']:,}), then goes ~10% longer after a fit, shorter after an OOM, while time is left.", "",
        "## Bytes per token: the calibration steps' slope", "", *slope_rows(run), "",
        "## Every step", "", *step_rows(run), "",
        *full_depth_lines(run),
        f"Run: `python benchmarks/longest_sequence.py {' '.join(run.args['argv'])}`.", "",
    ]
    return "\n".join(lines)


def to_json(run: Run) -> str:
    data = asdict(run)
    for policy, result in zip(data["policies"], run.policies):
        policy["longest_fit"], policy["shortest_failure"] = result.longest_fit, result.shortest_failure
    data["label"] = DRY_RUN_LABEL if run.dry_run else "measured"
    data["labels"] = {"steps": "measured", "modelled_*": "modelled", "full_depth": "modelled (ALST: measured)"}
    return json.dumps(data, indent=1, default=str)


def status_line(run: Run, progress: Progress) -> str:
    """How far the run got: ``progress`` counts steps decided (run, or not run and why); steps not
    run for the budget make a finished run partial, and say so."""
    not_run = sum(1 for p in run.policies for s in p.steps if s.result.startswith("not run"))
    if not not_run or progress.stopped is not None or progress.done < progress.total:
        return progress.status() + (f" ({not_run} of them not run, see the table)" if not_run else "")
    return (f"partial: {progress.done - not_run} of {progress.total} steps run, {not_run} not run (the time budget, "
            "a failed calibration, or converged tries: see the table)")


def device_slug(device: torch.device) -> str:
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    return "".join(ch if ch.isalnum() else "-" for ch in name.lower()).strip("-")


# ---------------------------------------------------------------------------------------------
# Main
# ---------------------------------------------------------------------------------------------
def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default=None, help="cuda (default where there is one) or cpu (implies --tiny)")
    parser.add_argument("--tiny", action="store_true", help="a tiny Llama in fp32 on the CPU: the dry run")
    parser.add_argument("--layers", type=int, default=1, help=f"layers of the model's {FULL_LAYERS} (default 1)")
    parser.add_argument("--policies", nargs="+", default=["lean", "offload", "block"])
    parser.add_argument("--calibration", type=int, nargs=2, default=None,
                        help="the two calibration lengths (default 16384 32768; 256 512 with --tiny)")
    parser.add_argument("--tries", type=int, default=2, help="tries per policy at most (default 2)")
    parser.add_argument("--budget-s", type=float, default=600.0,
                        help="the whole run's seconds (cut to GPU_CHECK_STEP_BUDGET_S - 10 where set)")
    parser.add_argument("--inner", default="aot_eager", choices=["aot_eager", "inductor"],
                        help="inner compiler (aot_eager: Inductor's compile of three variants would not fit)")
    parser.add_argument("--stand-in-tokens", type=int, default=1536,
                        help="CPU only: the stand-in memory is the first policy's measured line at this length")
    parser.add_argument("--out-dir", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    args.argv = list(argv if argv is not None else sys.argv[1:])
    args.device = args.device or ("cuda" if torch.cuda.is_available() and not args.tiny else "cpu")
    args.tiny = args.tiny or args.device == "cpu"
    args.calibration = sorted(args.calibration or ((256, 512) if args.tiny else (16384, 32768)))
    args.round_to = 64 if args.tiny else 1024
    args.warm_up_tokens = args.calibration[0] // 4
    for policy in args.policies:
        dcp.RecomputePolicy.parse(policy)
    return args


def restart_for_peak_measurement() -> None:
    """On a CPU the peak is the resident set's: freed blocks must leave it, which glibc does for
    blocks over MALLOC_MMAP_THRESHOLD_, read at the process's start: start again with it set."""
    if os.environ.get("MALLOC_MMAP_THRESHOLD_") == MMAP_THRESHOLD:
        return
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": MMAP_THRESHOLD}
    os.execve(sys.executable, [sys.executable, str(Path(__file__).resolve()), *sys.argv[1:]], env)


def setup(args: argparse.Namespace) -> tuple[Stepper, CostModel, Run, Hardware]:
    device = torch.device(args.device)
    dtype = torch.float32 if args.tiny else torch.bfloat16
    if device.type == "cpu":
        torch.set_num_threads(1)  # a shared 2-core machine: one thread, as memory_peaks.py
    config = llama_config(args.tiny, args.layers)
    model = build_model(config, device, dtype)
    profile = profile_for(config, args.layers, torch.finfo(dtype).bits // 8)
    name = device_name(device)
    hardware = preset_for_device_name(name if device.type == "cuda" else "")
    cost_model = CostModel(profile, hardware)
    if device.type == "cuda":
        capacity = float(torch.cuda.mem_get_info(device)[1])
        cap_note = (f"cap: the device's whole memory, `torch.cuda.mem_get_info()` total {capacity / GB:.1f} GB, of which "
                    f"the model reserves {cost_model.reserved_bytes / 2**30:.0f} GiB for the runtime (context, "
                    f"workspaces); hardware preset {hardware.name} (`preset_for_device_name`). The measured slope's "
                    "longest is the length whose line through the calibration steps reaches the memory free for the "
                    "step (free device memory and the allocator's cached blocks, just before the tries).")
    else:
        capacity = 0.0
        cap_note = (f"the memory is a stand-in (a CPU cannot run out of memory): the first policy's "
                    f"({args.policies[0]}) measured line through its calibration steps at {args.stand_in_tokens:,} "
                    "tokens; a try over it is marked \"over the stand-in cap\". A CPU's host and device are one "
                    "memory, so the modelled peak counts the offloaded inputs too (memory_peaks.py's rule).")
    versions = software_versions(device)
    if device.type == "cuda":
        versions.setdefault("triton", "not installed")
    run = Run(device=name, software=versions, dry_run=device.type != "cuda", layers=args.layers,
              dtype=str(dtype).removeprefix("torch."), inner=args.inner, memory_capacity_bytes=capacity,
              cap_note=cap_note, state_modelled_bytes=cost_model.model_state_bytes(),
              args={k: v for k, v in vars(args).items() if k != "out_dir"} | {"out_dir": str(args.out_dir)},
              allocator=f"PYTORCH_CUDA_ALLOC_CONF={os.environ.get('PYTORCH_CUDA_ALLOC_CONF', '')}")
    return Stepper(model, device, args.inner, config.vocab_size), cost_model, run, hardware


def full_depth_of(run: Run, hardware: Hardware, cost_model: CostModel) -> dict[str, Any]:
    """The 32-layer figures: on the GPU found, with its measured lean slope; in the dry run on the
    H100 preset with no measured slope (a tiny model's slope says nothing about Llama's)."""
    if run.dry_run:
        return full_depth(Hardware.H100, Hardware.H100.memory_capacity, profile_like_llama(), None,
                          cost_model.reserved_bytes) | {"dry_run_note": "H100 preset, no measured slope"}
    lean = next((p for p in run.policies if p.policy == "lean"), None)
    return full_depth(hardware, run.memory_capacity_bytes, cost_model.profile, lean, cost_model.reserved_bytes)


def profile_like_llama() -> ModelProfile:
    """The Llama-3-8B-shaped profile of a GPU run (bf16), for the dry run's 32-layer figures."""
    return profile_for(llama_config(False, 1), 1, 2)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.device == "cpu" and argv is None:
        restart_for_peak_measurement()
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")  # before CUDA's allocator starts
    started = time.perf_counter()
    budget = Budget(step_budget(args.budget_s), PROCESS_STARTED)
    stepper, cost_model, run, hardware = setup(args)
    run.build_seconds = time.perf_counter() - started
    slug = device_slug(stepper.device)
    progress = Progress(len(args.policies) * (2 + args.tries), unit="steps")

    def flush() -> None:
        run.status = status_line(run, progress)
        write_atomic(args.out_dir / f"longest_sequence_{slug}.md", markdown(run))
        write_atomic(args.out_dir / f"longest_sequence_{slug}.json", to_json(run))

    procedure = Procedure(args, stepper, cost_model, run, budget, flush, progress)
    with interruptible(progress, flush):
        flush()
        for policy in args.policies:
            procedure.policy(policy)
        run.full_depth = full_depth_of(run, hardware, cost_model)
        flush()
    print(f"wrote {args.out_dir / f'longest_sequence_{slug}.md'} in {time.perf_counter() - started:.0f} s "
          f"({run.status})", flush=True)
    failed = any(s.result.startswith("error") for p in run.policies for s in p.steps)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
