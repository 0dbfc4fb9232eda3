"""User ``autograd.Function``s keep their own backward through the backend (BLOOM's GeLU, straight-
through estimators): the ATen capture alone would differentiate their forward instead.

Parity runs on 2 real gloo ranks against eager (gradients summed over the SP group) and asserts
that every attention was sharded; the graph-structure checks use the fake process group.
"""

from __future__ import annotations

import torch

from dcp_compile.compiler.custom_autograd import custom_autograd_function
from dcp_compile.compiler.passes.sequence_dims import Role
from dcp_compile.testing.process_world import run_in_process_world
from model_zoo import ApproximateGelu
from parity import parity_worker
from passes.pass_helpers import analyse


def test_custom_backward_at_parity_and_sharded_on_two_ranks():
    results = run_in_process_world(parity_worker, 2, ["custom_function"], [12, 7], "eager", timeout=600)
    assert all(result["checked"] == 2 for result in results)
    assert all(result["sharded_variants"] >= 2 for result in results), results


def test_custom_backward_runs_on_one_process():
    """The user's backward, not the derivative of the forward (which differs by design here)."""
    import dcp_compile  # noqa: F401  (registers the backend)

    def f(x: torch.Tensor) -> torch.Tensor:
        return ApproximateGelu.apply(x * 3).sum()

    x = torch.randn(2, 9, 4, requires_grad=True)
    f(x).backward()
    expected = x.grad.clone()
    x.grad = None
    torch._dynamo.reset()
    torch.compile(f, backend="dcp", dynamic=True)(x).backward()
    torch.testing.assert_close(x.grad, expected, rtol=0, atol=0)
    derivative = torch.func.grad(lambda t: (0.5 * t * 3 * (1 + torch.tanh(0.79788456 * (t * 3 + 0.044715 * (t * 3) ** 3)))).sum())(x.detach())
    assert not torch.allclose(expected, derivative, atol=1e-3)  # the test can tell the two apart


class _CumulativeSum(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.cumsum(1)

    @staticmethod
    def backward(ctx, grad):
        return grad.flip(1).cumsum(1).flip(1)


def _attention_then(function):
    def model(x: torch.Tensor) -> torch.Tensor:
        q = x.unflatten(-1, (2, 4)).transpose(1, 2)
        out = torch.nn.functional.scaled_dot_product_attention(q, q, q).transpose(1, 2).flatten(2)
        return function.apply(out)

    return model


def test_elementwise_function_is_token_local():
    gm, analysis = analyse(_attention_then(ApproximateGelu), torch.randn(2, 11, 8, requires_grad=True))
    (call,) = gm.graph.find_nodes(op="call_function", target=custom_autograd_function._opoverload)
    assert analysis.sequence.roles[call].role == Role.TOKEN_LOCAL


def test_sequence_mixing_function_is_gathered_with_its_name():
    gm, analysis = analyse(_attention_then(_CumulativeSum), torch.randn(2, 11, 8, requires_grad=True))
    (call,) = gm.graph.find_nodes(op="call_function", target=custom_autograd_function._opoverload)
    role = analysis.sequence.roles[call]
    assert role.role == Role.MIXING and "custom autograd.Function" in role.reason and "not elementwise" in role.reason
