"""FSDP2 (``fully_shard``) with data-centric steps: one all-gather and one reduce-scatter per step.

Why FSDP2 cannot run as usual: ranks of different SP groups run different numbers of
micro-batches in a step (some none at all), and plain FSDP2 issues an all-gather per layer per
forward and a reduce-scatter per layer per backward. Those per-micro-batch collectives would
pair up across ranks wrongly or hang. FSDP2 also *averages* gradients over ranks, while exact
token weighting needs a SUM of the ``loss_scale``-weighted partial gradients (see
:mod:`dcp_compile.runtime.gradient_sync`).

What this module does instead, in the same order on every rank whatever its micro-batch count:

1. :func:`shard_model` applies ``fully_shard`` to every repeated block (each element of an
   ``nn.ModuleList``) and to the root, with ``reshard_after_forward=False``, and turns off
   FSDP's own gradient reduction (``set_requires_gradient_sync(False)``) and resharding after
   backward (``set_reshard_after_backward(False)``). Parameters, gradients and the optimizer
   state live sharded across the mesh between steps.
2. :func:`begin_step` all-gathers every FSDP module's parameters once, before the step's first
   micro-batch (ranks with no micro-batch gather too). Forward and backward then find them
   unsharded and issue no collective of FSDP's; gradients accumulate unsharded, locally.
3. :func:`sync_sharded_gradients` (what :func:`dcp_compile.sync_gradients` calls for an FSDP2
   model) flattens every parameter's unsharded gradient (zeros where a rank has none), padded
   the way FSDP shards dim 0, into one buffer per dtype and issues one SUM reduce-scatter per
   buffer, installs each rank's shard as the parameter's ``DTensor`` gradient, and reshards, so
   ``optimizer.step()`` updates the shards as with plain FSDP2.

Memory against plain FSDP2: the whole model's parameters stay unsharded from :func:`begin_step`
until the sync, and so do their gradients (the accumulation buffer), so each rank holds
``parameter_bytes + gradient_bytes`` of the full model during the step, where plain FSDP2
(``reshard_after_forward=True``) holds about one block unsharded plus ``1/world`` of the
gradients. Between steps only the shards remain, and the optimizer state is always sharded.
This is ZeRO-1/2-like peak memory with ZeRO-3 storage between steps. The planner's memory model
(:func:`dcp_compile.schedule.analytic.memory_coefficients`) already charges every rank the full
``parameter_bytes + gradient_bytes`` and the optimizer state divided by ``optimizer_shards``, so
with ``CostModel(..., optimizer_shards=world_size)`` its predictions describe this mode as they
are; no extra term is needed.
"""

from __future__ import annotations

import logging
import weakref
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

log = logging.getLogger(__name__)

_STEP_OPEN = "_dcp_fsdp_step_open"


@dataclass
class _ShardedGradient:
    """One FSDP parameter's place in a reduce-scatter buffer."""

    fsdp_param: object  # torch.distributed.fsdp._fully_shard._fsdp_param.FSDPParam
    padded_numel: int


def shard_model(model: nn.Module, mesh=None, blocks: list[nn.Module] | None = None, **fully_shard_kwargs) -> nn.Module:
    """Shard ``model`` with FSDP2 for data-centric steps (see the module docstring); returns it.

    ``blocks`` are the modules to shard one by one (default: every element of every outermost
    ``nn.ModuleList``, i.e. a transformer's layers, not lists inside them); the root gets the
    remaining parameters.
    ``mesh`` is a 1-D ``DeviceMesh`` over the ranks to shard over (default: the world).
    Extra keyword arguments (e.g. ``mp_policy``) go to ``fully_shard``; ``reshard_after_forward``
    is always ``False``. Compile the sharded model afterwards, as usual.
    """
    from torch.distributed.fsdp import fully_shard

    if "reshard_after_forward" in fully_shard_kwargs:
        raise ValueError("dcp.shard_model keeps parameters unsharded through the step; "
                         "reshard_after_forward cannot be set")
    if blocks is None:
        blocks = _outermost_list_elements(model)
    for block in blocks:
        fully_shard(block, mesh=mesh, reshard_after_forward=False, **fully_shard_kwargs)
    fully_shard(model, mesh=mesh, reshard_after_forward=False, **fully_shard_kwargs)
    model.set_requires_gradient_sync(False, recurse=True)
    model.set_reshard_after_backward(False, recurse=True)
    setattr(model, _STEP_OPEN, False)
    return model


def _outermost_list_elements(model: nn.Module) -> list[nn.Module]:
    """Every element of every ``nn.ModuleList`` that is not inside another such element.

    A block often holds lists of its own (diffusers' attention keeps ``to_out`` as a
    ``ModuleList``); sharding those after their block would meet parameters that are already
    ``DTensor`` s, which ``fully_shard`` takes for tensor parallelism and refuses.
    """
    blocks: list[nn.Module] = []

    def visit(module: nn.Module) -> None:
        for child in module.children():
            if isinstance(child, nn.ModuleList):
                blocks.extend(child)
            else:
                visit(child)

    visit(model)
    return blocks


def _root(model: nn.Module) -> nn.Module:
    """Where the step flag lives: the outermost FSDP module (the same for a compiled wrapper)."""
    return fsdp_modules(model)[0]


def fsdp_modules(model: nn.Module) -> list[nn.Module]:
    """The FSDP2 modules under ``model`` (itself included), in ``modules()`` order."""
    from torch.distributed.fsdp import FSDPModule

    return [module for module in model.modules() if isinstance(module, FSDPModule)]


def is_fsdp_model(model: object) -> bool:
    return isinstance(model, nn.Module) and bool(fsdp_modules(model))


def begin_step(model: nn.Module) -> None:
    """All-gather every FSDP module's parameters once, before the step's first micro-batch.

    Every rank calls it every step, including ranks with no micro-batch, so the all-gathers pair
    up. The parameters stay unsharded until :func:`dcp_compile.sync_gradients` reshards them.
    """
    modules = fsdp_modules(model)
    if not modules:
        raise ValueError("dcp.begin_step expects a model sharded with dcp.shard_model (fully_shard)")
    handles = [module.unshard(async_op=True) for module in modules]
    for handle in handles:
        if handle is not None:
            handle.wait()
    _watch_unsharded_parameters(modules)
    setattr(_root(model), _STEP_OPEN, True)


def _watch_unsharded_parameters(modules: list[nn.Module]) -> None:
    """Divide, per micro-batch, the gradients that eager code gives the unsharded parameters.

    Dynamo breaks the graph at every FSDP module's hooks, so the root's own code (embedding,
    final norm, head, loss of a transformer) runs eagerly on the full sequence on every rank
    of an SP group, and those parameters get the full gradient on each of them. The hook of
    :mod:`dcp_compile.runtime.graph_parameters` divides such a contribution by the SP size of
    the micro-batch it comes from and leaves parameters that a compiled graph took alone.
    Installed on FSDP's unsharded parameters (the objects forward uses; the registered DTensors
    never see a gradient from autograd), once: FSDP reuses them from step to step.
    """
    from dcp_compile.runtime import graph_parameters

    for module in modules:
        for param_group in module._get_fsdp_state()._fsdp_param_groups:
            for fsdp_param in param_group.fsdp_params:
                parameter = fsdp_param.unsharded_param
                if parameter.requires_grad and not graph_parameters._member(graph_parameters._watched, parameter):
                    parameter.register_hook(graph_parameters._hook(parameter))
                    graph_parameters._watched[id(parameter)] = weakref.ref(parameter)


def sync_sharded_gradients(model: nn.Module, check_ranks: bool = True) -> None:
    """One SUM reduce-scatter per dtype of the step's unsharded gradients, then reshard.

    Gradients are SUMmed, not averaged: each micro-batch's loss was scaled by its share of the
    step's tokens, so the sum is the gradient of the step's mean token loss. The sharded
    gradient is added to any gradient the parameter already has (accumulation across syncs
    behaves as with plain parameters).
    """
    modules = fsdp_modules(model)
    if not getattr(_root(model), _STEP_OPEN, False):
        raise RuntimeError(
            "dcp.sync_gradients on an FSDP2 model needs dcp.begin_step(model) before the step's first "
            "micro-batch on every rank (it gathers the parameters once, so ranks running different numbers "
            "of micro-batches issue the same collectives); was the model sharded with dcp.shard_model?"
        )
    entries = _entries(modules)
    group = _common_group(entries)
    world = dist.get_world_size(group)
    if check_ranks:
        from dcp_compile.runtime.consistency import check_world_agrees, next_sync_number

        check_world_agrees(
            "sync_gradients", [next_sync_number(), len(entries), sum(e.padded_numel for e in entries)],
            ["sync_gradients call", "sharded parameters", "padded shard elements"], group,
        )
    by_dtype: dict[tuple[torch.device, torch.dtype], list[_ShardedGradient]] = {}
    for entry in entries:
        unsharded = entry.fsdp_param.unsharded_param
        by_dtype.setdefault((unsharded.device, _gradient_dtype(entry.fsdp_param)), []).append(entry)
    pending = []
    for (device, dtype), members in by_dtype.items():
        rows = [_padded_rows(entry, world, dtype) for entry in members]  # each [world, padded_numel]
        send = torch.cat(rows, dim=1).reshape(-1)
        receive = send.new_empty(send.numel() // world)
        reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        work = reduce_scatter(receive, send, op=dist.ReduceOp.SUM, group=group, async_op=True)
        pending.append((work, receive, members))
    for work, receive, members in pending:
        work.wait()
        offset = 0
        for entry in members:
            shard = receive[offset: offset + entry.padded_numel]
            offset += entry.padded_numel
            _install_gradient(entry.fsdp_param, shard)
    for module in modules:
        module.reshard()
    setattr(_root(model), _STEP_OPEN, False)
    log.debug("reduce-scattered %d sharded gradients in %d buffers", len(entries), len(pending))


def _entries(modules: list[nn.Module]) -> list[_ShardedGradient]:
    entries = []
    for module in modules:
        state = module._get_fsdp_state()
        for param_group in state._fsdp_param_groups:
            for fsdp_param in param_group.fsdp_params:
                if not fsdp_param.sharded_param.requires_grad:
                    continue
                if fsdp_param.fsdp_placement.dim != 0:
                    raise NotImplementedError("dcp FSDP2 support shards parameters on dim 0 only")
                entries.append(_ShardedGradient(fsdp_param, fsdp_param.padded_sharded_param_size.numel()))
    return entries


def _common_group(entries: list[_ShardedGradient]) -> dist.ProcessGroup:
    groups = {id(e.fsdp_param.mesh_info.shard_process_group): e.fsdp_param.mesh_info.shard_process_group
              for e in entries}
    if len(groups) != 1:
        raise NotImplementedError("dcp FSDP2 support expects every module sharded over the same 1-D mesh")
    return next(iter(groups.values()))


def _gradient_dtype(fsdp_param) -> torch.dtype:
    return fsdp_param.reduce_dtype or fsdp_param.unsharded_param.dtype


def _padded_rows(entry: _ShardedGradient, world: int, dtype: torch.dtype) -> torch.Tensor:
    """The full gradient padded on dim 0 to ``world`` equal chunks, as ``[world, padded_numel]``."""
    fsdp_param = entry.fsdp_param
    unsharded = fsdp_param.unsharded_param
    gradient = fsdp_param.unsharded_accumulated_grad
    if gradient is None:
        gradient = unsharded.grad
    chunk_rows = fsdp_param.padded_sharded_param_size[0]
    padded = torch.zeros((world * chunk_rows, *unsharded.shape[1:]), dtype=dtype, device=unsharded.device)
    if gradient is not None:
        padded[: unsharded.shape[0]].copy_(gradient)
    fsdp_param.unsharded_accumulated_grad = None
    unsharded.grad = None
    return padded.reshape(world, entry.padded_numel)


def _install_gradient(fsdp_param, padded_shard: torch.Tensor) -> None:
    shard = padded_shard.view(fsdp_param.padded_sharded_param_size)
    shard = shard.narrow(0, 0, fsdp_param.sharded_size[0]).to(fsdp_param.sharded_param.dtype)
    gradient = fsdp_param.to_sharded_dtensor(shard.contiguous())
    parameter = fsdp_param.sharded_param
    if parameter.grad is None:
        parameter.grad = gradient
    else:
        parameter.grad += gradient
