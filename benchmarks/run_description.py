"""What every benchmark report states about the run: the library's commit and the machine.

The benchmarks run as scripts (``PYTHONPATH=. python benchmarks/<name>.py``), so this module is
imported from the scripts' own directory.
"""

from __future__ import annotations

import os
import platform
import subprocess
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent


def library_version() -> str:
    """The commit the library was at when this ran, and whether its code had uncommitted changes."""
    try:
        commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "--", "dcp_compile"],
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return f"{commit}{' + uncommitted library changes' if dirty else ''}" if commit else "unknown"


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine(device: torch.device | None = None) -> str:
    """The GPU's name on CUDA; otherwise the CPU, its cores and the software versions."""
    if device is not None and device.type == "cuda":
        return f"{torch.cuda.get_device_name(device)}, torch {torch.__version__}, Python {platform.python_version()}"
    return (f"{cpu_name()}, {os.cpu_count()} cores (shared, noisy), torch {torch.__version__}, "
            f"Python {platform.python_version()}")
