"""Choose, per call, whether a kernel runs as Triton or as its plain-torch reference.

The rule (read from the environment at *call* time, so tests and users can flip it without
re-importing anything):

* ``DCP_KERNELS`` unset, empty or ``auto``: CUDA tensors run the Triton kernels (when triton is
  installed), everything else runs the torch reference.
* ``DCP_KERNELS=triton``: always Triton. CPU tensors then run under the Triton interpreter
  (see :mod:`.triton_loader`), which is how the kernels are tested without a GPU.
* ``DCP_KERNELS=torch``: always the torch reference.

Triton is an optional dependency: nothing here imports it, we only ask whether it is installed.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
import os
from typing import Literal

import torch

log = logging.getLogger(__name__)

Backend = Literal["triton", "torch"]

ENV_VAR = "DCP_KERNELS"
_CHOICES = ("auto", "triton", "torch")


@functools.cache
def triton_available() -> bool:
    """Whether the ``triton`` package can be imported (checked once, without importing it)."""
    return importlib.util.find_spec("triton") is not None


def requested_backend() -> str:
    """The ``DCP_KERNELS`` setting: ``"auto"``, ``"triton"`` or ``"torch"``."""
    value = os.environ.get(ENV_VAR, "").strip().lower() or "auto"
    if value not in _CHOICES:
        raise ValueError(
            f"{ENV_VAR}={os.environ[ENV_VAR]!r} is not understood; use one of {', '.join(_CHOICES)} "
            "(or leave it unset for auto: Triton on CUDA tensors, torch reference elsewhere)."
        )
    return value


@functools.cache
def _warn_missing_triton_once() -> None:
    log.warning(
        "CUDA tensors but triton is not installed: dcp kernels fall back to the slower torch "
        "reference. Install the optional dependency (pip install 'dcp-compile[triton]')."
    )


def kernel_backend(tensor: torch.Tensor) -> Backend:
    """Which implementation a dcp kernel called on ``tensor`` will use right now."""
    requested = requested_backend()
    if requested == "torch":
        return "torch"
    if requested == "triton":
        if not triton_available():
            raise RuntimeError(
                f"{ENV_VAR}=triton but triton is not installed; install it "
                "(pip install 'dcp-compile[triton]') or unset the variable."
            )
        return "triton"
    if tensor.device.type == "cuda":
        if triton_available():
            return "triton"
        _warn_missing_triton_once()
    return "torch"
