"""Why a graph holds no attention, and whether that deserves a warning.

A model often reaches the backend as several graphs (graph breaks in its own code): the
timestep embedding and patchify before the blocks, position tables, an adaLN modulation, the
loss after them. Those pieces hold no attention by construction and run replicated on every
rank, which costs nothing: their record says so, with what they hold, and they stay quiet.
Two cases do warn (issue 24): a graph with an op that could be an attention the finder did not
recognise (a softmax over a dimension of dynamic size, or a product that pairs positions with
positions), and a whole model (one graph not cut by a graph break, not resuming after one, not
called from code that does) with parameters and a dynamic-length input but no attention: it runs
replicated, with no sequence parallelism.
"""

from __future__ import annotations

import collections
import os
import sys
from dataclasses import dataclass

import torch
import torch.fx as fx

aten = torch.ops.aten

SOFTMAX_LIKE = {aten.softmax.int, aten._softmax.default, aten._safe_softmax.default, aten.log_softmax.int,
                aten._log_softmax.default}
PRODUCTS = {aten.matmul.default, aten.bmm.default, aten.baddbmm.default, aten.einsum.default, aten.mm.default}
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

    def should_warn(self, whole_model_with_sequence: bool) -> bool:
        return self.suspect is not None or (self.piece is None and whole_model_with_sequence)


def _dynamic(size: object) -> bool:
    return isinstance(size, torch.SymInt) and bool(size.node.expr.free_symbols)


def _same_size(a: object, b: object) -> bool:
    return _dynamic(a) and _dynamic(b) and a.node.expr == b.node.expr  # type: ignore[union-attr]


def suspected_attention(gm: fx.GraphModule) -> str | None:
    """An op that could be an attention: a softmax over a dimension of dynamic size, a product
    whose last two dimensions are one dynamic size (scores, position by position), a flex attention."""
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        value = node.meta.get("val")
        if "flex_attention" in str(node.target):
            return f"{node.name} ({node.target})"
        if not isinstance(value, torch.Tensor) or value.dim() < 2:
            continue
        if node.target in SOFTMAX_LIKE:
            dim = node.args[1] if len(node.args) > 1 else -1
            if isinstance(dim, int) and _dynamic(value.shape[dim]):
                return f"{node.name} (a softmax over a dimension of dynamic size {value.shape[dim]})"
        if node.target in PRODUCTS and _same_size(value.shape[-1], value.shape[-2]):
            return f"{node.name} (a product pairing {value.shape[-1]} positions with {value.shape[-2]})"
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
    return NoAttention(reason, suspect, piece)
