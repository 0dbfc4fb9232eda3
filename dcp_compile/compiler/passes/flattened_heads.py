"""Attention written on ``[B*H, S, D]`` operands, put back on ``[B, H, S, D]`` before matching.

Why: some models fold heads into the batch for ``bmm`` and view the scores as ``[B, H, S, S]``
only around the softmax (BLOOM: ``alibi.baddbmm(q, k^T, beta, alpha)``, then ``.view(B, H, S, S)``
and a causal mask, then ``bmm(p.view(B*H, S, S), v)``). The attention matchers look for
``q @ k^T`` on 4-D operands; on the folded form they found nothing, so the model ran with no
sequence parallelism at all. Unfolding is exact (the same products, the same order of additions:
``baddbmm`` is ``beta * bias + alpha * (q @ k^T)``), after which the ALiBi bias is an ordinary side
input of an attention region, cut to each rank's heads under Ulysses.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from dcp_compile.compiler.passes.context import PassContext
from dcp_compile.compiler.passes.find_attention import (
    SOFTMAXES, VIEWS, _propagate_fake_values, _rank_of, _region_op_ok,
)

aten = torch.ops.aten
FOLDED_SCORES = {aten.bmm.default, aten.baddbmm.default}


def _shape(node: fx.Node) -> tuple:
    return tuple(node.meta["val"].shape)


def _unfolded(node: fx.Node) -> fx.Node | None:
    """The ``[B, H, S, D]`` value a ``[B*H, S, D]`` reshape folded, or None."""
    if not isinstance(node, fx.Node) or node.target not in VIEWS or _rank_of(node) != 3:
        return None
    source = node.args[0]
    if _rank_of(source) != 4:
        return None
    (batch, heads, *rest), folded = _shape(source), _shape(node)
    if folded[1:] != tuple(rest) or folded[0] != batch * heads:
        return None
    return source


def _folded_key(node: fx.Node) -> fx.Node | None:
    """``k`` of ``reshape(k, [B*H, S, D]).transpose(-1, -2)``."""
    if not isinstance(node, fx.Node) or node.target is not aten.transpose.int or _rank_of(node) != 3:
        return None
    if sorted(d % 3 for d in node.args[1:3]) != [1, 2] or len(node.users) != 1:
        return None
    return _unfolded(node.args[0])


def unfold_head_attention(gm: fx.GraphModule) -> int:
    """Rewrite each folded-heads attention around a 4-D softmax into 4-D ops; return how many."""
    rewritten = 0
    for softmax in list(gm.graph.nodes):
        if softmax.op != "call_function" or softmax.target not in SOFTMAXES or _rank_of(softmax) != 4:
            continue
        # Up: the softmax's input reaches a [B, H, S, S] view of 3-D scores through pointwise ops.
        view, frontier = None, [softmax.args[0]]
        while frontier and view is None:
            current = frontier.pop()
            if current.target in VIEWS and _rank_of(current) == 4 and current.args[0].target in FOLDED_SCORES:
                view = current
            elif _region_op_ok(current, 4) and _rank_of(current) == 4:
                frontier += [n for n in current.all_input_nodes if _rank_of(n) == 4]
        if view is None or len(view.users) != 1:
            continue
        scores = view.args[0]
        first, second = (scores.args[0], scores.args[1]) if scores.target is aten.bmm.default else scores.args[1:3]
        query, key = _unfolded(first), _folded_key(second)
        # Down: single-user head-local ops, then bmm(p.view(B*H, S, S), v.reshape(B*H, S, D)).
        node, output = softmax, None
        for _ in range(8):
            if len(node.users) != 1:
                break
            user = next(iter(node.users))
            if user.target in VIEWS and _rank_of(user) == 3 and len(user.users) == 1:
                matmul = next(iter(user.users))
                if matmul.target is aten.bmm.default and matmul.args[0] is user:
                    output = matmul
                break
            if not _region_op_ok(user, 4):
                break
            node = user
        if query is None or key is None or output is None or len(scores.users) != 1:
            continue
        value = _unfolded(output.args[1])
        if value is None or _shape(query)[:2] != _shape(key)[:2] or _shape(value)[:2] != _shape(query)[:2]:
            continue
        heads = _shape(query)[1]
        graph = gm.graph
        with graph.inserting_before(view):
            transposed = graph.call_function(aten.transpose.int, (key, -2, -1))
            unfolded = graph.call_function(aten.matmul.default, (query, transposed))
            if scores.target is aten.baddbmm.default:
                if _rank_of(scores.args[0]) != 3 or _shape(scores.args[0])[0] != _shape(scores)[0]:
                    graph.erase_node(unfolded)
                    graph.erase_node(transposed)
                    continue  # a bias broadcast over the folded batch: leave this one alone
                beta, alpha = scores.kwargs.get("beta", 1), scores.kwargs.get("alpha", 1)
                bias = graph.call_function(aten.unflatten.int, (scores.args[0], 0, [-1, heads]))
                unfolded = graph.call_function(aten.add.Tensor, (
                    graph.call_function(aten.mul.Tensor, (bias, beta)),
                    graph.call_function(aten.mul.Tensor, (unfolded, alpha))))
        view.replace_all_uses_with(unfolded)
        probabilities = output.args[0].args[0]  # the 4-D value the [B*H, S, S] view was taken of
        with graph.inserting_before(output):
            context = graph.call_function(aten.matmul.default, (probabilities, value))
            folded = graph.call_function(aten.flatten.using_ints, (context, 0, 1))
        for new in (transposed, context, folded):
            new.meta.update({k: v for k, v in view.meta.items() if k in ("stack_trace", "nn_module_stack")})
        output.replace_all_uses_with(folded)
        rewritten += 1
    if rewritten:
        graph.eliminate_dead_code()
        gm.recompile()
    return rewritten


def unfold_head_attention_pass(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    """Put folded-heads attention on 4-D operands, so that find_attention_pass sees it."""
    if unfold_head_attention(gm):
        _propagate_fake_values(gm, ctx)
    return gm
