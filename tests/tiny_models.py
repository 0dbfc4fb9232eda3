"""The tiny random Hugging Face model the integration tests train (nothing downloaded; a test fixture, not shipped)."""

from __future__ import annotations

import torch


def tiny_llama(vocab_size: int = 64, seed: int = 0) -> torch.nn.Module:
    """A 2-layer ``LlamaForCausalLM`` of width 32 with grouped-query attention (4 heads, 2 KV
    heads), SDPA attention and no K/V cache, seeded so every rank builds the same weights."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab_size, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=64, max_position_embeddings=512, use_cache=False, bos_token_id=0, eos_token_id=1,
        pad_token_id=None, attn_implementation="sdpa",
    )
    return LlamaForCausalLM(config)
