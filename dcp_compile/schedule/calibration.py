"""Fit the cost model's scale factors to measured micro-batch times.

The analytic terms are peak-rate seconds; five scale factors (inverse efficiencies: linear
matmuls, attention, memory-bound ops, communication, per-layer overhead) turn them into wall
time. :func:`calibrate` measures a small design of micro-batches (:func:`calibration_points`) and
fits the factors by non-negative least squares on relative errors.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Callable, Iterable, Sequence

import numpy as np

from dcp_compile.variant import RECOMPUTE_POLICIES, RecomputePolicy

from .analytic import COST_TERMS, context_seconds_per_sequence, token_sums

if TYPE_CHECKING:
    from .cost_model import CostModel

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CalibrationPoint:
    """One profiled configuration: a micro-batch of ``lengths`` on ``sp_size`` ranks."""

    lengths: tuple[int, ...]
    sp_size: int
    recompute: RecomputePolicy = RecomputePolicy.NONE

    def __post_init__(self) -> None:
        object.__setattr__(self, "recompute", RecomputePolicy.parse(self.recompute))


@dataclass(frozen=True)
class CalibrationReport:
    """What :func:`calibrate` fitted and how well (relative errors per point)."""

    scales: dict[str, float]
    relative_errors: tuple[float, ...]
    fixed_terms: tuple[str, ...]

    @property
    def max_relative_error(self) -> float:
        return max((abs(e) for e in self.relative_errors), default=0.0)


def calibrate(
    model: "CostModel",
    measure_fn: Callable[[Sequence[int], int, str], float],
    points: Iterable[CalibrationPoint | tuple],
    progress: bool = True,
) -> "CostModel":
    """Fit ``model``'s per-term scale factors to measured times; return the calibrated model.

    ``measure_fn(lengths, sp_size, recompute)`` runs (or simulates) one micro-batch and returns
    its seconds. Each point gives one row: the analytic seconds of every term divided by the
    measured seconds, with target 1, so a 10 ms and a 10 s point count alike. The scales are the
    non-negative least-squares solution (a negative efficiency means nothing). A term that no
    point exercises (communication when every point has ``sp_size == 1``) keeps its previous
    scale and is listed in ``report.fixed_terms``.
    """
    from tqdm.auto import tqdm

    points = [p if isinstance(p, CalibrationPoint) else CalibrationPoint(tuple(p[0]), int(p[1]), *p[2:]) for p in points]
    if not points:
        raise ValueError("calibrate needs at least one point; see CostModel.calibration_points()")
    rows: list[list[float]] = []
    for point in tqdm(points, desc="calibrating cost model", disable=not progress, leave=False):
        measured = float(measure_fn(list(point.lengths), point.sp_size, point.recompute.value))
        if not measured > 0:
            raise ValueError(f"measure_fn returned {measured!r} for {point}; it must return positive seconds")
        tokens, token_keys = token_sums(point.lengths, None)
        raw = model.raw_term_coefficients(point.sp_size, point.recompute)
        context = context_seconds_per_sequence(model.profile, model.hardware, point.recompute) * len(point.lengths)
        rows.append([
            (raw[t][0] + raw[t][1] * tokens + raw[t][2] * token_keys + (context if t == "linear" else 0.0)) / measured
            for t in COST_TERMS
        ])
    matrix = np.asarray(rows)
    active = np.flatnonzero((matrix > 0).any(axis=0))
    fixed = np.setdiff1d(np.arange(len(COST_TERMS)), active)
    previous = np.asarray([model.scales[t] for t in COST_TERMS])
    # Terms not exercised keep their scale: move their contribution to the target side.
    targets = 1.0 - matrix[:, fixed] @ previous[fixed]
    solution = previous.copy()
    solution[active] = non_negative_least_squares(matrix[:, active], targets)
    scales = {term: float(value) for term, value in zip(COST_TERMS, solution)}
    errors = tuple(float(e) for e in matrix @ solution - 1.0)
    report = CalibrationReport(scales=scales, relative_errors=errors, fixed_terms=tuple(COST_TERMS[i] for i in fixed))
    log.info("calibrated cost model %s: max relative error %.1f%%", scales, 100 * report.max_relative_error)
    return replace(model, scales=scales, calibration=report)


def non_negative_least_squares(matrix: np.ndarray, targets: np.ndarray) -> np.ndarray:
    """``argmin |A x - b|`` over ``x >= 0``, by SciPy's bounded-variable least squares (BVLS).

    The columns are scaled to unit norm first (the terms' seconds differ by orders of magnitude).
    BVLS rather than ``scipy.optimize.nnls``: its active-set solution is exact here and has been
    stable across SciPy releases, where ``nnls`` was reimplemented in 1.12 and since reported
    inaccurate on small, badly scaled problems like this one.
    """
    from scipy.optimize import lsq_linear

    norms = np.linalg.norm(matrix, axis=0)
    norms[norms == 0] = 1.0
    result = lsq_linear(matrix / norms, targets, bounds=(0.0, np.inf), method="bvls", tol=1e-14)
    return np.maximum(result.x, 0.0) / norms


def calibration_points(
    max_length: int,
    sp_sizes: Sequence[int] = (1, 2, 4),
    recompute: Sequence[RecomputePolicy | str] = RECOMPUTE_POLICIES,
    min_length: int = 128,
) -> list[CalibrationPoint]:
    """A small design that separates the terms: one and several sequences (overhead vs. linear),
    short and long (linear vs. attention), every policy, and SP > 1 (communication)."""
    lengths: list[int] = []
    length = max(1, min_length)
    while length <= max_length:
        lengths.append(length)
        length *= 4
    if not lengths or lengths[-1] != max_length:
        lengths.append(max_length)
    points = []
    for sp in sp_sizes:
        for policy in recompute:
            for length in lengths:
                points.append(CalibrationPoint((length,), sp, policy))
            points.append(CalibrationPoint((lengths[0],) * 4, sp, policy))
    return points
