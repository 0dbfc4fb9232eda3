"""What a multi-rank test asserts besides parity: that every SP>1 variant really sharded.

A whole-graph unsharded run is numerically exact, so a parity check alone cannot tell a model that
ran sequence-parallel from one that silently did not. Every parity test therefore also reads the
compile records and calls :func:`assert_sharded`.
"""

from __future__ import annotations

from dcp_compile.compiler.record import ModelRecord, VariantRecord


def sharding_problems(records: ModelRecord | list[VariantRecord], gather_budget: int) -> list[str]:
    """Why the SP>1 variants of ``records`` are not fully sharded within ``gather_budget`` gathers
    (per variant); empty when they are. Variants of graphs without attention are fine: they run
    replicated by design (a graph break's loss graph, a model with no attention)."""
    variants = records.variant_records() if isinstance(records, ModelRecord) else list(records)
    problems = []
    for variant in variants:
        if variant.sp_size == 1 or variant.attention_sites == 0:
            continue
        if not variant.is_sharded:
            problems.append(f"not sharded: {variant.summary()}")
        elif len(variant.gathers) > gather_budget:
            problems.append(f"{len(variant.gathers)} gathers over the budget of {gather_budget}: {variant.summary()}")
    return problems


def assert_sharded(records: ModelRecord | list[VariantRecord], gather_budget: int, what: str = "") -> None:
    problems = sharding_problems(records, gather_budget)
    if problems:
        raise AssertionError(f"{what + ': ' if what else ''}" + "; ".join(problems))
