"""Kernel benchmarks: each dcp kernel against the torch path it replaces.

* Layout kernels (``pack_for_heads``, its scatter-add backward, ``unpack_from_heads``,
  ``pack_for_sequence``) against the torch permute/index chain, reported as achieved GB/s and as a
  percentage of the chip's copy bandwidth, *measured* here with a plain ``torch`` device copy
  (a layout transform moves every byte once in and once out, so a copy is its ceiling).
* Varlen attention (forward, and forward + backward) against SDPA on the padded batch and
  FlexAttention with a document mask, reported as *useful* TFLOP/s (only the FLOPs inside each
  sequence's attention pattern, the same count for every method) and as a percentage of the
  device's dense 16-bit tensor-core peak. The padded SDPA baseline is timed on an already padded
  batch with KV heads already expanded for GQA (the pad/unpad and expansion copies are left out,
  which favors it).

Writes a table to stdout and ``kernels_<gpu>.csv`` / ``kernels_<gpu>.png`` (and the varlen chooser's
``varlen_choice_<gpu>.json``) under ``--out-dir``. The CSV and the chooser's table are rewritten after
every case, each row's ``run`` column saying what the run is and how far it got (``complete`` or
``partial: N of M cases``), so a run stopped by ``timeout --signal=INT`` leaves valid, partial files.

``--tiny`` (the dry run of ``benchmarks/gpu_check.sh``) runs that GPU path on the CPU at toy shapes:
Triton interpreted, FlexAttention uncompiled, a wall-clock timer instead of ``do_bench``. Its files are
``kernels_cpu.*`` and ``varlen_choice_cpu.json``, labelled "dry run on CPU": they check the script,
and their times mean nothing.

Without a GPU there is nothing meaningful to time: it says so and runs a correctness-only pass
(small shapes, Triton interpreter against the torch references), prints that table and exits 0
when everything matches (1 otherwise).

Run: ``python benchmarks/kernel_benchmarks.py [--quick] [--out-dir DIR]`` (or, from a source
checkout, ``python -m dcp_compile bench kernels``); ``benchmarks/gpu_check.sh`` runs it on a GPU.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import dataclasses
import logging
import math
import os
import re
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, Sequence

import torch
import torch.nn.functional as F

from dcp_compile.device_profile.partial_results import DRY_RUN_LABEL, Progress, interruptible, write_atomic
from dcp_compile.kernels import ulysses_layout_reference as layout_reference
from dcp_compile.kernels import varlen_attention_reference as attention_reference
from dcp_compile.kernels.dispatch import ENV_VAR, triton_available
from dcp_compile.kernels.ulysses_layout import pack_for_heads, pack_for_sequence, unpack_from_heads
from dcp_compile.kernels.varlen_attention import varlen_attention

log = logging.getLogger(__name__)

# Dense (no sparsity) fp16/bf16 tensor-core peaks in TFLOP/s, matched against the device name,
# most specific first. Vendor datasheet numbers; pass --peak-tflops for anything else.
PEAK_DENSE_TFLOPS: tuple[tuple[str, float], ...] = (
    ("H200", 989.0),
    ("H100 PCIe", 756.0),
    ("H100", 989.0),
    ("H800", 989.0),
    ("A100", 312.0),
    ("A800", 312.0),
    ("L40S", 362.0),
)


# --------------------------------------------------------------------------- records


@dataclass
class TimingRecord:
    """One timed (kernel, case, implementation, direction)."""

    kernel: str
    case: str
    impl: str
    direction: str
    dtype: str
    time_ms: float
    metric: str  # "GB/s" or "TFLOP/s"
    achieved: float
    ceiling: float  # copy GB/s or peak TFLOP/s; nan when unknown
    pct_of_ceiling: float
    speedup_vs_torch: float = float("nan")  # baseline time / this time


@dataclass
class CheckRecord:
    """One correctness comparison of the correctness-only (no GPU) pass."""

    kernel: str
    case: str
    dtype: str
    max_abs_err: float
    tolerance: float
    ok: bool


@dataclass(frozen=True)
class LayoutCase:
    """A Ulysses layout shape: x ``[B, H, S_r, D]`` on ``sp`` ranks, ``hp`` slots per rank."""

    name: str
    batch: int
    heads: int
    seq: int
    dim: int
    sp: int
    hp: int
    head_index: Optional[tuple[int, ...]] = None

    def index(self, device: torch.device) -> Optional[torch.Tensor]:
        return None if self.head_index is None else torch.tensor(self.head_index, device=device)

    @property
    def valid_slots(self) -> int:
        if self.head_index is None:
            return min(self.heads, self.sp * self.hp)
        return sum(1 for i in self.head_index if i >= 0)


@dataclass(frozen=True)
class AttentionCase:
    """A packed micro-batch: sequence lengths and head layout."""

    name: str
    lengths: tuple[int, ...]
    hq: int
    hkv: int
    dim: int
    causal: bool

    @property
    def total(self) -> int:
        return sum(self.lengths)

    def useful_fwd_flops(self) -> float:
        """2 matmuls x 2 FLOPs per multiply-add, over the attended (q, k) pairs only."""
        pairs = sum(n * (n + 1) / 2 if self.causal else n * n for n in self.lengths)
        return 4.0 * pairs * self.dim * self.hq


# --------------------------------------------------------------------------- shapes


def tiny_layout_cases() -> list[LayoutCase]:
    """The correctness pass's shapes: what the interpreter runs in a second or two."""
    return [LayoutCase("H6 P2", 2, 6, 5, 16, 2, 3), LayoutCase("KV2 GQA P4", 1, 2, 6, 16, 4, 1, (0, 0, 1, 1))]


def tiny_attention_cases() -> list[AttentionCase]:
    """Packed rows of a few dozen tokens, one causal and one full (the dry run's cases: the interpreter is slow)."""
    return [AttentionCase(f"{label} T={sum(lengths)} {'causal' if causal else 'full'} Hq4/Hkv2 D16", lengths, 4, 2, 16,
                          causal)
            for label, lengths, causal in (("4 docs", (8, 8, 8, 8), True), ("skewed docs", (1, 17, 40), False))]


def layout_cases(quick: bool) -> list[LayoutCase]:
    """Ulysses on 8 ranks with Llama-like heads; quick keeps one sequence length."""
    seqs = (4096,) if quick else (4096, 16384)
    cases = []
    for s in seqs:
        cases += [
            LayoutCase(f"H32 D128 S_r={s}", 1, 32, s, 128, 8, 4),
            LayoutCase(f"H28->32 padded D128 S_r={s}", 1, 28, s, 128, 8, 4),
            LayoutCase(f"KV4 GQA x2 D128 S_r={s}", 1, 4, s, 128, 8, 1, tuple(j // 2 for j in range(8))),
        ]
    if not quick:
        cases.append(LayoutCase("B2 H16 D64 S_r=8192", 2, 16, 8192, 64, 8, 2))
    return cases


def _skewed_lengths(total: int, seed: int = 0) -> tuple[int, ...]:
    """Long-tailed document lengths (log-uniform) summing exactly to ``total``."""
    gen = torch.Generator().manual_seed(seed)
    lengths: list[int] = []
    while sum(lengths) < total:
        n = int(2 ** (torch.rand((), generator=gen).item() * 12))  # 1 .. 4096
        lengths.append(max(1, min(n, total - sum(lengths))))
    return tuple(lengths)


def attention_cases(quick: bool) -> list[AttentionCase]:
    total = 16384 if quick else 32768
    shapes = {
        "8 docs": tuple([total // 8] * 8),
        "skewed docs": _skewed_lengths(total),
        "many short": tuple([256] * (total // 256)),
    }
    cases = []
    for label, lengths in shapes.items():
        for causal in (True, False):
            cases.append(AttentionCase(f"{label} T={total} {'causal' if causal else 'full'} Hq32/Hkv8 D128",
                                       lengths, 32, 8, 128, causal))
    if not quick:
        cases.append(AttentionCase(f"8 docs T={total} causal H16 D64", tuple([total // 8] * 8), 16, 16, 64, True))
    return cases


# --------------------------------------------------------------------------- helpers


@contextlib.contextmanager
def forced_backend(backend: str) -> Iterator[None]:
    """Pin ``DCP_KERNELS`` for a block, restoring the caller's value."""
    previous = os.environ.get(ENV_VAR)
    os.environ[ENV_VAR] = backend
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop(ENV_VAR, None)
        else:
            os.environ[ENV_VAR] = previous


def gpu_slug(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def peak_tflops(device_name: str, override: Optional[float]) -> float:
    if override is not None:
        return override
    for key, value in PEAK_DENSE_TFLOPS:
        if key.lower() in device_name.lower():
            return value
    log.warning("no known dense peak for %r; pass --peak-tflops to get percentages", device_name)
    return float("nan")


# Set by ``--tiny``: time with the wall clock (the dry run on a CPU, where do_bench has no device to time).
_WALL_CLOCK = False
_WALL_CLOCK_REPEATS = 2  # --wall-clock-repeats: more makes a dry run last (tests of gpu_check.sh's time limits)


def _bench_ms(fn: Callable[[], Any], grad_to_none: Optional[Sequence[torch.Tensor]] = None) -> float:
    if _WALL_CLOCK:
        return _wall_clock_ms(fn, grad_to_none, _WALL_CLOCK_REPEATS)
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=25, rep=100, grad_to_none=grad_to_none, return_mode="median"))


def _wall_clock_ms(fn: Callable[[], Any], grad_to_none: Optional[Sequence[torch.Tensor]] = None,
                   repeats: int = 2) -> float:
    """Median of a few wall-clock calls after one warm-up: enough to exercise the dry run's code path."""
    times = []
    for index in range(repeats + 1):
        for leaf in grad_to_none or ():
            leaf.grad = None
        start = time.perf_counter()
        fn()
        if index:
            times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def measure_copy_bandwidth(device: torch.device, gib: float = 1.0) -> float:
    """GB/s of a plain device-to-device ``copy_`` (read + write counted): the layout ceiling."""
    n = int(gib * 2**30) // 2
    src = torch.empty(n, dtype=torch.bfloat16, device=device).normal_()
    dst = torch.empty_like(src)
    ms = _bench_ms(lambda: dst.copy_(src))
    return 2 * n * 2 / (ms * 1e-3) / 1e9


# --------------------------------------------------------------------------- GPU: layouts


def _layout_workloads(case: LayoutCase, dtype: torch.dtype, device: torch.device):
    """(kernel name, bytes moved, dcp fn, torch fn) for each layout transform of a case."""
    b, h, s, d = case.batch, case.heads, case.seq, case.dim
    elt = torch.empty((), dtype=dtype).element_size()
    index = case.index(device)
    x = torch.randn(b, h, s, d, device=device, dtype=dtype)
    send = torch.randn(case.sp, s, b, case.hp, d, device=device, dtype=dtype)
    row = b * s * d * elt  # one head slot's worth of tokens
    slots = case.sp * case.hp
    yield (
        "pack_for_heads",
        row * (case.valid_slots + slots),
        lambda: pack_for_heads(x, case.sp, case.hp, index),
        lambda: layout_reference.pack_for_heads(x, case.sp, case.hp, index),
    )
    yield (
        "pack_for_heads.backward (scatter-add)",
        row * (case.valid_slots + h),
        lambda: unpack_from_heads(send, h, head_index=index),
        lambda: layout_reference.unpack_from_heads(send, h, index),
    )
    if index is None:  # the way back carries query heads: identity layout only
        yield (
            "unpack_from_heads",
            row * 2 * h,
            lambda: unpack_from_heads(send, h),
            lambda: layout_reference.unpack_from_heads(send, h, None),
        )
        full = torch.randn(b, case.hp, s * case.sp, d, device=device, dtype=dtype)
        yield (
            "pack_for_sequence",
            2 * full.numel() * elt,
            lambda: pack_for_sequence(full),
            lambda: layout_reference.pack_for_sequence(full),
        )


def bench_layouts(cases: list[LayoutCase], dtype: torch.dtype, device: torch.device, copy_gbps: float) -> list[TimingRecord]:
    records = []
    for case in cases:
        for kernel, nbytes, dcp_fn, torch_fn in _layout_workloads(case, dtype, device):
            with forced_backend("triton"):
                torch.testing.assert_close(dcp_fn(), torch_fn(), rtol=1e-2, atol=1e-2)
                t_dcp = _bench_ms(dcp_fn)
            t_ref = _bench_ms(torch_fn)
            for impl, ms in (("dcp-triton", t_dcp), ("torch permute/index", t_ref)):
                gbps = nbytes / (ms * 1e-3) / 1e9
                records.append(TimingRecord(kernel, case.name, impl, "fwd", str(dtype).removeprefix("torch."),
                                            ms, "GB/s", gbps, copy_gbps, 100 * gbps / copy_gbps, t_ref / ms))
            log.info("%s %s: triton %.3f ms, torch %.3f ms", kernel, case.name, t_dcp, t_ref)
    return records


# --------------------------------------------------------------------------- GPU: attention


def _padded(t: torch.Tensor, lengths: Sequence[int]) -> torch.Tensor:
    """``[T, H, D]`` packed -> ``[N, H, max_len, D]`` zero-padded (SDPA layout)."""
    parts = torch.split(t, list(lengths))
    return torch.nn.utils.rnn.pad_sequence(parts, batch_first=True).transpose(1, 2).contiguous()


def _attention_impls(case: AttentionCase, dtype: torch.dtype, device: torch.device, with_flex: bool,
                     compile_flex: bool = True):
    """(impl name, forward fn, leaves) for dcp varlen, padded SDPA and (optionally) FlexAttention
    (``compile_flex=False``: eager FlexAttention, the dry run's, which Inductor need not build on a CPU)."""
    gen = torch.Generator(device=device).manual_seed(0)
    t = case.total
    q = torch.randn(t, case.hq, case.dim, device=device, dtype=dtype, generator=gen)
    k = torch.randn(t, case.hkv, case.dim, device=device, dtype=dtype, generator=gen)
    v = torch.randn(t, case.hkv, case.dim, device=device, dtype=dtype, generator=gen)
    cu = torch.tensor([0, *torch.tensor(case.lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)
    max_len = max(case.lengths)

    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    yield "dcp-triton varlen", lambda: varlen_attention(*leaves, cu, max_len, causal=case.causal, kernel="triton"), leaves

    # What the varlen path runs by itself (dcp_compile/kernels/attention_choice.py), its block mask or
    # reshape inside the clock: chosen here, outside the benchmark's forced Triton backend.
    from dcp_compile.kernels.attention_choice import VarlenShape, choose_varlen_kernel

    chosen = choose_varlen_kernel(VarlenShape.of(q, cu, max_len, case.causal)).kernel.value
    chosen_leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    yield (f"dcp chosen ({chosen})",
           lambda: varlen_attention(*chosen_leaves, cu, max_len, causal=case.causal, kernel=chosen), chosen_leaves)

    # KV heads are expanded up front: SDPA's fused kernels then apply (enable_gqa with a padding
    # mask would fall back to the math path), and the expansion is not timed.
    group = case.hq // case.hkv
    padded = [_padded(x, case.lengths).requires_grad_()
              for x in (q, k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1))]
    key_ok = torch.arange(max_len, device=device)[None, :] < torch.tensor(case.lengths, device=device)[:, None]
    mask = None if case.causal else key_ok[:, None, None, :]

    def sdpa() -> torch.Tensor:
        return F.scaled_dot_product_attention(*padded, attn_mask=mask, is_causal=case.causal)

    yield "torch SDPA padded", sdpa, padded

    if not with_flex:
        return
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    except ImportError:  # pragma: no cover - old torch
        log.warning("FlexAttention unavailable in this torch; skipping that baseline")
        return
    doc = torch.repeat_interleave(torch.arange(len(case.lengths), device=device),
                                  torch.tensor(case.lengths, device=device))
    causal = case.causal

    def document_mask(b, h, q_idx, kv_idx):  # noqa: ANN001
        same = doc[q_idx] == doc[kv_idx]
        return same & (q_idx >= kv_idx) if causal else same

    block_mask = create_block_mask(document_mask, 1, None, t, t, device=device)
    flex = torch.compile(flex_attention, dynamic=False) if compile_flex else flex_attention
    # FlexAttention has no backward on a CPU: there (the dry run) it is timed forward only.
    flex_leaves = [x.transpose(0, 1).unsqueeze(0).contiguous().requires_grad_(device.type != "cpu") for x in (q, k, v)]
    yield ("torch FlexAttention doc-mask",
           lambda: flex(*flex_leaves, block_mask=block_mask, enable_gqa=case.hq != case.hkv),
           flex_leaves)


def bench_attention(
    cases: list[AttentionCase], dtype: torch.dtype, device: torch.device, peak: float, with_flex: bool = True,
    compile_flex: bool = True,
) -> list[TimingRecord]:
    records = []
    for case in cases:
        # Each case's FlexAttention mask is a new closure: start from empty dynamo caches so a long
        # sweep never hits the recompile limit (past it, flex would run unfused and O(T^2) memory).
        torch._dynamo.reset()
        fwd_flops = case.useful_fwd_flops()
        timed: list[tuple[str, str, float, float]] = []
        for impl, fn, leaves in _attention_impls(case, dtype, device, with_flex, compile_flex):
            out = fn()
            grad = torch.randn_like(out)

            def fwd_bwd() -> None:
                fn().backward(grad)

            with forced_backend("triton"):
                t_fwd = _bench_ms(fn)
                t_all = _bench_ms(fwd_bwd, grad_to_none=leaves) if out.requires_grad else float("nan")
            timed.append((impl, "fwd", t_fwd, fwd_flops))
            if out.requires_grad:  # not so for FlexAttention on a CPU (no backward there)
                timed.append((impl, "fwd+bwd", t_all, 3.5 * fwd_flops))
            log.info("%s %s: fwd %.3f ms, fwd+bwd %.3f ms", impl, case.name, t_fwd, t_all)
        baseline = {d: ms for impl, d, ms, _ in timed if impl == "torch SDPA padded"}
        for impl, direction, ms, flops in timed:
            tflops = flops / (ms * 1e-3) / 1e12
            records.append(TimingRecord("varlen_attention", case.name, impl, direction,
                                        str(dtype).removeprefix("torch."), ms, "TFLOP/s", tflops, peak,
                                        100 * tflops / peak, baseline.get(direction, float("nan")) / ms))
    return records


IMPL_KEYS = {"dcp-triton varlen": "triton", "torch SDPA padded": "padded_sdpa", "torch FlexAttention doc-mask": "flex"}


def write_choice_table(records: Sequence[TimingRecord], cases: Sequence[AttentionCase], device_name: str,
                       path: Path, label: str = "", status: str = "complete") -> list[str]:
    """The varlen chooser's measured table (forward+backward ms per implementation and case, with
    the GPU, torch and Triton versions), and one verdict line per case: the chosen path against
    FlexAttention, and against padded SDPA where padding exceeds 10%. ``label`` and ``status`` say
    what the run was (a dry run says so) and how far it got."""
    import json

    import triton

    lines, rows = [], []
    for case in cases:
        timed = {r.impl: r.time_ms for r in records if r.case == case.name and r.direction == "fwd+bwd"}
        lengths = case.lengths
        padding = 1 - sum(lengths) / (len(lengths) * max(lengths))
        rows.append({"case": case.name, "total_tokens": sum(lengths), "num_seqs": len(lengths), "max_seqlen": max(lengths),
                     "padding_fraction": round(padding, 4), "head_dim": case.dim, "q_heads": case.hq,
                     "kv_heads": case.hkv, "causal": case.causal,
                     "fwd_bwd_ms": {IMPL_KEYS[k]: round(v, 4) for k, v in timed.items() if k in IMPL_KEYS}})
        chosen = next(((k, v) for k, v in timed.items() if k.startswith("dcp chosen")), None)
        if chosen is None:
            continue
        flex, sdpa = timed.get("torch FlexAttention doc-mask"), timed.get("torch SDPA padded")
        verdict = f"{case.name}: {chosen[0]} {chosen[1]:.3f} ms"
        if flex:
            verdict += f", {flex / chosen[1]:.2f}x FlexAttention's speed ({'ok' if chosen[1] <= flex * 1.02 else 'SLOWER'})"
        if sdpa and padding > 0.10:
            verdict += f", {sdpa / chosen[1]:.2f}x padded SDPA's ({'ok' if chosen[1] <= sdpa * 1.02 else 'SLOWER'})"
        lines.append(verdict)
    write_atomic(path, json.dumps({
        "device": device_name, "torch": torch.__version__, "triton": triton.__version__,
        "label": label, "status": status,
        "source": f"benchmarks/kernel_benchmarks.py ({path.name})",
        "measured": ("forward+backward milliseconds, a wall-clock median of 2 calls (the dry run: they mean nothing)"
                     if _WALL_CLOCK else "forward+backward milliseconds, triton.testing.do_bench")
                    + "; padded SDPA on an already padded batch, FlexAttention with its block mask built outside the clock",
        "cases": rows}, indent=1))
    return lines


# --------------------------------------------------------------------------- CPU: correctness only


def correctness_pass() -> list[CheckRecord]:
    """Interpreted Triton kernels vs the torch references at small shapes (no timing)."""
    records: list[CheckRecord] = []
    gen = torch.Generator().manual_seed(0)

    def check(kernel: str, case: str, dtype: torch.dtype, got: torch.Tensor, want: torch.Tensor, tol: float) -> None:
        err = (got.double() - want.double()).abs().max().item() if got.numel() else 0.0
        records.append(CheckRecord(kernel, case, str(dtype).removeprefix("torch."), err, tol, err <= tol))

    layouts = [
        LayoutCase("H6 P2", 2, 6, 5, 16, 2, 3),
        LayoutCase("H5->6 padded P2", 1, 5, 7, 16, 2, 3),
        LayoutCase("KV2 GQA P4", 1, 2, 6, 16, 4, 1, (0, 0, 1, 1)),
    ]
    for case in layouts:
        for dtype in (torch.float32, torch.float16):
            x = torch.randn(case.batch, case.heads, case.seq, case.dim, generator=gen).to(dtype)
            send = torch.randn(case.sp, case.seq, case.batch, case.hp, case.dim, generator=gen).to(dtype)
            index = case.index(torch.device("cpu"))
            with forced_backend("triton"):
                packed = pack_for_heads(x, case.sp, case.hp, index)
                scattered = unpack_from_heads(send, case.heads, head_index=index)
                seq = pack_for_sequence(x)
            check("pack_for_heads", case.name, dtype, packed,
                  layout_reference.pack_for_heads(x, case.sp, case.hp, index), 0.0)
            check("pack_for_heads.backward (scatter-add)", case.name, dtype, scattered,
                  layout_reference.unpack_from_heads(send, case.heads, index), 1e-3)
            check("pack_for_sequence", case.name, dtype, seq, layout_reference.pack_for_sequence(x), 0.0)

    attention = [AttentionCase("lengths 1,17,40 GQA 4/2", (1, 17, 40), 4, 2, 32, causal) for causal in (True, False)]
    for case in attention:
        for dtype, tol in ((torch.float32, 1e-4), (torch.float16, 2e-2)):
            label = f"{case.name} {'causal' if case.causal else 'full'}"
            q = torch.randn(case.total, case.hq, case.dim, generator=gen).to(dtype)
            k = torch.randn(case.total, case.hkv, case.dim, generator=gen).to(dtype)
            v = torch.randn(case.total, case.hkv, case.dim, generator=gen).to(dtype)
            grad = torch.randn(case.total, case.hq, case.dim, generator=gen).to(dtype)
            cu = torch.tensor([0, *torch.tensor(case.lengths).cumsum(0).tolist()], dtype=torch.int32)
            scale = 1.0 / math.sqrt(case.dim)
            with forced_backend("triton"):
                leaves = [t.clone().requires_grad_() for t in (q, k, v)]
                out = varlen_attention(*leaves, cu, max(case.lengths), causal=case.causal)
                out.backward(grad)
            ref_out, ref_lse = attention_reference.attention_forward(q, k, v, cu, case.causal, scale)
            ref_grads = attention_reference.attention_backward(grad, q, k, v, ref_out, ref_lse, cu, case.causal, scale)
            check("varlen_attention fwd", label, dtype, out.detach(), ref_out, tol)
            for name, leaf, ref in zip(("dq", "dk", "dv"), leaves, ref_grads):
                check(f"varlen_attention {name}", label, dtype, leaf.grad, ref, tol)
    return records


# --------------------------------------------------------------------------- output


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        if math.isnan(value):
            return "n/a"
        return f"{value:.3g}" if abs(value) < 1000 else f"{value:.0f}"
    return str(value)


def format_table(rows: Sequence[Any]) -> str:
    if not rows:
        return "(no rows)"
    names = [f.name for f in dataclasses.fields(rows[0])]
    cells = [[_fmt(getattr(r, n)) for n in names] for r in rows]
    widths = [max(len(n), *(len(c[i]) for c in cells)) for i, n in enumerate(names)]
    line = lambda parts: "  ".join(p.ljust(w) for p, w in zip(parts, widths))  # noqa: E731
    return "\n".join([line(names), line(["-" * w for w in widths]), *(line(c) for c in cells)])


def write_csv(rows: Sequence[Any], path: Path, run: Optional[str] = None) -> None:
    """The rows as CSV; ``run`` (what the run is and how far it got) goes in a last column of every row,
    so a partial or dry-run file says so wherever it is read. No rows: the header of the timing table."""
    import io

    names = [fl.name for fl in dataclasses.fields(rows[0] if rows else TimingRecord)]
    stream = io.StringIO(newline="")
    writer = csv.DictWriter(stream, fieldnames=names + (["run"] if run is not None else []))
    writer.writeheader()
    for r in rows:
        writer.writerow({**dataclasses.asdict(r), **({"run": run} if run is not None else {})})
    write_atomic(path, stream.getvalue())


def plot(records: Sequence[TimingRecord], path: Path, title: str) -> bool:
    """Percent of ceiling per case and implementation: one panel per kernel and direction."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log.warning("matplotlib is not installed; no plot written (pip install 'dcp-compile[bench]')")
        return False
    panels = sorted({(r.kernel, r.direction) for r in records}, key=lambda p: (p[0] == "varlen_attention", p))
    fig, axes = plt.subplots(len(panels), 1, figsize=(11, 3.2 * len(panels)), squeeze=False)
    for ax, (kernel, direction) in zip(axes[:, 0], panels):
        rows = [r for r in records if r.kernel == kernel and r.direction == direction]
        case_names = list(dict.fromkeys(r.case for r in rows))
        impls = list(dict.fromkeys(r.impl for r in rows))
        width = 0.8 / len(impls)
        for i, impl in enumerate(impls):
            values = [next((r.pct_of_ceiling for r in rows if r.case == c and r.impl == impl), float("nan"))
                      for c in case_names]
            ax.bar([j + i * width for j in range(len(case_names))], values, width, label=impl)
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(case_names))])
        ax.set_xticklabels(case_names, rotation=15, ha="right", fontsize=7)
        unit = "copy bandwidth" if rows[0].metric == "GB/s" else "dense bf16 peak"
        ax.set_ylabel(f"% of {unit}")
        ax.set_title(f"{kernel} ({direction})", fontsize=9)
        ax.legend(fontsize=7)
    fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


# --------------------------------------------------------------------------- entry point


def parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m dcp_compile bench kernels",
        description="Benchmark the dcp Triton kernels against the torch paths they replace.",
    )
    parser.add_argument("--out-dir", type=Path, default=Path("benchmarks/results"),
                        help="where kernels_<gpu>.csv and .png go (default: benchmarks/results)")
    parser.add_argument("--quick", action="store_true", help="fewer, smaller shapes")
    parser.add_argument("--only", choices=("layout", "attention", "all"), default="all")
    parser.add_argument("--dtype", choices=("bfloat16", "float16"), default="bfloat16")
    parser.add_argument("--peak-tflops", type=float, default=None,
                        help="dense 16-bit peak of the device, if it is not in the built-in table")
    parser.add_argument("--no-flex", action="store_true", help="skip the FlexAttention baseline (saves its compiles)")
    parser.add_argument("--no-plot", action="store_true")
    parser.add_argument("--tiny", action="store_true",
                        help="the GPU path on the CPU at toy shapes, interpreted Triton, a wall-clock timer (the dry "
                             "run of gpu_check.sh: files labelled 'dry run on CPU', times meaningless)")
    parser.add_argument("--wall-clock-repeats", type=int, default=2,
                        help="--tiny's calls per timing after the warm-up (default 2)")
    return parser.parse_args(argv)


def main(argv: Optional[Sequence[str]] = None) -> int:
    global _WALL_CLOCK, _WALL_CLOCK_REPEATS
    args = parse_args(argv)
    _WALL_CLOCK_REPEATS = max(1, args.wall_clock_repeats)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if not triton_available():
        print("triton is not installed: the dcp kernels run their torch references only, nothing to "
              "benchmark or check. Install it with pip install 'dcp-compile[triton]'.")
        return 0
    if args.tiny:
        device, name, dtype = torch.device("cpu"), "cpu", torch.float32  # the interpreter: fp32 (bf16 tl.dot is wrong there)
        _WALL_CLOCK = True
        print(f"{DRY_RUN_LABEL}: the GPU path at toy shapes, Triton interpreted, wall-clock timer (times mean nothing)")
    elif not torch.cuda.is_available():
        print("No CUDA GPU found: skipping timings (they would be meaningless on CPU) and running a "
              "correctness-only pass of the Triton kernels under the interpreter, at small shapes.\n")
        checks = correctness_pass()
        print(format_table(checks))
        failed = [c for c in checks if not c.ok]
        print(f"\n{len(checks) - len(failed)}/{len(checks)} checks passed.")
        return 1 if failed else 0
    else:
        device = torch.device("cuda")
        name = torch.cuda.get_device_name(device)
        dtype = getattr(torch, args.dtype)
    print(f"Device: {name}")
    layouts = (tiny_layout_cases() if args.tiny else layout_cases(args.quick)) if args.only in ("layout", "all") else []
    attention = ((tiny_attention_cases() if args.tiny else attention_cases(args.quick))
                 if args.only in ("attention", "all") else [])
    progress = Progress(len(layouts) + len(attention), unit="cases")
    label = DRY_RUN_LABEL if args.tiny else f"measured on {name}"
    stem = f"kernels_{gpu_slug(name)}"
    csv_path = args.out_dir / f"{stem}.csv"
    table_path = args.out_dir / f"varlen_choice_{gpu_slug(name)}.json"
    records: list[TimingRecord] = []

    def flush(final: bool = False) -> list[str]:
        """Rewrite the CSV (and the chooser's table) with every case timed so far; the plot at the end."""
        status = progress.status()
        write_csv(records, csv_path, run=f"{label}; {status}")
        verdicts: list[str] = []
        if attention:
            timed = attention[:max(0, progress.done - len(layouts))]
            verdicts = write_choice_table(records, timed, name, table_path, label, status)
        if final and not args.no_plot and records:
            plot(records, args.out_dir / f"{stem}.png", f"dcp kernels on {name} ({str(dtype).removeprefix('torch.')})"
                 + (f": {DRY_RUN_LABEL}" if args.tiny else "") + ("" if progress.complete else f" ({status})"))
        return verdicts

    flush()
    with interruptible(progress, lambda: flush(final=True)):
        if layouts:
            copy_gbps = measure_copy_bandwidth(device, gib=1 / 256 if args.tiny else 1.0)
            print(f"Measured copy bandwidth ceiling: {copy_gbps:.0f} GB/s")
            for case in layouts:
                records += bench_layouts([case], dtype, device, copy_gbps)
                progress.done += 1
                flush()
        if attention:
            peak = peak_tflops(name, args.peak_tflops)
            print(f"Dense 16-bit peak used for percentages: {_fmt(peak)} TFLOP/s")
            for case in attention:
                records += bench_attention([case], dtype, device, peak, with_flex=not args.no_flex,
                                           compile_flex=not args.tiny)
                progress.done += 1
                flush()

    verdicts = flush(final=True)
    print()
    print(format_table(records))
    if attention:
        print("\n".join(verdicts))
        print(f"wrote {table_path} (copy it to dcp_compile/kernels/ for the varlen path to choose by it)")
    print(f"\nwrote {csv_path} ({progress.status()})")
    if not args.no_plot and (args.out_dir / f"{stem}.png").exists():
        print(f"wrote {args.out_dir / f'{stem}.png'}")
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
