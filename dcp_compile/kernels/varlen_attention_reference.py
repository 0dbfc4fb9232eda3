"""Plain-torch varlen attention: the CPU implementation and the math the Triton kernels follow.

One dense attention per packed sequence, computed in fp32 (or fp64 for fp64 inputs) and cast
back, in blocks of query rows (a causal block skips the keys after its last query). The backward is written out (not autograd) with the same quantities the FlashAttention-2
backward uses: ``P = exp(S - lse)``, ``delta = rowsum(dO * O)``, ``dS = P * (dP - delta)``.
"""

from __future__ import annotations

import torch

from dcp_compile.kernels.dense_ranges import dense_ranges


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _bounds(cu_seqlens: torch.Tensor) -> list[tuple[int, int]]:
    cu = cu_seqlens.tolist()
    return [(cu[i], cu[i + 1]) for i in range(len(cu) - 1)]


def _ranges(cu_seqlens: torch.Tensor, total: int) -> tuple[list[tuple[int, int]], bool]:
    """The token ranges to compute densely, and whether that is the whole row at once (the rule,
    shared with the cost model, is :func:`~dcp_compile.kernels.dense_ranges.dense_ranges`)."""
    return dense_ranges(_bounds(cu_seqlens), total)


SCORE_BLOCK = 1 << 18  # scores per query block: 1 MiB in fp32, so a block's temporaries stay in cache


def _block_rows(heads: int, keys: int) -> int:
    """Query rows per block. Scores of the whole range at once (``[heads, L, L]``) leave the CPU's
    caches past ~1K tokens and made the kernel's time grow faster than ``L^2``, which the cost
    model's ``fixed + tokens + L^2`` fit cannot follow; they were also CPU memory no model priced."""
    return max(16, SCORE_BLOCK // max(1, heads * keys))


def _sequence_ids(cu_seqlens: torch.Tensor, device: torch.device) -> torch.Tensor:
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).to(device=device, dtype=torch.long)
    return torch.repeat_interleave(torch.arange(len(lengths), device=device), lengths)


def _blocks(length: int, heads: int, causal: bool):
    """(first query, end query, end key) per block: a causal block sees no key past its last query."""
    rows = _block_rows(heads, length)
    for first in range(0, length, rows):
        end = min(length, first + rows)
        yield first, end, end if causal else length


def _block_scores(q: torch.Tensor, k: torch.Tensor, scale: float, sequence: torch.Tensor | None,
                  first: int, causal: bool) -> torch.Tensor:
    """Scaled, masked scores ``[Hq, rows, keys]`` of queries ``first..`` against keys ``0..``; k
    already expanded to the query heads. ``sequence`` (token -> sequence id) is given when the range
    is the whole packed row, so a query sees only keys of its own sequence."""
    rows, keys = q.shape[0], k.shape[0]
    s = torch.einsum("qhd,khd->hqk", q, k) * scale
    mask = None
    if sequence is not None:
        mask = sequence[first:first + rows, None] == sequence[None, :keys]
    if causal:
        past = torch.arange(first, first + rows, device=q.device)[:, None] >= torch.arange(keys, device=q.device)
        mask = past if mask is None else mask & past
    return s if mask is None else s.masked_fill(~mask, float("-inf"))


def attention_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
    causal: bool, scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out ``[T, Hq, D]``, lse ``[Hq, T]`` fp32, natural log of the scaled scores' normalizer)."""
    total, hq, _ = q.shape
    group = hq // k.shape[1]
    ct = _compute_dtype(q.dtype)
    out = torch.zeros(q.shape, dtype=ct, device=q.device)
    lse = torch.full((hq, total), float("-inf"), dtype=torch.float32, device=q.device)
    ranges, whole_row = _ranges(cu_seqlens, total)
    sequence = _sequence_ids(cu_seqlens, q.device) if whole_row else None
    for start, end in ranges:
        qs = q[start:end].to(ct)
        ks = k[start:end].to(ct).repeat_interleave(group, dim=1)
        vs = v[start:end].to(ct).repeat_interleave(group, dim=1)
        for first, last, keys in _blocks(end - start, hq, causal):
            s = _block_scores(qs[first:last], ks[:keys], scale, sequence, first, causal)
            row_lse = torch.logsumexp(s, dim=-1)  # [Hq, rows]
            p = torch.exp(s - row_lse[..., None])
            out[start + first:start + last] = torch.einsum("hqk,khd->qhd", p, vs[:keys])
            lse[:, start + first:start + last] = row_lse.to(torch.float32)
    return out.to(q.dtype), lse


def attention_backward(
    grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    out: torch.Tensor, lse: torch.Tensor, cu_seqlens: torch.Tensor,
    causal: bool, scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv); GQA: dk/dv of a KV head sum over the query heads that share it."""
    _, hq, dim = q.shape
    hkv = k.shape[1]
    group = hq // hkv
    ct = _compute_dtype(q.dtype)
    dq = torch.zeros(q.shape, dtype=ct, device=q.device)
    dk = torch.zeros(k.shape, dtype=ct, device=q.device)
    dv = torch.zeros(v.shape, dtype=ct, device=q.device)
    ranges, whole_row = _ranges(cu_seqlens, q.shape[0])
    sequence = _sequence_ids(cu_seqlens, q.device) if whole_row else None
    for start, end in ranges:
        length = end - start
        qs = q[start:end].to(ct)
        ks = k[start:end].to(ct).repeat_interleave(group, dim=1)
        vs = v[start:end].to(ct).repeat_interleave(group, dim=1)
        dos = grad_out[start:end].to(ct)
        row_lse = lse[:, start:end].to(ct)
        delta = (dos * out[start:end].to(ct)).sum(-1).transpose(0, 1)  # [Hq, L]
        dk_full = torch.zeros(length, hq, dim, dtype=ct, device=q.device)
        dv_full = torch.zeros(length, hq, dim, dtype=ct, device=q.device)
        for first, last, keys in _blocks(length, hq, causal):
            s = _block_scores(qs[first:last], ks[:keys], scale, sequence, first, causal)
            p = torch.exp(s - row_lse[:, first:last, None])
            dp = torch.einsum("qhd,khd->hqk", dos[first:last], vs[:keys])
            ds = p * (dp - delta[:, first:last, None])
            dq[start + first:start + last] = torch.einsum("hqk,khd->qhd", ds, ks[:keys]) * scale
            dk_full[:keys] += torch.einsum("hqk,qhd->khd", ds, qs[first:last])
            dv_full[:keys] += torch.einsum("hqk,qhd->khd", p, dos[first:last])
        dk[start:end] = (dk_full * scale).view(length, hkv, group, dim).sum(2)
        dv[start:end] = dv_full.view(length, hkv, group, dim).sum(2)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)
