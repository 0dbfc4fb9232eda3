"""The tiled loss as the compiler and the cost model share it: when a variant tiles, and what a chunk holds.

A language model's head (output projection, cross-entropy) is the largest per-token tensor a
long sequence holds: the fp32 log-probabilities kept for backward and two fp32 gradients of the
same ``[tokens, vocab]`` size in backward (about 1.5 MB per token for Llama-3-8B). The tiled loss
(``dcp::tiled_cross_entropy``, :mod:`dcp_compile.kernels.tiled_cross_entropy`; built by the
compiler pass ``tile_loss``) computes the projection and the loss over chunks of
:data:`LOSS_CHUNK_TOKENS` tokens and recomputes each chunk's logits in backward, so no more than one
chunk's logits exist at a time.

It is the head's recomputation, so the recompute policy decides it (:func:`tiles_loss`): every
policy but ``none`` tiles. Its price is one more output-projection matmul (forward work, in
backward) under ``attention`` and ``selective``; ``full`` and ``block`` recompute the head in
backward already, so there it costs nothing. ``none`` is the fastest policy, the one the planner
takes where memory does not bind, and keeps the logits. Measured on CPU (one thread, 4,096 tokens,
width 512, vocabulary 16,000, fp32): the head's forward and backward take 2.81 s plain and
3.54-3.66 s tiled (1, 4 or 8 chunks), the difference about one output-projection matmul
(0.90 s). For Llama-3-8B that matmul is about 2% of a step's matmul work at short lengths (less
where attention dominates): not negligible next to what the planner's choices gain, so ``none``
does not pay it.

Neither the compiler nor the scheduler imports the other: both read this module.
"""

from __future__ import annotations

from typing import Any

LOSS_CHUNK_TOKENS = 4096  # the most tokens a default chunk holds
LOSS_CHUNK_BYTES = 1 << 30  # and the most bytes: a large vocabulary gets shorter chunks (Llama 3: 837 tokens)


def tiles_loss(recompute: Any) -> bool:
    """Whether a variant under ``recompute`` (a policy, a per-layer mix, or their names) computes a
    language model's loss in chunks: every policy but ``none`` (a mix's head runs under its
    checkpointed policy, so a mix tiles too)."""
    return str(getattr(recompute, "value", recompute)) != "none"


def loss_chunk_bytes(chunk_tokens: int, vocab_size: int, dtype_bytes: int, upcast: bool = True) -> int:
    """The most bytes one chunk of ``dcp::tiled_cross_entropy`` holds at once, forward or backward:
    the chunk's logits in the model's dtype, their fp32 copy where the model upcasts them (none
    in fp32), and one more fp32 ``[chunk, vocab]`` tensor (forward: the log-probabilities;
    backward: ``softmax - onehot``, turned into the gradient of the logits in place)."""
    upcast_copy = 4 if upcast and dtype_bytes < 4 else 0
    return chunk_tokens * vocab_size * (dtype_bytes + upcast_copy + 4)


def default_chunk_tokens(vocab_size: int, dtype_bytes: int, upcast: bool = True) -> int:
    """The chunk the backend tiles with unless ``options={"loss_chunk": n}`` says otherwise, and the
    cost model prices: :data:`LOSS_CHUNK_TOKENS` tokens, fewer where that many would hold more than
    :data:`LOSS_CHUNK_BYTES` (:func:`loss_chunk_bytes`). Why a bound in bytes: a chunk is a fixed
    amount the device holds whatever the length, and Llama 3's 128,256-entry vocabulary would make
    a 4,096-token chunk 5.3 GB; a shorter one costs only more, smaller matmuls."""
    per_token = loss_chunk_bytes(1, max(1, vocab_size), dtype_bytes, upcast)
    return max(1, min(LOSS_CHUNK_TOKENS, LOSS_CHUNK_BYTES // per_token))
