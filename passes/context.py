"""What every pass receives besides the graph: the variant being built and where to record."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger(__name__)


@dataclass
class PassContext:
    """Shared state of one compile of one variant.

    ``analysis`` holds what the analysis passes found (attention sites, sequence dimensions); it
    depends only on the graph, so the backend computes it once and hands the same object to every
    variant's passes.
    """

    fake_inputs: list[Any]
    fake_mode: Any
    sp_size: int = 1
    rank: int = 0
    group_name: str | None = None
    recompute: str = "none"
    memory_budget: float | None = None
    packed: bool = False  # the batch packs several sequences (use_varlen_attention adds cu_seqlens)
    record: Any = None  # dcp_compile.record.GraphRecord
    variant_record: Any = None  # dcp_compile.record.VariantRecord
    analysis: dict[str, Any] = field(default_factory=dict)

    def note(self, message: str, *args: Any) -> None:
        log.info(message, *args)
