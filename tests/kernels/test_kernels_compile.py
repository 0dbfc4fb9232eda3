"""The kernels trace under ``torch.compile(backend="aot_eager", dynamic=True)``: fake impls give
symbolic shapes, registered autograd formulas land in the compiled backward, and a new sequence
length does not re-trace."""

from __future__ import annotations

import pytest
import torch
import torch._dynamo.testing

from dcp_compile.kernels import pack_for_heads, pack_for_sequence, unpack_from_heads, varlen_attention


@pytest.fixture(autouse=True)
def fresh_dynamo() -> None:
    torch._dynamo.reset()


def ulysses_round_trip(x: torch.Tensor, head_index: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Both layout directions of a 2-rank Ulysses layer, the all-to-all replaced by a reshape."""
    send = pack_for_heads(x, 2, 2, head_index)  # [2, S, B, 2, D]
    mixed = torch.tanh(send * w)  # stand-in for attention on the received heads
    back = pack_for_sequence(mixed[1].permute(1, 2, 0, 3))  # [S, B, 2, D]
    return unpack_from_heads(mixed, 3) + back.permute(1, 2, 0, 3).sum(1, keepdim=True)


def packed_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor, max_seqlen: int) -> torch.Tensor:
    out = varlen_attention(torch.sin(q), k, v * 2, cu, max_seqlen, causal=True)
    return out.square()


def run_with_grads(fn, *inputs):
    def differentiable(t) -> bool:  # noqa: ANN001
        return isinstance(t, torch.Tensor) and t.is_floating_point()

    leaves = [t.clone().requires_grad_() if differentiable(t) else t for t in inputs]
    out = fn(*leaves)
    torch.manual_seed(0)
    out.backward(torch.randn_like(out))
    return out.detach(), [t.grad for t in leaves if differentiable(t)]


def test_layout_ops_compile_dynamic_same_as_eager(device) -> None:
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(ulysses_round_trip, backend=counter, dynamic=True, fullgraph=True)
    index = torch.tensor([0, 2, 1, -1], device=device)
    for seq in (6, 9):
        x = torch.randn(2, 3, seq, 4, device=device)
        w = torch.randn(2, seq, 2, 2, 4, device=device)
        want, want_grads = run_with_grads(ulysses_round_trip, x, index, w)
        got, got_grads = run_with_grads(compiled, x, index, w)
        torch.testing.assert_close(got, want, rtol=0, atol=0)
        for g, e in zip(got_grads, want_grads):
            torch.testing.assert_close(g, e, rtol=1e-6, atol=1e-6)
    assert counter.frame_count == 1, "a new sequence length must not re-trace"
    assert counter.op_count > 0


def test_varlen_attention_compile_dynamic_same_as_eager(device) -> None:
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(packed_attention, backend=counter, dynamic=True, fullgraph=True)
    for lengths in ([3, 9, 1, 6], [12, 5]):  # sizes chosen to avoid duck-sizing coincidences
        total = sum(lengths)
        cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)
        q, k, v = (torch.randn(total, h, 16, device=device) for h in (4, 2, 2))
        want, want_grads = run_with_grads(packed_attention, q, k, v, cu, max(lengths))
        got, got_grads = run_with_grads(compiled, q, k, v, cu, max(lengths))
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
        for g, e in zip(got_grads, want_grads):
            torch.testing.assert_close(g, e, rtol=1e-6, atol=1e-6)
    assert counter.frame_count == 1, "a new token count / cu_seqlens must not re-trace"


def test_compiled_graph_calls_the_custom_ops() -> None:
    """The joint graph holds the dcp ops themselves (forward and backward), not a decomposition."""
    graphs: list[str] = []

    def capture(gm: torch.fx.GraphModule, example_inputs):  # noqa: ANN001
        from torch._functorch.aot_autograd import aot_module_simplified

        def record(g: torch.fx.GraphModule, _inputs):  # noqa: ANN001
            graphs.append(g.code)
            return g.forward

        return aot_module_simplified(gm, example_inputs, fw_compiler=record, bw_compiler=record)

    compiled = torch.compile(packed_attention, backend=capture, dynamic=True)
    cu = torch.tensor([0, 4, 9], dtype=torch.int32)
    q = torch.randn(9, 2, 16, requires_grad=True)
    compiled(q, torch.randn(9, 2, 16), torch.randn(9, 2, 16), cu, 5).sum().backward()
    assert len(graphs) == 2
    assert "torch.ops.dcp.varlen_attention_fwd.default" in graphs[0]
    assert "torch.ops.dcp.varlen_attention_bwd.default" in graphs[1]
