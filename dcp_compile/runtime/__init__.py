"""``dcp.runtime``: what a training loop calls around the compiled model.

The common calls are at the top level (``dcp.sync_gradients``, ``dcp.shard_model``,
``dcp.begin_step``, ``dcp.pack_sequences``); the rest is here: :func:`create_sp_groups` (build
the SP process groups ahead of the first step), :func:`idle_round` (an FSDP2 rank with no
micro-batch this round), :func:`watch_parameters` (parameters used outside the compiled graphs)
and :class:`PackedBatch` (what ``pack_sequences`` returns). Checkpoints are ``dcp.checkpoint``.

The names load on first use.
"""

from __future__ import annotations

from dcp_compile.lazy_exports import lazy_getattr

# name -> module that defines it (loaded by ``__getattr__`` on first access)
_EXPORTS = {
    "sync_gradients": "dcp_compile.runtime.gradient_sync",
    "shard_model": "dcp_compile.runtime.fsdp",
    "begin_step": "dcp_compile.runtime.fsdp",
    "idle_round": "dcp_compile.runtime.fsdp",
    "watch_parameters": "dcp_compile.runtime.graph_parameters",
    "PackedBatch": "dcp_compile.runtime.packing",
    "pack_sequences": "dcp_compile.runtime.packing",
    "create_sp_groups": "dcp_compile.runtime.process_groups",
}

__all__ = sorted(_EXPORTS)


__getattr__ = lazy_getattr(__name__, _EXPORTS)


def __dir__() -> list[str]:
    return sorted({*__all__, *(name for name in globals() if not name.startswith("_") and name not in ("annotations", "lazy_getattr"))})
