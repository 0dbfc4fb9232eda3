"""Measured compute per variant: what ``dcp.profile`` timed on the device, fitted, and how well.

The analytic model (:mod:`.analytic`) counts FLOPs and bytes and guesses how fast a device runs
them; this module holds what a device *did*. ``dcp.profile`` runs the compiled model's per-rank
work of each variant ``(sp_size, recompute)`` at several lengths (on a fake process group, so
collectives cost nothing and the time is the rank's compute at the shapes the variant runs: its
chunk of the tokens in token-local ops, all positions of its heads in attention) and records one
:class:`Measurement` per point. :func:`fit_variant` fits the separable form the planner uses::

    seconds(tokens, token_keys) = fixed + per_token * tokens + per_token_key * token_keys

by non-negative least squares on relative errors (a 1 ms and a 1 s point count alike), per
variant. Communication is not in these numbers: :class:`~.cost_model.CostModel` adds its modelled
all-to-all time on top and says so. Points held out of the fit (other lengths, beyond the fitted
range too) measure how far the fit can be trusted: :attr:`MeasuredCosts.held_out`.
"""

from __future__ import annotations

import enum

import statistics
from dataclasses import asdict, dataclass, field
from typing import Any, Iterable, Mapping, Sequence

import numpy as np

from dcp_compile.variant import RecomputePolicy, checkpoints_whole_blocks

from .analytic import MemoryCoefficients, ScoreLayout, token_sums


@dataclass(frozen=True)
class Measurement:
    """One timed micro-batch: the per-rank work of ``sp_size`` / ``recompute`` on ``lengths``.

    ``seconds`` is the median of the repeats (forward + backward, device synchronised);
    ``peak_bytes`` the allocator's peak above what was allocated before the call (``None`` where
    the device has no allocator statistics: the CPU)."""

    lengths: tuple[int, ...]
    sp_size: int
    recompute: RecomputePolicy
    seconds: float
    repeats: tuple[float, ...] = ()
    peak_bytes: float | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "recompute", RecomputePolicy.parse(self.recompute))
        object.__setattr__(self, "lengths", tuple(int(n) for n in self.lengths))

    @property
    def tokens(self) -> int:
        return sum(self.lengths)

    def token_keys(self, layout: ScoreLayout = ScoreLayout.PER_SEQUENCE) -> float:
        return token_sums(self.lengths, None, layout)[1]

    @property
    def spread(self) -> float:
        """(max - min) / median of the repeats: how noisy this point was."""
        if len(self.repeats) < 2 or self.seconds <= 0:
            return 0.0
        return (max(self.repeats) - min(self.repeats)) / self.seconds


class Clock(str, enum.Enum):
    """What a measured second is.

    On a single-threaded CPU rank the process's CPU time is the device's time: on a shared machine
    the wall clock also counts the time the OS gave to other processes, which moved the demo's
    ratios by more than the schedules differ (0.92x at load 30, 1.16x at load 5); the process's
    CPU time of the same work moved by about 5%. With several threads per process, CPU time sums
    the threads, so the wall clock is kept."""

    DEVICE_WALL = "wall time (device synchronised)"
    PROCESS_CPU = "process CPU time (user + system, one thread)"


@dataclass(frozen=True)
class VariantFit:
    """Fitted compute time (and, where measured, activation memory) of one variant."""

    sp_size: int
    recompute: RecomputePolicy
    fixed: float
    per_token: float
    per_token_key: float
    max_tokens: int  # the longest micro-batch the fit saw: beyond it the fit extrapolates
    per_sequence: float | None = None  # measured where micro-batches of several sequences were timed
    activation_fixed_bytes: float | None = None
    activation_bytes_per_token: float | None = None
    score_layout: ScoreLayout = ScoreLayout.PER_SEQUENCE  # what the token-keys counted when fitted

    def __post_init__(self) -> None:
        object.__setattr__(self, "recompute", RecomputePolicy.parse(self.recompute))
        object.__setattr__(self, "score_layout", ScoreLayout(self.score_layout))

    def seconds(self, lengths: Sequence[int]) -> float:
        tokens, token_keys = token_sums(lengths, None, self.score_layout)
        return (self.fixed + self.per_token * tokens + self.per_token_key * token_keys
                + (self.per_sequence or 0.0) * len(lengths))

    def memory_coefficients(self) -> MemoryCoefficients | None:
        if self.activation_bytes_per_token is None:
            return None
        return MemoryCoefficients(self.activation_fixed_bytes or 0.0, self.activation_bytes_per_token)


@dataclass(frozen=True)
class HeldOut:
    """A measured point the fit did not see, and what the fit predicts for it."""

    measurement: Measurement
    predicted: float

    @property
    def relative_error(self) -> float:
        return self.predicted / self.measurement.seconds - 1


@dataclass(frozen=True)
class MeasuredCosts:
    """Everything ``dcp.profile`` measured on one device, and the fits made of it."""

    device: str
    software: dict[str, str]
    fits: tuple[VariantFit, ...]
    measurements: tuple[Measurement, ...]
    held_out: tuple[HeldOut, ...] = ()
    memory_measured: bool = False
    notes: tuple[str, ...] = field(default_factory=tuple)
    score_layout: ScoreLayout = ScoreLayout.PER_SEQUENCE  # the attention kernel's, on this device
    clock: Clock = Clock.DEVICE_WALL  # what a second of these measurements is

    def __post_init__(self) -> None:
        object.__setattr__(self, "score_layout", ScoreLayout(self.score_layout))
        object.__setattr__(self, "clock", Clock(self.clock))

    def fit_for(self, sp_size: int, recompute: RecomputePolicy | str) -> VariantFit | None:
        recompute = RecomputePolicy.parse(recompute)
        for fit in self.fits:
            if fit.sp_size == sp_size and fit.recompute == recompute:
                return fit
        return None

    def compute_fit_for(self, sp_size: int, recompute: RecomputePolicy | str) -> VariantFit | None:
        """The fit whose compute time this variant has: its own, or for ``block`` ``full``'s at the
        same SP size (the same per-rank compute: the all-to-alls ``block`` sends again are
        communication, which is modelled, and they cost nothing on the profile's fake world).
        Its memory is not ``full``'s: only :meth:`fit_for` gives measured memory."""
        fit = self.fit_for(sp_size, recompute)
        if fit is None and RecomputePolicy.parse(recompute) in (RecomputePolicy.BLOCK, RecomputePolicy.OFFLOAD):
            fit = self.fit_for(sp_size, RecomputePolicy.FULL)  # offload: its host copies are communication too
        return fit

    def nearest_fit(self, sp_size: int, recompute: RecomputePolicy | str) -> VariantFit | None:
        """The measured variant closest to an unmeasured one: the same policy (``block``: else
        ``full``, whose per-rank compute it repeats; only its communication differs), the largest
        SP size not above it (else the smallest above it); used to scale the analytic prior."""
        recompute = RecomputePolicy.parse(recompute)
        same = [f for f in self.fits if f.recompute == recompute]
        if not same and checkpoints_whole_blocks(recompute):  # block, offload, lean: full's per-rank work and more
            same = [f for f in self.fits if f.recompute == RecomputePolicy.FULL]
        same = same or list(self.fits)
        if not same:
            return None
        below = [f for f in same if f.sp_size <= sp_size]
        if below:
            return max(below, key=lambda f: f.sp_size)
        return min(same, key=lambda f: f.sp_size)

    def held_out_summary(self) -> tuple[float, float] | None:
        """(median, worst) absolute relative error of the held-out points, or None."""
        if not self.held_out:
            return None
        errors = [abs(h.relative_error) for h in self.held_out]
        return statistics.median(errors), max(errors)

    # ------------------------------------------------------------------ io
    def to_dict(self) -> dict[str, Any]:
        return {
            "device": self.device,
            "software": dict(self.software),
            "memory_measured": self.memory_measured,
            "notes": list(self.notes),
            "score_layout": self.score_layout.value,
            "clock": self.clock.value,
            "fits": [_plain(asdict(f)) for f in self.fits],
            "measurements": [_plain(asdict(m)) for m in self.measurements],
            "held_out": [{"measurement": _plain(asdict(h.measurement)), "predicted": h.predicted} for h in self.held_out],
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "MeasuredCosts":
        def measurement(d: Mapping[str, Any]) -> Measurement:
            return Measurement(**{**d, "lengths": tuple(d["lengths"]), "repeats": tuple(d.get("repeats", ()))})

        return cls(
            device=data["device"],
            software=dict(data.get("software", {})),
            fits=tuple(VariantFit(**f) for f in data["fits"]),
            measurements=tuple(measurement(m) for m in data["measurements"]),
            held_out=tuple(HeldOut(measurement(h["measurement"]), float(h["predicted"])) for h in data.get("held_out", ())),
            memory_measured=bool(data.get("memory_measured", False)),
            notes=tuple(data.get("notes", ())),
            score_layout=ScoreLayout(data.get("score_layout", ScoreLayout.PER_SEQUENCE.value)),
            clock=Clock(data.get("clock", Clock.DEVICE_WALL.value)),  # files from before the field: wall time
        )


def _plain(data: dict[str, Any]) -> dict[str, Any]:
    return {k: (v.value if isinstance(v, (RecomputePolicy, ScoreLayout)) else list(v) if isinstance(v, tuple) else v) for k, v in data.items()}


def fit_variant(points: Sequence[Measurement], layout: ScoreLayout = ScoreLayout.PER_SEQUENCE,
                base: VariantFit | None = None) -> VariantFit:
    """Fit ``fixed + per_token * tokens + per_token_key * token_keys`` to one variant's points.

    Non-negative least squares on relative errors (each row divided by its measured seconds);
    columns scaled to unit norm first, since tokens and token-keys differ by orders of magnitude.
    Needs three or more distinct lengths to tell the three terms apart; with fewer, the quadratic
    term is dropped (a straight line through what there is). Where some points pack several
    sequences (``packed`` profiles), a fourth term, ``per_sequence * sequences``, is fitted too;
    rows of few long and of many short sequences (:func:`~dcp_compile.device_profile.runner.packed_rows`)
    tell it apart from the per-token and the fixed terms.

    ``base``: the same SP size without recompute. Recomputing runs part of the forward again and
    removes no work, so a recompute policy is fitted as ``base`` plus non-negative extra terms: on a
    noisy machine a free fit can otherwise price recompute below no recompute and steer plans into it."""
    if not points:
        raise ValueError("fit_variant needs at least one measurement")
    first = points[0]
    if any(p.sp_size != first.sp_size or p.recompute != first.recompute for p in points):
        raise ValueError("fit_variant fits one variant at a time: the points mix SP sizes or policies")
    distinct = len({p.lengths for p in points})
    columns = [0, 1, 2] if distinct >= 3 else [0, 1]
    if len({len(p.lengths) for p in points}) > 1:
        columns.append(3)
    rows = [[1.0, p.tokens, p.token_keys(layout), len(p.lengths)] for p in points]
    matrix = np.asarray(rows)[:, columns] / np.asarray([[p.seconds] for p in points])
    start = [0.0, 0.0, 0.0, 0.0]
    if base is not None:
        start = [base.fixed, base.per_token, base.per_token_key, base.per_sequence or 0.0]
    # Relative residual of base + extra: (base(x) + extra . x) / y - 1, solved for extra >= 0.
    targets = np.asarray([1.0 - sum(start[c] * row[c] for c in columns) / p.seconds for row, p in zip(rows, points)])
    extra = dict(zip(columns, _non_negative_least_squares(matrix, targets)))
    coefficient = {c: start[c] + float(extra.get(c, 0.0)) for c in range(4)}
    fixed, per_token = coefficient[0], coefficient[1]
    per_token_key = coefficient[2] if 2 in columns else 0.0
    per_sequence = coefficient[3] if 3 in columns else None
    memory = [p for p in points if p.peak_bytes is not None]
    activation_fixed = activation_per_token = None
    if len(memory) >= 2 and len({p.tokens for p in memory}) >= 2:
        slope, intercept = np.polyfit([p.tokens for p in memory], [p.peak_bytes for p in memory], deg=1)
        activation_per_token = max(float(slope), 0.0)
        activation_fixed = max(float(intercept), 0.0)
    return VariantFit(
        sp_size=first.sp_size, recompute=first.recompute, fixed=fixed, per_token=per_token,
        per_token_key=per_token_key, max_tokens=max(p.tokens for p in points), per_sequence=per_sequence,
        activation_fixed_bytes=activation_fixed, activation_bytes_per_token=activation_per_token,
        score_layout=layout,
    )


def _non_negative_least_squares(matrix: np.ndarray, targets: np.ndarray) -> np.ndarray:
    from scipy.optimize import lsq_linear

    norms = np.linalg.norm(matrix, axis=0)
    norms[norms == 0] = 1.0
    result = lsq_linear(matrix / norms, targets, bounds=(0.0, np.inf), method="bvls", tol=1e-14)
    return np.maximum(result.x, 0.0) / norms


def fit_all(points: Iterable[Measurement], layout: ScoreLayout = ScoreLayout.PER_SEQUENCE) -> tuple[VariantFit, ...]:
    """One :class:`VariantFit` per variant present in ``points``, ordered by (SP size, policy)."""
    by_variant: dict[tuple[int, RecomputePolicy], list[Measurement]] = {}
    for point in points:
        by_variant.setdefault((point.sp_size, point.recompute), []).append(point)
    order = {policy: i for i, policy in enumerate(RecomputePolicy)}
    fits: list[VariantFit] = []
    for key in sorted(by_variant, key=lambda k: (k[0], order[k[1]])):  # NONE first in each SP size
        base = next((f for f in fits if f.sp_size == key[0] and f.recompute == RecomputePolicy.NONE), None)
        fits.append(fit_variant(by_variant[key], layout, base if key[1] != RecomputePolicy.NONE else None))
    return tuple(fits)


def held_out_errors(fits: Sequence[VariantFit], points: Iterable[Measurement]) -> tuple[HeldOut, ...]:
    """Each held-out point with its fitted prediction (points of unfitted variants are skipped)."""
    table = {(f.sp_size, f.recompute): f for f in fits}
    rows = []
    for point in points:
        fit = table.get((point.sp_size, point.recompute))
        if fit is not None:
            rows.append(HeldOut(point, fit.seconds(point.lengths)))
    return tuple(rows)


def slowest_of(profiles: Sequence[MeasuredCosts]) -> MeasuredCosts:
    """Several processes' profiles of one design as one: each point at its slowest process's
    time (a step waits for its slowest rank), fits and held-out errors redone. Every rank that
    merges the same profiles gets the same model, so all plan alike."""
    if not profiles:
        raise ValueError("slowest_of needs at least one profile")

    def merged(groups: Iterable[Sequence[Measurement]]) -> list[Measurement]:
        slowest: dict[tuple, Measurement] = {}
        for points in groups:
            for point in points:
                key = (point.sp_size, point.recompute, point.lengths)
                if key not in slowest or point.seconds > slowest[key].seconds:
                    slowest[key] = point
        return list(slowest.values())

    fitted = merged(p.measurements for p in profiles)
    kept_out = merged([h.measurement for h in p.held_out] for p in profiles)
    first = profiles[0]
    fits = fit_all(fitted, first.score_layout)
    notes = (*first.notes, f"each point the slowest of {len(profiles)} processes measuring at once")
    return MeasuredCosts(device=first.device, software=first.software, fits=fits, measurements=tuple(fitted),
                         held_out=held_out_errors(fits, kept_out), memory_measured=first.memory_measured, notes=notes,
                         score_layout=first.score_layout, clock=first.clock)


def markdown_report(costs: MeasuredCosts, title: str = "Profiled cost model") -> str:
    """The fits and held-out errors as a Markdown page (what ``benchmarks/results/profile_<device>.md`` holds)."""
    lines = [f"# {title}: {costs.device}", ""]
    lines.append("Measured: " + ", ".join(f"{k} {v}" for k, v in sorted(costs.software.items()))
                 + f"; every second is {costs.clock.value}.")
    lines += ["", *[f"- {note}" for note in costs.notes], ""]
    summary = costs.held_out_summary()
    if summary:
        lines.append(
            f"**Held-out prediction error** (points not in the fit, {len(costs.held_out)} of them): "
            f"median {100 * summary[0]:.1f}%, worst {100 * summary[1]:.1f}%.")
        lines.append("")
    lines += ["## Fits (per-rank compute: seconds = fixed + per_token * tokens + per_token_key * sum(length^2))", "",
              "| SP | recompute | fixed ms | per token us | per token-key ns | per sequence ms | fitted up to (tokens) | activation bytes/token |",
              "|---:|---|---:|---:|---:|---:|---:|---:|"]
    for fit in costs.fits:
        memory = "-" if fit.activation_bytes_per_token is None else f"{fit.activation_bytes_per_token:,.0f}"
        per_sequence = "-" if fit.per_sequence is None else f"{1e3 * fit.per_sequence:.3f}"
        lines.append(f"| {fit.sp_size} | {fit.recompute.value} | {1e3 * fit.fixed:.3f} | {1e6 * fit.per_token:.3f} | "
                     f"{1e9 * fit.per_token_key:.4f} | {per_sequence} | {fit.max_tokens:,} | {memory} |")
    if costs.held_out:
        lines += ["", "## Held-out points", "",
                  "| SP | recompute | lengths | measured ms | predicted ms | error | repeat spread |",
                  "|---:|---|---|---:|---:|---:|---:|"]
        for row in costs.held_out:
            m = row.measurement
            lengths = ",".join(str(n) for n in m.lengths) if len(m.lengths) <= 4 else f"{len(m.lengths)} x {m.lengths[0]}.."
            lines.append(f"| {m.sp_size} | {m.recompute.value} | {lengths} | {1e3 * m.seconds:.2f} | "
                         f"{1e3 * row.predicted:.2f} | {100 * row.relative_error:+.1f}% | {100 * m.spread:.0f}% |")
    lines += ["", "## Fitted points", "", "| SP | recompute | lengths | measured ms | fit ms | repeat spread |",
              "|---:|---|---|---:|---:|---:|"]
    table = {(f.sp_size, f.recompute): f for f in costs.fits}
    for m in costs.measurements:
        fit = table.get((m.sp_size, m.recompute))
        predicted = "-" if fit is None else f"{1e3 * fit.seconds(m.lengths):.2f}"
        lengths = ",".join(str(n) for n in m.lengths) if len(m.lengths) <= 4 else f"{len(m.lengths)} x {m.lengths[0]}"
        lines.append(f"| {m.sp_size} | {m.recompute.value} | {lengths} | {1e3 * m.seconds:.2f} | {predicted} | "
                     f"{100 * m.spread:.0f}% |")
    return "\n".join(lines) + "\n"


__all__ = [
    "HeldOut", "MeasuredCosts", "Measurement", "VariantFit", "fit_all", "fit_variant", "held_out_errors",
    "markdown_report", "slowest_of",
]
