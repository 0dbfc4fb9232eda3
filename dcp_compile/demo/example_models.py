"""Small models the demo, the tests and the benchmarks train: plain PyTorch, no DCP code in them.

:class:`TinyGPT` is a GPT-style decoder; :class:`VideoDiT` a video diffusion transformer with
cross-attention to a per-clip caption (the kind of model the published DCP system trains), with
:func:`video_dit_inputs` to make its inputs for a clip shape.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F


class Block(nn.Module):
    def __init__(self, hidden: int, heads: int):
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(hidden)
        self.qkv = nn.Linear(hidden, 3 * hidden, bias=False)
        self.proj = nn.Linear(hidden, hidden, bias=False)
        self.norm2 = nn.LayerNorm(hidden)
        self.mlp = nn.Sequential(nn.Linear(hidden, 4 * hidden), nn.GELU(), nn.Linear(4 * hidden, hidden))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        batch, length, hidden = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(batch, length, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        attention = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attention.transpose(1, 2).reshape(batch, length, hidden))
        return x + self.mlp(self.norm2(x))


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-second, first], dim=-1) * sin


class TinyGPT(nn.Module):
    """GPT-style decoder: RoPE from ``arange``, causal SDPA, shifted-label cross-entropy."""

    def __init__(self, vocab: int = 512, hidden: int = 128, layers: int = 2, heads: int = 4):
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.blocks = nn.ModuleList(Block(hidden, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(hidden)
        self.head = nn.Linear(hidden, vocab, bias=False)
        head_dim = hidden // heads
        self.register_buffer("inv_freq", 1.0 / 10000 ** (torch.arange(0, head_dim, 2).float() / head_dim), persistent=False)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor,
                position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """``position_ids`` ``[B, S]``: RoPE positions, for packed rows where they restart per sequence."""
        if position_ids is None:
            positions = torch.arange(input_ids.shape[1], device=input_ids.device).float()
            angles = torch.outer(positions, self.inv_freq)  # [S, D/2], broadcast over batch and heads
        else:
            angles = (position_ids.float()[..., None] * self.inv_freq).unsqueeze(1)  # [B, 1, S, D/2]
        cos, sin = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()
        x = self.embed(input_ids)
        for block in self.blocks:
            x = block(x, cos, sin)
        logits = self.head(self.norm(x)).float()
        shifted = F.pad(labels, (0, 1), value=-100)[:, 1:]
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), shifted.reshape(-1), ignore_index=-100)


# ---------------------------------------------------------------------------------------------
# A small video DiT: what the published DCP system trains (Open-Sora), at toy size
# ---------------------------------------------------------------------------------------------
def timestep_embedding(t: torch.Tensor, dim: int, max_period: float = 10000.0) -> torch.Tensor:
    """DiT/ADM sinusoidal embedding of diffusion times ``t`` [B] -> [B, dim]."""
    half = dim // 2
    freqs = torch.exp(-math.log(max_period) * torch.arange(half, dtype=torch.float32, device=t.device) / half)
    angles = t[:, None].float() * freqs[None]
    return torch.cat([torch.cos(angles), torch.sin(angles)], dim=-1)


def coordinate_embedding(coords: torch.Tensor, dim: int, max_period: float = 10000.0) -> torch.Tensor:
    """Sinusoidal embedding of each token's (frame, row, column) ``coords`` [B, N, 3] -> [B, N, dim]:
    a third of the channels per axis, as Open-Sora's and Latte's fixed 3-D sin-cos tables. Per
    token, so it shards with the tokens (no table indexed by position)."""
    per_axis = dim // 3 // 2 * 2
    half = per_axis // 2
    freqs = torch.exp(-math.log(max_period) * torch.arange(half, dtype=torch.float32, device=coords.device) / half)
    angles = coords.float()[..., None] * freqs  # [B, N, 3, half]
    table = torch.cat([torch.cos(angles), torch.sin(angles)], dim=-1).flatten(-2)  # [B, N, 3 * per_axis]
    return F.pad(table, (0, dim - table.shape[-1]))


def modulate(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """adaLN: per-sample shift and scale [B, hidden], broadcast over the tokens."""
    return x * (1 + scale.unsqueeze(1)) + shift.unsqueeze(1)


class VideoDiTBlock(nn.Module):
    """Self-attention over every latent token of the clip (full 3-D attention, as Wan, CogVideoX
    and Open-Sora 2.0), cross-attention to the clip's caption, MLP; adaLN-single modulation from
    the timestep (PixArt / STDiT3: one shared projection, a learnt per-block table added to it).

    The caption's keys and values are computed from the whole caption in every cross-attention.
    Under sequence parallelism only the video tokens are sharded: every rank of an SP group
    computes the caption's key/value projections in full (VideoSys ``kv_linear(cond)``). That is
    the per-sample work the cost model's ``context_flops_per_sequence`` prices.
    """

    def __init__(self, hidden: int, heads: int, mlp_ratio: int = 4):
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(hidden, elementwise_affine=False, eps=1e-6)
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.proj = nn.Linear(hidden, hidden)
        self.cross_q = nn.Linear(hidden, hidden)
        self.cross_kv = nn.Linear(hidden, 2 * hidden)
        self.cross_proj = nn.Linear(hidden, hidden)
        self.norm2 = nn.LayerNorm(hidden, elementwise_affine=False, eps=1e-6)
        self.mlp = nn.Sequential(nn.Linear(hidden, mlp_ratio * hidden), nn.GELU(approximate="tanh"),
                                 nn.Linear(mlp_ratio * hidden, hidden))
        self.scale_shift_table = nn.Parameter(torch.randn(6, hidden) / hidden**0.5)

    def _heads(self, x: torch.Tensor) -> torch.Tensor:  # [B, S, hidden] -> [B, heads, S, head_dim]
        return x.unflatten(-1, (self.heads, -1)).transpose(1, 2)

    def forward(self, x: torch.Tensor, timestep: torch.Tensor, text: torch.Tensor) -> torch.Tensor:
        batch, length, hidden = x.shape
        modulation = (self.scale_shift_table[None] + timestep.unflatten(-1, (6, hidden))).unbind(1)
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = modulation
        q, k, v = self.qkv(modulate(self.norm1(x), shift_msa, scale_msa)).chunk(3, dim=-1)
        attention = F.scaled_dot_product_attention(self._heads(q), self._heads(k), self._heads(v))
        x = x + gate_msa.unsqueeze(1) * self.proj(attention.transpose(1, 2).reshape(batch, length, hidden))
        text_k, text_v = self.cross_kv(text).chunk(2, dim=-1)  # the caption: every rank, in full
        cross = F.scaled_dot_product_attention(self._heads(self.cross_q(x)), self._heads(text_k), self._heads(text_v))
        x = x + self.cross_proj(cross.transpose(1, 2).reshape(batch, length, hidden))
        return x + gate_mlp.unsqueeze(1) * self.mlp(modulate(self.norm2(x), shift_mlp, scale_mlp))


class VideoDiT(nn.Module):
    """A small video diffusion transformer trained with the rectified-flow loss (Open-Sora 1.2+).

    ``forward(patches, target, coords, t, text) -> loss``: ``patches`` [B, N, patch_dim] are the
    clip's noised latent patches (``N`` = frames x rows x columns of patches, one token each;
    patchified by the data pipeline, so a clip of any shape is a token sequence), ``target`` [B, N,
    patch_dim] the velocity to predict, ``coords`` [B, N, 3] each token's (frame, row, column),
    ``t`` [B] the diffusion time, ``text`` [B, text_tokens, hidden] the caption embedding (a
    fixed number of tokens per clip, as T5's 300 in Open-Sora). The loss is the mean squared error
    over every element; inside the model, so that no rank gathers the prediction (the mean over
    the sharded tokens is a local sum and an all-reduce).
    """

    def __init__(self, patch_dim: int = 16, hidden: int = 128, heads: int = 4, layers: int = 2, freq_dim: int = 64):
        super().__init__()
        self.hidden = hidden
        self.freq_dim = freq_dim
        self.embed = nn.Linear(patch_dim, hidden)
        self.t_embedder = nn.Sequential(nn.Linear(freq_dim, hidden), nn.SiLU(), nn.Linear(hidden, hidden))
        self.t_block = nn.Sequential(nn.SiLU(), nn.Linear(hidden, 6 * hidden))
        self.text_norm = nn.LayerNorm(hidden)
        self.blocks = nn.ModuleList(VideoDiTBlock(hidden, heads) for _ in range(layers))
        self.norm_out = nn.LayerNorm(hidden, elementwise_affine=False, eps=1e-6)
        self.out_table = nn.Parameter(torch.randn(2, hidden) / hidden**0.5)
        self.out = nn.Linear(hidden, patch_dim)

    def forward(self, patches: torch.Tensor, target: torch.Tensor, coords: torch.Tensor, t: torch.Tensor,
                text: torch.Tensor) -> torch.Tensor:
        x = self.embed(patches) + coordinate_embedding(coords, self.hidden)
        c = self.t_embedder(timestep_embedding(t, self.freq_dim))  # [B, hidden]
        timestep = self.t_block(c)  # [B, 6 * hidden], shared by every block
        text = self.text_norm(text)
        for block in self.blocks:
            x = block(x, timestep, text)
        shift, scale = (self.out_table[None] + c[:, None]).unbind(1)
        prediction = self.out(modulate(self.norm_out(x), shift, scale))
        return ((prediction - target) ** 2).mean()


def video_dit_inputs(shape: tuple[int, int, int], batch: int, generator: torch.Generator, patch_dim: int = 16,
                     hidden: int = 128, text_tokens: int = 120) -> dict[str, torch.Tensor]:
    """Random inputs of :class:`VideoDiT` for ``batch`` clips of ``shape`` = (frames, rows,
    columns) of patches: clean latents and noise drawn from ``generator``, a rectified-flow time
    per clip, the noised patches ``(1 - t) x + t noise`` and the velocity target ``noise - x``."""
    frames, rows, columns = shape
    tokens = frames * rows * columns
    clean = torch.randn(batch, tokens, patch_dim, generator=generator)
    noise = torch.randn(batch, tokens, patch_dim, generator=generator)
    t = torch.rand(batch, generator=generator)
    grid = torch.stack(torch.meshgrid(torch.arange(frames), torch.arange(rows), torch.arange(columns), indexing="ij"), -1)
    return {
        "patches": (1 - t[:, None, None]) * clean + t[:, None, None] * noise,
        "target": noise - clean,
        "coords": grid.reshape(1, tokens, 3).expand(batch, tokens, 3).float().contiguous(),
        "t": t * 1000,
        "text": torch.randn(batch, text_tokens, hidden, generator=generator),
    }
