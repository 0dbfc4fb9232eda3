"""Compile the Triton kernels ahead of time for Hopper (sm_90), no GPU needed.

The interpreter checks what the kernels compute, not whether the compiler accepts them; this
lowers every kernel through Triton's real pipeline (TTIR -> PTX -> ptxas cubin) with the exact
tile configs the launchers use on a GPU, and checks the shared memory they need fits an H100/H200.
"""

from __future__ import annotations

import os
import shutil

import pytest
import torch

triton = pytest.importorskip("triton")

from dcp_compile.kernels.triton_loader import triton_module  # noqa: E402

_HOPPER_SMEM_BYTES = 227 * 1024  # max dynamic shared memory per block on sm_90


def _ptxas_available() -> bool:
    bundled = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    return os.path.exists(bundled) or shutil.which("ptxas") is not None


pytestmark = pytest.mark.skipif(
    not _ptxas_available(), reason="ptxas (shipped in triton's CUDA wheels) is needed to compile for sm_90"
)


@pytest.fixture
def compiled(monkeypatch: pytest.MonkeyPatch):
    """Kernel modules built in compiled mode (never launched here, so no GPU is needed)."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    return {name: triton_module(name, torch.device("cuda")) for name in ("varlen_attention_triton", "ulysses_layout_triton")}


def compile_sm90(kernel, pointers: dict[str, str], floats: tuple[str, ...], constexprs: dict, num_warps: int, num_stages: int):
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature = {}
    for name in kernel.arg_names:
        if name in constexprs:
            signature[name] = "constexpr"
        elif name in pointers:
            signature[name] = pointers[name]
        else:
            signature[name] = "fp32" if name in floats else "i32"
    source = ASTSource(fn=kernel, signature=signature, constexprs=constexprs)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps, "num_stages": num_stages})


@pytest.mark.parametrize(
    ("dtype", "dim", "causal"),
    [
        (torch.bfloat16, 128, True),
        (torch.float16, 64, False),
        # fp32 lowers its exact products to CUDA-core loops: ~30 s of ptxas on 2 CPU cores.
        pytest.param(torch.float32, 64, True, marks=pytest.mark.slow),
    ],
    ids=["bf16-D128-causal", "fp16-D64-full", "fp32-D64-causal"],
)
def test_attention_kernels_compile_for_sm90(compiled, dtype, dim, causal) -> None:
    module = compiled["varlen_attention_triton"]
    t = {torch.bfloat16: "*bf16", torch.float16: "*fp16", torch.float32: "*fp32"}[dtype]
    ieee = dtype == torch.float32

    fwd = module.forward_config(dim, dtype, interpreted=False)
    ptrs = {n: t for n in ("Q", "K", "V", "O")} | {"LSE": "*fp32", "CU": "*i32"}
    kernel = compile_sm90(module._fwd_kernel, ptrs, ("qk_scale",),
                          dict(CAUSAL=causal, IEEE=ieee, BLOCK_M=fwd.block_m, BLOCK_N=fwd.block_n,
                               BLOCK_D=dim, EVEN_D=True), fwd.num_warps, fwd.num_stages)
    assert kernel.metadata.shared <= _HOPPER_SMEM_BYTES

    tiles = module.backward_config(dim, dtype, interpreted=False)
    ptrs = {n: t for n in ("Q", "K", "V", "DO", "DK", "DV", "DQ")} | {"LSE": "*fp32", "DELTA": "*fp32", "CU": "*i32"}
    for fn, cfg in ((module._bwd_dkdv_kernel, tiles.dkdv), (module._bwd_dq_kernel, tiles.dq)):
        kernel = compile_sm90(fn, ptrs, ("sm_scale", "qk_scale"),
                              dict(CAUSAL=causal, IEEE=ieee, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
                                   BLOCK_D=dim, EVEN_D=True), cfg.num_warps, cfg.num_stages)
        assert kernel.metadata.shared <= _HOPPER_SMEM_BYTES, fn
    kernel = compile_sm90(module._bwd_delta_kernel, {"O": t, "DO": t, "DELTA": "*fp32"}, (),
                          dict(BLOCK_T=4096 // dim, BLOCK_D=dim), 4, 3)
    assert kernel.metadata.shared <= _HOPPER_SMEM_BYTES


def test_layout_kernels_compile_for_sm90(compiled) -> None:
    import triton.language as tl

    module = compiled["ulysses_layout_triton"]
    block_s, block_d = 32, 128  # what _tile gives for D = 128 on a GPU
    for has_index in (False, True):
        compile_sm90(module._gather_heads_kernel, {"x_ptr": "*bf16", "index_ptr": "*i64", "send_ptr": "*bf16"}, (),
                     dict(HAS_INDEX=has_index, BLOCK_S=block_s, BLOCK_D=block_d), 4, 3)
        compile_sm90(module._scatter_heads_kernel, {"recv_ptr": "*bf16", "index_ptr": "*i64", "out_ptr": "*bf16"}, (),
                     dict(HAS_INDEX=has_index, NUM_SLOTS=32, ACC_DTYPE=tl.float32, BLOCK_S=block_s, BLOCK_D=block_d), 4, 3)
    compile_sm90(module._permute_copy_kernel, {"src_ptr": "*bf16", "dst_ptr": "*bf16"}, (),
                 dict(BLOCK_S=block_s, BLOCK_D=block_d), 4, 3)
