"""dcp-compile: Data-Centric Parallel training for any PyTorch model, as a torch.compile backend.

    model = torch.compile(model, backend="dcp", dynamic=True)
    sampler = dcp.DataCentricSampler(lengths, tokens_per_step=65536, seed=0)
    for step in sampler:
        for mb in step.microbatches:
            with dcp.use(mb):
                loss = model(**collate(mb.indices)).loss * mb.loss_scale
            loss.backward()
        dcp.sync_gradients(model)
        optimizer.step(); optimizer.zero_grad()
"""

from __future__ import annotations

import torch._logging._internal as _torch_logging

from dcp_compile.cost_model import RECOMPUTE_POLICIES, CalibrationPoint, CostModel, ModelProfile, video_attention_span
from dcp_compile.gradient_sync import sync_gradients
from dcp_compile.hardware import Hardware
from dcp_compile.packing import PackedBatch, pack_sequences
from dcp_compile.plan import GroupPlan, MicroBatch, Schedule, StepPlan
from dcp_compile.planner import Planner, PlannerConfig, PlanningError
from dcp_compile.process_groups import create_sp_groups
from dcp_compile.sampler import DataCentricSampler, PlanMismatchError
from dcp_compile.variants import Bucket, Variant, use

try:  # TORCH_LOGS="+dcp_compile" turns on this package's loggers
    _torch_logging.register_log("dcp_compile", "dcp_compile")
except Exception:  # pragma: no cover - logging registration is best effort
    pass

__all__ = [
    "Bucket", "CalibrationPoint", "CostModel", "DataCentricSampler", "GroupPlan", "Hardware",
    "MicroBatch", "ModelProfile", "PackedBatch", "PlanMismatchError", "Planner", "PlannerConfig", "PlanningError",
    "RECOMPUTE_POLICIES", "Schedule", "StepPlan", "Variant", "create_sp_groups", "explain",
    "pack_sequences", "sync_gradients", "use", "video_attention_span",
]


def explain(model, *args, **kwargs):
    """Run the compiled model once and return what the dcp backend did (see ``dcp_compile.inspection``)."""
    from dcp_compile.inspection import explain as _explain

    return _explain(model, *args, **kwargs)
