"""The kernel benchmark: the no-GPU correctness pass end to end, and the GPU code path's
bookkeeping with the timer replaced (so it runs on CPU)."""

from __future__ import annotations

import csv
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import kernel_benchmarks as benchmark  # noqa: E402  (benchmarks/ is on sys.path)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU behaviour; gpu_check.sh runs the GPU one")
def test_main_without_gpu_runs_correctness_pass(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    assert benchmark.main(["--out-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "No CUDA GPU found" in out
    assert "varlen_attention dk" in out and "pack_for_heads.backward (scatter-add)" in out
    assert "checks passed" in out and "False" not in out
    assert list(tmp_path.iterdir()) == []  # no timing files pretend to be GPU results


def test_gpu_path_bookkeeping_with_fake_timer(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    timings = iter([2.0, 4.0] * 50)  # dcp 2 ms, torch baseline 4 ms, alternating
    monkeypatch.setattr(benchmark, "_bench_ms", lambda fn, grad_to_none=None: (fn(), next(timings))[1])
    case = benchmark.LayoutCase("small", 1, 3, 5, 16, 2, 2)
    records = benchmark.bench_layouts([case], torch.float32, torch.device("cpu"), copy_gbps=100.0)
    assert {r.kernel for r in records} == {
        "pack_for_heads", "pack_for_heads.backward (scatter-add)", "unpack_from_heads", "pack_for_sequence"
    }
    pack = [r for r in records if r.kernel == "pack_for_heads"]
    row_bytes = 1 * 5 * 16 * 4
    expected_gbps = row_bytes * (3 + 4) / 2e-3 / 1e9  # 3 heads read, 4 slots written, in 2 ms
    assert pack[0].impl == "dcp-triton" and pack[0].achieved == pytest.approx(expected_gbps)
    assert pack[0].pct_of_ceiling == pytest.approx(expected_gbps)  # ceiling is 100 GB/s
    assert pack[0].speedup_vs_torch == pytest.approx(2.0) and pack[1].speedup_vs_torch == pytest.approx(1.0)

    attn = benchmark.AttentionCase("tiny", (3, 9), 4, 2, 16, causal=True)
    assert attn.useful_fwd_flops() == 4.0 * (6 + 45) * 16 * 4
    records += benchmark.bench_attention([attn], torch.float32, torch.device("cpu"), peak=989.0, with_flex=False)

    benchmark.write_csv(records, tmp_path / "kernels_test.csv")
    with (tmp_path / "kernels_test.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == len(records) and rows[0]["metric"] == "GB/s"
    assert benchmark.plot(records, tmp_path / "kernels_test.png", "test")
    assert (tmp_path / "kernels_test.png").stat().st_size > 0
    assert "speedup_vs_torch" in benchmark.format_table(records)


def test_device_naming_and_peaks() -> None:
    assert benchmark.gpu_slug("NVIDIA H200") == "nvidia-h200"
    assert benchmark.peak_tflops("NVIDIA H200", None) == 989.0
    assert benchmark.peak_tflops("NVIDIA H100 PCIe", None) == 756.0
    assert benchmark.peak_tflops("Some New GPU", 123.0) == 123.0
    assert benchmark.peak_tflops("Some New GPU", None) != benchmark.peak_tflops("Some New GPU", None)  # nan


def test_sweeps_are_well_formed() -> None:
    for quick in (True, False):
        for case in benchmark.attention_cases(quick):
            assert case.hq % case.hkv == 0 and min(case.lengths) >= 1
            assert case.total == (16384 if quick else 32768)
        for case in benchmark.layout_cases(quick):
            assert case.sp * case.hp >= case.heads or case.head_index is not None
