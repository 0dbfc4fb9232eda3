"""The varlen path's implementations and the rule that picks one (dcp_compile/kernels/attention_choice.py).

CPU: FlexAttention with a document mask (forward: torch 2.13 has no FlexAttention backward on CPU)
and SDPA over equal-length sequences (forward and backward) against the varlen reference; the
chooser against the committed H200 table. CUDA (gpu_check.sh runs ``-k cuda``): every
implementation forward and backward against the reference.
"""

from __future__ import annotations

import math

import pytest
import torch

from dcp_compile.kernels import varlen_attention_reference as reference
from dcp_compile.kernels.attention_choice import (
    MeasuredTable,
    VarlenKernel,
    VarlenShape,
    choose_varlen_kernel,
    equal_length_sdpa,
    measured_table,
)
from dcp_compile.kernels.varlen_attention import last_varlen_choice, varlen_attention
from dcp_compile.kernels.varlen_flex import flex_document_attention

HAS_CUDA = torch.cuda.is_available()
ALL = {VarlenKernel.TRITON, VarlenKernel.FLEX, VarlenKernel.EQUAL_SDPA}


def _inputs(lengths, hq, hkv, dim, dtype, device, seed=0):
    gen = torch.Generator().manual_seed(seed)
    total = sum(lengths)
    q, k, v = (torch.randn(total, h, dim, generator=gen, dtype=torch.float64).to(device=device, dtype=dtype)
               for h in (hq, hkv, hkv))
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)
    return q, k, v, cu


def test_flex_document_mask_matches_the_reference_on_cpu():
    """Sequences of 5, 1, 0 (empty), 9 and 3 tokens; causal and full; MHA and GQA; fp64, and one
    call through varlen_attention(kernel='flex')."""
    for causal in (False, True):
        for hq, hkv in ((4, 4), (4, 2)):
            q, k, v, cu = _inputs([5, 1, 0, 9, 3], hq, hkv, 16, torch.float64, "cpu")
            got = flex_document_attention(q, k, v, cu, causal)
            want, _ = reference.attention_forward(q, k, v, cu, causal, 1 / math.sqrt(16))
            torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    got = varlen_attention(q, k, v, cu, 9, causal=True, kernel="flex", scale=0.3)
    assert last_varlen_choice().kernel is VarlenKernel.FLEX
    torch.testing.assert_close(got, reference.attention_forward(q, k, v, cu, True, 0.3)[0], rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("causal", [False, True])
def test_equal_length_sdpa_matches_the_reference_forward_and_backward(causal):
    q, k, v, cu = _inputs([6, 6, 6], 4, 2, 8, torch.float64, "cpu")
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    got = equal_length_sdpa(*leaves, 3, causal, None)
    grad = torch.randn_like(got)
    got.backward(grad)
    want, lse = reference.attention_forward(q, k, v, cu, causal, 1 / math.sqrt(8))
    grads = reference.attention_backward(grad, q, k, v, want, lse, cu, causal, 1 / math.sqrt(8))
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    for leaf, expected in zip(leaves, grads):
        torch.testing.assert_close(leaf.grad, expected, rtol=1e-6, atol=1e-6)  # the reference keeps lse in fp32
    with pytest.raises(ValueError, match="sequences of one length"):
        varlen_attention(q, k, v, torch.tensor([0, 5, 12, 18], dtype=torch.int32), 7, kernel="equal_sdpa")


def _h200(total, num_seqs, max_seqlen, causal, dim=128):
    return VarlenShape(total, num_seqs, max_seqlen, dim, torch.bfloat16, causal, "cuda", "NVIDIA H200")


def test_the_choice_on_each_measured_h200_case_is_its_fastest_available_kernel(monkeypatch):
    monkeypatch.delenv("DCP_KERNELS", raising=False)
    table = measured_table("NVIDIA H200")
    assert table is not None and len(table.cases) == 6 and table.torch and table.triton
    for case in table.cases:
        for available in (ALL, {VarlenKernel.TRITON, VarlenKernel.FLEX}, {VarlenKernel.TRITON}):
            shape = _h200(case.total_tokens, case.num_seqs, math.ceil(case.total_tokens / case.num_seqs)
                          if case.padding_fraction == 0 else case.total_tokens // 2, case.causal)
            choice = choose_varlen_kernel(shape, table, available)
            times = {VarlenKernel(name): ms for name, ms in case.fwd_bwd_ms.items() if name != "padded_sdpa"}
            if shape.equal_lengths:
                times[VarlenKernel.EQUAL_SDPA] = case.fwd_bwd_ms["padded_sdpa"]
            usable = {kind: ms for kind, ms in times.items() if kind in available and
                      (kind is not VarlenKernel.EQUAL_SDPA or shape.equal_lengths)}
            assert choice.kernel is min(usable, key=usable.get), (case.case, available, choice)
            assert case.case in choice.reason and "torch 2.11" in choice.reason


def test_the_h200_rule_flex_for_packed_documents_sdpa_for_equal_causal_ones(monkeypatch):
    monkeypatch.delenv("DCP_KERNELS", raising=False)
    table = measured_table("NVIDIA H200")
    assert choose_varlen_kernel(_h200(16384, 8, 2048, True), table, ALL).kernel is VarlenKernel.EQUAL_SDPA
    assert choose_varlen_kernel(_h200(16384, 8, 4000, True), table, ALL).kernel is VarlenKernel.FLEX
    assert choose_varlen_kernel(_h200(16384, 8, 2048, False), table, ALL).kernel is VarlenKernel.FLEX
    assert choose_varlen_kernel(_h200(9000, 30, 0, True), table, ALL).kernel is VarlenKernel.FLEX  # padding unknown


def test_without_a_table_or_on_cpu_the_choice_is_todays(monkeypatch):
    from dcp_compile.kernels.dispatch import triton_available

    monkeypatch.delenv("DCP_KERNELS", raising=False)
    cpu = VarlenShape(100, 3, 50, 64, torch.float32, True, "cpu")
    assert choose_varlen_kernel(cpu).kernel is VarlenKernel.REFERENCE
    other = VarlenShape(100, 3, 50, 64, torch.bfloat16, True, "cuda", "NVIDIA A100-SXM4-80GB")
    choice = choose_varlen_kernel(other)
    assert choice.kernel is (VarlenKernel.TRITON if triton_available() else VarlenKernel.REFERENCE)
    assert "no measured table for NVIDIA A100" in choice.reason
    monkeypatch.setenv("DCP_KERNELS", "torch")
    assert choose_varlen_kernel(_h200(16384, 8, 2048, True), measured_table("NVIDIA H200"), ALL).kernel \
        is VarlenKernel.REFERENCE
    empty = MeasuredTable("NVIDIA H200", "2.11", "3.6", "test", ())
    monkeypatch.delenv("DCP_KERNELS")
    assert "no causal case" in choose_varlen_kernel(_h200(16384, 8, 2048, True), empty, ALL).reason


@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("kernel", ["flex", "equal_sdpa", "triton", None])
def test_every_varlen_kernel_on_cuda_matches_the_reference_forward_and_backward(kernel, monkeypatch):
    monkeypatch.delenv("DCP_KERNELS", raising=False)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    lengths = [128, 128, 128, 128] if kernel in ("equal_sdpa", None) else [1, 130, 300, 77, 256]
    q, k, v, cu = _inputs(lengths, 8, 2, 64, torch.bfloat16, "cuda")
    for causal in (False, True):
        leaves = [x.clone().requires_grad_() for x in (q, k, v)]
        got = varlen_attention(*leaves, cu, max(lengths), causal=causal, kernel=kernel)
        grad = torch.randn_like(got)
        got.backward(grad)
        want, lse = reference.attention_forward(*(x.float() for x in (q, k, v)), cu, causal, 1 / 8)
        grads = reference.attention_backward(grad.float(), *(x.float() for x in (q, k, v)), want, lse, cu, causal, 1 / 8)
        torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=2e-2)
        for leaf, expected in zip(leaves, grads):
            torch.testing.assert_close(leaf.grad.float(), expected, rtol=5e-2, atol=5e-2)
