"""``dcp::tiled_mlp``: a transformer's MLP over chunks of tokens (ALST's TiledMLP, arXiv 2506.13996).

An MLP widens each token to ``ffn`` features and back: ``down(act(gate(x)) * up(x))`` (gated:
SwiGLU, GeGLU) or ``down(act(up(x)))`` (plain). Eager builds its ``ffn``-wide tensors for the whole
sequence at once, and under whole-block checkpointing backward rebuilds them whole again beside
their gradients: the largest working set a layer holds once its input is offloaded
(:mod:`dcp_compile.tiled_mlp`). This op computes ``chunk`` tokens at a time instead:

* forward: for each chunk, its ``ffn``-wide tensors and its rows of the output; nothing is kept;
* backward (``dcp::tiled_mlp_backward``, its own op so a compiled backward calls it as one
  kernel): for each chunk, the ``ffn``-wide tensors rebuilt and the chunk's rows of the input's
  gradient computed by hand, the weights' and biases' gradients accumulated over chunks.

What backward keeps from forward: the input and the parameters. At most
:func:`dcp_compile.tiled_mlp.mlp_chunk_bytes` of ``ffn``-wide tensors exist at once (backward
holds five ``[chunk, ffn]`` tensors gated, three plain; the rule allows seven and four), the
price the cost model puts on the policy.

Exact: per chunk this is eager's math on fewer rows (the same ``linear``, the same activation and
its ATen backward: ``silu_backward``, ``gelu_backward``, ``threshold_backward``); the weights'
gradients are summed over chunks, in the weights' dtype (one rounding per chunk; eager rounds once).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

aten = torch.ops.aten
# Each activation's forward and backward, the latter as eager's autograd calls it (the ATen
# kernel: so the result is eager's), one new tensor of ``grad``'s size. ReLU's mask from its input:
# relu(v) > 0 exactly where v > 0.
_ACTIVATION_KERNELS = {
    "silu": (F.silu, aten.silu_backward),
    "gelu": (F.gelu, lambda grad, value: aten.gelu_backward(grad, value, approximate="none")),
    "gelu_tanh": (lambda value: F.gelu(value, approximate="tanh"),
                  lambda grad, value: aten.gelu_backward(grad, value, approximate="tanh")),
    "relu": (F.relu, lambda grad, value: aten.threshold_backward(grad, value, 0)),
}
ACTIVATIONS = tuple(_ACTIVATION_KERNELS)


def _kernels(activation: str):
    try:
        return _ACTIVATION_KERNELS[activation]
    except KeyError:
        raise ValueError(f"dcp::tiled_mlp: unknown activation {activation!r} (one of {ACTIVATIONS})") from None


def _activation(value: torch.Tensor, activation: str) -> torch.Tensor:
    return _kernels(activation)[0](value)


def _activation_backward(grad: torch.Tensor, value: torch.Tensor, activation: str) -> torch.Tensor:
    """The activation's gradient at ``value`` (its input) times ``grad``."""
    return _kernels(activation)[1](grad, value)


def _rows(tensor: torch.Tensor) -> torch.Tensor:
    """``[..., features]`` as ``[tokens, features]`` (a view when the layout allows)."""
    return tensor.reshape(-1, tensor.shape[-1])


def _hidden(rows: torch.Tensor, up_weight: torch.Tensor, up_bias: Optional[torch.Tensor],
            gate_weight: Optional[torch.Tensor], gate_bias: Optional[torch.Tensor], activation: str) -> torch.Tensor:
    """The chunk's input to the down projection; at most three ``[chunk, ffn]`` tensors live at once."""
    if gate_weight is None:
        return _activation(F.linear(rows, up_weight, up_bias), activation)
    gate = F.linear(rows, gate_weight, gate_bias)
    activated = _activation(gate, activation)
    del gate
    return activated.mul_(F.linear(rows, up_weight, up_bias))


@torch.library.custom_op("dcp::tiled_mlp", mutates_args=())
def tiled_mlp(
    x: torch.Tensor,
    up_weight: torch.Tensor,
    up_bias: Optional[torch.Tensor],
    gate_weight: Optional[torch.Tensor],
    gate_bias: Optional[torch.Tensor],
    down_weight: torch.Tensor,
    down_bias: Optional[torch.Tensor],
    activation: str,
    chunk: int,
) -> torch.Tensor:
    """``down(act(gate(x)) * up(x))`` (``gate_weight`` given) or ``down(act(up(x)))``, computed
    ``chunk`` tokens at a time. ``x`` is ``[..., features]``; the output ``[..., down features]``."""
    rows = _rows(x)
    out = x.new_empty(rows.shape[0], down_weight.shape[0])
    for start in range(0, rows.shape[0], chunk):
        stop = min(rows.shape[0], start + chunk)
        hidden = _hidden(rows[start:stop], up_weight, up_bias, gate_weight, gate_bias, activation)
        out[start:stop] = F.linear(hidden, down_weight, down_bias)
        del hidden
    return out.view(*x.shape[:-1], down_weight.shape[0])


@tiled_mlp.register_fake
def _(x, up_weight, up_bias, gate_weight, gate_bias, down_weight, down_bias, activation, chunk):
    return x.new_empty(*x.shape[:-1], down_weight.shape[0])


@torch.library.custom_op("dcp::tiled_mlp_backward", mutates_args=())
def tiled_mlp_backward(
    grad: torch.Tensor,
    x: torch.Tensor,
    up_weight: torch.Tensor,
    up_bias: Optional[torch.Tensor],
    gate_weight: Optional[torch.Tensor],
    gate_bias: Optional[torch.Tensor],
    down_weight: torch.Tensor,
    down_bias: Optional[torch.Tensor],
    activation: str,
    chunk: int,
) -> list[torch.Tensor]:
    """The gradients of :func:`tiled_mlp` for ``grad`` (its output's): ``[grad_x, grad_up_weight,
    grad_down_weight]``, then ``grad_gate_weight`` when gated, then the biases' gradients of
    ``up``, ``gate`` and ``down``, each only where that bias is given."""
    rows, grad_rows = _rows(x), _rows(grad)
    gated = gate_weight is not None
    grad_x = torch.empty_like(rows)
    grad_up_weight, grad_down_weight = torch.zeros_like(up_weight), torch.zeros_like(down_weight)
    grad_gate_weight = torch.zeros_like(gate_weight) if gated else None
    grad_up_bias = torch.zeros_like(up_bias) if up_bias is not None else None
    grad_gate_bias = torch.zeros_like(gate_bias) if gate_bias is not None else None
    grad_down_bias = torch.zeros_like(down_bias) if down_bias is not None else None
    for start in range(0, rows.shape[0], chunk):
        stop = min(rows.shape[0], start + chunk)
        chunk_rows, chunk_grad = rows[start:stop], grad_rows[start:stop]
        if grad_down_bias is not None:
            grad_down_bias.add_(chunk_grad.sum(0))
        # The order below keeps at most five [chunk, ffn] tensors alive gated (three plain).
        up = F.linear(chunk_rows, up_weight, up_bias)
        if gated:
            gate = F.linear(chunk_rows, gate_weight, gate_bias)
            activated = _activation(gate, activation)
            product = activated * up
            grad_down_weight.addmm_(chunk_grad.t(), product)
            del product
            grad_product = torch.mm(chunk_grad, down_weight)
            grad_up = grad_product * activated
            del activated
            grad_activated = grad_product.mul_(up)  # in place: the product's gradient is read no more
            del up, grad_product
            grad_gate = _activation_backward(grad_activated, gate, activation)
            del gate, grad_activated
            torch.mm(grad_gate, gate_weight, out=grad_x[start:stop])
            grad_x[start:stop].addmm_(grad_up, up_weight)
            grad_gate_weight.addmm_(grad_gate.t(), chunk_rows)
            if grad_gate_bias is not None:
                grad_gate_bias.add_(grad_gate.sum(0))
            del grad_gate
        else:
            activated = _activation(up, activation)
            grad_down_weight.addmm_(chunk_grad.t(), activated)
            del activated
            grad_activated = torch.mm(chunk_grad, down_weight)
            grad_up = _activation_backward(grad_activated, up, activation)
            del grad_activated, up
            torch.mm(grad_up, up_weight, out=grad_x[start:stop])
        grad_up_weight.addmm_(grad_up.t(), chunk_rows)
        if grad_up_bias is not None:
            grad_up_bias.add_(grad_up.sum(0))
        del grad_up
    grads = [grad_x.view(x.shape), grad_up_weight, grad_down_weight]
    if gated:
        grads.append(grad_gate_weight)
    return grads + [g for g in (grad_up_bias, grad_gate_bias, grad_down_bias) if g is not None]


@tiled_mlp_backward.register_fake
def _(grad, x, up_weight, up_bias, gate_weight, gate_bias, down_weight, down_bias, activation, chunk):
    grads = [torch.empty_like(x), torch.empty_like(up_weight), torch.empty_like(down_weight)]
    if gate_weight is not None:
        grads.append(torch.empty_like(gate_weight))
    return grads + [torch.empty_like(b) for b in (up_bias, gate_bias, down_bias) if b is not None]


def _setup_context(ctx, inputs, output) -> None:
    x, up_weight, up_bias, gate_weight, gate_bias, down_weight, down_bias, activation, chunk = inputs
    ctx.save_for_backward(x, up_weight, up_bias, gate_weight, gate_bias, down_weight, down_bias)
    ctx.activation, ctx.chunk = activation, chunk


def _backward(ctx, grad: torch.Tensor):
    x, up_weight, up_bias, gate_weight, gate_bias, down_weight, down_bias = ctx.saved_tensors
    grads = list(torch.ops.dcp.tiled_mlp_backward(grad, x, up_weight, up_bias, gate_weight, gate_bias, down_weight,
                                                   down_bias, ctx.activation, ctx.chunk))
    grad_x, grad_up_weight, grad_down_weight = grads[:3]
    rest = grads[3:]
    grad_gate_weight = rest.pop(0) if gate_weight is not None else None
    grad_up_bias = rest.pop(0) if up_bias is not None else None
    grad_gate_bias = rest.pop(0) if gate_bias is not None else None
    grad_down_bias = rest.pop(0) if down_bias is not None else None
    return (grad_x, grad_up_weight, grad_up_bias, grad_gate_weight, grad_gate_bias, grad_down_weight, grad_down_bias,
            None, None)


tiled_mlp.register_autograd(_backward, setup_context=_setup_context)

__all__ = ["ACTIVATIONS", "tiled_mlp", "tiled_mlp_backward"]
