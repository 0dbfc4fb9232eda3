"""Compile caches shared across variants never hand one variant another's compiled code.

The recompute policy is a tag in the graph's node meta, which AOTAutograd's cache key does not see:
dcp bypasses that cache for tagged graphs (Inductor's FX graph cache, keyed by the partitioned
graphs, stays on).
"""

from __future__ import annotations

import pytest
import torch
import torch.fx as fx
from torch._functorch import config as functorch_config
from torch.utils.checkpoint import CheckpointPolicy

import dcp_compile as dcp
from dcp_compile.compiler.inner_compilers import autograd_cache_off_if_tagged
from tests.test_progress import _Attention


def _graph() -> fx.GraphModule:
    return fx.symbolic_trace(lambda x: (x.sin() * 2).sum())


def test_aot_autograd_cache_is_bypassed_only_for_graphs_with_recompute_tags():
    gm = _graph()
    with autograd_cache_off_if_tagged(gm):
        assert functorch_config.enable_autograd_cache  # nothing tagged: the cache keys it right
    next(n for n in gm.graph.nodes if n.op == "call_method").meta["recompute"] = CheckpointPolicy.PREFER_RECOMPUTE
    with autograd_cache_off_if_tagged(gm):
        assert not functorch_config.enable_autograd_cache
    assert functorch_config.enable_autograd_cache  # restored


@pytest.mark.slow
def test_a_recompute_variant_compiled_after_its_sp_twin_recomputes(fake_world):
    """recompute=full at SP 2 after recompute=none at SP 2 (the same graph code, other tags) is
    compiled, not served from the cache: it saves less for backward, and its graphs are recorded."""
    # compiled whole: the AOTAutograd cache keys whole variants (regions compile apart from it)
    compiled = torch.compile(_Attention(), backend="dcp", dynamic=True, options={"inner": "inductor", "regions": False})
    saved = {}
    for variant in (dcp.Variant(2, "none"), dcp.Variant(2, "full")):
        with dcp.use(variant):
            record = dcp.explain(compiled, torch.randn(2, 12, 8))[0].variants[variant]
        assert record.forward_graph is not None and record.backward_graph is not None, variant
        saved[variant.recompute] = record.saved_activation_bytes
    assert saved["full"] < saved["none"], saved
