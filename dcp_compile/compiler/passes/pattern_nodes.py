"""Reading an ATen node's arguments and traced value, for the passes that match op patterns
(``tile_loss``, ``tile_mlp``): an argument may be positional or a keyword, and a value may be a
node or a constant."""

from __future__ import annotations

from typing import Any

import torch.fx as fx


def argument(node: fx.Node, index: int, name: str, default: Any) -> Any:
    """``node``'s argument at ``index`` or named ``name``, else ``default``."""
    if len(node.args) > index:
        return node.args[index]
    return node.kwargs.get(name, default)


def traced_value(node: Any) -> Any:
    """The fake value traced for ``node`` (``None`` for a constant or an untraced node)."""
    return node.meta.get("val") if isinstance(node, fx.Node) else None
