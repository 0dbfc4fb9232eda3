"""Regional compilation: a variant's graph cut at its attention and communication, and the token-local
pieces between them compiled once for every variant that repeats them.

A variant compiled whole is a new Inductor graph for every SP size and recompute policy, so a
further variant cost about as much as the first (``benchmarks/results/compile_time.md``). Cut at
the ops that differ between variants (the all-to-alls, attention, dcp's own ops), what remains is
token-local code (norms, projections, MLPs, residuals) that is the same graph at every SP size,
differing only in how many tokens each rank holds. Each such region is compiled with fresh size
symbols (a symbol per symbolic dimension of its inputs, not the expression ``(s0 + 1) // 2`` the
variant's chunk has), keyed by its code, and reused by every region that has the same code: the
repeated blocks of one variant, and the same blocks in every other variant. The cut ops run as the
ATen ops they are (what the inner compiler would call for them anyway: collectives, SDPA and dcp's
custom ops are extern kernels under Inductor).

Recomputation is applied around the compiled regions at run time, with
``torch.utils.checkpoint``, so that it does not make new graphs either: ``attention`` recomputes
each attention op from its saved inputs, ``full`` recomputes every region from its inputs;
communication is never recomputed (its outputs are saved, as under every whole-graph policy).
``selective`` keeps the whole-graph compile: it picks ops inside regions.

A region compiled with fresh symbols is only valid where the guards its compile added hold (a
size that must be at least 2, a stride): they are evaluated on every call, as dynamo's are, and a
region whose guards fail compiles again for the new shapes.
"""

from __future__ import annotations

import enum
import itertools
import logging
import operator
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.fx as fx
from torch.fx.passes.split_module import split_module
from torch.utils.checkpoint import checkpoint

from dcp_compile.compiler.passes.insert_all_to_all import LOWERED_SITE
from dcp_compile.compiler.passes.recompute import is_attention, is_collective
from dcp_compile.compiler.progress import compile_stage
from dcp_compile.variant import RecomputePolicy

log = logging.getLogger(__name__)

# Recompute policies that regions apply at run time; ``selective`` compiles the variant whole.
REGIONAL_POLICIES = (RecomputePolicy.NONE, RecomputePolicy.ATTENTION, RecomputePolicy.FULL)


class RegionKind(enum.Enum):
    COMPILED = "compiled"  # token-local: compiled once per distinct code, shared across variants
    ATTENTION = "attention"  # one attention op: runs as it is; recomputed under attention and full
    EXCHANGE = "exchange"  # a collective or one of dcp's own ops: runs as it is; never recomputed


def kind_of(node: fx.Node) -> RegionKind:
    """Attention ops; what differs between SP sizes (a site's Ulysses or ring lowering, collectives,
    dcp's own ops, higher-order ops with subgraphs of their own); and the token-local rest."""
    if is_attention(node):
        return RegionKind.ATTENTION
    target = node.target
    if (node.meta.get(LOWERED_SITE) is not None or is_collective(node) or str(target).startswith("dcp.")
            or isinstance(target, torch._ops.HigherOrderOperator)):
        return RegionKind.EXCHANGE
    return RegionKind.COMPILED


@dataclass
class RegionPlan:
    """The variant's graph as a parent graph that calls one submodule per region, in order."""

    parent: fx.GraphModule
    kinds: dict[str, RegionKind]  # submodule name -> kind


def split_into_regions(gm: fx.GraphModule) -> RegionPlan:
    """Cut ``gm`` before and after every op that is not token-local (see ``kind_of``): each attention
    op a region of its own, consecutive exchange ops one region, consecutive token-local ops one.

    Region numbers only grow along the graph's order, so every region reads only regions before
    it, and the parent calls them in that order. A multi-output op's ``getitem`` nodes stay with it.
    """
    partition: dict[fx.Node, int] = {}
    kinds: dict[int, RegionKind] = {}
    numbers = itertools.count()
    open_region: int | None = None
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "output", "get_attr"):
            continue
        if node.target is operator.getitem and isinstance(node.args[0], fx.Node) and node.args[0] in partition \
                and kinds[partition[node.args[0]]] is not RegionKind.COMPILED:
            partition[node] = partition[node.args[0]]
            continue
        kind = kind_of(node)
        if kind is RegionKind.ATTENTION or open_region is None or kinds[open_region] is not kind:
            open_region = next(numbers)
            kinds[open_region] = kind
        partition[node] = open_region
        if kind is RegionKind.ATTENTION:
            open_region = None
    parent = split_module(gm, gm, lambda node: partition[node], keep_original_order=True, tuple_return=True)
    return RegionPlan(parent, {f"submod_{number}": kind for number, kind in kinds.items()
                               if hasattr(parent, f"submod_{number}")})


# --- compiling a region with fresh size symbols ---------------------------------------------------

def _hint(value: Any) -> int:
    if isinstance(value, torch.SymInt):
        hint = value.node.hint
        if hint is None:
            raise UnsupportedRegion("an input size only the data decides (an unbacked symbol)")
        return int(hint)
    return int(value)


class UnsupportedRegion(Exception):
    """A region that cannot be compiled with fresh symbols; the variant compiles whole instead."""


@dataclass
class FreshInputs:
    fake_mode: Any
    values: list[Any]


def fresh_inputs(traced: list[Any], args: tuple) -> FreshInputs:
    """Fake inputs of a new shape environment for a region called with ``args``: each distinct size
    expression of the variant's trace (``traced``, the placeholders' values: ``s0``, the chunk
    ``(s1 + 1) // 2``) becomes a symbol of its own, hinted by ``args``; static sizes stay numbers.

    Sizes that are one expression in the trace are one symbol here, so the region keeps exactly
    the relations the variant's trace had between its inputs' sizes, and no others: a region of
    SP 2 (chunk ``(s1 + 1) // 2``) and of SP 1 (``s1``) then trace to the same graph."""
    import sympy
    from torch._dynamo.source import LocalSource
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv

    shape_env = ShapeEnv()
    fake_mode = FakeTensorMode(shape_env=shape_env)
    symbols: dict[sympy.Expr, sympy.Symbol] = {}

    def symbol_for(expression: sympy.Expr, hint: int, source: Any, positive: bool | None = True) -> sympy.Symbol:
        if expression not in symbols:
            symbols[expression] = shape_env.create_symbol(hint, source, dynamic_dim=DimDynamic.DYNAMIC,
                                                          do_not_specialize_zero_one=True, positive=positive)
        return symbols[expression]

    def expression_of(size: Any) -> sympy.Expr | None:
        if isinstance(size, torch.SymInt):
            if size.node.hint is None:
                raise UnsupportedRegion("an input size only the data decides (an unbacked symbol)")
            return size.node.expr
        return None

    # Sizes first, everywhere, so that a stride can be written in the symbols of any input's sizes.
    for index, (value, arg) in enumerate(zip(traced, args)):
        source = LocalSource(f"t{index}")
        if isinstance(arg, torch.Tensor) and isinstance(value, torch.Tensor):
            for dim, size in enumerate(value.shape):
                expression = expression_of(size)
                if expression is not None:
                    symbol_for(expression, int(arg.shape[dim]), _size_source(source, dim))
        elif isinstance(arg, int) and isinstance(value, torch.SymInt):
            symbol_for(expression_of(value), arg, source, positive=None)  # an int may be negative (a slice end)
    fresh: list[Any] = []
    for index, (value, arg) in enumerate(zip(traced, args)):
        if isinstance(arg, torch.Tensor):
            if not isinstance(value, torch.Tensor):
                raise UnsupportedRegion("a tensor input without its traced value")
            sizes = [_in_fresh(shape_env, symbols, size, int(actual)) for size, actual in zip(value.shape, arg.shape)]
            strides, offset = _fresh_layout(shape_env, symbols, value, arg, sizes, LocalSource(f"t{index}"))
            with fake_mode:
                if isinstance(offset, int) and offset == 0:
                    fake = torch.empty_strided(sizes, strides, dtype=arg.dtype, device=arg.device)
                else:  # a view into a larger buffer (a narrowed chunk): keep its offset, or its guard fails
                    extent = offset + 1 + sum((size - 1) * stride for size, stride in zip(sizes, strides))
                    fake = torch.empty(extent, dtype=arg.dtype, device=arg.device).as_strided(sizes, strides, offset)
            fresh.append(fake.requires_grad_(True) if arg.requires_grad else fake)
        elif isinstance(arg, int) and isinstance(value, torch.SymInt):
            fresh.append(_in_fresh(shape_env, symbols, value, arg))
        elif isinstance(value, (torch.SymFloat, torch.SymBool)):
            raise UnsupportedRegion(f"a symbolic {type(value).__name__} input")
        else:
            fresh.append(arg)
    return FreshInputs(fake_mode, fresh)


def _fresh_layout(shape_env: Any, symbols: dict, value: torch.Tensor, arg: torch.Tensor, sizes: list,
                  source: Any) -> tuple[list, Any]:
    """The strides and storage offset ``arg`` has at run time, in the fresh symbols: the traced
    expressions where they give ``arg``'s values (a kernel may lay its output out otherwise than its
    fake did: then ``arg``'s dense order), and a symbol of their own where no size writes them."""
    from torch._dynamo.source import TensorProperty, TensorPropertySource

    def fresh(traced: Any, actual: int, where: Any) -> Any:
        try:
            return _in_fresh(shape_env, symbols, traced, actual)
        except UnsupportedRegion:
            symbol = shape_env.create_symbol(actual, where, do_not_specialize_zero_one=True)
            symbols[traced.node.expr] = symbol
            return shape_env.create_symintnode(symbol, hint=actual)

    def hint(size: Any) -> int:
        return int(size.node.hint) if isinstance(size, torch.SymInt) else int(size)

    if [hint(stride) for stride in value.stride()] == list(arg.stride()):
        strides = [fresh(stride, actual, TensorPropertySource(source, TensorProperty.STRIDE, dim))
                   for dim, (stride, actual) in enumerate(zip(value.stride(), arg.stride()))]
    else:
        order = sorted(range(arg.dim()), key=lambda dim: (arg.stride(dim), arg.shape[dim]))  # innermost first
        strides = [0] * arg.dim()
        running: Any = 1
        for dim in order:
            strides[dim] = running
            running = running * sizes[dim]
        if [hint(stride) for stride in strides] != list(arg.stride()):
            raise UnsupportedRegion(f"an input with strides {tuple(arg.stride())} that are not dense")
    actual_offset = arg.storage_offset()
    traced_offset = value.storage_offset()
    offset_source = TensorPropertySource(source, TensorProperty.STORAGE_OFFSET)
    if hint(traced_offset) == actual_offset:
        offset = fresh(traced_offset, actual_offset, offset_source)
    elif actual_offset == 0:
        offset = 0
    else:
        symbol = shape_env.create_symbol(actual_offset, offset_source, do_not_specialize_zero_one=True)
        offset = shape_env.create_symintnode(symbol, hint=actual_offset)
    return strides, offset


def _size_source(source: Any, dim: int) -> Any:
    from torch._dynamo.source import TensorProperty, TensorPropertySource

    return TensorPropertySource(source, TensorProperty.SIZE, dim)


def _in_fresh(shape_env: Any, symbols: dict, size: Any, actual: int) -> Any:
    """A traced size or stride written in the fresh symbols (a number where it is static)."""
    if not isinstance(size, torch.SymInt):
        return int(size)
    expression = size.node.expr
    if expression in symbols:
        return shape_env.create_symintnode(symbols[expression], hint=actual)
    rewritten = expression.xreplace(symbols)
    if rewritten.free_symbols - set(symbols.values()):
        raise UnsupportedRegion(f"a stride or size {expression} not written in the inputs' sizes")
    return shape_env.create_symintnode(rewritten, hint=actual)


def canonical_code(region: fx.GraphModule) -> str:
    """The region's code with its nodes named by position: equal for equal code wherever it sits."""
    graph = copy_graph(region)
    for number, node in enumerate(graph.nodes):
        node.name = f"v{number}"  # placeholders included: their names are the caller's node names
        if node.op == "placeholder":
            node.target = node.name
    return graph.python_code("self").src


def copy_graph(region: fx.GraphModule) -> fx.Graph:
    graph = fx.Graph()
    environment: dict[fx.Node, fx.Node] = {}
    for node in region.graph.nodes:
        environment[node] = graph.node_copy(node, lambda n: environment[n])
    return graph


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


def traced_inputs(region: fx.GraphModule) -> list[Any]:
    """The region's placeholders' values in the variant's trace (what is symbolic there)."""
    return [node.meta.get("val") for node in region.graph.find_nodes(op="placeholder")]


def compile_region(region: fx.GraphModule, args: tuple, inner: str) -> GuardedCompile:
    """``region`` compiled by ``inner`` for shapes like ``args`` (real values), from the cache if its
    code was compiled before and its guards hold for ``args``."""
    traced = traced_inputs(region)
    key = (inner, canonical_code(region), input_signature(traced, args))
    candidates = REGION_CACHE.entries.setdefault(key, [])
    for candidate in candidates:
        if candidate.accepts(args):
            REGION_CACHE.reuses += 1
            return candidate
    fresh = fresh_inputs(traced, args)
    compiled = INNER_REGION_COMPILERS[inner](copy_module(region), fresh.values)
    guard_code = fresh.fake_mode.shape_env.produce_guards_expression(fresh.values, ignore_static=False)
    guards = compile(guard_code, "<dcp region guards>", "eval") if guard_code else None
    entry = GuardedCompile(guards, compiled, guard_code or "")
    candidates.append(entry)
    REGION_CACHE.compiles += 1
    return entry


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


def _compile_inductor(gm: fx.GraphModule, inputs: list[Any]) -> Callable:
    from torch._inductor.compile_fx import compile_fx

    from dcp_compile.compiler.inductor_patches import caches_keyed_by_the_fix, stride_sort_with_shape_env
    from dcp_compile.compiler.inner_compilers import INDUCTOR_STRIDE_SORT_BUG, _is_inductor_stride_sort_bug

    try:
        with stride_sort_with_shape_env(), caches_keyed_by_the_fix():
            return compile_fx(copy_module(gm), inputs)
    except Exception as error:
        if not _is_inductor_stride_sort_bug(error):
            raise
    # As for a whole variant (inner_compilers.compile_inductor): the same region on every rank.
    log.warning("dcp: a region runs under aot_eager: Inductor failed on symbolic strides it cannot order "
                "(%s, pytorch/pytorch#172204)", INDUCTOR_STRIDE_SORT_BUG)
    return _compile_aot_eager(gm, inputs)


def _compile_aot_eager(gm: fx.GraphModule, inputs: list[Any]) -> Callable:
    from functorch.compile import make_boxed_func
    from torch._functorch.aot_autograd import aot_module_simplified
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    def boxed(graph: fx.GraphModule, _: list[Any]) -> Callable:
        return make_boxed_func(graph.forward)

    return aot_module_simplified(gm, inputs, fw_compiler=boxed, bw_compiler=boxed,
                                 partition_fn=min_cut_rematerialization_partition,
                                 keep_inference_input_mutations=True)


INNER_REGION_COMPILERS: dict[str, Callable[[fx.GraphModule, list[Any]], Callable]] = {
    "inductor": _compile_inductor,
    "aot_eager": _compile_aot_eager,
}


# --- running regions --------------------------------------------------------------------------------

MAX_COMPILES_PER_REGION = 8  # as dynamo's recompile limit: past it, a region runs uncompiled


class Region(torch.nn.Module):
    """One region of a variant, called by the parent graph; compiled at its first call."""

    def __init__(self, graph: fx.GraphModule, kind: RegionKind, inner: str, recomputed: bool,
                 uncompiled: list[str] | None = None):
        super().__init__()
        self.graph_module = graph
        self.kind = kind
        self.inner = inner
        self.recomputed = recomputed
        self.compiled: list[GuardedCompile] = []
        self.uncompiled = uncompiled if uncompiled is not None else []  # the variant record's list

    def run(self, *args: Any) -> Any:
        if self.kind is not RegionKind.COMPILED:
            return self.graph_module(*args)
        for entry in self.compiled:
            if entry.accepts(args):
                return entry.compiled(*args)
        if len(self.compiled) >= MAX_COMPILES_PER_REGION:
            reason = (f"its guards failed on {MAX_COMPILES_PER_REGION} compiles (a size or stride that changes "
                      "from call to call in a way the compiles could not make symbolic)")
            log.warning("dcp: a region runs uncompiled from now on: %s", reason)
            self.uncompiled.append(reason)
            self.compiled.insert(0, GuardedCompile(None, self.graph_module))
            return self.graph_module(*args)
        try:
            with compile_stage(f"region ({self.inner})"):
                entry = compile_region(self.graph_module, args, self.inner)
        except UnsupportedRegion as reason:
            log.warning("dcp: a region runs uncompiled (%s); the rest of the variant is compiled", reason)
            self.uncompiled.append(str(reason))
            entry = GuardedCompile(None, self.graph_module)
        self.compiled.append(entry)
        return entry.compiled(*args)

    def forward(self, *args: Any) -> Any:
        if self.recomputed and torch.is_grad_enabled() and any(
                isinstance(a, torch.Tensor) and a.requires_grad for a in args):
            return checkpoint(self.run, *args, use_reentrant=False)
        return self.run(*args)


VIEWS = (torch.ops.aten.view.default, torch.ops.aten.reshape.default, torch.ops.aten._unsafe_view.default)


def canonical_views(region: fx.GraphModule) -> bool:
    """Spell every view's sizes one way: static sizes as numbers, the last symbolic size as -1.

    The same code is written two ways by the traces a variant comes from: dynamo's trace of the
    model at SP 1 writes ``view(x, [b, s, -1, 8])`` (the heads inferred), dcp's sharded trace at
    SP 2 ``view(x, [b, -1, 4, 8])`` (the rank's chunk inferred). One spelling makes the regions
    of every SP size one code, compiled once. Returns whether a view was rewritten (only where
    the traced output shows the sizes; a view whose other symbolic sizes are inferred stays)."""
    changed = False
    for node in list(region.graph.nodes):
        if node.op != "call_function":
            continue
        if node.target is torch.ops.aten.slice.Tensor and _keeps_everything(node):
            node.replace_all_uses_with(node.args[0])
            region.graph.erase_node(node)
            changed = True
            continue
        if node.target is torch.ops.aten.expand.default:
            changed |= _canonical_expand(node)
            continue
        if node.target not in VIEWS or not isinstance(node.args[1], (list, tuple)):
            continue
        output = node.meta.get("val")
        sizes = list(node.args[1])
        if not isinstance(output, torch.Tensor) or len(sizes) != output.dim():
            continue
        symbolic = [index for index, size in enumerate(output.shape) if isinstance(size, torch.SymInt)]
        if any(not isinstance(sizes[index], fx.Node) for index in symbolic[:-1]):
            continue  # an earlier symbolic size is inferred: no node spells it here
        canonical = [sizes[index] if index in symbolic else int(size) for index, size in enumerate(output.shape)]
        if symbolic:
            canonical[symbolic[-1]] = -1
        if canonical != sizes:
            node.args = (node.args[0], canonical, *node.args[2:])
            changed = True
    return changed


FULL_SLICE_END = 2**63 - 1  # what a trace writes for ``x[:, a:]``


def _keeps_everything(node: fx.Node) -> bool:
    """``slice(x, dim, 0, end)`` with step 1 and an end past any size: ``x`` itself."""
    args = list(node.args) + [None] * (5 - len(node.args))
    _, _, start, end, step = args[:5]
    return start in (0, None) and step in (1, None) and end in (FULL_SLICE_END, None) and not node.kwargs


def _canonical_expand(node: fx.Node) -> bool:
    """``expand`` sizes: -1 wherever the input already has the size (symbolic), numbers where static."""
    source, output = node.args[0], node.meta.get("val")
    sizes = list(node.args[1]) if isinstance(node.args[1], (list, tuple)) else None
    if not isinstance(source, fx.Node) or not isinstance(output, torch.Tensor) or sizes is None:
        return False
    value = source.meta.get("val")
    if not isinstance(value, torch.Tensor) or len(sizes) != output.dim():
        return False
    lead = output.dim() - value.dim()
    canonical = list(sizes)
    for index, size in enumerate(output.shape):
        if not isinstance(size, torch.SymInt):
            canonical[index] = int(size)
        elif index >= lead and isinstance(value.shape[index - lead], torch.SymInt) \
                and value.shape[index - lead].node.expr == size.node.expr:
            canonical[index] = -1
    if canonical == sizes:
        return False
    node.args = (source, canonical, *node.args[2:])
    return True


def drop_unused_inputs(parent: fx.GraphModule, name: str) -> None:
    """Remove the placeholders ``name``'s region no longer reads, and the parent's arguments for them."""
    region = getattr(parent, name)
    region.graph.eliminate_dead_code()
    placeholders = list(region.graph.find_nodes(op="placeholder"))
    unused = [index for index, node in enumerate(placeholders) if not node.users]
    if not unused:
        region.recompile()
        return
    for index in unused:
        region.graph.erase_node(placeholders[index])
    region.recompile()
    for call in parent.graph.find_nodes(op="call_module", target=name):
        call.args = tuple(arg for index, arg in enumerate(call.args) if index not in unused)
    parent.graph.eliminate_dead_code()
    parent.recompile()


def regional_module(gm: fx.GraphModule, inner: str, recompute: RecomputePolicy,
                    uncompiled: list[str] | None = None) -> tuple[fx.GraphModule, RegionPlan]:
    """The variant's graph as a parent of ``Region`` modules (compiled lazily, at their first call);
    a region that cannot be compiled says why in ``uncompiled`` (the variant record's list)."""
    if recompute not in REGIONAL_POLICIES:
        raise UnsupportedRegion(f"recompute={recompute} picks ops inside regions")
    started = time.perf_counter()
    plan = split_into_regions(gm)
    for name, kind in plan.kinds.items():
        if kind is RegionKind.COMPILED and canonical_views(getattr(plan.parent, name)):
            drop_unused_inputs(plan.parent, name)
    for name, kind in plan.kinds.items():
        recomputed = (recompute is RecomputePolicy.FULL and kind is not RegionKind.EXCHANGE) or (
            recompute is RecomputePolicy.ATTENTION and kind is RegionKind.ATTENTION)
        setattr(plan.parent, name, Region(getattr(plan.parent, name), kind, inner, recomputed, uncompiled))
    log.debug("dcp: split into %d regions in %.2fs", len(plan.kinds), time.perf_counter() - started)
    return plan.parent, plan


def describe_regions(plan: RegionPlan) -> str:
    counts = {kind: sum(1 for k in plan.kinds.values() if k is kind) for kind in RegionKind}
    return (f"{counts[RegionKind.COMPILED]} compiled region(s) (shared by code across variants), "
            f"{counts[RegionKind.ATTENTION]} attention op(s) and {counts[RegionKind.EXCHANGE]} exchange op(s) between them")
