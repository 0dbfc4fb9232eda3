"""Tile a language model's loss: output projection and cross-entropy over chunks of tokens.

Finds, in the variant's ATen graph, the head of a language model::

    hidden -> linear(hidden, weight[, bias]) -> [to(float32)] -> [view / reshape to [tokens, vocab]]
           -> cross_entropy_loss(logits, target, reduction=mean|sum, ignore_index)
              (or nll_loss(log_softmax(logits, -1), target, ...))

and replaces the loss by ``dcp::tiled_cross_entropy`` (:mod:`dcp_compile.kernels.tiled_cross_entropy`):
the loss summed chunk by chunk, divided by the count of counted tokens for a mean. Its backward
recomputes each chunk's logits, so neither pass holds more than one chunk's ``[tokens, vocab]``
logits, and backward keeps the hidden states and the targets instead of the fp32
log-probabilities. That is what Hugging Face's ``ForCausalLMLoss`` (``model.loss_function``:
``logits.float()``, the labels shifted on the full labels, ``view(-1, vocab)``,
``F.cross_entropy(..., ignore_index=-100, reduction="mean"`` or ``"sum"`` with
``num_items_in_batch``)), GPT-2's and TinyGPT's losses look like in the graph.

Where it runs: after ``shard_sequence`` and ``insert_all_to_all``, before ``recompute``. Under
sequence parallelism ``shard_sequence`` has already lowered the loss to a shard-local sum over the
rank's tokens (``reduction=sum`` on the rank's chunk of logits and of the labels, shifted on the
full labels) plus one all-reduce of ``[sum, count]``; this pass replaces only that local sum, so
the loss stays a local sum plus an all-reduce and each rank tiles its own chunk of the sequence.
At SP 1 it replaces the whole ``mean`` (the sum, divided by the count).

When: under every recompute policy but ``none`` (:func:`dcp_compile.tiled_loss.tiles_loss`): it is
the head's recomputation, priced by the cost model; ``none`` keeps the logits.

Default deny: a loss that does not match exactly (class weights, label smoothing, per-token
losses, class dimension not last, logits that are not a plain ``linear`` of the hidden states,
mixed dtypes) is left as it is, with the reason on the variant record
(``VariantRecord.untiled_losses``, printed by ``dcp.explain``). Logits the graph also returns
(Hugging Face returns ``logits`` in its output, and transformers 5.x has no switch to leave them
out: ``logits_to_keep=0`` keeps them all, any other value computes fewer logits, and the loss
from those) are kept for that output: the loss then reads each chunk of them in forward instead
of computing it again, and backward still keeps none of them (the record says so). The returned
logits cost what they cost in eager while the caller holds the output; a training loop that only
reads ``.loss`` drops them before backward.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx

from dcp_compile.compiler import collectives  # noqa: F401  (registers dcp::replicated_input)
from dcp_compile.compiler.graph_capture import splice_traced
from dcp_compile.compiler.passes.context import PassContext
from dcp_compile.compiler.passes.pattern_nodes import argument, traced_value
from dcp_compile.kernels import tiled_cross_entropy as _tiled  # noqa: F401  (registers dcp::tiled_cross_entropy)
from dcp_compile.tiled_loss import LOSS_CHUNK_TOKENS, default_chunk_tokens, tiles_loss

aten = torch.ops.aten
log = logging.getLogger(__name__)
TILED_CROSS_ENTROPY = torch.ops.dcp.tiled_cross_entropy.default

CROSS_ENTROPY = aten.cross_entropy_loss.default
NLL_LOSSES = {aten.nll_loss.default, aten.nll_loss_nd.default}
LOG_SOFTMAX = {aten.log_softmax.int, aten._log_softmax.default}
RESHAPES = {aten.view.default, aten.reshape.default, aten._unsafe_view.default}
CASTS = {aten.to.dtype, aten._to_copy.default, aten.to.dtype_layout}
COPIES = {aten.contiguous.default, aten.clone.default, aten.alias.default}
MEAN, SUM = 1, 2
REPLICATED_INPUT = torch.ops.dcp.replicated_input.default  # shard_sequence's wrap of a differentiable input


@dataclass(frozen=True)
class LossMatch:
    """One loss the pass can tile, and what it is made of."""

    loss: fx.Node  # the loss node it replaces (cross_entropy_loss, or nll_loss of a log_softmax)
    hidden: fx.Node  # the output projection's input, [..., features]
    weight: fx.Node  # [vocab, features]
    bias: fx.Node | None
    target: fx.Node  # [tokens] class indices
    projection: fx.Node  # the linear node: the logits in the model's dtype
    chain: tuple[fx.Node, ...]  # from the projection to the loss's input (casts, views, a log_softmax)
    reduction: int
    ignore_index: int
    upcast: bool  # the logits are converted to fp32 before the loss (``logits.float()``)

    @property
    def logits_read_elsewhere(self) -> list[fx.Node]:
        """Nodes outside the loss that read the logits (or a view or cast of them): a returned
        ``logits`` output, another loss term."""
        inside = set(self.chain) | {self.loss}
        return [user for node in (self.projection, *self.chain) for user in node.users if user not in inside]


class NotTiled(Exception):
    """This loss does not match the pattern exactly (the message says where)."""


def _cast_dtype(node: fx.Node) -> torch.dtype | None:
    if node.target is aten.to.dtype:
        return argument(node, 1, "dtype", None)
    return node.kwargs.get("dtype")


def _same(a: Any, b: Any) -> bool:
    """Two sizes (ints or SymInts) are the same expression."""
    expression = (lambda s: s.node.expr if isinstance(s, torch.SymInt) else s)
    try:
        return bool(expression(a) == expression(b))
    except TypeError:
        return False


def match_loss(loss: fx.Node) -> LossMatch:
    """The loss as a :class:`LossMatch`, or :class:`NotTiled` with the first mismatch."""
    if loss.target is CROSS_ENTROPY:
        logits = loss.args[0]
        weight = argument(loss, 2, "weight", None)
        reduction = argument(loss, 3, "reduction", MEAN)
        ignore_index = argument(loss, 4, "ignore_index", -100)
        if argument(loss, 5, "label_smoothing", 0.0) != 0.0:
            raise NotTiled("label smoothing")
        chain: list[fx.Node] = []
    elif loss.target in NLL_LOSSES:
        log_probabilities = loss.args[0]
        weight = argument(loss, 2, "weight", None)
        reduction = argument(loss, 3, "reduction", MEAN)
        ignore_index = argument(loss, 4, "ignore_index", -100)
        if not (isinstance(log_probabilities, fx.Node) and log_probabilities.target in LOG_SOFTMAX):
            raise NotTiled("nll_loss of something other than a log_softmax")
        values = traced_value(log_probabilities)
        dim = log_probabilities.args[1]
        if values is None or dim % values.dim() != values.dim() - 1:
            raise NotTiled("log_softmax over a dimension other than the last")
        if len(log_probabilities.users) != 1:
            raise NotTiled("the log-probabilities are read elsewhere too")
        logits = log_probabilities.args[0]
        chain = [log_probabilities]
    else:
        raise NotTiled(f"{loss.target} is not a cross-entropy")
    if weight is not None:
        raise NotTiled("class weights")
    if reduction not in (MEAN, SUM):
        raise NotTiled("per-token losses (reduction='none'): nothing is summed over the tokens")
    target = loss.args[1]
    logits_value, target_value = traced_value(logits), traced_value(target)
    if not isinstance(logits_value, torch.Tensor) or not isinstance(target_value, torch.Tensor):
        raise NotTiled("inputs without traced values")
    if logits_value.dim() != 2 or target_value.dim() != 1:
        raise NotTiled(f"logits of {logits_value.dim()} dimensions (the class dimension must be the last of 2)")
    if target_value.dtype not in (torch.int64, torch.int32):
        raise NotTiled("targets that are not class indices (probabilities)")
    upcast = loss.target in NLL_LOSSES and argument(chain[0], 2, "dtype", None) == torch.float32
    vocab = logits_value.shape[-1]
    node = logits
    while isinstance(node, fx.Node) and node.target in RESHAPES | CASTS | COPIES:
        value = traced_value(node)
        if value is None or not _same(value.shape[-1], vocab):
            raise NotTiled(f"{node.name} changes the class dimension")
        if node.target in CASTS:
            dtype = _cast_dtype(node)
            if dtype != torch.float32 or any(key in node.kwargs for key in ("memory_format",)):
                raise NotTiled(f"{node.name} casts the logits to {dtype}, not to float32")
            upcast = True
        chain.insert(0, node)
        node = node.args[0]
    source = node
    while isinstance(source, fx.Node) and source.target is REPLICATED_INPUT:  # a graph input at SP > 1
        source = source.args[0]
    if isinstance(source, fx.Node) and source.op == "placeholder":
        raise NotTiled(f"the logits are an input of this graph ({source.name}): the output projection ran in an "
                       "earlier graph (a graph break between the head and the loss)")
    if not (isinstance(node, fx.Node) and node.target is aten.linear.default):
        raise NotTiled("the logits are not a linear output projection of the hidden states "
                       f"({node.target if isinstance(node, fx.Node) else node})")
    projection = node
    hidden, weight_node = projection.args[:2]
    bias = argument(projection, 2, "bias", None)
    hidden_value, weight_value = traced_value(hidden), traced_value(weight_node)
    if not isinstance(hidden_value, torch.Tensor) or not isinstance(weight_value, torch.Tensor):
        raise NotTiled("a projection without traced values")
    if weight_value.dim() != 2 or not _same(weight_value.shape[0], vocab):
        raise NotTiled("a projection whose weight is not [vocab, features]")
    dtypes = {hidden_value.dtype, weight_value.dtype} | ({traced_value(bias).dtype} if bias is not None else set())
    if len(dtypes) != 1:
        raise NotTiled(f"a projection over mixed dtypes {sorted(map(str, dtypes))}")
    if not upcast and logits_value.dtype != weight_value.dtype:
        raise NotTiled(f"logits in {logits_value.dtype} from a {weight_value.dtype} projection")
    return LossMatch(loss=loss, hidden=hidden, weight=weight_node, bias=bias, target=target, projection=projection,
                     chain=tuple(chain), reduction=int(reduction), ignore_index=int(ignore_index), upcast=bool(upcast))


def find_losses(gm: fx.GraphModule) -> tuple[list[LossMatch], list[tuple[str, str]]]:
    """The graph's cross-entropy losses: those that match exactly, and ``(node, why not)`` for the others."""
    matches: list[LossMatch] = []
    refused: list[tuple[str, str]] = []
    for node in gm.graph.nodes:
        if node.op != "call_function" or not (node.target is CROSS_ENTROPY or node.target in NLL_LOSSES):
            continue
        try:
            matches.append(match_loss(node))
        except NotTiled as why:
            refused.append((node.name, str(why)))
    return matches, refused


def _default_chunk(match: LossMatch) -> int:
    """:func:`dcp_compile.tiled_loss.default_chunk_tokens` for this loss's vocabulary and dtype."""
    weight = match.weight.meta.get("val")
    if weight is None:
        return LOSS_CHUNK_TOKENS
    return default_chunk_tokens(int(weight.shape[0]), weight.element_size(), match.upcast)


def _tiled_loss_function(match: LossMatch, chunk: int, reads_logits: bool):
    """``function(hidden, weight, [bias], target, [logits])``: the loss, tiled, as the graph computed it."""
    def tiled(hidden: torch.Tensor, weight: torch.Tensor, *rest: torch.Tensor) -> torch.Tensor:
        rest = list(rest)
        bias = rest.pop(0) if match.bias is not None else None
        target = rest.pop(0)
        logits = rest.pop(0).reshape(-1, weight.shape[0]) if reads_logits else None
        total = TILED_CROSS_ENTROPY(hidden.reshape(-1, hidden.shape[-1]), weight, bias, target, logits,
                                    match.ignore_index, chunk, match.upcast)
        if match.reduction == SUM:
            return total
        return total / (target != match.ignore_index).sum()

    return tiled


def _erase_unused(gm: fx.GraphModule, nodes: list[fx.Node]) -> None:
    for node in reversed(nodes):
        if not node.users:
            gm.graph.erase_node(node)


def tile_loss_pass(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    matches, refused = find_losses(gm)
    record = ctx.variant_record
    if record is not None:
        record.untiled_losses.extend(refused)
    for name, why in refused:
        log.info("dcp: loss %s not tiled: %s", name, why)
    if not matches:
        return gm
    if not tiles_loss(ctx.recompute):
        if record is not None:
            record.untiled_losses.extend(
                (match.loss.name, "recompute=none keeps the logits (the fastest policy; every other policy "
                 "tiles the loss)") for match in matches)
        return gm
    for match in matches:
        chunk = ctx.loss_chunk or _default_chunk(match)
        elsewhere = match.logits_read_elsewhere
        inputs = [match.hidden, match.weight] + ([match.bias] if match.bias is not None else []) + [match.target]
        if elsewhere:
            inputs.append(match.projection)
        splice_traced(gm, match.loss, _tiled_loss_function(match, chunk, bool(elsewhere)), inputs, ctx.fake_mode)
        _erase_unused(gm, [match.projection, *match.chain])
        note = f"{match.loss.name}: output projection and cross-entropy tiled over {chunk}-token chunks"
        if elsewhere:
            readers = ", ".join("the graph's output" if user.op == "output" else user.name for user in elsewhere)
            note += (f"; the logits are also read by {readers}: built whole in forward for that (as in eager), "
                     "read chunk by chunk by the loss, and not kept for backward")
        if record is not None:
            record.tiled_losses.append(note)
        log.info("dcp: %s", note)
    gm.graph.lint()
    gm.recompile()
    return gm


__all__ = ["LossMatch", "NotTiled", "TILED_CROSS_ENTROPY", "find_losses", "match_loss", "tile_loss_pass"]
