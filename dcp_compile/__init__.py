"""dcp-compile: Data-Centric Parallel training for any PyTorch model, as a torch.compile backend.

    cost_model = dcp.CostModel(dcp.ModelProfile.measure(model, make_inputs, causal=True), dcp.Hardware.detect())
    model = torch.compile(model, backend="dcp", dynamic=True)
    sampler = dcp.DataCentricSampler(lengths, tokens_per_step=65536, cost_model=cost_model, seed=0,
                                     supervised_tokens=[n - 1 for n in lengths])
    for step in sampler:
        for mb in step.microbatches:
            with dcp.use(mb):
                loss = model(**collate(mb.indices)).loss * mb.loss_scale
            loss.backward()
        dcp.sync_gradients(model)
        optimizer.step(); optimizer.zero_grad()

(docs/training.md, "The data-centric loop", has this loop with its ``collate``; tests/test_readme.py runs it as written.)

The package is four packages whose imports point one way:

* ``dcp_compile.compiler`` (backend, dispatcher, passes) uses ``dcp_compile.kernels``;
* ``dcp_compile.schedule`` (cost model, planner, sampler) prices variants by name and never
  imports the compiler;
* ``dcp_compile.runtime`` (process groups, gradient sync, packing, Hugging Face glue) is what a
  training loop calls around the compiled model.

The names below are loaded on first use, so ``import dcp_compile.compiler.passes`` does not pull
in the scheduler, and importing the package changes no torch setting and issues no collective.
"""

from __future__ import annotations

import importlib
from typing import Any

from dcp_compile.variant import RecomputePolicy, Variant

# name -> module that defines it (loaded by ``__getattr__`` on first access)
_EXPORTS = {
    "Bucket": "dcp_compile.compiler.variant_selection",
    "use": "dcp_compile.compiler.variant_selection",
    "explain": "dcp_compile.compiler.inspection",
    "recording": "dcp_compile.compiler.inspection",
    "sharding_summary": "dcp_compile.compiler.sharding_summary",
    "check": "dcp_compile.compiler.self_check",
    "profile": "dcp_compile.device_profile",
    "CalibrationPoint": "dcp_compile.schedule.cost_model",
    "CostModel": "dcp_compile.schedule.cost_model",
    "ModelProfile": "dcp_compile.schedule.cost_model",
    "video_attention_span": "dcp_compile.schedule.cost_model",
    "Hardware": "dcp_compile.schedule.hardware",
    "GroupPlan": "dcp_compile.schedule.plan",
    "MicroBatch": "dcp_compile.schedule.plan",
    "Schedule": "dcp_compile.schedule.plan",
    "StepPlan": "dcp_compile.schedule.plan",
    "Planner": "dcp_compile.schedule.planner",
    "PlannerConfig": "dcp_compile.schedule.planner",
    "PlanningError": "dcp_compile.schedule.planner",
    "DataCentricSampler": "dcp_compile.schedule.sampler",
    "PlanMismatchError": "dcp_compile.schedule.sampler",
    "sync_gradients": "dcp_compile.runtime.gradient_sync",
    "shard_model": "dcp_compile.runtime.fsdp",
    "begin_step": "dcp_compile.runtime.fsdp",
    "idle_round": "dcp_compile.runtime.fsdp",
    "DataCentricBatchSampler": "dcp_compile.schedule.data_loading",
    "LoadedStep": "dcp_compile.schedule.data_loading",
    "save_checkpoint": "dcp_compile.runtime.checkpoints",
    "load_checkpoint": "dcp_compile.runtime.checkpoints",
    "latest_checkpoint": "dcp_compile.runtime.checkpoints",
    "checkpoint_path": "dcp_compile.runtime.checkpoints",
    "CheckpointInfo": "dcp_compile.runtime.checkpoints",
    "watch_parameters": "dcp_compile.runtime.graph_parameters",
    "PackedBatch": "dcp_compile.runtime.packing",
    "pack_sequences": "dcp_compile.runtime.packing",
    "create_sp_groups": "dcp_compile.runtime.process_groups",
    # Errors a training loop may catch (each names the problem and the fix in its message).
    "RankMismatchError": "dcp_compile.runtime.consistency",
    "RankTimeoutError": "dcp_compile.runtime.consistency",
    "PeerFailureError": "dcp_compile.runtime.consistency",
    "fault_guard": "dcp_compile.runtime.consistency",
    "ParametersOutsideGraphs": "dcp_compile.runtime.graph_parameters",
    "CheckFailed": "dcp_compile.compiler.self_check",
    "CannotPack": "dcp_compile.compiler.passes.use_varlen_attention",
}
_SUBPACKAGES = {"compiler", "kernels", "schedule", "runtime", "huggingface", "accelerate"}

__all__ = sorted([*_EXPORTS, "RecomputePolicy", "Variant", "RECOMPUTE_POLICIES"])

RECOMPUTE_POLICIES = tuple(policy.value for policy in RecomputePolicy)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value
        return value
    if name in _SUBPACKAGES:
        return importlib.import_module(f"dcp_compile.{name}")
    raise AttributeError(f"module 'dcp_compile' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])
