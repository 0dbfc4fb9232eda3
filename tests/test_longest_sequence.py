"""benchmarks/longest_sequence.py (issue 37's "longest sequence one GPU trains"): the procedure that
picks the tries (calibrate, predict, try the smaller prediction, ~10% longer after a fit, shorter
after an OOM, time-capped when the budget is short) and the page it writes, on a stand-in device
whose memory is a line and whose OOM is a threshold (no compile: quick); the script itself on the CPU
end to end (slow: it compiles a Llama variant)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dcp_compile.schedule.cost_model import CostModel
from dcp_compile.schedule.hardware import Hardware
from benchmark_scripts import load_benchmark

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "longest_sequence.py"


def _script():
    return load_benchmark("longest_sequence")


ls = _script()
FREE = 80e9  # what a step may take on the stand-in device
BEFORE = 5e9


class LineDevice:
    """A GPU stand-in: a step's peak is ``fixed + slope[policy] * tokens``; over ``FREE`` it is an OOM."""

    device = torch.device("cuda")

    def __init__(self, slope: dict[str, float], seconds_per_token: float = 1e-6, fixed: float = 1e9) -> None:
        self.slope, self.seconds_per_token, self.fixed = slope, seconds_per_token, fixed
        self.measured: list[tuple[str, str, int]] = []

    def warm_up(self, policy: str, tokens: int) -> float:
        return 0.1

    def free_bytes(self) -> float:
        return FREE

    def measure(self, policy: str, kind: str, tokens: int):
        self.measured.append((policy, kind, tokens))
        peak = self.fixed + self.slope[policy] * tokens
        fits = peak <= FREE
        return ls.Step(policy, kind, tokens, "fit" if fits else "OOM", peak_bytes=min(peak, FREE),
                       allocated_peak_bytes=BEFORE + min(peak, FREE), before_bytes=BEFORE,
                       seconds=self.seconds_per_token * tokens, note="" if fits else "CUDA out of memory. Tried to allocate")


def _procedure(tmp_path: Path, slope_factor: dict[str, float], budget_s: float = 600.0, seconds_per_token: float = 1e-6):
    args = ls.parse_args(["--device", "cuda", "--policies", *slope_factor, "--out-dir", str(tmp_path)])
    cost_model = CostModel(ls.profile_for(ls.llama_config(False, 1), 1, 2), Hardware.H100)
    model_slope = {p: (ls.modelled_step_bytes(cost_model, 32768, p, False) - ls.modelled_step_bytes(cost_model, 16384, p, False))
                   / 16384 for p in slope_factor}
    device = LineDevice({p: f * model_slope[p] for p, f in slope_factor.items()}, seconds_per_token)
    run = ls.Run(device="NVIDIA H100 80GB HBM3 (stand-in)", software={"torch": "x", "cuda": "y", "triton": "z"},
                 dry_run=False, layers=1, dtype="bfloat16", inner="aot_eager",
                 memory_capacity_bytes=Hardware.H100.memory_capacity, cap_note="cap note",
                 state_modelled_bytes=cost_model.model_state_bytes(), args=vars(args) | {"out_dir": str(tmp_path)},
                 allocator="PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True")
    progress = ls.Progress(len(slope_factor) * (2 + args.tries), unit="steps")
    pages: list[str] = []

    def flush() -> None:
        run.status = ls.status_line(run, progress)
        pages.append(ls.markdown(run))

    procedure = ls.Procedure(args, device, cost_model, run, ls.Budget(budget_s), flush, progress)
    for policy in slope_factor:
        procedure.policy(policy)
    run.full_depth = ls.full_depth(Hardware.H100, run.memory_capacity_bytes, cost_model.profile,
                                   run.policies[0], cost_model.reserved_bytes)
    flush()
    return run, device, pages, cost_model


def test_tries_start_at_the_smaller_prediction_then_go_longer_after_a_fit_and_record_the_oom(tmp_path: Path) -> None:
    """lean measures 10% more per token than modelled: the measured slope's longest is the smaller,
    it fits, and 10% longer is an OOM. block measures 10% less: the model's longest is the smaller,
    and both tries fit."""
    run, device, pages, cost_model = _procedure(tmp_path, {"lean": 1.1, "block": 0.9})
    lean, block = run.policies
    assert [kind for _, kind, _ in device.measured[:2]] == ["calibration", "calibration"]
    assert lean.measured_bytes_per_token == pytest.approx(1.1 * lean.modelled_bytes_per_token, rel=1e-6)
    assert lean.modelled_longest == cost_model.token_capacity(1, "lean", Hardware.H100.memory_capacity)
    first, second = lean.tries()
    assert first.tokens == ls.round_down(min(lean.modelled_longest, lean.measured_slope_longest), 1024)
    assert lean.measured_slope_longest < lean.modelled_longest
    assert (first.result, second.result) == ("fit", "OOM")
    assert second.tokens == ls.round_down(first.tokens * 1.1, 1024)
    assert lean.longest_fit == first.tokens and lean.shortest_failure == second.tokens
    assert first.modelled_peak_bytes == pytest.approx(ls.modelled_step_bytes(cost_model, first.tokens, "lean", False))
    assert block.tries()[0].tokens == ls.round_down(block.modelled_longest, 1024)
    assert [s.result for s in block.tries()] == ["fit", "fit"]
    page = pages[-1]
    assert len(pages) >= 9  # rewritten after every step
    for text in ("**measured**", "**modelled**", "NVIDIA H100", "| lean | try |", "OOM", "500,000", "2506.13996",
                 "Status: complete: 8 of 8 steps", "With all 32 layers", f"{first.tokens:,}"):
        assert text in page, text
    assert json.loads(ls.to_json(run))["policies"][0]["longest_fit"] == first.tokens


def test_the_documented_32_layer_figure_is_capacity_md_s(tmp_path: Path) -> None:
    """The page's documented setting is benchmarks/results/capacity.md's one H100 under ZeRO-3 with
    the optimizer offloaded (694,563 tokens under lean), computed, not copied."""
    run, *_ = _procedure(tmp_path, {"lean": 1.0})
    assert run.full_depth["documented_lean_tokens"] == 694_563
    assert f"{694_563:,}" in (ROOT / "benchmarks" / "results" / "capacity.md").read_text()
    assert run.full_depth["measured_slope_documented_tokens"] > 0


def test_a_short_budget_caps_the_first_try_to_what_the_time_allows(tmp_path: Path) -> None:
    """The first try would take minutes: it runs shorter, within the time left, labelled a lower
    bound, and the second is not run."""
    run, device, pages, _ = _procedure(tmp_path, {"lean": 1.0}, budget_s=60.0, seconds_per_token=3e-5)
    lean = run.policies[0]
    (capped,) = lean.tries()
    assert capped.tokens < ls.round_down(min(lean.modelled_longest, lean.measured_slope_longest), 1024)
    assert capped.tokens > 32768 and "time-capped" in capped.note and capped.result == "fit"
    assert lean.steps[-1].result.startswith("not run")
    assert "lower bound" in pages[-1] and "Status: partial: 3 of 4 steps run, 1 not run" in pages[-1]


@pytest.mark.slow
def test_the_tiny_cpu_run_writes_a_labelled_complete_page(tmp_path: Path) -> None:
    """About 25 s on 2 busy cores (the Llama variant's compile): the script's whole path on a CPU."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPU_CHECK_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    run = subprocess.run([sys.executable, str(SCRIPT), "--tiny", "--policies", "lean", "--out-dir", str(tmp_path)],
                         capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    page = (tmp_path / "longest_sequence_cpu.md").read_text()
    data = json.loads((tmp_path / "longest_sequence_cpu.json").read_text())
    assert "dry run on CPU" in page and data["label"] == "dry run on CPU"
    assert "Status: complete: 4 of 4 steps" in page
    steps = data["policies"][0]["steps"]
    assert [s["kind"] for s in steps] == ["calibration", "calibration", "try", "try"]
    assert all(s["peak_bytes"] > 0 for s in steps)  # VmHWM above the step's start, measured
    assert data["policies"][0]["measured_bytes_per_token"] > 0 and data["policies"][0]["modelled_longest"] > 0
    assert "| lean | try |" in page and "**measured**" in page and "**modelled**" in page
