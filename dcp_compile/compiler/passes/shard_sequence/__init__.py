"""Run every token-local op on the rank's chunk of the sequence.

Layouts are decided per *sharding region*: the connected components of the graph formed by
"this op's output chunk lines up with that input's chunk" edges (token-local ops, attention's
queries and self-attention keys/values, and the inputs of the known rewrites). A region that
contains an attention is sharded; every other value stays full. Inside a sharded region:

* values that are created full (graph inputs, ``arange`` positions, a patchify's flatten, the
  output of a sequence-mixing op) are sliced to the rank's chunk where a sharded op first reads
  them: slicing is a view, so "as early as possible" costs nothing;
* token-local ops run on chunks (views get ``-1`` for the sequence size, so one graph serves
  every length);
* attention becomes ``dcp::sharded_attention``, for ``insert_all_to_all`` to lower;
* sums/means over the sequence, a loss over the sequence, and picking one position (a CLS token)
  are rewritten into a local reduction plus one all-reduce;
* anything else that reads a chunked value across positions gets an all-gather first, recorded
  with its reason.

Graph outputs are full on every rank: a chunked output is gathered, a full one carries a
gradient scale of 1/P (see ``dcp_compile.compiler.collectives``).

The rewrite happens by re-tracing the graph through an interpreter, so every new node gets its
symbolic shape from the ops themselves.

Modules: ``plan`` (which nodes run on chunks: a pure function of the analysis), ``interpreter``
(layouts and the re-trace; the only code that writes its maps), ``lowering_context`` (the
interface: a lowering reads a read-only ``LoweringContext`` and returns a ``Lowered`` record),
``lowerings`` (the registry keyed by ``Rewrite``, ``Role.ATTENTION`` and ``OpForm``), one module of lowerings per
layout family (``attention_lowerings``, ``segment_lowerings``, ``reduction_lowerings``,
``permutation_lowerings``, ``grid_lowerings``, ``chunk_lowerings``, ``full_lowerings``, ``gather_lowerings``), and
``sharding_pass``.
Importing this package registers every lowering.
"""

from __future__ import annotations

from dcp_compile.compiler.passes.shard_sequence import (  # noqa: F401  (each registers its lowerings)
    attention_lowerings, chunk_lowerings, full_lowerings, gather_lowerings, grid_lowerings, permutation_lowerings,
    reduction_lowerings, segment_lowerings,
)
from dcp_compile.compiler.passes.shard_sequence.full_lowerings import SCALAR_READS
from dcp_compile.compiler.passes.shard_sequence.interpreter import ShardingInterpreter, describe_node
from dcp_compile.compiler.passes.shard_sequence.lowering_context import Layout, Lowered, LoweringContext, OpForm, Path
from dcp_compile.compiler.passes.shard_sequence.lowerings import LOWERINGS, CannotShard, GatherRecord, lowering
from dcp_compile.compiler.passes.shard_sequence.plan import ShardPlan, plan_sharding
from dcp_compile.compiler.passes.shard_sequence.sharding_pass import shard_sequence_pass

__all__ = [
    "LOWERINGS", "SCALAR_READS", "CannotShard", "GatherRecord", "Layout", "Lowered", "LoweringContext", "OpForm", "Path",
    "ShardPlan", "ShardingInterpreter", "describe_node", "lowering", "plan_sharding", "shard_sequence_pass",
]
