"""The cost model's per-layer bytes and FLOPs against a full-size STDiT3-like block, traced.

A block of Open-Sora v1.2's STDiT3-XL/2 (width 1152, 16 heads, MLP 4608, cross-attention to 300
text tokens) runs under FakeTensorMode (no real memory: 16k tokens cost nothing) with
``saved_tensors_hooks`` counting what autograd keeps, with and without whole-block
checkpointing, and under ``FlopCounterMode``. Differences between token counts remove what does
not scale with tokens (weights, the text context), leaving bytes and FLOPs per token, which must
match the profile the simulator prices (``ModelProfile.from_config("stdit3-xl/2")``).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils.checkpoint import checkpoint
from torch.utils.flop_counter import FlopCounterMode

from dcp_compile.schedule.model_profile import ModelProfile

HIDDEN, HEADS, CONTEXT = 1152, 16, 300
TOKEN_COUNTS = (1024, 4096, 16384)


class STDiTLikeBlock(nn.Module):
    """Self-attention, cross-attention to a fixed text context, GELU MLP (pre-norm, residuals), with
    STDiT3's adaLN-single modulation: ``t2i_modulate(norm(x), shift, scale)`` before each of the
    self-attention and the MLP and ``gate *`` after each (shift, scale and gate from the timestep,
    one row per sample: fixed bytes), which keeps four more ``[tokens, width]`` tensors per block."""

    def __init__(self, explicit_attention: bool = False) -> None:
        super().__init__()
        self.explicit_attention = explicit_attention
        h = HIDDEN
        self.norm1, self.qkv, self.proj = nn.LayerNorm(h), nn.Linear(h, 3 * h), nn.Linear(h, h)
        self.cross_q, self.cross_kv, self.cross_proj = nn.Linear(h, h), nn.Linear(h, 2 * h), nn.Linear(h, h)
        self.norm2, self.fc1, self.fc2 = nn.LayerNorm(h), nn.Linear(h, 4 * h), nn.Linear(4 * h, h)
        self.scale_shift_table = nn.Parameter(torch.randn(6, h) / h**0.5)

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        batch = q.shape[0]
        q, k, v = (t.view(batch, -1, HEADS, HIDDEN // HEADS).transpose(1, 2) for t in (q, k, v))
        if self.explicit_attention:  # the FLOP counter does not count the CPU flash kernel; matmuls it does
            out = torch.softmax(q @ k.transpose(-1, -2) / (HIDDEN // HEADS) ** 0.5, -1) @ v
        else:
            out = F.scaled_dot_product_attention(q, k, v)
        return out.transpose(1, 2).reshape(batch, -1, HIDDEN)

    def forward(self, x: torch.Tensor, context: torch.Tensor, timestep: torch.Tensor) -> torch.Tensor:
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = (
            self.scale_shift_table[None] + timestep.reshape(x.shape[0], 6, -1)).chunk(6, dim=1)
        q, k, v = self.qkv(self.norm1(x) * (1 + scale_msa) + shift_msa).chunk(3, -1)
        x = x + gate_msa * self.proj(self.attention(q, k, v))
        k, v = self.cross_kv(context).chunk(2, -1)
        x = x + self.cross_proj(self.attention(self.cross_q(x), k, v))
        return x + gate_mlp * self.fc2(F.gelu(self.fc1(self.norm2(x) * (1 + scale_mlp) + shift_mlp)))


def trace(tokens: int, block_checkpointed: bool, explicit_attention: bool = False) -> tuple[int, int]:
    """(bytes autograd keeps, forward FLOPs) of one bf16 block on ``tokens`` tokens, faked."""
    with FakeTensorMode():
        previous = torch.get_default_dtype()
        torch.set_default_dtype(torch.bfloat16)
        try:
            block = STDiTLikeBlock(explicit_attention)
        finally:
            torch.set_default_dtype(previous)
        x = torch.randn(1, tokens, HIDDEN, dtype=torch.bfloat16, requires_grad=True)
        context = torch.randn(1, CONTEXT, HIDDEN, dtype=torch.bfloat16)
        timestep = torch.randn(1, 6 * HIDDEN, dtype=torch.bfloat16)  # the embedded timestep, per sample
        kept: dict[int, int] = {}

        def pack(tensor: torch.Tensor) -> torch.Tensor:
            kept[id(tensor)] = 0 if isinstance(tensor, nn.Parameter) else tensor.numel() * tensor.element_size()
            return tensor

        counter = FlopCounterMode(display=False)
        with counter, torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            if block_checkpointed:
                checkpoint(block, x, context, timestep, use_reentrant=False)
            else:
                block(x, context, timestep)
        return sum(kept.values()), counter.get_total_flops()


@pytest.fixture(scope="module")
def traces() -> dict[tuple[int, bool], tuple[int, int]]:
    return {(n, ckpt): trace(n, ckpt) for n in TOKEN_COUNTS for ckpt in (False, True)}


PROFILE = ModelProfile.from_config("stdit3-xl/2")


@pytest.mark.parametrize("block_checkpointed,policy", [(False, "none"), (True, "full")])
def test_saved_bytes_per_token_match_the_profile(traces, block_checkpointed: bool, policy: str) -> None:
    priced = PROFILE.activation_bytes_per_token[policy]
    for small, large in zip(TOKEN_COUNTS, TOKEN_COUNTS[1:]):
        per_token = (traces[(large, block_checkpointed)][0] - traces[(small, block_checkpointed)][0]) / (large - small)
        assert per_token == pytest.approx(priced, rel=0.01), (small, large, per_token, priced)


def test_block_checkpointing_keeps_only_the_block_input(traces) -> None:
    for n in TOKEN_COUNTS:
        # bf16 inputs: the tokens, the (fixed-size) text context and timestep, nothing else
        assert traces[(n, True)][0] == (n + CONTEXT + 6) * HIDDEN * 2
        assert traces[(n, False)][0] > 20 * traces[(n, True)][0]


def test_forward_flops_match_the_profile() -> None:
    """FLOPs(n) = fixed (the context's keys and values) + linear * n + attention * n^2 (one
    self-attention over all n tokens), fitted on three counts and checked on a fourth."""
    counts = (1024, 4096, 16384)
    flops = [float(trace(n, False, explicit_attention=True)[1]) for n in counts]
    solution = torch.linalg.solve(
        torch.tensor([[1.0, n, n * n] for n in counts], dtype=torch.float64), torch.tensor(flops, dtype=torch.float64))
    fixed, linear, attention = solution.tolist()
    check = 2048
    assert fixed + linear * check + attention * check**2 == pytest.approx(trace(check, False, True)[1], rel=1e-6)
    head_flops = 2 * HIDDEN * 32  # the output head's matmul, priced once for the whole model
    priced_linear = (PROFILE.linear_flops_per_token - head_flops) / PROFILE.num_layers
    assert linear == pytest.approx(priced_linear, rel=0.01)
    assert attention == pytest.approx(PROFILE.attention_flops_per_token_key / PROFILE.num_attention_layers, rel=0.01)
