"""The graph as a person reads it: ops grouped by the module that ran them, each with its role.

A compiled graph is a flat list of ATen ops; the model is a tree of modules. ``nn_module_stack``
(kept by Dynamo on every node) gives each op its module path, so the report can show
``layers.0.attn`` as one expandable group instead of hundreds of lines. Roles come from the
sequence analysis (``GraphRecord.classification``, keyed by the analysed graph's node names); a
variant adds what it did to them: the ops that ran on gathered inputs and the collectives it
inserted (found in the variant's own graph, grouped by the same module paths).

This module builds plain data only; ``html_report`` renders it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterable

from dcp_compile.report.source_lines import SourceLine, source_line

if TYPE_CHECKING:
    import torch.fx as fx

    from dcp_compile.compiler.record import GraphRecord, VariantRecord

# Roles the report colours, in legend order. "replicated" is an op with no sequence dimension.
ROLES = ("token_local", "attention", "sequence_mixing", "gathered", "collective", "source", "token_set", "replicated")
ROLE_LABELS = {
    "token_local": "token-local",
    "attention": "attention",
    "sequence_mixing": "sequence-mixing",
    "gathered": "ran on gathered inputs",
    "collective": "collective",
    "source": "creates the sequence",
    "token_set": "token set (MoE counts)",
    "replicated": "no sequence dimension",
}
# The graph's placeholders (parameters, buffers, the batch), one collapsed group: a model has hundreds.
INPUTS = "(graph inputs)"
_COLLECTIVE_NAMESPACES = ("_c10d_functional", "c10d_functional", "_dtensor")


@dataclass
class OpView:
    """One op of the graph as shown: name, short op, role and why."""

    name: str
    op: str
    role: str
    detail: str = ""
    source: SourceLine | None = None


@dataclass
class ModuleView:
    """A module of the model (``path`` as the user spells it: ``layers.0.attn``) and the ops it ran."""

    path: str
    name: str
    type_name: str = ""
    ops: list[OpView] = field(default_factory=list)
    children: dict[str, "ModuleView"] = field(default_factory=dict)

    def walk(self) -> Iterable["ModuleView"]:
        yield self
        for child in self.children.values():
            yield from child.walk()

    def role_counts(self) -> dict[str, int]:
        """Ops per role in this module and below (what the collapsed group shows)."""
        counts: dict[str, int] = {}
        for module in self.walk():
            for op in module.ops:
                counts[op.role] = counts.get(op.role, 0) + 1
        return counts

    @property
    def op_count(self) -> int:
        return sum(len(module.ops) for module in self.walk())


def module_path(node: "fx.Node") -> tuple[str, str]:
    """(path, class name) of the innermost module that ran ``node``; ("", "") for the top level."""
    stack = node.meta.get("nn_module_stack") or {}
    # A module Dynamo reached through a module global (``G['__import_transformers_dot_...'].fn``: a
    # Hugging Face hub kernel wrapping a function such as apply_rotary_pos_emb) is not in the
    # user's module tree: its ops belong to the module that called it.
    entries = [(path, module_type) for path, module_type in stack.values() if not str(path).startswith("G[")]
    if not entries:
        return "", ""
    path, module_type = entries[-1]
    type_name = getattr(module_type, "__name__", None) or str(module_type).rsplit(".", 1)[-1].strip("'>")
    return clean_module_path(str(path)), type_name


def clean_module_path(path: str) -> str:
    """Dynamo's source spelling (``L['self'].layers._modules['0'].attn``) as the user writes it."""
    path = re.sub(r"^L\['self'\]\.?", "", path)
    # A forward wrapped by a decorator taking ``*args`` (Hugging Face's can_return_tuple) gets
    # ``self`` as its first positional argument: the root of the user's tree, not "args.0".
    path = re.sub(r"^L\['args'\]\[0\]\.?", "", path)
    path = re.sub(r"^L\['(\w+)'\]\.?", r"\1.", path).rstrip(".")
    path = re.sub(r"\._modules\['([^']+)'\]", r".\1", path)
    path = re.sub(r"_modules\['([^']+)'\]", r"\1", path)
    path = re.sub(r"\[(\d+)\]", r".\1", path)
    path = re.sub(r"\['([^']+)'\]", r".\1", path)
    return path.strip(".")


def short_op(node: "fx.Node") -> str:
    if node.op in ("placeholder", "output", "get_attr"):
        return node.op
    target = node.target
    name = getattr(target, "__name__", None) or str(target)
    return str(target).replace("aten.", "") if "aten." in str(target) else name


def is_collective(node: "fx.Node") -> bool:
    return node.op == "call_function" and str(node.target).split(".")[0] in _COLLECTIVE_NAMESPACES


def gathered_nodes(variant: "VariantRecord") -> dict[str, str]:
    """Analysed-graph node name -> why it ran on gathered (full) inputs, for this variant."""
    names: dict[str, str] = {}
    for gather in variant.gathers:
        consumer = getattr(gather, "op", None)
        if consumer:
            names.setdefault(consumer, f"all-gather of {getattr(gather, 'node', '?')}: {getattr(gather, 'reason', gather)}")
    for fallback in variant.local_fallbacks:
        name, _, why = fallback.partition(" (")
        names.setdefault(name, fallback)
    for site, why in variant.unsharded_sites:
        names.setdefault(site, f"attention UNSHARDED: {why}")
    return names


def module_tree(graph_record: "GraphRecord", variant: "VariantRecord | None" = None) -> ModuleView:
    """The analysed graph grouped by module, roles from the analysis, and (for ``variant``) the
    ops that ran gathered and the collectives it inserted."""
    root = ModuleView(path="", name="(model)")
    gm = graph_record.graph
    if gm is None:
        return root
    roles = {name: (role, detail) for name, _, role, detail in graph_record.classification}
    gathered = gathered_nodes(variant) if variant is not None else {}
    for node in gm.graph.nodes:
        if node.op in ("output",):
            continue
        role, detail = roles.get(node.name, ("replicated", ""))
        if node.name in gathered and variant is not None and variant.sp_size > 1:
            role, detail = "gathered", gathered[node.name]
        if is_collective(node):
            role = "collective"
        path, type_name = module_path(node)
        if node.op == "placeholder" and not path:
            path, type_name = INPUTS, "parameters, buffers and inputs"
        _module(root, path, type_name).ops.append(
            OpView(node.name, short_op(node), role, detail, source_line(node.meta.get("stack_trace"))))
    if variant is not None and variant.graph is not None:
        for node in variant.graph.graph.nodes:
            if is_collective(node) and "wait_tensor" not in str(node.target):
                path, type_name = module_path(node)
                _module(root, path, type_name).ops.append(
                    OpView(node.name, short_op(node).replace("_c10d_functional.", ""), "collective",
                           "inserted by this variant", source_line(node.meta.get("stack_trace"))))
    return root


def _module(root: ModuleView, path: str, type_name: str) -> ModuleView:
    module = root
    if not path:
        return root
    parts = path.split(".")
    for depth, part in enumerate(parts):
        child_path = ".".join(parts[: depth + 1])
        if part not in module.children:
            module.children[part] = ModuleView(path=child_path, name=part)
        module = module.children[part]
    if type_name and not module.type_name:
        module.type_name = type_name
    return module


def node_sources(graph_record: "GraphRecord") -> dict[str, SourceLine]:
    """Analysed node name -> the model source line that produced it (where Dynamo kept one)."""
    if graph_record.graph is None:
        return {}
    sources = {}
    for node in graph_record.graph.graph.nodes:
        line = source_line(node.meta.get("stack_trace"))
        if line is not None:
            sources[node.name] = line
    return sources


def summarise_collectives(collectives: dict[str, Any]) -> str:
    return ", ".join(f"{name.replace('_c10d_functional.', '')} x{count}" for name, count in sorted(collectives.items())) or "none"
