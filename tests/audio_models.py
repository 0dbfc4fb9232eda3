"""A small audio encoder, written the way speech models are (Whisper, Speech2Text): mel frames
``[B, T, n_mels]`` go through convolutions over positions, the second with stride 2, and the
encoder attends over the ``(T - 1) // 2 + 1`` downsampled positions. Odd and even ``T`` give
different chunk boundaries between the frames and the positions."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

MELS, WIDTH, HEADS = 8, 16, 2


class StridedAudioEncoder(nn.Module):
    def __init__(self, layers: int = 2) -> None:
        super().__init__()
        self.conv1 = nn.Conv1d(MELS, WIDTH, 3, padding=1)
        self.conv2 = nn.Conv1d(WIDTH, WIDTH, 3, stride=2, padding=1)
        self.qkv = nn.ModuleList(nn.Linear(WIDTH, 3 * WIDTH) for _ in range(layers))
        self.out = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(layers))
        self.norm = nn.LayerNorm(WIDTH)

    def forward(self, mels: torch.Tensor) -> torch.Tensor:
        x = F.gelu(self.conv1(mels.transpose(1, 2)))
        x = F.gelu(self.conv2(x)).transpose(1, 2)  # [B, (T - 1) // 2 + 1, WIDTH]
        b, n, _ = x.shape
        for qkv, out in zip(self.qkv, self.out):
            q, k, v = qkv(self.norm(x)).view(b, n, 3, HEADS, WIDTH // HEADS).permute(2, 0, 3, 1, 4)
            x = x + out(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, n, WIDTH))
        return x


def build_audio_encoder() -> StridedAudioEncoder:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return StridedAudioEncoder()


def mel_frames(length: int, batch: int = 2) -> torch.Tensor:
    return torch.randn(batch, length, MELS, generator=torch.Generator().manual_seed(length))


def audio_worker(rank: int, world_size: int, lengths: list[int]) -> dict:
    from sequence_programs import check_model

    problems, seen = check_model("strided_audio_encoder", build_audio_encoder, mel_frames, lengths)
    return {"problems": problems, **seen}


def build_speech2text() -> nn.Module:
    """transformers' Speech2Text (an audio encoder-decoder: a strided Conv1d subsampler, then
    attention), tiny, fp32, no dropout."""
    from transformers import Speech2TextConfig, Speech2TextForConditionalGeneration

    config = Speech2TextConfig(
        vocab_size=32, d_model=16, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32, input_feat_per_channel=MELS,
        input_channels=1, conv_channels=16, conv_kernel_sizes=[5, 5], num_conv_layers=2, dropout=0.0,
        attention_dropout=0.0, activation_dropout=0.0, max_source_positions=256, max_target_positions=64,
        attn_implementation="eager")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return Speech2TextWrapper(Speech2TextForConditionalGeneration(config))


class Speech2TextWrapper(nn.Module):
    """Mel frames in, the encoder-decoder's logits for a fixed 5-token text out."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, mels: torch.Tensor) -> torch.Tensor:
        text = torch.arange(5, device=mels.device)[None].expand(mels.shape[0], 5) % 32
        return self.model(input_features=mels, decoder_input_ids=text).logits


def speech2text_worker(rank: int, world_size: int, lengths: list[int]) -> dict:
    from sequence_programs import check_model

    problems, seen = check_model("speech2text", build_speech2text, mel_frames, lengths)
    return {"problems": problems, **seen}


class DownsamplingEncoder(nn.Module):
    """Attention over the frames, a stride-2 convolution over positions, attention over the
    downsampled positions (a hierarchical speech encoder's stage boundary)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(MELS, WIDTH)
        self.down = nn.Conv1d(WIDTH, WIDTH, 3, stride=2, padding=1)
        self.qkv = nn.ModuleList(nn.Linear(WIDTH, 3 * WIDTH) for _ in range(3))
        self.out = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(3))

    def attend(self, index: int, x: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        q, k, v = self.qkv[index](x).view(b, n, 3, HEADS, WIDTH // HEADS).permute(2, 0, 3, 1, 4)
        return x + self.out[index](F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, n, WIDTH))

    def forward(self, mels: torch.Tensor) -> torch.Tensor:
        x = self.attend(1, self.attend(0, self.proj(mels)))
        x = self.down(x.transpose(1, 2)).transpose(1, 2)
        return self.attend(2, x)


def build_downsampling_encoder() -> DownsamplingEncoder:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return DownsamplingEncoder()


def downsampling_worker(rank: int, world_size: int, lengths: list[int]) -> dict:
    from sequence_programs import check_model

    problems, seen = check_model("downsampling_encoder", build_downsampling_encoder, mel_frames, lengths)
    return {"problems": problems, **seen}


def strided_models_worker(rank: int, world_size: int, lengths: list[int], with_transformers: bool) -> dict:
    """Every strided-convolution model at ``lengths``, in one process world."""
    from sequence_programs import check_model

    models = {"strided_audio_encoder": build_audio_encoder, "downsampling_encoder": build_downsampling_encoder}
    if with_transformers:
        models["speech2text"] = build_speech2text
    results = {}
    for name, factory in models.items():
        problems, seen = check_model(name, factory, mel_frames, lengths)
        results[name] = {"problems": problems, **seen}
    return results
