"""``dcp.profile``: the cost model measured on the device at hand, as the published profiler
measures each bucket, but for any model and every variant the planner may choose."""

from __future__ import annotations

import logging
import math
import os
import statistics
import sys
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import torch

from dcp_compile.compiler.variant_selection import use
from dcp_compile.schedule.analytic import ScoreLayout
from dcp_compile.schedule.cost_model import CostModel
from dcp_compile.schedule.hardware import Hardware
from dcp_compile.schedule.measured_costs import MeasuredCosts, Measurement, fit_all, held_out_errors
from dcp_compile.schedule.model_profile import ModelProfile
from dcp_compile.schedule.profiling import call_with_inputs
from dcp_compile.variant import RECOMPUTE_POLICIES, REGIONS_BY_DEFAULT, RecomputePolicy, checkpoints_whole_blocks, Variant

from .device_timing import Timing, clock_for, device_name, software_versions, time_step
from .fake_world import fake_world

log = logging.getLogger(__name__)

DEFAULT_LENGTHS = (256, 512, 1024, 2048)
# The policies measured by default. Not `block`: on the one-process fake world its per-rank
# compute is `full`'s (the all-to-alls it sends again cost nothing there), so its compute is
# priced from `full`'s measured fit (MeasuredCosts.nearest_fit) and its communication and memory
# are modelled; one more compiled variant per SP size would measure nothing new. Nor `offload`
# (block's compute; its host copies are modelled as communication) or `lean` (the policy of
# lengths the profile cannot run: priced as `full`'s fit scales its own prior, one more MLP forward).
MEASURED_POLICIES: tuple[RecomputePolicy, ...] = tuple(p for p in RECOMPUTE_POLICIES
                                                        if not checkpoints_whole_blocks(p))


def default_held_out_lengths(lengths: Sequence[int]) -> tuple[int, ...]:
    """Points the fit does not see: the geometric midpoint of each pair of neighbouring fit
    lengths, and one 1.5x past the longest (how the fit extrapolates)."""
    ordered = sorted(set(lengths))
    middles = [round(math.sqrt(a * b)) for a, b in zip(ordered, ordered[1:])]
    return tuple(sorted({*middles, round(1.5 * ordered[-1])} - set(ordered)))


SHORTEST_PACKED_SEQUENCE = 8  # tokens: the many-short row's sequences are no shorter
MANY_SHORT = 256  # sequences in the many-short row, at most


def packed_rows(fit_lengths: Sequence[int], held_lengths: Sequence[int]) -> list[tuple[int, ...]]:
    """Rows of several equal sequences: 4 x L/4 for the two longest fitted lengths, 16 x L/16 and
    many short ones (up to 256 of at least 8 tokens) for the longest (in the fit); 3 x L/3 and
    12 x L/12 for the longest held-out length (held out: many short sequences in one row is how a
    static setup packs a short-dominated mix).

    The many-short row is what tells the per-sequence term from the attention term: rows of a few
    long sequences are all attention, and a fit of them priced a row of 256 eight-token documents
    27x under its measured time (a kernel's per-sequence work: the CPU reference attention loops
    over sequences), which steered the long-sequence replay's plans."""
    rows = [(n // 4,) * 4 for n in sorted(fit_lengths)[-2:] if n >= 4]
    rows += [(n // 16,) * 16 for n in sorted(fit_lengths)[-1:] if n >= 16]
    for n in sorted(fit_lengths)[-1:]:
        parts = min(MANY_SHORT, n // SHORTEST_PACKED_SEQUENCE)
        if parts > 16:
            rows.append((n // parts,) * parts)
    rows += [(n // parts,) * parts for n in sorted(held_lengths)[-1:] for parts in (3, 12) if n >= parts]
    return rows


def profile(
    model: torch.nn.Module,
    make_inputs: Callable[[int], Any],
    *,
    lengths: Sequence[int] = DEFAULT_LENGTHS,
    held_out: Sequence[int] | None = None,
    sp_sizes: Sequence[int] = (1, 2, 4, 8),
    recompute: Sequence[RecomputePolicy | str] = MEASURED_POLICIES,
    causal: bool = False,
    prior: ModelProfile | None = None,
    hardware: Hardware | None = None,
    optimizer_shards: int = 1,
    inner: str = "inductor",
    options: Mapping[str, Any] | None = None,
    packed: bool = False,
    loss: Callable[[Any], torch.Tensor] | None = None,
    repeats: int = 5,
    warmup: int = 1,
    path: str | os.PathLike[str] | None = None,
    progress: bool = True,
) -> CostModel:
    """Time the compiled model's per-rank work of every variant on this device; return the cost model.

    For each SP size in ``sp_sizes`` and each policy in ``recompute`` (default: every policy but
    ``block``, whose compute is ``full``'s: :data:`MEASURED_POLICIES`), the model compiled with
    ``backend="dcp"`` runs that variant on a one-process fake world (collectives cost nothing:
    see :mod:`.fake_world`) at each of ``lengths`` (tokens of one sample; ``make_inputs(length)``
    builds its inputs, as for :meth:`dcp.ModelProfile.measure`), forward and backward, timed
    in ``repeats`` rounds over all points after ``warmup`` rounds (median), with the allocator's peak
    on a GPU. Each
    variant's times are fitted as ``fixed + per_token * tokens + per_token_key * length^2``; the
    ``held_out`` lengths (default: midpoints and 1.5x the longest) are measured too but kept out
    of the fit, and their errors are in ``cost_model.measured.held_out``.

    The returned :class:`~dcp_compile.CostModel` plans with the measured compute; communication
    (which one device cannot measure) stays modelled from ``hardware`` (default
    ``Hardware.detect()``), and a variant not measured gets the analytic prior (``prior``, or
    FLOPs counted on the model) scaled to its nearest measured variant: ``cost_model.source(sp,
    policy)`` says which. With ``path``, the result is written there as JSON, and a later call
    with the same path loads it instead of measuring again (delete the file to re-measure).
    ``packed=True``: the model trains on packed rows (``dcp.pack_sequences``); ``make_inputs``
    then takes a *list* of lengths and returns one packed row of those sequences, the packed
    variants are the ones measured, and rows of several sequences (:func:`packed_rows`) let the
    fit price each sequence of a row apart from the row's fixed cost.

    Call it where ``torch.distributed`` is not initialised (one process), then load the file on
    every rank with ``dcp.CostModel.load(path)``: all ranks must plan with the same numbers.
    ``options`` are the backend's, as training compiles with them; ``{"regions": True}`` also
    makes the returned model price regional checkpointing's memory (``CostModel.regions``).
    """
    if path is not None and Path(path).exists():
        loaded = CostModel.load(path)
        log.info("dcp.profile: loaded %s (measured on %s)", path,
                 loaded.measured.device if loaded.measured else "nothing: an analytic model")
        return loaded
    policies = tuple(RecomputePolicy.parse(p) for p in recompute)
    sizes = tuple(sorted(set(int(s) for s in sp_sizes)))
    fit_lengths = tuple(sorted(set(int(n) for n in lengths)))
    if len(fit_lengths) < 3:
        raise ValueError(f"dcp.profile needs 3 or more distinct lengths to fit fixed, per-token and attention "
                         f"terms apart; got {fit_lengths}")
    held_lengths = tuple(default_held_out_lengths(fit_lengths) if held_out is None else sorted(set(held_out)))
    device = _device_of(model)
    if prior is None:  # FLOPs and saved bytes counted on the model: the analytic prior
        one_sample = (lambda n: make_inputs([n])) if packed else make_inputs
        prior = ModelProfile.measure(model, one_sample, lengths=fit_lengths[:3], causal=causal)
    hardware = hardware or Hardware.detect()
    scalar = loss or scalar_loss

    rows = [(length,) for length in (*fit_lengths, *held_lengths)]
    if packed:  # rows of several sequences, so the fit can tell per-sequence from fixed costs
        rows += packed_rows(fit_lengths, held_lengths)
    points = [(Variant(sp, policy), row) for sp in sizes for policy in policies for row in rows]
    from tqdm.auto import tqdm

    with fake_world(max(sizes)):
        compiled = torch.compile(model, backend="dcp", dynamic=True,
                                 options={"inner": inner, "check_ranks": False, **(options or {})})
        steps = [_training_step(compiled, model, make_inputs(list(row)) if packed else make_inputs(row[0]), variant,
                                scalar, list(row) if packed else None)
                 for variant, row in points]
        # Rounds over the whole design rather than repeats of one point in a row: a slow phase of
        # a shared machine then spreads over every point instead of landing on a few.
        timings: list[list[Timing]] = [[] for _ in points]
        rounds = ["warm-up"] * max(1, warmup) + ["timed"] * max(1, repeats)
        # A terminal redraws the bar in place; a log file (not a TTY) would keep every redraw, so
        # there it gets a line every 30 s.
        bar = tqdm(total=len(rounds) * len(points), desc="dcp.profile", unit="point", disable=not progress, leave=False,
                   mininterval=0.1 if sys.stderr.isatty() else 30.0)
        for kind in rounds:
            for index, ((variant, row), step) in enumerate(zip(points, steps)):
                bar.set_postfix_str(f"{kind} {variant} {'+'.join(map(str, row))} tokens", refresh=False)
                timing = time_step(step, device, repeats=1, warmup=0)
                if kind == "timed":
                    timings[index].append(timing)
                bar.update()
        bar.close()
    model.zero_grad(set_to_none=True)

    fitted: list[Measurement] = []
    kept_out: list[Measurement] = []
    held_rows = {(n,) for n in held_lengths} | set(packed_rows((), held_lengths) if packed else ())
    for (variant, row), runs in zip(points, timings):
        seconds = tuple(t.seconds for t in runs)
        peaks = [t.peak_bytes for t in runs if t.peak_bytes is not None]
        point = Measurement(row, variant.sp_size, variant.recompute, statistics.median(seconds), seconds,
                            max(peaks) if peaks else None)
        (kept_out if row in held_rows else fitted).append(point)

    layout = score_layout_on(device) if packed else ScoreLayout.PER_SEQUENCE
    fits = fit_all(fitted, layout)
    notes = [
        f"per-rank work of each variant timed on one device on a fake {max(sizes)}-rank process group: "
        "collectives move no data, so these are compute times; the cost model adds modelled communication",
        f"forward + backward, median of {repeats} timed rounds over all points after {warmup} warm-up round(s), "
        f"inner compiler {inner}",
    ]
    if device.type != "cuda":
        notes.append("memory not measured (the CPU allocator keeps no peak statistics): the analytic memory model is used")
    measured = MeasuredCosts(
        device=device_name(device), software=software_versions(device), fits=fits, measurements=tuple(fitted),
        held_out=held_out_errors(fits, kept_out), memory_measured=device.type == "cuda", notes=tuple(notes),
        score_layout=layout, clock=clock_for(device),
    )
    cost_model = CostModel(prior, hardware, optimizer_shards=optimizer_shards, measured=measured,
                           regions=bool((options or {}).get("regions", REGIONS_BY_DEFAULT)))
    summary = measured.held_out_summary()
    if summary is not None:
        log.info("dcp.profile: %d points fitted, held-out error median %.1f%%, worst %.1f%%",
                 len(fitted), 100 * summary[0], 100 * summary[1])
    if path is not None:
        cost_model.save(path)
    return cost_model


def _training_step(compiled: Any, model: torch.nn.Module, inputs: Any, variant: Variant,
                   scalar: Callable[[Any], torch.Tensor], sequence_lengths: list[int] | None) -> Callable[[], None]:
    def step() -> None:
        with use(variant, sequence_lengths=sequence_lengths):
            value = scalar(call_with_inputs(compiled, inputs))
        value.backward()
        # Keep gradient buffers allocated: the peak then measures activations, not them.
        model.zero_grad(set_to_none=False)

    return step


def scalar_loss(output: Any) -> torch.Tensor:
    """A scalar to run backward from: ``output.loss`` (Hugging Face), a scalar output itself, or
    the mean of the first tensor output."""
    loss = getattr(output, "loss", None)
    if isinstance(loss, torch.Tensor):
        return loss
    if isinstance(output, (tuple, list)) and output:
        return scalar_loss(output[0])
    if isinstance(output, Mapping) and output:
        return scalar_loss(next(iter(output.values())))
    sample = getattr(output, "sample", None)  # diffusers' Transformer2DModelOutput
    if isinstance(sample, torch.Tensor):
        output = sample
    if isinstance(output, torch.Tensor):
        return output if output.numel() == 1 else output.float().mean()
    raise TypeError(f"dcp.profile: cannot find a loss in the model's output ({type(output).__name__}); "
                    "pass loss=lambda output: ... returning a scalar tensor")


def score_layout_on(device: torch.device) -> ScoreLayout:
    """The scores a packed row costs on ``device``: the torch reference kernel (the CPU's) may
    compute a whole row at once; the Triton kernel computes each sequence's own."""
    from dcp_compile.kernels import kernel_backend

    reference = kernel_backend(torch.empty(0, device=device)) == "torch"
    return ScoreLayout.DENSE_RANGES if reference else ScoreLayout.PER_SEQUENCE


def _device_of(model: torch.nn.Module) -> torch.device:
    for parameter in model.parameters():
        return parameter.device
    return torch.device("cpu")
