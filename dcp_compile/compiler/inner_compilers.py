"""Hand a transformed graph to the compiler that turns it into code, recording what it made.

All three go through AOTAutograd's view of the graph except ``eager``: the forward and backward
graphs of a variant are kept on its record (that is where the partitioner's decisions, the saved
activations and the backward all-to-alls can be read).
"""

from __future__ import annotations

import contextlib
import logging
import operator
import os
import traceback
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
import torch.fx as fx

from dcp_compile.compiler.activation_offload import is_offloaded, marking_partition, offloading_block_inputs
from dcp_compile.compiler.workarounds.dynamic_output_shapes import dynamic_output_shapes_allowed
from dcp_compile.compiler.progress import compile_stage, compiling
from dcp_compile.compiler.workarounds.invariant_divisions import invariant_divisions_opaque
from dcp_compile.compiler.workarounds.inductor_patches import (
    caches_keyed_by_the_fix, stride_sort_with_shape_env, symbolic_forward_output_strides,
)
from dcp_compile.compiler.record import VariantRecord

log = logging.getLogger(__name__)


@contextlib.contextmanager
def floats_already_specialized(fake_mode: Any) -> Iterator[None]:
    """Tell AOTAutograd's float tensorification that the graph's float symbols are specialized.

    Dynamo hands Python floats over as 0-d inputs read with ``.item()``; the capture leaves float
    symbols in the shape environment, and the variants bake their values (the dispatcher keys
    compiled variants by them). Without this, AOTAutograd would ask dynamo to restart its analysis,
    which cannot happen for a variant compiled lazily outside dynamo. The names are registered only
    for the duration of one compile, so dynamo's own float handling is left as it was.
    """
    from torch._dynamo.symbolic_convert import TensorifyState
    from torch.utils._sympy.symbol import SymT, symbol_is_type

    shape_env = getattr(fake_mode, "shape_env", None)
    names = set()
    if shape_env is not None:
        names = {str(symbol) for symbol in shape_env.backed_var_to_val if symbol_is_type(symbol, SymT.FLOAT)}
    added = {name for name in names if not TensorifyState.should_specialize(name)}
    for name in added:
        TensorifyState.specialize(name)
    try:
        yield
    finally:
        TensorifyState.force_specializations.difference_update(added)


def _tensor_bytes(value: Any) -> int:
    if not isinstance(value, torch.Tensor):
        return 0
    numel = 1
    for size in value.shape:
        if isinstance(size, torch.SymInt):
            # Unbacked sizes (mark_unbacked) have no hint: count them as 1, an estimate only.
            numel *= int(size.node.hint) if size.node.hint is not None else 1
        else:
            numel *= int(size)
    return numel * value.element_size()


def _storage_owner(node: fx.Node) -> fx.Node:
    """The node whose result owns the storage ``node`` reads: itself, or the start of its chain of views."""
    while node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload) and node.target.is_view:
        node = node.args[0]
    return node


def _is_rng_state(node: fx.Node) -> bool:
    """The generator state the partitioner saves so a recomputed seeded op draws the same numbers.

    SDPA kernels carry the ``nondeterministic_seeded`` tag (for dropout) whatever their dropout
    probability, so recomputing attention saves one state per attention: 16 bytes (seed, offset)
    on CUDA, a 5,056-byte Mersenne-Twister state on CPU. It does not grow with the sequence, so it
    is reported apart from the activations.
    """
    if node.op != "call_function" or node.target is not operator.getitem or node.args[1] != 0:
        return False
    source = node.args[0]
    return isinstance(source, fx.Node) and source.target is torch._prims.rng_prims.run_and_save_rng_state


def saved_for_backward(forward: fx.GraphModule, num_user_outputs: int | None = None) -> tuple[int, int, int]:
    """(activation bytes, RNG-state bytes, offloaded bytes) the forward graph returns beyond the
    user outputs: on the device, and moved to host memory (``recompute=offload``, ``lean``).

    What backward keeps alive is storages, each counted once: a saved view keeps its base's
    whole storage (a v sliced out of a fused q/k/v projection keeps the projection, as a regional
    variant's count sees at run time). Graph inputs and views of them (weights, transposed
    weights) are not counted, they live anyway.
    """
    output = next(n for n in forward.graph.nodes if n.op == "output")
    values = list(output.args[0])
    saved = values[num_user_outputs:] if num_user_outputs is not None else values
    activations = rng_states = offloaded = 0
    owners = dict.fromkeys(_storage_owner(node) for node in saved if isinstance(node, fx.Node))
    for node in owners:
        if node.op == "placeholder":
            continue
        if _is_rng_state(node):
            rng_states += _tensor_bytes(node.meta.get("val"))
        elif is_offloaded(node):
            offloaded += _tensor_bytes(node.meta.get("val"))
        else:
            activations += _tensor_bytes(node.meta.get("val"))
    return activations, rng_states, offloaded


def _dump(record: VariantRecord, name: str, code: str) -> None:
    directory = os.environ.get("DCP_DEBUG_DIR")
    if directory and record.debug_path:
        path = Path(directory) / record.debug_path / f"{name}.py"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(code)


def _record_forward(record: VariantRecord, gm: fx.GraphModule, num_user_outputs: int) -> None:
    from dcp_compile.compiler.passes.pipeline import readable

    record.forward_graph = readable(gm)
    (record.saved_activation_bytes, record.saved_rng_state_bytes,
     record.offloaded_activation_bytes) = saved_for_backward(gm, num_user_outputs)
    _dump(record, "forward", record.forward_graph)


def _record_backward(record: VariantRecord, gm: fx.GraphModule) -> None:
    from dcp_compile.compiler.passes.pipeline import readable

    record.backward_graph = readable(gm)
    _dump(record, "backward", record.backward_graph)


def _num_outputs(gm: fx.GraphModule) -> int:
    output = next(n for n in gm.graph.nodes if n.op == "output")
    return len(output.args[0]) if isinstance(output.args[0], (tuple, list)) else 1


def _recompute(record: VariantRecord) -> Any:
    """The variant's recompute policy (a record made without a variant: ``none``)."""
    return getattr(record.variant, "recompute", None)


def _fake_mode(example_inputs: list[Any]) -> Any:
    from torch._guards import detect_fake_mode

    return detect_fake_mode(example_inputs)


def compile_aot_eager(gm: fx.GraphModule, example_inputs: list[Any], record: VariantRecord) -> Callable:
    from functorch.compile import make_boxed_func
    from torch._functorch.aot_autograd import aot_module_simplified
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    user_outputs = _num_outputs(gm)

    def forward_compiler(forward: fx.GraphModule, inputs: list[Any]) -> Callable:
        _record_forward(record, forward, user_outputs)
        return make_boxed_func(forward.forward)

    def backward_compiler(backward: fx.GraphModule, inputs: list[Any]) -> Callable:
        _record_backward(record, backward)
        return make_boxed_func(backward.forward)

    recompute = _recompute(record)
    with (compile_stage("AOTAutograd trace and partition"), dynamic_output_shapes_allowed(_fake_mode(example_inputs)),
          offloading_block_inputs(recompute, example_inputs)):
        return aot_module_simplified(
            gm, example_inputs, fw_compiler=forward_compiler, bw_compiler=backward_compiler,
            partition_fn=marking_partition(min_cut_rematerialization_partition, recompute),
            keep_inference_input_mutations=True,
        )


# Inductor on torch <= 2.13 sorts symbolic strides without the shape environment and fails on a
# product of two size symbols (an image's ``H*W`` tokens), with or without dcp:
# https://github.com/pytorch/pytorch/issues/172204 (fix proposed in pytorch/pytorch#185871).
INDUCTOR_STRIDE_SORT_BUG = "cannot determine truth value of Relational"


def _error_chain(error: BaseException | None) -> Iterator[BaseException]:
    """``error`` and what it was raised from or during (torch wraps compile errors), each once."""
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        yield error
        error = error.__cause__ or error.__context__


def is_inductor_stride_sort_bug(error: BaseException) -> bool:
    for link in _error_chain(error):
        if isinstance(link, TypeError) and INDUCTOR_STRIDE_SORT_BUG in str(link):
            return any("stride" in frame.name or "fill_order" in frame.name or frame.name == "argsort"
                       for frame in traceback.extract_tb(link.__traceback__))
    return False


def has_recompute_tags(gm: fx.GraphModule) -> bool:
    return any(node.meta.get("recompute") is not None for node in gm.graph.nodes)


@contextlib.contextmanager
def autograd_cache_off_if_tagged(gm: fx.GraphModule) -> Iterator[None]:
    """Bypass AOTAutograd's cache for a graph whose nodes carry recompute tags.

    The partitioner reads the recompute policy from ``node.meta["recompute"]``, which AOTAutograd's
    cache key (the graph's code; torch 2.13 clears the graph module's own meta while keying) does
    not see: ``recompute=full`` at SP 2 hit the entry of ``recompute=none`` at SP 2 and ran without
    recomputation (and without the forward/backward graphs on its record). Inductor's FX graph
    cache stays on: it keys the partitioned forward and backward graphs, which the tags shape.
    """
    from torch._functorch import config as functorch_config

    if has_recompute_tags(gm):
        with functorch_config.patch(enable_autograd_cache=False):
            yield
    else:
        yield


def compile_inductor(gm: fx.GraphModule, example_inputs: list[Any], record: VariantRecord) -> Callable:
    from torch._inductor.compile_fx import compile_fx, compile_fx_inner

    user_outputs = _num_outputs(gm)
    fake_mode = _fake_mode(example_inputs)  # the backward is compiled later, outside the variant's compile

    def recording_inner(graph: fx.GraphModule, inputs: list[Any], **kwargs: Any):
        if kwargs.get("is_backward"):
            _record_backward(record, graph)
            stage = "Inductor: backward"
        else:
            _record_forward(record, graph, user_outputs)
            stage = "Inductor: forward"
        # A backward compiled at the first backward call, after the variant's compile, beats alone.
        with (compiling(f"variant {record.variant}", stage), stride_sort_with_shape_env(),  # pytorch#172204
              dynamic_output_shapes_allowed(fake_mode), invariant_divisions_opaque()):
            try:
                compiled = compile_fx_inner(graph, inputs, **kwargs)
            except Exception as error:
                if not (kwargs.get("is_backward") and is_data_dependent_guard(error)):
                    raise
                return backward_without_inductor(graph, record, error)
        if not kwargs.get("is_backward"):  # the backward, compiled once for every length, reads them
            symbolic_forward_output_strides(compiled, inputs)
        return compiled

    try:
        with (compile_stage("AOTAutograd trace and partition"), autograd_cache_off_if_tagged(gm), caches_keyed_by_the_fix(),
              dynamic_output_shapes_allowed(fake_mode), offloading_block_inputs(_recompute(record), example_inputs)):
            return compile_fx(gm, example_inputs, inner_compile=recording_inner)
    except Exception as error:
        if not is_inductor_stride_sort_bug(error):
            raise
    # Every rank compiles the same graph and meets the same bug, so they all take this branch.
    record.inner_fallback = ("aot_eager instead of inductor: Inductor failed on symbolic strides it cannot "
                             "order (a PyTorch bug, pytorch/pytorch#172204; the tokens are a product of two "
                             "size symbols); upgrade torch, or pass options={'inner': 'aot_eager'} to skip "
                             "the attempt")
    log.warning("dcp: %s variant %s runs with %s", record.debug_path or "a graph", record.variant,
                record.inner_fallback)
    return compile_aot_eager(gm, example_inputs, record)


def is_data_dependent_guard(error: BaseException) -> bool:
    """Inductor asked a question about a size that only the data decides (an unbacked symbol)."""
    from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode

    return any(isinstance(link, GuardOnDataDependentSymNode) for link in _error_chain(error))


def backward_without_inductor(graph: fx.GraphModule, record: VariantRecord, error: BaseException) -> Callable:
    """Run a backward graph that Inductor could not lower as the ATen graph it is (``aot_eager``'s
    backward), keeping the Inductor forward.

    Inductor (torch <= 2.13) lowers a slice only when it can prove the bounds, and a bound that
    mixes an unbacked size (tokens selected with ``nonzero``) with a size value ranges cannot bound
    is not provable. Mochi's last rank met this until the rank's own chunk became one division
    (``sequence_chunks.chunk_length``); no zoo model meets it now. Only a data-dependent guard error
    of a backward takes this path; the record says so (``dcp.explain``) and a warning is logged."""
    from functorch.compile import make_boxed_func

    reason = str(error).strip().splitlines()[0][:200] if str(error).strip() else type(error).__name__
    record.inner_fallback = ("backward under aot_eager, forward under inductor: Inductor could not lower the "
                             f"backward on a size only the data decides ({reason}); a torch limit on unbacked "
                             "sizes (a nonzero-selected segment), see the known limitations")
    log.warning("dcp: %s variant %s runs its %s", record.debug_path or "a graph", record.variant, record.inner_fallback)
    return make_boxed_func(graph.forward)


def compile_eager(gm: fx.GraphModule, example_inputs: list[Any], record: VariantRecord) -> Callable:
    return gm


INNER_COMPILERS: dict[str, Callable[[fx.GraphModule, list[Any], VariantRecord], Callable]] = {
    "inductor": compile_inductor,
    "aot_eager": compile_aot_eager,
    "eager": compile_eager,
}
