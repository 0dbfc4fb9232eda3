"""Find every attention in an ATen graph, and rewrite hand-written ones into SDPA.

Ulysses needs to know, for each attention, which values are the queries, keys and values, which
one is the mask, and where the output goes. ``F.scaled_dot_product_attention`` says so directly.
Hand-written attention (``softmax(q @ k^T * scale + mask) @ v``, in its ``matmul``/``bmm``/``@``,
``transpose``/``mT``, ``softmax``, dropout spellings) is matched and replaced by the equivalent
SDPA call, so every later pass deals with a single form. The replacement is exact math: the scale
becomes SDPA's ``scale``, an additive mask its ``attn_mask``, dropout its ``dropout_p``.
"""

from __future__ import annotations

import logging
import operator
import warnings
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx

from dcp_compile.compiler.passes.context import PassContext
from dcp_compile.compiler.passes.einsum_products import respell_einsum_products, respell_summed_products
from dcp_compile.compiler.passes.no_attention import explain_no_attention

aten = torch.ops.aten
log = logging.getLogger(__name__)

SDPA = aten.scaled_dot_product_attention.default
MATMULS = {aten.matmul.default, aten.bmm.default}
SOFTMAXES = {aten.softmax.int, aten._softmax.default}
TRANSPOSES = {aten.transpose.int, aten.mT.default, aten.permute.default}
VIEWS = {aten.view.default, aten.reshape.default, aten._unsafe_view.default}


@dataclass
class AttentionRegion:
    """Hand-written attention SDPA cannot express (soft-capped scores, a ``torch.where`` mask, a
    per-head bias): ``p = f(q @ k^T, side inputs); out = p @ v``. Every op of ``f`` works on the
    scores' last two dims and broadcasts over batch and heads, so under Ulysses the region runs
    unchanged on each rank's heads, its side inputs (masks, biases) cut to those heads."""

    scores: fx.Node  # q @ k^T
    key_transposed: fx.Node  # k^T, the second operand of ``scores``
    nodes: tuple[fx.Node, ...]  # topological order, from key_transposed to the output matmul
    side_inputs: tuple[fx.Node, ...]  # inputs of the region other than q, k, v

    @property
    def output(self) -> fx.Node:
        return self.nodes[-1]


@dataclass
class AttentionSite:
    """One attention, as the sharding passes need it."""

    node: fx.Node  # the SDPA node, or the output matmul of a region
    spelling: str  # "sdpa", "handwritten" (rewritten into SDPA) or "region"
    query_shape: tuple[str, ...]
    key_shape: tuple[str, ...]
    region: AttentionRegion | None = None

    @property
    def query(self) -> fx.Node:
        return self.region.scores.args[0] if self.region else self.node.args[0]

    @property
    def key(self) -> fx.Node:
        return self.region.key_transposed.args[0] if self.region else self.node.args[1]

    @property
    def value(self) -> fx.Node:
        return self.node.args[1] if self.region else self.node.args[2]

    @property
    def mask(self) -> fx.Node | None:
        return None if self.region else sdpa_argument(self.node, "attn_mask")

    def describe(self) -> str:
        if self.region is not None:
            sides = ", ".join(n.name for n in self.region.side_inputs)
            ops = sorted({str(n.target).replace("aten.", "").split(".")[0] for n in self.region.nodes[1:-1]})
            return (f"{self.node.name} (hand-written region: {', '.join(ops)}"
                    f"{'; side inputs ' + sides if sides else ''}): "
                    f"q[{', '.join(self.query_shape)}] k[{', '.join(self.key_shape)}]")
        causal = " causal" if sdpa_argument(self.node, "is_causal") else ""
        gqa = " gqa" if sdpa_argument(self.node, "enable_gqa") else ""
        mask = f" mask={self.mask.name}" if self.mask is not None else ""
        return (
            f"{self.node.name} ({self.spelling}{causal}{gqa}{mask}): "
            f"q[{', '.join(self.query_shape)}] k[{', '.join(self.key_shape)}]"
        )


REGION_OPS_EXTRA = {aten.softmax.int, aten._softmax.default, aten.dropout.default, aten.native_dropout.default,
                    aten.clone.default, aten._to_copy.default, aten.to.dtype, aten.to.dtype_layout,
                    aten.type_as.default, aten.masked_fill.Scalar, aten.masked_fill.Tensor, aten.where.self,
                    aten.where.ScalarOther, aten.where.ScalarSelf, aten.contiguous.default, aten.detach.default}
REGION_SEARCH_DEPTH = 24


# Ops over the keys axis (the scores' last dim) that keep the rank: an attention sink's logit
# concatenated to the scores and sliced off after the softmax, a max subtracted for stability.
# Under Ulysses each rank holds every key of its heads, so they run there unchanged.
KEY_AXIS_OPS = {aten.cat.default: 1, aten.slice.Tensor: 1, aten.narrow.default: 1, aten.amax.default: 1,
                aten.max.dim: 1, aten.logsumexp.default: 1, aten.sum.dim_IntList: 1}
KEEPDIM_POSITION = {aten.amax.default: 2, aten.max.dim: 2, aten.logsumexp.default: 2, aten.sum.dim_IntList: 2}


def _over_key_axis(node: fx.Node, scores_rank: int) -> bool:
    """An op of KEY_AXIS_OPS over the scores' last dim alone, keeping the scores' rank."""
    position = KEY_AXIS_OPS[node.target]
    dims = node.args[position] if len(node.args) > position else node.kwargs.get("dim", 0)
    dims = list(dims) if isinstance(dims, (list, tuple)) else [dims]
    if not dims or not all(isinstance(d, int) and d % scores_rank == scores_rank - 1 for d in dims):
        return False
    keep = KEEPDIM_POSITION.get(node.target)
    if keep is not None and not (node.args[keep] if len(node.args) > keep else node.kwargs.get("keepdim", False)):
        return False
    return all(_rank_of(source) == scores_rank for source in node.all_input_nodes)


def _region_op_ok(node: fx.Node, scores_rank: int) -> bool:
    """Ops a region may hold: elementwise ones, softmax over the last dim and the ops over the keys
    axis (head-local)."""
    target = node.target
    if target in (aten.softmax.int, aten._softmax.default):
        return node.args[1] % scores_rank == scores_rank - 1
    if target is operator.getitem:
        return True
    if target in KEY_AXIS_OPS:
        return _over_key_axis(node, scores_rank)
    return isinstance(target, torch._ops.OpOverload) and (torch.Tag.pointwise in target.tags or target in REGION_OPS_EXTRA)


def find_attention_region(softmax: fx.Node) -> AttentionRegion | None:
    """``out = f(q @ k^T) @ v`` around a softmax over the keys, for 4-D ``[B, H, S, D]`` operands."""
    rank = _rank_of(softmax)
    if rank != 4 or softmax.args[1] % rank != rank - 1:
        return None
    # Down from the softmax: single-user head-local ops up to the matmul with v.
    output, node = None, softmax
    for _ in range(REGION_SEARCH_DEPTH):
        if len(node.users) != 1:
            return None
        user = next(iter(node.users))
        if user.target in MATMULS and user.args[0] is node:
            output = user
            break
        if not _region_op_ok(user, rank):
            return None
        node = user
    if output is None or _rank_of(output.args[1]) != 4:
        return None
    # Up from the softmax: the one matmul q @ k^T that the scores come from.
    scores, frontier, seen = None, [softmax], set()
    while frontier:
        current = frontier.pop()
        if current in seen:
            continue
        seen.add(current)
        for source in current.all_input_nodes:
            if source.target in MATMULS and _rank_of(source) == rank:
                if scores is not None and scores is not source:
                    return None
                scores = source
            elif _region_op_ok(source, rank) and _rank_of(source) == rank and len(seen) < REGION_SEARCH_DEPTH:
                frontier.append(source)
    if scores is None:
        return None
    key_transposed = scores.args[1]
    if (not isinstance(key_transposed, fx.Node) or key_transposed.target not in TRANSPOSES
            or not _swaps_last_two_dims(key_transposed) or len(key_transposed.users) != 1):
        return None
    if not (_rank_of(scores.args[0]) == _rank_of(key_transposed.args[0]) == 4):
        return None
    # The region: what lies on a path from the scores to the output; nothing else may read it.
    between = {scores, key_transposed, output}
    stack = [scores]
    while stack:
        current = stack.pop()
        for user in current.users:
            if user not in between and _reaches(user, output, REGION_SEARCH_DEPTH):
                between.add(user)
                stack.append(user)
    # An unused element of a member's tuple result (the indices of ``max(dim=-1)``) runs with it.
    between |= {user for member in between - {output} for user in member.users if _dead_element(user)}
    for member in between - {output}:
        if not set(member.users) <= between:
            return None  # e.g. attention weights also returned (output_attentions=True)
        if member not in (scores, key_transposed) and not _region_op_ok(member, rank):
            return None
    graph_order = {n: i for i, n in enumerate(softmax.graph.nodes)}
    nodes = tuple(sorted(between, key=graph_order.__getitem__))
    operands = {scores.args[0], key_transposed.args[0], output.args[1]}
    sides = []
    for member in nodes:
        for source in member.all_input_nodes:
            if source not in between and source not in operands and source not in sides:
                sides.append(source)
    return AttentionRegion(scores, key_transposed, nodes, tuple(sides))


def _dead_element(node: fx.Node) -> bool:
    """An unused element of a tuple result (the indices of ``max(dim=-1)`` when only its values are read)."""
    return node.target is operator.getitem and not node.users


def _reaches(start: fx.Node, goal: fx.Node, depth: int) -> bool:
    frontier, seen = [start], {start}
    for _ in range(depth):
        if goal in frontier:
            return True
        frontier = [user for node in frontier for user in node.users if user not in seen]
        seen.update(frontier)
        if not frontier:
            return False
    return False


_SDPA_DEFAULTS = {"attn_mask": None, "dropout_p": 0.0, "is_causal": False, "scale": None, "enable_gqa": False}
_SDPA_POSITIONS = {"attn_mask": 3, "dropout_p": 4, "is_causal": 5, "scale": 6, "enable_gqa": 7}


def sdpa_argument(node: fx.Node, name: str) -> Any:
    position = _SDPA_POSITIONS[name]
    if name in node.kwargs:
        return node.kwargs[name]
    if len(node.args) > position:
        return node.args[position]
    return _SDPA_DEFAULTS[name]


def _shape(node: fx.Node) -> tuple[str, ...]:
    value = node.meta.get("val")
    return tuple(str(size) for size in value.shape) if isinstance(value, torch.Tensor) else ()


def _rank_of(node: Any) -> int:
    value = node.meta.get("val") if isinstance(node, fx.Node) else None
    return value.dim() if isinstance(value, torch.Tensor) else -1


def _swaps_last_two_dims(node: fx.Node) -> bool:
    rank = _rank_of(node.args[0])
    if node.target is aten.mT.default:
        return True
    if node.target is aten.transpose.int:
        dims = sorted(d % rank for d in node.args[1:3])
        return dims == [rank - 2, rank - 1]
    if node.target is aten.permute.default:
        order = [d % rank for d in node.args[1]]
        return order == list(range(rank - 2)) + [rank - 1, rank - 2]
    return False


@dataclass
class HandwrittenMatch:
    softmax: fx.Node
    output: fx.Node
    query: fx.Node
    key: fx.Node
    value: fx.Node
    mask: fx.Node | None
    scale: float
    dropout_p: float
    head_view: list | None = None  # [B, H, S, S]: run SDPA on 4-D views of 3-D operands


def _is_constant_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def find_handwritten_attention(softmax: fx.Node) -> HandwrittenMatch | None:
    """Match ``[dropout](softmax(matmul(q, k^T) [*|/ c] [+ mask], -1)) @ v`` ending at ``softmax``."""
    rank = _rank_of(softmax)
    if rank < 3 or softmax.args[1] % rank != rank - 1:
        return None
    if softmax.target is aten._softmax.default and softmax.args[2]:
        return None  # half-to-float softmax: leave it alone
    scores, mask, scale = softmax.args[0], None, 1.0
    head_view = None  # [B*H, S, S] scores viewed as [B, H, S, S] to add a per-batch mask
    if scores.target in VIEWS and len(scores.users) == 1 and _rank_of(scores) == 3:
        inner = scores.args[0]
        if inner.target is aten.add.Tensor and len(inner.users) == 1 and _rank_of(inner) == 4:
            left = inner.args[0]
            if isinstance(left, fx.Node) and left.target in VIEWS and len(left.users) == 1:
                head_view = list(left.args[1])
                scores = inner
                scores_source = left.args[0]
    if scores.target is aten.add.Tensor and len(scores.users) == 1:
        left, right = scores.args[0], scores.args[1]
        if isinstance(left, fx.Node) and isinstance(right, fx.Node):
            if head_view is not None:
                scores, mask = scores_source, right
            elif left.target in MATMULS or left.target in (aten.mul.Tensor, aten.div.Tensor):
                scores, mask = left, right
            elif right.target in MATMULS or right.target in (aten.mul.Tensor, aten.div.Tensor):
                scores, mask = right, left
    if scores.target in (aten.mul.Tensor, aten.div.Tensor) and len(scores.users) == 1:
        factor = scores.args[1]
        if not _is_constant_number(factor):
            return None
        scale = float(factor) if scores.target is aten.mul.Tensor else 1.0 / float(factor)
        scores = scores.args[0]
    if scores.target not in MATMULS or len(scores.users) != 1:
        return None
    query, key_transposed = scores.args
    if key_transposed.target not in TRANSPOSES or not _swaps_last_two_dims(key_transposed):
        return None
    key = key_transposed.args[0]
    probabilities, dropout_p = softmax, 0.0
    if len(probabilities.users) != 1:
        return None
    user = next(iter(probabilities.users))
    if user.target is aten.dropout.default:
        dropout_p = float(user.args[1]) if user.args[2] else 0.0
        probabilities = user
        if len(probabilities.users) != 1:
            return None
        user = next(iter(probabilities.users))
    if user.target not in MATMULS or user.args[0] is not probabilities:
        return None
    value = user.args[1]
    if not (_rank_of(query) == _rank_of(key) == _rank_of(value) == rank):
        return None
    return HandwrittenMatch(softmax, user, query, key, value, mask, scale, dropout_p, head_view)


def _propagate_fake_values(gm: fx.GraphModule, ctx: PassContext) -> None:
    """Give the nodes this pass created a ``val`` (later passes read shapes from it)."""
    with ctx.fake_mode:
        for node in gm.graph.nodes:
            if node.op == "call_function" and "val" not in node.meta:
                args = fx.map_arg(node.args, lambda n: n.meta["val"])
                kwargs = fx.map_arg(node.kwargs, lambda n: n.meta["val"])
                node.meta["val"] = node.target(*args, **kwargs)


NO_ATTENTION_WARNING = (
    "dcp: a graph with parameters and inputs of a dynamic length has no attention the compiler recognises "
    "(F.scaled_dot_product_attention, or softmax(q @ k^T) @ v in matmul/bmm/einsum/einops spellings): it runs "
    "replicated on every rank, with no sequence parallelism. If the model has attention, write it with "
    "F.scaled_dot_product_attention; dcp.explain(model, *inputs) shows what was found.")


def _has_sequence_dimension(gm: fx.GraphModule, ctx: PassContext) -> bool:
    """A model graph (it holds parameters) with an input of a dynamic (symbolic) size: a graph
    break's loss graph holds no parameters, so it stays quiet (and a piece of a forward cut by a
    graph break stays quiet unless it could hold an attention: see ``no_attention``)."""
    placeholders = list(gm.graph.find_nodes(op="placeholder"))
    if not ctx.analysis.parameter_indices:
        return False
    for index, node in enumerate(placeholders):
        value = node.meta.get("val")
        if index in ctx.analysis.parameter_indices or not isinstance(value, torch.Tensor):
            continue
        if any(isinstance(size, torch.SymInt) and size.node.expr.free_symbols for size in value.shape):
            return True
    return False


def find_attention_pass(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    """Record every attention site; rewrite hand-written attention into SDPA nodes."""
    # einsum- and einops.reduce-spelled attention reads as q @ k^T from here on
    if respell_summed_products(gm) + respell_einsum_products(gm):
        _propagate_fake_values(gm, ctx)
    rewritten = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target not in SOFTMAXES:
            continue
        match = find_handwritten_attention(node)
        if match is None:
            continue
        with gm.graph.inserting_before(match.output):
            query, key, value = match.query, match.key, match.value
            if match.head_view is not None:
                batch, heads, length = match.head_view[:3]

                def four_d(node: fx.Node) -> fx.Node:
                    head_dim = node.meta["val"].shape[-1]
                    return gm.graph.call_function(aten.view.default, (node, [batch, heads, length, head_dim]))

                query, key, value = four_d(query), four_d(key), four_d(value)
            sdpa = gm.graph.call_function(
                SDPA,
                (query, key, value),
                {"attn_mask": match.mask, "dropout_p": match.dropout_p, "scale": match.scale},
            )
            if match.head_view is not None:
                head_dim = match.value.meta["val"].shape[-1]
                rows = gm.graph.call_function(aten.sym_size.int, (match.query, 0))
                flat = gm.graph.call_function(aten.reshape.default, (sdpa, [rows, length, head_dim]))
                flat.meta = dict(match.output.meta)
        sdpa.meta = {k: v for k, v in match.output.meta.items() if match.head_view is None or k != "val"}
        sdpa.meta["dcp_spelling"] = "handwritten"
        match.output.replace_all_uses_with(sdpa if match.head_view is None else flat)
        rewritten += 1
    if rewritten:
        gm.graph.eliminate_dead_code()
        gm.recompile()
        _propagate_fake_values(gm, ctx)
    sites = [
        AttentionSite(node, node.meta.get("dcp_spelling", "sdpa"), _shape(node.args[0]), _shape(node.args[1]))
        for node in gm.graph.nodes
        if node.op == "call_function" and node.target is SDPA
    ]
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and node.target in SOFTMAXES:
            region = find_attention_region(node)
            if region is not None:
                sites.append(AttentionSite(region.output, "region", _shape(region.scores.args[0]),
                                           _shape(region.key_transposed.args[0]), region))
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    sites.sort(key=lambda site: order[site.node])
    ctx.analysis.attention_sites = sites
    if not sites:
        finding = explain_no_attention(gm)
        ctx.analysis.no_attention = finding.reason
        log.info("dcp: no attention found in this graph; it runs unsharded on every rank: %s", finding.reason)
        if finding.should_warn(_has_sequence_dimension(gm, ctx)):
            remedy = f" {finding.remedy}." if finding.remedy else ""
            warnings.warn(f"{NO_ATTENTION_WARNING} This graph: {finding.reason}.{remedy}", UserWarning, stacklevel=2)
    else:
        log.info("dcp: found %d attention site(s) (%d hand-written)", len(sites), rewritten)
    return gm
