"""The tiled MLP as the compiler and the cost model share it: when a variant tiles, what a chunk holds.

Under whole-block checkpointing a layer's backward rebuilds its MLP whole: for Llama-3-8B four
``ffn``-wide tensors (gate, up, the activation, the product: 115 KB per token) and three
``ffn``-wide gradients beside them, the largest working set left once the block inputs are
offloaded. ALST (arXiv 2506.13996) runs the MLP over chunks of tokens in forward and backward
(its TiledMLP); ``recompute=lean`` does (``dcp::tiled_mlp``, built by the compiler pass
``tile_mlp``), so the ``ffn``-wide tensors exist one chunk at a time, a fixed amount whatever the
length. Its price: backward runs the MLP's forward once more per chunk (the block's own
recomputation runs it once already, tiled, keeping nothing).

Neither the compiler nor the scheduler imports the other: both read this module.
"""

from __future__ import annotations

MLP_CHUNK_TOKENS = 4096  # the most tokens a default chunk holds
MLP_CHUNK_BYTES = 1 << 30  # and the most bytes (a very wide MLP gets shorter chunks)


def mlp_chunk_bytes(chunk_tokens: int, ffn_hidden_size: int, gated: bool, dtype_bytes: int) -> int:
    """The most bytes one chunk of ``dcp::tiled_mlp``'s backward holds at once: ``ffn``-wide
    tensors of the chunk in the model's dtype, 5 for a gated MLP (gate and up rebuilt, the
    activation, then the gradients of the product, of the up projection and of the gate, each
    freed as soon as the next no longer needs it), 3 for a plain one; measured so on CPU by
    ``tests/passes/test_tiled_mlp.py``. The forward holds 2."""
    widths = 5 if gated else 3
    return chunk_tokens * ffn_hidden_size * widths * dtype_bytes


def default_mlp_chunk_tokens(ffn_hidden_size: int, gated: bool, dtype_bytes: int) -> int:
    """The chunk the backend tiles with unless ``options={"mlp_chunk": n}`` says otherwise, and the
    cost model prices: :data:`MLP_CHUNK_TOKENS` tokens, fewer where that many would hold more
    than :data:`MLP_CHUNK_BYTES` (:func:`mlp_chunk_bytes`)."""
    per_token = mlp_chunk_bytes(1, max(1, ffn_hidden_size), gated, dtype_bytes)
    return max(1, min(MLP_CHUNK_TOKENS, MLP_CHUNK_BYTES // per_token))
