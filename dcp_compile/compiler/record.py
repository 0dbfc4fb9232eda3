"""What the backend did, kept per compiled graph: the answer to "why is my model slow/wrong?".

``dcp.explain(model, ...)`` returns these records; ``str()`` of one is a readable report, and
``dcp_compile.report.save_model_report(record, path)`` renders one as an HTML page (the records
are data: they know nothing of how they are drawn).
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field
from typing import Any

import torch.fx as fx


@dataclass
class PassRecord:
    name: str
    variant: str
    before: str | None  # readable graphs, kept only when someone will read them (explain, debug dir)
    after: str | None
    seconds: float


@dataclass
class RegionCompiles:
    """What a variant's regions cost (``options={"regions": True}``): they compile at the variant's
    first call, after its own compile, so without these counts a variant "compiled in 1.0s" hid the
    minute its regions took."""

    compiled: int = 0  # regions compiled by this variant (code no earlier region had, or guards that failed)
    reused: int = 0  # regions whose compile came from the cache (an earlier variant's, or a repeated block's)
    seconds: float = 0.0  # time in the compiles (cache lookups excluded)

    def since(self, before: RegionCompiles) -> RegionCompiles:
        """The compiles between ``before`` (a copy taken earlier) and now."""
        return RegionCompiles(self.compiled - before.compiled, self.reused - before.reused,
                              self.seconds - before.seconds)

    def __str__(self) -> str:
        noun = "region" if self.compiled == 1 else "regions"
        timed = f" in {self.seconds:.1f}s" if self.compiled else ""
        return f"{self.compiled} {noun} compiled{timed}, {self.reused} reused from the cache"


@dataclass
class VariantRecord:
    variant: Any
    passes: list[PassRecord] = field(default_factory=list)
    attention_sites: int = 0  # attention sites in the graph (the same for every variant)
    sharded_sites: list[str] = field(default_factory=list)  # attention run under Ulysses' all-to-all
    rank_local_sites: list[str] = field(default_factory=list)  # attention over a dimension the shard keeps whole
    replicated_sites: list[str] = field(default_factory=list)  # attention over another, short sequence (text)
    unsharded_sites: list[tuple[str, str]] = field(default_factory=list)  # (site, why it ran on gathered inputs)
    gathers: list[Any] = field(default_factory=list)
    local_fallbacks: list[str] = field(default_factory=list)  # sharded ops that ran on gathered inputs
    rewrites: list[str] = field(default_factory=list)
    tiled_losses: list[str] = field(default_factory=list)  # losses computed over chunks of tokens (passes/tiled_loss)
    untiled_losses: list[tuple[str, str]] = field(default_factory=list)  # (loss, why it was left as it is)
    tiled_mlps: list[str] = field(default_factory=list)  # MLPs computed over chunks of tokens (passes/tiled_mlp, lean)
    untiled_mlps: list[tuple[str, str]] = field(default_factory=list)  # (activation, why its MLP was left as it is)
    # (site, layout, padded head slots) per SDPA site: "ring x2 over Ulysses x2 (...)" or "Ulysses x4 (...)"
    attention_layouts: list[tuple[str, str, int]] = field(default_factory=list)
    collectives: dict[str, int] = field(default_factory=dict)
    sharded_regions: int = 0
    output_gathers: int = 0  # forward-only all-to-alls that return a chunked output in full
    fallback_reason: str | None = None
    no_attention: str | None = None  # a graph without attention: why it has none (a graph break's piece, ...)
    inner_fallback: str | None = None  # why the variant runs under another inner compiler than asked
    regions: str | None = None  # options={"regions": True}: how the variant was cut, or why it was not
    compiled_in_regions: bool = False  # the variant runs as compiled regions (no whole forward/backward graph)
    uncompiled_regions: list[str] = field(default_factory=list)  # regions that run as ATen graphs, and why
    region_compiles: RegionCompiles = field(default_factory=RegionCompiles)  # counted as the regions compile
    packed_attention: str | None = None  # packed variants: the attention implementation and why (the table's case)
    forward_graph: str | None = None
    backward_graph: str | None = None
    saved_activation_bytes: int | None = None  # per rank, at the traced length: storages, each once; inputs and their views excluded
    saved_at_first_call: bool = False  # regions: saved_activation_bytes counted as the first call kept them
    offloaded_activation_bytes: int = 0  # saved for backward in host memory (recompute=offload, lean)
    saved_rng_state_bytes: int = 0  # generator states kept so recomputed seeded ops (SDPA) repeat their draws
    compile_seconds: float = 0.0
    calls: int = 0
    graph: fx.GraphModule | None = None  # the transformed graph handed to the inner compiler
    debug_path: str | None = None  # where DCP_DEBUG_DIR dumps go, relative to it

    @property
    def sp_size(self) -> int:
        return getattr(self.variant, "sp_size", 1)

    @property
    def is_sharded(self) -> bool:
        """Every attention site ran sharded (all-to-all or rank-local) and nothing fell back."""
        covered = len(self.sharded_sites) + len(self.rank_local_sites) + len(self.replicated_sites)
        return self.fallback_reason is None and covered == self.attention_sites and not self.unsharded_sites

    def gather_reasons(self) -> collections.Counter:
        return collections.Counter(getattr(gather, "reason", str(gather)) for gather in self.gathers)

    def summary(self) -> str:
        """One line: is this variant sequence-parallel, and where is it not."""
        if self.sp_size == 1:
            return f"{self.variant}: SP 1 (nothing to shard)"
        if self.fallback_reason is not None:
            return f"{self.variant}: UNSHARDED (whole graph): {self.fallback_reason}"
        if not self.attention_sites:
            why = f" ({self.no_attention})" if self.no_attention else ""
            return f"{self.variant}: no attention{why}: runs replicated on every rank"
        covered = len(self.sharded_sites) + len(self.rank_local_sites) + len(self.replicated_sites)
        local = f", {len(self.rank_local_sites)} rank-local" if self.rank_local_sites else ""
        local += f", {len(self.replicated_sites)} over another sequence" if self.replicated_sites else ""
        reasons = "; ".join(f"{reason} x{count}" for reason, count in self.gather_reasons().most_common())
        line = (f"{self.variant}: sharded {covered}/{self.attention_sites} attention sites "
                f"({len(self.sharded_sites)} all-to-all{local}) | gathers {len(self.gathers)}"
                + (f" [{reasons}]" if reasons else ""))
        layouts = collections.Counter(layout.split(" (")[0] for _, layout, _ in self.attention_layouts)
        if any(not layout.startswith("Ulysses") for layout in layouts) or any(p for _, _, p in self.attention_layouts):
            padded = sum(p for _, _, p in self.attention_layouts)
            line += " | attention: " + ", ".join(f"{layout} at {count} site(s)" for layout, count in layouts.items())
            line += f" ({padded} padded head slots)" if padded else " (no padded heads)"
        for site, why in self.unsharded_sites:
            line += f" | {site} UNSHARDED: {why}"
        return line


@dataclass
class GraphRecord:
    graph_id: int
    attention_sites: list[str] = field(default_factory=list)
    sequence_length: str | None = None
    classification: list[tuple[str, str, str, str]] = field(default_factory=list)
    analysis_passes: list[PassRecord] = field(default_factory=list)
    variants: dict[Any, VariantRecord] = field(default_factory=dict)
    dispatches: collections.deque = field(default_factory=lambda: collections.deque(maxlen=256))
    trace_seconds: float = 0.0
    # The analysed ATen graph, which the dispatcher keeps anyway: its node names are those of
    # ``classification`` and of every variant's gathers, and its nodes carry ``nn_module_stack``
    # and ``stack_trace``, so the HTML report can group ops by module and link to source lines.
    graph: fx.GraphModule | None = None
    # Integer inputs this graph was compiled for (``L_logits_to_keep_=0``), see free_integers.
    specialization: str | None = None
    # Outputs that are some attention's keys or values (a K/V cache): gathered on every SP>1 call.
    returned_key_values: int | None = None
    # Why dynamo handed over this graph beside an earlier one of the same function (a size Dynamo
    # specialises, 0 or 1: a micro-batch of 1 sample), see specialised_sizes.
    new_graph_reason: str | None = None

    def variant(self, key: Any) -> VariantRecord:
        return self.variants[key]

    def __str__(self) -> str:
        lines = [f"DCP graph {self.graph_id}"]
        if self.new_graph_reason:
            lines.append(f"  {self.new_graph_reason}")
        if self.specialization:
            lines.append(f"  compiled for the integer inputs {self.specialization}")
        if self.returned_key_values:
            lines.append(f"  returns {self.returned_key_values} attention key/value tensors (a K/V cache): gathered in "
                         "full on every SP>1 call; training needs no cache: use_cache=False")
        lines.append(f"  sequence length: {self.sequence_length or 'none (no attention found)'}")
        lines.append(f"  attention sites: {len(self.attention_sites)}")
        lines += [f"    {site}" for site in self.attention_sites]
        counts = collections.Counter(role for _, _, role, _ in self.classification)
        if counts:
            lines.append("  sequence dimension roles: " + ", ".join(f"{k}={v}" for k, v in sorted(counts.items())))
        mixing = [row for row in self.classification if row[2] == "sequence_mixing"]
        for name, op, _, detail in mixing:
            lines.append(f"    sequence-mixing {name} ({op}): {detail}")
        for key, variant in self.variants.items():
            lines.append(f"  {variant.summary()}")
            lines.append(f"  variant {key}: {variant.calls} call(s), compiled in {variant.compile_seconds:.2f}s"
                         + (f" + {variant.region_compiles}" if variant.compiled_in_regions else ""))
            if variant.regions:
                lines.append(f"    regions: {variant.regions}")
            for reason in variant.uncompiled_regions:
                lines.append(f"    region runs uncompiled: {reason}")
            if variant.fallback_reason:
                lines.append(f"    UNSHARDED fallback: {variant.fallback_reason}")
            else:
                lines.append(f"    sharded regions: {variant.sharded_regions}")
            if variant.inner_fallback:
                lines.append(f"    inner compiler: {variant.inner_fallback}")
            if variant.packed_attention:
                lines.append(f"    packed attention: {variant.packed_attention}")
            if variant.collectives:
                lines.append("    collectives: " + ", ".join(f"{k} x{v}" for k, v in sorted(variant.collectives.items())))
            for site, layout, _ in variant.attention_layouts:
                lines.append(f"    attention {site}: {layout}")
            for rewrite in variant.rewrites:
                lines.append(f"    rewrite {rewrite}")
            for tiled in variant.tiled_losses:
                lines.append(f"    tiled loss {tiled}")
            for loss, why in variant.untiled_losses:
                lines.append(f"    loss {loss} not tiled: {why}")
            for tiled in variant.tiled_mlps:
                lines.append(f"    tiled MLP {tiled}")
            for mlp, why in variant.untiled_mlps:
                lines.append(f"    MLP at {mlp} not tiled: {why}")
            for gather in variant.gathers:
                lines.append(f"    {gather}")
            for fallback in variant.local_fallbacks:
                lines.append(f"    ran on gathered inputs: {fallback}")
            if variant.saved_activation_bytes is not None:
                rng = f" + {variant.saved_rng_state_bytes} bytes of RNG state for recomputation" if variant.saved_rng_state_bytes else ""
                how = ("as its first call kept them (regions)" if variant.saved_at_first_call
                       else "symbolic sizes at the traced length")
                lines.append(f"    activations saved for backward: {variant.saved_activation_bytes} bytes{rng} ({how})")
                if variant.offloaded_activation_bytes:
                    lines.append(f"    and in host memory until backward: {variant.offloaded_activation_bytes} bytes "
                                 "(the blocks' inputs, recompute=offload/lean)")
            lines.append("    passes: " + ", ".join(f"{p.name} ({p.seconds * 1000:.0f} ms)" for p in variant.passes))
        if self.dispatches:
            lines.append("  last dispatches (length -> variant, by what): "
                         + "; ".join(f"{length}->{key} ({why})" for length, key, why in list(self.dispatches)[-5:]))
        return "\n".join(lines)


@dataclass
class ModelRecord:
    """All graphs the backend compiled for one ``torch.compile`` call."""

    graphs: list[GraphRecord] = field(default_factory=list)

    def __str__(self) -> str:
        if not self.graphs:
            return "DCP: nothing compiled yet"
        return "\n".join(self.summary_lines()) + "\n\n" + "\n\n".join(str(graph) for graph in self.graphs)

    def summary_lines(self) -> list[str]:
        """One line per graph and variant: the first thing to read ("is DCP doing anything?")."""
        return [f"graph {graph.graph_id} {variant.summary()}" for graph in self.graphs for variant in graph.variants.values()]

    def variant_records(self) -> list[VariantRecord]:
        return [variant for graph in self.graphs for variant in graph.variants.values()]

    def __getitem__(self, index: int) -> GraphRecord:
        return self.graphs[index]

    def __len__(self) -> int:
        return len(self.graphs)
