"""A write through ``tensor.data`` survives the backend's ATen re-trace.

CogVideoX builds its joint position table with ``table.data[:, text:].copy_(positions)``. Dynamo
spells ``.data`` as ``_get_data_attr``, which the re-trace used to freeze into a fake constant:
the write was lost and the compiled graph held a fake tensor at run time. Single process, no
sharding involved: the capture alone must keep the alias.
"""

from __future__ import annotations

import torch
from torch import nn

from dcp_compile.compiler.graph_capture import detach_data_attributes


class TableFilledThroughData(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(x.shape[1], dtype=x.dtype).unsqueeze(-1).expand(-1, 4)
        table = positions.new_zeros(1, x.shape[1] + 2, 4)
        table.data[:, 2:].copy_(positions)
        return self.proj(x) + table[:, 2:]


def test_a_write_through_data_reaches_the_compiled_result() -> None:
    torch._dynamo.reset()
    model = TableFilledThroughData()
    x = torch.randn(2, 5, 4)
    compiled = torch.compile(model, backend="dcp", dynamic=True, options={"inner": "eager"})
    torch.testing.assert_close(compiled(x), model(x))
    assert not torch.equal(model(x), model.proj(x)), "the table must matter for this test to mean anything"


def test_get_data_attr_becomes_detach() -> None:
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    data = graph.call_function(torch._C._autograd._get_data_attr, (x,))
    graph.output(data)
    gm = torch.fx.GraphModule(nn.Module(), graph)
    assert detach_data_attributes(gm) == 1
    assert [n.target for n in gm.graph.nodes if n.op == "call_function"] == [torch.ops.aten.detach.default]
