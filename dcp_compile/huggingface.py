"""``dcp.huggingface``: what a Hugging Face user imports (``from dcp_compile.huggingface import ...``).

* Training through ``transformers.Trainer``: :class:`DataCentricTrainer` with
  :class:`DataCentricArguments` (:mod:`dcp_compile.runtime.trainer`; imports transformers'
  Trainer, so it is loaded on first use).
* Packed micro-batches: :func:`use_packed_attention` (:mod:`dcp_compile.runtime.huggingface`).
"""

from __future__ import annotations

from typing import Any

from dcp_compile.runtime.huggingface import (  # noqa: F401  (re-exported)
    ATTENTION_IMPLEMENTATION,
    dcp_attention_forward,
    register,
    use_packed_attention,
)

_TRAINER_EXPORTS = ("DataCentricTrainer", "DataCentricArguments", "SAMPLER_STATE_NAME")

__all__ = ["ATTENTION_IMPLEMENTATION", "dcp_attention_forward", "register", "use_packed_attention", *_TRAINER_EXPORTS]


def __getattr__(name: str) -> Any:
    if name in _TRAINER_EXPORTS:
        from dcp_compile.runtime import trainer

        return getattr(trainer, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
