"""A step's plan as a picture: ranks down, time across, one bar per micro-batch.

``str(StepPlan)`` is a table of groups; what a user wants to see is the makespan and where ranks
wait. Each rank runs its micro-batches back to back in the plan's execution order (see
``dcp_compile.schedule.plan``: a rank's finish time is the sum of its micro-batch times), so the
bars are laid out by accumulating predicted times per rank. A micro-batch on an SP group spans the
group's rows; bars are coloured by SP size, and hatched and lettered when they recompute. The grey
tail of a row is that rank's idle time before the step's end.
"""

from __future__ import annotations

import html
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

if TYPE_CHECKING:
    from dcp_compile.schedule.plan import MicroBatch, StepPlan

SP_COLOURS = {1: "#7fb3e6", 2: "#8fd18f", 4: "#f2b25c", 8: "#e57f7f", 16: "#b48ee0", 32: "#6cc7c0", 64: "#c9c95a"}
ROW_HEIGHT = 22
LEFT = 64
WIDTH = 960


def sp_colour(sp_size: int) -> str:
    return SP_COLOURS.get(sp_size, "#aaaaaa")


def _policy(mb: "MicroBatch") -> str:
    recompute = mb.recompute
    return getattr(recompute, "value", str(recompute))


def rank_timeline(plan: "StepPlan", rank: int) -> list[tuple[float, "MicroBatch"]]:
    """(start time, micro-batch) for every micro-batch ``rank`` runs, in execution order."""
    start, timeline = 0.0, []
    for mb in plan.rank_microbatches(rank):
        timeline.append((start, mb))
        start += mb.predicted_time
    return timeline


def plan_svg(plan: "StepPlan") -> str:
    """An SVG Gantt chart of ``plan`` (every rank, not only ``plan.rank``)."""
    world = max(plan.world_size, 1)
    loads = plan.predicted_rank_times()
    makespan = max([plan.predicted_makespan, *loads, 1e-12])
    scale = (WIDTH - LEFT - 16) / makespan
    height = 28 + world * ROW_HEIGHT + 34
    parts = [f"<svg xmlns='http://www.w3.org/2000/svg' width='{WIDTH}' height='{height}' role='img' "
             f"aria-label='step {plan.step} plan'>",
             "<defs><pattern id='recompute-hatch' width='6' height='6' patternUnits='userSpaceOnUse' "
             "patternTransform='rotate(45)'><line x1='0' y1='0' x2='0' y2='6' stroke='rgba(0,0,0,.35)' "
             "stroke-width='2'/></pattern></defs>"]
    top = 24
    for rank in range(world):
        y = top + rank * ROW_HEIGHT
        parts.append(f"<text x='{LEFT - 8}' y='{y + 15}' font-size='12' text-anchor='end'>rank {rank}</text>")
        parts.append(f"<rect x='{LEFT}' y='{y}' width='{makespan * scale:.1f}' height='{ROW_HEIGHT - 4}' fill='#f1f1f1'/>")
        if loads[rank] < makespan:
            idle_x = LEFT + loads[rank] * scale
            parts.append(f"<rect class='idle' x='{idle_x:.1f}' y='{y}' width='{(makespan - loads[rank]) * scale:.1f}' "
                         f"height='{ROW_HEIGHT - 4}' fill='#d0d0d0'><title>rank {rank} idle "
                         f"{_ms(makespan - loads[rank])}</title></rect>")
    for group in plan.groups:
        first = group.ranks[0]
        for start, mb in rank_timeline(plan, first):
            if mb.group_ranks != group.ranks:
                continue
            x, w = LEFT + start * scale, max(mb.predicted_time * scale, 1.0)
            y = top + first * ROW_HEIGHT
            h = len(group.ranks) * ROW_HEIGHT - 4
            policy = _policy(mb)
            tip = (f"SP {mb.sp_size} on ranks {group.ranks[0]}-{group.ranks[-1]} | {len(mb.indices)} samples, "
                   f"{mb.tokens:,} tokens | recompute {policy} | {_ms(mb.predicted_time)}")
            parts.append(f"<g class='mb sp{mb.sp_size}'><title>{html.escape(tip)}</title>"
                         f"<rect x='{x:.1f}' y='{y}' width='{w:.1f}' height='{h}' fill='{sp_colour(mb.sp_size)}' "
                         f"stroke='white' stroke-width='1'/>")
            if policy != "none":
                parts.append(f"<rect class='recompute' x='{x:.1f}' y='{y}' width='{w:.1f}' height='{h}' "
                             f"fill='url(#recompute-hatch)'/>")
                if w > 14:
                    parts.append(f"<text x='{x + w / 2:.1f}' y='{y + h / 2 + 4:.1f}' font-size='11' "
                                 f"text-anchor='middle'>{html.escape(policy[0].upper())}</text>")
            parts.append("</g>")
    end_x = LEFT + makespan * scale
    bottom = top + world * ROW_HEIGHT
    parts.append(f"<line x1='{end_x:.1f}' y1='{top - 6}' x2='{end_x:.1f}' y2='{bottom}' stroke='#333' "
                 f"stroke-dasharray='4 3'/>")
    parts.append(f"<text x='{end_x:.1f}' y='{top - 10}' font-size='11' text-anchor='end'>makespan "
                 f"{_ms(makespan)}</text>")
    if plan.lower_bound > 0:
        bound_x = LEFT + plan.lower_bound * scale
        parts.append(f"<line x1='{bound_x:.1f}' y1='{top - 4}' x2='{bound_x:.1f}' y2='{bottom}' stroke='#2e9e44' "
                     f"stroke-dasharray='2 3'><title>lower bound {_ms(plan.lower_bound)}</title></line>")
    legend_x = LEFT
    for size in sorted({group.sp_size for group in plan.groups}):
        parts.append(f"<rect x='{legend_x}' y='{bottom + 12}' width='14' height='12' fill='{sp_colour(size)}'/>"
                     f"<text x='{legend_x + 18}' y='{bottom + 22}' font-size='11'>SP {size}</text>")
        legend_x += 64
    parts.append(f"<rect x='{legend_x}' y='{bottom + 12}' width='14' height='12' fill='url(#recompute-hatch)' "
                 f"stroke='#999'/><text x='{legend_x + 18}' y='{bottom + 22}' font-size='11'>recompute "
                 f"(A attention, S selective, F full, B block)</text>")
    legend_x += 340
    parts.append(f"<rect x='{legend_x}' y='{bottom + 12}' width='14' height='12' fill='#d0d0d0'/>"
                 f"<text x='{legend_x + 18}' y='{bottom + 22}' font-size='11'>idle</text>")
    parts.append("</svg>")
    return "".join(parts)


def plan_caption(plan: "StepPlan") -> str:
    """One line: step, makespan, idle share (the number the chart's grey tails add up to)."""
    loads = plan.predicted_rank_times()
    makespan = max([plan.predicted_makespan, *loads])
    idle = sum(makespan - load for load in loads) / (makespan * len(loads)) if makespan > 0 and loads else 0.0
    samples = sum(group.num_samples for group in plan.groups)
    bound = f", lower bound {_ms(plan.lower_bound)}" if plan.lower_bound > 0 else ""
    return (f"step {plan.step} (epoch {plan.epoch}, {plan.scheduler}): {plan.world_size} ranks, {samples} samples, "
            f"{plan.tokens:,} tokens | makespan {_ms(makespan)}{bound} | idle {100 * idle:.1f}% of rank time")


def plans_section(plans: Sequence["StepPlan"]) -> str:
    items = [f"<h3>{html.escape(plan_caption(plan))}</h3>\n{plan_svg(plan)}" for plan in plans]
    return "<section class='plans'><h2>Planner: steps as timelines</h2>" + "\n".join(items) + "</section>"


def plan_html(plans: Sequence["StepPlan"], path: str | Path) -> str:
    """Write the plans' timelines as one self-contained HTML page; returns the path."""
    from dcp_compile.report.page import page

    plans = list(plans)
    if not plans:
        raise ValueError("plan_html needs at least one StepPlan")
    Path(path).write_text(page("DCP plan", "<h1>DCP plan</h1>" + plans_section(plans)))
    return str(path)


def _ms(seconds: float) -> str:
    return f"{seconds:.3f} s" if seconds >= 1 else f"{seconds * 1000:.1f} ms"
