"""Triton kernels for padding-free (varlen) flash attention (loaded through :mod:`.triton_loader`).

Layout: ``q [T, Hq, D]``, ``k, v [T, Hkv, D]`` with the sequences of a micro-batch packed one after
another along ``T`` and delimited by ``cu_seqlens`` (int32 or int64, ``[N + 1]``). Self-attention
only: queries and keys share ``cu_seqlens``; a causal mask is aligned at each sequence start.

The algorithm is FlashAttention-2's: the forward streams key blocks past a resident query block
with an online softmax (running max ``m`` and denominator ``l``, base-2 exponentials with the
scale folded into ``log2(e)``) and saves the per-row logsumexp; the backward recomputes the
probabilities from it. Grid axis 2 is the sequence, so a program never sees a token of another
sequence and there is no padding work beyond the last partial block of each sequence.

Backward, three launches:
  1. ``delta = rowsum(dO * O)`` per query row and head;
  2. ``dK, dV``: one program per (key block, KV head, sequence) loops over the ``Hq / Hkv`` query
     heads sharing that KV head, so GQA gradients are summed in registers, with no atomics and a
     deterministic result;
  3. ``dQ``: one program per (query block, query head, sequence).

Only Triton builtins are called (``tl.full`` and ``tl.reduce`` rather than the ``@jit``-defined
``tl.zeros``/``tl.max``/``tl.sum``): library ``@jit`` functions are built in the mode
``TRITON_INTERPRET`` had when ``triton.language`` was first imported, and cannot be called from
kernels that the loader builds in the other mode.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .triton_loader import use_interpreter

_LOG2E = 1.4426950408889634


@triton.jit
def _max_combine(a, b):
    return tl.maximum(a, b)


@triton.jit
def _add_combine(a, b):
    return a + b


# The interpreter evaluates ``tl.reduce`` with numpy only for triton's own combine functions,
# recognized by identity; any other combine function is applied element by element in Python
# (~100x slower). Triton's are never *called* by the interpreter, so using them is safe in both
# modes; ours are the fallback should a triton release rename them.
_MAX = getattr(tl.standard, "_elementwise_max", None) or _max_combine
_ADD = getattr(tl.standard, "_sum_combine", None) or _add_combine


@triton.jit
def _mm(a, b, IEEE: tl.constexpr):
    # fp32 inputs: full-precision products (parity with the fp32 reference); fp16/bf16: tensor cores.
    if IEEE:
        return tl.dot(a, b, input_precision="ieee")
    else:
        return tl.dot(a, b)


@triton.jit
def _fwd_kernel(
    Q, K, V, O, LSE, CU,
    qk_scale,  # softmax scale * log2(e)
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh, stride_lh,
    D, GROUP,
    CAUSAL: tl.constexpr, IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, EVEN_D: tl.constexpr,
):
    pid_m = tl.program_id(0)
    hq = tl.program_id(1)
    seq = tl.program_id(2)
    start = tl.load(CU + seq).to(tl.int64)
    length = (tl.load(CU + seq + 1).to(tl.int64) - start).to(tl.int32)
    m0 = pid_m * BLOCK_M
    if m0 >= length:
        return
    hk = hq // GROUP

    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    row_ok = offs_m < length
    if EVEN_D:
        d_ok = offs_d < BLOCK_D  # constant-folds: no feature-dim masking
    else:
        d_ok = offs_d < D

    q_ptrs = Q + (start + offs_m[:, None]) * stride_qt + hq * stride_qh + offs_d[None, :]
    q = tl.load(q_ptrs, mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    k_base = K + start * stride_kt + hk * stride_kh
    v_base = V + start * stride_vt + hk * stride_vh

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.full([BLOCK_M], 0.0, dtype=tl.float32)
    acc = tl.full([BLOCK_M, BLOCK_D], 0.0, dtype=tl.float32)

    hi = length
    if CAUSAL:
        hi = tl.minimum(length, m0 + BLOCK_M)
    for n0 in range(0, hi, BLOCK_N):
        cols = n0 + offs_n
        col_ok = cols < length
        kt = tl.load(k_base + cols[None, :] * stride_kt + offs_d[:, None],
                     mask=col_ok[None, :] & d_ok[:, None], other=0.0)
        s = _mm(q, kt, IEEE) * qk_scale
        keep = col_ok[None, :]
        if CAUSAL:
            keep = keep & (cols[None, :] <= offs_m[:, None])
        s = tl.where(keep, s, float("-inf"))
        # Every row has a live column in the first block (column 0), so m_new is finite.
        m_new = tl.maximum(m_i, tl.reduce(s, 1, _MAX))
        p = tl.math.exp2(s - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.reduce(p, 1, _ADD)
        v = tl.load(v_base + cols[:, None] * stride_vt + offs_d[None, :],
                    mask=col_ok[:, None] & d_ok[None, :], other=0.0)
        acc = acc * alpha[:, None] + _mm(p.to(v.dtype), v, IEEE)
        m_i = m_new

    acc = acc / l_i[:, None]
    o_ptrs = O + (start + offs_m[:, None]) * stride_ot + hq * stride_oh + offs_d[None, :]
    tl.store(o_ptrs, acc.to(O.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
    lse = (m_i + tl.math.log2(l_i)) * 0.6931471805599453  # natural-log logsumexp of scaled scores
    tl.store(LSE + hq * stride_lh + start + offs_m, lse, mask=row_ok)


@triton.jit
def _bwd_delta_kernel(
    O, DO, DELTA, T,
    stride_ot, stride_oh, stride_dot, stride_doh, stride_lh,
    D,
    BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
):
    pid_t = tl.program_id(0)
    h = tl.program_id(1)
    offs_t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_d = tl.arange(0, BLOCK_D)
    rows = offs_t.to(tl.int64)
    mask = (offs_t[:, None] < T) & (offs_d[None, :] < D)
    o = tl.load(O + rows[:, None] * stride_ot + h * stride_oh + offs_d[None, :], mask=mask, other=0.0)
    do = tl.load(DO + rows[:, None] * stride_dot + h * stride_doh + offs_d[None, :], mask=mask, other=0.0)
    delta = tl.reduce(o.to(tl.float32) * do.to(tl.float32), 1, _ADD)
    tl.store(DELTA + h * stride_lh + rows, delta, mask=offs_t < T)


@triton.jit
def _bwd_dkdv_kernel(
    Q, K, V, DO, LSE, DELTA, DK, DV, CU,
    sm_scale, qk_scale,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
    stride_dot, stride_doh, stride_lh,
    stride_dkt, stride_dkh, stride_dvt, stride_dvh,
    D, GROUP,
    CAUSAL: tl.constexpr, IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, EVEN_D: tl.constexpr,
):
    pid_n = tl.program_id(0)
    hk = tl.program_id(1)
    seq = tl.program_id(2)
    start = tl.load(CU + seq).to(tl.int64)
    length = (tl.load(CU + seq + 1).to(tl.int64) - start).to(tl.int32)
    n0 = pid_n * BLOCK_N
    if n0 >= length:
        return

    offs_n = n0 + tl.arange(0, BLOCK_N)
    offs_m_base = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    col_ok = offs_n < length
    if EVEN_D:
        d_ok = offs_d < BLOCK_D  # constant-folds: no feature-dim masking
    else:
        d_ok = offs_d < D
    kv_mask = col_ok[:, None] & d_ok[None, :]
    k = tl.load(K + (start + offs_n[:, None]) * stride_kt + hk * stride_kh + offs_d[None, :], mask=kv_mask, other=0.0)
    v = tl.load(V + (start + offs_n[:, None]) * stride_vt + hk * stride_vh + offs_d[None, :], mask=kv_mask, other=0.0)
    dk = tl.full([BLOCK_N, BLOCK_D], 0.0, dtype=tl.float32)
    dv = tl.full([BLOCK_N, BLOCK_D], 0.0, dtype=tl.float32)

    lo = 0
    if CAUSAL:
        lo = (n0 // BLOCK_M) * BLOCK_M  # query blocks strictly above the diagonal see nothing
    for g in range(GROUP):
        hq = hk * GROUP + g
        for m0 in range(lo, length, BLOCK_M):
            offs_m = m0 + offs_m_base
            row_ok = offs_m < length
            q_mask = row_ok[:, None] & d_ok[None, :]
            q = tl.load(Q + (start + offs_m[:, None]) * stride_qt + hq * stride_qh + offs_d[None, :], mask=q_mask, other=0.0)
            do = tl.load(DO + (start + offs_m[:, None]) * stride_dot + hq * stride_doh + offs_d[None, :], mask=q_mask, other=0.0)
            lse = tl.load(LSE + hq * stride_lh + start + offs_m, mask=row_ok, other=0.0) * 1.4426950408889634
            delta = tl.load(DELTA + hq * stride_lh + start + offs_m, mask=row_ok, other=0.0)
            # Transposed scores: rows are keys, columns queries.
            st = _mm(k, tl.trans(q), IEEE) * qk_scale
            keep = col_ok[:, None] & row_ok[None, :]
            if CAUSAL:
                keep = keep & (offs_m[None, :] >= offs_n[:, None])
            pt = tl.where(keep, tl.math.exp2(st - lse[None, :]), 0.0)
            dv += _mm(pt.to(do.dtype), do, IEEE)
            dpt = _mm(v, tl.trans(do), IEEE)
            dst = pt * (dpt - delta[None, :])
            dk += _mm(dst.to(q.dtype), q, IEEE)

    dk = dk * sm_scale
    tl.store(DK + (start + offs_n[:, None]) * stride_dkt + hk * stride_dkh + offs_d[None, :], dk.to(DK.dtype.element_ty), mask=kv_mask)
    tl.store(DV + (start + offs_n[:, None]) * stride_dvt + hk * stride_dvh + offs_d[None, :], dv.to(DV.dtype.element_ty), mask=kv_mask)


@triton.jit
def _bwd_dq_kernel(
    Q, K, V, DO, LSE, DELTA, DQ, CU,
    sm_scale, qk_scale,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
    stride_dot, stride_doh, stride_lh, stride_dqt, stride_dqh,
    D, GROUP,
    CAUSAL: tl.constexpr, IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, EVEN_D: tl.constexpr,
):
    pid_m = tl.program_id(0)
    hq = tl.program_id(1)
    seq = tl.program_id(2)
    start = tl.load(CU + seq).to(tl.int64)
    length = (tl.load(CU + seq + 1).to(tl.int64) - start).to(tl.int32)
    m0 = pid_m * BLOCK_M
    if m0 >= length:
        return
    hk = hq // GROUP

    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_n_base = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    row_ok = offs_m < length
    if EVEN_D:
        d_ok = offs_d < BLOCK_D
    else:
        d_ok = offs_d < D
    q_mask = row_ok[:, None] & d_ok[None, :]
    q = tl.load(Q + (start + offs_m[:, None]) * stride_qt + hq * stride_qh + offs_d[None, :], mask=q_mask, other=0.0)
    do = tl.load(DO + (start + offs_m[:, None]) * stride_dot + hq * stride_doh + offs_d[None, :], mask=q_mask, other=0.0)
    lse = tl.load(LSE + hq * stride_lh + start + offs_m, mask=row_ok, other=0.0) * 1.4426950408889634
    delta = tl.load(DELTA + hq * stride_lh + start + offs_m, mask=row_ok, other=0.0)
    dq = tl.full([BLOCK_M, BLOCK_D], 0.0, dtype=tl.float32)

    hi = length
    if CAUSAL:
        hi = tl.minimum(length, m0 + BLOCK_M)
    for n0 in range(0, hi, BLOCK_N):
        offs_n = n0 + offs_n_base
        col_ok = offs_n < length
        kv_mask = col_ok[:, None] & d_ok[None, :]
        k = tl.load(K + (start + offs_n[:, None]) * stride_kt + hk * stride_kh + offs_d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(V + (start + offs_n[:, None]) * stride_vt + hk * stride_vh + offs_d[None, :], mask=kv_mask, other=0.0)
        s = _mm(q, tl.trans(k), IEEE) * qk_scale
        keep = row_ok[:, None] & col_ok[None, :]
        if CAUSAL:
            keep = keep & (offs_n[None, :] <= offs_m[:, None])
        p = tl.where(keep, tl.math.exp2(s - lse[:, None]), 0.0)
        dp = _mm(do, tl.trans(v), IEEE)
        ds = p * (dp - delta[:, None])
        dq += _mm(ds.to(k.dtype), k, IEEE)

    dq = dq * sm_scale
    tl.store(DQ + (start + offs_m[:, None]) * stride_dqt + hq * stride_dqh + offs_d[None, :], dq.to(DQ.dtype.element_ty), mask=q_mask)


@dataclass(frozen=True)
class TileConfig:
    """Block sizes and launch shape of one attention kernel."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


def _block_d(head_dim: int) -> int:
    return max(16, triton.next_power_of_2(head_dim))


def forward_config(head_dim: int, dtype: torch.dtype, interpreted: bool) -> TileConfig:
    """Heuristic tiles, not autotuned (shapes change every micro-batch; a tuning pass per shape
    would cost more than it saves). Chosen from sm_90 register/shared-memory reports of an
    ahead-of-time compile: the 16-bit tiles do not spill at D <= 64 and spill < 64 B at D = 128.
    fp32 (exact ``ieee`` products on CUDA cores) uses small tiles; it is the parity path, not the
    fast one."""
    if interpreted:
        return TileConfig(32, 32, 1, 1)  # the interpreter pays per program: few, large-ish tiles
    if dtype == torch.float32:
        return TileConfig(64, 32, 4, 2)
    if _block_d(head_dim) <= 64:
        return TileConfig(128, 128, 8, 3)
    return TileConfig(128, 64, 8, 3)


@dataclass(frozen=True)
class BackwardTiles:
    """dK/dV programs hold a key block (wide BLOCK_N); dQ programs a query block (wide BLOCK_M)."""

    dkdv: TileConfig
    dq: TileConfig


def backward_config(head_dim: int, dtype: torch.dtype, interpreted: bool) -> BackwardTiles:
    """No spills at D <= 64 on sm_90; at D = 128 the dK/dV accumulators alone take half the
    register file and every tile tried spilled some (0.2-1 KB/thread); these spilled least."""
    if interpreted:
        return BackwardTiles(TileConfig(32, 32, 1, 1), TileConfig(32, 32, 1, 1))
    if dtype == torch.float32:
        return BackwardTiles(TileConfig(32, 64, 4, 2), TileConfig(64, 32, 4, 2))
    return BackwardTiles(TileConfig(32, 128, 8, 2), TileConfig(128, 32, 8, 2))


def _grid_seqs(num_seqs: int) -> int:
    if num_seqs > 65535:
        raise ValueError(f"varlen_attention launches one grid row per sequence; {num_seqs} > 65535 sequences")
    return num_seqs


def _check_last_dim_contiguous(*tensors: torch.Tensor) -> None:
    for t in tensors:
        assert t.stride(-1) == 1, "callers make the feature dim contiguous"


def forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
    max_seqlen: int, causal: bool, scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    _check_last_dim_contiguous(q, k, v)
    total, hq, dim = q.shape
    hkv = k.shape[1]
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    lse = torch.empty((hq, total), dtype=torch.float32, device=q.device)
    num_seqs = cu_seqlens.shape[0] - 1
    if total == 0 or num_seqs == 0 or max_seqlen == 0:
        out.zero_()
        lse.fill_(float("-inf"))
        return out, lse
    cfg = forward_config(dim, q.dtype, use_interpreter(q.device))
    grid = (triton.cdiv(max_seqlen, cfg.block_m), hq, _grid_seqs(num_seqs))
    _fwd_kernel[grid](
        q, k, v, out, lse, cu_seqlens,
        scale * _LOG2E,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        out.stride(0), out.stride(1), lse.stride(0),
        dim, hq // hkv,
        CAUSAL=causal, IEEE=q.dtype == torch.float32,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_D=_block_d(dim), EVEN_D=_block_d(dim) == dim,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return out, lse


def backward(
    grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    out: torch.Tensor, lse: torch.Tensor, cu_seqlens: torch.Tensor,
    max_seqlen: int, causal: bool, scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    _check_last_dim_contiguous(grad_out, q, k, v, out)
    total, hq, dim = q.shape
    hkv = k.shape[1]
    dq = torch.empty_like(q, memory_format=torch.contiguous_format)
    dk = torch.empty_like(k, memory_format=torch.contiguous_format)
    dv = torch.empty_like(v, memory_format=torch.contiguous_format)
    num_seqs = cu_seqlens.shape[0] - 1
    if total == 0 or num_seqs == 0 or max_seqlen == 0:
        return dq.zero_(), dk.zero_(), dv.zero_()
    block_d = _block_d(dim)
    ieee = q.dtype == torch.float32

    delta = torch.empty_like(lse)
    block_t = 64 if use_interpreter(q.device) else max(1, 4096 // block_d)
    _bwd_delta_kernel[(triton.cdiv(total, block_t), hq)](
        out, grad_out, delta, total,
        out.stride(0), out.stride(1), grad_out.stride(0), grad_out.stride(1), delta.stride(0),
        dim, BLOCK_T=block_t, BLOCK_D=block_d,
    )

    tiles = backward_config(dim, q.dtype, use_interpreter(q.device))
    seqs = _grid_seqs(num_seqs)

    def options(cfg: TileConfig) -> dict:
        return dict(
            CAUSAL=causal, IEEE=ieee, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_D=block_d,
            EVEN_D=block_d == dim, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )

    _bwd_dkdv_kernel[(triton.cdiv(max_seqlen, tiles.dkdv.block_n), hkv, seqs)](
        q, k, v, grad_out, lse, delta, dk, dv, cu_seqlens,
        scale, scale * _LOG2E,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        grad_out.stride(0), grad_out.stride(1), lse.stride(0),
        dk.stride(0), dk.stride(1), dv.stride(0), dv.stride(1),
        dim, hq // hkv, **options(tiles.dkdv),
    )
    _bwd_dq_kernel[(triton.cdiv(max_seqlen, tiles.dq.block_m), hq, seqs)](
        q, k, v, grad_out, lse, delta, dq, cu_seqlens,
        scale, scale * _LOG2E,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        grad_out.stride(0), grad_out.stride(1), lse.stride(0), dq.stride(0), dq.stride(1),
        dim, hq // hkv, **options(tiles.dq),
    )
    return dq, dk, dv
