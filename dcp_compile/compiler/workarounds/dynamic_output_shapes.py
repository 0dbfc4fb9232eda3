"""Ops whose output size depends on the data (``nonzero``, ``masked_select``, a boolean index) in
the graphs dcp traces after dynamo.

Dynamo's shape environment refuses such ops unless the user sets
``torch._dynamo.config.capture_dynamic_output_shape_ops``: dynamo then cuts the graph before one
in the model's code, and the forward graph it hands over has none. The backward can still need one
that the forward never ran: ``x[mask] = values`` is an ``index_put`` whose gradient for ``values``
is ``grad[mask]``, a ``nonzero`` (GLM-Image's ``prior_embedding[prior_token_drop] *= 0.0``). The
joint trace (AOTAutograd, in dynamo's fake mode) then raised ``DynamicOutputShapeException`` for
every inner compiler but ``eager``; plain ``torch.compile`` with ``aot_eager`` or Inductor raises
the same on torch 2.13. The size such an op creates is an unbacked symbol, which AOTAutograd and
Inductor handle (they do when the user sets the flag), so dcp allows these ops while it traces and
compiles its variants, and only then: dynamo's own capture is left as the user configured it.

Covers: AOTAutograd's joint trace on torch 2.13.0 raising ``DynamicOutputShapeException`` for a
backward ``nonzero`` the forward never ran, unless ``capture_dynamic_output_shape_ops`` is set
(related upstream report: pytorch/pytorch#114686, an index in a backward pass under ``aot_eager``).
Test: tests/test_data_dependent_shapes.py (slow tier: the masked write raises without it).
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Iterator


@contextlib.contextmanager
def dynamic_output_shapes_allowed(fake_mode: Any) -> Iterator[None]:
    """Within the block, ``fake_mode``'s shape environment gives a data-dependent output size an
    unbacked symbol instead of raising (the setting is part of the fake-tensor cache key)."""
    shape_env = getattr(fake_mode, "shape_env", None)
    if shape_env is None or shape_env.allow_dynamic_output_shape_ops:
        yield
        return
    settings = shape_env.settings
    shape_env.settings = dataclasses.replace(settings, allow_dynamic_output_shape_ops=True)
    try:
        yield
    finally:
        shape_env.settings = settings
