"""Timing one training micro-batch (forward and backward) on a device, with its peak memory."""

from __future__ import annotations

import platform
import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch

from dcp_compile.schedule.measured_costs import Clock


def clock_for(device: torch.device) -> Clock:
    if device.type == "cpu" and torch.get_num_threads() == 1:
        return Clock.PROCESS_CPU
    return Clock.DEVICE_WALL


def read_clock(clock: Clock) -> float:
    return time.process_time() if clock is Clock.PROCESS_CPU else time.perf_counter()


@dataclass(frozen=True)
class Timing:
    seconds: float  # median of the repeats
    repeats: tuple[float, ...]
    peak_bytes: float | None  # allocator peak above the start (None on CPU: no allocator statistics)
    clock: Clock = Clock.DEVICE_WALL


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class DeviceStopwatch:
    """Seconds of device work between ``start()`` and ``elapsed()``, on ``clock_for(device)``."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.clock = clock_for(device)
        self.began = read_clock(self.clock)

    def start(self) -> "DeviceStopwatch":
        synchronize(self.device)
        self.began = read_clock(self.clock)
        return self

    def elapsed(self) -> float:
        synchronize(self.device)
        return read_clock(self.clock) - self.began


def time_step(step: Callable[[], Any], device: torch.device, repeats: int, warmup: int = 1) -> Timing:
    """Median time of ``step()`` (on ``clock_for(device)``) over ``repeats`` runs after ``warmup``
    runs; on CUDA also the peak allocated bytes above what was allocated before the timed runs."""
    for _ in range(warmup):
        step()
    synchronize(device)
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
    seconds = []
    watch = DeviceStopwatch(device)
    for _ in range(max(1, repeats)):
        watch.start()
        step()
        seconds.append(watch.elapsed())
    peak = float(torch.cuda.max_memory_allocated(device) - base) if cuda else None
    return Timing(statistics.median(seconds), tuple(seconds), peak, watch.clock)


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
