"""``dcp.report.sharding_summary(record)``: the line a training script prints once after warm-up.

Why: a run that trains and converges says nothing about whether DCP sharded anything (an
unsharded graph is exact too), how much it gathered, or why the model became several graphs.
This answers those three in a few lines from the records (``dcp.report.recording()`` around a step, or
``dcp.explain``), without running anything.
"""

from __future__ import annotations

import collections

from dcp_compile.compiler.record import ModelRecord


def graph_break_reasons(limit: int = 3) -> list[str]:
    """Dynamo's graph-break reasons in this process, most frequent first (``reason xN``)."""
    try:
        from torch._dynamo.utils import counters
    except ImportError:  # pragma: no cover - torch without dynamo
        return []
    reasons = collections.Counter({str(reason).splitlines()[0][:140]: count
                                   for reason, count in counters["graph_break"].items()})
    return [f"{reason} x{count}" for reason, count in reasons.most_common(limit)]


def sharding_summary(record: ModelRecord) -> str:
    """Graphs (and why several), attention sites sharded in the SP>1 variants, gathers with reasons."""
    graphs = list(record.graphs)
    with_attention = [graph for graph in graphs if graph.attention_sites]
    variants = [v for graph in graphs for v in graph.variants.values() if v.sp_size > 1 and v.attention_sites]
    lines = [f"dcp: {len(graphs)} graph(s) ran, {len(with_attention)} with attention"]
    breaks = graph_break_reasons()
    if len(graphs) > 1:
        specialised = sum(1 for graph in graphs if graph.specialization)
        why = []
        if breaks:
            why.append("dynamo graph breaks: " + "; ".join(breaks))
        if specialised:
            why.append(f"{specialised} compiled for integer inputs of 0 or 1")
        why += [f"graph {graph.graph_id} is {graph.new_graph_reason.split(': ')[0]} (dcp.explain says why)"
                for graph in graphs if graph.new_graph_reason]
        why.append("each FSDP2-wrapped module (its hooks) and each graph break starts a new graph; "
                   "a graph that repeats (one per layer) is compiled once")
        lines.append("  why several graphs: " + " | ".join(why))
    if not variants:
        lines.append("  no SP>1 variant with attention has run yet (every micro-batch so far ran at SP 1)")
        return "\n".join(lines + packed_attention_lines(graphs))
    total = sum(v.attention_sites for v in variants)
    covered = sum(len(v.sharded_sites) + len(v.rank_local_sites) + len(v.replicated_sites) for v in variants)
    all_to_all = sum(len(v.sharded_sites) for v in variants)
    gathers = collections.Counter()
    for variant in variants:
        gathers.update(variant.gather_reasons())
    sizes = sorted({v.sp_size for v in variants})
    line = (f"  SP {', '.join(map(str, sizes))}: attention sites sharded {covered}/{total} "
            f"({all_to_all} under the all-to-all) over {len(variants)} graph variant(s) | gathers {sum(gathers.values())}")
    if gathers:
        line += " [" + "; ".join(f"{reason} x{count}" for reason, count in gathers.most_common()) + "]"
    lines.append(line)
    lines.append("  " + collectives_line(variants))
    for variant in variants:
        if not variant.is_sharded:
            lines.append(f"  NOT SHARDED: {variant.summary()}")
    lines += packed_attention_lines(graphs)
    return "\n".join(lines)


def packed_attention_lines(graphs: list) -> list[str]:
    """Which attention implementation packed micro-batches ran (chosen per call by the measured table)."""
    packed = collections.Counter(v.packed_attention for graph in graphs for v in graph.variants.values()
                                 if getattr(v, "packed_attention", None))
    return [f"  packed attention: {how} ({count} variant(s))" for how, count in packed.most_common()]


def collectives_line(variants: list) -> str:
    """The collectives the SP>1 variants inserted, and what each kind is for: a count alone (9
    all-to-alls for 2 attention sites) reads like a bug."""
    counts: collections.Counter = collections.Counter()
    for variant in variants:
        counts.update(variant.collectives)
    output_gathers = sum(getattr(v, "output_gathers", 0) for v in variants)
    rings = sum(1 for v in variants for _, layout, _ in getattr(v, "attention_layouts", ()) if layout.startswith("ring"))
    meaning = {
        "all_to_all_single": "Ulysses around attention (4 per self-attention, 2 per cross-attention site)"
                             + (f", {rings} site(s) as ring attention (4 if heads are split, plus ring size - 1)"
                                if rings else "")
                             + (f", {output_gathers} returning a sharded output in full" if output_gathers else ""),
        "all_gather_into_tensor": "gathers before sequence-mixing ops, and replicated text over heads",
        "all_reduce": "sums of shard-local reductions (the loss)",
    }
    parts = [f"{name} x{count}" + (f" ({meaning[name]})" if name in meaning else "")
             for name, count in sorted(counts.items())]
    return "collectives in these variants' graphs: " + ("; ".join(parts) if parts else "none")
