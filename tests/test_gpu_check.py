"""benchmarks/gpu_check.sh, the one script a lent GPU runs: its plan (order, budgets inside the total,
a header comment that matches the code), tables that survive a timeout, and its dry run end to end."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "gpu_check.sh"
PRIORITY = ["replay", "longest_sequence", "profile", "single_gpu", "kernels_bench", "varlen_choice_tests"]
OPTIONAL = ["dit_inductor_step", "compiled_choice_tests", "packed_vs_padded", "kernels_tests"]


def _clean_env(**extra: str) -> dict[str, str]:
    """The environment without any GPU_CHECK_* knob a developer may have set, plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPU_CHECK_") and k != "OUT"}
    env.update(extra)
    return env


def _plan(*args: str, **env: str) -> tuple[dict[str, dict], dict[str, int]]:
    run = subprocess.run(["bash", str(SCRIPT), "--print-plan", *args], capture_output=True, text=True,
                         env=_clean_env(**env), cwd=ROOT, timeout=60)
    assert run.returncode == 0, run.stderr
    steps, totals = {}, {}
    for line in run.stdout.splitlines():
        fields = line.split("\t")
        if fields[0] == "step":
            _, order, name, budget, state, tables, command = fields
            steps[name] = {"order": int(order), "budget": int(budget), "on": state == "on", "state": state,
                           "tables": tables.split(), "command": command}
        elif fields[0] in ("total", "sum_on"):
            totals[fields[0]] = int(fields[1])
    return steps, totals


def test_steps_run_most_valuable_first_and_the_default_budgets_fit_the_total() -> None:
    steps, totals = _plan()
    assert sorted(steps, key=lambda n: steps[n]["order"]) == PRIORITY + OPTIONAL
    assert all(steps[n]["on"] for n in PRIORITY), {n: steps[n]["state"] for n in PRIORITY}
    assert not any(steps[n]["on"] for n in OPTIONAL), {n: steps[n]["state"] for n in OPTIONAL}
    assert all(step["budget"] > 0 for step in steps.values())
    on = sum(s["budget"] for s in steps.values() if s["on"])
    assert totals["sum_on"] == on
    assert totals["total"] <= 540, "a 15-minute lease must leave room for the machine's start and a rerun"
    assert on <= totals["total"], f"default budgets {on} s exceed GPU_CHECK_TOTAL={totals['total']} s"
    # The replay is called as its developer defined it: measured compute on the GPU found.
    assert steps["replay"]["command"] == "python benchmarks/replay.py --device cuda --out-dir benchmarks/results"
    # Issue 37's longest sequence: second, 200 s, on the GPU found, its own budget inside the step's limit.
    longest = steps["longest_sequence"]
    assert longest["budget"] == 200 and longest["tables"] == ["longest_sequence_*.md", "longest_sequence_*.json"]
    assert longest["command"].startswith("python benchmarks/longest_sequence.py --device cuda --out-dir ")
    assert "--budget-s 190" in longest["command"] and "--tiny" not in longest["command"]


def test_knobs_change_the_plan() -> None:
    steps, totals = _plan(GPU_CHECK_PROFILE="no", GPU_CHECK_BUDGET_REPLAY="10", GPU_CHECK_TIMEOUT="50",
                          GPU_CHECK_TESTS="cuda", GPU_CHECK_TOTAL="300", GPU_CHECK_BENCH="full",
                          GPU_CHECK_LONGEST="no", GPU_CHECK_DIT="yes")
    assert not steps["profile"]["on"] and "GPU_CHECK_PROFILE=no" in steps["profile"]["state"]
    assert not steps["longest_sequence"]["on"] and "GPU_CHECK_LONGEST=no" in steps["longest_sequence"]["state"]
    assert steps["dit_inductor_step"]["on"]
    assert steps["replay"]["budget"] == 10
    assert all(s["budget"] <= 50 for s in steps.values())  # GPU_CHECK_TIMEOUT caps every step
    assert steps["kernels_tests"]["on"] and "-k cuda" in steps["kernels_tests"]["command"]
    assert "--quick" not in steps["kernels_bench"]["command"]
    assert totals["total"] == 300


def test_the_dry_run_runs_every_step_on_the_cpu_at_tiny_sizes() -> None:
    steps, _ = _plan("--dry-run")
    for name in ("replay", "longest_sequence", "profile", "single_gpu", "kernels_bench", "dit_inductor_step"):
        assert "--tiny" in steps[name]["command"], steps[name]["command"]
        assert "--device cuda" not in steps[name]["command"]
    assert "--device cpu" in steps["replay"]["command"] and "--device cpu" in steps["longest_sequence"]["command"]
    for name in ("varlen_choice_tests", "compiled_choice_tests"):  # the CUDA selections' CPU counterparts
        assert "-k not\\ cuda" in steps[name]["command"], steps[name]["command"]
    assert steps["packed_vs_padded"]["command"].startswith("skipped: ")
    assert "--inner inductor" not in " ".join(s["command"] for s in steps.values())


def _header_and_code() -> tuple[str, str]:
    text = SCRIPT.read_text()
    head, _, code = text.partition("\nset -uo pipefail\n")
    return head, code


def test_the_header_comment_names_every_knob_and_every_default_budget() -> None:
    head, code = _header_and_code()
    knobs = set(re.findall(r"GPU_CHECK_[A-Z_]*[A-Z]", code)) - {"GPU_CHECK_BUDGET"}
    missing = sorted(k for k in knobs if k not in head)
    assert not missing, f"knobs the code reads but the header does not describe: {missing}"
    assert "GPU_CHECK_BUDGET_<STEP>" in head
    steps, totals = _plan()
    assert f"default {totals['total']}" in head and f"sum to {totals['sum_on']}" in head
    blocks = re.split(r"\n#\s+(?=\d+ [a-z_]+)", head)
    for name, step in steps.items():
        block = next((b for b in blocks if re.match(rf"{step['order']} {name}\b", b)), None)
        assert block is not None, f"the header has no entry '{step['order']} {name}'"
        assert re.search(rf"\b{step['budget']} s\b", block), f"{name}: header does not say its {step['budget']} s budget"
        for pattern in step["tables"]:
            stem = pattern.split("*")[0].rsplit(".", 1)[0].rstrip("_")
            assert stem in block, f"{name}: header does not name the table {pattern}"
    for name in ("gpu_check_summary.md", "kernels_nvidia_smi.txt", "<step>.log"):
        assert name in head


def test_an_unknown_argument_is_refused_with_the_fix() -> None:
    run = subprocess.run(["bash", str(SCRIPT), "--dryrun"], capture_output=True, text=True, env=_clean_env(),
                         cwd=ROOT, timeout=60)
    assert run.returncode == 2 and "--dry-run" in run.stderr


# --- tables that survive a timeout -----------------------------------------------------------------
_PARTIAL_RUN = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from dcp_compile.device_profile.partial_results import Progress, interruptible, write_atomic

    out = Path(sys.argv[1])
    progress = Progress(5)
    rows = []

    def flush():
        write_atomic(out, "status: " + progress.status() + "\\n" + "\\n".join(rows) + "\\n")

    with interruptible(progress, flush):
        for case in range(5):
            rows.append(f"row {case}")
            progress.done += 1
            flush()
            print(f"measured {case}", flush=True)
            if case == 1:
                time.sleep(60)  # the signal comes here
    flush()
""")


@pytest.mark.parametrize("signum, code, name", [(signal.SIGINT, 130, "SIGINT"), (signal.SIGTERM, 143, "SIGTERM")])
def test_a_stopped_script_leaves_its_rows_marked_partial(tmp_path: Path, signum: int, code: int, name: str) -> None:
    table = tmp_path / "table.md"
    # The child starts with SIGINT at its default, whatever the test process has: an ignored SIGINT
    # is inherited, and Python then installs no KeyboardInterrupt (once, in a quick tier run in the
    # background, the child slept its 60 s through the signal and exited 0).
    process = subprocess.Popen([sys.executable, "-c", _PARTIAL_RUN, str(table)], stdout=subprocess.PIPE, text=True,
                               cwd=ROOT, env=_clean_env(PYTHONPATH=str(ROOT)),
                               preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        assert process.stdout is not None
        lines = [process.stdout.readline() for _ in range(2)]
        assert lines[-1].strip() == "measured 1", lines
        assert "partial: 2 of 5 cases so far" in table.read_text()  # written while running: a SIGKILL keeps this
        process.send_signal(signum)
        assert process.wait(timeout=90) == code  # a loaded 2-core machine took over 30 s to exit once
    finally:
        process.kill()
    text = table.read_text()
    assert f"partial: stopped after 2 of 5 cases ({name}" in text
    assert "row 1" in text and "row 2" not in text
    assert not list(tmp_path.glob(".table.md.*")), "a temporary file of an atomic write was left behind"


def test_an_uninterrupted_run_says_complete(tmp_path: Path) -> None:
    script = _PARTIAL_RUN.replace("time.sleep(60)", "pass")
    table = tmp_path / "table.md"
    run = subprocess.run([sys.executable, "-c", script, str(table)], capture_output=True, text=True, cwd=ROOT,
                         env=_clean_env(PYTHONPATH=str(ROOT)), timeout=60)
    assert run.returncode == 0, run.stderr
    assert table.read_text().startswith("status: complete: 5 of 5 cases")


@pytest.mark.slow
def test_a_step_past_its_budget_is_stopped_and_its_tables_say_partial(tmp_path: Path) -> None:
    """The kernel benchmark's dry run, made to last (40 timed calls per case: over a minute, where the
    plain dry run takes 5-20 s, too close to any budget on an idle machine) under a 10 s budget:
    gpu_check.sh stops it with SIGINT, the chooser's table says how far it got, and the summary says
    the step timed out."""
    out = tmp_path / "out"
    env = _clean_env(OUT=str(out), GPU_CHECK_REPLAY="no", GPU_CHECK_PROFILE="no", GPU_CHECK_SINGLE="no",
                     GPU_CHECK_LONGEST="no", GPU_CHECK_BUDGET_KERNELS_BENCH="10", GPU_CHECK_MIN_STEP="5",
                     GPU_CHECK_KERNELS_ARGS="--wall-clock-repeats 40")
    started = time.monotonic()
    run = subprocess.run(["bash", str(SCRIPT), "--dry-run"], capture_output=True, text=True, env=env, cwd=ROOT,
                         timeout=240)
    assert run.returncode == 1, run.stdout[-3000:] + run.stderr[-3000:]
    summary = (out / "gpu_check_summary.md").read_text()
    assert re.search(r"\| kernels_bench \| 10 \| 10 \| \d+ \| timed out at 10 s", summary), summary
    assert re.search(r"\| varlen_choice_tests \| 30 \| 30 \| \d+ \| ok \|", summary), summary
    assert "| replay | 120 | - | - | off (GPU_CHECK_REPLAY=no) |" in summary
    choice = (out / "varlen_choice_cpu.json").read_text()
    assert re.search(r'"status": "partial: stopped after \d of 4 cases \(SIGINT', choice), choice
    assert time.monotonic() - started < 200


# --- the dry run, end to end -----------------------------------------------------------------------
@pytest.mark.slow
def test_the_dry_run_writes_every_table_of_the_gpu_run_labelled(tmp_path: Path) -> None:
    """About 5 minutes on 2 busy cores: every default step at tiny sizes on the CPU."""
    out = tmp_path / "out"
    run = subprocess.run(["bash", str(SCRIPT), "--dry-run"], capture_output=True, text=True,
                         env=_clean_env(OUT=str(out)), cwd=ROOT, timeout=900)
    assert run.returncode == 0, run.stdout[-5000:] + run.stderr[-3000:]
    steps, _ = _plan()  # the GPU run's plan: the dry run must write every table it would
    summary = (out / "gpu_check_summary.md").read_text()
    assert "dry run on CPU" in summary
    for name, step in steps.items():
        if not step["on"]:
            continue
        assert re.search(rf"\| {name} \| \d+ \| \d+ \| \d+ \| ok \|", summary), f"{name} not ok:\n{summary}"
        assert (out / f"{name}.log").stat().st_size > 0
        for pattern in step["tables"]:
            found = sorted(out.glob(pattern))
            assert found, f"{name}: no {pattern} in {sorted(p.name for p in out.iterdir())}"
            for path in found:
                assert path.stat().st_size > 0, path
                if path.suffix == ".png":
                    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", path
                    continue
                text = path.read_text()
                assert "dry run on CPU" in text, f"{path.name} does not say it is a dry run"
                assert "partial: stopped" not in text, f"{path.name} was cut short in a dry run:\n{text[:2000]}"
