"""Hugging Face Accelerate loops (diffusers' training scripts) with data-centric steps.

    model, compiled = dcp.accelerate.prepare_model(accelerator, model)           # no DDP: dcp syncs
    optimizer, lr_scheduler = accelerator.prepare(optimizer, lr_scheduler)
    loader = dcp.accelerate.prepare_data(accelerator, dataset, sampler, collate_fn=collate)
    for step in loader:                                   # one item per optimizer step, every rank
        for mb, batch in step:
            with dcp.use(mb):
                loss = loss_fn(compiled, batch)
            accelerator.backward(loss * mb.loss_scale)
        dcp.sync_gradients(model)
        accelerator.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step(); lr_scheduler.step(); optimizer.zero_grad()
    accelerator.save_state(directory)                     # model, optimizer, scheduler and the sampler position

Why not ``accelerator.prepare(model, dataloader)`` as usual: it would wrap the model in DDP, which
all-reduces (and averages) inside every backward while ranks run different numbers of
micro-batches (a hang or a mis-weighted step), and it would shard the data loader over ranks when
the plan has already said which rank trains which sample. :func:`prepare_model` therefore places
the model and applies Accelerate's mixed precision without the DDP wrapper, and the step's
gradients are summed once by :func:`dcp.sync_gradients`. ``accelerator.accumulate`` is not needed:
the planner's micro-batches are the accumulation, so the Accelerator must keep
``gradient_accumulation_steps=1`` (its ``backward`` would otherwise divide every loss again).

The Accelerator must see the ``torch.distributed`` world (``accelerate launch``, or torchrun, on
GPUs; ``Accelerator(cpu=True)`` or ``accelerate launch --cpu`` on CPU): one that does not would
let every rank act as the main process. :func:`prepare_model` refuses it, naming the fix.
Resuming: ``accelerator.load_state`` puts the loader at the first step not yet trained, so do not
also ``accelerator.skip_first_batches`` it.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from dcp_compile.runtime.step_loader import DataCentricStepLoader


def check_world(seen: int, who: str, cpu_fix: str) -> None:
    """``who`` must see the torch.distributed world: it saves on one rank and reduces what it logs.

    A process group the framework did not see is what transformers' warning "torch.distributed
    process group is initialized, but parallel_mode != ParallelMode.DISTRIBUTED" is about.
    """
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or seen == dist.get_world_size():
        return
    raise ValueError(
        f"dcp: torch.distributed runs {dist.get_world_size()} ranks but {who} sees {seen} process(es), so every "
        f"rank would act as the main one (each writing checkpoints, each logging its own loss). On CPU, {cpu_fix}; "
        "on GPUs, launch with torchrun or accelerate launch, which set the LOCAL_RANK and WORLD_SIZE it reads"
    )


def _check_accelerator(accelerator: Any) -> None:
    from accelerate.utils import DistributedType

    check_world(accelerator.num_processes, "the Accelerator",
                "build Accelerator(cpu=True) (or launch with `accelerate launch --cpu`)")
    if accelerator.gradient_accumulation_steps != 1:
        raise ValueError(
            f"dcp: the Accelerator has gradient_accumulation_steps={accelerator.gradient_accumulation_steps}, and "
            "accelerator.backward divides every loss by it, while each micro-batch's mb.loss_scale already weights "
            "it exactly. Build the Accelerator with gradient_accumulation_steps=1 and raise tokens_per_step instead: "
            "the planner splits a step into micro-batches itself"
        )
    unsupported = {DistributedType.DEEPSPEED, DistributedType.FSDP, DistributedType.MEGATRON_LM}
    if accelerator.distributed_type in unsupported:
        raise ValueError(
            f"dcp: Accelerate's {accelerator.distributed_type.value} reduces gradients inside backward per micro-batch; "
            "data-centric steps need one SUM per step. Launch without it (plain multi-GPU/CPU), or shard "
            "parameters with dcp.shard_model (docs/training.md, FSDP2)"
        )


def prepare_model(accelerator: Any, model: torch.nn.Module, options: dict[str, Any] | None = None
                  ) -> tuple[torch.nn.Module, torch.nn.Module]:
    """Place ``model`` and apply the Accelerator's mixed precision, without DDP; return
    ``(model, compiled)``: train through ``compiled``, and give ``model`` to the optimizer,
    ``dcp.sync_gradients`` and checkpoints (``accelerator.save_state`` saves it)."""
    import dcp_compile as dcp

    _check_accelerator(accelerator)
    # evaluation_mode=True is Accelerate's switch for "no distributed wrapper": the model is still
    # placed, cast by the mixed-precision policy and registered for save_state / load_state.
    model = accelerator.prepare_model(model, evaluation_mode=True)
    model.train()
    dcp.runtime.watch_parameters(model)  # parameters a graph break leaves in eager code: exact from step one
    compiled = torch.compile(model, backend="dcp", dynamic=True, options=dict(options or {}))
    return model, compiled


def prepare_data(accelerator: Any, dataset: Any, sampler: Any, collate_fn: Callable | None = None,
                 **dataloader_kwargs: Any) -> DataCentricStepLoader:
    """One item per optimizer step (:class:`DataCentricStepLoader`), registered with
    ``accelerator.register_for_checkpointing`` so that ``save_state`` / ``load_state`` keep the
    sampler's position: a resumed run trains exactly the samples not yet seen."""
    loader = DataCentricStepLoader(dataset, sampler, collate_fn, **dataloader_kwargs)
    accelerator.register_for_checkpointing(loader)
    return loader
