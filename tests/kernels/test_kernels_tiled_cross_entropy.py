"""``dcp::tiled_cross_entropy`` against the plain computation it replaces: ``F.cross_entropy`` of
``F.linear(hidden, weight, bias)`` (summed over the tokens), forward and backward, with ignored
targets, chunks that do not divide the tokens, an empty input, a bias, an fp32 upcast of bf16
logits, logits handed in, and under ``torch.compile`` with a symbolic token count."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dcp_compile.kernels.tiled_cross_entropy import tiled_cross_entropy

IGNORE = -100


def make(tokens: int, features: int = 16, vocab: int = 50, bias: bool = False, dtype=torch.float32, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(tokens, features, generator=generator, dtype=dtype).requires_grad_()
    weight = torch.randn(vocab, features, generator=generator, dtype=dtype).requires_grad_()
    b = torch.randn(vocab, generator=generator, dtype=dtype).requires_grad_() if bias else None
    target = torch.randint(0, vocab, (tokens,), generator=generator)
    target[::3] = IGNORE  # every third token ignored
    return hidden, weight, b, target


def leaves(hidden, weight, bias):
    return [hidden, weight] + ([bias] if bias is not None else [])


def plain(hidden, weight, bias, target, upcast: bool = False):
    logits = F.linear(hidden, weight, bias)
    return F.cross_entropy(logits.float() if upcast else logits, target, ignore_index=IGNORE, reduction="sum")


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("chunk", [1, 8, 37, 4096])
def test_forward_and_backward_equal_the_plain_loss(bias: bool, chunk: int) -> None:
    hidden, weight, b, target = make(37, bias=bias)  # 37 tokens: chunks of 8 leave 5
    expected = plain(hidden, weight, b, target)
    expected_grads = torch.autograd.grad(expected * 0.7, leaves(hidden, weight, b))
    loss = tiled_cross_entropy(hidden, weight, b, target, None, IGNORE, chunk, False)
    grads = torch.autograd.grad(loss * 0.7, leaves(hidden, weight, b))
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-5)
    for got, want in zip(grads, expected_grads):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_gradients_pass_gradcheck_in_float64() -> None:
    hidden, weight, b, target = make(11, features=4, vocab=7, bias=True, dtype=torch.float64)
    assert torch.autograd.gradcheck(
        lambda h, w, bb: tiled_cross_entropy(h, w, bb, target, None, IGNORE, 4, False), (hidden, weight, b))


def test_logits_handed_in_give_the_same_loss_and_gradients() -> None:
    """Where the model also returns its logits, the forward reads them instead of computing them;
    the gradient still comes through the hidden states and the weight (backward recomputes)."""
    hidden, weight, b, target = make(23, bias=True)
    logits = F.linear(hidden, weight, b).detach()
    loss = tiled_cross_entropy(hidden, weight, b, target, logits, IGNORE, 5, False)
    grads = torch.autograd.grad(loss, leaves(hidden, weight, b))
    expected = plain(hidden, weight, b, target)
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-5)
    for got, want in zip(grads, torch.autograd.grad(expected, leaves(hidden, weight, b))):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_bf16_logits_upcast_to_fp32_as_the_model_does() -> None:
    """``logits.float()`` before the loss (Hugging Face's ``ForCausalLMLoss``): the loss in fp32,
    the gradients in bf16 (the weight's accumulated over chunks in bf16: one rounding per chunk)."""
    hidden, weight, _, target = make(40, features=32, vocab=64, dtype=torch.bfloat16)
    expected = plain(hidden, weight, None, target, upcast=True)
    expected_grads = torch.autograd.grad(expected, [hidden, weight])
    loss = tiled_cross_entropy(hidden, weight, None, target, None, IGNORE, 16, True)
    grads = torch.autograd.grad(loss, [hidden, weight])
    assert loss.dtype == torch.float32 and grads[0].dtype == torch.bfloat16
    torch.testing.assert_close(loss, expected, rtol=1e-4, atol=1e-3)
    for got, want in zip(grads, expected_grads):
        torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)


def test_no_tokens_and_no_counted_tokens_give_zero() -> None:
    """An empty chunk of the sequence (a rank whose share is empty) and a chunk whose targets are
    all ignored: the summed loss is 0 and so are the gradients, as for the plain sum."""
    hidden, weight, _, target = make(0)
    loss = tiled_cross_entropy(hidden, weight, None, target, None, IGNORE, 8, False)
    loss.backward()
    assert loss.item() == 0.0 and hidden.grad.shape == (0, 16) and not weight.grad.any()
    hidden, weight, _, target = make(9)
    target.fill_(IGNORE)
    loss = tiled_cross_entropy(hidden, weight, None, target, None, IGNORE, 4, False)
    loss.backward()
    assert loss.item() == 0.0 and not hidden.grad.any() and not weight.grad.any()


def test_the_op_passes_opcheck() -> None:
    """Schema, fake implementation and autograd registration agree with the implementation."""
    hidden, weight, b, target = make(13, bias=True)
    torch.library.opcheck(torch.ops.dcp.tiled_cross_entropy.default,
                          (hidden, weight, b, target, None, IGNORE, 4, False))
    grad = torch.tensor(0.5)
    torch.library.opcheck(torch.ops.dcp.tiled_cross_entropy_backward.default,
                          (grad, hidden.detach(), weight.detach(), b.detach(), target, IGNORE, 4, False))


def test_compiles_once_for_every_token_count() -> None:
    """Under ``torch.compile(dynamic=True)`` the op traces with a symbolic token count (its fake
    returns a scalar, its backward's fake the inputs' shapes), and a new length does not re-trace."""
    torch._dynamo.reset()

    def head(hidden, weight, target):
        return tiled_cross_entropy(torch.tanh(hidden), weight, None, target, None, IGNORE, 8, True) / 3

    compiled = torch.compile(head, backend="aot_eager", dynamic=True, fullgraph=True)
    for tokens, stance in ((21, "default"), (34, "fail_on_recompile"), (5, "fail_on_recompile")):
        hidden, weight, _, target = make(tokens)
        with torch.compiler.set_stance(stance):
            loss = compiled(hidden, weight, target)
        grads = torch.autograd.grad(loss, [hidden, weight])
        expected = plain(torch.tanh(hidden), weight, None, target, upcast=True) / 3
        for got, want in zip(grads, torch.autograd.grad(expected, [hidden, weight])):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-5)
    torch._dynamo.reset()
