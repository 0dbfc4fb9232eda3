"""One SUM all-reduce of the gradients over the world, once per step.

Why a SUM and not DDP's mean: each micro-batch's loss is its mean token loss times
``loss_scale = tokens(micro-batch) / tokens(step)``, and the ranks of an SP group each hold a
*partial* gradient of their micro-batches (the compiled model guarantees those partials sum, over
the group, to the gradient of the full micro-batch). Summing every rank's accumulated gradient
therefore gives ``sum_mb tokens(mb) / tokens(step) * grad(mean loss of mb)`` = the gradient of the
mean token loss over the whole step, whatever the SP groups, the packing and the number of
micro-batches per rank were. Averaging would divide by the world size and weight ranks instead
of tokens.

Ranks run different numbers of micro-batches (or none), and a parameter may get no gradient on
some rank (an unused branch, a rank with no micro-batch): such gradients count as zeros, so every
rank flattens the same tensors in the same order and calls the same collectives.

Composing with other wrappers:

* **DDP**: wrap *every* micro-batch's forward and backward in ``model.no_sync()`` so that DDP does
  not all-reduce (and average) on its own, then call ``sync_gradients(model)`` once per step.
  Under ``no_sync`` DDP only accumulates local gradients, which is what this function expects.
* **FSDP2** (``fully_shard``): shard with ``dcp.shard_model(model)`` and call
  ``dcp.begin_step(model)`` before each step's first micro-batch; this function then issues one
  SUM reduce-scatter per step instead (:mod:`dcp_compile.runtime.fsdp`). Fully sharded during the
  step (``dcp.shard_model(model, reshard_after_forward=True)``, ZeRO-3, plans in rounds): FSDP2
  reduce-scatters after every backward, as a SUM (divide factor 1), and accumulates the shards;
  ``dcp.begin_step(model, step)`` and this function run the rank's idle rounds, so every rank
  issues the same collectives. A model sharded with plain ``fully_shard`` reduces (and averages)
  inside backward, per micro-batch; its DTensor gradients are refused below rather than silently
  mis-weighted.
"""

from __future__ import annotations

import logging
from typing import Iterable

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from dcp_compile.runtime.consistency import check_world_agrees, next_sync_number
from dcp_compile.runtime.graph_parameters import correct_parameters_outside_graphs

log = logging.getLogger(__name__)

DEFAULT_BUCKET_BYTES = 256 * 1024 * 1024


def sync_gradients(
    model_or_params: torch.nn.Module | Iterable[torch.nn.Parameter],
    group: dist.ProcessGroup | None = None,
    bucket_bytes: int | None = DEFAULT_BUCKET_BYTES,
    check_ranks: bool = True,
) -> None:
    """SUM-all-reduce the gradients of ``model_or_params`` over ``group`` (default: the world).

    Gradients are flattened into buckets of at most ``bucket_bytes`` per (device, dtype) (``None``:
    one buffer per device and dtype), all buckets are reduced asynchronously and back-to-back, then
    copied back. Parameters that require grad but have none on this rank get a zero gradient.
    Without an initialised process group (one process) the gradients are already exact and this
    does nothing. ``check_ranks`` first has the ranks agree (one all-gather of three integers, with
    a bounded wait) on how many syncs they ran and on the parameters, so a restarted rank or one
    stuck elsewhere gives an error naming ranks instead of a hang or a mis-paired all-reduce.
    """
    if isinstance(model_or_params, torch.nn.Module):
        from dcp_compile.runtime.fsdp import is_fsdp_model, sync_sharded_gradients

        if is_fsdp_model(model_or_params):  # one SUM reduce-scatter instead (dcp.shard_model)
            sync_sharded_gradients(model_or_params, check_ranks=check_ranks)
            return
    parameters = _unique_trainable(model_or_params)
    if not parameters:
        return
    if not (dist.is_available() and dist.is_initialized()):
        return
    if dist.get_world_size(group) == 1:
        return
    if check_ranks:
        check_world_agrees("sync_gradients", [next_sync_number(), len(parameters), sum(p.numel() for p in parameters)],
                           ["sync_gradients call", "trainable parameters", "parameter elements"], group)
    if isinstance(model_or_params, torch.nn.Module):
        correct_parameters_outside_graphs(model_or_params)
    gradients: list[torch.Tensor] = []
    for parameter in parameters:
        if parameter.grad is None:
            parameter.grad = torch.zeros_like(parameter, memory_format=torch.preserve_format)
        gradient = parameter.grad
        if _is_dtensor(gradient):
            raise NotImplementedError(
                "sync_gradients got a DTensor gradient (FSDP2 / fully_shard?); FSDP2 reduces gradients "
                "itself with a mean over ranks, which breaks exact token weighting. Use DDP with no_sync() "
                "around every micro-batch, or plain parameters, with dcp.sync_gradients once per step."
            )
        if gradient.is_sparse:
            raise NotImplementedError(
                "sync_gradients does not handle sparse gradients; use a dense embedding (sparse=False)"
            )
        gradients.append(gradient)
    pending = []
    for bucket in _buckets(gradients, bucket_bytes):
        flat = _flatten_dense_tensors(bucket)
        work = dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group, async_op=True)
        pending.append((work, flat, bucket))
    for work, flat, bucket in pending:
        work.wait()
        for gradient, reduced in zip(bucket, _unflatten_dense_tensors(flat, bucket)):
            gradient.copy_(reduced)
    log.debug("synchronised %d gradients in %d buckets", len(gradients), len(pending))


def _unique_trainable(model_or_params: torch.nn.Module | Iterable[torch.nn.Parameter]) -> list[torch.nn.Parameter]:
    if isinstance(model_or_params, torch.nn.Module):
        candidates = model_or_params.parameters()
    else:
        candidates = model_or_params
    seen: set[int] = set()
    unique = []
    for parameter in candidates:
        if parameter.requires_grad and id(parameter) not in seen:
            seen.add(id(parameter))
            unique.append(parameter)
    return unique


def _buckets(gradients: list[torch.Tensor], bucket_bytes: int | None) -> list[list[torch.Tensor]]:
    """Group by (device, dtype) in parameter order, splitting at ``bucket_bytes``."""
    by_kind: dict[tuple[torch.device, torch.dtype], list[list[torch.Tensor]]] = {}
    sizes: dict[tuple[torch.device, torch.dtype], int] = {}
    for gradient in gradients:
        kind = (gradient.device, gradient.dtype)
        nbytes = gradient.numel() * gradient.element_size()
        buckets = by_kind.setdefault(kind, [[]])
        if bucket_bytes is not None and buckets[-1] and sizes[kind] + nbytes > bucket_bytes:
            buckets.append([])
            sizes[kind] = 0
        buckets[-1].append(gradient)
        sizes[kind] = sizes.get(kind, 0) + nbytes
    return [bucket for buckets in by_kind.values() for bucket in buckets if bucket]


def _is_dtensor(tensor: torch.Tensor) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - older torch
        return False
    return isinstance(tensor, DTensor)
