"""Blocks' kept inputs in host memory between the forward and their backward (``offload``, ``lean``).

Under whole-block checkpointing (``recompute=block``) what a rank keeps per token is one block
input per layer; for Llama-3-8B that is 8 KB per token per layer, 256 KB per token in all, the
largest term left once the loss is tiled. ALST (arXiv 2506.13996) moves those checkpoints to host
memory. So do ``offload`` and ``lean``, through torch's own activation offloading in the min-cut
partitioner (``torch._functorch._activation_offloading``, torch >= 2.10): after partitioning, each
saved forward output marked ``should_offload`` is copied to the host after its last use in the
forward and copied back before its first use in the backward. On a GPU the copies run on a side
stream into pinned buffers and the backward prefetches them; on a CPU they are copies within the
same memory (the graphs have the same structure, so parity tests see the real mechanism).

What is marked: every floating-point tensor the recompute pass tagged (the blocks' and the head's
ops). The partitioner offloads only those it saves for backward, and not views, getitems or
non-contiguous tensors (``can_offload``): under whole-block checkpointing that is the blocks'
inputs. The marks are set on the joint graph (the partitioner copies a node's meta into the
forward graph), by a joint-graph pass: Inductor's ``joint_custom_post_pass`` under Inductor, a
wrapped partition function under ``aot_eager``. Both are scoped to the variant's compile: no
global torch setting changes.
"""

from __future__ import annotations

import contextlib
import hashlib
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
import torch.fx as fx
from torch._inductor.custom_graph_pass import CustomGraphPass

from dcp_compile.variant import RecomputePolicy, offloads_block_inputs

OFFLOADED_MARK = "cpu_offload_"  # in the name of an offloaded forward output (torch 2.13's CPU_OFFLOAD_PREFIX)


def mark_offloadable(graph: fx.Graph) -> int:
    """Mark the joint graph's tagged floating-point tensors ``should_offload``; return how many."""
    marked = 0
    for node in graph.nodes:
        value = node.meta.get("val")
        if node.op != "call_function" or node.meta.get("recompute") is None:
            continue
        if isinstance(value, torch.Tensor) and value.is_floating_point():
            node.meta["should_offload"] = True
            marked += 1
    return marked


class MarkOffloadable(CustomGraphPass):
    """:func:`mark_offloadable` as Inductor's joint-graph pass (its uuid keys Inductor's caches)."""

    def __call__(self, graph: fx.Graph) -> None:
        mark_offloadable(graph)

    def uuid(self) -> Any:
        return hashlib.sha256(Path(__file__).read_bytes()).hexdigest()


def _on_gpu(example_inputs: list[Any]) -> bool:
    return any(isinstance(value, torch.Tensor) and value.device.type == "cuda" for value in example_inputs)


@contextlib.contextmanager
def offloading_block_inputs(recompute: RecomputePolicy | str, example_inputs: list[Any]) -> Iterator[None]:
    """Within it, a compile under ``recompute`` offloads the saved block inputs (where the policy
    says so; otherwise nothing changes). On a GPU the copies are asynchronous and prefetched."""
    if not offloads_block_inputs(recompute):
        yield
        return
    from torch._functorch import config as functorch_config
    from torch._inductor import config as inductor_config

    asynchronous = _on_gpu(example_inputs)
    with (functorch_config.patch(enable_activation_offloading=True,
                                 activation_offload_separate_stream=asynchronous,
                                 activation_offload_sink_wait=asynchronous,
                                 activation_reload_prefetch=asynchronous),
          inductor_config.patch(joint_custom_post_pass=MarkOffloadable())):
        yield


def marking_partition(partition: Callable[..., Any], recompute: RecomputePolicy | str) -> Callable[..., Any]:
    """``partition`` (AOTAutograd's ``partition_fn``) with the joint graph marked first, where
    ``recompute`` offloads: the ``aot_eager`` path, which runs no Inductor joint-graph passes."""
    if not offloads_block_inputs(recompute):
        return partition

    def partition_marked(joint_module: fx.GraphModule, *args: Any, **kwargs: Any) -> Any:
        mark_offloadable(joint_module.graph)
        return partition(joint_module, *args, **kwargs)

    return partition_marked


def is_offloaded(node: fx.Node) -> bool:
    """A forward output the partitioner moved to the host (what the variant record counts apart)."""
    return OFFLOADED_MARK in node.name


__all__ = ["MarkOffloadable", "is_offloaded", "mark_offloadable", "marking_partition", "offloading_block_inputs"]
