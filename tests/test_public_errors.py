"""Every error a user may catch is reachable as ``dcp.<Name>`` (``except dcp.RankMismatchError``)."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest

import dcp_compile as dcp

PUBLIC_ERRORS = {
    "RankMismatchError": "dcp_compile.runtime.consistency",
    "RankTimeoutError": "dcp_compile.runtime.consistency",
    "PeerFailureError": "dcp_compile.runtime.consistency",
    "PlanMismatchError": "dcp_compile.schedule.sampler",
    "PlanningError": "dcp_compile.schedule.planning_state",
    "ParametersOutsideGraphs": "dcp_compile.runtime.graph_parameters",
    "CheckFailed": "dcp_compile.compiler.self_check",
    "CannotPack": "dcp_compile.compiler.passes.use_varlen_attention",
}


@pytest.mark.parametrize("name, module", sorted(PUBLIC_ERRORS.items()))
def test_public_error_is_exported_as_the_class_that_is_raised(name, module):
    exported = getattr(dcp, name)
    assert exported is getattr(importlib.import_module(module), name)  # `except dcp.X` catches what is raised
    assert issubclass(exported, Exception) and name in dcp.__all__ and name in dir(dcp)


def test_a_raised_rank_mismatch_is_caught_by_the_exported_name():
    from dcp_compile.runtime import consistency

    with pytest.raises(dcp.RankMismatchError):
        raise consistency.RankMismatchError("rank 1: length 40, rank 0: length 37")
    assert dcp.fault_guard is consistency.fault_guard


def test_exporting_errors_keeps_the_import_light():
    """The names load on first use: importing the package does not import the compiler or torch.distributed's
    consistency code."""
    code = ("import sys, dcp_compile; "
            "print(any(m.startswith(('dcp_compile.runtime.consistency', 'dcp_compile.compiler.passes')) for m in sys.modules))")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.stdout.strip() == "False", run
