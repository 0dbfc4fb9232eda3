"""What one accelerator (and its links) can do, as the cost model needs it.

The planner must derive *the same* plan on every rank from nothing but its inputs, so a
``Hardware`` record is plain constants: presets for the chips we plan for, and constants for the
present CPU. Measuring the machine is opt-in (``Hardware.this_cpu(measure=True)``), because two
ranks that time a matmul get two different numbers, and two different cost models give two
different plans. Measure once, save the calibrated cost model (``CostModel.save``) and load the
same file on every rank instead.

Numbers are peak/raw figures (dense bf16 FLOP/s, HBM bandwidth, one direction of a link per GPU);
how much of them a real kernel reaches is the cost model's per-term scale factors, which a short
profile calibrates.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import asdict, dataclass, replace
from typing import Any, ClassVar

log = logging.getLogger(__name__)

GB = 1e9


@dataclass(frozen=True)
class Hardware:
    """One device of a homogeneous cluster and its links to the others.

    Bandwidths are bytes/s one way per device; latencies are seconds per collective call.
    ``layer_overhead_s`` is the fixed host/launch time one transformer layer costs per training
    micro-batch (forward + backward) whatever its size: it is why many tiny micro-batches are slower
    than one packed one. ``host_link_bandwidth`` is one direction of the device's link to host
    memory (PCIe), what FSDP2's ``CPUOffloadPolicy`` copies shards over; ``host_memory_bandwidth``
    is the device's share of its host's DRAM bandwidth, what an optimizer step on the host reads
    and writes at. ``host_memory_per_node`` is a node's host memory, what offloaded optimizer
    state and offloaded activations (``recompute=offload``, ``lean``) share among the node's
    ranks; 0 where unknown (no host-memory limit is then applied).
    """

    name: str
    peak_flops: float
    memory_bandwidth: float
    memory_capacity: float
    intra_node_bandwidth: float
    intra_node_latency: float
    inter_node_bandwidth: float
    inter_node_latency: float
    gpus_per_node: int
    layer_overhead_s: float = 1e-4
    host_link_bandwidth: float = 50 * GB
    host_memory_bandwidth: float = 75 * GB
    host_memory_per_node: float = 0.0

    def __post_init__(self) -> None:
        for field_name in (
            "peak_flops", "memory_bandwidth", "memory_capacity",
            "intra_node_bandwidth", "inter_node_bandwidth", "host_link_bandwidth", "host_memory_bandwidth",
        ):
            if getattr(self, field_name) <= 0:
                raise ValueError(f"Hardware.{field_name} must be positive, got {getattr(self, field_name)!r}")
        if self.host_memory_per_node < 0:
            raise ValueError(f"Hardware.host_memory_per_node must be >= 0 (0: unknown), got {self.host_memory_per_node!r}")
        if self.gpus_per_node < 1:
            raise ValueError(f"Hardware.gpus_per_node must be >= 1, got {self.gpus_per_node}")

    # Presets: ``Hardware.H200`` and ``Hardware.H100`` (instances, attached below the class).
    H200: ClassVar["Hardware"]
    H100: ClassVar["Hardware"]

    @classmethod
    def this_cpu(cls, measure: bool = False) -> "Hardware":
        """The present CPU, treating each process as one "device".

        By default from constants (cores x a nominal 16 FLOP/cycle at 2 GHz, 10 GB/s per process of
        memory bandwidth, shared-memory and 10 GbE links) so that every rank gets the same record.
        ``measure=True`` times a small matmul and a copy (about 0.1 s); use it for a one-off
        calibration on one rank, not for planning on many.
        """
        threads = max(1, _torch_threads())
        peak_flops = threads * 16 * 2.0e9
        memory_bandwidth = 10 * GB
        if measure:
            peak_flops, memory_bandwidth = _measure_cpu()
        ranks_per_node = int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)
        return cls(
            name="cpu",
            peak_flops=peak_flops,
            memory_bandwidth=memory_bandwidth,
            memory_capacity=float(_physical_memory_bytes()) / max(1, ranks_per_node),
            intra_node_bandwidth=5 * GB,
            intra_node_latency=50e-6,
            inter_node_bandwidth=1.25 * GB,
            inter_node_latency=100e-6,
            gpus_per_node=max(1, ranks_per_node),
            layer_overhead_s=2e-4,
            host_link_bandwidth=memory_bandwidth,  # "offloading" a CPU's tensors is a copy in the same memory
            host_memory_bandwidth=memory_bandwidth,
        )

    @classmethod
    def detect(cls) -> "Hardware":
        """The device this process trains on: a preset when the GPU is one we know (with its real
        memory size), a generic GPU record otherwise, else ``this_cpu()``."""
        try:
            import torch
        except ImportError:  # pragma: no cover - torch is a dependency
            return cls.this_cpu()
        if not torch.cuda.is_available():
            return cls.this_cpu()
        properties = torch.cuda.get_device_properties(torch.cuda.current_device())
        device_name = properties.name
        per_node = int(os.environ.get("LOCAL_WORLD_SIZE", "0") or 0) or torch.cuda.device_count()
        if "H200" in device_name:
            base = cls.H200
        elif "H100" in device_name:
            base = cls.H100
        else:
            log.warning(
                "unknown GPU %r: using generic peak numbers (calibrate the cost model for a better plan)",
                device_name,
            )
            base = replace(
                cls.H100, name=device_name, peak_flops=200e12, memory_bandwidth=1.5e12,
                intra_node_bandwidth=100 * GB, inter_node_bandwidth=12.5 * GB,
            )
        return replace(base, memory_capacity=float(properties.total_memory), gpus_per_node=max(1, per_node))

    # ------------------------------------------------------------------ links
    def all_to_all_seconds(self, bytes_per_rank: float, group_size: int) -> float:
        """Time of one all-to-all in which each of ``group_size`` aligned ranks sends
        ``bytes_per_rank`` spread evenly over the group (a share stays local).

        Inside a node every peer is reached over NVLink; a group larger than a node sends the
        off-node share over the slower NIC, and the slower of the two paths decides.
        """
        if group_size <= 1 or bytes_per_rank <= 0:
            return 0.0
        chunk = bytes_per_rank / group_size
        on_node_peers = min(group_size, self.gpus_per_node) - 1
        off_node_peers = group_size - 1 - on_node_peers
        intra = on_node_peers * chunk / self.intra_node_bandwidth
        inter = off_node_peers * chunk / self.inter_node_bandwidth
        latency = self.inter_node_latency if off_node_peers else self.intra_node_latency
        return latency + max(intra, inter)

    def all_to_all_latency(self, group_size: int) -> float:
        """The fixed part of one all-to-all on an aligned group of ``group_size`` ranks."""
        if group_size <= 1:
            return 0.0
        return self.inter_node_latency if group_size > self.gpus_per_node else self.intra_node_latency

    def all_to_all_seconds_per_byte(self, group_size: int) -> float:
        """The size-proportional part of :meth:`all_to_all_seconds` per byte sent by one rank."""
        if group_size <= 1:
            return 0.0
        on_node_peers = min(group_size, self.gpus_per_node) - 1
        off_node_peers = group_size - 1 - on_node_peers
        return max(
            on_node_peers / self.intra_node_bandwidth,
            off_node_peers / self.inter_node_bandwidth,
        ) / group_size

    def all_reduce_seconds(self, total_bytes: float, world_size: int) -> float:
        """Ring all-reduce of ``total_bytes`` over ``world_size`` ranks (bandwidth-optimal:
        each rank moves 2 (P-1)/P of the buffer over the slowest link it uses)."""
        if world_size <= 1 or total_bytes <= 0:
            return 0.0
        bandwidth = self.inter_node_bandwidth if world_size > self.gpus_per_node else self.intra_node_bandwidth
        latency = self.inter_node_latency if world_size > self.gpus_per_node else self.intra_node_latency
        return 2 * latency * (world_size - 1) + 2 * (world_size - 1) / world_size * total_bytes / bandwidth

    def all_gather_seconds(self, total_bytes: float, world_size: int, calls: int = 1) -> float:
        """Ring all-gather (or reduce-scatter: the same traffic) of a ``total_bytes`` buffer over
        ``world_size`` ranks in ``calls`` collectives: each rank moves (P-1)/P of the buffer over
        the slowest link it uses, and each call pays the ring's latency (FSDP2 issues one per
        sharded module)."""
        if world_size <= 1 or total_bytes <= 0:
            return 0.0
        bandwidth = self.inter_node_bandwidth if world_size > self.gpus_per_node else self.intra_node_bandwidth
        latency = self.inter_node_latency if world_size > self.gpus_per_node else self.intra_node_latency
        return calls * latency * (world_size - 1) + (world_size - 1) / world_size * total_bytes / bandwidth

    reduce_scatter_seconds = all_gather_seconds

    # ------------------------------------------------------------------ io
    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Hardware":
        return cls(**data)


MiB = 2**20
# Memory capacities are what the device reports (``torch.cuda.get_device_properties().total_memory``,
# which ``Hardware.detect`` reads on the device itself), not the marketed decimal gigabytes: the
# planner's cap is a fraction of this number, so a rounded-down figure wastes memory and a
# rounded-up one admits plans that do not fit.
# H100 80GB HBM3: 85,520,809,984 bytes = 81,559 MiB (torch's total_memory; nvidia-smi shows the
# same 81559MiB), not 80e9.
H100_MEMORY_BYTES = 81_559 * MiB
# H200 141GB HBM3e: a published ``_CudaDeviceProperties(name='NVIDIA H200', ..., total_memory=143156MB)``
# (torch prints MiB) is the one torch figure found; nvidia-smi on H200 SXM boards shows 143771MiB.
# The lower, torch-reported one is used: 150,109,945,856 bytes (141e9 was 6% under it).
H200_MEMORY_BYTES = 143_156 * MiB
# NVIDIA H200 SXM: 989 TFLOP/s dense bf16, 4.8 TB/s HBM3e, 141 GB; NVLink 4 (450 GB/s one way) inside
# an 8-GPU node, one 400 Gb/s InfiniBand NIC per GPU across nodes. Host side (the defaults): PCIe 5.0
# x16 to the host, 64 GB/s one way raw, about 50 GB/s achieved; a DGX H100/H200's two Xeon 8480C
# with 8 DDR5-4800 channels each (2 x 307 GB/s) shared by 8 GPUs: about 75 GB/s per GPU, and 2 TB
# of host memory (the DGX H100 / H200 datasheets' "system memory").
H200 = Hardware(
    name="H200",
    peak_flops=989e12,
    memory_bandwidth=4.8e12,
    memory_capacity=float(H200_MEMORY_BYTES),
    intra_node_bandwidth=450 * GB,
    intra_node_latency=10e-6,
    inter_node_bandwidth=50 * GB,
    inter_node_latency=25e-6,
    gpus_per_node=8,
    host_memory_per_node=2e12,
)
# NVIDIA H100 SXM: like the H200 but 3.35 TB/s HBM3 and 80 GB (81,559 MiB as the device reports it).
H100 = replace(H200, name="H100", memory_bandwidth=3.35e12, memory_capacity=float(H100_MEMORY_BYTES))
Hardware.H200 = H200
Hardware.H100 = H100


def preset_for_device_name(name: str) -> Hardware:
    """The preset of a chip named by ``torch.cuda.get_device_name()`` (e.g. "NVIDIA H100 80GB HBM3").

    Benchmarks that replay or price plans on a lent GPU must use that GPU's figures, not a fixed
    H200: an "H200" or "H100" in the name (case-insensitive) gives that preset; any other name (a
    CPU, an unknown GPU) gives :meth:`Hardware.detect`, the device this process actually runs on.
    """
    upper = name.upper()
    if "H200" in upper:
        return H200
    if "H100" in upper:
        return H100
    log.info("no preset for device %r: using Hardware.detect()", name)
    return Hardware.detect()


def _torch_threads() -> int:
    try:
        import torch

        return torch.get_num_threads()
    except ImportError:  # pragma: no cover
        return os.cpu_count() or 1


def _physical_memory_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # pragma: no cover - non-POSIX
        return 16 * 1024**3


def _measure_cpu() -> tuple[float, float]:
    """Best-of-a-few timings of a 256x256 fp32 matmul and a 32 MB copy."""
    import torch

    size = 256
    a = torch.randn(size, size)
    b = torch.randn(size, size)
    best = float("inf")
    for _ in range(10):
        start = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - start)
    flops = 2 * size**3 / max(best, 1e-9)
    source = torch.empty(8 * 1024 * 1024)
    target = torch.empty_like(source)
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        target.copy_(source)
        best = min(best, time.perf_counter() - start)
    bandwidth = 2 * source.numel() * source.element_size() / max(best, 1e-9)
    return flops, bandwidth
