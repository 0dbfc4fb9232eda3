"""Ring and Ulysses x ring attention: SP beyond the head count without padded heads.

Ulysses needs ``P`` to divide the query heads; otherwise it pads heads and ranks compute attention
for repeated heads (2 query heads at SP 4: twice the total work). Here the group is factored as
``P = u * r`` (:func:`dcp_compile.attention_layout.choose_attention_layout`): rank ``p`` is head
slot ``j = p % u`` of ring position ``g = p // u``.

1. An all-to-all inside each block of ``u`` consecutive ranks (a "super-chunk" of the sequence)
   gives rank ``(g, j)`` all positions of super-chunk ``g`` for heads slice ``j`` (skipped at
   ``u = 1``).
2. The ``r`` ranks with the same ``j`` pass their K/V block around a ring, ``r - 1`` steps; each
   computes its queries against every block it sees (``dcp::attention_block``, which returns
   the block's output and log-sum-exp) and the blocks are merged by their log-sum-exps (the
   online softmax, exact). Causal: a block after the queries' super-chunk is skipped, the
   diagonal block is causal, earlier blocks are full.
3. The reverse all-to-all returns the rank's chunk of every head.

Sub-group collectives are written as all-to-alls over the whole SP group with zero-sized splits
to the ranks outside the sub-group, so no new process groups are needed (groups are created once,
in the same order on every rank); their autograd adjoints are the reverse all-to-alls, so the
backward is exact too (the K/V gradients travel back around the ring). The backward keeps every
K/V block the forward received (a ring backward that re-passes K/V to save memory is not done).

Masks and additive biases are cut to each block (a bias's gradient is exact). Not taken (today's
padded Ulysses runs instead, with the reason on the variant record): dropout, cross-attention
(keys from a full context), joint and replicated-query attention, hand-written attention regions,
packed micro-batches (``use_varlen_attention`` needs each rank's heads whole). ``DCP_RING_ATTENTION=0`` turns the path off.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any, Optional

import torch

from dcp_compile.attention_layout import AttentionLayout, choose_attention_layout
from dcp_compile.compiler import collectives
from dcp_compile.compiler.sequence_chunks import chunk_lengths

# Score elements (batch x heads x queries x keys) this process computed in ``dcp::attention_block``:
# what the tests and the benchmark read to check a rank's share of the attention work.
WORK_COUNTER = {"score_elements": 0, "blocks": 0}


@dataclass(frozen=True)
class AttentionPlan:
    """The layout one attention site runs under, and why padded Ulysses runs when it does."""

    layout: AttentionLayout
    query_heads: int
    key_heads: int
    padded_because: str | None = None  # set when the ring would help but cannot run here

    @property
    def uses_ring(self) -> bool:
        return self.layout.ring > 1 and self.padded_because is None

    def describe(self) -> str:
        heads = f"{self.query_heads} query / {self.key_heads} KV heads at SP {self.layout.sp_size}"
        if self.uses_ring:
            return f"{self.layout.describe()} ({heads}, no padded heads)"
        sp_size = self.layout.sp_size
        padded = math.ceil(self.query_heads / sp_size) * sp_size - self.query_heads
        text = f"Ulysses x{sp_size} ({heads}" + (f", {padded} padded head slot(s))" if padded else ")")
        return text + (f": ring not used: {self.padded_because}" if self.padded_because else "")

    @property
    def padded_head_slots(self) -> int:
        if self.uses_ring:
            return 0
        sp_size = self.layout.sp_size
        return math.ceil(self.query_heads / sp_size) * sp_size - self.query_heads


def ring_enabled() -> bool:
    return os.environ.get("DCP_RING_ATTENTION", "1").strip().lower() not in ("0", "false", "off", "no")


def plan_attention(query_heads: int, key_heads: int, sp_size: int, *, self_attention: bool = True,
                   dropout_p: float = 0.0, joint: bool = False,
                   query_replicated: bool = False, packed: bool = False) -> AttentionPlan:
    """Ulysses when ``sp_size`` divides the query heads, else ring/hybrid where it applies."""
    layout = choose_attention_layout(query_heads, key_heads, sp_size)
    if layout.ring == 1:
        return AttentionPlan(layout, query_heads, key_heads)
    why = None
    if not ring_enabled():
        why = "DCP_RING_ATTENTION=0"
    elif packed:
        why = "a packed micro-batch (varlen attention over whole heads)"
    elif query_replicated:
        why = "replicated queries over sharded keys/values"
    elif joint:
        why = "joint attention (replicated text around the chunk)"
    elif not self_attention:
        why = "cross-attention (keys/values from a full context)"
    elif dropout_p:
        why = "attention dropout"
    elif query_heads % key_heads:
        why = f"{query_heads} query heads do not group over {key_heads} KV heads"
    return AttentionPlan(layout, query_heads, key_heads, why)


# --- one block: queries against one K/V block, with its log-sum-exp -------------------------

def _scores(query: torch.Tensor, key: torch.Tensor, bias: Optional[torch.Tensor], scale: float,
            causal: bool) -> torch.Tensor:
    group = query.shape[1] // key.shape[1]
    key = key.float().repeat_interleave(group, 1) if group > 1 else key.float()
    scores = query.float() @ key.transpose(-2, -1) * scale
    if bias is not None:
        scores = scores.masked_fill(~bias, float("-inf")) if bias.dtype == torch.bool else scores + bias.float()
    if causal:  # top-left aligned, as SDPA's is_causal: the diagonal block of a super-chunk
        above = torch.ones(scores.shape[-2], scores.shape[-1], dtype=torch.bool, device=scores.device).triu(1)
        scores = scores.masked_fill(above, float("-inf"))
    return scores


def _probabilities(scores: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """``exp(scores - lse)``; rows with no visible key (lse = -inf) are 0, not NaN."""
    finite = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    return torch.exp(scores - finite.unsqueeze(-1))


def _expand(value: torch.Tensor, group: int) -> torch.Tensor:
    return value.float().repeat_interleave(group, 1) if group > 1 else value.float()


def _fold(grad: torch.Tensor, group: int) -> torch.Tensor:
    """Sum the gradient of repeated KV heads back onto each KV head."""
    if group == 1:
        return grad
    batch, heads, length, dim = grad.shape
    return grad.reshape(batch, heads // group, group, length, dim).sum(2)


@torch.library.custom_op("dcp::attention_block", mutates_args=())
def attention_block(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, bias: Optional[torch.Tensor],
                    scale: float, causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``softmax(q k^T * scale + bias) @ v`` of one K/V block in fp32, and the rows' log-sum-exp
    (``-inf`` where a row sees no key of this block)."""
    scores = _scores(query, key, bias, scale, causal)
    lse = torch.logsumexp(scores, -1)
    out = (_probabilities(scores, lse) @ _expand(value, query.shape[1] // key.shape[1])).contiguous()
    WORK_COUNTER["score_elements"] += scores.numel()
    WORK_COUNTER["blocks"] += 1
    return out, lse.contiguous()


@attention_block.register_fake
def _(query, key, value, bias, scale, causal):
    out = query.new_empty((*query.shape[:-1], value.shape[-1]), dtype=torch.float32)
    return out, query.new_empty(query.shape[:-1], dtype=torch.float32)


@torch.library.custom_op("dcp::attention_block_backward", mutates_args=())
def attention_block_backward(grad_out: torch.Tensor, grad_lse: torch.Tensor, query: torch.Tensor, key: torch.Tensor,
                             value: torch.Tensor, bias: Optional[torch.Tensor], out: torch.Tensor, lse: torch.Tensor,
                             scale: float, causal: bool, bias_grad: bool
                             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The exact adjoint of :func:`attention_block` (scores recomputed from q, k); the bias's
    gradient (summed over the dimensions it broadcasts over) when ``bias_grad``, else empty."""
    group = query.shape[1] // key.shape[1]
    probabilities = _probabilities(_scores(query, key, bias, scale, causal), lse)
    values = _expand(value, group)
    grad_value = probabilities.transpose(-2, -1) @ grad_out
    grad_probabilities = grad_out @ values.transpose(-2, -1)
    delta = (grad_out * out).sum(-1, keepdim=True)
    grad_scores = probabilities * (grad_probabilities - delta + grad_lse.unsqueeze(-1))
    grad_query = grad_scores @ _expand(key, group) * scale
    grad_key = grad_scores.transpose(-2, -1) @ query.float() * scale
    grad_bias = _reduce_to(grad_scores, bias.shape).to(bias.dtype) if bias_grad and bias is not None \
        else grad_scores.new_empty(0)
    return (grad_query.to(query.dtype).contiguous(), _fold(grad_key, group).to(key.dtype).contiguous(),
            _fold(grad_value, group).to(value.dtype).contiguous(), grad_bias.contiguous())


@attention_block_backward.register_fake
def _(grad_out, grad_lse, query, key, value, bias, out, lse, scale, causal, bias_grad):
    # Contiguous, as the implementation returns them: the compiled backward's views follow these strides.
    grad_bias = bias.new_empty(bias.shape) if bias_grad and bias is not None else grad_out.new_empty(0)
    return query.new_empty(query.shape), key.new_empty(key.shape), value.new_empty(value.shape), grad_bias


def _reduce_to(grad: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """Sum a ``[B, H, Lq, Lk]`` gradient over the dimensions a broadcast bias of ``shape`` repeats."""
    while grad.dim() > len(shape):
        grad = grad.sum(0)
    for dim, size in enumerate(shape):
        if size == 1 and grad.shape[dim] != 1:
            grad = grad.sum(dim, keepdim=True)
    return grad


def _block_setup(ctx, inputs, output):
    query, key, value, bias, scale, causal = inputs
    ctx.save_for_backward(query, key, value, bias, *output)
    ctx.scale, ctx.causal = scale, causal
    ctx.bias_grad = bias is not None and bias.is_floating_point()


def _block_backward(ctx, grad_out, grad_lse):
    query, key, value, bias, out, lse = ctx.saved_tensors
    grad_out = torch.zeros_like(out) if grad_out is None else grad_out
    grad_lse = torch.zeros_like(lse) if grad_lse is None else grad_lse
    bias_grad = ctx.bias_grad and ctx.needs_input_grad[3]
    grad_query, grad_key, grad_value, grad_bias = torch.ops.dcp.attention_block_backward(
        grad_out, grad_lse, query, key, value, bias, out, lse, ctx.scale, ctx.causal, bias_grad)
    return grad_query, grad_key, grad_value, grad_bias if bias_grad else None, None, None


attention_block.register_autograd(_block_backward, setup_context=_block_setup)


@torch.library.custom_op("dcp::depend", mutates_args=())
def depend(tensor: torch.Tensor, others: list[torch.Tensor]) -> torch.Tensor:
    """``tensor``, made to depend on ``others``: a collective whose result a rank does not use
    (a K/V block a causal rank skips) would be dead code on that rank and not on the others,
    and a collective issued by only some ranks hangs. The gradient of ``others`` is zero."""
    return tensor.clone(memory_format=torch.contiguous_format)


@depend.register_fake
def _(tensor, others):
    return torch.empty_like(tensor, memory_format=torch.contiguous_format)


def _depend_backward(ctx, grad):
    return grad, [grad.new_zeros(shape, dtype=dtype) for shape, dtype in ctx.shapes]


def _depend_setup(ctx, inputs, output):
    ctx.shapes = [(other.shape, other.dtype) for other in inputs[1]]


depend.register_autograd(_depend_backward, setup_context=_depend_setup)


def merge_blocks(outs: list[torch.Tensor], lses: list[torch.Tensor]) -> torch.Tensor:
    """Online-softmax merge: ``sum_i exp(lse_i - lse) * out_i``. The shift is a detached finite
    row maximum (it cancels), so rows where a block saw no key give weight 0 and no NaN. The shift
    is computed from detached log-sum-exps: autograd records none of it, so it saves nothing (run
    eagerly between regions, a ``where`` on the attached values saved its mask for nothing)."""
    top = lses[0].detach()
    for lse in lses[1:]:
        top = torch.maximum(top, lse.detach())
    top = torch.where(torch.isinf(top), torch.zeros_like(top), top)
    weights = [torch.exp(lse - top).unsqueeze(-1) for lse in lses]
    total = weights[0]
    merged = weights[0] * outs[0]
    for weight, out in zip(weights[1:], outs[1:]):
        total = total + weight
        merged = merged + weight * out
    return merged / total


# --- collectives inside sub-groups, as whole-group all-to-alls --------------------------------

def _sub_group_splits(sp_size: int, members: list[int], sizes: dict[int, Any]) -> list[Any]:
    return [sizes[rank] if rank in members else 0 for rank in range(sp_size)]


def _sequence_to_heads(chunk: torch.Tensor, layout: AttentionLayout, lengths: list, rank: int,
                       group: str) -> torch.Tensor:
    """``[B, H, S_p, D]`` → ``[B, H/u, S_g, D]``: super-chunk ``g``'s positions of head slice ``j``."""
    u = layout.ulysses
    if u == 1:
        return chunk
    batch, heads, local, dim = chunk.shape
    members = list(range((rank // u) * u, (rank // u) * u + u))
    send = chunk.reshape(batch, u, heads // u, local, dim).permute(1, 3, 0, 2, 4).reshape(u * local, batch, heads // u, dim)
    received = collectives.all_to_all(send, _sub_group_splits(len(lengths), members, {m: lengths[m] for m in members}),
                                      _sub_group_splits(len(lengths), members, {m: local for m in members}), group)
    return received.permute(1, 2, 0, 3)


def _heads_to_sequence(heads: torch.Tensor, layout: AttentionLayout, lengths: list, rank: int,
                       group: str) -> torch.Tensor:
    """``[B, H/u, S_g, D]`` → ``[B, H, S_p, D]``: the inverse of :func:`_sequence_to_heads`."""
    u = layout.ulysses
    if u == 1:
        return heads
    batch, per_slot, _, dim = heads.shape
    local = lengths[rank]
    members = list(range((rank // u) * u, (rank // u) * u + u))
    send = heads.permute(2, 0, 1, 3)
    received = collectives.all_to_all(send, _sub_group_splits(len(lengths), members, {m: local for m in members}),
                                      _sub_group_splits(len(lengths), members, {m: lengths[m] for m in members}), group)
    out = received.view(u, local, batch, per_slot, dim).permute(2, 0, 3, 1, 4)
    return out.reshape(batch, u * per_slot, local, dim)


def _pass_on(block: torch.Tensor, layout: AttentionLayout, rank: int, send_length: Any, receive_length: Any,
             group: str) -> torch.Tensor:
    """One ring step: ``[B, h, L, D]`` to the next ring position, the previous one's in return."""
    u, r = layout.ulysses, layout.ring
    position, slot = divmod(rank, u)
    target, source = ((position + 1) % r) * u + slot, ((position - 1) % r) * u + slot
    sp_size = layout.sp_size
    send = block.permute(2, 0, 1, 3)
    received = collectives.all_to_all(send, _sub_group_splits(sp_size, [source], {source: receive_length}),
                                      _sub_group_splits(sp_size, [target], {target: send_length}), group)
    return received.permute(1, 2, 0, 3)


def _mask_block(mask: Optional[torch.Tensor], heads: tuple[int, int], rows: tuple[Any, Any],
                columns: tuple[Any, Any]) -> Optional[torch.Tensor]:
    """The full mask's entries for this rank's heads, query rows and key columns (dimensions a
    mask broadcasts over, of static size 1, are kept)."""
    if mask is None:
        return None

    def cut(tensor: torch.Tensor, dim: int, span: tuple[Any, Any]) -> torch.Tensor:
        size = tensor.shape[dim]
        if isinstance(size, int) and size == 1:
            return tensor
        return tensor.narrow(dim, span[0], span[1])

    if mask.dim() >= 3:
        mask = cut(mask, mask.dim() - 3, heads)
    return cut(cut(mask, mask.dim() - 2, rows), mask.dim() - 1, columns)


def ring_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: Optional[torch.Tensor],
                   is_causal: bool, scale: Optional[float], full_length: Any, layout: AttentionLayout, *,
                   rank: int, group: str) -> torch.Tensor:
    """Attention of ``[B, H, S_p, D]`` chunks under ``layout`` (ring x Ulysses), output ``[B, H, S_p, Dv]``."""
    u, r = layout.ulysses, layout.ring
    lengths = chunk_lengths(full_length, layout.sp_size)
    super_lengths = [sum(lengths[c * u:(c + 1) * u]) for c in range(r)]
    super_starts = [sum(super_lengths[:c]) for c in range(r)]
    position, slot = divmod(rank, u)
    scale = scale if scale is not None else 1.0 / math.sqrt(query.shape[-1])
    query_heads = _sequence_to_heads(query, layout, lengths, rank, group)
    key_block = _sequence_to_heads(key, layout, lengths, rank, group)
    value_block = _sequence_to_heads(value, layout, lengths, rank, group)
    per_slot = query.shape[1] // u
    head_span = (slot * per_slot, per_slot)
    rows = (super_starts[position], super_lengths[position])
    key_dim = key_block.shape[-1]
    outs, lses, skipped = [], [], []
    for step in range(r):
        held = (position - step) % r  # the super-chunk whose K/V this rank holds now
        if step:
            both = _pass_on(torch.cat([key_block, value_block], -1), layout, rank,
                            super_lengths[(held + 1) % r], super_lengths[held], group)
            key_block, value_block = both[..., :key_dim], both[..., key_dim:]
        if is_causal and held > position:
            skipped.append(both)  # every key comes after every query here: passed on, not used
            continue
        mask = _mask_block(attn_mask, head_span, rows, (super_starts[held], super_lengths[held]))
        out, lse = torch.ops.dcp.attention_block(query_heads, key_block, value_block, mask, scale,
                                                 bool(is_causal and held == position))
        outs.append(out)
        lses.append(lse)
    merged = merge_blocks(outs, lses).to(query.dtype)
    if skipped:  # every rank must issue every ring step, forward and backward: keep them live
        merged = torch.ops.dcp.depend(merged, skipped)
    return _heads_to_sequence(merged, layout, lengths, rank, group)
