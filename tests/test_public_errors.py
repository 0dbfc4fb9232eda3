"""Every error a user may catch is a ``dcp.DCPError``, reachable as ``dcp.errors.<Name>``
(``except dcp.errors.RankMismatchError``), and is the class that is raised."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest

import dcp_compile as dcp

PUBLIC_ERRORS = {
    "RankMismatchError": ("dcp_compile.runtime.consistency", RuntimeError),
    "RankTimeoutError": ("dcp_compile.runtime.consistency", RuntimeError),
    "PeerFailureError": ("dcp_compile.runtime.consistency", RuntimeError),
    "PlanMismatchError": ("dcp_compile.schedule.sampler", RuntimeError),
    "PlanningError": ("dcp_compile.schedule.planning_state", ValueError),
    "ParametersOutsideGraphs": ("dcp_compile.runtime.graph_parameters", RuntimeError),
    "CheckFailed": ("dcp_compile.compiler.self_check", AssertionError),
    "CannotPack": ("dcp_compile.compiler.passes.use_varlen_attention", ValueError),
}


@pytest.mark.parametrize("name, module, builtin", [(n, m, b) for n, (m, b) in sorted(PUBLIC_ERRORS.items())])
def test_public_error_is_exported_as_the_class_that_is_raised(name, module, builtin):
    exported = getattr(dcp.errors, name)
    assert exported is getattr(importlib.import_module(module), name)  # `except dcp.errors.X` catches what is raised
    assert issubclass(exported, dcp.DCPError) and issubclass(exported, builtin)  # old `except ValueError` still works
    assert name in dcp.errors.__all__ and name in dir(dcp.errors)


def test_a_raised_rank_mismatch_is_caught_by_the_exported_name_and_the_base():
    from dcp_compile.runtime import consistency

    with pytest.raises(dcp.errors.RankMismatchError):
        raise consistency.RankMismatchError("rank 1: length 40, rank 0: length 37")
    with pytest.raises(dcp.DCPError):
        raise consistency.RankMismatchError("rank 1: length 40, rank 0: length 37")
    assert dcp.errors.fault_guard is consistency.fault_guard
    assert dcp.errors.DCPError is dcp.DCPError


def test_exporting_errors_keeps_the_import_light():
    """The names load on first use: importing the package (or ``dcp_compile.errors``) does not import the
    compiler or torch.distributed's consistency code."""
    code = ("import sys, dcp_compile, dcp_compile.errors; dcp_compile.DCPError; "
            "print(any(m.startswith(('dcp_compile.runtime', 'dcp_compile.compiler', 'dcp_compile.schedule')) "
            "for m in sys.modules))")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.stdout.strip() == "False", run
