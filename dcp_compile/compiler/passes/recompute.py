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
  kept; ops outside the blocks are recomputed from the graph inputs.

Under every policy collective outputs are saved (``MUST_SAVE``): recomputing them would re-send
the all-to-alls in backward. Random ops (dropout) are saved too, so a recomputation never draws
a different mask.
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


def block_of(node: fx.Node) -> str | None:
    """The repeated block (``model.layers.3``) a node belongs to, from its module stack."""
    stack = node.meta.get("nn_module_stack") or {}
    for path, _ in stack.values():
        match = BLOCK_PATH.match(str(path))
        if match:
            return match.group(1)
    return None


def _tag(node: fx.Node, policy: CheckpointPolicy, region: int = 0) -> None:
    node.meta["recompute"] = policy
    node.meta["ac_graph_id"] = RECOMPUTE_GRAPH_ID + region
    node.meta["dcp_recompute_tag"] = True


def recompute_pass(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    policy = ctx.recompute
    tagged = 0
    blocks: dict[str, int] = {}
    for node in gm.graph.nodes:
        if node.op == "call_function" and (is_collective(node) or is_random(node)):
            # Under every policy: the min-cut partitioner would otherwise be free to recompute a
            # cheap-looking collective in backward, and ranks whose graphs differ (every rank's
            # does) could then disagree on the collectives they issue, and hang.
            _tag(node, CheckpointPolicy.MUST_SAVE)
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.meta.get("dcp_recompute_tag"):
            continue  # already ours: collectives and random ops, or a region tagged above
        if policy == "full":
            # One region per block: the partitioner saves what crosses a region boundary (each
            # block's input) and recomputes each block from it in backward, as block
            # checkpointing does; what lies outside the blocks forms one region of its own.
            block = block_of(node)
            region = blocks.setdefault(block, len(blocks) + 1) if block is not None else 0
            _tag(node, CheckpointPolicy.PREFER_RECOMPUTE, region)
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

