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
"""

from __future__ import annotations

import functools
import logging

import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

from dcp_compile.kernels import varlen_attention as _register_varlen_ops  # noqa: F401  (defines dcp::varlen_*)
from dcp_compile.compiler.graph_capture import splice_traced
from dcp_compile.compiler.passes.context import PassContext
from dcp_compile.compiler.passes.find_attention import SDPA, sdpa_argument

log = logging.getLogger(__name__)
VARLEN_ATTENTION = torch.ops.dcp.varlen_attention_fwd.default


class CannotPack(ValueError):
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


def packed_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, boundaries: torch.Tensor,
                     *, causal: bool, scale: float | None) -> torch.Tensor:
    """SDPA's ``[B, H, T, D]`` in and out; varlen attention over the ``B*T`` tokens in between."""
    def tokens(x: torch.Tensor) -> torch.Tensor:  # [B, H, T, D] -> [B*T, H, D], every row in order
        return x.transpose(1, 2).flatten(0, 1)

    out, _ = VARLEN_ATTENTION(tokens(query), tokens(key), tokens(value), boundaries, 0, causal, scale)
    return out.view_as(query.transpose(1, 2)).transpose(1, 2)


def add_sequence_boundaries_input(gm: fx.GraphModule, ctx: PassContext) -> fx.Node:
    """A ``cu_seqlens`` placeholder after the others, its length (sequences + 1) a new symbol."""
    from torch._dynamo.source import ConstantSource
    from torch.fx.experimental.symbolic_shapes import DimDynamic, StatelessSymbolicContext

    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    with gm.graph.inserting_after(placeholders[-1]):
        boundaries = gm.graph.placeholder("dcp_cu_seqlens")
    # A backed symbol (hint 3, so that 0/1 specialization stays out of the way): nothing in the
    # graph reads the count but the varlen kernel, so no guard is ever put on it.
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
    for sdpa in sites:
        lower = functools.partial(packed_attention, causal=bool(sdpa_argument(sdpa, "is_causal")),
                                  scale=sdpa_argument(sdpa, "scale"))
        splice_traced(gm, sdpa, lower, [*sdpa.args[:3], boundaries], ctx.fake_mode)
    gm.recompile()
    if ctx.variant_record is not None:
        ctx.variant_record.rewrites.append(f"{len(sites)} attention(s) -> varlen attention over packed sequences")
    log.info("dcp: %d attention site(s) run as varlen attention over packed sequences", len(sites))
    return gm

