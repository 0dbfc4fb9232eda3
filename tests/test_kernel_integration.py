"""The Ulysses pass with the fused Triton layout kernels (forced on CPU under the interpreter)."""

from __future__ import annotations

import pytest

pytest.importorskip("triton", reason="the layout kernels need triton (`pip install .[test]`)")

from dcp_compile.testing.process_world import run_in_process_world  # noqa: E402
from parity import parity_worker  # noqa: E402

TRITON_ON_CPU = {"DCP_KERNELS": "triton", "TRITON_INTERPRET": "1"}


@pytest.mark.slow
def test_compiled_model_with_layout_kernels_at_parity():
    # GQA exercises the head-index path (2 KV heads replicated per rank); 9 splits unevenly.
    results = run_in_process_world(parity_worker, 2, ["gpt", "gqa"], [9], "aot_eager", timeout=1500, env=TRITON_ON_CPU)
    assert all(result["checked"] == 2 for result in results)


def test_ulysses_pass_emits_layout_kernels(monkeypatch):
    import torch
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    import dcp_compile as dcp
    from model_zoo import ZOO

    monkeypatch.setenv("DCP_KERNELS", "triton")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    torch._dynamo.reset()
    try:
        case = ZOO["gpt"]
        compiled = torch.compile(case.build(), backend="dcp", dynamic=True, options={"sp_size": 2, "inner": "eager"})
        (variant,) = dcp.explain(compiled, **case.make_inputs(12))[0].variants.values()
        (lowering,) = [p for p in variant.passes if p.name == "insert_all_to_all_pass"]
        assert lowering.after.count("dcp.pack_for_heads") == 6  # q, k, v of two attentions
        assert lowering.after.count("dcp.pack_for_sequence") == lowering.after.count("dcp.unpack_from_heads") == 2
    finally:
        dist.destroy_process_group()
        torch._dynamo.reset()
