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

The top level holds what the documented training loops call, and ``DCPError``, the base of every
error a loop may catch; the rest is in four namespaces, each an attribute of the package:

* ``dcp.schedule``: the cost model, hardware presets, planner, plan records (``StepPlan``,
  ``MicroBatch``...), sampler;
* ``dcp.checkpoint``: ``save_checkpoint``, ``load_checkpoint``, ``latest_checkpoint``...;
* ``dcp.report``: what DCP did (``recording``, ``sharding_summary``, the HTML reports);
* ``dcp.errors``: each error class (``RankMismatchError``, ``PlanningError``...) and ``fault_guard``.

``dir(dcp)`` lists exactly these. The code is in packages whose imports point one way:

* ``dcp_compile.compiler`` (backend, dispatcher, passes) uses ``dcp_compile.kernels``;
* ``dcp_compile.schedule`` prices variants by name and never imports the compiler;
* ``dcp_compile.runtime`` (process groups, gradient sync, FSDP2, packing, checkpoints) is what a
  training loop calls around the compiled model (``dcp.runtime.create_sp_groups``,
  ``idle_round``, ``watch_parameters``);
* ``dcp_compile.report`` reads the compiler's records and never the other way round;
* ``dcp_compile.huggingface`` and ``dcp_compile.accelerate``: the Trainer and Accelerate glue.

Every name loads on first use, so ``import dcp_compile.compiler.passes`` does not pull in the
scheduler, and importing the package changes no torch setting and issues no collective. A name
that moved off the top level still resolves for one release, with a ``DeprecationWarning`` that
names its new spelling.
"""

from __future__ import annotations

import importlib
import warnings

from dcp_compile.errors import DCPError
from dcp_compile.variant import RecomputePolicy, Variant

# name -> module that defines it (loaded by ``__getattr__`` on first access)
_EXPORTS = {
    "use": "dcp_compile.compiler.variant_selection",
    "explain": "dcp_compile.compiler.inspection",
    "check": "dcp_compile.compiler.self_check",
    "profile": "dcp_compile.device_profile",
    "CostModel": "dcp_compile.schedule.cost_model",
    "ModelProfile": "dcp_compile.schedule.cost_model",
    "Hardware": "dcp_compile.schedule.hardware",
    "DataCentricSampler": "dcp_compile.schedule.sampler",
    "DataCentricBatchSampler": "dcp_compile.schedule.data_loading",
    "pack_sequences": "dcp_compile.runtime.packing",
    "sync_gradients": "dcp_compile.runtime.gradient_sync",
    "shard_model": "dcp_compile.runtime.fsdp",
    "begin_step": "dcp_compile.runtime.fsdp",
}
# the namespaces listed by ``dir``, and the other subpackages, reachable as attributes
_NAMESPACES = ("schedule", "checkpoint", "report", "errors")
_SUBPACKAGES = {*_NAMESPACES, "compiler", "kernels", "runtime", "huggingface", "accelerate", "device_profile"}

# Off the top level since 0.1.0; each still resolves, with a DeprecationWarning, for one release.
_MOVED = {
    **{name: "dcp.schedule" for name in (
        "CalibrationPoint", "video_attention_span", "GroupPlan", "MicroBatch", "Schedule", "StepPlan",
        "Planner", "PlannerConfig", "LoadedStep", "RECOMPUTE_POLICIES")},
    **{name: "dcp.checkpoint" for name in (
        "save_checkpoint", "load_checkpoint", "latest_checkpoint", "checkpoint_path", "CheckpointInfo")},
    **{name: "dcp.report" for name in ("recording", "sharding_summary")},
    **{name: "dcp.errors" for name in (
        "RankMismatchError", "RankTimeoutError", "PeerFailureError", "fault_guard", "PlanningError",
        "PlanMismatchError", "ParametersOutsideGraphs", "CheckFailed", "CannotPack")},
    **{name: "dcp.runtime" for name in ("create_sp_groups", "idle_round", "watch_parameters", "PackedBatch")},
    "Bucket": "dcp_compile.compiler.variant_selection",
}

__all__ = [  # what ``dir(dcp)`` lists: at most 20 names (tests/test_public_api.py)
    "CostModel", "DCPError", "DataCentricBatchSampler", "DataCentricSampler", "Hardware",
    "ModelProfile", "RecomputePolicy", "Variant", "begin_step", "check", "checkpoint", "errors",
    "explain", "pack_sequences", "profile", "report", "schedule", "shard_model", "sync_gradients",
    "use",
]


def __getattr__(name: str):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value
        return value
    if name in _SUBPACKAGES:
        return importlib.import_module(f"dcp_compile.{name}")
    if name in _MOVED:
        new = _MOVED[name]
        warnings.warn(f"dcp.{name} is deprecated: use {new}.{name}", DeprecationWarning, stacklevel=2)
        return getattr(importlib.import_module(new.replace("dcp.", "dcp_compile.", 1)), name)
    raise AttributeError(f"module 'dcp_compile' has no attribute {name!r}")


def __dir__() -> list[str]:
    return list(__all__)
