"""The errors a training loop may catch, each a :class:`DCPError` whose message names the problem
and the fix (``except dcp.DCPError`` catches all of them; ``except dcp.errors.RankMismatchError``
one). Each also keeps the builtin base it had (``RuntimeError``, ``ValueError``, ``AssertionError``).

* :class:`RankMismatchError`, :class:`RankTimeoutError`, :class:`PeerFailureError`: ranks that must
  agree did not, did not arrive in time, or another rank failed (docs/ranks.md);
  :func:`fault_guard` around a step names the failed rank on its peers;
* :class:`PlanningError` (a step cannot be planned), :class:`PlanMismatchError` (ranks derived
  different plans);
* :class:`ParametersOutsideGraphs` (gradients from eager code that cannot be divided exactly);
* :class:`CheckFailed` (``dcp.check``: the compiled model disagrees with eager);
* :class:`CannotPack` (a packed micro-batch for a graph whose attention cannot take boundaries).

This module imports nothing of the package but its lazy-export helper: the classes load on first
use from where they are raised, so ``import dcp_compile.errors`` stays light.
"""

from __future__ import annotations

from dcp_compile.lazy_exports import lazy_getattr


class DCPError(Exception):
    """Base of every error dcp-compile raises for a user to catch."""


# name -> module that defines it (loaded by ``__getattr__`` on first access)
_EXPORTS = {
    "RankMismatchError": "dcp_compile.runtime.consistency",
    "RankTimeoutError": "dcp_compile.runtime.consistency",
    "PeerFailureError": "dcp_compile.runtime.consistency",
    "fault_guard": "dcp_compile.runtime.consistency",
    "PlanningError": "dcp_compile.schedule.planning_state",
    "PlanMismatchError": "dcp_compile.schedule.sampler",
    "ParametersOutsideGraphs": "dcp_compile.runtime.graph_parameters",
    "CheckFailed": "dcp_compile.compiler.self_check",
    "CannotPack": "dcp_compile.compiler.passes.use_varlen_attention",
}

__all__ = sorted(["DCPError", *_EXPORTS])


__getattr__ = lazy_getattr(__name__, _EXPORTS)


def __dir__() -> list[str]:
    return list(__all__)
