"""Which implementation runs a varlen attention call: the fastest measured one for its shape.

Candidates (all exact): the project's Triton kernel (``dcp::varlen_attention_fwd``), FlexAttention
with a document block mask (:mod:`.varlen_flex`), and, when every sequence has the same length (no
padding), SDPA over the batch reshaped to ``[N, L, H, D]`` (:func:`equal_length_sdpa`). On a GPU
with a measured table (``varlen_choice_<gpu>.json`` beside this module, written from
``benchmarks/kernel_benchmarks.py``; it names the GPU, torch and Triton versions) the case nearest to
the call's shape (same causality; by mean sequence length and padding fraction) decides, by its
forward+backward time, among the candidates available here. Without a table, and on CPU, the
choice is today's: :func:`.dispatch.kernel_backend` (Triton on CUDA, the torch reference
elsewhere), which ``DCP_KERNELS=triton|torch`` also forces. ``DCP_VARLEN_TABLE=<file.json>`` (same
format) replaces the committed tables for every device, CPU included: measurements of one's own,
or a test that needs the choice to pick a given kernel on CPU.

Compiled graphs (packed micro-batches, ``compiler/passes/use_varlen_attention.py``) choose among
:func:`available_in_graph`: the ``dcp::`` op (Triton, or the reference on CPU) and FlexAttention
traced into the graph (on CUDA only under Inductor, which fuses its forward and backward; the
unfused HOP on CPU). SDPA over equal lengths is eager-only: in a graph the token axis would have
to be split by the run-time sequence count, a relation between size symbols the shared shape
environment cannot take without specialising every variant.

The H200 table (torch 2.11, Triton 3.6) says: FlexAttention beats the Triton kernel
forward+backward in all six cases (0.68-0.85x its time); SDPA on equal-length sequences beats both
when causal (0.76x and 0.83x FlexAttention's time).
"""

from __future__ import annotations

import enum
import functools
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch

from .dispatch import requested_backend

TABLE_DIR = Path(__file__).resolve().parent


class VarlenKernel(str, enum.Enum):
    TRITON = "triton"  # dcp::varlen_attention_fwd / _bwd, the Triton kernels
    REFERENCE = "reference"  # the same ops' plain-torch reference (CPU)
    FLEX = "flex"  # FlexAttention with a document block mask
    EQUAL_SDPA = "equal_sdpa"  # SDPA over [N, L, H, D]: every sequence has the same length
    PADDED_SDPA = "padded_sdpa"  # measured as a baseline only (not run by the varlen path)


@dataclass(frozen=True)
class VarlenShape:
    """What the choice reads from one call (no device data: nothing to synchronise)."""

    total_tokens: int
    num_seqs: int
    max_seqlen: int  # 0: not given (read from cu_seqlens by the kernel): padding unknown
    head_dim: int
    dtype: torch.dtype
    causal: bool
    device_type: str
    device_name: str = ""

    @property
    def padding_fraction(self) -> Optional[float]:
        """Share of a padded ``[N, max_len]`` batch that would be padding; None when unknown."""
        if self.max_seqlen <= 0 or self.num_seqs <= 0:
            return None
        return 1.0 - self.total_tokens / (self.num_seqs * self.max_seqlen)

    @property
    def equal_lengths(self) -> bool:
        return self.padding_fraction == 0.0

    @classmethod
    def of(cls, q: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int, causal: bool) -> "VarlenShape":
        name = torch.cuda.get_device_name(q.device) if q.device.type == "cuda" else ""
        return cls(int(q.shape[0]), int(cu_seqlens.shape[0]) - 1, int(max_seqlen), int(q.shape[-1]), q.dtype,
                   bool(causal), q.device.type, name)


@dataclass(frozen=True)
class VarlenChoice:
    kernel: VarlenKernel
    reason: str

    def __str__(self) -> str:
        return f"{self.kernel.value} ({self.reason})"


@dataclass(frozen=True)
class MeasuredCase:
    case: str
    total_tokens: int
    num_seqs: int
    padding_fraction: float
    head_dim: int
    causal: bool
    fwd_bwd_ms: dict[str, float]

    @property
    def mean_seqlen(self) -> float:
        return self.total_tokens / self.num_seqs


@dataclass(frozen=True)
class MeasuredTable:
    device: str
    torch: str
    triton: str
    source: str
    cases: tuple[MeasuredCase, ...]

    @classmethod
    def load(cls, path: Path) -> "MeasuredTable":
        data = json.loads(path.read_text())
        cases = tuple(MeasuredCase(c["case"], c["total_tokens"], c["num_seqs"], c["padding_fraction"], c["head_dim"],
                                   c["causal"], dict(c["fwd_bwd_ms"])) for c in data["cases"])
        return cls(data["device"], data["torch"], data["triton"], data["source"], cases)

    def nearest(self, shape: VarlenShape) -> Optional[MeasuredCase]:
        """The case of the same causality nearest in (log mean sequence length, padding fraction)."""
        same = [c for c in self.cases if c.causal == shape.causal]
        if not same:
            return None
        mean = shape.total_tokens / max(shape.num_seqs, 1)
        padding = shape.padding_fraction

        def distance(case: MeasuredCase) -> float:
            d = abs(math.log2(max(mean, 1.0)) - math.log2(case.mean_seqlen)) / 4
            return d + (abs(padding - case.padding_fraction) if padding is not None else 0.5)

        return min(same, key=distance)


def table_slug(device_name: str) -> str:
    return "".join(ch if ch.isalnum() else "-" for ch in device_name.lower()).strip("-")


TABLE_ENV = "DCP_VARLEN_TABLE"


def table_override() -> Optional[MeasuredTable]:
    """The table ``DCP_VARLEN_TABLE`` names (read at call time), for every device; None if unset."""
    value = os.environ.get(TABLE_ENV, "").strip()
    if not value:
        return None
    path = Path(value)
    if not path.is_file():
        raise FileNotFoundError(f"{TABLE_ENV}={value!r} is not a file; point it at a varlen choice table "
                                f"(the format of {TABLE_DIR / 'varlen_choice_nvidia-h200.json'}) or unset it")
    return _load_table(str(path.resolve()), path.stat().st_mtime_ns)


@functools.lru_cache(maxsize=8)
def _load_table(path: str, mtime_ns: int) -> MeasuredTable:
    return MeasuredTable.load(Path(path))


@functools.cache
def committed_table(device_name: str) -> Optional[MeasuredTable]:
    path = TABLE_DIR / f"varlen_choice_{table_slug(device_name)}.json"
    return MeasuredTable.load(path) if path.exists() else None


def measured_table(device_name: str) -> Optional[MeasuredTable]:
    """The table that decides for this device: ``DCP_VARLEN_TABLE``'s, else the committed one."""
    override = table_override()
    return override if override is not None else committed_table(device_name)


def available_kernels(shape: VarlenShape) -> set[VarlenKernel]:
    from .dispatch import triton_available
    from .varlen_flex import flex_available

    found = set()
    if triton_available():
        found.add(VarlenKernel.TRITON)
    if flex_available():
        found.add(VarlenKernel.FLEX)
    if shape.equal_lengths:
        found.add(VarlenKernel.EQUAL_SDPA)
    return found


def available_in_graph(shape: VarlenShape, inner: str) -> set[VarlenKernel]:
    """What a compiled packed graph can run under the inner compiler ``inner``: the ``dcp::`` op
    always; FlexAttention on CUDA under Inductor only (elsewhere on CUDA it would run unfused, at
    ``T^2`` memory), and on CPU unfused under ``aot_eager``/``eager`` (torch has no CPU
    FlexAttention backward in Inductor). Never equal-length SDPA (see the module docstring)."""
    from .varlen_flex import flex_available

    found = {_today(shape)}
    if flex_available() and (inner == "inductor" if shape.device_type == "cuda" else inner in ("aot_eager", "eager")):
        found.add(VarlenKernel.FLEX)
    return found


def choose_varlen_kernel(shape: VarlenShape, table: Any = "auto",
                         available: Optional[set[VarlenKernel]] = None) -> VarlenChoice:
    """The implementation for one call (see the module docstring for the rule)."""
    forced = requested_backend()
    fallback = _today(shape)
    if forced != "auto":
        return VarlenChoice(fallback, f"DCP_KERNELS={forced}")
    if table == "auto":
        override = table_override()
        if override is None and shape.device_type != "cuda":
            return VarlenChoice(fallback, f"{shape.device_type}: the torch reference")
        table = override if override is not None else committed_table(shape.device_name)
    if table is None:
        return VarlenChoice(fallback, f"no measured table for {shape.device_name or 'this GPU'}")
    case = table.nearest(shape)
    if case is None:
        return VarlenChoice(fallback, f"no {'causal' if shape.causal else 'full'} case in the {table.device} table")
    candidates = available if available is not None else available_kernels(shape)
    timed = {VarlenKernel(name): ms for name, ms in case.fwd_bwd_ms.items()
             if name in VarlenKernel._value2member_map_ and VarlenKernel(name) in candidates}
    if shape.equal_lengths and VarlenKernel.EQUAL_SDPA in candidates and "padded_sdpa" in case.fwd_bwd_ms \
            and case.padding_fraction == 0.0:
        timed[VarlenKernel.EQUAL_SDPA] = case.fwd_bwd_ms["padded_sdpa"]  # no padding: the same SDPA call
    if not timed:
        return VarlenChoice(fallback, f"none of the {table.device} table's kernels is available")
    best = min(timed, key=timed.get)
    listed = ", ".join(f"{k.value} {ms:.2f} ms" for k, ms in sorted(timed.items(), key=lambda kv: kv[1]))
    return VarlenChoice(best, f"nearest {table.device} case '{case.case}' (torch {table.torch}, Triton "
                              f"{table.triton}), forward+backward: {listed}")


def _today(shape: VarlenShape) -> VarlenKernel:
    """What the varlen op runs without a choice (:func:`.dispatch.kernel_backend`'s rule)."""
    from .dispatch import triton_available

    requested = requested_backend()
    if requested != "auto":
        return VarlenKernel.TRITON if requested == "triton" else VarlenKernel.REFERENCE
    return VarlenKernel.TRITON if shape.device_type == "cuda" and triton_available() else VarlenKernel.REFERENCE


def equal_length_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_seqs: int, causal: bool,
                      scale: Optional[float]) -> torch.Tensor:
    """Varlen attention when every sequence has ``T / num_seqs`` tokens: one SDPA call over
    ``[N, H, L, D]`` (a reshape, no padding), differentiable by SDPA's own backward."""
    total, hq, dim = q.shape
    length = total // num_seqs
    layout = [x.view(num_seqs, length, x.shape[1], dim).transpose(1, 2) for x in (q, k, v)]
    out = torch.nn.functional.scaled_dot_product_attention(*layout, is_causal=causal, scale=scale,
                                                           enable_gqa=hq != k.shape[1])
    return out.transpose(1, 2).reshape(total, hq, dim)


# --- compiled graphs: one choice per packed call, from the graph's attention sites ---------------

@dataclass(frozen=True)
class PackedSite:
    """What the kernel choice reads from one attention site of the graph."""

    causal: bool
    head_dim: int
    dtype: torch.dtype


@functools.lru_cache(maxsize=4096)
def _choose(sites: tuple[PackedSite, ...], lengths: tuple[int, int, int], device: torch.device, inner: str,
            table: Any) -> VarlenChoice:
    total, count, longest = lengths
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else ""
    choices = []
    for site in dict.fromkeys(sites):  # each distinct (causality, head dim, dtype) once
        shape = VarlenShape(total, count, longest, site.head_dim, site.dtype, site.causal, device.type, name)
        choices.append(choose_varlen_kernel(shape, available=available_in_graph(shape, inner)))
    if all(choice.kernel is VarlenKernel.FLEX for choice in choices):
        return choices[0]
    # one implementation per graph: FlexAttention only where the table prefers it at every site
    return next(choice for choice in choices if choice.kernel is not VarlenKernel.FLEX)


def choose_packed_attention(sites: tuple[PackedSite, ...], boundaries: torch.Tensor, device: torch.device,
                            inner: str) -> VarlenChoice:
    """The implementation a packed call runs, from its ``cu_seqlens`` (a CPU tensor: read without a
    device sync) and the device of its tensors; cached per shape."""
    cu = boundaries.tolist()
    lengths = (cu[-1], len(cu) - 1, max(b - a for a, b in zip(cu[:-1], cu[1:])))
    # the table and DCP_KERNELS are read per call (either may change between calls): part of the key
    return _choose(sites, lengths, device, inner, (os.environ.get(TABLE_ENV, ""), requested_backend()))
