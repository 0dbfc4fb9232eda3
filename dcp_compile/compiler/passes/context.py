"""What every pass receives besides the graph: the variant being built and where to record."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from dcp_compile.variant import RecomputePolicy

if TYPE_CHECKING:
    from dcp_compile.compiler.passes.find_attention import AttentionSite
    from dcp_compile.compiler.passes.sequence_dims import SequenceAnalysis
    from dcp_compile.compiler.record import GraphRecord, VariantRecord

log = logging.getLogger(__name__)


@dataclass
class Analysis:
    """What the analysis passes found. It depends only on the graph, so the backend computes it
    once and every variant's passes read the same record."""

    parameter_indices: frozenset[int] = frozenset()  # graph inputs that are nn.Parameters
    attention_sites: list["AttentionSite"] = field(default_factory=list)
    sequence: "SequenceAnalysis | None" = None
    # Python floats (a norm's eps, a scale attribute) reach the graph as 0-d float64 inputs read
    # with ``.item()``. Variants bake their values (see shard_sequence), and the dispatcher keys
    # compiled variants by them, which is what dynamo's specialize_float would do, scoped to dcp.
    scalar_inputs: tuple[int, ...] = ()
    causal_mask_sites: list[str] = field(default_factory=list)  # SDPAs whose built mask became is_causal
    no_attention: str | None = None  # why a graph without attention has none (see passes/no_attention)


@dataclass
class PassContext:
    """Shared state of one compile of one variant."""

    fake_inputs: list[Any]
    fake_mode: Any
    sp_size: int = 1
    rank: int = 0
    group_name: str | None = None
    recompute: RecomputePolicy = RecomputePolicy.NONE
    packed: bool = False  # the batch packs several sequences (use_varlen_attention adds cu_seqlens)
    packed_attention: str | None = None  # Variant.attention: None (the dcp:: op) or "flex"
    packed_attention_reason: str = ""  # why the dispatcher chose it (the measured table's case)
    record: "GraphRecord | None" = None
    variant_record: "VariantRecord | None" = None
    analysis: Analysis = field(default_factory=Analysis)
    scalar_values: dict[int, float] = field(default_factory=dict)  # baked values of analysis.scalar_inputs
    snapshots: bool = False  # keep each pass's before/after graph text (explain, debug dir, tlparse)
    loss_chunk: int | None = None  # tokens per chunk of the tiled loss (options={"loss_chunk": ...}; None: the default rule)
    mlp_chunk: int | None = None  # tokens per chunk of the tiled MLP (options={"mlp_chunk": ...}; None: the default rule)

    def note(self, message: str, *args: Any) -> None:
        log.info(message, *args)
