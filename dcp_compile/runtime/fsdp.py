"""FSDP2 (``fully_shard``) with data-centric steps, in two modes.

Why FSDP2 cannot run as usual: ranks of different SP groups run different numbers of
micro-batches in a step (some none at all), and plain FSDP2 issues an all-gather per layer per
forward and a reduce-scatter per layer per backward, over the world. Those per-micro-batch
collectives would pair up across ranks wrongly or hang. FSDP2 also *averages* gradients over ranks,
while exact token weighting needs a SUM of the ``loss_scale``-weighted partial gradients (see
:mod:`dcp_compile.runtime.gradient_sync`).

**Gathered once per step** (``dcp.shard_model(model)``, the default), in the same order on every
rank whatever its micro-batch count:

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

Memory of this mode: the whole model's parameters stay unsharded from :func:`begin_step` until
the sync, and so do their gradients (the accumulation buffer), so each rank holds
``parameter_bytes + gradient_bytes`` of the full model during the step; between steps only the
shards remain, and the optimizer state is always sharded (ZeRO-2-like peak, ZeRO-3 storage). The
planner's memory model prices it as ``CostModel(..., optimizer_shards=world_size)`` with the
default ``state_sharding="replicated"``.

**Fully sharded, in rounds** (``dcp.shard_model(model, reshard_after_forward=True)``: ZeRO-3).
Parameters are all-gathered per block for each forward and again for each backward and freed
after each, gradients are reduce-scattered per block after each backward: a rank holds about the
root's and one or two blocks' unsharded parameters and gradients, plus ``1 / world`` of
everything. FSDP2 runs its own hooks; what makes it safe here is the plan:

1. The sampler's cost model says ``state_sharding="sharded"`` (or ``"sharded_offload"``), so every
   step's plan is cut into *rounds* (:mod:`dcp_compile.schedule.rounds`), the same count on every
   rank: in each round a rank runs exactly one micro-batch or none.
2. :func:`begin_step` takes the rank's plan (``dcp.begin_step(model, step)``). Before each of the
   rank's micro-batches, a forward pre-hook on the root runs the *idle rounds* that precede it in
   the plan, and :func:`dcp_compile.sync_gradients` runs those after the last one. An idle round
   (:func:`idle_round`, also callable by hand) drives every FSDP module through FSDP2's own
   forward and backward hooks with a stand-in for each module's ``forward`` that uses every
   parameter times zero: the same all-gathers and reduce-scatters, in the same order and of the
   same sizes as a real micro-batch's, with zero gradients. The modules are not touched (their
   hooks are called as ``nn.Module.__call__`` calls them), so Dynamo's guards on them still hold.
3. Each reduce-scatter is a SUM (``set_gradient_divide_factor(1.0)`` with
   ``set_force_sum_reduction_for_comms(True)``), every parameter takes part whether it got a
   gradient or not (``set_reduce_scatter_unused_params(True)``, so every rank's buffers have one
   size), and FSDP2 accumulates the shards across rounds: after the last round each sharded
   gradient is the step's SUM of the ``loss_scale``-weighted partial gradients, as in the other
   mode.
4. No hang: each round starts with a bounded world check (epoch, step, round, rounds in the step;
   :func:`dcp_compile.runtime.consistency.check_world_agrees`), so a rank that runs another plan,
   skips a micro-batch or runs one more raises a named error instead of pairing collectives
   wrongly (``check_rounds=False`` turns it off: one tiny all-gather and host sync per round).

``offload=True`` adds FSDP2's ``CPUOffloadPolicy`` (in either mode): the sharded parameters,
gradients and optimizer state live in host memory, and ``optimizer.step()`` runs there (priced by
``CostModel(..., state_sharding="sharded_offload")``, its step by
``CostModel.optimizer_step_seconds``).
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
_ROUNDS = "_dcp_fsdp_rounds"  # the root's _Rounds, in the fully sharded mode


@dataclass
class _Rounds:
    """The fully sharded mode's state on the root: the step's plan and how far this rank is."""

    check_rounds: bool
    plan: object | None = None  # this rank's StepPlan (dcp_compile.schedule.plan)
    next_round: int = 0  # the first round this rank has not run yet
    forwards: int = 0  # the rank's micro-batches started this step
    shadow: bool = False  # an idle round is running (the root's pre-hook lets it through)
    watched: bool = False  # the unsharded parameters have their gradient hooks


@dataclass
class _ShardedGradient:
    """One FSDP parameter's place in a reduce-scatter buffer."""

    fsdp_param: object  # torch.distributed.fsdp._fully_shard._fsdp_param.FSDPParam
    padded_numel: int


def shard_model(model: nn.Module, mesh=None, blocks: list[nn.Module] | None = None, *,
                reshard_after_forward: bool = False, offload: bool = False, check_rounds: bool = True,
                **fully_shard_kwargs) -> nn.Module:
    """Shard ``model`` with FSDP2 for data-centric steps (see the module docstring); returns it.

    ``blocks`` are the modules to shard one by one (default: every element of every outermost
    ``nn.ModuleList``, i.e. a transformer's layers, not lists inside them); the root gets the
    remaining parameters.
    ``mesh`` is a 1-D ``DeviceMesh`` over the ranks to shard over (default: the world).
    ``reshard_after_forward``: ``False`` (the default) gathers the parameters once per step and
    reduce-scatters once at the sync; ``True`` keeps them sharded during the step (ZeRO-3): plan
    with ``CostModel(..., state_sharding="sharded", optimizer_shards=world_size)``, whose plans run
    in rounds, and pass each step's plan to ``dcp.begin_step(model, step)``.
    ``offload``: FSDP2's ``CPUOffloadPolicy`` (parameters, gradients and optimizer state in host
    memory, the optimizer step on the host; ``state_sharding="sharded_offload"``).
    ``check_rounds`` (fully sharded mode): a bounded world check at the start of every round.
    Extra keyword arguments (e.g. ``mp_policy``) go to ``fully_shard``. Compile the sharded model
    afterwards, as usual.
    """
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

    if offload:
        if "offload_policy" in fully_shard_kwargs:
            raise ValueError("dcp.shard_model: give offload=True or an offload_policy, not both")
        fully_shard_kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=torch.cuda.is_available())
    if blocks is None:
        blocks = _outermost_list_elements(model)
    for block in blocks:
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard_after_forward, **fully_shard_kwargs)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard_after_forward, **fully_shard_kwargs)
    setattr(model, _STEP_OPEN, False)
    if not reshard_after_forward:
        model.set_requires_gradient_sync(False, recurse=True)
        model.set_reshard_after_backward(False, recurse=True)
        return model
    # Fully sharded: FSDP2 reduce-scatters every backward, as a SUM of every parameter's gradient.
    for module in fsdp_modules(model):
        module.set_gradient_divide_factor(1.0)
        module.set_force_sum_reduction_for_comms(True)
    model.set_reduce_scatter_unused_params(True, recurse=True)
    setattr(model, _ROUNDS, _Rounds(check_rounds=check_rounds))
    model.register_forward_pre_hook(_before_forward, prepend=True)
    model.register_forward_hook(_after_forward)
    return model


def is_fully_sharded(model: nn.Module) -> bool:
    """Was ``model`` sharded with ``dcp.shard_model(..., reshard_after_forward=True)``?"""
    return is_fsdp_model(model) and getattr(_root(model), _ROUNDS, None) is not None


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


def begin_step(model: nn.Module, step=None) -> None:
    """Start a step on every rank, before its first micro-batch (ranks with none too).

    Gathered mode: all-gather every FSDP module's parameters once; they stay unsharded until
    :func:`dcp_compile.sync_gradients` reshards them (``step`` is not needed).
    Fully sharded mode (``reshard_after_forward=True``): ``step`` is this rank's plan (the
    ``StepPlan`` the sampler yields, or a loaded step that has one as ``.plan``), cut into rounds;
    nothing is gathered here, the rounds do it.
    """
    modules = fsdp_modules(model)
    if not modules:
        raise ValueError("dcp.begin_step expects a model sharded with dcp.shard_model (fully_shard)")
    root = _root(model)
    rounds = getattr(root, _ROUNDS, None)
    if rounds is not None:
        _begin_rounds(root, rounds, step)
        setattr(root, _STEP_OPEN, True)
        return
    handles = [module.unshard(async_op=True) for module in modules]
    for handle in handles:
        if handle is not None:
            handle.wait()
    _watch_unsharded_parameters(modules)
    setattr(root, _STEP_OPEN, True)


def _begin_rounds(root: nn.Module, rounds: _Rounds, step) -> None:
    plan = getattr(step, "plan", step)
    if plan is None or not hasattr(plan, "num_rounds"):
        raise ValueError(
            "dcp.begin_step(model, step): a model sharded with reshard_after_forward=True needs this rank's "
            "step plan (the StepPlan the sampler yields, or the DataLoader step holding it), so that every rank "
            "runs the step's rounds of parameter all-gathers and gradient reduce-scatters")
    if getattr(root, _STEP_OPEN, False):
        raise RuntimeError("dcp.begin_step: the previous step is still open; call dcp.sync_gradients(model) first")
    if plan.num_rounds == 0 and plan.world_size > 1:
        raise ValueError(
            "dcp.begin_step: this step's plan has no rounds, but a model sharded with reshard_after_forward=True "
            "issues world collectives for every micro-batch, so every rank must run the same number of them. Plan "
            "with CostModel(..., state_sharding='sharded', optimizer_shards=world_size) (or 'sharded_offload'): "
            "its plans run in rounds")
    state = root._get_fsdp_state()
    for param_group in state._fsdp_param_groups:
        world = param_group.mesh_info.shard_mesh_size
        if world != plan.world_size:
            raise ValueError(f"dcp.begin_step: the model is sharded over {world} ranks but the plan is for a world "
                             f"of {plan.world_size}; shard over the world the sampler plans for")
    rounds.plan, rounds.next_round, rounds.forwards = plan, 0, 0


def _planned_rounds(plan) -> tuple:
    """This rank's rounds; a one-rank plan without rounds runs each micro-batch as its own round."""
    if plan.num_rounds:
        return plan.rounds
    return tuple(plan.microbatches)


@torch._dynamo.disable
def _before_forward(module: nn.Module, args) -> None:
    """Fully sharded mode, before each of the rank's micro-batches: run the idle rounds before it,
    then check that every rank starts this round."""
    rounds: _Rounds = getattr(module, _ROUNDS)
    if rounds.shadow:
        return
    plan = rounds.plan
    if plan is None or not getattr(module, _STEP_OPEN, False):
        raise RuntimeError("a model sharded with dcp.shard_model(..., reshard_after_forward=True) ran forward "
                           "outside a step: call dcp.begin_step(model, step) first, on every rank")
    planned = _planned_rounds(plan)
    mine = [r for r, mb in enumerate(planned) if mb is not None]
    if rounds.forwards >= len(mine):
        raise RuntimeError(
            f"rank {plan.rank}: micro-batch {rounds.forwards + 1} of a step whose plan gives this rank "
            f"{len(mine)} (in {len(planned)} rounds); under reshard_after_forward=True every rank must run exactly "
            "its plan's micro-batches, once each (one forward and one backward per micro-batch)")
    target = mine[rounds.forwards]
    while rounds.next_round < target:
        _run_idle_round(module, rounds)
    _check_round(module, rounds, idle=False)
    rounds.next_round = target + 1
    rounds.forwards += 1


@torch._dynamo.disable
def _after_forward(module: nn.Module, args, output):
    """Once: hook the unsharded parameters' gradients (they exist after the first forward)."""
    rounds: _Rounds = getattr(module, _ROUNDS)
    if not rounds.watched:
        _watch_unsharded_parameters(fsdp_modules(module))
        rounds.watched = True
    return None


def idle_round(model: nn.Module) -> None:
    """Run this rank's next round as an idle one: join its parameter all-gathers and gradient
    reduce-scatters with zero gradients (fully sharded mode). The root's forward pre-hook and
    :func:`dcp_compile.sync_gradients` do this for every idle round of the plan; call it yourself
    only in a loop over ``step.rounds`` that meets a ``None``."""
    root = _root(model)
    rounds = getattr(root, _ROUNDS, None)
    if rounds is None:
        raise ValueError("dcp.runtime.idle_round is for a model sharded with dcp.shard_model(..., reshard_after_forward=True)")
    if rounds.plan is None or not getattr(root, _STEP_OPEN, False):
        raise RuntimeError("dcp.runtime.idle_round outside a step: call dcp.begin_step(model, step) first")
    planned = _planned_rounds(rounds.plan)
    if rounds.next_round >= len(planned) or planned[rounds.next_round] is not None:
        raise RuntimeError(f"dcp.runtime.idle_round: round {rounds.next_round} of this rank's plan is not an idle one "
                           f"(the plan has {len(planned)} rounds)")
    _run_idle_round(root, rounds)


def _run_idle_round(root: nn.Module, rounds: _Rounds) -> None:
    _check_round(root, rounds, idle=True)
    rounds.shadow = True
    try:
        _shadow_micro_batch(root)
    finally:
        rounds.shadow = False
    rounds.next_round += 1


def _check_round(root: nn.Module, rounds: _Rounds, idle: bool) -> None:
    if not rounds.check_rounds or not (dist.is_available() and dist.is_initialized()):
        return
    from dcp_compile.runtime.consistency import check_world_agrees

    plan = rounds.plan
    what = f"round {rounds.next_round} of step {plan.step} ({'idle' if idle else 'a micro-batch'} on rank {plan.rank})"
    check_world_agrees(what, [plan.epoch, plan.step, rounds.next_round, len(_planned_rounds(plan))],
                       ["epoch", "step", "round", "rounds in the step"], _group(root))


def _group(root: nn.Module):
    state = root._get_fsdp_state()
    return state._fsdp_param_groups[0].mesh_info.shard_process_group if state._fsdp_param_groups else None


def _shadow_micro_batch(root: nn.Module) -> None:
    """A forward and backward through every FSDP module's own hooks, each module's ``forward``
    replaced by ``input + sum(parameter[0] * 0)``: FSDP2 all-gathers, reshards, all-gathers again
    in backward (with its prefetch) and reduce-scatters exactly as for a real micro-batch of a
    model that calls its blocks in order, here with zero gradients."""
    blocks = fsdp_modules(root)[1:]
    device = _device(root)

    def root_forward() -> torch.Tensor:
        x = torch.zeros((), device=device, requires_grad=True)
        for block in blocks:
            x = _call_with_hooks(block, lambda value, block=block: value + _zero_use(block), (x,))
        return x + _zero_use(root)

    with torch.enable_grad():
        loss = _call_with_hooks(root, root_forward, ())
        loss.backward()


def _zero_use(module: nn.Module) -> torch.Tensor:
    """Every trainable parameter FSDP manages for ``module`` (unsharded now), times zero."""
    total = None
    for param_group in module._get_fsdp_state()._fsdp_param_groups:
        for fsdp_param in param_group.fsdp_params:
            parameter = fsdp_param.unsharded_param
            if parameter.requires_grad:
                term = parameter.reshape(-1)[0].float() * 0.0
                total = term if total is None else total + term
    return total if total is not None else torch.zeros((), device=_device(module))


def _device(module: nn.Module) -> torch.device:
    state = module._get_fsdp_state()
    return state._device


def _call_with_hooks(module: nn.Module, forward, args: tuple):
    """Call ``forward(*args)`` as ``module(*args)`` would, with the module's forward pre-hooks and
    hooks (FSDP2's among them), without touching the module: Dynamo's guards on it stay valid."""
    kwargs: dict = {}
    for hook_id, hook in module._forward_pre_hooks.items():
        if hook_id in module._forward_pre_hooks_with_kwargs:
            result = hook(module, args, kwargs)
            if result is not None:
                args, kwargs = result
        else:
            result = hook(module, args)
            if result is not None:
                args = result if isinstance(result, tuple) else (result,)
    output = forward(*args, **kwargs)
    for hook_id, hook in module._forward_hooks.items():
        if hook_id in module._forward_hooks_with_kwargs:
            result = hook(module, args, kwargs, output)
        else:
            result = hook(module, args, output)
        if result is not None:
            output = result
    return output


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
                parameter = getattr(fsdp_param, "_unsharded_param", None)  # made by the first all-gather
                if parameter is None:
                    continue
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
    if getattr(_root(model), _ROUNDS, None) is not None:
        _end_rounds(model, check_ranks)
        return
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


def _end_rounds(model: nn.Module, check_ranks: bool) -> None:
    """Fully sharded mode's sync: run the rank's idle rounds after its last micro-batch; FSDP2 has
    reduce-scattered (SUM) and accumulated every round's gradients into the sharded ones."""
    root = _root(model)
    rounds: _Rounds = getattr(root, _ROUNDS)
    if not getattr(root, _STEP_OPEN, False) or rounds.plan is None:
        raise RuntimeError("dcp.sync_gradients on a model sharded with reshard_after_forward=True needs "
                           "dcp.begin_step(model, step) before the step's first micro-batch, on every rank")
    plan = rounds.plan
    planned = _planned_rounds(plan)
    mine = sum(1 for mb in planned if mb is not None)
    if rounds.forwards != mine:
        raise RuntimeError(
            f"rank {plan.rank}: dcp.sync_gradients after {rounds.forwards} of the {mine} micro-batches this rank's "
            f"plan gives it in step {plan.step}; every rank must run all of them (the other ranks wait in that "
            "round's collectives)")
    while rounds.next_round < len(planned):
        _run_idle_round(root, rounds)
    if check_ranks:
        from dcp_compile.runtime.consistency import check_world_agrees, next_sync_number

        check_world_agrees("sync_gradients", [next_sync_number(), len(planned), plan.step],
                           ["sync_gradients call", "rounds", "step"], _group(root))
    setattr(root, _STEP_OPEN, False)
    rounds.plan = None
    log.debug("step %d: %d rounds, %d of them micro-batches of this rank", plan.step, len(planned), mine)


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
    shard = shard.to(fsdp_param.sharded_param.device)  # offloaded: the shards live in host memory
    gradient = fsdp_param.to_sharded_dtensor(shard.contiguous())
    parameter = fsdp_param.sharded_param
    if parameter.grad is None:
        parameter.grad = gradient
    else:
        parameter.grad += gradient
