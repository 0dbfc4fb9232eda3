"""Ulysses' layouts: a sequence chunk of every head, or every position of some heads.

Before the forward all-to-all every rank holds ``[B, H, S_r, D]`` (its chunk of the sequence, all
heads); after it ``[B, Hp, S, D]``: every position of the heads ``[r*Hp, (r+1)*Hp)``, so attention
runs unchanged; the output goes back the same way. Heads that do not divide by P are padded to
``P * ceil(H/P)`` by repeating a real head (the padded outputs are dropped, so their gradient is
zero); GQA with KV heads that do not split evenly replicates the KV heads each rank needs. Sequence
chunks may be uneven (and empty): the split sizes of the all-to-alls are the symbolic chunk lengths.

When P does not divide the query heads, an SDPA site runs as ring or Ulysses x ring attention
instead of padding (:mod:`dcp_compile.compiler.ring_attention`); hand-written regions, joint and
replicated-query attention still pad.

Used by ``insert_all_to_all`` (SDPA sites) and ``shard_sequence`` (hand-written attention regions).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from dcp_compile.compiler import collectives, ring_attention
from dcp_compile.compiler.sequence_chunks import chunk_lengths


@dataclass(frozen=True)
class HeadLayout:
    """Which source head fills each of the ``sp_size * per_rank`` head slots."""

    num_heads: int  # heads of the operand as given
    per_rank: int
    source_heads: tuple[int, ...]  # length sp_size * per_rank

    @property
    def is_identity(self) -> bool:
        return self.source_heads == tuple(range(self.num_heads))

    def of_rank(self, rank: int) -> tuple[int, ...]:
        return self.source_heads[rank * self.per_rank : (rank + 1) * self.per_rank]


def plan_heads(query_heads: int, key_heads: int, sp_size: int, enable_gqa: bool) -> tuple[HeadLayout, HeadLayout, bool]:
    """Head layouts for queries and keys/values, and whether SDPA still sees grouped heads."""
    per_rank = math.ceil(query_heads / sp_size)
    slots = per_rank * sp_size

    def padded(heads: list[int]) -> tuple[int, ...]:
        return tuple(heads + [heads[0]] * (slots - len(heads)))

    query = HeadLayout(query_heads, per_rank, padded(list(range(query_heads))))
    if key_heads == query_heads or not enable_gqa:
        return query, HeadLayout(key_heads, per_rank, padded(list(range(key_heads)))), enable_gqa
    if query_heads % sp_size == 0 and key_heads % sp_size == 0:
        kv_per_rank = key_heads // sp_size
        return query, HeadLayout(key_heads, kv_per_rank, tuple(range(key_heads))), True
    group = query_heads // key_heads
    expanded = [head // group for head in range(query_heads)]
    return query, HeadLayout(key_heads, per_rank, padded(expanded)), False


def select_heads(tensor: torch.Tensor, heads: tuple[int, ...], identity: bool) -> torch.Tensor:
    if identity:
        return tensor
    index = torch.tensor(heads, dtype=torch.long, device=tensor.device)
    return tensor.index_select(1, index)


def use_layout_kernels(tensor: torch.Tensor) -> bool:
    """The fused Triton layout kernels on CUDA (or when ``DCP_KERNELS=triton`` forces them)."""
    from dcp_compile.kernels import kernel_backend

    return kernel_backend(tensor) == "triton"


def sequence_to_heads(chunk: torch.Tensor, layout: HeadLayout, lengths: list, group: str) -> torch.Tensor:
    """``[B, H, S_r, D]`` chunk → ``[B, Hp, S, D]``: all positions of this rank's heads."""
    batch, _, local, dim = chunk.shape
    sp_size = len(lengths)
    if use_layout_kernels(chunk):
        from dcp_compile.kernels import pack_for_heads

        index = None if layout.is_identity else torch.tensor(layout.source_heads, dtype=torch.long, device=chunk.device)
        send = pack_for_heads(chunk, sp_size, layout.per_rank, index)  # one pass into the send buffer
    else:
        chunk = select_heads(chunk, layout.source_heads, layout.is_identity)
        send = chunk.reshape(batch, sp_size, layout.per_rank, local, dim).permute(1, 3, 0, 2, 4)
    send = send.reshape(sp_size * local, batch, layout.per_rank, dim)
    received = collectives.all_to_all(send, lengths, [local] * sp_size, group)
    return received.permute(1, 2, 0, 3)


def heads_to_sequence(heads: torch.Tensor, num_heads: int, local: Any, lengths: list, group: str) -> torch.Tensor:
    """``[B, Hp, S, D]`` → ``[B, H, S_r, D]``: this rank's chunk of every head."""
    batch, per_rank, _, dim = heads.shape
    sp_size = len(lengths)
    if use_layout_kernels(heads):
        from dcp_compile.kernels import pack_for_sequence, unpack_from_heads

        received = collectives.all_to_all(pack_for_sequence(heads), [local] * sp_size, lengths, group)
        return unpack_from_heads(received.view(sp_size, local, batch, per_rank, dim), num_heads)
    send = heads.permute(2, 0, 1, 3)
    received = collectives.all_to_all(send, [local] * sp_size, lengths, group)
    # [B, S_r, H, D] in memory, seen as [B, H, S_r, D]: the layout flash attention gives its output
    # (on CPU and CUDA), so that what follows attention sees the same strides at every SP size
    # (regional compilation shares its compiled code across them), and the usual
    # ``out.transpose(1, 2).contiguous()`` after attention copies nothing. One copy, as before.
    out = received.view(sp_size, local, batch, per_rank, dim).permute(2, 1, 0, 3, 4)
    out = out.reshape(batch, local, sp_size * per_rank, dim).transpose(1, 2)
    return out if out.shape[1] == num_heads else out[:, :num_heads]


def heads_of_rank(mask: torch.Tensor | None, layout: HeadLayout, rank: int, head_dim: int) -> torch.Tensor | None:
    """The mask rows of this rank's heads (a mask broadcast over heads is kept as it is)."""
    if mask is None or mask.dim() < 3:
        return mask
    if mask.shape[head_dim] == 1:
        return mask
    index = torch.tensor(layout.of_rank(rank), dtype=torch.long, device=mask.device)
    return mask.index_select(head_dim, index)


def gather_heads(heads: torch.Tensor, num_heads: int, sp_size: int, group: str) -> torch.Tensor:
    """``[B, Hp, S, D]`` of this rank's heads → ``[B, H, S, D]``: every head, on every rank (the
    replicated text segment of a joint attention's output). The adjoint is the reduce-scatter."""
    gathered = collectives.gather_sequence(heads, 1, sp_size * heads.shape[1], sp_size, group)
    return gathered if gathered.shape[1] == num_heads else gathered[:, :num_heads]


def _segments(tensor: torch.Tensor, before: Any, after: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``[leading | chunk | trailing]`` along dim 2.

    When the joint length holds an unbacked size (text selected with ``nonzero``: Mochi), the
    segments are gathered by position instead of sliced, for two Inductor/AOTAutograd limits
    (torch <= 2.13) that a slice meets and an index does not:

    - the chunk sliced from ``[chunk | u text]`` has the head stride ``(S_r + u) * D``; Inductor
      lowered the all-to-all's view of it asking whether that equals ``S_r * D``
      (``Ne(8*u8 + 424, 424)``): it reasons size-obliviously only when *sizes* hold an unbacked
      symbol, so it raised ``GuardOnDataDependentSymNode``;
    - a slice must prove its bounds, and on the last rank, whose chunk is ``S - (S + 1) // 2``,
      ``0 <= S - (S + 1) // 2 + u`` does not follow from value ranges once the hint-free ``u`` is
      in it: AOTAutograd's re-trace gave the slice a new unbacked size that attention guarded on,
      and Inductor's slice lowering raised ``GuardOnDataDependentSymNode``.

    The gathered chunk is contiguous; the copy is one the all-to-all makes anyway (its send buffer
    is a permuted copy), as ``select_heads`` copies the replicated segments."""
    from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

    total = tensor.shape[2]
    local = total - before - after
    if not free_unbacked_symbols(total):
        return tensor.narrow(2, 0, before), tensor.narrow(2, before, local), tensor.narrow(2, before + local, after)

    def positions(start: Any, stop: Any) -> torch.Tensor:
        return tensor.index_select(2, torch.arange(start, stop, device=tensor.device))

    return positions(0, before), positions(before, before + local), positions(before + local, total)


def _present(segment: Any) -> bool:
    """A replicated segment that may hold tokens (a static 0 needs no select and no gather)."""
    return not (isinstance(segment, int) and segment == 0)


def plan_site(query, key, dropout_p, key_is_chunk, value_is_chunk, query_joint, key_joint, query_replicated,
              sp_size: int, packed: bool = False) -> ring_attention.AttentionPlan:
    """The layout one ``dcp::sharded_attention`` site runs under (4-D operands, heads at dim 1)."""
    return ring_attention.plan_attention(
        query.shape[1], key.shape[1], sp_size, self_attention=bool(key_is_chunk and value_is_chunk),
        dropout_p=float(dropout_p), joint=bool(query_joint or key_joint), query_replicated=bool(query_replicated),
        packed=packed)


def ulysses_attention(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, full_length,
                      key_is_chunk, value_is_chunk, query_joint=False, key_joint=False, before=0, after=0,
                      query_replicated=False, *, sp_size: int, rank: int, group: str,
                      packed: bool = False) -> torch.Tensor:
    """Ulysses around one attention. A joint sequence (``[text | image chunk | text]`` on every
    rank) sends only the image chunk through the all-to-all; the replicated text segments are
    cut to the rank's heads locally and, after attention, gathered back to every head. Replicated
    queries of another stream (``query_replicated``) are handled the same way as a whole."""
    three_dim = query.dim() == 3
    if three_dim:  # [N, S, D] hand-written attention: treat N as the head dimension
        query, key, value = query.unsqueeze(0), key.unsqueeze(0), value.unsqueeze(0)
        if attn_mask is not None and attn_mask.dim() == 3:
            attn_mask = attn_mask.unsqueeze(0)
    if query.dim() != 4:
        raise NotImplementedError(f"dcp: attention on {query.dim()}-D queries")
    plan = plan_site(query, key, dropout_p, key_is_chunk, value_is_chunk, query_joint, key_joint, query_replicated,
                     sp_size, packed)
    if plan.uses_ring:  # P does not divide the heads: ring (x Ulysses) instead of padded heads
        out = ring_attention.ring_attention(query, key, value, attn_mask, is_causal, scale, full_length, plan.layout,
                                            rank=rank, group=group)
        return out.squeeze(0) if three_dim else out
    lengths = chunk_lengths(full_length, sp_size)
    local = query.shape[2]
    query_layout, kv_layout, gqa = plan_heads(query.shape[1], key.shape[1], sp_size, enable_gqa)

    def joint_to_heads(tensor: torch.Tensor, layout: HeadLayout) -> torch.Tensor:
        leading, chunk, trailing = _segments(tensor, before, after)
        heads = layout.of_rank(rank)
        parts = [select_heads(leading, heads, False)] if _present(before) else []
        parts.append(sequence_to_heads(chunk, layout, lengths, group))
        if _present(after):
            parts.append(select_heads(trailing, heads, False))
        return torch.cat(parts, 2)

    def to_heads(tensor: torch.Tensor, is_chunk: bool) -> torch.Tensor:
        if is_chunk:
            return joint_to_heads(tensor, kv_layout) if key_joint else sequence_to_heads(tensor, kv_layout, lengths, group)
        return select_heads(tensor, kv_layout.of_rank(rank), False)

    if query_replicated:
        query_heads = select_heads(query, query_layout.of_rank(rank), False)
    elif query_joint:
        local = query.shape[2] - before - after
        query_heads = joint_to_heads(query, query_layout)
    else:
        query_heads = sequence_to_heads(query, query_layout, lengths, group)
    key_heads, value_heads = to_heads(key, key_is_chunk), to_heads(value, value_is_chunk)
    mask = heads_of_rank(attn_mask, query_layout, rank, attn_mask.dim() - 3) if attn_mask is not None else None
    out = F.scaled_dot_product_attention(
        query_heads, key_heads, value_heads, attn_mask=mask, dropout_p=dropout_p,
        is_causal=is_causal, scale=scale, enable_gqa=gqa,
    )
    if query_replicated:
        out = gather_heads(out, query.shape[1], sp_size, group)
    elif query_joint:
        leading, chunk, trailing = out.narrow(2, 0, before), out.narrow(2, before, full_length), \
            out.narrow(2, before + full_length, after)
        parts = [gather_heads(leading, query.shape[1], sp_size, group)] if _present(before) else []
        parts.append(heads_to_sequence(chunk, query.shape[1], local, lengths, group))
        if _present(after):
            parts.append(gather_heads(trailing, query.shape[1], sp_size, group))
        out = torch.cat(parts, 2)
    else:
        out = heads_to_sequence(out, query.shape[1], local, lengths, group)
    return out.squeeze(0) if three_dim else out


