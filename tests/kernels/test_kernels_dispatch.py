"""Backend choice (DCP_KERNELS, read at call time), the optional triton import, and the loader
that builds interpreted or compiled kernels independently of TRITON_INTERPRET at import."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from dcp_compile.kernels import kernel_backend, pack_for_heads
from dcp_compile.kernels import ulysses_layout
from dcp_compile.kernels.triton_loader import triton_module, use_interpreter


def test_default_is_torch_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DCP_KERNELS")
    assert kernel_backend(torch.zeros(1)) == "torch"
    monkeypatch.setenv("DCP_KERNELS", "auto")
    assert kernel_backend(torch.zeros(1)) == "torch"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="auto picks Triton only for CUDA tensors")
def test_default_is_triton_on_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DCP_KERNELS")
    assert kernel_backend(torch.zeros(1, device="cuda")) == "triton"


def test_env_overrides_and_bad_value(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DCP_KERNELS", "Triton")
    assert kernel_backend(torch.zeros(1)) == "triton"
    monkeypatch.setenv("DCP_KERNELS", "torch")
    assert kernel_backend(torch.zeros(1)) == "torch"
    monkeypatch.setenv("DCP_KERNELS", "cuda")
    with pytest.raises(ValueError, match="DCP_KERNELS='cuda'"):
        kernel_backend(torch.zeros(1))


def test_choice_is_made_per_call(monkeypatch: pytest.MonkeyPatch) -> None:
    """Flipping the variable between two calls of an already-imported op changes the path taken."""
    calls: list[str] = []
    real = ulysses_layout.triton_module

    def spy(name: str, device: torch.device):
        calls.append(name)
        return real(name, device)

    monkeypatch.setattr(ulysses_layout, "triton_module", spy)
    x = torch.randn(1, 2, 3, 4)
    monkeypatch.setenv("DCP_KERNELS", "torch")
    a = pack_for_heads(x, 2, 1)
    assert calls == []
    monkeypatch.setenv("DCP_KERNELS", "triton")
    b = pack_for_heads(x, 2, 1)
    assert calls == ["ulysses_layout_triton"]
    assert torch.equal(a, b)


def test_cpu_runs_interpreted_without_triton_interpret(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert use_interpreter(torch.device("cpu"))
    assert not use_interpreter(torch.device("cuda"))
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert use_interpreter(torch.device("cuda"))
    monkeypatch.delenv("TRITON_INTERPRET")

    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    interpreted = triton_module("ulysses_layout_triton", torch.device("cpu"))
    compiled = triton_module("ulysses_layout_triton", torch.device("cuda"))  # built, never launched here
    assert isinstance(interpreted._gather_heads_kernel, InterpretedFunction)
    assert isinstance(compiled._gather_heads_kernel, JITFunction)
    assert triton_module("ulysses_layout_triton", torch.device("cpu")) is interpreted
    x = torch.randn(1, 2, 3, 4)
    assert torch.equal(pack_for_heads(x, 1, 2), x.permute(2, 0, 1, 3).unsqueeze(0))


def test_import_and_cpu_use_without_triton() -> None:
    """triton is optional: with it unimportable the package imports and CPU calls use torch."""
    script = textwrap.dedent(
        """
        import os, sys
        sys.modules["triton"] = None  # makes `import triton` fail
        import torch
        import dcp_compile.kernels as k
        x = torch.randn(1, 3, 4, 8)
        assert k.kernel_backend(x) == "torch"
        send = k.pack_for_heads(x, 2, 2)
        assert torch.equal(k.unpack_from_heads(send, 3), x)
        cu = torch.tensor([0, 4], dtype=torch.int32)
        q = torch.randn(4, 2, 8)
        k.varlen_attention(q, q, q, cu, 4, causal=True)
        os.environ["DCP_KERNELS"] = "triton"
        try:
            k.kernel_backend(x)
        except RuntimeError as e:
            assert "triton is not installed" in str(e)
        else:
            raise AssertionError("forcing triton without triton must fail loudly")
        print("ok")
        """
    )
    env = {key: value for key, value in os.environ.items() if key not in ("DCP_KERNELS", "TRITON_INTERPRET")}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().endswith("ok")
