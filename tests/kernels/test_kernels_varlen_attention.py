"""Varlen attention against ``F.scaled_dot_product_attention`` run on each sequence separately."""

from __future__ import annotations

import math
from typing import Optional

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dcp_compile.kernels import varlen_attention

HAS_CUDA = torch.cuda.is_available()

BF16 = pytest.param(
    torch.bfloat16,
    marks=pytest.mark.skipif(
        not HAS_CUDA, reason="the Triton interpreter computes bf16 tl.dot wrongly; bf16 is tested on CUDA"
    ),
    id="torch.bfloat16",
)
DTYPES = [pytest.param(torch.float32, id="torch.float32"), pytest.param(torch.float16, id="torch.float16"), BF16]

# (out, grads) tolerances against an fp64 reference.
TOLERANCES = {
    torch.float32: (dict(rtol=1e-4, atol=2e-5), dict(rtol=1e-4, atol=5e-5)),
    torch.float16: (dict(rtol=5e-3, atol=5e-3), dict(rtol=1e-2, atol=1e-2)),
    torch.bfloat16: (dict(rtol=3e-2, atol=3e-2), dict(rtol=5e-2, atol=5e-2)),
}


def cu_from_lengths(lengths: list[int], device: torch.device) -> torch.Tensor:
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    return torch.tensor(cu, dtype=torch.int32, device=device)


def sdpa_per_sequence(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: list[int], causal: bool, scale: Optional[float]
) -> torch.Tensor:
    outs, start = [], 0
    for n in lengths:
        sl = slice(start, start + n)
        o = F.scaled_dot_product_attention(
            q[sl].transpose(0, 1), k[sl].transpose(0, 1), v[sl].transpose(0, 1),
            is_causal=causal, scale=scale, enable_gqa=True,
        )
        outs.append(o.transpose(0, 1))
        start += n
    return torch.cat(outs)


def check_against_sdpa(
    lengths: list[int], hq: int, hkv: int, dim: int, dtype: torch.dtype, causal: bool,
    device: torch.device, scale: Optional[float] = None, seed: int = 0,
) -> None:
    gen = torch.Generator().manual_seed(seed)
    total = sum(lengths)
    q, k, v = (torch.randn(total, h, dim, generator=gen) for h in (hq, hkv, hkv))
    grad = torch.randn(total, hq, dim, generator=gen)

    leaves = [t.to(device=device, dtype=dtype).clone().requires_grad_() for t in (q, k, v)]
    out = varlen_attention(*leaves, cu_from_lengths(lengths, device), max(lengths), causal=causal, scale=scale)
    out.backward(grad.to(device=device, dtype=dtype))

    refs = [leaf.detach().double().requires_grad_() for leaf in leaves]
    ref = sdpa_per_sequence(*refs, lengths, causal, scale)
    ref.backward(grad.to(device=device, dtype=dtype).double())

    out_tol, grad_tol = TOLERANCES[dtype]
    assert out.dtype == dtype and out.shape == (total, hq, dim)
    torch.testing.assert_close(out.double(), ref, **out_tol)
    for name, leaf, r in zip("qkv", leaves, refs):
        assert leaf.grad.dtype == dtype, name
        torch.testing.assert_close(leaf.grad.double(), r.grad, **grad_tol, msg=lambda m: f"d{name}: {m}")


HEADS = [(2, 2), (4, 2), (4, 1)]


@pytest.mark.parametrize("dtype", DTYPES)
@settings(max_examples=10, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    lengths=st.lists(st.integers(1, 40), min_size=1, max_size=4),
    causal=st.booleans(),
    heads=st.sampled_from(HEADS),
    dim=st.sampled_from([16, 32]),
)
def test_matches_sdpa_random_cu_seqlens(device, dtype, lengths, causal, heads, dim) -> None:
    check_against_sdpa(lengths, *heads, dim, dtype, causal, device)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_length_one_sequences_and_gqa(device, dtype, causal) -> None:
    check_against_sdpa([1, 3, 1, 1, 34, 1], 4, 2, 16, dtype, causal, device)


@pytest.mark.parametrize("dim", [64, 128])
def test_model_head_dims(device, dim) -> None:
    check_against_sdpa([9, 33], 2, 1, dim, torch.float16, True, device)
    check_against_sdpa([17], 2, 2, dim, torch.float32, False, device, seed=1)


def test_custom_scale_and_non_pow2_head_dim(device) -> None:
    check_against_sdpa([5, 20], 2, 1, 24, torch.float32, True, device, scale=0.3)


def test_reference_backend_matches_sdpa(device, monkeypatch: pytest.MonkeyPatch) -> None:
    """The torch path (what CPU runs by default) is held to the same standard."""
    monkeypatch.setenv("DCP_KERNELS", "torch")
    check_against_sdpa([1, 7, 30], 4, 2, 16, torch.float32, True, device)
    check_against_sdpa([12, 3], 4, 1, 16, torch.float16, False, device)


@pytest.mark.parametrize("lengths", [[400, 200], [60] * 10], ids=["one-pass", "per-sequence"])
def test_reference_both_strategies(monkeypatch: pytest.MonkeyPatch, lengths) -> None:
    """The torch path computes a row in one block-diagonal pass when the row's T^2 is within 2x of
    sum L^2, and sequence by sequence otherwise: both against SDPA on each sequence."""
    from dcp_compile.kernels import varlen_attention_reference as reference

    total = sum(lengths)
    expected_whole_row = len(lengths) == 2
    assert reference._ranges(cu_from_lengths(lengths, torch.device("cpu")), total)[1] is expected_whole_row
    monkeypatch.setenv("DCP_KERNELS", "torch")
    check_against_sdpa(lengths, 2, 1, 8, torch.float32, True, torch.device("cpu"))
    check_against_sdpa(lengths, 2, 2, 8, torch.float32, False, torch.device("cpu"), seed=1)


@pytest.mark.parametrize("lengths", [[400, 200], [300] * 3], ids=["one-pass", "per-sequence"])
def test_reference_in_query_blocks(monkeypatch: pytest.MonkeyPatch, lengths) -> None:
    """Ranges whose scores exceed one block run in several query blocks (a causal one stops at its
    last query's key): the same numbers as SDPA, both strategies, GQA."""
    from dcp_compile.kernels import varlen_attention_reference as reference

    for start, end in reference._ranges(cu_from_lengths(lengths, torch.device("cpu")), sum(lengths))[0]:
        assert len(list(reference._blocks(end - start, 8, causal=True))) > 1
    monkeypatch.setenv("DCP_KERNELS", "torch")
    check_against_sdpa(lengths, 8, 2, 8, torch.float32, True, torch.device("cpu"))
    check_against_sdpa(lengths, 8, 2, 8, torch.float32, False, torch.device("cpu"), seed=1)


def test_strided_inputs_and_empty_sequence(device) -> None:
    """q, k, v as views of one packed qkv projection, and a zero-length sequence in cu_seqlens."""
    gen = torch.Generator().manual_seed(3)
    lengths = [6, 0, 11]
    total, heads, dim = 17, 2, 16
    qkv = torch.randn(total, 3, heads, dim, generator=gen).to(device).requires_grad_()
    q, k, v = qkv.unbind(1)
    cu = torch.tensor([0, 6, 6, 17], dtype=torch.int32, device=device)
    out = varlen_attention(q, k, v, cu, 11, causal=True)
    out.sum().backward()

    ref_qkv = qkv.detach().double().requires_grad_()
    rq, rk, rv = ref_qkv.unbind(1)
    ref = sdpa_per_sequence(rq, rk, rv, [6, 11], True, None)
    ref.sum().backward()
    torch.testing.assert_close(out.double(), ref, rtol=1e-4, atol=2e-5)
    torch.testing.assert_close(qkv.grad.double(), ref_qkv.grad, rtol=1e-4, atol=5e-5)


def test_no_attention_across_sequences(device) -> None:
    """Changing one sequence's keys/values leaves every other sequence's output bit-identical."""
    gen = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(20, 2, 16, generator=gen).to(device) for _ in range(3))
    cu = torch.tensor([0, 8, 20], dtype=torch.int32, device=device)
    before = varlen_attention(q, k, v, cu, 12)
    k2, v2 = k.clone(), v.clone()
    k2[8:] += 1.0
    v2[8:] -= 2.0
    after = varlen_attention(q, k2, v2, cu, 12)
    assert torch.equal(before[:8], after[:8])
    assert not torch.allclose(before[8:], after[8:])


def test_lse_is_logsumexp_of_scaled_scores(device) -> None:
    q, k, v = (torch.randn(5, 1, 16).to(device) for _ in range(3))
    cu = torch.tensor([0, 5], dtype=torch.int32, device=device)
    _, lse = torch.ops.dcp.varlen_attention_fwd(q, k, v, cu, 5, False, None)
    expected = torch.logsumexp((q[:, 0] @ k[:, 0].T) / math.sqrt(16), dim=-1)
    torch.testing.assert_close(lse[0], expected, rtol=1e-5, atol=1e-5)


def test_opcheck_attention_ops() -> None:
    """Schema, fake impl vs the real Triton outputs, autograd registration, AOT dispatch."""
    q = torch.randn(9, 4, 16, requires_grad=True)
    k = torch.randn(9, 2, 16, requires_grad=True)
    v = torch.randn(9, 2, 16, requires_grad=True)
    cu = torch.tensor([0, 2, 9], dtype=torch.int32)
    torch.library.opcheck(torch.ops.dcp.varlen_attention_fwd.default, (q, k, v, cu, 7, True, None))
    out, lse = torch.ops.dcp.varlen_attention_fwd(q, k, v, cu, 7, True, None)
    args = (torch.randn_like(out), q.detach(), k.detach(), v.detach(), out.detach(), lse, cu, 7, True, 0.5)
    torch.library.opcheck(torch.ops.dcp.varlen_attention_bwd.default, args)


def test_bad_inputs_raise() -> None:
    q, k = torch.randn(6, 4, 16), torch.randn(6, 3, 16)
    cu = torch.tensor([0, 6], dtype=torch.int32)
    with pytest.raises(ValueError, match="divisible"):
        varlen_attention(q, k, k, cu, 6)
    k = torch.randn(6, 2, 16)
    with pytest.raises(ValueError, match="every token"):
        varlen_attention(q, k, k, torch.tensor([0, 5], dtype=torch.int32), 5)
    with pytest.raises(ValueError, match="max_seqlen"):
        varlen_attention(q, k, k, torch.tensor([0, 2, 6], dtype=torch.int32), 3)
    with pytest.raises(ValueError, match="cu_seqlens"):
        varlen_attention(q, k, k, torch.tensor([0.0, 6.0]), 6)
    with pytest.raises(TypeError, match="dtypes"):
        varlen_attention(q, k.half(), k, cu, 6)


@pytest.mark.parametrize(
    ("dtype", "dim"),
    [(torch.float16, 64), (torch.float16, 128), (torch.float32, 32)],
    ids=["fp16-D64", "fp16-D128", "fp32-D32"],
)
def test_gpu_tile_shapes_under_interpreter(monkeypatch: pytest.MonkeyPatch, dtype, dim) -> None:
    """The GPU tiles are uneven (e.g. 128x32 for dQ, 32x128 for dK/dV), unlike the interpreter's
    32x32: run the interpreted kernels with exactly the GPU tiles, on lengths that straddle them."""
    from dcp_compile.kernels.triton_loader import triton_module

    module = triton_module("varlen_attention_triton", torch.device("cpu"))
    fwd, bwd = module.forward_config, module.backward_config
    monkeypatch.setattr(module, "forward_config", lambda d, t, interpreted: fwd(d, t, False))
    monkeypatch.setattr(module, "backward_config", lambda d, t, interpreted: bwd(d, t, False))
    tiles = bwd(dim, dtype, False)
    assert tiles.dkdv.block_m != tiles.dkdv.block_n  # the point of this test
    for causal in (True, False):
        check_against_sdpa([1, 33, 130], 2, 1, dim, dtype, causal, torch.device("cpu"), seed=int(causal))


@pytest.mark.skipif(
    not HAS_CUDA,
    reason="hundreds of tokens per sequence are too slow for the interpreter; on CPU the GPU tile "
    "shapes are covered by test_gpu_tile_shapes_under_interpreter",
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("dim", [64, 128])
def test_long_sequences_on_cuda(dtype, dim) -> None:
    for causal in (True, False):
        check_against_sdpa([1, 130, 300, 77, 513], 8, 2, dim, dtype, causal, torch.device("cuda"))
