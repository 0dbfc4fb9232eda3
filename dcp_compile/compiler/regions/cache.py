"""Compiled regions of this process, keyed by inner compiler and canonical code, each with its guards."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.fx as fx

from dcp_compile.compiler.regions.canonical_form import canonical_code, copy_graph
from dcp_compile.compiler.regions.fresh_symbols import fresh_inputs

log = logging.getLogger(__name__)


def input_signature(traced: list[Any], args: tuple) -> tuple:
    """What the key needs beyond the code: each input's kind, dtype, static sizes and grad flag."""
    signature = []
    for value, arg in zip(traced, args):
        if isinstance(arg, torch.Tensor):
            sizes = tuple(None if isinstance(s, torch.SymInt) else int(s) for s in value.shape) \
                if isinstance(value, torch.Tensor) else tuple(arg.shape)
            signature.append(("tensor", arg.dtype, str(arg.device), sizes, arg.requires_grad))
        elif isinstance(value, torch.SymInt):
            signature.append(("symint",))
        else:
            signature.append(("constant", type(arg).__name__, repr(arg)))
    return tuple(signature)


@dataclass
class GuardedCompile:
    guards: Any  # compiled expression, or None when the compile added none
    compiled: Callable
    guard_source: str = ""  # the guards as Python, for whoever asks why a region compiled again

    def accepts(self, args: tuple) -> bool:
        from torch.fx.experimental.symbolic_shapes import SYMPY_INTERP

        if self.guards is None:
            return True
        return bool(eval(self.guards, SYMPY_INTERP, {"L": {f"t{i}": arg for i, arg in enumerate(args)}}))


@dataclass
class RegionCache:
    """Compiled regions of this process, by inner compiler and canonical code."""

    entries: dict[tuple, list[GuardedCompile]] = field(default_factory=dict)
    compiles: int = 0
    reuses: int = 0

    def clear(self) -> None:
        self.entries.clear()
        self.compiles = self.reuses = 0


REGION_CACHE = RegionCache()


def constants_signature(region: fx.GraphModule) -> tuple:
    """Which objects the region's ``get_attr`` nodes read (a lifted constant: a mask, a table).

    The code names them by attribute (``_tensor_constant0``), and a compile bakes them in, so two
    regions with the same code but other constants must not share one: they are keyed by identity
    (two equal constants that are different objects compile twice, which is only slower)."""
    return tuple((str(node.target), id(_attribute(region, str(node.target))))
                 for node in region.graph.find_nodes(op="get_attr"))


def _attribute(module: torch.nn.Module, qualified_name: str) -> Any:
    for part in qualified_name.split("."):
        module = getattr(module, part)
    return module


def traced_inputs(region: fx.GraphModule) -> list[Any]:
    """The region's placeholders' values in the variant's trace (what is symbolic there)."""
    return [node.meta.get("val") for node in region.graph.find_nodes(op="placeholder")]


def compile_region(region: fx.GraphModule, args: tuple, inner: str, uncompiled: list[str] | None = None) -> GuardedCompile:
    """``region`` compiled by ``inner`` for shapes like ``args`` (real values), from the cache if its
    code was compiled before and its guards hold for ``args``. A backward whose compile fails later
    runs as ATen ops, its reason appended to ``uncompiled`` (the record of the variant that compiled)."""
    traced = traced_inputs(region)
    key = (inner, canonical_code(region), input_signature(traced, args), constants_signature(region))
    candidates = REGION_CACHE.entries.setdefault(key, [])
    for candidate in candidates:
        if candidate.accepts(args):
            REGION_CACHE.reuses += 1
            return candidate
    fresh = fresh_inputs(traced, args)
    lifted = lifted_sizes(fresh.values)
    sizes = [fresh.values[index].shape[dim] for index, dim in lifted]
    module = with_size_inputs(copy_module(region), sizes)
    values = [*fresh.values, *sizes]
    if any("unbacked_bindings" in node.meta for node in region.graph.nodes):
        module = traced_in(module, values, fresh.fake_mode)
    compiled = INNER_REGION_COMPILERS[inner](module, values, uncompiled if uncompiled is not None else [])
    if lifted:
        compiled = _passing_sizes(compiled, lifted)
    guard_code = fresh.fake_mode.shape_env.produce_guards_expression(fresh.values, ignore_static=False)
    guards = compile(guard_code, "<dcp region guards>", "eval") if guard_code else None
    entry = GuardedCompile(guards, compiled, guard_code or "")
    candidates.append(entry)
    REGION_CACHE.compiles += 1
    return entry


def first_line(error: BaseException) -> str:
    """``Type: first line of the message`` (200 characters at most), for a record's reason."""
    message = str(error).strip()
    return f"{type(error).__name__}: {message.splitlines()[0][:200] if message else ''}"


def lifted_sizes(values: list[Any]) -> tuple[tuple[int, int], ...]:
    """``(input, dim)`` of each size symbol that no integer input carries, first place it appears.

    Dynamo hands a backend every symbol as an input of its own; a region's inputs are only its
    tensors and ints, so a symbol that its backward meets only inside a product (a saved
    ``[s0*s1, 16]``: Inductor cannot solve ``s1`` from it) had no input to bind it, and Inductor's
    backward raised ``expected [s1] to have been codegen-ed``. Lifting them as inputs, as dynamo does,
    lets the partitioner hand them to the backward."""
    bound = {value.node.expr for value in values if isinstance(value, torch.SymInt)}
    lifted = []
    for index, value in enumerate(values):
        if not isinstance(value, torch.Tensor):
            continue
        for dim, size in enumerate(value.shape):
            if isinstance(size, torch.SymInt) and size.node.expr.is_Symbol and size.node.expr not in bound:
                bound.add(size.node.expr)
                lifted.append((index, dim))
    return tuple(lifted)


def with_size_inputs(module: fx.GraphModule, sizes: list[Any]) -> fx.GraphModule:
    """``module`` with an integer placeholder per lifted size after its own (unused by its nodes)."""
    if not sizes:
        return module
    graph = module.graph
    last = list(graph.find_nodes(op="placeholder"))[-1]
    for position, size in enumerate(sizes):
        with graph.inserting_after(last):
            last = graph.placeholder(f"dcp_lifted_size_{position}")
            last.meta["val"] = size
    module.recompile()
    return module


def traced_in(module: fx.GraphModule, values: list[Any], fake_mode: Any) -> fx.GraphModule:
    """``module`` traced again on the fresh inputs, so that each data-dependent op (``nonzero``)
    says which of the fresh environment's symbols it binds (``unbacked_bindings``).

    AOTAutograd runs a graph twice (metadata, then the joint trace), each run making its own
    symbol for a ``nonzero``'s size, and renames the second to the first by those bindings. Without
    them the backward's tangent was ``[s0 + u0, ...]`` beside saved tensors of ``s0 + u1``, and
    Inductor raised ``expected [u0] to have been codegen-ed`` (Mochi's joint attention region)."""
    from torch.fx.experimental.proxy_tensor import make_fx

    with fake_mode:
        return make_fx(module, pre_dispatch=True, record_module_stack=False)(*values)


def _passing_sizes(compiled: Callable, lifted: tuple[tuple[int, int], ...]) -> Callable:
    def call(*args: Any) -> Any:
        return compiled(*args, *(args[index].shape[dim] for index, dim in lifted))
    return call


def copy_module(region: fx.GraphModule) -> fx.GraphModule:
    """A copy to compile: the compile passes edit the graph, and the cached code must stay the key."""
    graph = copy_graph(region)
    for node in graph.nodes:
        for tag in ("recompute", "ac_graph_id", "dcp_recompute_tag"):  # recomputation is applied around regions
            node.meta.pop(tag, None)
        # Symbols a data-dependent op (nonzero) made in the variant's shape environment: the region's
        # trace makes its own in the fresh one, and rebinding to the variant's would find no range.
        node.meta.pop("unbacked_bindings", None)
    return fx.GraphModule(region, graph)


def _compile_inductor(gm: fx.GraphModule, inputs: list[Any], uncompiled: list[str]) -> Callable:
    from functorch.compile import make_boxed_func
    from torch._inductor import config as inductor_config
    from torch._inductor.compile_fx import compile_fx, compile_fx_inner

    from dcp_compile.compiler.workarounds.inductor_patches import (
        caches_keyed_by_the_fix, stride_sort_with_shape_env, symbolic_forward_output_strides,
    )
    from dcp_compile.compiler.inner_compilers import INDUCTOR_STRIDE_SORT_BUG, is_inductor_stride_sort_bug

    def inner_compile(graph: fx.GraphModule, graph_inputs: list[Any], **kwargs: Any) -> Callable:
        if kwargs.get("is_backward"):
            try:
                return compile_fx_inner(graph, graph_inputs, **kwargs)
            except Exception as error:  # noqa: BLE001  compiled at the first backward: never raise there
                reason = f"a region's backward runs uncompiled: its Inductor compile failed ({first_line(error)})"
                log.warning("dcp: %s", reason)
                uncompiled.append(reason)
                return make_boxed_func(graph.forward)
        compiled = compile_fx_inner(graph, graph_inputs, **kwargs)
        symbolic_forward_output_strides(compiled, graph_inputs)  # its backward serves every length the guards admit
        return compiled

    # Layout optimisation off: it computes a convolution channels-last, and a region returns views of
    # such intermediates (it ends where an attention begins), which came back read in the traced
    # strides: HunyuanDiT's patchify region at SP 2 gave wrong tokens (2.8 off) on both gloo ranks,
    # no error (tests/test_inductor_zoo.py -k hunyuan_dit fails without it; a small region with the
    # same ops did not reproduce it). Whole variants keep it: their views stay inside the graph.
    try:
        with stride_sort_with_shape_env(), caches_keyed_by_the_fix(), inductor_config.patch(layout_optimization=False):
            # A copy (Inductor's passes edit the graph) that keeps traced_in's unbacked bindings.
            return compile_fx(fx.GraphModule(gm, copy_graph(gm)), inputs, inner_compile=inner_compile)
    except Exception as error:
        if not is_inductor_stride_sort_bug(error):
            raise
    # As for a whole variant (inner_compilers.compile_inductor): the same region on every rank.
    log.warning("dcp: a region runs under aot_eager: Inductor failed on symbolic strides it cannot order "
                "(%s, pytorch/pytorch#172204)", INDUCTOR_STRIDE_SORT_BUG)
    return _compile_aot_eager(gm, inputs, uncompiled)


def _compile_aot_eager(gm: fx.GraphModule, inputs: list[Any], uncompiled: list[str]) -> Callable:
    from functorch.compile import make_boxed_func
    from torch._functorch.aot_autograd import aot_module_simplified
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    def boxed(graph: fx.GraphModule, _: list[Any]) -> Callable:
        return make_boxed_func(graph.forward)

    return aot_module_simplified(gm, inputs, fw_compiler=boxed, bw_compiler=boxed,
                                 partition_fn=min_cut_rematerialization_partition,
                                 keep_inference_input_mutations=True)


# (region, fake inputs, the compiling variant's list of uncompiled parts) -> compiled callable
INNER_REGION_COMPILERS: dict[str, Callable[[fx.GraphModule, list[Any], list[str]], Callable]] = {
    "inductor": _compile_inductor,
    "aot_eager": _compile_aot_eager,
}
