"""``preset_for_device_name``: the benchmarks on a lent GPU price plans with that GPU's preset."""

from __future__ import annotations

import pytest
import torch

from dcp_compile.schedule.hardware import H100, H200, Hardware, preset_for_device_name


@pytest.mark.parametrize("name, expected", [
    ("NVIDIA H100 80GB HBM3", H100),
    ("NVIDIA H100 PCIe", H100),
    ("NVIDIA H200", H200),
    ("nvidia h200 nvl", H200),
])
def test_known_chip_names_give_their_preset(name: str, expected: Hardware) -> None:
    assert preset_for_device_name(name) is expected


def test_h100_and_h200_presets_differ_where_the_replay_reads_them() -> None:
    # Picking the wrong one would move memory caps and bandwidth terms: the two must not coincide.
    assert preset_for_device_name("NVIDIA H100 80GB HBM3").memory_capacity < preset_for_device_name("NVIDIA H200").memory_capacity
    assert preset_for_device_name("NVIDIA H100 80GB HBM3").memory_bandwidth < preset_for_device_name("NVIDIA H200").memory_bandwidth


def test_unknown_name_falls_back_to_the_detected_device(monkeypatch: pytest.MonkeyPatch) -> None:
    sentinel = Hardware.this_cpu()
    monkeypatch.setattr(Hardware, "detect", classmethod(lambda cls: sentinel))
    assert preset_for_device_name("cpu") is sentinel
    assert preset_for_device_name("NVIDIA A100-SXM4-80GB") is sentinel


def test_unknown_name_without_a_gpu_is_this_cpu() -> None:
    if torch.cuda.is_available():
        pytest.skip("a GPU is visible: detect() returns its record, not the CPU's")
    assert preset_for_device_name("cpu").name == "cpu"
