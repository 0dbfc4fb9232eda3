"""``dcp::tiled_cross_entropy``: the output projection and cross-entropy over chunks of tokens.

A language model's head turns each token's hidden state into ``vocab`` logits and the loss reads
them once; eager keeps the whole sequence's fp32 log-probabilities for backward and backward holds
two more ``[tokens, vocab]`` fp32 tensors (the gradients of the log-probabilities and of the
logits). For Llama-3-8B (vocabulary 128,256) that is about 1.5 MB per token: most of what a rank
holds at long lengths. ALST (arXiv 2506.13996) computes the loss over chunks of tokens instead;
so does this op:

* forward: for each chunk of ``chunk`` tokens, the chunk's logits (``hidden @ weight.T + bias``,
  upcast to fp32 where the model upcasts them), its loss summed over its tokens; returns the sum
  over all chunks (the caller divides by the count of counted tokens for a mean, or all-reduces
  the sum over the SP group first);
* backward (``dcp::tiled_cross_entropy_backward``, its own op so that a compiled backward calls it
  as one kernel): recomputes each chunk's logits and returns the gradients of the hidden states,
  of the weight and of the bias; ``softmax - onehot`` for the chunk, scaled by the loss's gradient
  and zero on ignored tokens, is all it holds of the vocabulary at a time.

Neither holds more than one chunk's logits. What backward keeps from forward: the hidden states,
the weight (a parameter), the bias and the targets. ``logits``: where the model also returns its
logits (Hugging Face's ``CausalLMOutputWithPast.logits``), the forward reads each chunk's logits
from them instead of computing them again; backward still recomputes them, so nothing
``[tokens, vocab]``-sized is kept for it either way.

Exact: per chunk this is the loss and gradient eager computes (the same matmul on fewer rows, the
same softmax), summed over chunks. With a low-precision weight the weight's gradient is
accumulated over chunks in the weight's dtype (one rounding per chunk; eager rounds once).
Plain torch: the matmuls and softmax are the device's own kernels on every device.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F


def _loss_dtype(weight: torch.Tensor, upcast: bool) -> torch.dtype:
    return torch.float32 if upcast else weight.dtype


def _chunk_logits(hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], upcast: bool) -> torch.Tensor:
    logits = F.linear(hidden, weight, bias)
    return logits.float() if upcast else logits


@torch.library.custom_op("dcp::tiled_cross_entropy", mutates_args=())
def tiled_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    target: torch.Tensor,
    logits: Optional[torch.Tensor],
    ignore_index: int,
    chunk: int,
    upcast: bool,
) -> torch.Tensor:
    """The sum over tokens of ``cross_entropy(hidden @ weight.T + bias, target)`` (tokens whose
    target is ``ignore_index`` count 0), computed ``chunk`` tokens at a time. ``hidden`` is
    ``[tokens, features]``, ``target`` ``[tokens]``; ``logits`` (optional, ``[tokens, vocab]``):
    the logits already computed, read chunk by chunk instead of computed."""
    loss_dtype = _loss_dtype(weight, upcast)
    total = torch.zeros((), dtype=torch.promote_types(torch.float32, loss_dtype), device=hidden.device)
    tokens = hidden.shape[0]
    for start in range(0, tokens, chunk):
        stop = min(tokens, start + chunk)
        if logits is not None:
            chunk_logits = logits[start:stop].float() if upcast else logits[start:stop]
        else:
            chunk_logits = _chunk_logits(hidden[start:stop], weight, bias, upcast)
        loss = F.cross_entropy(chunk_logits, target[start:stop], ignore_index=ignore_index, reduction="sum")
        total += loss
        del chunk_logits, loss
    return total.to(loss_dtype)


@tiled_cross_entropy.register_fake
def _(hidden, weight, bias, target, logits, ignore_index, chunk, upcast):
    return hidden.new_empty((), dtype=_loss_dtype(weight, upcast))


@torch.library.custom_op("dcp::tiled_cross_entropy_backward", mutates_args=())
def tiled_cross_entropy_backward(
    grad: torch.Tensor,
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    target: torch.Tensor,
    ignore_index: int,
    chunk: int,
    upcast: bool,
) -> list[torch.Tensor]:
    """``[grad_hidden, grad_weight]`` (and ``grad_bias`` when there is a bias) of
    :func:`tiled_cross_entropy`'s sum, scaled by ``grad``, each chunk's logits recomputed."""
    grad_hidden = torch.empty_like(hidden)
    grad_weight = torch.zeros_like(weight)
    grad_bias = torch.zeros_like(bias) if bias is not None else None
    tokens = hidden.shape[0]
    for start in range(0, tokens, chunk):
        stop = min(tokens, start + chunk)
        rows = hidden[start:stop]
        chunk_target = target[start:stop]
        # softmax - onehot on counted tokens, 0 on ignored ones: the gradient of the summed loss.
        probabilities = torch.softmax(_chunk_logits(rows, weight, bias, upcast), dim=-1)
        counted = chunk_target != ignore_index
        picked = torch.where(counted, chunk_target, 0).unsqueeze(-1)
        probabilities.scatter_add_(-1, picked, -counted.to(probabilities.dtype).unsqueeze(-1))
        probabilities.mul_((counted.to(probabilities.dtype) * grad.to(probabilities.dtype)).unsqueeze(-1))
        grad_logits = probabilities.to(weight.dtype)
        del probabilities
        torch.mm(grad_logits, weight, out=grad_hidden[start:stop])
        grad_weight.addmm_(grad_logits.t(), rows)
        if grad_bias is not None:
            grad_bias.add_(grad_logits.sum(0))
        del grad_logits
    return [grad_hidden, grad_weight] + ([grad_bias] if grad_bias is not None else [])


@tiled_cross_entropy_backward.register_fake
def _(grad, hidden, weight, bias, target, ignore_index, chunk, upcast):
    grads = [torch.empty_like(hidden), torch.empty_like(weight)]
    return grads + ([torch.empty_like(bias)] if bias is not None else [])


def _setup_context(ctx, inputs, output) -> None:
    hidden, weight, bias, target, _logits, ignore_index, chunk, upcast = inputs
    ctx.save_for_backward(hidden, weight, bias, target)
    ctx.ignore_index, ctx.chunk, ctx.upcast = ignore_index, chunk, upcast


def _backward(ctx, grad: torch.Tensor):
    hidden, weight, bias, target = ctx.saved_tensors
    grads = torch.ops.dcp.tiled_cross_entropy_backward(grad, hidden, weight, bias, target, ctx.ignore_index,
                                                       ctx.chunk, ctx.upcast)
    grad_bias = grads[2] if bias is not None else None
    return grads[0], grads[1], grad_bias, None, None, None, None, None


tiled_cross_entropy.register_autograd(_backward, setup_context=_setup_context)

