"""Host memory is a cap too: what ``offload`` and ``lean`` (and an offloaded optimizer) put there must fit.

``recompute=offload`` and ``lean`` move every block's kept input to host memory; under ZeRO-3 with
optimizer offload the state's shards live there as well. A node's host memory is shared by its
ranks (``Hardware.host_memory_per_node``, 2 TB on a DGX H100 / H200), so a plan whose device
memory fits can still not fit the host: ``CostModel.token_capacity`` and
``fastest_feasible_recompute`` take the lesser of the two.
"""

from __future__ import annotations

import math
from dataclasses import replace

from dcp_compile.schedule.cost_model import CostModel
from dcp_compile.schedule.hardware import Hardware
from dcp_compile.schedule.model_profile import ModelProfile

LLAMA = ModelProfile.from_config("llama-3-8b")
CAP = 0.9 * Hardware.H100.memory_capacity


def test_a_node_s_host_memory_is_shared_by_its_ranks() -> None:
    assert Hardware.H100.host_memory_per_node == Hardware.H200.host_memory_per_node == 2e12
    assert CostModel(LLAMA, Hardware.H100, optimizer_shards=1).host_memory_cap == 2e12
    assert CostModel(LLAMA, Hardware.H100, optimizer_shards=32).host_memory_cap == 2e12 / 8
    unknown = replace(Hardware.H100, host_memory_per_node=0.0)
    assert CostModel(LLAMA, unknown).host_memory_cap == math.inf


def test_offloaded_inputs_and_state_are_capped_by_the_host() -> None:
    generous = CostModel(LLAMA, Hardware.H100, optimizer_shards=8, state_sharding="sharded_offload")
    device_only = generous.memory_coefficients(8, "lean").token_capacity(CAP)
    assert generous.token_capacity(8, "lean", CAP) == device_only  # 250 GB a rank holds it
    # A host with 40 GB a rank: the state's shards (18 GB) leave 22 GB for 256 KB a token of a share.
    small = replace(generous, hardware=replace(Hardware.H100, host_memory_per_node=8 * 40e9))
    tokens = small.token_capacity(8, "lean", CAP)
    assert tokens < device_only
    assert small.host_peak([tokens], 8, "lean") <= small.host_memory_cap < small.host_peak([tokens + 8], 8, "lean")
    room = small.host_memory_cap - small.host_state_bytes()
    assert tokens == int(room / (LLAMA.host_activation_bytes_per_token("lean") / 8))
    # Policies that keep nothing on the host are capped by the device alone.
    assert small.token_capacity(8, "block", CAP) == small.memory_coefficients(8, "block").token_capacity(CAP)


def test_the_fastest_feasible_policy_respects_the_host() -> None:
    model = CostModel(LLAMA, Hardware.H100, optimizer_shards=8, state_sharding="sharded_offload")
    tokens = model.token_capacity(8, "block", CAP) + 100_000  # past block: only offload or lean hold it
    assert model.fastest_feasible_recompute(tokens, 8, CAP).value in ("offload", "lean")
    tight = replace(model, hardware=replace(Hardware.H100, host_memory_per_node=8 * 20e9))
    assert tight.fastest_feasible_recompute(tokens, 8, CAP) is None
