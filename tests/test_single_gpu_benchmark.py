"""benchmarks/single_gpu.py at a tiny configuration on the CPU: a real run of its main path (the
profile, the three schedules, the timed steps), and the page it writes has what a GPU run reports."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from benchmark_scripts import load_benchmark

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "single_gpu.py"


def _benchmark():
    return load_benchmark("single_gpu")


@pytest.mark.slow
@pytest.mark.parametrize("model", ["llama", "wan"])
def test_tiny_run_reports_every_schedule_equal_losses_and_the_ratio(model, tmp_path):
    benchmark = _benchmark()
    assert benchmark.main(["--tiny", "--models", model, "--steps", "2", "--profile-repeats", "1",
                           "--budget-s", "900", "--device", "cpu", "--out-dir", str(tmp_path)]) == 0
    page = (tmp_path / "single_gpu_cpu.md").read_text()
    record = json.loads((tmp_path / "single_gpu_cpu.json").read_text())
    (result,) = record["models"]
    assert result["model"] == model and result["steps"] == 2
    for schedule in ("static", "bucket", "dcp"):
        assert re.search(rf"^\| {schedule} \| [\d,]+ \|", page, re.M), f"no {schedule} row in\n{page}"
        assert result["tokens_per_s"][schedule] > 0
        assert len(result["per_step"][schedule]) == 2
    # The same samples each step under every schedule: the tokens agree, and so must the losses.
    for step in range(2):
        assert len({result["per_step"][s][step]["tokens"] for s in ("static", "bucket", "dcp")}) == 1
    assert result["losses_agree"], page
    assert result["loss_max_relative_difference"] <= 1e-4
    assert re.search(r"Losses: max relative difference .* agree\.", page)
    assert re.search(r"Ratio DCP / better baseline \((static|bucket)\): \d+\.\d\dx \(95% interval "
                     r"\d+\.\d\d-\d+\.\d\dx\); goal >= 1\.3x: (met|not met)", page), page
    # The rank check's host time, measured on a real gloo world of one process.
    assert result["rank_check"]["backend"] == "gloo" and result["rank_check"]["sync_s"] > 0
    assert "## The rank check's host time" in page
    # Every schedule trained every sample of the step exactly once.
    for plan in result["plans"]:
        samples = {s: sorted(i for batch in plan[s] for i in batch[0]) for s in ("static", "bucket", "dcp")}
        assert samples["static"] == samples["bucket"] == samples["dcp"]
        assert len(set(samples["dcp"])) == len(samples["dcp"])
