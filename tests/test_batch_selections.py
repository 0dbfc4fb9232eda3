"""Per-sample selections of one sharded value are gathered once, not once per sample.

Lumina2 unpatchifies each sample on its own (``hidden[i][text:seq]`` for every ``i``): a slice
along the sequence of each sample's selection. Gathering each selection would move the same bytes
in one collective per sample; the backend gathers the shared source once and selects from it.
Two gloo ranks against eager, and the record says one gather at a batch of 3.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dcp_compile.testing.process_world import run_in_process_world

PREFIX = 2  # leading tokens each sample drops (a caption, say)


class PerSampleTail(nn.Module):
    def __init__(self, hidden: int = 16, heads: int = 2) -> None:
        super().__init__()
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.out = nn.Linear(hidden, hidden)
        self.heads = heads

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        h = self.out(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, s, d))
        return torch.stack([h[i][PREFIX:] for i in range(b)])


def _worker(rank: int, world_size: int) -> dict:
    import dcp_compile as dcp

    torch.manual_seed(0)
    model = PerSampleTail()
    compiled = torch.compile(model, backend="dcp", dynamic=True, options={"inner": "eager", "sp_size": world_size})
    x = torch.randn(3, 11, 16, generator=torch.Generator().manual_seed(1))
    expected = model(x)
    expected.square().mean().backward()
    eager = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    records = dcp.explain(compiled, x)
    actual = compiled(x)
    actual.square().mean().backward()
    dcp.sync_gradients(model)
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-6)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, eager[name], rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")
    (variant,) = [v for v in records.variant_records() if v.sp_size > 1]
    return {"sharded": len(variant.sharded_sites), "gathers": len(variant.gathers), "fallback": variant.fallback_reason}


def test_per_sample_selections_share_one_gather_at_parity() -> None:
    for result in run_in_process_world(_worker, 2, timeout=600):
        assert result["fallback"] is None and result["sharded"] == 1, result
        assert result["gathers"] == 1, result  # one for the batch, not one per sample (3)
