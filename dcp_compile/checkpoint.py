"""``dcp.checkpoint``: save and resume a DCP training run mid-epoch (docs/training.md, "Checkpoints").

:func:`save_checkpoint` writes the model, the optimizer and the sampler's position (the resumed run
trains exactly the samples not yet seen); :func:`load_checkpoint` reads one back;
:func:`latest_checkpoint` finds the newest complete one in a directory, :func:`checkpoint_path` names
the one of a step, and :class:`CheckpointInfo` is what ``load_checkpoint`` returns.

The names load on first use (from ``dcp_compile.runtime.checkpoints``).
"""

from __future__ import annotations

import importlib

_MODULE = "dcp_compile.runtime.checkpoints"
__all__ = sorted(["save_checkpoint", "load_checkpoint", "latest_checkpoint", "checkpoint_path", "CheckpointInfo"])


def __getattr__(name: str):
    if name in __all__:
        value = getattr(importlib.import_module(_MODULE), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'dcp_compile.checkpoint' has no attribute {name!r}")


def __dir__() -> list[str]:
    return list(__all__)
