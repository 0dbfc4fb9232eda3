"""The FX passes, one concern per module, and the one place that lists them in order.

Analysis passes run once per dynamo graph; variant passes run once per variant
(SP size, recompute policy, packing) on the analysed graph.
"""

from __future__ import annotations

from dcp_compile.compiler.passes.causal_masks import causal_masks_pass
from dcp_compile.compiler.passes.find_attention import find_attention_pass
from dcp_compile.compiler.passes.flattened_heads import unfold_head_attention_pass
from dcp_compile.compiler.passes.insert_all_to_all import insert_all_to_all_pass
from dcp_compile.compiler.passes.pipeline import GraphInput, GraphPass, Product, check_disabled, run_passes
from dcp_compile.compiler.passes.recompute import recompute_pass
from dcp_compile.compiler.passes.sequence_dims import sequence_dims_pass
from dcp_compile.compiler.passes.shard_sequence import shard_sequence_pass
from dcp_compile.compiler.passes.tiled_loss import tile_loss_pass
from dcp_compile.compiler.passes.tiled_mlp import tile_mlp_pass
from dcp_compile.compiler.passes.use_varlen_attention import use_varlen_attention_pass
from dcp_compile.compiler.variant_selection import active_sequence_boundaries

ANALYSIS_PASSES: tuple[GraphPass, ...] = (
    GraphPass(unfold_head_attention_pass),
    GraphPass(find_attention_pass, provides=frozenset({Product.ATTENTION_SITES})),
    GraphPass(causal_masks_pass),
    GraphPass(sequence_dims_pass, requires=frozenset({Product.ATTENTION_SITES}),
              provides=frozenset({Product.SEQUENCE_ANALYSIS})),
)

VARIANT_PASSES: tuple[GraphPass, ...] = (
    # Re-traces the analysed graph, so the passes after it edit a graph of their own.
    # Re-traces at SP 1 too: that bakes the scalar inputs' values (see Analysis.scalar_inputs).
    GraphPass(shard_sequence_pass, runs_without_sharding=True, returns_new_graph=True,
              requires=frozenset({Product.SEQUENCE_ANALYSIS}), provides=frozenset({Product.ATTENTION_MARKERS}),
              obliges=frozenset({Product.LOWERED_ATTENTION})),
    GraphPass(insert_all_to_all_pass, requires=frozenset({Product.ATTENTION_MARKERS}),
              provides=frozenset({Product.LOWERED_ATTENTION})),
    GraphPass(
        use_varlen_attention_pass,
        runs_without_sharding=True,
        adds_input=GraphInput("dcp_cu_seqlens", active_sequence_boundaries),
        adds_input_when=lambda ctx: ctx.packed,
    ),
    # After the sharding (the loss is a shard-local sum by then), before the recompute tags.
    GraphPass(tile_loss_pass, runs_without_sharding=True),
    # Under lean only: each rank's MLPs over chunks of its tokens; before the recompute tags too.
    GraphPass(tile_mlp_pass, runs_without_sharding=True),
    GraphPass(recompute_pass, runs_without_sharding=True),
)



def check_disable_passes(disabled: tuple[str, ...]) -> None:
    """Refuse an unknown or unsafe ``disable_passes`` list against the whole pipeline."""
    check_disabled(ANALYSIS_PASSES + VARIANT_PASSES, disabled)


__all__ = ["ANALYSIS_PASSES", "VARIANT_PASSES", "GraphInput", "GraphPass", "Product", "check_disable_passes",
           "run_passes"]
