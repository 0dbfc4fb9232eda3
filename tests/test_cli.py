"""The command line refuses what cannot run, at once, and importing the package prints nothing."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from dcp_compile.__main__ import main


@pytest.mark.parametrize("argv, message", [
    (["demo", "--steps", "0"], "argument --steps: must be at least 1, got 0"),
    (["demo", "--world-size", "0"], "argument --world-size: must be at least 1, got 0"),
    (["demo", "--steps", "-3"], "argument --steps: must be at least 1, got -3"),
    (["demo", "--world-size", "two"], "argument --world-size: expected a whole number, got 'two'"),
])
def test_demo_refuses_counts_below_one_before_doing_anything(capsys, argv, message):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_the_shell_command_fails_within_seconds():
    start = time.monotonic()
    run = subprocess.run([sys.executable, "-m", "dcp_compile", "demo", "--world-size", "0"],
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 2, run
    assert "--world-size: must be at least 1, got 0" in run.stderr, run.stderr
    assert time.monotonic() - start < 30


def test_importing_the_package_warns_nothing():
    """torch warns "Failed to initialize NumPy" when numpy is missing; numpy is a dependency now."""
    run = subprocess.run([sys.executable, "-W", "default", "-c", "import dcp_compile, dcp_compile.compiler.backend"],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert run.stderr == "", run.stderr


def test_inspect_help_lists_its_options():
    # As a subparser with a REMAINDER argument, `inspect --help` listed only `rest`.
    run = subprocess.run([sys.executable, "-m", "dcp_compile", "inspect", "--help"],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    for option in ("target", "--sp", "--out", "--inner"):
        assert option in run.stdout, run.stdout
    assert " rest" not in run.stdout, run.stdout
