"""Tile a transformer's MLPs: their ``ffn``-wide tensors computed over chunks of tokens (``recompute=lean``).

Finds, in the variant's ATen graph, the MLPs::

    plain:  linear(x, W_up[, b_up]) -> act -> linear(., W_down[, b_down])
    gated:  linear(x, W_gate[, b]) -> act -> mul(., linear(x, W_up[, b])) -> linear(., W_down[, b])
            (the product's operands in either order)

with ``act`` one of ``aten.silu``, ``aten.gelu`` (``approximate`` none or tanh), ``aten.relu``:
TinyGPT's and DiT's ``Sequential(Linear, GELU, Linear)``, Llama's
``down_proj(act_fn(gate_proj(x)) * up_proj(x))``. Each becomes one ``dcp::tiled_mlp``
(:mod:`dcp_compile.kernels.tiled_mlp`), whose forward and backward hold one chunk's ``ffn``-wide
tensors at a time (:func:`dcp_compile.tiled_mlp.mlp_chunk_bytes`, the price the cost model puts
on ``lean``).

Where it runs: after ``shard_sequence`` (each rank tiles its own share of the tokens) and
``tile_loss``, before ``recompute`` (the op takes the down projection's module stack, so it falls
in its block's recompute region). When: only under ``lean`` (:func:`dcp_compile.variant.tiles_mlp`).

Default deny: anything that is not exactly the pattern is left as it is, with the reason on the
variant record (``VariantRecord.untiled_mlps``, printed by ``dcp.explain``) and in the log:
an intermediate read elsewhere too (adaLN's ``silu(c)`` feeds several projections), an MLP over
something other than the attended sequence (a timestep embedding's ``[batch, features]``: tiling
gains nothing there), mixed dtypes (autocast's casts are not part of the pattern). What is
reported is every activation of a ``linear`` the pass looked at; activations of other values are
not MLPs and are not listed.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import sympy
import torch
import torch.fx as fx

from dcp_compile.compiler.graph_capture import splice_traced
from dcp_compile.compiler.passes.context import PassContext
from dcp_compile.compiler.passes.pattern_nodes import argument, traced_value
from dcp_compile.compiler.passes.sequence_dims import expression
from dcp_compile.compiler.sequence_chunks import chunk_length
from dcp_compile.kernels import tiled_mlp as _tiled  # noqa: F401  (registers dcp::tiled_mlp)
from dcp_compile.tiled_mlp import default_mlp_chunk_tokens
from dcp_compile.variant import tiles_mlp

aten = torch.ops.aten
log = logging.getLogger(__name__)
TILED_MLP = torch.ops.dcp.tiled_mlp.default
LINEAR = aten.linear.default
MUL = aten.mul.Tensor
ACTIVATION_TARGETS = {aten.silu.default, aten.gelu.default, aten.relu.default}


@dataclass(frozen=True)
class MLPMatch:
    """One MLP the pass can tile, and what it is made of."""

    down: fx.Node  # the down projection: the node the op replaces
    activation_node: fx.Node
    up: fx.Node  # linear(x, W_up): the activation's input in a plain MLP
    gate: fx.Node | None  # linear(x, W_gate): the activation's input in a gated one
    product: fx.Node | None  # mul(act(gate), up)
    x: fx.Node
    activation: str  # the kernel's name for it: silu, gelu, gelu_tanh, relu

    @property
    def gated(self) -> bool:
        return self.gate is not None

    @property
    def intermediates(self) -> list[fx.Node]:
        """What the op makes unused, in graph order."""
        return [node for node in (self.gate, self.up, self.activation_node, self.product) if node is not None]

    def weights(self) -> list[Any]:
        """``up_weight, up_bias, gate_weight, gate_bias, down_weight, down_bias`` (None where absent)."""
        def parts(linear: fx.Node | None) -> list[Any]:
            if linear is None:
                return [None, None]
            return [linear.args[1], argument(linear, 2, "bias", None)]
        return parts(self.up) + parts(self.gate) + parts(self.down)


class NotTiled(Exception):
    """This MLP does not match the pattern exactly (the message says where)."""


def _is_linear(node: Any) -> bool:
    return isinstance(node, fx.Node) and node.op == "call_function" and node.target is LINEAR


def _activation_name(node: fx.Node) -> str:
    if node.target is aten.silu.default:
        return "silu"
    if node.target is aten.relu.default:
        return "relu"
    approximate = argument(node, 1, "approximate", "none")
    if approximate == "none":
        return "gelu"
    if approximate == "tanh":
        return "gelu_tanh"
    raise NotTiled(f"gelu with approximate={approximate!r}")


def module_path(node: fx.Node) -> str:
    """The innermost module that made ``node`` (``L['self'].layers[0].mlp.down_proj``), or its name."""
    stack = node.meta.get("nn_module_stack") or {}
    paths = [str(path) for path, _ in stack.values()]
    return paths[-1] if paths else node.name


def _only_user(node: fx.Node, role: str) -> fx.Node:
    if len(node.users) != 1:
        readers = ", ".join("the graph's output" if user.op == "output" else user.name for user in node.users)
        raise NotTiled(f"the {role} ({node.name}) is read elsewhere too ({readers})")
    return next(iter(node.users))


def match_mlp(activation_node: fx.Node) -> MLPMatch:
    """The MLP around ``activation_node`` (an activation of a ``linear``) as an :class:`MLPMatch`,
    or :class:`NotTiled` with the first mismatch."""
    first = activation_node.args[0]
    activation = _activation_name(activation_node)
    if not _is_linear(first):
        raise NotTiled(f"the activation's input is {getattr(first, 'target', first)}, not a linear")
    x = first.args[0]
    user = _only_user(activation_node, "activation")
    gate = product = None
    if _is_linear(user) and user.args[0] is activation_node:
        up, down = first, user
    elif user.op == "call_function" and user.target is MUL and len(user.args) == 2 and not user.kwargs:
        other = user.args[1] if user.args[0] is activation_node else user.args[0]
        if other is activation_node or not _is_linear(other):
            raise NotTiled(f"the activation is multiplied ({user.name}) by {getattr(other, 'target', other)}, "
                           "not by a linear projection")
        if other.args[0] is not x:
            raise NotTiled(f"the gate ({first.name}) and up ({other.name}) projections read different inputs")
        gate, up, product = first, other, user
        down = _only_user(product, "gated product")
        if not (_is_linear(down) and down.args[0] is product):
            raise NotTiled(f"the gated product ({product.name}) goes to {getattr(down, 'target', down)}, "
                           "not to a down projection")
    else:
        raise NotTiled(f"the activation goes to {getattr(user, 'target', user)}: neither a down projection "
                       "nor a product with another projection of the same input")
    match = MLPMatch(down=down, activation_node=activation_node, up=up, gate=gate, product=product, x=x,
                     activation=activation)
    for node in ([gate, up] if gate is not None else [up]):
        _only_user(node, "gate projection" if node is gate else "up projection")
    _check_shapes(match)
    return match


def _check_shapes(match: MLPMatch) -> None:
    """The projections' values agree with an MLP (2-D weights, ``x`` ``[..., features]``), all of
    one dtype."""
    values = {"x": traced_value(match.x)}
    for name, node in zip(("up weight", "up bias", "gate weight", "gate bias", "down weight", "down bias"),
                          match.weights()):
        if node is not None:
            values[name] = traced_value(node)
    if not all(isinstance(value, torch.Tensor) for value in values.values()):
        raise NotTiled("inputs without traced values")
    up, down = values["up weight"], values["down weight"]
    if up.dim() != 2 or down.dim() != 2 or values["x"].dim() < 2:
        raise NotTiled("projections whose weights are not [out, in] or an input without a token dimension")
    if "gate weight" in values and values["gate weight"].shape != up.shape:
        raise NotTiled("gate and up weights of different shapes")
    dtypes = {value.dtype for value in values.values()}
    if len(dtypes) != 1:
        raise NotTiled(f"an MLP over mixed dtypes {sorted(map(str, dtypes))}")


def _over_tokens(value: torch.Tensor, ctx: PassContext) -> bool | None:
    """Does a dimension of ``value`` (other than its last) hold the attended sequence's tokens: the
    whole length, or this rank's chunk of it? None where the graph has no sequence length."""
    length = getattr(ctx.analysis.sequence, "length", None)
    if length is None:
        return None
    length = sympy.sympify(length)
    sizes = [expression(size) for size in value.shape[:-1]]
    if length.free_symbols:
        return any(size.free_symbols & length.free_symbols for size in sizes)
    tokens = {int(length), int(chunk_length(int(length), max(1, ctx.sp_size), ctx.rank))}
    return any(not size.free_symbols and int(size) in tokens for size in sizes)


def _token_dimension(match: MLPMatch, ctx: PassContext) -> None:
    """:class:`NotTiled` unless the MLP's input is over the attended sequence's tokens
    (:func:`_over_tokens`). An MLP over something else (a timestep embedding) holds no
    sequence-long tensor: tiling it gains nothing."""
    x = traced_value(match.x)
    over = _over_tokens(x, ctx)
    if over is None:
        raise NotTiled("the graph has no attention, so no sequence length to tell the token dimension by")
    if not over:
        length = getattr(ctx.analysis.sequence, "length", None)
        raise NotTiled(f"its input {[expression(size) for size in x.shape]} has no dimension of the "
                       f"sequence (length {length}): not over the tokens")


def _scan(gm: fx.GraphModule, ctx: PassContext | None) -> tuple[list[MLPMatch], list[tuple[fx.Node, str]]]:
    """The graph's MLPs that match exactly, and ``(activation node, why not)`` for every other
    activation of a ``linear``. Without ``ctx`` the token dimension is not checked."""
    matches: list[MLPMatch] = []
    refused: list[tuple[fx.Node, str]] = []
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target not in ACTIVATION_TARGETS or not _is_linear(node.args[0]):
            continue
        try:
            match = match_mlp(node)
            if ctx is not None:
                _token_dimension(match, ctx)
            matches.append(match)
        except NotTiled as why:
            refused.append((node, str(why)))
    return matches, refused


def _where(node: fx.Node) -> str:
    return f"{node.name} ({module_path(node)})"


def find_mlps(gm: fx.GraphModule, ctx: PassContext | None = None) -> tuple[list[MLPMatch], list[tuple[str, str]]]:
    """The graph's MLPs: those that match exactly, and ``(activation node, why not)`` for every
    other activation of a ``linear``. Without ``ctx`` the token dimension is not checked."""
    matches, refused = _scan(gm, ctx)
    return matches, [(_where(node), why) for node, why in refused]


def _chunk(match: MLPMatch, ctx: PassContext) -> int:
    """``options={"mlp_chunk": n}``, else :func:`dcp_compile.tiled_mlp.default_mlp_chunk_tokens` for
    this MLP's width and dtype (what the cost model prices)."""
    if ctx.mlp_chunk:
        return ctx.mlp_chunk
    up = traced_value(match.up.args[1])
    return default_mlp_chunk_tokens(int(up.shape[0]), match.gated, up.element_size())


def _tiled_mlp_function(match: MLPMatch, chunk: int):
    """``function(x, *present weights)``: the MLP as ``dcp::tiled_mlp``."""
    present = [node is not None for node in match.weights()]

    def tiled(x: torch.Tensor, *weights: torch.Tensor) -> torch.Tensor:
        given = iter(weights)
        arguments = [next(given) if here else None for here in present]
        return TILED_MLP(x, *arguments, match.activation, chunk)

    return tiled


def tile_mlp_pass(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    if not tiles_mlp(ctx.recompute):
        return gm
    matches, refused = _scan(gm, ctx)
    record = ctx.variant_record
    if record is not None:
        record.untiled_mlps.extend((_where(node), why) for node, why in refused)
    for node, why in refused:
        if not _over_tokens(traced_value(node), ctx):
            log.info("dcp: MLP at %s not tiled: %s", _where(node), why)
            continue
        # The memory model priced this variant with every MLP over the tokens tiled: a refused one
        # keeps its ffn-wide tensors, so the planner may place more tokens here than fit.
        log.warning("dcp: under recompute=%s the MLP at %s is not tiled (%s): its ffn-wide activations are whole, "
                    "more than the memory model priced; plan with recompute_policies that leave out 'lean', or "
                    "write the MLP as up/gate projections, activation, down projection so the pass finds it",
                    ctx.recompute.value, _where(node), why)
    for match in matches:
        chunk = _chunk(match, ctx)
        ffn = int(traced_value(match.up.args[1]).shape[0])
        inputs = [match.x] + [node for node in match.weights() if node is not None]
        splice_traced(gm, match.down, _tiled_mlp_function(match, chunk), inputs, ctx.fake_mode)
        for node in reversed(match.intermediates):
            if not node.users:
                gm.graph.erase_node(node)
        note = (f"{match.down.name} ({module_path(match.down)}): {'gated ' if match.gated else ''}{match.activation} "
                f"MLP of width {ffn} tiled over {chunk}-token chunks")
        if record is not None:
            record.tiled_mlps.append(note)
        log.info("dcp: %s", note)
    if matches:
        gm.graph.lint()
        gm.recompile()
    return gm


__all__ = ["MLPMatch", "NotTiled", "TILED_MLP", "find_mlps", "match_mlp", "tile_mlp_pass"]
