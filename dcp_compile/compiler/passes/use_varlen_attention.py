"""Packed micro-batches: every self-attention becomes padding-free varlen attention.

A packed micro-batch concatenates several sequences along the sequence dimension (batch 1,
``T = sum(lengths)`` tokens) instead of padding them to the longest. Token-local work is already
right on such a batch; attention is not: it must not look across a sequence boundary. This pass
replaces each SDPA ``[B, H, T, D]`` by ``dcp::varlen_attention_fwd`` over ``[B*T, H, D]`` with the
boundaries as ``cu_seqlens``, a new graph input the dispatcher fills from ``dcp.use(...,
sequence_lengths=...)`` on every call.

It runs after ``insert_all_to_all``: under Ulysses each rank holds the whole packed sequence for
its heads between the two all-to-alls, so the boundaries apply unchanged and the SP size does not
matter. Attention that cannot be packed (a mask, dropout, cross-attention, 3-D hand-written
attention) is an error naming the site, never a silent attention across sequences.

Which implementation runs is chosen per call, where the sequences are known: the dispatcher reads
the call's ``sequence_lengths`` (on the host: no device sync) and asks
:func:`dcp_compile.kernels.attention_choice.choose_packed_attention` (the measured table there,
among what a graph can run under the inner compiler). The choice is part of the variant
(``Variant.attention``): ``None`` lowers to the ``dcp::`` op (Triton, or the reference on CPU),
``"flex"`` to FlexAttention traced into the graph, so AOTAutograd derives its exact backward and the
recompute policies tag it like any attention. Each kernel a variant is chosen with compiles it once.
"""

from __future__ import annotations

import functools
import logging

import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

from dcp_compile.kernels import varlen_attention as _register_varlen_ops  # noqa: F401  (defines dcp::varlen_*)
from dcp_compile.kernels.attention_choice import PackedSite, VarlenKernel
from dcp_compile.errors import DCPError
from dcp_compile.kernels.varlen_flex import document_mask_inputs, flex_document_attention_of_mask
from dcp_compile.compiler.graph_capture import insert_traced, splice_traced
from dcp_compile.compiler.passes.context import PassContext
from dcp_compile.compiler.passes.find_attention import SDPA, sdpa_argument

log = logging.getLogger(__name__)
VARLEN_ATTENTION = torch.ops.dcp.varlen_attention_fwd.default
FLEX_ATTENTION = torch.ops.higher_order.flex_attention


class CannotPack(DCPError, ValueError):
    """A packed micro-batch was asked for a graph whose attention cannot take sequence boundaries."""


def _why_not_packable(sdpa: fx.Node) -> str | None:
    query, key = sdpa.args[0].meta["val"], sdpa.args[1].meta["val"]
    if query.dim() != 4:
        return f"{query.dim()}-D attention (batch and heads are folded together, so tokens cannot be told apart)"
    if sdpa_argument(sdpa, "attn_mask") is not None:
        return "it has an attention mask (packing expresses the mask as sequence boundaries; drop the mask for packed batches)"
    if float(sdpa_argument(sdpa, "dropout_p")) > 0.0:
        return "it uses attention dropout, which the varlen kernel does not implement"
    if not statically_known_true(query.shape[2] == key.shape[2]):
        return "it is cross-attention (keys of another length): the context's boundaries are not known"
    if query.shape[-1] != sdpa.args[2].meta["val"].shape[-1]:
        return "values have another head dim than queries"
    return None


def tokens(x: torch.Tensor) -> torch.Tensor:
    """``[B, H, T, D]`` -> ``[B*T, H, D]``, every row in order."""
    return x.transpose(1, 2).flatten(0, 1)


def packed_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, boundaries: torch.Tensor,
                     *, causal: bool, scale: float | None) -> torch.Tensor:
    """SDPA's ``[B, H, T, D]`` in and out; varlen attention over the ``B*T`` tokens in between."""
    out, _ = VARLEN_ATTENTION(tokens(query), tokens(key), tokens(value), boundaries, 0, causal, scale)
    return out.view_as(query.transpose(1, 2)).transpose(1, 2)


def packed_flex_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *mask_inputs: torch.Tensor,
                          causal: bool, scale: float | None) -> torch.Tensor:
    """:func:`packed_attention` by FlexAttention over the graph's shared document mask."""
    out = flex_document_attention_of_mask(tokens(query), tokens(key), tokens(value), mask_inputs, causal, scale)
    return out.reshape(query.transpose(1, 2).shape).transpose(1, 2)


def insert_document_mask(gm: fx.GraphModule, before: fx.Node, query: fx.Node, boundaries: fx.Node, causal: bool,
                         ctx: PassContext) -> tuple[fx.Node, ...]:
    """The document ids and block-mask tensors, traced once into the graph before ``before``: every
    attention of that causality reads them (built per site, a graph of 40 layers would launch
    the mask's kernels 40 times a step)."""
    def build(boundaries: torch.Tensor, query: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return document_mask_inputs(boundaries, tokens(query), causal)

    return tuple(insert_traced(gm, before, build, [boundaries, query], ctx.fake_mode,
                               prefix=f"_dcp_document_mask_{int(causal)}"))


def packed_sites(gm: fx.GraphModule) -> tuple[PackedSite, ...]:
    """The graph's distinct SDPA sites as the choice sees them (read once, from the analysed graph)."""
    sites = []
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target is SDPA:
            query = node.args[0].meta["val"]
            sites.append(PackedSite(bool(sdpa_argument(node, "is_causal")), int(query.shape[-1]), query.dtype))
    return tuple(dict.fromkeys(sites))  # one per kind: the per-call cache key stays small


def add_sequence_boundaries_input(gm: fx.GraphModule, ctx: PassContext) -> fx.Node:
    """A ``cu_seqlens`` placeholder after the others, its length (sequences + 1) a new symbol."""
    from torch._dynamo.source import ConstantSource
    from torch.fx.experimental.symbolic_shapes import DimDynamic, StatelessSymbolicContext

    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    with gm.graph.inserting_after(placeholders[-1]):
        boundaries = gm.graph.placeholder("dcp_cu_seqlens")
    # A backed symbol (hint 3, so that 0/1 specialization stays out of the way): nothing in the
    # graph reads the count but the varlen kernel or FlexAttention's document ids (an arange of
    # it, repeated by the lengths), so no guard is ever put on it; one sequence is tested.
    boundaries.meta["val"] = ctx.fake_mode.from_tensor(
        torch.zeros(3, dtype=torch.int32), source=ConstantSource("dcp_cu_seqlens"),
        symbolic_context=StatelessSymbolicContext(dynamic_sizes=[DimDynamic.DYNAMIC]),
    )
    ctx.fake_inputs = [*ctx.fake_inputs, boundaries.meta["val"]]
    return boundaries


def use_varlen_attention_pass(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    if not ctx.packed:
        return gm
    sites = [n for n in gm.graph.nodes if n.op == "call_function" and n.target is SDPA]
    if not sites:
        raise CannotPack("dcp: a packed micro-batch was asked for (dcp.use(..., sequence_lengths=...)), but the "
                         "graph has no attention to keep the sequences apart; run it without sequence_lengths")
    for sdpa in sites:
        reason = _why_not_packable(sdpa)
        if reason is not None:
            raise CannotPack(f"dcp: cannot pack sequences through attention {sdpa.name} "
                             f"({(sdpa.meta.get('stack_trace') or '?').strip().splitlines()[-1]}): {reason}. "
                             "Run this model on padded batches (dcp.use without sequence_lengths).")
    boundaries = add_sequence_boundaries_input(gm, ctx)
    flex = ctx.packed_attention == VarlenKernel.FLEX.value
    masks: dict[bool, tuple[fx.Node, ...]] = {}  # FlexAttention's document mask, once per causality
    for sdpa in sites:
        causal, scale = bool(sdpa_argument(sdpa, "is_causal")), sdpa_argument(sdpa, "scale")
        if flex:
            if causal not in masks:
                masks[causal] = insert_document_mask(gm, sdpa, sdpa.args[0], boundaries, causal, ctx)
            lower = functools.partial(packed_flex_attention, causal=causal, scale=scale)
            splice_traced(gm, sdpa, lower, [*sdpa.args[:3], *masks[causal]], ctx.fake_mode)
        else:
            lower = functools.partial(packed_attention, causal=causal, scale=scale)
            splice_traced(gm, sdpa, lower, [*sdpa.args[:3], boundaries], ctx.fake_mode)
    gm.recompile()
    how = "FlexAttention with a document mask" if flex else "the dcp::varlen_attention op"
    why = ctx.packed_attention_reason  # "<kernel> (<the table's case, or why there is none>)"
    if ctx.variant_record is not None:
        ctx.variant_record.rewrites.append(f"{len(sites)} attention(s) -> varlen attention over packed sequences "
                                           f"by {how}" + (f", chosen: {why}" if why else ""))
        ctx.variant_record.packed_attention = why or ("flex" if flex else "dcp op")
    log.info("dcp: %d attention site(s) run as varlen attention over packed sequences by %s (%s)", len(sites), how,
             why or "no choice recorded")
    return gm

