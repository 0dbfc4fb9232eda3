"""``save_model_report``: what DCP did to a model, as one page a person would rather read.

The first screen answers "is DCP sharding my model, and where does it not": one coloured summary
line per graph and variant (the same line ``dcp.explain`` prints), then a table of the numbers
(attention sites sharded / total, gathers, unsharded ops, collectives, bytes saved for backward,
compile time) and every gather or fallback with the model source line that caused it. Below: the
graph grouped by module (expandable), each op coloured by its role, and each pass's before/after
graph as a side-by-side diff.
"""

from __future__ import annotations

import html
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

from dcp_compile.report.graph_view import (
    ROLE_LABELS,
    ModuleView,
    module_tree,
    node_sources,
    summarise_collectives,
)
from dcp_compile.report.page import legend_and_toolbar, page, role_chip
from dcp_compile.report.pass_diff import changed_lines, pass_diff_html
from dcp_compile.report.source_lines import SourceLine

if TYPE_CHECKING:
    from dcp_compile.compiler.record import GraphRecord, ModelRecord, PassRecord, VariantRecord

# Modules with more ops than this start collapsed even when they hold a gather (a page stays short).
_OPEN_LIMIT = 400
# A top-level module this small starts open, so its layers (``layers.0``, ``layers.1``) are the
# first thing seen; a 40-layer model's ``blocks`` stays collapsed.
_OPEN_TOP_LEVEL = 150


def save_model_report(record: "ModelRecord", path: str | Path, plans: Sequence[Any] | None = None) -> str:
    """Write ``record`` (and optionally ``plans``' timelines) to ``path``; returns the path."""
    Path(path).write_text(model_report_html(record, plans=plans))
    return str(path)


def model_report_html(record: "ModelRecord", plans: Sequence[Any] | None = None) -> str:
    summary = "\n".join(_summary_line(graph, variant) for graph in record.graphs for variant in graph.variants.values())
    body = [
        "<h1>DCP report</h1>",
        f"<p class='muted'>{len(record.graphs)} graph(s) compiled by the dcp backend. "
        "One line per graph and variant: green = every attention sharded and no gather, "
        "amber = sharded with gathers, red = something runs unsharded.</p>",
        f"<div id='summary'>{summary or '<p>nothing compiled</p>'}</div>",
    ]
    if plans:
        from dcp_compile.report.plan_chart import plans_section

        body.append(plans_section(list(plans)))
    body.append(legend_and_toolbar())
    body += [_graph_section(graph) for graph in record.graphs]
    return page("DCP report", "\n".join(body))


def verdict(variant: "VariantRecord") -> str:
    """ok / warn / bad: the colour of a variant's summary line."""
    if variant.sp_size == 1:
        return "warn"
    if variant.fallback_reason is not None or variant.unsharded_sites or not variant.is_sharded:
        return "bad"
    return "warn" if variant.gathers or variant.local_fallbacks else "ok"


def _summary_line(graph: "GraphRecord", variant: "VariantRecord") -> str:
    return (f"<div class='summary {verdict(variant)}'>"
            f"{html.escape(f'graph {graph.graph_id} {variant.summary()}')}</div>")


def _graph_section(graph: "GraphRecord") -> str:
    parts = [f"<section class='graph' id='graph-{graph.graph_id}'><h2>graph {graph.graph_id}</h2>",
             f"<p>sequence length <code>{html.escape(graph.sequence_length or 'none (no attention found)')}</code>; "
             f"{len(graph.attention_sites)} attention site(s); traced and analysed in {graph.trace_seconds:.2f} s</p>"]
    if graph.graph is None:
        parts.append("<p class='muted'>the analysed graph was not kept: no module view</p>")
    sources = node_sources(graph)
    for key, variant in graph.variants.items():
        parts.append(_variant_section(graph, key, variant, sources))
    if graph.analysis_passes:
        parts.append("<h3>analysis passes</h3>" + _passes_html(graph.analysis_passes))
    parts.append("</section>")
    return "\n".join(parts)


def _variant_section(graph: "GraphRecord", key: Any, variant: "VariantRecord", sources: dict[str, SourceLine]) -> str:
    parts = [f"<h3>variant {html.escape(str(key))}</h3>", _summary_line(graph, variant), _stats_table(variant),
             _findings_html(variant, sources)]
    tree = module_tree(graph, variant)
    counts = tree.role_counts()
    chips = " ".join(role_chip(role, f"{ROLE_LABELS.get(role, role)} {count}") for role, count in sorted(counts.items()))
    parts.append(f"<p>ops by role: {chips}</p>")
    parts.append(f"<div class='tree'>{_module_html(tree, top=True)}</div>")
    if variant.passes:
        parts.append("<h4>passes</h4>" + _passes_html(variant.passes))
    return "\n".join(parts)


def _stats_table(variant: "VariantRecord") -> str:
    covered = len(variant.sharded_sites) + len(variant.rank_local_sites) + len(variant.replicated_sites)
    if variant.fallback_reason is not None:
        unsharded = f"whole graph: {variant.fallback_reason}"
    else:
        unsharded = str(len(variant.unsharded_sites) + len(variant.local_fallbacks))
    if variant.compiled_in_regions and variant.saved_activation_bytes is None:
        saved = "not counted (regional compilation: counted at the first call under grad, which has not run)"
    elif variant.saved_at_first_call:
        saved = f"{_bytes(variant.saved_activation_bytes)} per rank, as its first call kept them (regions)"
    elif variant.saved_activation_bytes is None:
        saved = "not measured (inner compiler 'eager' partitions no backward)"
    else:
        saved = f"{_bytes(variant.saved_activation_bytes)} per rank at the traced length"
        if variant.saved_rng_state_bytes:
            saved += f" + {_bytes(variant.saved_rng_state_bytes)} RNG state"
    rows = [
        ("SP size", str(variant.sp_size)),
        ("attention sites sharded", f"{covered} / {variant.attention_sites} "
                                    f"({len(variant.sharded_sites)} all-to-all, {len(variant.rank_local_sites)} rank-local, "
                                    f"{len(variant.replicated_sites)} over another sequence)"),
        ("gathers", str(len(variant.gathers))),
        ("unsharded ops / sites", unsharded),
        ("sharded regions", str(variant.sharded_regions)),
        ("collectives", summarise_collectives(variant.collectives)),
        ("saved for backward", saved),
        ("compile time", f"{variant.compile_seconds:.2f} s"
                         + (f" + {variant.region_compiles} at its first call" if variant.compiled_in_regions else "")
                         + f" ({variant.calls} call(s))"),
    ]
    if variant.regions:
        rows.append(("regions", variant.regions + (f"; uncompiled: {'; '.join(variant.uncompiled_regions)}"
                                                   if variant.uncompiled_regions else "")))
    cells = "".join(f"<tr><th>{html.escape(name)}</th><td>{html.escape(value)}</td></tr>" for name, value in rows)
    return f"<table class='stats'>{cells}</table>"


def _source_link(source: SourceLine | None) -> str:
    if source is None:
        return "<span class='muted'>(no source line kept)</span>"
    return (f"<a class='src' href='{html.escape(source.uri)}' title='{html.escape(source.file)}'>"
            f"{html.escape(source.short)}</a> <code>{html.escape(source.code)}</code>")


def _findings_html(variant: "VariantRecord", sources: dict[str, SourceLine]) -> str:
    """Every place this variant does not run sharded, each with the model line that caused it."""
    items = []
    if variant.fallback_reason is not None:
        items.append(f"<li>{role_chip('gathered', 'whole graph unsharded')} {html.escape(variant.fallback_reason)}</li>")
    for gather in variant.gathers:
        consumer = getattr(gather, "op", "")
        items.append(f"<li>{role_chip('gathered', 'gather')} {html.escape(str(gather))}<br>"
                     f"{_source_link(sources.get(consumer) or sources.get(getattr(gather, 'node', '')))}</li>")
    for fallback in variant.local_fallbacks:
        name = fallback.partition(" (")[0]
        items.append(f"<li>{role_chip('gathered', 'ran on gathered inputs')} {html.escape(fallback)}<br>"
                     f"{_source_link(sources.get(name))}</li>")
    for site, why in variant.unsharded_sites:
        items.append(f"<li>{role_chip('gathered', 'attention unsharded')} {html.escape(site)}: {html.escape(why)}<br>"
                     f"{_source_link(sources.get(site))}</li>")
    for rewrite in variant.rewrites:
        items.append(f"<li>{role_chip('sequence_mixing', 'rewrite')} {html.escape(rewrite)}</li>")
    if not items:
        return "<p>no gathers, no fallbacks.</p>"
    return "<ul class='findings'>" + "".join(items) + "</ul>"


def _module_html(module: ModuleView, top: bool = False, depth: int = 0) -> str:
    ops = "".join(
        f"<span class='op r-{op.role}' title='{html.escape(_op_title(op))}'>{html.escape(op.name)}"
        f" <small>{html.escape(op.op)}</small></span>"
        for op in module.ops)
    children = "".join(_module_html(child, depth=depth + 1) for child in module.children.values())
    inner = (f"<div class='ops'>{ops}</div>" if ops else "") + children
    if top:
        return inner
    counts = module.role_counts()
    gathered = counts.get("gathered", 0)
    badge = f"<span class='badge'>{gathered} gathered</span>" if gathered else ""
    count_text = ", ".join(f"{ROLE_LABELS.get(role, role)} {n}" for role, n in sorted(counts.items()))
    type_name = f" <span class='muted'>({html.escape(module.type_name)})</span>" if module.type_name else ""
    small_top_level = depth == 1 and module.op_count <= _OPEN_TOP_LEVEL and module.children
    opened = " open" if (gathered and module.op_count <= _OPEN_LIMIT) or small_top_level else ""
    return (f"<details class='module'{opened}><summary><b>{html.escape(module.name)}</b>{type_name}"
            f"<span class='count'>{module.op_count} ops: {html.escape(count_text)}</span>{badge}</summary>"
            f"{inner}</details>")


def _op_title(op: Any) -> str:
    text = f"{op.name} = {op.op} | {ROLE_LABELS.get(op.role, op.role)}"
    if op.detail:
        text += f" | {op.detail}"
    if op.source is not None:
        text += f" | {op.source.short}: {op.source.code}"
    return text


def _passes_html(passes: Sequence["PassRecord"]) -> str:
    items = []
    for record in passes:
        changed = changed_lines(record)
        items.append(f"<details class='pass'><summary><code>{html.escape(record.name)}</code> "
                     f"<span class='count'>{record.seconds * 1000:.0f} ms, {changed} line(s) changed</span></summary>"
                     f"{pass_diff_html(record)}</details>")
    return "".join(items)


def _bytes(count: int) -> str:
    for unit, size in (("GiB", 2 ** 30), ("MiB", 2 ** 20), ("KiB", 2 ** 10)):
        if count >= size:
            return f"{count / size:.2f} {unit} ({count:,} bytes)"
    return f"{count:,} bytes"
