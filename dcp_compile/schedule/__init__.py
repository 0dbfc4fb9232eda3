"""``dcp.schedule``: the cost model, the hardware presets, the planner and its plans, the sampler.

What a training loop needs is also at the top level (``dcp.CostModel``, ``dcp.ModelProfile``,
``dcp.Hardware``, ``dcp.DataCentricSampler``, ``dcp.DataCentricBatchSampler``); the rest is here:
the plan records a step yields (:class:`StepPlan`, :class:`GroupPlan`, :class:`MicroBatch`,
:class:`Schedule`), the planner run by hand (:class:`Planner`, :class:`PlannerConfig`), cost-model
calibration (:class:`CalibrationPoint`, :func:`video_attention_span`), :class:`LoadedStep` (what a
``DataCentricBatchSampler`` yields) and ``RECOMPUTE_POLICIES`` (the policies, fastest first).

The names load on first use: ``import dcp_compile.schedule.cost_model`` does not import the planner.
This package prices variants by name and never imports the compiler.
"""

from __future__ import annotations

from dcp_compile.lazy_exports import lazy_getattr

# name -> module that defines it (loaded by ``__getattr__`` on first access)
_EXPORTS = {
    "CostModel": "dcp_compile.schedule.cost_model",
    "ModelProfile": "dcp_compile.schedule.cost_model",
    "CalibrationPoint": "dcp_compile.schedule.cost_model",
    "video_attention_span": "dcp_compile.schedule.cost_model",
    "Hardware": "dcp_compile.schedule.hardware",
    "GroupPlan": "dcp_compile.schedule.plan",
    "MicroBatch": "dcp_compile.schedule.plan",
    "Schedule": "dcp_compile.schedule.plan",
    "StepPlan": "dcp_compile.schedule.plan",
    "Planner": "dcp_compile.schedule.planner",
    "PlannerConfig": "dcp_compile.schedule.planner",
    "DataCentricSampler": "dcp_compile.schedule.sampler",
    "DataCentricBatchSampler": "dcp_compile.schedule.data_loading",
    "LoadedStep": "dcp_compile.schedule.data_loading",
    "RECOMPUTE_POLICIES": "dcp_compile.variant",
}

__all__ = sorted(_EXPORTS)


__getattr__ = lazy_getattr(__name__, _EXPORTS)


def __dir__() -> list[str]:
    return sorted({*__all__, *(name for name in globals() if not name.startswith("_") and name not in ("annotations", "lazy_getattr"))})
