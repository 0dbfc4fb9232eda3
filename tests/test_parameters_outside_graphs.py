"""Parameters that a graph break leaves in eager code get their full gradient on every rank of an
SP group: ``dcp.sync_gradients`` refuses to sum them (P-times the right value) and ``dcp.check``
names them. Two real gloo ranks."""

from __future__ import annotations

import torch
from torch import nn

from dcp_compile.testing.process_world import run_in_process_world


class AttentionThenEagerHead(nn.Module):
    """Attention compiled by dcp; the head runs eagerly (``torch.compiler.disable``), as code after
    a graph break inside a loop does in real models (diffusers' HunyuanVideo 1.5)."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(8, 24)
        self.head = nn.Linear(8, 8)

    @torch.compiler.disable
    def eager_head(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = (t.unflatten(-1, (2, 4)).transpose(1, 2) for t in self.qkv(x).chunk(3, dim=-1))
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v).transpose(1, 2).flatten(2)
        return self.eager_head(out)


def _worker(rank: int, world_size: int) -> dict:
    import dcp_compile as dcp
    from dcp_compile.runtime.graph_parameters import ParametersOutsideGraphs

    torch.manual_seed(0)
    model = AttentionThenEagerHead()
    compiled = torch.compile(model, backend="dcp", dynamic=True, options={"inner": "eager", "sp_size": world_size})
    x = torch.randn(2, 9, 8)
    report = dcp.check(compiled, x, raise_on_mismatch=False)
    model.zero_grad()
    compiled(x).pow(2).mean().backward()
    try:
        dcp.sync_gradients(model)
    except ParametersOutsideGraphs as error:
        refused = str(error)
    else:
        refused = ""
    sharded = all(v.is_sharded for v in report.record.variant_records() if v.sp_size > 1)
    return {"refused": refused, "check": str(report), "sharded": sharded}


def test_sync_refuses_and_check_names_parameters_left_in_eager_code():
    for result in run_in_process_world(_worker, 2, timeout=300):
        assert "head.weight" in result["refused"] and "head.bias" in result["refused"], result["refused"]
        assert "qkv" not in result["refused"]
        assert "gradient of head.weight: computed in eager code" in result["check"], result["check"]
        assert result["sharded"], result["check"]
