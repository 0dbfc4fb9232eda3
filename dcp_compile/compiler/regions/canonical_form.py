"""One spelling for code that two traces write two ways, so that equal code has one key."""

from __future__ import annotations

import torch
import torch.fx as fx


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
