"""Run every test in this folder on the Triton kernels, interpreted on CPU.

``DCP_KERNELS=triton`` forces the Triton path for CPU tensors, and ``TRITON_INTERPRET=1`` is set
when there is no GPU. Both are set per test with ``monkeypatch`` so they never leak into the rest
of the suite (which must keep the default dispatch). That is enough because the kernels are built
by ``dcp_compile.kernels.triton_loader``, which builds an interpreted copy for CPU tensors
whatever ``TRITON_INTERPRET`` said when triton was imported, and the kernels call only Triton
builtins (not library ``@jit`` functions, whose mode is fixed at ``import triton``).

On a GPU machine ``TRITON_INTERPRET`` stays unset, so CUDA tensors run the compiled kernels while
CPU cases still run interpreted.
"""

from __future__ import annotations

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()

DEVICES = ["cpu"] + (["cuda"] if HAS_CUDA else [])


@pytest.fixture(autouse=True)
def triton_kernels_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DCP_KERNELS", "triton")
    if not HAS_CUDA:
        monkeypatch.setenv("TRITON_INTERPRET", "1")


@pytest.fixture(params=DEVICES)
def device(request: pytest.FixtureRequest) -> torch.device:
    return torch.device(request.param)
