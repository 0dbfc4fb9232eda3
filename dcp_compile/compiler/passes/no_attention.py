"""Why a graph holds no attention, and whether that deserves a warning.

A model often reaches the backend as several graphs (graph breaks in its own code): the
timestep embedding and patchify before the blocks, position tables, an adaLN modulation, the
loss after them. Those pieces hold no attention by construction and run replicated on every
rank, which costs nothing: their record says so, with what they hold, and they stay quiet.
Two cases do warn (issue 24): a graph with an op that could be an attention the finder did not
recognise (a softmax over a dimension of dynamic size, or a product that pairs positions with
positions: the largest such product is named, with its line of model code, and how to write the
attention so that it is found), and a whole model (one graph not cut by a graph break, not
resuming after one, not called from code that does) with parameters and a dynamic-length input
but no attention: it runs replicated, with no sequence parallelism.
"""

from __future__ import annotations

import collections
import os
import sys
from dataclasses import dataclass

import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import optimization_hint

aten = torch.ops.aten

SOFTMAX_LIKE = {aten.softmax.int, aten._softmax.default, aten._safe_softmax.default, aten.log_softmax.int,
                aten._log_softmax.default}
PRODUCTS = {aten.matmul.default, aten.bmm.default, aten.baddbmm.default, aten.einsum.default, aten.mm.default}
# How to write a suspected attention so that it is found: the two forms the finder shards.
MARK_ATTENTION = (
    "If {name} belongs to an attention, write that attention as "
    "torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=..., scale=...), or as "
    "torch.softmax(f(q @ k.transpose(-2, -1)), dim=-1) @ v with f elementwise (a scale, a mask, a bias, "
    "soft-capping) on [batch, heads, length, head_dim] operands: the two forms dcp finds and shards")
RESUMED = "torch_dynamo_resume_in_"  # dynamo's name for the code after a graph break
GRAPH_BREAK_META = "dcp_graph_break"  # the reason dynamo cut this graph, set where the graph is captured
EVAL_FRAME = os.path.join("_dynamo", "eval_frame.py")  # the entry of a torch.compile'd call
TORCH_DIR = os.path.dirname(torch.__file__)
DCP_DIR = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@dataclass
class NoAttention:
    """The finding for a graph with no attention site."""

    reason: str  # what the record and the log say
    suspect: str | None  # an op that could be a missed attention
    piece: str | None  # how this graph is a piece of a larger forward (a graph break), if it is
    remedy: str | None = None  # how to write a suspected product's attention so that it is found

    def should_warn(self, whole_model_with_sequence: bool) -> bool:
        return self.suspect is not None or (self.piece is None and whole_model_with_sequence)


def _dynamic(size: object) -> bool:
    return isinstance(size, torch.SymInt) and bool(size.node.expr.free_symbols)


def _same_size(a: object, b: object) -> bool:
    return _dynamic(a) and _dynamic(b) and a.node.expr == b.node.expr  # type: ignore[union-attr]


def _is_product(node: fx.Node) -> bool:
    """A product op, or a sum of a broadcast product (``einops.reduce``) not read as a matmul."""
    if node.target in PRODUCTS:
        return True
    source = node.args[0] if node.target is aten.sum.dim_IntList and node.args else None
    return isinstance(source, fx.Node) and source.target is aten.mul.Tensor


def _size_hint(value: torch.Tensor) -> int:
    """The element count at the traced sizes (for ranking only: no guard)."""
    try:
        return optimization_hint(value.numel(), fallback=0)
    except Exception:  # a size with no hint ranks last
        return 0


def largest_scores_product(gm: fx.GraphModule) -> fx.Node | None:
    """The likeliest scores of a missed attention: the largest product with a ``[..., S, S]``
    output, S one dynamic size (the first of equals, in graph order)."""
    candidates = [node for node in gm.graph.nodes if node.op == "call_function" and _is_product(node)
                  and isinstance(value := node.meta.get("val"), torch.Tensor) and value.dim() >= 2
                  and _same_size(value.shape[-1], value.shape[-2])]
    return max(candidates, key=lambda node: _size_hint(node.meta["val"]), default=None)


def source_line(node: fx.Node) -> str | None:
    """The model line ``node`` comes from (file name, line number, the code in backquotes): the
    innermost frame of its stack trace outside torch, dcp and installed libraries (einops), else
    the innermost outside torch and dcp (a model of an installed library: transformers)."""
    lines = (node.meta.get("stack_trace") or "").splitlines()
    frames = [(i, line.strip()) for i, line in enumerate(lines) if line.strip().startswith("File ")]
    outside = [(i, f) for i, f in frames if not _library_frame(f, site_packages=False)]
    preferred = [(i, f) for i, f in outside if not _library_frame(f, site_packages=True)] or outside
    if not preferred:
        return None
    index, frame = preferred[-1]
    quoted = frame.split('"')
    line_number = frame.partition(", line ")[2].partition(",")[0]
    place = f"{os.path.basename(quoted[1]) if len(quoted) > 2 else frame}:{line_number}"
    code = lines[index + 1].strip() if index + 1 < len(lines) else ""
    return f"{place} `{code}`" if code and not code.startswith("File ") else place


INSTALLED = ("site-packages", "dist-packages")


def _library_frame(frame: str, site_packages: bool) -> bool:
    quoted = frame.split('"')
    path = quoted[1] if len(quoted) > 2 else ""
    installed = site_packages and any(part in path for part in INSTALLED)
    return path.startswith(TORCH_DIR) or path.startswith(DCP_DIR) or installed


@dataclass(frozen=True)
class Suspect:
    """An op that could be a missed attention, and why."""

    node: fx.Node
    why: str

    def __str__(self) -> str:
        return f"{self.node.name} ({self.why})"


def suspected_attention(gm: fx.GraphModule) -> Suspect | None:
    """An op that could be an attention: a flex attention, the largest product whose last two
    dimensions are one dynamic size (scores, position by position), a softmax over a dimension of
    dynamic size."""
    calls = [node for node in gm.graph.nodes if node.op == "call_function"]
    flex = next((node for node in calls if "flex_attention" in str(node.target)), None)
    if flex is not None:
        return Suspect(flex, str(flex.target))
    scores = largest_scores_product(gm)
    if scores is not None:
        shape, where = scores.meta["val"].shape, source_line(scores)
        return Suspect(scores, f"the largest product pairing {shape[-1]} positions with {shape[-2]}"
                               f"{', at ' + where if where else ''}")
    for node in calls:
        value = node.meta.get("val")
        if node.target in SOFTMAX_LIKE and isinstance(value, torch.Tensor) and value.dim() >= 2:
            dim = node.args[1] if len(node.args) > 1 else -1
            if isinstance(dim, int) and _dynamic(value.shape[dim]):
                return Suspect(node, f"a softmax over a dimension of dynamic size {value.shape[dim]}")
    return None


def _origins(gm: fx.GraphModule, limit: int = 3) -> str:
    """Where the graph's ops come from: the innermost model functions of their stack traces."""
    places: collections.Counter = collections.Counter()
    for node in gm.graph.nodes:
        trace = (node.meta.get("stack_trace") or "").strip().splitlines() if node.op == "call_function" else []
        frame = next((line.strip() for line in reversed(trace) if line.strip().startswith("File")), "")
        if frame:
            path, _, function = frame.partition(", in ")
            quoted = path.split('"')
            places[f"{os.path.basename(quoted[1]) if len(quoted) > 2 else path}:{function}"] += 1
    names = [place.replace(RESUMED, "resumed ") for place, _ in places.most_common(limit)]
    return f" (from {', '.join(names)})" if names else ""


def graph_piece(gm: fx.GraphModule) -> str | None:
    """How ``gm`` is part of a forward dynamo cut in pieces, or None for a whole frame."""
    cut = gm.meta.get(GRAPH_BREAK_META)
    if cut:
        return f"dynamo cut the model's forward here (graph break: {cut})"
    for node in gm.graph.nodes:
        if RESUMED in (node.meta.get("stack_trace") or ""):
            return "it resumes the model's forward after a graph break"
    caller = _resumed_caller()
    if caller is not None:
        return f"a submodule's frame, called from model code dynamo did not capture ({caller})"
    return None


def _resumed_caller() -> str | None:
    """A frame on the Python stack that runs a model's code dynamo did not capture. The backend is
    called while dynamo compiles a frame, before it runs, so the frames above are its callers: a
    submodule whose forward dynamo compiles on its own was called from its parent's resumed code
    after a graph break (HunyuanVideo 1.5's adaLN norm), or from a parent forward dynamo runs
    eagerly inside the compiled call (Z-Image's blocks, after a break in a loop): a model's
    ``forward`` below the compiled call's entry (dynamo's ``eval_frame``)."""
    frame = sys._getframe(1)
    forward = None
    while frame is not None:
        code = frame.f_code
        if code.co_name.startswith(RESUMED):
            return f"{os.path.basename(code.co_filename)}:{code.co_name.replace(RESUMED, 'resumed ')}"
        if forward is None and code.co_name == "forward" and _model_code(code.co_filename) and isinstance(
                frame.f_locals.get("self"), torch.nn.Module):
            forward = f"{os.path.basename(code.co_filename)}:{type(frame.f_locals['self']).__name__}.forward"
        elif forward is not None and code.co_filename.endswith(EVAL_FRAME):
            return f"{forward}, run eagerly inside the compiled call"
        frame = frame.f_back
    return None


def _model_code(path: str) -> bool:
    return not (path.startswith(TORCH_DIR) or path.startswith(DCP_DIR))


def explain_no_attention(gm: fx.GraphModule) -> NoAttention:
    ops = sum(1 for node in gm.graph.nodes if node.op == "call_function")
    suspect = suspected_attention(gm)
    piece = graph_piece(gm)
    if suspect is not None:
        reason = f"no attention recognised, though {suspect} could be one (of {ops} ops{_origins(gm)})"
    else:
        reason = (f"the graph has no attention: none of its {ops} ops{_origins(gm)} is a softmax or a "
                  "product of positions with positions, so none was missed")
    if piece is not None:
        reason += f"; {piece}"
    remedy = MARK_ATTENTION.format(name=suspect.node.name) if suspect is not None else None
    return NoAttention(reason, None if suspect is None else str(suspect), piece, remedy)
