"""A slice along the sequence that only feeds graph outputs is an output gather, not a gather.

A sliding-window K/V cache returns ``keys[:, :, -window:]`` of every layer: the slice needs the
full keys, but only to hand them back (Gemma 2 with ``use_cache=True``). The backend gathers them
the way it gathers a returned value (outside autograd, no gather in the record) and the gradient
through the returned slice still reaches the right chunks: checked here by a loss that uses the
returned tail, on two gloo ranks against eager.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dcp_compile.testing.process_world import run_in_process_world

WINDOW = 3


class AttentionWithWindowCache(nn.Module):
    def __init__(self, hidden: int = 16, heads: int = 2) -> None:
        super().__init__()
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.heads = heads

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        b, s, d = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, d)
        return out, k[:, :, -WINDOW:].clone()  # the cache a sliding-window layer keeps


def _worker(rank: int, world_size: int) -> dict:
    import dcp_compile as dcp

    torch.manual_seed(0)
    model = AttentionWithWindowCache()
    compiled = torch.compile(model, backend="dcp", dynamic=True, options={"inner": "eager", "sp_size": world_size})
    x = torch.randn(2, 9, 16, generator=torch.Generator().manual_seed(1))

    def loss_of(outputs: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        out, cache = outputs
        return out.square().mean() + cache.sin().sum()  # gradient through the returned cache too

    expected = model(x)
    loss_of(expected).backward()
    eager = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    records = dcp.explain(compiled, x)
    actual = compiled(x)
    loss_of(actual).backward()
    dcp.sync_gradients(model)
    for got, want in zip(actual, expected):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, eager[name], rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")
    (variant,) = [v for v in records.variant_records() if v.sp_size > 1]
    return {"sharded": len(variant.sharded_sites), "gathers": len(variant.gathers), "output_gathers": variant.output_gathers,
            "fallback": variant.fallback_reason}


def test_a_returned_sequence_slice_is_an_output_gather_with_exact_gradients() -> None:
    for result in run_in_process_world(_worker, 2, timeout=600):
        assert result["fallback"] is None and result["sharded"] == 1, result
        assert result["gathers"] == 0, result
        assert result["output_gathers"] >= 2, result  # the attention output and the cache's keys
