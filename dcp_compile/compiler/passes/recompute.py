"""Recomputation policy of a variant, written as partitioner tags on the graph.

AOTAutograd's min-cut partitioner reads ``node.meta["recompute"]`` (a ``CheckpointPolicy``) and
``node.meta["ac_graph_id"]``, the same tags ``torch.utils.checkpoint`` leaves, so the compiled
backward recomputes what the policy says and keeps the rest:

* ``none``: no tags of ours (the model's own checkpointed regions keep theirs);
* ``attention``: attention and the projections that make its queries, keys and values are
  recomputed in backward (what lies between the projections' inputs and SDPA: views, head
  repeats, rotary embeddings); under sequence parallelism the walk stops at the all-to-alls,
  whose outputs are saved, so there only SDPA itself is recomputed;
* ``selective``: ``attention``, plus every op that is not a matrix product (norms, activation
  functions, elementwise ops, views): only matmul outputs are kept, the classic selective
  activation checkpointing, and what the cost model prices under the same name;
* ``full``: every block (``layers.3``, by module path) is recomputed from its input, which is
  kept; ops outside the blocks are recomputed from the graph inputs;
* ``block``: ``full``, and the collectives inside each block (its all-to-alls) are recomputed
  too, in the block's region (``MUST_RECOMPUTE``): a block keeps only its input, as
  ``torch.utils.checkpoint`` around the block does, and the compiled backward re-sends the
  block's forward all-to-alls before its own;
* ``offload`` and ``lean``: tagged as ``block``; what else they do happens later (the kept block
  inputs offloaded at partitioning, :mod:`dcp_compile.compiler.activation_offload`; the MLPs
  tiled by ``tile_mlp``).

Under every other policy collective outputs are saved (``MUST_SAVE``): recomputing them re-sends
the all-to-alls in backward; under ``block`` those outside the blocks (output gathers, a loss's
all-reduce) stay saved. Random ops (dropout) are saved under every policy, so a recomputation
never draws a different mask.

Why the ranks of a group cannot disagree under ``block``: their graphs have the same ops in the
same order and differ only in their chunks' sizes, and the min-cut partitioner reads sizes only
to decide about nodes it is free to save or recompute. A collective tagged ``MUST_RECOMPUTE`` is
never saved: it is recomputed exactly when backward needs its value, which the graph's structure
decides, not its sizes (one tagged ``MUST_SAVE`` is never recomputed). Backward keeps every
collective it was given (its dead-code elimination treats them as impure) and orders them by the
same structure on every rank.
"""

from __future__ import annotations

import logging
import operator
import re

import torch
import torch.fx as fx
from torch.utils.checkpoint import CheckpointPolicy

from dcp_compile.compiler.passes.context import PassContext
from dcp_compile.compiler.passes.find_attention import SDPA, sdpa_argument
from dcp_compile.compiler.passes.use_varlen_attention import FLEX_ATTENTION, VARLEN_ATTENTION
from dcp_compile.variant import checkpoints_whole_blocks

log = logging.getLogger(__name__)
RECOMPUTE_GRAPH_ID = 4242


def is_collective(node: fx.Node) -> bool:
    return node.op == "call_function" and "_c10d_functional" in str(node.target)


def is_random(node: fx.Node) -> bool:
    target = node.target
    if target is SDPA:  # seeded only through its dropout
        return float(sdpa_argument(node, "dropout_p")) > 0.0
    return isinstance(target, torch._ops.OpOverload) and torch.Tag.nondeterministic_seeded in target.tags


PROJECTIONS = {
    torch.ops.aten.linear.default, torch.ops.aten.mm.default, torch.ops.aten.addmm.default,
    torch.ops.aten.matmul.default, torch.ops.aten.bmm.default, torch.ops.aten.baddbmm.default,
    torch.ops.aten.einsum.default,
}


def is_attention(node: fx.Node) -> bool:
    """SDPA, or the varlen attention that replaced it in a packed variant (the dcp:: op or FlexAttention)."""
    return node.op == "call_function" and (node.target is SDPA or node.target is VARLEN_ATTENTION
                                           or node.target is FLEX_ATTENTION)


def attention_inputs_region(sdpa: fx.Node) -> list[fx.Node]:
    """SDPA and everything from its q, k, v back to (and including) their projections.

    The walk stops at graph inputs, at collectives (their outputs are saved under every policy)
    and at the first matrix product on each path: the projection is recomputed, its input (the
    normed hidden state, which its weight gradient needs anyway) stays saved.
    """
    outputs = [user for user in sdpa.users if user.target is operator.getitem]  # multi-output kernels
    region = [sdpa, *outputs]
    seen = set(region)
    stack = [arg for arg in sdpa.args[:3] if isinstance(arg, fx.Node)]
    while stack:
        node = stack.pop()
        if node in seen or node.op != "call_function" or is_collective(node) or is_random(node):
            continue
        seen.add(node)
        region.append(node)
        if node.target in PROJECTIONS:
            continue
        stack.extend(arg for arg in node.all_input_nodes)
    return region


BLOCK_PATH = re.compile(r"^(.*?(?:\.|\[)\d+\]?)(?:\.|$)")
# Where Dynamo found the root module: ``L['self']``, or an argument (``L['args'][0]``: transformers 5
# wraps ``forward`` in decorators, so the model arrives as the wrapper's first argument). Its index
# is not a block's: without this, every op of such a model fell in one "block" ``L['args'][0]``.
ROOT_SOURCE = re.compile(r"^L\[['\"](?:args|kwargs)['\"]\]\[[^\]]+\]")


def block_of(node: fx.Node) -> str | None:
    """The repeated block (``model.layers.3``) a node belongs to, from its module stack."""
    stack = node.meta.get("nn_module_stack") or {}
    for path, _ in stack.values():
        path = str(path)
        root = ROOT_SOURCE.match(path)
        prefix = root.group(0) if root else ""
        match = BLOCK_PATH.match(path[len(prefix):])
        if match:
            return prefix + match.group(1)
    return None


def _tag(node: fx.Node, policy: CheckpointPolicy, region: int = 0) -> None:
    node.meta["recompute"] = policy
    node.meta["ac_graph_id"] = RECOMPUTE_GRAPH_ID + region
    node.meta["dcp_recompute_tag"] = True


def block_regions(gm: fx.GraphModule) -> dict[str, int]:
    """Each repeated block's recompute region (1, 2, ... in graph order; 0 is outside the blocks).

    Numbered in the order the blocks' first ops appear, so a later block has a larger
    ``ac_graph_id``: the partitioner saves what crosses from a region into a later one."""
    blocks: dict[str, int] = {}
    for node in gm.graph.nodes:
        if node.op == "call_function":
            block = block_of(node)
            if block is not None:
                blocks.setdefault(block, len(blocks) + 1)
    return blocks


def recompute_pass(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    policy = ctx.recompute
    tagged = 0
    whole_blocks = checkpoints_whole_blocks(policy)  # block, offload, lean
    blocks = block_regions(gm) if policy == "full" or whole_blocks else {}
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        if whole_blocks and is_collective(node) and block_of(node) is not None:
            # Whole-block checkpointing: the block's collectives (its all-to-alls) run again in
            # backward instead of keeping their outputs. MUST, not PREFER: the min-cut partitioner
            # then has no choice to make about them (it recomputes every MUST_RECOMPUTE node whose
            # value backward needs, whatever its size), so every rank of the group, whose graphs
            # differ only in their chunks' sizes, re-issues the same collectives in the same order.
            _tag(node, CheckpointPolicy.MUST_RECOMPUTE, blocks[block_of(node)])
            tagged += 1
        elif is_collective(node) or is_random(node):
            # Under every policy: the min-cut partitioner would otherwise be free to recompute a
            # cheap-looking collective in backward, and ranks whose graphs differ (every rank's
            # does) could then disagree on the collectives they issue, and hang. Under `block`
            # the collectives outside the blocks (output gathers, a loss's all-reduce) and random
            # ops everywhere (a recomputed dropout must not draw a new mask) stay saved too.
            _tag(node, CheckpointPolicy.MUST_SAVE)
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.meta.get("dcp_recompute_tag"):
            continue  # already ours: collectives and random ops, or a region tagged above
        if policy == "full" or whole_blocks:
            # One region per block: the partitioner saves what crosses a region boundary (each
            # block's input) and recomputes each block from it in backward, as block
            # checkpointing does; what lies outside the blocks forms one region of its own.
            block = block_of(node)
            _tag(node, CheckpointPolicy.PREFER_RECOMPUTE, blocks[block] if block is not None else 0)
            tagged += 1
        elif policy == "selective" and node.target not in PROJECTIONS and not is_attention(node):
            _tag(node, CheckpointPolicy.MUST_RECOMPUTE)
            tagged += 1
        if policy in ("attention", "selective") and is_attention(node):
            # MUST: a soft preference loses to keeping SDPA's output and logsumexp, which is
            # exactly what this policy gives up.
            for member in attention_inputs_region(node):
                if not member.meta.get("dcp_recompute_tag"):
                    _tag(member, CheckpointPolicy.MUST_RECOMPUTE)
                    tagged += 1
    log.debug("dcp: recompute=%s tagged %d node(s) for recomputation", policy, tagged)
    return gm
