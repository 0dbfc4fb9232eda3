"""causal_masks_pass: a causal mask built from sizes alone becomes ``is_causal=True``; a mask that
depends on data, a constant buffer, or is causal only up to a window is left alone."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from pass_helpers import analyse

import dcp_compile  # noqa: F401  (registers the backend)
from dcp_compile.compiler.passes.find_attention import sdpa_argument


class MaskedAttention(nn.Module):
    def __init__(self, style: str) -> None:
        super().__init__()
        self.style = style
        self.qkv = nn.Linear(16, 48)
        self.register_buffer("tril", torch.ones(64, 64, dtype=torch.bool).tril())

    def forward(self, x: torch.Tensor, padding: torch.Tensor) -> torch.Tensor:
        batch, length, _ = x.shape
        q, k, v = self.qkv(x).view(batch, length, 3, 2, 8).permute(2, 0, 3, 1, 4)
        positions = torch.arange(length, device=x.device)
        causal = positions[None, :] <= positions[:, None]  # [S, S]: key <= query
        if self.style == "causal":
            mask = causal[None, None].expand(batch, 1, length, length)
        elif self.style == "additive":
            mask = torch.zeros(length, length).masked_fill(~causal, torch.finfo(torch.float32).min)
        elif self.style == "window":  # causal, and at most 5 positions back
            mask = causal & (positions[:, None] - positions[None, :] < 5)
        elif self.style == "padding":  # data: the padding mask of the batch
            mask = causal[None, None] & padding[:, None, None, :].bool()
        else:  # "buffer": a registered tril cut to the length
            mask = self.tril[:length, :length]
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def _site(style: str):
    gm, analysis = analyse(MaskedAttention(style), torch.randn(2, 11, 16), torch.ones(2, 11))
    (site,) = analysis.attention_sites
    return site, analysis


@pytest.mark.parametrize("style", ["causal", "additive"])
def test_a_causal_mask_of_positions_becomes_is_causal(style):
    site, analysis = _site(style)
    assert site.mask is None and sdpa_argument(site.node, "is_causal") is True
    assert analysis.causal_mask_sites == [site.node.name]


@pytest.mark.parametrize("style", ["window", "padding", "buffer"])
def test_other_masks_are_kept(style):
    site, analysis = _site(style)
    assert site.mask is not None and sdpa_argument(site.node, "is_causal") is False
    assert analysis.causal_mask_sites == []


def test_the_rewritten_model_matches_eager():
    torch.manual_seed(0)
    model = MaskedAttention("causal")
    x, padding = torch.randn(2, 13, 16), torch.ones(2, 13)
    expected = model(x, padding)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="dcp", dynamic=True, options={"inner": "eager"})
    torch.testing.assert_close(compiled(x, padding), expected)
    torch.testing.assert_close(compiled(x[:, :7], padding[:, :7]), model(x[:, :7], padding[:, :7]))
    torch._dynamo.reset()
