"""A causal mask the model builds from positions becomes ``is_causal=True``.

Traced by ``torch.compile``, Hugging Face models (and many others) materialise their causal mask
as a ``[B, 1, S, S]`` tensor built from ``arange`` positions (transformers turns its ``is_causal``
shortcut off while tracing). Under sequence parallelism that mask is read in full on every rank
after the all-to-all: O(S^2) memory per layer that a long sequence cannot afford, and a masked SDPA
is slower than a causal one. When the mask is a function of the sizes alone (no tensor input, no
constant tensor) and equals ``tril`` at lengths longer than any integer the mask's ops mention
(a window of 4096 would show at 4099), the mask is dropped and the SDPA gets ``is_causal=True``:
the same attention, exactly, at every length the graph serves. Anything else is left as it is.
"""

from __future__ import annotations

import logging
from typing import Any, Iterable

import sympy
import torch
import torch.fx as fx

from dcp_compile.compiler.passes.context import PassContext
from dcp_compile.compiler.passes.find_attention import SDPA, sdpa_argument

aten = torch.ops.aten
log = logging.getLogger(__name__)
LARGEST_CHECKED_LENGTH = 8192  # masks whose ops mention larger integers are left alone


def _expression(size: Any) -> Any:
    return size.node.expr if isinstance(size, torch.SymInt) else sympy.Integer(int(size))


def _ancestors(node: fx.Node) -> list[fx.Node]:
    seen: set[fx.Node] = set()
    stack = [node]
    while stack:
        current = stack.pop()
        if current in seen:
            continue
        seen.add(current)
        stack.extend(current.all_input_nodes)
    return [n for n in node.graph.nodes if n in seen]  # in graph (topological) order


def _integers(values: Iterable[Any]) -> list[int]:
    found = []
    for value in values:
        if isinstance(value, bool):
            continue
        if isinstance(value, int):
            if abs(value) < 2**62:  # not a slice's "to the end"
                found.append(abs(value))
        elif isinstance(value, (list, tuple)):
            found += _integers(value)
        elif isinstance(value, dict):
            found += _integers(value.values())
    return found


def _symbols(nodes: list[fx.Node]) -> set[sympy.Symbol]:
    symbols: set[sympy.Symbol] = set()
    for node in nodes:
        value = node.meta.get("val")
        sizes = value.shape if isinstance(value, torch.Tensor) else [value] if isinstance(value, torch.SymInt) else []
        for size in sizes:
            symbols |= _expression(size).free_symbols
    return symbols


def _evaluate(nodes: list[fx.Node], assignment: dict[sympy.Symbol, int]) -> Any:
    """Run the mask's ops on concrete sizes: SymInt inputs take their symbol's value."""
    env: dict[fx.Node, Any] = {}
    for node in nodes:
        if node.op == "placeholder":
            env[node] = int(_expression(node.meta["val"]).xreplace(assignment))
            continue
        args = fx.map_arg(node.args, lambda n: env[n])
        kwargs = fx.map_arg(node.kwargs, lambda n: env[n])
        env[node] = node.target(*args, **kwargs)
    return env[nodes[-1]]


def _is_causal_at(nodes: list[fx.Node], length_expression: Any, assignment: dict[sympy.Symbol, int]) -> bool:
    mask = _evaluate(nodes, assignment)
    length = int(length_expression.xreplace(assignment))
    if not isinstance(mask, torch.Tensor) or mask.dim() < 2 or tuple(mask.shape[-2:]) != (length, length):
        return False
    lower = torch.ones(length, length, dtype=torch.bool).tril().expand_as(mask)
    if mask.dtype == torch.bool:
        return torch.equal(mask, lower)
    if not mask.is_floating_point():
        return False
    kept, dropped = mask[lower], mask[~lower]
    return bool((kept == 0).all()) and bool((dropped <= torch.finfo(mask.dtype).min / 2).all())


def causal_mask_of(sdpa: fx.Node) -> fx.Node | None:
    """The SDPA's mask if it is provably causal at every length, else None."""
    mask = sdpa_argument(sdpa, "attn_mask")
    if not isinstance(mask, fx.Node) or sdpa_argument(sdpa, "is_causal"):
        return None
    query, key = sdpa.args[0].meta["val"], sdpa.args[1].meta["val"]
    length = _expression(query.shape[-2])
    if length != _expression(key.shape[-2]) or not length.free_symbols:
        return None
    nodes = _ancestors(mask)
    for node in nodes:
        if node.op == "placeholder" and not isinstance(node.meta.get("val"), torch.SymInt):
            return None  # depends on a tensor input (a padding mask, position ids): data, not sizes
        if node.op not in ("placeholder", "call_function"):
            return None  # a constant tensor (a registered tril buffer): not proved here
    largest = max(_integers(a for n in nodes for a in (*n.args, *n.kwargs.values())) + [0])
    if largest + 3 > LARGEST_CHECKED_LENGTH:
        return None
    lengths = sorted(length.free_symbols, key=str)
    others = sorted(_symbols(nodes) - set(lengths), key=str)  # batch sizes: small
    try:
        for base in (largest + 3, largest + 6):  # two lengths past every integer the ops mention
            assignment = {symbol: base + index for index, symbol in enumerate(lengths)}
            assignment.update({symbol: 2 + index for index, symbol in enumerate(others)})
            if not _is_causal_at(nodes, length, assignment):
                return None
    except Exception as error:  # noqa: BLE001  (an op that does not run on concrete sizes: leave it)
        log.debug("dcp: could not evaluate the mask of %s: %s", sdpa.name, error)
        return None
    return mask


def causal_masks_pass(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    """Replace every provably causal SDPA mask by ``is_causal=True``."""
    replaced = []
    for sdpa in list(gm.graph.find_nodes(op="call_function", target=SDPA)):
        if causal_mask_of(sdpa) is None:
            continue
        query, key, value = sdpa.args[:3]
        sdpa.args = (query, key, value)
        sdpa.kwargs = {"dropout_p": sdpa_argument(sdpa, "dropout_p"), "is_causal": True,
                       "scale": sdpa_argument(sdpa, "scale"), "enable_gqa": sdpa_argument(sdpa, "enable_gqa")}
        replaced.append(sdpa.name)
    if replaced:
        gm.graph.eliminate_dead_code()
        gm.recompile()
        log.info("dcp: causal masks built from positions replaced by is_causal at %s", ", ".join(replaced))
    ctx.analysis.causal_mask_sites = replaced
    return gm
