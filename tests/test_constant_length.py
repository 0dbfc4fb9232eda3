"""A constant attention length that another size equals (``passes/sequence_hints``).

Compiled without ``dynamic=True`` (or where a model pads its tokens to a constant, as Z-Image
pads to a multiple of 32), the attention length is a number, and the analysis finds tokens by
size: at 32 tokens in a model 32 wide every activation ``[B, 32, 32]`` shows the length twice,
every weight ``[32, 32]`` once. Without the attention's own reading of its tokens (dimension -2
of q, k, v, followed back through views and linears), the block gathered before its output
projection ("creates a second sequence dimension") and weighed a modulation vector as tokens.
Parity on two gloo ranks and the sharding (every site, no gather) at a length equal to the width,
and at one that is not, for comparison.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dcp_compile.testing.process_world import run_in_process_world

WIDTH = 32


class ModulatedBlock(nn.Module):
    """A DiT-style block: RMS-normalised tokens scaled by a per-sample modulation computed from
    a conditioning vector as wide as the model (Z-Image's ``adaLN``), attention, an MLP."""

    def __init__(self, width: int = WIDTH, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.modulation = nn.Linear(width, 2 * width)
        self.qkv = nn.Linear(width, 3 * width)
        self.out = nn.Linear(width, width)
        self.mlp = nn.Sequential(nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width))

    def forward(self, x: torch.Tensor, condition: torch.Tensor) -> torch.Tensor:
        scale, gate = self.modulation(condition).unsqueeze(1).chunk(2, dim=2)
        h = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * (1 + scale)
        b, s, d = h.shape
        q, k, v = self.qkv(h).view(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        attended = F.scaled_dot_product_attention(q, k, v).permute(0, 2, 1, 3).flatten(2, 3)
        x = x + gate.tanh() * self.out(attended)
        return x + self.mlp(x)


def _worker(rank: int, world_size: int, length: int) -> dict:
    import dcp_compile as dcp

    torch.manual_seed(0)
    model = ModulatedBlock()
    generator = torch.Generator().manual_seed(1)
    x, condition = torch.randn(2, length, WIDTH, generator=generator), torch.randn(2, WIDTH, generator=generator)
    expected = model(x, condition)
    expected.square().mean().backward()
    eager_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    compiled = torch.compile(model, backend="dcp", dynamic=False, options={"inner": "eager", "sp_size": world_size})
    record = dcp.explain(compiled, x, condition)
    actual = compiled(x, condition)
    actual.square().mean().backward()
    dcp.sync_gradients(model)
    variants = [v for graph in record.graphs for v in graph.variants.values() if v.sp_size > 1]
    return {
        "output_error": (actual - expected).abs().max().item(),
        "grad_error": max((model.get_parameter(n).grad - g).abs().max().item() for n, g in eager_grads.items()),
        "sharded": [len(v.sharded_sites) for v in variants],
        "gathers": [[str(g) for g in v.gathers] for v in variants],
        "length": [str(graph.sequence_length) for graph in record.graphs],
    }


def _check(length: int) -> None:
    for result in run_in_process_world(_worker, 2, length, timeout=600):
        assert result["length"] == [str(length)], result  # a constant length, as the test intends
        assert result["sharded"] == [1], result
        assert result["gathers"] == [[]], result
        assert result["output_error"] < 1e-5 and result["grad_error"] < 1e-5, result


def test_length_equal_to_the_width_is_sharded_at_parity():
    _check(WIDTH)


@pytest.mark.slow
def test_length_unlike_the_width_is_sharded_at_parity():
    _check(24)
