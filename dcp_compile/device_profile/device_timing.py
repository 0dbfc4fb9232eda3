"""Timing one training micro-batch (forward and backward) on a device, with its peak memory."""

from __future__ import annotations

import platform
import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch


@dataclass(frozen=True)
class Timing:
    seconds: float  # median of the repeats
    repeats: tuple[float, ...]
    peak_bytes: float | None  # allocator peak above the start (None on CPU: no allocator statistics)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_step(step: Callable[[], Any], device: torch.device, repeats: int, warmup: int = 1) -> Timing:
    """Median wall time of ``step()`` over ``repeats`` runs after ``warmup`` runs; on CUDA also the
    peak allocated bytes above what was allocated before the timed runs."""
    for _ in range(warmup):
        step()
    synchronize(device)
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
    seconds = []
    for _ in range(max(1, repeats)):
        synchronize(device)
        start = time.perf_counter()
        step()
        synchronize(device)
        seconds.append(time.perf_counter() - start)
    peak = float(torch.cuda.max_memory_allocated(device) - base) if cuda else None
    return Timing(statistics.median(seconds), tuple(seconds), peak)


def device_name(device: torch.device) -> str:
    """What the measurement ran on, as a results file names it."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as handle:
            for line in handle:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return f"CPU ({model}, {torch.get_num_threads()} thread{'s' if torch.get_num_threads() > 1 else ''})"


def software_versions(device: torch.device) -> dict[str, str]:
    versions = {"torch": torch.__version__}
    try:
        import triton

        versions["triton"] = triton.__version__
    except ImportError:
        pass
    if device.type == "cuda" and torch.version.cuda:
        versions["cuda"] = torch.version.cuda
    return versions
