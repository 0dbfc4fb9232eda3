"""Which dimension of every value is the sequence, and what every op does to it.

Laid out as PyTorch's DTensor op rules are (``torch/distributed/tensor/_ops/``):

* ``model``: the data (``SequenceDim``, the ``Role`` and ``Rewrite`` enums, the ``NodeRole``
  record with the ``Findings`` a rule reports, ``SequenceAnalysis`` and the read-only view of it
  every rule gets, ``Refusal``);
* ``symbolic``: sympy size arithmetic (``equal``, ``divides``, ``map_through_view``);
* ``registry``: ``@rule`` / ``@stage_rule`` registration and ``classify``, the precedence chain
  written down in one place, with the elementwise and source fallbacks it needs;
* one module of rules per op family, each importing only the three above: ``attention_rules``,
  ``view_rules``, ``indexing_rules`` (with joint segments), ``reduction_rules``,
  ``matmul_rules``, ``token_sets`` (an MoE's sorted tokens), ``elementwise_rules``,
  ``grid_rules`` (token grids run on each rank's window), ``spatial_rules`` (convolution, pooling
  and resampling along their batch and channel dimensions), ``schema_reductions`` (any reduction,
  read off its schema and shapes), ``decomposition_rules`` (any op torch can decompose, read
  through its decomposition), ``inplace_writes`` (buffers written in place: default deny);
* ``propagation``: the driver (attention length, then attempts that classify every node in
  topological order, recording what the rules found, until one refuses nothing) and the pass.

Rules are pure: ``(node, read-only view) -> NodeRole``, no writes, no module state.

Every node gets a role (see ``Role``): a *source* creates a sequence dimension, *token-local* ops
run on a chunk, *attention* runs under Ulysses, *sequence-mixing* ops are gathered unless a
``Rewrite`` gives them an exact chunked form. Importing this package registers every rule.
"""

from __future__ import annotations

from dcp_compile.compiler.passes.sequence_dims import (  # noqa: F401  (each registers its rules)
    attention_rules, decomposition_rules, elementwise_rules, grid_rules, indexing_rules, inplace_writes, matmul_rules, reduction_rules,
    schema_reductions, spatial_rules, token_sets, view_rules,
)
from dcp_compile.compiler.passes.sequence_dims.model import (
    AnalysisView, Findings, GridRegion, NodeRole, ReadOnlyAnalysis, Refusal, RefusalKind, Rewrite, Role,
    SequenceAnalysis, SequenceDim, TokenPositions, read_only,
)
from dcp_compile.compiler.passes.sequence_dims.propagation import (
    analyze_sequence_dims, long_segment_of, sequence_dims_pass, sequence_length_of,
)
from dcp_compile.compiler.passes.sequence_dims.registry import RULES, VIEWS, classify
from dcp_compile.compiler.passes.sequence_dims.symbolic import expression, map_through_view, shape_of

__all__ = [
    "RULES", "VIEWS", "AnalysisView", "Findings", "GridRegion", "NodeRole", "ReadOnlyAnalysis", "Refusal",
    "RefusalKind", "Rewrite", "Role", "SequenceAnalysis", "SequenceDim", "TokenPositions", "analyze_sequence_dims",
    "classify", "expression", "long_segment_of", "map_through_view", "read_only", "sequence_dims_pass",
    "sequence_length_of", "shape_of",
]
