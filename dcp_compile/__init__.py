"""dcp-compile: Data-Centric Parallel training for any PyTorch model, as a torch.compile backend.

    model = torch.compile(model, backend="dcp", dynamic=True)
"""

from __future__ import annotations

import torch._logging._internal as _torch_logging

from dcp_compile.variants import Bucket, Variant, use

try:  # TORCH_LOGS="+dcp_compile" turns on this package's loggers
    _torch_logging.register_log("dcp_compile", "dcp_compile")
except Exception:  # pragma: no cover - logging registration is best effort
    pass

__all__ = ["Bucket", "Variant", "use", "explain"]


def explain(model, *args, **kwargs):
    from dcp_compile.explain import explain as _explain

    return _explain(model, *args, **kwargs)
