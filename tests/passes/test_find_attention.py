"""find_attention_pass on small graphs: SDPA is found, a hand-written attention SDPA can express is
rewritten into SDPA, and one it cannot express is kept as a region (an AttentionSite spelled
``"region"``) that later passes run on each rank's heads."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from pass_helpers import SDPA, analyse, call_targets

from dcp_compile.compiler.passes.find_attention import sdpa_argument

SOFTMAX = torch.ops.aten.softmax.int


class Attention(nn.Module):
    """One self-attention over ``[B, S, 16]``, its core spelled as ``style`` says."""

    def __init__(self, style: str, hidden: int = 16, heads: int = 2):
        super().__init__()
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.heads, self.style = heads, style

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, _ = x.shape
        q, k, v = self.qkv(x).view(batch, length, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        if self.style == "sdpa":
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)
        scores = q @ k.transpose(-2, -1)
        if self.style == "handwritten":  # softmax(q @ k^T * scale + mask) @ v
            mask = torch.full((length, length), float("-inf"), device=x.device).triu(1)
            weights = torch.softmax(scores * (1.0 / math.sqrt(q.shape[-1])) + mask, dim=-1)
        elif self.style == "softcap":  # Gemma-2-style soft-capping: no SDPA argument says tanh
            weights = torch.softmax(torch.tanh(scores / 30.0) * 30.0, dim=-1)
        elif self.style == "where_mask":  # finfo.min, not -inf: a fully masked row is not NaN
            causal = torch.ones(length, length, dtype=torch.bool, device=x.device).tril()
            weights = torch.softmax(torch.where(causal, scores, torch.finfo(scores.dtype).min), dim=-1)
        return weights @ v


def sites_of(style: str):
    torch.manual_seed(0)
    return analyse(Attention(style), torch.randn(2, 12, 16))


def test_sdpa_is_found():
    gm, analysis = sites_of("sdpa")
    (site,) = analysis.attention_sites
    assert site.spelling == "sdpa"
    assert site.node.target is SDPA
    assert call_targets(gm).count(SDPA) == 1


def test_handwritten_attention_is_rewritten_into_sdpa():
    gm, analysis = sites_of("handwritten")
    (site,) = analysis.attention_sites
    assert site.spelling == "handwritten"
    assert site.node.target is SDPA and site.node.graph is gm.graph
    targets = call_targets(gm)
    assert targets.count(SDPA) == 1
    assert SOFTMAX not in targets  # the hand-written core is gone, not kept beside the SDPA
    # The additive causal mask, built from sizes alone, went on to become is_causal (causal_masks).
    assert site.mask is None and sdpa_argument(site.node, "is_causal") is True


@pytest.mark.parametrize("style", ["softcap", "where_mask"])
def test_attention_sdpa_cannot_express_is_a_region(style):
    gm, analysis = sites_of(style)
    (site,) = analysis.attention_sites
    assert site.spelling == "region" and site.region is not None
    targets = call_targets(gm)
    assert SDPA not in targets  # left as written: rewriting it would change the numbers
    assert targets.count(SOFTMAX) == 1
    region = site.region
    assert site.node is region.output  # the site is the region's output matmul, p @ v
    assert any(node.target is SOFTMAX for node in region.nodes)
    if style == "where_mask":  # the boolean mask is a side input, cut to each rank's heads later
        assert [node.target for node in region.side_inputs] == [torch.ops.aten.tril.default]
    # The site's queries and keys are the [B, H, S, D] operands of q @ k^T.
    assert len(site.query_shape) == 4 and site.query_shape == site.key_shape
