"""Triton kernels behind ``torch.library`` custom ops (``dcp::*``), with plain-torch references.

Public API:

* :func:`pack_for_heads`, :func:`pack_for_sequence`, :func:`unpack_from_heads`: the fused layouts
  around the Ulysses all-to-all.
* :func:`varlen_attention`: padding-free flash attention over packed sequences (``cu_seqlens``).
* :func:`kernel_backend`: ``"triton"`` or ``"torch"``, what a call on a given tensor would use now.

CUDA tensors run Triton, CPU tensors the torch reference; ``DCP_KERNELS=triton|torch`` overrides
(read at call time). Importing this package does not import triton.
"""

from .dispatch import kernel_backend
from .ulysses_layout import pack_for_heads, pack_for_sequence, unpack_from_heads
from .varlen_attention import varlen_attention

__all__ = [
    "kernel_backend",
    "pack_for_heads",
    "pack_for_sequence",
    "unpack_from_heads",
    "varlen_attention",
]
