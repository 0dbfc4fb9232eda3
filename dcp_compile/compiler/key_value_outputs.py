"""Warn once when a compiled graph returns its attention's keys and values (a K/V cache).

Hugging Face decoders default to ``use_cache=True``: every forward returns each layer's keys and
values in a cache object. Training never reads that cache, but under sequence parallelism the
graph's outputs are returned full on every rank, so each SP>1 call gathers every layer's K and V
to the whole sequence (two extra collectives per layer) and keeps them alive with the outputs.
The result is still correct, which is why this is a warning and not an error; the fix is one flag
(``use_cache=False``), so the warning names it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.fx as fx

log = logging.getLogger(__name__)
aten = torch.ops.aten

# Ops that move or copy a tensor without computing on it: the walk from an attention's key or value
# back to the tensor a cache stores (after RoPE, before GQA's repeat_kv, which is expand + reshape).
_LAYOUT_OPS = {
    aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.expand.default,
    aten.permute.default, aten.transpose.int, aten.t.default, aten.unsqueeze.default, aten.squeeze.dim,
    aten.squeeze.default, aten.clone.default, aten.contiguous.default, aten.alias.default,
    aten.slice.Tensor, aten.select.int, aten._to_copy.default, aten.detach.default,
}

_warned = False


@dataclass(frozen=True)
class ReturnedKeyValues:
    """The graph outputs that are some attention's keys or values, by output position."""

    graph_id: int
    positions: tuple[int, ...]


def find_returned_key_values(gm: fx.GraphModule, attention_sites: list, graph_id: int) -> ReturnedKeyValues | None:
    """The outputs of ``gm`` that reach an attention's key or value through layout ops only.

    ``attention_sites`` are :class:`~dcp_compile.compiler.passes.find_attention.AttentionSite`
    records (anything with ``key`` and ``value`` nodes). A hidden state reaches the keys through a
    projection, which is not a layout op, so only the cached tensors themselves match.
    """
    cached: set[fx.Node] = set()
    for site in attention_sites:
        frontier = [site.key, site.value]
        while frontier:
            node = frontier.pop()
            if not isinstance(node, fx.Node) or node in cached:
                continue
            cached.add(node)
            if node.op == "call_function" and node.target in _LAYOUT_OPS and node.args:
                frontier.append(node.args[0])
    output = next(iter(gm.graph.find_nodes(op="output")))
    values = fx.node.map_arg(output.args[0], lambda n: n)
    flat = values if isinstance(values, (list, tuple)) else [values]
    positions = tuple(i for i, value in enumerate(flat) if isinstance(value, fx.Node) and value in cached)
    return ReturnedKeyValues(graph_id, positions) if positions else None


def warn_once_if_key_values_returned(found: ReturnedKeyValues | None, sp_size: int) -> bool:
    """Log one warning per process when an SP>1 variant returns K/V; True when it warned now."""
    global _warned
    if _warned or sp_size <= 1 or found is None:
        return False
    _warned = True
    log.warning(
        "dcp: graph %d returns %d attention key/value tensors (a K/V cache, e.g. Hugging Face's default "
        "use_cache=True): at SP %d every call gathers them to the full sequence on every rank and keeps them "
        "alive; training needs no cache: set use_cache=False (model.config.use_cache = False, or pass "
        "use_cache=False to the forward)", found.graph_id, len(found.positions), sp_size,
    )
    return True
