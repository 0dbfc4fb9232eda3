"""From the graph dynamo hands the backend to an ATen graph the passes can read.

Dynamo's graph speaks torch IR (``torch.nn.functional.linear``, ``x.view(...)``, method calls,
checkpointed regions as nested graph modules). One pre-dispatch ATen re-trace normalizes all of
that to a single spelling per op (``aten.linear``, ``aten.view``, ``aten.scaled_dot_product_attention``)
while keeping the ops above autograd, so AOTAutograd can still differentiate the transformed graph.
Checkpointed regions are inlined first, each of their nodes tagged the way AOTAutograd tags them
(``recompute`` / ``ac_graph_id``), so the partitioner still recomputes them. Custom
``autograd.Function`` calls become one op each that keeps the user's backward
(:mod:`~dcp_compile.compiler.custom_autograd`): the re-trace alone would keep only their forward.

Every later re-trace (the sharding passes rewrite by re-tracing) uses the same fake inputs, which
carry the symbolic sizes dynamo allocated: the sequence length stays one symbol from end to end.
"""

from __future__ import annotations

import contextlib
import copy
import operator
from typing import Any, Callable, Iterator, Sequence

import torch
import torch.fx as fx
import torch.fx.proxy as fx_proxy
import torch.fx.traceback as fx_traceback
from torch.fx.experimental import _config as fx_config
from torch._guards import TracingContext, detect_fake_mode
from torch.fx.experimental.proxy_tensor import make_fx
from torch.utils.checkpoint import CheckpointPolicy

from dcp_compile.compiler.custom_autograd import capture_custom_autograd_functions

checkpoint_hop = torch.ops.higher_order.tag_activation_checkpoint


def fake_inputs_for(example_inputs: Sequence[Any]) -> tuple[list[Any], Any]:
    """Fake copies of the backend's example inputs, with dynamo's symbolic sizes."""
    context = TracingContext.try_get()
    fake_mode = context.fake_mode if context is not None else detect_fake_mode(example_inputs)
    if fake_mode is None:
        from torch._subclasses.fake_tensor import FakeTensorMode
        from torch.fx.experimental.symbolic_shapes import ShapeEnv

        fake_mode = FakeTensorMode(shape_env=ShapeEnv())

    def fakify(value: Any) -> Any:
        if not isinstance(value, torch.Tensor):
            return value
        if getattr(value, "fake_mode", None) is fake_mode:
            return value
        symbolic_context = context.tensor_to_context.get(value) if context is not None else None
        source = symbolic_context.tensor_source if symbolic_context is not None else None
        return fake_mode.from_tensor(value, symbolic_context=symbolic_context, source=source)

    return [fakify(value) for value in example_inputs], fake_mode


def inline_checkpointed_regions(gm: fx.GraphModule) -> int:
    """Replace each ``tag_activation_checkpoint`` call by its body, tagged for recomputation."""
    regions = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target is not checkpoint_hop:
            continue
        body: fx.GraphModule = getattr(gm, node.args[0].target)
        inline_checkpointed_regions(body)
        env: dict[fx.Node, Any] = {}
        placeholders = [n for n in body.graph.nodes if n.op == "placeholder"]
        for placeholder, argument in zip(placeholders, node.args[1:]):
            env[placeholder] = argument
        result: Any = None
        with gm.graph.inserting_before(node):
            for body_node in body.graph.nodes:
                if body_node.op == "placeholder":
                    continue
                if body_node.op == "output":
                    result = fx.map_arg(body_node.args[0], lambda n: env[n])
                    break
                if body_node.op == "get_attr":
                    # Bodies keep their own attributes (constants, nested graphs): hoist them.
                    qualified = f"_dcp_inlined_{regions}_{body_node.target.replace('.', '_')}"
                    setattr(gm, qualified, getattr(body, body_node.target))
                    copied = gm.graph.get_attr(qualified)
                    copied.meta = dict(body_node.meta)
                else:
                    copied = gm.graph.node_copy(body_node, lambda n: env[n])
                copied.meta.setdefault("recompute", CheckpointPolicy.PREFER_RECOMPUTE)
                copied.meta.setdefault("ac_graph_id", 1000 + regions)
                env[body_node] = copied
        for user in list(node.users):
            if user.op == "call_function" and user.target is operator.getitem:
                user.replace_all_uses_with(result[user.args[1]])
                gm.graph.erase_node(user)
        if node.users:
            node.replace_all_uses_with(result)
        gm.graph.erase_node(node)
        regions += 1
    if regions:
        gm.graph.eliminate_dead_code()
        gm.delete_all_unused_submodules()
        gm.recompile()
    return regions


def retrace(function: Callable[..., Any], fake_inputs: Sequence[Any], fake_mode: Any,
            dispatch_cache: bool = False) -> fx.GraphModule:
    """Trace ``function(*fake_inputs)`` to a pre-dispatch ATen graph, keeping node metadata.

    ``preserve_node_meta`` lets the ``recompute`` tags and stack traces of the interpreted graph's
    nodes follow into the ops they turn into.
    """
    # Chunk lengths are expressions like (s0 + 1) // 2: treat them size-obliviously, so that a
    # contiguity or broadcast check does not specialize the graph on a chunk of length 1.
    cache = contextlib.nullcontext() if dispatch_cache else without_dispatch_cache(fake_mode)
    with fake_mode, cache, fx_traceback.preserve_node_meta(), fx_config.patch(backed_size_oblivious=True):
        return make_fx(function, pre_dispatch=True, record_module_stack=False)(*fake_inputs)


@contextlib.contextmanager
def without_dispatch_cache(fake_mode: Any) -> Iterator[None]:
    """Fake-tensor dispatch without its cache, for dcp's own traces.

    With symbolic sizes the cache costs more than it saves: each op's key hashes its symbolic
    arguments, and a hit rebuilds the output through ``set_`` with symbolic sizes and strides,
    whose contiguity checks are sympy work. Measured on the sequence fuzzer's programs (process CPU
    time, one rank at SP 2): dcp's re-traces took ~35-45% less time without it. Its key leaves out
    ``backed_size_oblivious``: a hit can hand dcp's size-oblivious trace the size dynamo simplified
    under a guard (``s0`` for a slice ``x[:, :s0]`` of a padded ``2*((s0+1)//2)``), where the
    trace's own rule gives ``Min(s0, 2*((s0+1)//2))``; without the cache every size comes from that
    rule. The sharding records of 59 fuzz programs were the same either way. The first trace
    (:func:`capture_aten_graph`, which the analysis reads) keeps the cache, so the analysis sees
    the sizes it always saw; so does dynamo's own trace.
    """
    if not hasattr(fake_mode, "cache_enabled"):
        yield
        return
    previous = fake_mode.cache_enabled
    fake_mode.cache_enabled = False
    try:
        yield
    finally:
        fake_mode.cache_enabled = previous


def splice_traced(gm: fx.GraphModule, node: fx.Node, function: Callable[..., Any], inputs: Sequence[fx.Node],
                  fake_mode: Any) -> fx.Node:
    """Replace ``node`` by the ATen graph of ``function(*inputs)``, traced on those inputs alone.

    Re-tracing one site (a few dozen ops) instead of the whole model keeps a per-variant pass
    cheap. The new ops carry ``node``'s stack trace and recompute tags, as a whole re-trace would.
    """
    with fx_traceback.preserve_node_meta(), fx_traceback.set_current_meta(node):
        result = insert_traced(gm, node, function, inputs, fake_mode, prefix=f"_dcp_{node.name}")
    node.replace_all_uses_with(result)
    gm.graph.erase_node(node)
    return result


def insert_traced(gm: fx.GraphModule, before: fx.Node, function: Callable[..., Any], inputs: Sequence[fx.Node],
                  fake_mode: Any, prefix: str) -> Any:
    """The ATen graph of ``function(*inputs)``, traced on those inputs alone and copied into ``gm``
    before ``before``; its lifted constants become attributes of ``gm`` named ``prefix_<name>``.
    Returns what the copied graph returns (a node, or a tuple of nodes)."""
    subgraph = retrace(function, [n.meta["val"] for n in inputs], fake_mode)
    return copy_traced(gm, before, subgraph, inputs, prefix)


def copy_traced(gm: fx.GraphModule, before: fx.Node, subgraph: fx.GraphModule, inputs: Sequence[fx.Node],
                prefix: str, stamp: dict[str, Any] | None = None) -> Any:
    """Copy the traced ``subgraph`` into ``gm`` before ``before``, its placeholders bound to
    ``inputs``; its lifted constants become attributes of ``gm`` named ``prefix_<name>``. The
    subgraph is left as it was, so one trace can be copied in at several sites. ``stamp``: node
    meta (stack trace, recompute tags, ...) each copied node takes where the trace set none, as
    a trace under ``fx.traceback.set_current_meta`` of the site would have given it."""
    placeholders = subgraph.graph.find_nodes(op="placeholder")
    copied: dict[fx.Node, fx.Node] = dict(zip(placeholders, inputs))
    with gm.graph.inserting_before(before):
        result = gm.graph.graph_copy(subgraph.graph, copied)
    for constant in subgraph.graph.find_nodes(op="get_attr"):  # lifted constants move over
        name = f"{prefix}_{constant.target}"
        setattr(gm, name, getattr(subgraph, constant.target))
        copied[constant].target = name
    if stamp:
        fields = [field for field in ("stack_trace", *fx_proxy._COPY_META_FIELDS) if field in stamp]
        for node in subgraph.graph.nodes:
            if node.op in ("placeholder", "output"):
                continue
            for field in fields:
                copied[node].meta.setdefault(field, copy.copy(stamp[field]))
    return result


def site_meta(node: fx.Node) -> dict[str, Any]:
    """The meta a trace under ``fx.traceback.set_current_meta(node)`` gives the nodes it creates."""
    with fx_traceback.preserve_node_meta(), fx_traceback.set_current_meta(node):
        return dict(fx_traceback.get_current_meta())


def interpret(gm: fx.GraphModule) -> Callable[..., Any]:
    def run(*args: Any) -> Any:
        return fx.Interpreter(gm).run(*args)

    return run


def detach_data_attributes(gm: fx.GraphModule) -> int:
    """``tensor.data`` (dynamo's ``_get_data_attr``) becomes ``aten.detach``: the same storage
    without autograd history.

    Traced as it is, ``_get_data_attr`` of a fake tensor yields a tensor the tracer does not
    connect to its source: it is frozen into the graph as a fake constant, so a write through it
    (CogVideoX fills its position table with ``table.data[:, text:].copy_(positions)``) is lost
    and the compiled graph holds a fake tensor at run time. ``detach`` keeps the alias.
    """
    rewritten = 0
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target is torch._C._autograd._get_data_attr:
            node.target = torch.ops.aten.detach.default
            rewritten += 1
    if rewritten:
        gm.recompile()
    return rewritten


def capture_aten_graph(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> tuple[fx.GraphModule, list[Any], Any]:
    """Dynamo's graph as a pre-dispatch ATen graph, with its fake inputs and fake mode."""
    fake_inputs, fake_mode = fake_inputs_for(example_inputs)
    inline_checkpointed_regions(gm)
    detach_data_attributes(gm)
    capture_custom_autograd_functions(gm, fake_mode)
    # With the dispatch cache as dynamo had it: the analysis reads these sizes (see without_dispatch_cache).
    aten_gm = retrace(interpret(gm), fake_inputs, fake_mode, dispatch_cache=True)
    cut = getattr(gm, "compile_subgraph_reason", None)  # dynamo sets it on a graph a graph break cut short
    if cut is not None and getattr(cut, "graph_break", False):
        aten_gm.meta["dcp_graph_break"] = str(cut.reason).splitlines()[0][:160]
    return aten_gm, fake_inputs, fake_mode
