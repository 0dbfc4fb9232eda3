"""benchmarks/compile_time.py's report says, per timed call, what Inductor's C++ compiles cost and
how many C++ kernels a further variant compiled of those it asked for (the rest came from Inductor's
code cache, compiled by an earlier variant): the measure of compiled code shared across variants."""

from __future__ import annotations

from pathlib import Path

from benchmark_scripts import load_benchmark

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "compile_time.py"


def _benchmark():
    return load_benchmark("compile_time")


def _caches(misses: int) -> dict[str, int]:
    return {"inductor.fxgraph_cache_hit": 0, "inductor.fxgraph_cache_miss": misses,
            "aot_autograd.autograd_cache_hit": 0, "aot_autograd.autograd_cache_miss": 0}


def _results(with_kernels: bool) -> list[dict]:
    def kernels(prefix: str, cxx: float, compiled: int, requested: int) -> dict:
        if not with_kernels:  # a result written before the script kept them
            return {}
        return {f"{prefix}_cxx_cpu_s": cxx, f"{prefix}_cpp_kernels": {"compiled": compiled, "requested": requested}}

    common = {"model": "llama", "inner": "inductor", "pass": 0, "case": "llama-sdpa", "tokens": 64,
              "torch": "2.13", "next_step_s": 0.01, "load_average_1m": 1.0}
    plain = {**common, "mode": "plain", "first_step_s": 40.0, "first_step_cpu_s": 30.0,
             "first_step_stages": {"Inductor": 25.0}, **kernels("first_step", 15.0, 21, 21)}
    first = {"variant": "sp=2/recompute=none", "first_call_s": 45.0, "first_call_cpu_s": 36.0,
             "stages": {"Inductor": 30.0}, "caches": _caches(2), **kernels("first_call", 20.0, 26, 26)}
    further = {"variant": "sp=1/recompute=attention", "first_call_s": 20.0, "first_call_cpu_s": 15.0,
               "stages": {"Inductor": 12.0}, "caches": _caches(2), **kernels("first_call", 4.9, 9, 26)}
    dcp = {**common, "mode": "dcp", "first_step_s": 45.0, "first_step_cpu_s": 36.0,
           "first_step_stages": first["stages"], "variants": [first, further],
           **{key.replace("first_call", "first_step"): value for key, value in first.items() if "cxx" in key or "cpp" in key}}
    return [plain, dcp]


def test_stage_table_reports_cxx_compile_seconds_and_kernels_compiled_of_those_asked_for():
    report = _benchmark().markdown(_results(with_kernels=True), "test machine")
    row = next(line for line in report.splitlines() if line.startswith("| llama, pass 1 | inductor | Inductor"))
    assert "Inductor 25.0 [C++ compiles 15.0 CPU s, 21 of 21 C++ kernels compiled]" in row
    assert "Inductor 30.0 [C++ compiles 20.0 CPU s, 26 of 26 C++ kernels compiled]" in row
    assert "sp=1/recompute=attention: Inductor 12.0" in row
    assert "[C++ compiles 4.9 CPU s, 9 of 26 C++ kernels compiled]" in row
    assert "0.50x" in report  # 15 of plain's 30 CPU seconds


def test_results_from_before_kernels_were_counted_still_report():
    report = _benchmark().markdown(_results(with_kernels=False), "test machine")
    assert "C++ kernels compiled]" not in report
    assert "sp=1/recompute=attention: Inductor 12.0" in report
