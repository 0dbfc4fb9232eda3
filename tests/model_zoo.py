"""A zoo of small eager transformer models for dcp-compile's parity tests.

dcp-compile shards the sequence dimension of an unchanged model across ranks, so it has to
cope with whatever real model code does to that dimension. Every model here is written the way
real models are written (``torch.cat`` for CLS tokens, RoPE built from ``torch.arange``,
hand-written attention with additive masks, ``view``/``permute`` unpatchify, GQA, ...), never
"compiler-friendly" rewrites, because those are the spellings the compiler meets in practice.

All models are tiny (hidden 32-64, 1-2 layers), fp32, dropout-free (p=0, so outputs are
deterministic even in training mode) and built from a fixed seed. Each model comes as a
:class:`ZooCase`, which bundles how to build it, how to make inputs for a given sequence length,
which scalar to backpropagate, and how long the attended sequence of a given input is.

Usage::

    case = ZOO["gpt"]
    model = case.build()
    inputs = case.make_inputs(seq_len=16)
    loss = case.loss_of(model(**inputs))
    outputs, grads = eager_reference(case, seq_len=16)   # the ground truth for parity tests

Notes that matter to parity tests:

* Causal-LM cases (``gpt``, ``gqa``, ``hf_llama``, ``hf_gpt2``) use the Hugging Face shifted
  loss. At ``seq_len == 1`` no token has a target, so the loss is a mean over zero elements and
  is NaN in eager too (exactly as in Hugging Face). Their ``loss_of`` therefore falls back to
  ``logits.float().pow(2).mean()`` when the logits have fewer than two positions (a decision on
  a shape, never on values, so it cannot hide a NaN produced by a compiler bug). Compare the raw
  ``loss`` output at length 1 with ``equal_nan=True``.
* ``vit`` prepends a CLS token, so ``seq_len_of(make_inputs(n)) == n + 1``.
* ``dit`` attends over patches: ``make_inputs(n)`` picks an image whose patch grid has exactly
  ``n`` patches (see :func:`dit_image_hw`), so ``seq_len_of(make_inputs(n)) == n``.
* ``hf_llama`` / ``hf_gpt2`` need ``transformers``; the module imports without it and their
  ``build`` raises ``ImportError`` (check ``case.requires`` and ``pytest.importorskip``).
"""

from __future__ import annotations

import functools

import importlib.util
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = [
    "GPTModel",
    "DiTBlockModel",
    "ViTModel",
    "HandwrittenAttentionModel",
    "GQAModel",
    "NoAttentionModel",
    "tiny_llama",
    "tiny_gpt2",
    "HAS_TRANSFORMERS",
    "ZooCase",
    "ZOO",
    "dit_image_hw",
    "eager_reference",
    "output_tensors",
]



def _has_module(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):  # e.g. sys.modules[name] is None (import blocked)
        return False


HAS_TRANSFORMERS: bool = _has_module("transformers")

VOCAB_SIZE = 128
BUILD_SEED = 1234


# ---------------------------------------------------------------------------------------------
# Shared building blocks
# ---------------------------------------------------------------------------------------------


class RMSNorm(nn.Module):
    """RMSNorm written out by hand, as Llama-family code does, rather than ``nn.RMSNorm``.

    The compiler sees a ``pow``/``mean``/``rsqrt`` chain over the hidden dim only, which must
    stay local to each sequence shard.
    """

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class SwiGLU(nn.Module):
    """Llama-style gated MLP: ``down(silu(gate(x)) * up(x))``."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=False)
        self.up_proj = nn.Linear(dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class RotaryEmbedding(nn.Module):
    """RoPE tables computed in forward from ``torch.arange(seq_len)``.

    Positions are created inside the graph from the (symbolic) sequence length, which is the
    pattern a sequence-sharding compiler must rewrite into per-rank offsets.
    """

    def __init__(self, head_dim: int, base: float = 10000.0) -> None:
        super().__init__()
        inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        seq_len = x.shape[1]
        positions = torch.arange(seq_len, device=x.device, dtype=torch.float32)
        freqs = torch.outer(positions, self.inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)


def rotate_half(x: Tensor) -> Tensor:
    x1, x2 = x.chunk(2, dim=-1)  # the form every model here traced with (a later copy replaced the slicing one)
    return torch.cat([-x2, x1], dim=-1)


def apply_rotary(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
    """Apply RoPE to [B, H, S, D] tensors; ``cos``/``sin`` are [S, D]."""
    cos = cos[None, None]
    sin = sin[None, None]
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


def hf_shifted_lm_loss(logits: Tensor, labels: Tensor) -> Tensor:
    """Hugging Face's causal-LM loss: shift labels left by padding with -100, then mean CE.

    The shift (``F.pad`` + slice) moves data across sequence positions, so on a sharded
    sequence it needs the first label of the next shard.
    """
    vocab = logits.shape[-1]
    labels = F.pad(labels, (0, 1), value=-100)[..., 1:]
    return F.cross_entropy(logits.float().view(-1, vocab), labels.reshape(-1), ignore_index=-100)


def repeat_kv(hidden_states: Tensor, n_rep: int) -> Tensor:
    """Llama's ``repeat_kv``: [B, KV, S, D] -> [B, KV * n_rep, S, D] via expand + reshape.

    Equivalent to ``torch.repeat_interleave(hidden_states, n_rep, dim=1)``.
    """
    batch, num_kv, seq_len, head_dim = hidden_states.shape
    if n_rep == 1:
        return hidden_states
    hidden_states = hidden_states[:, :, None, :, :].expand(batch, num_kv, n_rep, seq_len, head_dim)
    return hidden_states.reshape(batch, num_kv * n_rep, seq_len, head_dim)


# ---------------------------------------------------------------------------------------------
# 1. GPT-style decoder
# ---------------------------------------------------------------------------------------------


class GPTAttention(nn.Module):
    """Causal self-attention with RoPE through ``F.scaled_dot_product_attention(is_causal=True)``.

    ``fused_qkv=True`` uses one ``Linear(h, 3h)`` split with ``chunk`` (GPT-NeoX/Phi style);
    ``False`` uses separate q/k/v projections (Llama style). The zoo uses one of each so both
    spellings are covered.
    """

    def __init__(self, hidden: int, num_heads: int, fused_qkv: bool) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = hidden // num_heads
        self.fused_qkv = fused_qkv
        if fused_qkv:
            self.qkv_proj = nn.Linear(hidden, 3 * hidden, bias=False)
        else:
            self.q_proj = nn.Linear(hidden, hidden, bias=False)
            self.k_proj = nn.Linear(hidden, hidden, bias=False)
            self.v_proj = nn.Linear(hidden, hidden, bias=False)
        self.o_proj = nn.Linear(hidden, hidden, bias=False)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        batch, seq_len, hidden = x.shape
        if self.fused_qkv:
            q, k, v = self.qkv_proj(x).chunk(3, dim=-1)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q = q.view(batch, seq_len, self.num_heads, self.head_dim).transpose(1, 2)
        k = k.view(batch, seq_len, self.num_heads, self.head_dim).transpose(1, 2)
        v = v.view(batch, seq_len, self.num_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rotary(q, k, cos, sin)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        out = out.transpose(1, 2).reshape(batch, seq_len, hidden)
        return self.o_proj(out)


class GPTBlock(nn.Module):
    def __init__(self, hidden: int, num_heads: int, mlp_hidden: int, fused_qkv: bool) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(hidden)
        self.attn = GPTAttention(hidden, num_heads, fused_qkv)
        self.mlp_norm = RMSNorm(hidden)
        self.mlp = SwiGLU(hidden, mlp_hidden)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin)
        return x + self.mlp(self.mlp_norm(x))


class GPTModel(nn.Module):
    """GPT/Llama-style decoder: RoPE, causal SDPA, hand-written RMSNorm, SwiGLU, tied lm head.

    Layer 0 uses a fused qkv projection, layer 1 separate q/k/v projections.
    ``forward(input_ids, labels=None) -> (loss, logits)``; ``loss`` is None without labels.
    """

    def __init__(
        self,
        vocab_size: int = VOCAB_SIZE,
        hidden: int = 32,
        num_heads: int = 4,
        mlp_hidden: int = 64,
        tie_embeddings: bool = True,
    ) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab_size, hidden)
        self.rotary = RotaryEmbedding(hidden // num_heads)
        self.layers = nn.ModuleList(
            [
                GPTBlock(hidden, num_heads, mlp_hidden, fused_qkv=True),
                GPTBlock(hidden, num_heads, mlp_hidden, fused_qkv=False),
            ]
        )
        self.norm = RMSNorm(hidden)
        self.lm_head = nn.Linear(hidden, vocab_size, bias=False)
        if tie_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def forward(self, input_ids: Tensor, labels: Tensor | None = None) -> tuple[Tensor | None, Tensor]:
        x = self.embed_tokens(input_ids)
        cos, sin = self.rotary(x)
        for layer in self.layers:
            x = layer(x, cos, sin)
        logits = self.lm_head(self.norm(x))
        loss = hf_shifted_lm_loss(logits, labels) if labels is not None else None
        return loss, logits


class ApproximateGelu(torch.autograd.Function):
    """tanh-GeLU whose backward is a cheaper formula, not its derivative (BLOOM's ``GeLUFunction``
    does the same): a compiler that differentiates the forward instead of running this backward
    gives different gradients."""

    @staticmethod
    def forward(ctx: Any, x: Tensor) -> Tensor:
        ctx.save_for_backward(x)
        return 0.5 * x * (1.0 + torch.tanh(0.79788456 * (x + 0.044715 * x * x * x)))

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:
        (x,) = ctx.saved_tensors
        return grad * torch.sigmoid(1.702 * x) * 1.25


class CustomFunctionMLP(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.up_proj = nn.Linear(dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(ApproximateGelu.apply(self.up_proj(x)))


class CustomFunctionGPT(GPTModel):
    """The GPT decoder with its MLPs' activation written as a custom ``autograd.Function``."""

    def __init__(self) -> None:
        super().__init__()
        for layer in self.layers:
            layer.mlp = CustomFunctionMLP(32, 64)


class SortedExperts(nn.Module):
    """Mixture-of-experts feed-forward, dispatched the way Mixtral/Qwen-MoE kernels do: flatten the
    tokens, sort the (token, expert) pairs by expert, gather the rows in that order, run each row
    through its expert's weights, scale by the router weight and scatter back with the inverse
    permutation. Every token's output depends on its own row only."""

    def __init__(self, hidden: int, mlp_hidden: int, experts: int = 4, top_k: int = 2) -> None:
        super().__init__()
        self.top_k = top_k
        self.router = nn.Linear(hidden, experts, bias=False)
        self.w_in = nn.Parameter(torch.randn(experts, hidden, mlp_hidden) * hidden**-0.5)
        self.w_out = nn.Parameter(torch.randn(experts, mlp_hidden, hidden) * mlp_hidden**-0.5)

    def forward(self, x: Tensor) -> Tensor:
        B, S, D = x.shape
        tokens = x.reshape(-1, D)
        weights, experts = self.router(tokens).softmax(-1).topk(self.top_k, dim=-1)
        weights = weights / weights.sum(-1, keepdim=True)
        sorted_experts, order = experts.reshape(-1).sort()
        rows = tokens[order // self.top_k]
        hidden = F.silu(torch.bmm(rows.unsqueeze(1), self.w_in[sorted_experts]))
        out = torch.bmm(hidden, self.w_out[sorted_experts]).squeeze(1) * weights.reshape(-1)[order].unsqueeze(-1)
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(order.numel(), device=order.device)
        return out[inverse].view(-1, self.top_k, D).sum(1).view(B, S, D)


class MoEGPT(GPTModel):
    """The GPT decoder with sorted-dispatch mixture-of-experts feed-forwards."""

    def __init__(self) -> None:
        super().__init__()
        for layer in self.layers:
            layer.mlp = SortedExperts(32, 64)


class CapacityExperts(nn.Module):
    """Switch-style top-1 mixture of experts with a capacity computed from the token count,
    ``ceil(tokens * factor / experts)``: a token's place in its expert's buffer is a ``cumsum``
    over the tokens, tokens past the capacity are dropped (zero output), the kept ones are written
    into an ``[experts * capacity, D]`` buffer, run as one batched matmul over the experts and read
    back. Which tokens drop depends on every token before them and on the sequence's length."""

    def __init__(self, hidden: int, mlp_hidden: int, experts: int = 4, capacity_factor: float = 1.0) -> None:
        super().__init__()
        self.experts, self.capacity_factor = experts, capacity_factor
        self.router = nn.Linear(hidden, experts, bias=False)
        self.w_in = nn.Parameter(torch.randn(experts, hidden, mlp_hidden) * hidden**-0.5)
        self.w_out = nn.Parameter(torch.randn(experts, mlp_hidden, hidden) * mlp_hidden**-0.5)

    def forward(self, x: Tensor) -> Tensor:
        B, S, D = x.shape
        tokens = x.reshape(-1, D)
        capacity = math.ceil(tokens.shape[0] * self.capacity_factor / self.experts)
        gate, expert = self.router(tokens).softmax(-1).max(-1)
        chosen = F.one_hot(expert, self.experts)
        position = (chosen.cumsum(0) * chosen).sum(-1) - 1
        kept = position < capacity
        slot = torch.where(kept, expert * capacity + position, self.experts * capacity)
        buffer = tokens.new_zeros(self.experts * capacity + 1, D).index_add(0, slot, tokens)
        grouped = buffer[:-1].view(self.experts, capacity, D)
        hidden = torch.bmm(F.silu(torch.bmm(grouped, self.w_in)), self.w_out)
        rows = torch.cat([hidden.reshape(-1, D), hidden.new_zeros(1, D)])[slot]
        return (rows * (gate * kept)[:, None]).view(B, S, D)


class CapacityMoEGPT(GPTModel):
    """The GPT decoder with capacity-limited (token-dropping) mixture-of-experts feed-forwards."""

    def __init__(self) -> None:
        super().__init__()
        for layer in self.layers:
            layer.mlp = CapacityExperts(32, 64)


# ---------------------------------------------------------------------------------------------
# 2. DiT-style block model
# ---------------------------------------------------------------------------------------------


def timestep_embedding(t: Tensor, dim: int, max_period: float = 10000.0) -> Tensor:
    """DiT/ADM sinusoidal timestep embedding of ``t`` [B] -> [B, dim]."""
    half = dim // 2
    freqs = torch.exp(
        -math.log(max_period) * torch.arange(half, dtype=torch.float32, device=t.device) / half
    )
    args = t[:, None].float() * freqs[None]
    return torch.cat([torch.cos(args), torch.sin(args)], dim=-1)


def modulate(x: Tensor, shift: Tensor, scale: Tensor) -> Tensor:
    """adaLN modulation; shift/scale are per-sample [B, hidden], broadcast over tokens."""
    return x * (1 + scale.unsqueeze(1)) + shift.unsqueeze(1)


class DiTAttention(nn.Module):
    """Multi-head attention via SDPA; self-attention when ``context`` is None, else cross.

    In cross-attention the queries come from the (sharded) image tokens and keys/values from
    the (unsharded, fixed 77-token) text, so only one side of the attention is sequence-split.
    """

    def __init__(self, hidden: int, num_heads: int, context_dim: int | None = None) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = hidden // num_heads
        kv_dim = hidden if context_dim is None else context_dim
        self.q = nn.Linear(hidden, hidden)
        self.k = nn.Linear(kv_dim, hidden)
        self.v = nn.Linear(kv_dim, hidden)
        self.proj = nn.Linear(hidden, hidden)

    def _heads(self, x: Tensor) -> Tensor:
        batch, seq_len, _ = x.shape
        return x.view(batch, seq_len, self.num_heads, self.head_dim).transpose(1, 2)

    def forward(self, x: Tensor, context: Tensor | None = None) -> Tensor:
        batch, seq_len, hidden = x.shape
        source = x if context is None else context
        q, k, v = self._heads(self.q(x)), self._heads(self.k(source)), self._heads(self.v(source))
        out = F.scaled_dot_product_attention(q, k, v)
        return self.proj(out.transpose(1, 2).reshape(batch, seq_len, hidden))


class DiTBlock(nn.Module):
    """DiT block with adaLN-Zero-style modulation (but *not* zero-initialised) + cross-attention.

    Real DiT zero-initialises the modulation so every block starts as the identity; here it is
    randomly initialised so that every parameter receives a non-zero gradient in parity tests.
    """

    def __init__(self, hidden: int, num_heads: int, text_dim: int, mlp_ratio: int = 4) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(hidden, elementwise_affine=False, eps=1e-6)
        self.attn = DiTAttention(hidden, num_heads)
        self.norm_cross = nn.LayerNorm(hidden, eps=1e-6)
        self.cross_attn = DiTAttention(hidden, num_heads, context_dim=text_dim)
        self.norm2 = nn.LayerNorm(hidden, elementwise_affine=False, eps=1e-6)
        self.mlp = nn.Sequential(
            nn.Linear(hidden, mlp_ratio * hidden),
            nn.GELU(approximate="tanh"),
            nn.Linear(mlp_ratio * hidden, hidden),
        )
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(hidden, 6 * hidden))

    def forward(self, x: Tensor, c: Tensor, text: Tensor) -> Tensor:
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = self.adaLN_modulation(c).chunk(6, dim=1)
        x = x + gate_msa.unsqueeze(1) * self.attn(modulate(self.norm1(x), shift_msa, scale_msa))
        x = x + self.cross_attn(self.norm_cross(x), context=text)
        x = x + gate_mlp.unsqueeze(1) * self.mlp(modulate(self.norm2(x), shift_mlp, scale_mlp))
        return x


class DiTFinalLayer(nn.Module):
    def __init__(self, hidden: int, patch_size: int, out_channels: int) -> None:
        super().__init__()
        self.norm_final = nn.LayerNorm(hidden, elementwise_affine=False, eps=1e-6)
        self.linear = nn.Linear(hidden, patch_size * patch_size * out_channels)
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(hidden, 2 * hidden))

    def forward(self, x: Tensor, c: Tensor) -> Tensor:
        shift, scale = self.adaLN_modulation(c).chunk(2, dim=1)
        return self.linear(modulate(self.norm_final(x), shift, scale))


class DiTBlockModel(nn.Module):
    """DiT-style latent denoiser: conv patchify -> 2 DiT blocks (self + cross attn) -> unpatchify.

    The token sequence does not exist in the inputs: it is created inside forward by
    ``Conv2d(stride=2).flatten(2).transpose(1, 2)`` (row-major over the patch grid) and
    destroyed again by a ``view``/``permute``/``reshape`` unpatchify, so the compiler has to
    find the sequence dimension through image-shaped ops.
    ``forward(x [B, 4, H, W], t [B], text [B, 77, text_dim]) -> [B, 4, H, W]`` (H, W even).
    """

    patch_size = 2

    def __init__(
        self,
        in_channels: int = 4,
        hidden: int = 32,
        num_heads: int = 4,
        text_dim: int = 48,
        freq_dim: int = 64,
        depth: int = 2,
    ) -> None:
        super().__init__()
        self.in_channels = in_channels
        self.freq_dim = freq_dim
        self.x_embedder = nn.Conv2d(in_channels, hidden, kernel_size=2, stride=2)
        self.t_embedder = nn.Sequential(nn.Linear(freq_dim, hidden), nn.SiLU(), nn.Linear(hidden, hidden))
        self.blocks = nn.ModuleList([DiTBlock(hidden, num_heads, text_dim) for _ in range(depth)])
        self.final_layer = DiTFinalLayer(hidden, self.patch_size, in_channels)

    def forward(self, x: Tensor, t: Tensor, text: Tensor) -> Tensor:
        B, C, H, W = x.shape
        x = self.x_embedder(x).flatten(2).transpose(1, 2)  # [B, (H/2)*(W/2), hidden]
        c = self.t_embedder(timestep_embedding(t, self.freq_dim))
        for block in self.blocks:
            x = block(x, c, text)
        x = self.final_layer(x, c)  # [B, (H/2)*(W/2), 2*2*C]
        return x.view(B, H // 2, W // 2, 2, 2, C).permute(0, 5, 1, 3, 2, 4).reshape(B, C, H, W)


class JointAttentionBlock(nn.Module):
    """MM-DiT block (SD3, Flux): text and image tokens keep their own weights but attend jointly
    over ``cat(text, image)`` (or ``cat(image, text)``) with rotary positions over the joint
    sequence; the output is split back into the two streams."""

    def __init__(self, hidden: int, num_heads: int, image_first: bool, split: bool, image_queries: bool = False) -> None:
        super().__init__()
        self.num_heads, self.image_first, self.split, self.image_queries = num_heads, image_first, split, image_queries
        self.image_qkv, self.text_qkv = nn.Linear(hidden, 3 * hidden), nn.Linear(hidden, 3 * hidden)
        self.image_out = nn.Linear(hidden, hidden)
        self.text_out = None if image_queries else nn.Linear(hidden, hidden)  # text does not query there
        self.image_mlp = nn.Sequential(nn.LayerNorm(hidden), nn.Linear(hidden, 2 * hidden), nn.GELU(), nn.Linear(2 * hidden, hidden))
        self.text_mlp = nn.Sequential(nn.LayerNorm(hidden), nn.Linear(hidden, 2 * hidden), nn.GELU(), nn.Linear(2 * hidden, hidden))

    def _heads(self, qkv: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        B, S, _ = qkv.shape
        return qkv.view(B, S, 3, self.num_heads, -1).permute(2, 0, 3, 1, 4).unbind(0)

    def forward(self, image: Tensor, text: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
        (iq, ik, iv), (tq, tk, tv) = self._heads(self.image_qkv(image)), self._heads(self.text_qkv(text))
        first, second = ((iq, ik, iv), (tq, tk, tv)) if self.image_first else ((tq, tk, tv), (iq, ik, iv))
        q, k, v = (torch.cat([a, b], dim=2) for a, b in zip(first, second))
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        text_len, image_len = text.shape[1], image.shape[1]
        if self.image_queries:  # PRX: only the image tokens query, over text + image keys
            image_q = q[:, :, text_len:]
            image_attn = F.scaled_dot_product_attention(image_q, k, v).transpose(1, 2).flatten(2)
            image = image + self.image_out(image_attn)
            return image + self.image_mlp(image), text + self.text_mlp(text)
        out = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).flatten(2)
        if self.split:
            sizes = [image_len, text_len] if self.image_first else [text_len, image_len]
            a, b = out.split_with_sizes(sizes, dim=1)
            image_attn, text_attn = (a, b) if self.image_first else (b, a)
        elif self.image_first:  # counted from the end, as HunyuanVideo writes it
            image_attn, text_attn = out[:, :-text_len], out[:, -text_len:]
        else:
            text_attn, image_attn = out[:, :text_len], out[:, text_len:]
        image = image + self.image_out(image_attn)
        text = text + self.text_out(text_attn)
        return image + self.image_mlp(image), text + self.text_mlp(text)


class JointDiTModel(nn.Module):
    """Joint-attention DiT: patchified image tokens and projected text tokens, attending together.

    The attention length is ``text + image``; only the image tokens are long. DCP shards the image
    stream and keeps the text replicated around the chunk (no gather at the splits): one block
    splits with ``split_with_sizes``, the second slices (from the end), one puts the text first, the
    other last; the third lets only the image tokens query over the joint keys (PRX).
    ``forward(x [B, 4, H, W], text [B, T, text_dim]) -> [B, 4, H, W]``.
    """

    def __init__(self, in_channels: int = 4, hidden: int = 32, num_heads: int = 4, text_dim: int = 24) -> None:
        super().__init__()
        self.in_channels, self.head_dim = in_channels, hidden // num_heads
        self.x_embedder = nn.Conv2d(in_channels, hidden, kernel_size=2, stride=2)
        self.text_embedder = nn.Linear(text_dim, hidden)
        self.blocks = nn.ModuleList([JointAttentionBlock(hidden, num_heads, image_first=False, split=True),
                                     JointAttentionBlock(hidden, num_heads, image_first=True, split=False),
                                     JointAttentionBlock(hidden, num_heads, image_first=False, split=False,
                                                         image_queries=True)])
        self.final = nn.Linear(hidden, 4 * in_channels)
        self.text_head = nn.Linear(hidden, in_channels)

    def _rotary(self, text_len: int, image_len: int, image_first: bool, device: torch.device) -> tuple[Tensor, Tensor]:
        text_pos = torch.zeros(text_len, device=device)
        image_pos = torch.arange(image_len, device=device, dtype=torch.float32) + 1
        positions = torch.cat([image_pos, text_pos] if image_first else [text_pos, image_pos])
        freqs = 1.0 / (100.0 ** (torch.arange(0, self.head_dim, 2, device=device).float() / self.head_dim))
        angles = torch.outer(positions, freqs).repeat(1, 2)
        return angles.cos(), angles.sin()

    def forward(self, x: Tensor, text: Tensor) -> Tensor:
        B, C, H, W = x.shape
        image = self.x_embedder(x).flatten(2).transpose(1, 2)
        text = self.text_embedder(text)
        for block in self.blocks:
            cos, sin = self._rotary(text.shape[1], image.shape[1], block.image_first, x.device)
            image, text = block(image, text, cos, sin)
        out = self.final(image).view(B, H // 2, W // 2, 2, 2, C).permute(0, 5, 1, 3, 2, 4).reshape(B, C, H, W)
        return out + self.text_head(text).mean(1)[:, :, None, None]


class TwoStreamBlock(nn.Module):
    """LTX-2's audio-video block: a long (video) and a short (audio) stream, each attending over
    itself and then over the other. Video queries over audio keys read a replicated context;
    audio queries over video keys read the sharded tokens: their keys and values go to the rank's
    heads, the audio queries are cut to the same heads and their output is gathered over heads.
    Three heads, so at SP 2 and 4 the heads are padded. ``by_hand`` writes the cross-attentions
    as ``softmax(softcap(q @ k^T * scale)) @ v`` (a hand-written region) instead of SDPA."""

    def __init__(self, video_dim: int, audio_dim: int, num_heads: int, head_dim: int, by_hand: bool = False) -> None:
        super().__init__()
        inner = num_heads * head_dim
        self.num_heads, self.by_hand = num_heads, by_hand
        self.video_qkv, self.audio_qkv = nn.Linear(video_dim, 3 * inner), nn.Linear(audio_dim, 3 * inner)
        self.video_self_out, self.audio_self_out = nn.Linear(inner, video_dim), nn.Linear(inner, audio_dim)
        self.video_cross_q, self.audio_cross_kv = nn.Linear(video_dim, inner), nn.Linear(audio_dim, 2 * inner)
        self.audio_cross_q, self.video_cross_kv = nn.Linear(audio_dim, inner), nn.Linear(video_dim, 2 * inner)
        self.video_cross_out, self.audio_cross_out = nn.Linear(inner, video_dim), nn.Linear(inner, audio_dim)
        self.video_norm, self.audio_norm = nn.LayerNorm(video_dim), nn.LayerNorm(audio_dim)

    def _heads(self, x: Tensor, parts: int) -> tuple[Tensor, ...]:
        B, S, _ = x.shape
        return x.view(B, S, parts, self.num_heads, -1).permute(2, 0, 3, 1, 4).unbind(0)

    def _attend(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        return F.scaled_dot_product_attention(q, k, v).transpose(1, 2).flatten(2)

    def _cross(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        if not self.by_hand:
            return self._attend(q, k, v)
        scores = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
        scores = torch.tanh(scores / 5.0) * 5.0  # Gemma 2's soft-capping: no SDPA spelling, a region
        return (scores.softmax(dim=-1) @ v).transpose(1, 2).flatten(2)

    def forward(self, video: Tensor, audio: Tensor) -> tuple[Tensor, Tensor]:
        video = video + self.video_self_out(self._attend(*self._heads(self.video_qkv(self.video_norm(video)), 3)))
        audio = audio + self.audio_self_out(self._attend(*self._heads(self.audio_qkv(self.audio_norm(audio)), 3)))
        (video_q,), (audio_q,) = self._heads(self.video_cross_q(video), 1), self._heads(self.audio_cross_q(audio), 1)
        audio_k, audio_v = self._heads(self.audio_cross_kv(audio), 2)
        video_k, video_v = self._heads(self.video_cross_kv(video), 2)
        video_out = video + self.video_cross_out(self._cross(video_q, audio_k, audio_v))
        audio_out = audio + self.audio_cross_out(self._cross(audio_q, video_k, video_v))
        return video_out, audio_out


class TwoStreamModel(nn.Module):
    """Two token streams with cross-attention both ways (LTX-2's audio+video transformer).
    ``forward(video [B, S, 24], audio [B, 5, 16]) -> (video [B, S, 24], audio [B, 5, 16])``:
    only the video stream grows with the sample, so only it is sharded."""

    def __init__(self, video_dim: int = 24, audio_dim: int = 16, num_heads: int = 3, head_dim: int = 8,
                 by_hand: bool = False) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([TwoStreamBlock(video_dim, audio_dim, num_heads, head_dim, by_hand) for _ in range(2)])

    def forward(self, video: Tensor, audio: Tensor) -> tuple[Tensor, Tensor]:
        for block in self.blocks:
            video, audio = block(video, audio)
        return video, audio


class GridConvBlock(nn.Module):
    """Attention over the tokens, then a feed-forward that convolves the token grid (Sana's Mix-FFN:
    1x1 conv, 3x3 depthwise conv, gate, 1x1 conv). ``video=True`` is Sana-Video's spelling: the
    frames folded into the batch for the spatial convs, then a (3, 1) conv over the frames, a
    residual inside the feed-forward. ``x [B, F*H*W, D]`` with the grid ``(F, H, W)`` (F = 1 for images)."""

    def __init__(self, dim: int = 16, heads: int = 4, video: bool = False) -> None:
        super().__init__()
        self.heads, self.video = heads, video
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        hidden = 2 * dim
        self.conv_inverted = nn.Conv2d(dim, 2 * hidden, 1)
        self.conv_depth = nn.Conv2d(2 * hidden, 2 * hidden, 3, 1, 1, groups=2 * hidden)
        self.conv_point = nn.Conv2d(hidden, dim, 1, bias=False)
        self.conv_temporal = nn.Conv2d(dim, dim, kernel_size=(3, 1), padding=(1, 0), bias=False) if video else None

    def forward(self, x: Tensor, frames: int, height: int, width: int) -> Tensor:
        B, S, D = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(B, S, 3, self.heads, D // self.heads).permute(2, 0, 3, 1, 4)
        x = x + self.proj(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(B, S, D))
        h = self.norm2(x)
        if not self.video:
            h = h.unflatten(1, (height, width)).permute(0, 3, 1, 2)
            return x + self._mix(h).flatten(2, 3).permute(0, 2, 1)
        grid = h.unflatten(1, (frames, height, width))
        h = grid.reshape(B * frames, height, width, D).permute(0, 3, 1, 2)
        h = self._mix(h)
        temporal = h.view(B, frames, D, height * width).permute(0, 2, 1, 3)
        h = (temporal + self.conv_temporal(temporal)).permute(0, 2, 3, 1).view(B, frames, height, width, D)
        return x + (h + grid).flatten(1, 3)

    def _mix(self, h: Tensor) -> Tensor:
        h = self.conv_depth(F.silu(self.conv_inverted(h)))
        h, gate = torch.chunk(h, 2, dim=1)
        return self.conv_point(h * F.silu(gate))


class GridConvModel(nn.Module):
    """Patch tokens of a latent grid through two ``GridConvBlock`` s; returns the tokens."""

    def __init__(self, video: bool = False, dim: int = 16, patch: int = 1) -> None:
        super().__init__()
        self.patch = patch
        self.embed = nn.Linear(4 * patch * patch, dim)
        self.blocks = nn.ModuleList([GridConvBlock(dim, video=video) for _ in range(2)])

    def forward(self, latent: Tensor) -> Tensor:
        if latent.dim() == 4:
            latent = latent.unsqueeze(2)  # an image: one frame
        if self.patch > 1:  # patches of p x p latent pixels: a grid of (H//p, W//p) tokens
            B, C, T, H, W = latent.shape
            p = self.patch
            latent = latent.view(B, C, T, H // p, p, W // p, p).permute(0, 1, 4, 6, 2, 3, 5).reshape(B, C * p * p, T, H // p, W // p)
        _, _, frames, height, width = latent.shape
        x = self.embed(latent.flatten(2).transpose(1, 2))
        for block in self.blocks:
            x = block(x, frames, height, width)
        return x


# ---------------------------------------------------------------------------------------------
# 3. ViT-style encoder
# ---------------------------------------------------------------------------------------------


class ViTBlock(nn.Module):
    """Pre-norm encoder block: ``nn.LayerNorm`` + bidirectional SDPA + GELU MLP."""

    def __init__(self, hidden: int, num_heads: int, mlp_ratio: int = 4) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = hidden // num_heads
        self.norm1 = nn.LayerNorm(hidden)
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.proj = nn.Linear(hidden, hidden)
        self.norm2 = nn.LayerNorm(hidden)
        self.fc1 = nn.Linear(hidden, mlp_ratio * hidden)
        self.fc2 = nn.Linear(mlp_ratio * hidden, hidden)

    def forward(self, x: Tensor) -> Tensor:
        B, N, C = x.shape
        # timm spelling: one reshape/permute to [3, B, H, N, D], then unbind.
        qkv = self.qkv(self.norm1(x)).reshape(B, N, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
        attn = F.scaled_dot_product_attention(q, k, v)
        x = x + self.proj(attn.transpose(1, 2).reshape(B, N, C))
        return x + self.fc2(F.gelu(self.fc1(self.norm2(x))))


class ViTModel(nn.Module):
    """ViT-style classifier over pre-embedded patch tokens of variable length S (<= 256).

    Uses ``torch.cat`` to prepend the CLS token, so the attended sequence is S + 1 (odd lengths,
    and a token that exists on no input shard), slices a learned position table as
    ``self.pos[:, :S + 1]`` (a sequence-dependent slice of a parameter), and pools ``x[:, 0]``
    (a single position that lives on one shard only).
    ``forward(tokens [B, S, in_dim], labels [B]) -> (loss, logits)``.
    """

    max_len = 256

    def __init__(
        self, in_dim: int = 24, hidden: int = 32, num_heads: int = 4, num_classes: int = 10, depth: int = 2
    ) -> None:
        super().__init__()
        self.patch_proj = nn.Linear(in_dim, hidden)
        self.cls_token = nn.Parameter(torch.randn(1, 1, hidden) * 0.02)
        self.pos = nn.Parameter(torch.randn(1, self.max_len + 1, hidden) * 0.02)
        self.blocks = nn.ModuleList([ViTBlock(hidden, num_heads) for _ in range(depth)])
        self.norm = nn.LayerNorm(hidden)
        self.head = nn.Linear(hidden, num_classes)

    def forward(self, tokens: Tensor, labels: Tensor) -> tuple[Tensor, Tensor]:
        B, S, _ = tokens.shape
        x = self.patch_proj(tokens)
        x = torch.cat([self.cls_token.expand(B, -1, -1), x], dim=1)
        x = x + self.pos[:, : S + 1]
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.norm(x)[:, 0])
        return F.cross_entropy(logits, labels), logits


# ---------------------------------------------------------------------------------------------
# 4. Hand-written attention (BERT-style additive padding mask)
# ---------------------------------------------------------------------------------------------


class HandwrittenAttention(nn.Module):
    """Attention spelled out with matmul/softmax instead of SDPA, two spellings.

    ``style="bert"``: 4-D ``torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(d)``,
    ``Tensor.softmax``, ``probs @ v``.
    ``style="bmm"``: q/k/v flattened to [B*H, S, D]; ``q @ k.mT * scale``, ``F.softmax``,
    ``torch.bmm(probs, v)``. The compiler must recognise both as attention (the softmax
    reduces over the sharded key dimension).
    The additive mask is [B, 1, 1, S] with 0 for kept keys and ``finfo.min`` for padding.
    """

    def __init__(self, hidden: int, num_heads: int, style: str, dropout: float = 0.0) -> None:
        super().__init__()
        assert style in ("bert", "bmm")
        self.style = style
        self.num_heads = num_heads
        self.head_dim = hidden // num_heads
        self.dropout = dropout
        self.query = nn.Linear(hidden, hidden)
        self.key = nn.Linear(hidden, hidden)
        self.value = nn.Linear(hidden, hidden)
        self.out = nn.Linear(hidden, hidden)

    def forward(self, x: Tensor, attention_mask: Tensor) -> Tensor:
        B, S, hidden = x.shape
        H, D = self.num_heads, self.head_dim
        q = self.query(x).view(B, S, H, D).transpose(1, 2)
        k = self.key(x).view(B, S, H, D).transpose(1, 2)
        v = self.value(x).view(B, S, H, D).transpose(1, 2)
        if self.style == "bert":
            scores = torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(D)
            mask = (1.0 - attention_mask[:, None, None, :]) * torch.finfo(scores.dtype).min
            scores = scores + mask
            probs = scores.softmax(dim=-1)
            probs = F.dropout(probs, p=self.dropout, training=self.training)
            ctx = probs @ v
        else:
            scale = D**-0.5
            q = q.reshape(B * H, S, D)
            k = k.reshape(B * H, S, D)
            v = v.reshape(B * H, S, D)
            scores = q @ k.mT * scale
            mask = (1.0 - attention_mask[:, None, None, :]) * torch.finfo(scores.dtype).min
            scores = (scores.view(B, H, S, S) + mask).view(B * H, S, S)
            probs = F.softmax(scores, dim=-1)
            probs = F.dropout(probs, p=self.dropout, training=self.training)
            ctx = torch.bmm(probs, v).view(B, H, S, D)
        return self.out(ctx.transpose(1, 2).reshape(B, S, hidden))


class HandwrittenAttentionModel(nn.Module):
    """BERT-like post-norm encoder whose attention is hand-written (layer 0 "bert", layer 1 "bmm").

    ``forward(input_ids [B, S], attention_mask [B, S] of 0/1) -> hidden states [B, S, hidden]``.
    Padded positions still produce outputs (no masked mean is applied).
    """

    def __init__(
        self, vocab_size: int = VOCAB_SIZE, hidden: int = 32, num_heads: int = 4, mlp_hidden: int = 64
    ) -> None:
        super().__init__()
        self.embeddings = nn.Embedding(vocab_size, hidden)
        self.attns = nn.ModuleList(
            [HandwrittenAttention(hidden, num_heads, "bert"), HandwrittenAttention(hidden, num_heads, "bmm")]
        )
        self.attn_norms = nn.ModuleList([nn.LayerNorm(hidden) for _ in range(2)])
        self.mlps = nn.ModuleList(
            [nn.Sequential(nn.Linear(hidden, mlp_hidden), nn.GELU(), nn.Linear(mlp_hidden, hidden)) for _ in range(2)]
        )
        self.mlp_norms = nn.ModuleList([nn.LayerNorm(hidden) for _ in range(2)])

    def forward(self, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        x = self.embeddings(input_ids)
        for attn, attn_norm, mlp, mlp_norm in zip(self.attns, self.attn_norms, self.mlps, self.mlp_norms):
            x = attn_norm(x + attn(x, attention_mask))
            x = mlp_norm(x + mlp(x))
        return x


# ---------------------------------------------------------------------------------------------
# 5. Grouped-query attention
# ---------------------------------------------------------------------------------------------


class GQAAttention(nn.Module):
    """8 query heads sharing 2 KV heads (head dim 8), causal, with RoPE.

    ``native_gqa=True`` passes [B, 2, S, D] keys/values straight to
    ``F.scaled_dot_product_attention(..., enable_gqa=True)``; ``False`` expands them first, keys
    with Llama's ``repeat_kv`` (expand + reshape) and values with ``torch.repeat_interleave``.
    A head-scattering (Ulysses) compiler has to split 2 KV heads across ranks, which may need
    replication rather than a plain split.
    """

    def __init__(self, num_heads: int = 8, num_kv_heads: int = 2, head_dim: int = 8, native_gqa: bool = True) -> None:
        super().__init__()
        hidden = num_heads * head_dim
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.native_gqa = native_gqa
        self.q_proj = nn.Linear(hidden, num_heads * head_dim, bias=False)
        self.k_proj = nn.Linear(hidden, num_kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(hidden, num_kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(num_heads * head_dim, hidden, bias=False)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        B, S, _ = x.shape
        q = self.q_proj(x).view(B, S, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(B, S, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(B, S, self.num_kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rotary(q, k, cos, sin)
        if self.native_gqa:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        else:
            n_rep = self.num_heads // self.num_kv_heads
            k = repeat_kv(k, n_rep)
            v = torch.repeat_interleave(v, n_rep, dim=1)
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(out.transpose(1, 2).reshape(B, S, self.num_heads * self.head_dim))


class GQABlock(nn.Module):
    def __init__(self, hidden: int, native_gqa: bool) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(hidden)
        self.attn = GQAAttention(native_gqa=native_gqa)
        self.mlp_norm = RMSNorm(hidden)
        self.mlp = SwiGLU(hidden, 2 * hidden)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin)
        return x + self.mlp(self.mlp_norm(x))


class GQAModel(nn.Module):
    """Llama-style decoder with grouped-query attention (hidden 64) and an untied lm head.

    Layer 0 uses SDPA's native ``enable_gqa=True``, layer 1 expands KV heads by hand.
    ``forward(input_ids, labels=None) -> (loss, logits)`` like :class:`GPTModel`.
    """

    def __init__(self, vocab_size: int = VOCAB_SIZE, hidden: int = 64) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab_size, hidden)
        self.rotary = RotaryEmbedding(head_dim=8)
        self.layers = nn.ModuleList([GQABlock(hidden, native_gqa=True), GQABlock(hidden, native_gqa=False)])
        self.norm = RMSNorm(hidden)
        self.lm_head = nn.Linear(hidden, vocab_size, bias=False)

    def forward(self, input_ids: Tensor, labels: Tensor | None = None) -> tuple[Tensor | None, Tensor]:
        x = self.embed_tokens(input_ids)
        cos, sin = self.rotary(x)
        for layer in self.layers:
            x = layer(x, cos, sin)
        logits = self.lm_head(self.norm(x))
        loss = hf_shifted_lm_loss(logits, labels) if labels is not None else None
        return loss, logits


class ALiBiBlock(nn.Module):
    """BLOOM's attention spelling: heads folded into the batch for ``bmm``, the ALiBi bias added by
    ``baddbmm(bias, q, k^T, beta, alpha)``, scores viewed ``[B, H, S, S]`` only around the causal
    mask and the softmax, then ``bmm`` with the values on ``[B*H, S, D]`` again."""

    def __init__(self, hidden: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.heads, self.head_dim = heads, hidden // heads
        self.norm = nn.LayerNorm(hidden)
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.out = nn.Linear(hidden, hidden)
        self.mlp = nn.Sequential(nn.LayerNorm(hidden), nn.Linear(hidden, 2 * hidden), nn.GELU(), nn.Linear(2 * hidden, hidden))
        self.register_buffer("slopes", 2.0 ** (-8.0 * torch.arange(1, heads + 1) / heads), persistent=False)

    def forward(self, x: Tensor) -> Tensor:
        b, s, d = x.shape
        q, k, v = self.qkv(self.norm(x)).view(b, s, 3, self.heads, self.head_dim).permute(2, 0, 3, 1, 4)
        q, v = q.reshape(b * self.heads, s, self.head_dim), v.reshape(b * self.heads, s, self.head_dim)
        k = k.reshape(b * self.heads, s, self.head_dim).transpose(-1, -2)
        positions = torch.arange(s, device=x.device, dtype=x.dtype)
        alibi = (self.slopes[:, None] * positions[None, :]).expand(b, -1, -1).reshape(b * self.heads, 1, s)
        scores = alibi.baddbmm(q, k, beta=1.0, alpha=1.0 / math.sqrt(self.head_dim)).view(b, self.heads, s, s)
        causal = torch.ones(s, s, dtype=torch.bool, device=x.device).tril()
        scores = scores + torch.zeros(s, s, dtype=x.dtype, device=x.device).masked_fill(~causal, torch.finfo(x.dtype).min)
        probabilities = F.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        context = torch.bmm(probabilities.view(b * self.heads, s, s), v)
        context = context.view(b, self.heads, s, self.head_dim).permute(0, 2, 1, 3).reshape(b, s, d)
        x = x + self.out(context)
        return x + self.mlp(x)


class ALiBiGPT(nn.Module):
    """A decoder with BLOOM-style ALiBi attention; ``forward(input_ids, labels=None) -> (loss, logits)``."""

    def __init__(self, vocab_size: int = VOCAB_SIZE, hidden: int = 32) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab_size, hidden)
        self.blocks = nn.ModuleList([ALiBiBlock(hidden), ALiBiBlock(hidden)])
        self.norm = nn.LayerNorm(hidden)
        self.lm_head = nn.Linear(hidden, vocab_size, bias=False)

    def forward(self, input_ids: Tensor, labels: Tensor | None = None) -> tuple[Tensor | None, Tensor]:
        x = self.embed(input_ids)
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.norm(x))
        loss = hf_shifted_lm_loss(logits, labels) if labels is not None else None
        return loss, logits


# ---------------------------------------------------------------------------------------------
# 6. No attention at all
# ---------------------------------------------------------------------------------------------


class NoAttentionModel(nn.Module):
    """Token-wise MLP with a LayerNorm and no sequence mixing at all.

    The degenerate case: sharding the sequence must be a no-op for correctness, and a compiler
    that only knows how to handle attention must not choke when there is none.
    ``forward(input_ids [B, S]) -> [B, S, hidden]``.
    """

    def __init__(self, vocab_size: int = VOCAB_SIZE, hidden: int = 32, mlp_hidden: int = 64) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab_size, hidden)
        self.norm = nn.LayerNorm(hidden)
        self.fc1 = nn.Linear(hidden, mlp_hidden)
        self.fc2 = nn.Linear(mlp_hidden, hidden)

    def forward(self, input_ids: Tensor) -> Tensor:
        x = self.embed(input_ids)
        return x + self.fc2(F.gelu(self.fc1(self.norm(x))))


# ---------------------------------------------------------------------------------------------
# 7. Hugging Face models (random init, no downloads)
# ---------------------------------------------------------------------------------------------


def _require_transformers() -> None:
    if not HAS_TRANSFORMERS:
        raise ImportError("this zoo case needs `transformers` (pip install 'dcp-compile[hf]')")


def tiny_llama() -> nn.Module:
    """``LlamaForCausalLM`` with a tiny random config (no download); SDPA attention, GQA 4/2."""
    _require_transformers()
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=64,
        max_position_embeddings=256,
        attention_dropout=0.0,
        use_cache=False,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=None,
        attn_implementation="sdpa",
    )
    return LlamaForCausalLM(config)


def tiny_gpt2(loss_type: str | None = None) -> nn.Module:
    """``GPT2LMHeadModel`` with a tiny random config (no download); SDPA attention, dropouts 0.

    Left stock on purpose, it graph-breaks once under torch.compile: transformers 5 derives
    ``model.loss_type`` from the class name, ``GPT2LMHeadModel`` matches no known loss type, so
    every forward with labels calls ``logger.warning_once`` inside ``loss_function``, which
    Dynamo cannot trace. The model then compiles as two graphs (body, then loss), as it does for
    real users. Pass ``loss_type="ForCausalLM"`` to get a single graph.
    """
    _require_transformers()
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        vocab_size=VOCAB_SIZE,
        n_embd=32,
        n_layer=2,
        n_head=4,
        n_positions=256,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        summary_first_dropout=0.0,
        use_cache=False,
        bos_token_id=0,
        eos_token_id=1,
        attn_implementation="sdpa",
    )
    model = GPT2LMHeadModel(config)
    if loss_type is not None:
        model.loss_type = loss_type
    return model


# ---------------------------------------------------------------------------------------------
# Cases
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ZooCase:
    """One model of the zoo with everything a parity test needs.

    ``build()`` returns a freshly, deterministically initialised fp32 model (same weights every
    call), in training mode as ``nn.Module`` leaves it; all dropout is p=0, so that is deterministic.
    ``make_inputs(seq_len, batch_size=2, seed=0)`` returns the forward kwargs.
    ``loss_of(outputs)`` returns the scalar to backpropagate.
    ``seq_len_of(inputs)`` returns the number of tokens the attention runs over.
    ``causal`` marks models whose outputs at position i depend only on inputs at positions <= i.
    ``max_seq_len`` is the largest ``seq_len`` ``make_inputs`` accepts (None: unbounded).
    ``requires`` lists optional packages the case needs.
    ``expected_graph_breaks`` is what ``torch._dynamo.explain`` reports for the case (the zoo's
    own models have none; see :func:`tiny_gpt2` for the one that does).
    """

    name: str
    factory: Callable[[], nn.Module]
    make_inputs_fn: Callable[[int, int, torch.Generator], dict[str, Tensor]]
    loss_of: Callable[[Any], Tensor]
    seq_len_of: Callable[[Mapping[str, Tensor]], int]
    causal: bool = False
    max_seq_len: int | None = None
    requires: tuple[str, ...] = field(default_factory=tuple)
    expected_graph_breaks: int = 0
    seed: int = BUILD_SEED
    # Mid-graph all-gathers an SP>1 variant may need (each with a reason on the record): 0 for
    # decoders; the DiT gathers once for its unpatchify; GPT-2 gathers its hidden states once for
    # ``hidden_states[:, -logits_to_keep:]``, whose bound arrives as a symbolic int after a graph
    # break in transformers' own code (a logging call for the config's ``loss_type``).
    gather_budget: int = 0

    def build(self) -> nn.Module:
        """Build the model under a fixed seed without disturbing the caller's RNG state."""
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.seed)
            model = self.factory()
        return model.float()

    def make_inputs(self, seq_len: int, batch_size: int = 2, seed: int = 0) -> dict[str, Tensor]:
        if seq_len < 1:
            raise ValueError(f"seq_len must be >= 1, got {seq_len}")
        if self.max_seq_len is not None and seq_len > self.max_seq_len:
            raise ValueError(f"{self.name}: seq_len {seq_len} > max_seq_len {self.max_seq_len}")
        generator = torch.Generator().manual_seed(seed)
        return self.make_inputs_fn(seq_len, batch_size, generator)

    @property
    def available(self) -> bool:
        return all(_has_module(pkg) for pkg in self.requires)


# --- input makers ----------------------------------------------------------------------------


def _lm_inputs(seq_len: int, batch_size: int, g: torch.Generator) -> dict[str, Tensor]:
    input_ids = torch.randint(0, VOCAB_SIZE, (batch_size, seq_len), generator=g)
    return {"input_ids": input_ids, "labels": input_ids.clone()}


def _hf_lm_inputs(seq_len: int, batch_size: int, g: torch.Generator) -> dict[str, Tensor]:
    """``labels`` is the *same tensor* as ``input_ids``, as in ``model(input_ids=ids, labels=ids)``."""
    input_ids = torch.randint(0, VOCAB_SIZE, (batch_size, seq_len), generator=g)
    return {"input_ids": input_ids, "labels": input_ids}


def _ids_only_inputs(seq_len: int, batch_size: int, g: torch.Generator) -> dict[str, Tensor]:
    return {"input_ids": torch.randint(0, VOCAB_SIZE, (batch_size, seq_len), generator=g)}


def _padded_inputs(seq_len: int, batch_size: int, g: torch.Generator) -> dict[str, Tensor]:
    """Right padding: sample ``b`` has its last ``(b * seq_len) // (2 * batch_size)`` tokens masked.

    Sample 0 is never padded and every sample keeps at least one real token, so no softmax
    row is fully masked.
    """
    input_ids = torch.randint(0, VOCAB_SIZE, (batch_size, seq_len), generator=g)
    attention_mask = torch.ones(batch_size, seq_len, dtype=torch.long)
    for b in range(batch_size):
        n_pad = min((b * seq_len) // (2 * batch_size), seq_len - 1)
        if n_pad:
            attention_mask[b, seq_len - n_pad :] = 0
    return {"input_ids": input_ids, "attention_mask": attention_mask}


def _vit_inputs(seq_len: int, batch_size: int, g: torch.Generator) -> dict[str, Tensor]:
    return {
        "tokens": torch.randn(batch_size, seq_len, 24, generator=g),
        "labels": torch.randint(0, 10, (batch_size,), generator=g),
    }


def dit_image_hw(seq_len: int) -> tuple[int, int]:
    """Latent image size (H, W) whose 2x2 patch grid has exactly ``seq_len`` patches.

    Picks the most square grid ``h x w`` with ``h * w == seq_len`` and ``h <= w`` (h is the
    largest divisor of seq_len not above its square root), then ``H, W = 2h, 2w``. Primes
    therefore give a one-row strip ``H = 2, W = 2 * seq_len``; e.g. 16 -> (8, 8), 12 -> (6, 8),
    7 -> (2, 14), 1 -> (2, 2).
    """
    h = max(d for d in range(1, math.isqrt(seq_len) + 1) if seq_len % d == 0)
    return 2 * h, 2 * (seq_len // h)


def _dit_inputs(seq_len: int, batch_size: int, g: torch.Generator) -> dict[str, Tensor]:
    H, W = dit_image_hw(seq_len)
    return {
        "x": torch.randn(batch_size, 4, H, W, generator=g),
        "t": torch.randint(0, 1000, (batch_size,), generator=g),
        "text": torch.randn(batch_size, 77, 48, generator=g),
    }


# --- losses and lengths ----------------------------------------------------------------------


def _joint_dit_inputs(seq_len: int, batch_size: int, g: torch.Generator) -> dict[str, Tensor]:
    H, W = dit_image_hw(seq_len)
    return {"x": torch.randn(batch_size, 4, H, W, generator=g), "text": torch.randn(batch_size, 5, 24, generator=g)}


def _two_stream_inputs(seq_len: int, batch_size: int, g: torch.Generator) -> dict[str, Tensor]:
    return {"video": torch.randn(batch_size, seq_len, 24, generator=g), "audio": torch.randn(batch_size, 5, 16, generator=g)}


def _two_stream_loss(outputs: tuple[Tensor, Tensor]) -> Tensor:
    video, audio = outputs
    return video.float().pow(2).mean() + audio.float().pow(2).mean()


def _video_len(inputs: Mapping[str, Tensor]) -> int:
    return inputs["video"].shape[1]


def _tensor_loss(outputs: Tensor) -> Tensor:
    return outputs.float().pow(2).mean()


def _lm_loss(outputs: Any) -> Tensor:
    """The LM loss; with < 2 positions (no shifted targets, NaN loss) a logits-based stand-in."""
    if isinstance(outputs, Mapping):
        loss, logits = outputs["loss"], outputs["logits"]
    else:
        loss, logits = outputs[0], outputs[1]
    if logits.shape[-2] < 2:
        return logits.float().pow(2).mean()
    return loss


def _first_output(outputs: tuple[Tensor, Tensor]) -> Tensor:
    return outputs[0]


def _ids_len(inputs: Mapping[str, Tensor]) -> int:
    return inputs["input_ids"].shape[1]


def _vit_len(inputs: Mapping[str, Tensor]) -> int:
    return inputs["tokens"].shape[1] + 1  # + CLS


def _grid_image_inputs(seq_len: int, batch_size: int, g: torch.Generator) -> dict[str, Tensor]:
    """``seq_len`` rows of 3 tokens: a chunk boundary falls inside a row unless 2 * P divides it."""
    return {"latent": torch.randn(batch_size, 4, seq_len, 3, generator=g)}


def _grid_video_inputs(seq_len: int, batch_size: int, g: torch.Generator) -> dict[str, Tensor]:
    """``seq_len`` frames of 3x5 tokens."""
    return {"latent": torch.randn(batch_size, 4, seq_len, 3, 5, generator=g)}


def _grid_len(inputs: Mapping[str, Tensor]) -> int:
    return math.prod(inputs["latent"].shape[2:])


def _dit_len(inputs: Mapping[str, Tensor]) -> int:
    _, _, H, W = inputs["x"].shape
    return (H // 2) * (W // 2)


ZOO: dict[str, ZooCase] = {
    case.name: case
    for case in [
        ZooCase("gpt", GPTModel, _lm_inputs, _lm_loss, _ids_len, causal=True),
        ZooCase("dit", DiTBlockModel, _dit_inputs, _tensor_loss, _dit_len, gather_budget=1),
        ZooCase("joint_dit", JointDiTModel, _joint_dit_inputs, _tensor_loss, _dit_len, gather_budget=1),
        ZooCase("vit", ViTModel, _vit_inputs, _first_output, _vit_len, max_seq_len=ViTModel.max_len),
        ZooCase("handwritten_attention", HandwrittenAttentionModel, _padded_inputs, _tensor_loss, _ids_len),
        ZooCase("gqa", GQAModel, _lm_inputs, _lm_loss, _ids_len, causal=True),
        ZooCase("custom_function", CustomFunctionGPT, _lm_inputs, _lm_loss, _ids_len, causal=True),
        ZooCase("moe", MoEGPT, _lm_inputs, _lm_loss, _ids_len, causal=True),
        # Positions by a cumsum over the tokens and the buffer writes gather (3 per layer): the
        # drops are decided on the whole sequence, as in eager. Not causal: the capacity grows
        # with the length.
        ZooCase("moe_capacity", CapacityMoEGPT, _lm_inputs, _lm_loss, _ids_len, gather_budget=6),
        ZooCase("alibi", ALiBiGPT, _lm_inputs, _lm_loss, _ids_len, causal=True),
        ZooCase("two_stream", TwoStreamModel, _two_stream_inputs, _two_stream_loss, _video_len),
        ZooCase("two_stream_by_hand", functools.partial(TwoStreamModel, by_hand=True), _two_stream_inputs,
                _two_stream_loss, _video_len),
        ZooCase("grid_conv_image", GridConvModel, _grid_image_inputs, _tensor_loss, _grid_len),
        ZooCase("grid_conv_video", functools.partial(GridConvModel, video=True), _grid_video_inputs, _tensor_loss,
                _grid_len),
        ZooCase("no_attention", NoAttentionModel, _ids_only_inputs, _tensor_loss, _ids_len),
        ZooCase(
            "hf_llama", tiny_llama, _hf_lm_inputs, _lm_loss, _ids_len,
            causal=True, max_seq_len=256, requires=("transformers",),
        ),
        ZooCase(
            "hf_gpt2", tiny_gpt2, _hf_lm_inputs, _lm_loss, _ids_len,
            causal=True, max_seq_len=256, requires=("transformers",), expected_graph_breaks=1, gather_budget=1,
        ),
    ]
}


# ---------------------------------------------------------------------------------------------
# Reference computation
# ---------------------------------------------------------------------------------------------


def output_tensors(outputs: Any) -> dict[str, Tensor]:
    """Flatten a model's outputs (tensor, tuple, dict or HF ``ModelOutput``) to named tensors.

    Non-tensor entries (e.g. ``loss=None``) are dropped; tuple entries are named by index.
    """
    if isinstance(outputs, Tensor):
        return {"output": outputs}
    if isinstance(outputs, Mapping):
        return {str(k): v for k, v in outputs.items() if isinstance(v, Tensor)}
    if isinstance(outputs, (tuple, list)):
        return {str(i): v for i, v in enumerate(outputs) if isinstance(v, Tensor)}
    raise TypeError(f"unsupported output type {type(outputs).__name__}")


def _detach(outputs: Any) -> Any:
    if isinstance(outputs, Tensor):
        return outputs.detach()
    if isinstance(outputs, Mapping):
        items = {k: _detach(v) for k, v in outputs.items()}
        try:
            return type(outputs)(**items)  # keeps HF ModelOutput types
        except TypeError:
            return items
    if isinstance(outputs, (tuple, list)):
        return type(outputs)(_detach(v) for v in outputs)
    return outputs


def eager_reference(
    case: ZooCase, seq_len: int, batch_size: int = 2, seed: int = 0
) -> tuple[Any, dict[str, Tensor]]:
    """Ground truth for parity tests: eager fp32 forward + backward of ``case.loss_of`` in this process.

    Returns ``(detached outputs, {parameter name: gradient})``; parameters without a gradient
    are left out. Tied parameters appear once, under their first name.
    """
    model = case.build()
    inputs = case.make_inputs(seq_len, batch_size=batch_size, seed=seed)
    outputs = model(**inputs)
    case.loss_of(outputs).backward()
    grads = {
        name: param.grad.detach().clone() for name, param in model.named_parameters() if param.grad is not None
    }
    return _detach(outputs), grads
