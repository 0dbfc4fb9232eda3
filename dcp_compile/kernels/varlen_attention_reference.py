"""Plain-torch varlen attention: the CPU implementation and the math the Triton kernels follow.

One dense attention per packed sequence, computed in fp32 (or fp64 for fp64 inputs) and cast
back. The backward is written out (not autograd) with the same quantities the FlashAttention-2
backward uses: ``P = exp(S - lse)``, ``delta = rowsum(dO * O)``, ``dS = P * (dP - delta)``.
"""

from __future__ import annotations

import torch

from dcp_compile.kernels.dense_ranges import dense_ranges


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _scores(q: torch.Tensor, k: torch.Tensor, scale: float, allowed: torch.Tensor | None) -> torch.Tensor:
    """Scaled scores ``[Hq, L, L]`` for one range; k already expanded to the query heads."""
    s = torch.einsum("qhd,khd->hqk", q, k) * scale
    return s if allowed is None else s.masked_fill(~allowed, float("-inf"))


def _bounds(cu_seqlens: torch.Tensor) -> list[tuple[int, int]]:
    cu = cu_seqlens.tolist()
    return [(cu[i], cu[i + 1]) for i in range(len(cu) - 1)]


def _ranges(cu_seqlens: torch.Tensor, total: int) -> tuple[list[tuple[int, int]], bool]:
    """The token ranges to compute densely, and whether that is the whole row at once (the rule,
    shared with the cost model, is :func:`~dcp_compile.kernels.dense_ranges.dense_ranges`)."""
    return dense_ranges(_bounds(cu_seqlens), total)


def _allowed(cu_seqlens: torch.Tensor | None, length: int, causal: bool, device: torch.device) -> torch.Tensor | None:
    """``[L, L]``: which keys each query may see; ``cu_seqlens`` given when the range is the whole
    packed row (then only keys of the query's own sequence)."""
    mask = None
    if cu_seqlens is not None:
        lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).to(device=device, dtype=torch.long)
        sequence = torch.repeat_interleave(torch.arange(len(lengths), device=device), lengths)
        mask = sequence[:, None] == sequence[None, :]
    if causal:
        past = torch.ones(length, length, dtype=torch.bool, device=device).tril()
        mask = past if mask is None else mask & past
    return mask


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
    for start, end in ranges:
        qs = q[start:end].to(ct)
        ks = k[start:end].to(ct).repeat_interleave(group, dim=1)
        vs = v[start:end].to(ct).repeat_interleave(group, dim=1)
        s = _scores(qs, ks, scale, _allowed(cu_seqlens if whole_row else None, end - start, causal, q.device))
        row_lse = torch.logsumexp(s, dim=-1)  # [Hq, L]
        p = torch.exp(s - row_lse[..., None])
        out[start:end] = torch.einsum("hqk,khd->qhd", p, vs)
        lse[:, start:end] = row_lse.to(torch.float32)
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
    for start, end in ranges:
        length = end - start
        qs = q[start:end].to(ct)
        ks = k[start:end].to(ct).repeat_interleave(group, dim=1)
        vs = v[start:end].to(ct).repeat_interleave(group, dim=1)
        dos = grad_out[start:end].to(ct)
        allowed = _allowed(cu_seqlens if whole_row else None, length, causal, q.device)
        p = torch.exp(_scores(qs, ks, scale, allowed) - lse[:, start:end].to(ct)[..., None])
        delta = (dos * out[start:end].to(ct)).sum(-1).transpose(0, 1)  # [Hq, L]
        dp = torch.einsum("qhd,khd->hqk", dos, vs)
        ds = p * (dp - delta[..., None])
        dq[start:end] = torch.einsum("hqk,khd->qhd", ds, ks) * scale
        dk_full = torch.einsum("hqk,qhd->khd", ds, qs) * scale
        dv_full = torch.einsum("hqk,qhd->khd", p, dos)
        dk[start:end] = dk_full.view(length, hkv, group, dim).sum(2)
        dv[start:end] = dv_full.view(length, hkv, group, dim).sum(2)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)
