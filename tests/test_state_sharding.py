"""Model state sharded during the step (ZeRO-3): what the cost model charges and how plans run.

The cost model (``CostModel.state_sharding``): per-rank bytes of parameters, gradients and
optimizer state under ``replicated`` / ``sharded`` / ``sharded_offload``, what is unsharded while a
micro-batch runs, and the per-round all-gathers and reduce-scatters in every micro-batch's fixed
time. The planner: under a sharded state every plan runs in rounds, every rank the same count.
"""

from __future__ import annotations

import pytest

from dcp_compile.schedule.analytic import (
    StateSharding,
    block_state_fraction,
    memory_coefficients,
    unsharded_state_bytes,
)
from dcp_compile.schedule.cost_model import CostModel, ModelProfile
from dcp_compile.schedule.hardware import Hardware

LLAMA = ModelProfile.from_config("llama-3-8b")


def llama(world: int, mode: str, hardware: Hardware = Hardware.H100) -> CostModel:
    return CostModel(LLAMA, hardware, optimizer_shards=world, state_sharding=mode)


# --- memory ---------------------------------------------------------------------------------------


def test_a_block_of_llama_3_8b_is_its_attention_and_gated_mlp() -> None:
    h, kv, ffn = 4096, 8 * 128, 14336
    block = 2 * h * h + 2 * h * kv + 3 * h * ffn  # 218,103,808 parameters
    assert block_state_fraction(LLAMA) == pytest.approx(block * 2 / LLAMA.parameter_bytes)
    # The root keeps the embeddings and the head (2 x 128256 x 4096; the profile counts no norms).
    root = 1 - LLAMA.num_layers * block_state_fraction(LLAMA)
    assert root * LLAMA.parameter_bytes / 2 == pytest.approx(2 * 128256 * 4096, rel=1e-9)
    assert unsharded_state_bytes(LLAMA) == pytest.approx(
        (root + 2 * block_state_fraction(LLAMA)) * (LLAMA.parameter_bytes + LLAMA.gradient_bytes))


def test_replicated_state_is_what_it_was() -> None:
    """The default keeps every plan made before this mode existed: whole parameters and gradients,
    the optimizer divided by ``optimizer_shards``."""
    for world in (1, 8):
        model = CostModel(LLAMA, Hardware.H100, optimizer_shards=world)
        assert model.state_sharding is StateSharding.REPLICATED and not model.rounds
        expected = LLAMA.parameter_bytes + LLAMA.gradient_bytes + LLAMA.optimizer_bytes / world + model.reserved_bytes
        assert model.memory_coefficients(4, "full").fixed_bytes == pytest.approx(expected)
        assert model.memory_coefficients(4, "none").fixed_bytes == pytest.approx(expected)
        assert model.state_round_seconds() == 0.0


@pytest.mark.parametrize("world", [1, 8, 32])
def test_sharded_state_divides_everything_over_the_world_plus_what_runs_unsharded(world: int) -> None:
    sharded = llama(world, "sharded")
    state = LLAMA.parameter_bytes + LLAMA.gradient_bytes + LLAMA.optimizer_bytes
    in_flight = unsharded_state_bytes(LLAMA)
    assert sharded.model_state_bytes() == pytest.approx(state / world + in_flight)
    assert sharded.memory_coefficients(2, "block").fixed_bytes == pytest.approx(
        state / world + in_flight + sharded.reserved_bytes)
    # The per-token terms do not depend on where the state lives.
    replicated = llama(world, "replicated")
    assert sharded.memory_coefficients(2, "block").bytes_per_token == replicated.memory_coefficients(2, "block").bytes_per_token
    offloaded = llama(world, "sharded_offload")
    assert offloaded.model_state_bytes() == pytest.approx(in_flight)
    assert offloaded.host_state_bytes() == pytest.approx(state / world)
    assert sharded.host_state_bytes() == 0.0


def test_the_sharded_state_of_llama_3_8b_leaves_room_for_long_sequences() -> None:
    """Issue 37: 61 GB of a 72 GB cap on 8 H100s replicated; 27 GB sharded, 9 GB offloaded."""
    cap = 0.9 * Hardware.H100.memory_capacity
    assert llama(8, "replicated").model_state_bytes() > 60e9
    assert llama(8, "sharded").model_state_bytes() < 28e9
    assert llama(1, "sharded_offload").model_state_bytes() < 10e9
    for world in (8, 32):
        assert llama(world, "sharded").token_capacity(world, "block", cap) > 2 * llama(world, "replicated").token_capacity(world, "block", cap)
    assert llama(1, "replicated").token_capacity(1, "block", cap) == 0
    assert llama(1, "sharded_offload").token_capacity(1, "block", cap) > 10_000


def test_memory_coefficients_take_the_state_mode() -> None:
    base = memory_coefficients(LLAMA, 8, "full", optimizer_shards=8)
    sharded = memory_coefficients(LLAMA, 8, "full", optimizer_shards=8, state_sharding="zero3")
    assert sharded.fixed_bytes < base.fixed_bytes and sharded.bytes_per_token == base.bytes_per_token


# --- time -----------------------------------------------------------------------------------------


def test_every_micro_batch_pays_the_rounds_all_gathers_and_reduce_scatters() -> None:
    hardware = Hardware.H100
    for world in (8, 32):
        sharded, replicated = llama(world, "sharded"), llama(world, "replicated")
        extra = sharded.time_coefficients(2, "full").fixed - replicated.time_coefficients(2, "full").fixed
        assert extra == pytest.approx(sharded.state_round_seconds())
        assert sharded.time_coefficients(2, "full").per_token == replicated.time_coefficients(2, "full").per_token
    # Forward and backward all-gather the blocks' bf16 parameters (the root's once), backward
    # reduce-scatters the fp32 gradients; at 8 ranks over NVLink:
    root = 1 - LLAMA.num_layers * block_state_fraction(LLAMA)
    gathered = (2 - root) * LLAMA.parameter_bytes
    bandwidth_seconds = 7 / 8 * (gathered + LLAMA.gradient_bytes) / hardware.intra_node_bandwidth
    latency_seconds = 3 * (LLAMA.num_layers + 1) * 7 * hardware.intra_node_latency
    assert llama(8, "sharded").state_round_seconds() == pytest.approx(
        (bandwidth_seconds + latency_seconds) / 0.70, rel=1e-6)
    # Across nodes the NIC decides: much slower per round.
    assert llama(32, "sharded").state_round_seconds() > 5 * llama(8, "sharded").state_round_seconds()
    # One rank: nothing to gather, unless the shards live on the host.
    assert llama(1, "sharded").state_round_seconds() == 0.0
    assert llama(1, "sharded_offload").state_round_seconds() == pytest.approx(
        (2 - root + 1) * LLAMA.gradient_bytes / hardware.host_link_bandwidth / 0.70)


def test_the_optimizer_step_on_the_host_is_stated() -> None:
    offloaded, sharded = llama(1, "sharded_offload"), llama(8, "sharded")
    moved = 2 * LLAMA.optimizer_bytes + LLAMA.gradient_bytes + LLAMA.parameter_bytes
    assert offloaded.optimizer_step_seconds() == pytest.approx(moved / Hardware.H100.host_memory_bandwidth / 0.70)
    assert sharded.optimizer_step_seconds() == pytest.approx(moved / 8 / Hardware.H100.memory_bandwidth / 0.70)


# --- parsing and files ----------------------------------------------------------------------------


def test_state_sharding_names() -> None:
    assert StateSharding.parse("ZeRO-3") is StateSharding.SHARDED
    assert StateSharding.parse("zero3+offload") is StateSharding.SHARDED_OFFLOAD
    assert StateSharding.parse(StateSharding.REPLICATED) is StateSharding.REPLICATED
    with pytest.raises(ValueError, match="unknown state_sharding"):
        StateSharding.parse("zero-2")
    with pytest.raises(ValueError, match="unknown state_sharding"):
        CostModel(LLAMA, Hardware.H100, state_sharding="everywhere")


def test_a_saved_cost_model_keeps_its_state_mode(tmp_path) -> None:
    model = llama(8, "sharded_offload")
    model.save(tmp_path / "model.json")
    loaded = CostModel.load(tmp_path / "model.json")
    assert loaded.state_sharding is StateSharding.SHARDED_OFFLOAD
    assert loaded.memory_coefficients(8, "block").fixed_bytes == model.memory_coefficients(8, "block").fixed_bytes
    data = model.to_dict()
    del data["state_sharding"]  # a file written before the field existed
    assert CostModel.from_dict(data).state_sharding is StateSharding.REPLICATED


def test_hardware_records_without_host_figures_still_load() -> None:
    data = Hardware.H100.to_dict()
    del data["host_link_bandwidth"], data["host_memory_bandwidth"]
    assert Hardware.from_dict(data) == Hardware.H100


# --- plans in rounds ------------------------------------------------------------------------------

from dataclasses import replace  # noqa: E402

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from dcp_compile.schedule.cost_model import video_attention_span  # noqa: E402
from dcp_compile.schedule.plan import StepPlan  # noqa: E402
from dcp_compile.schedule.planner import Planner, PlanningError  # noqa: E402
from dcp_compile.schedule.rounds import round_times  # noqa: E402

VIDEO = ModelProfile.from_config("stdit3-xl/2")
TWO_PER_NODE = replace(Hardware.H200, gpus_per_node=2)  # 4+ ranks cross a "node": slow all-gathers


def check_rounds(cost: CostModel, schedule, lengths, spans, world: int) -> None:
    """Every rank the same count of rounds, at most one micro-batch per rank per round, no empty
    round, the step the sum of the rounds' longest micro-batches, everything fits and is priced."""
    schedule.validate(len(lengths))
    assert schedule.rounds >= 1 and schedule.rounds >= max(
        sum(1 for mb in schedule.microbatches if rank in mb.ranks) for rank in range(world))
    slots = [schedule.rank_rounds(rank) for rank in range(world)]  # raises on two in one round
    assert {len(s) for s in slots} == {schedule.rounds}
    for r in range(schedule.rounds):
        assert any(s[r] is not None for s in slots), f"round {r} is empty"
    times = round_times(schedule)
    assert schedule.makespan == pytest.approx(sum(times))
    assert schedule.makespan >= max(schedule.rank_loads()) * (1 - 1e-12)
    cap = 0.9 * cost.hardware.memory_capacity
    for mb in schedule.microbatches:
        mb_lengths = [lengths[p] for p in mb.positions]
        assert cost.peak_memory(mb_lengths, mb.sp_size, mb.recompute) <= cap, mb
        mb_spans = None if spans is None else [spans[p] for p in mb.positions]
        assert mb.predicted_time == pytest.approx(cost.time(mb_lengths, mb.sp_size, mb.recompute, mb_spans), rel=1e-9)
        # Every micro-batch pays the round's state collectives.
        assert mb.predicted_time >= cost.state_round_seconds()


@st.composite
def sharded_steps(draw):
    world = draw(st.sampled_from([1, 2, 4, 8, 16]))
    mode = draw(st.sampled_from(["sharded", "sharded_offload"]))
    hardware = draw(st.sampled_from([Hardware.H100, TWO_PER_NODE]))
    if draw(st.booleans()):
        frames, height, width = zip(*draw(st.lists(st.sampled_from(
            [(1, 9, 16), (15, 15, 27), (30, 23, 40), (60, 30, 54), (120, 45, 80)]), min_size=1, max_size=40)))
        lengths = [t * h * w for t, h, w in zip(frames, height, width)]
        spans = [video_attention_span(t, h, w) for t, h, w in zip(frames, height, width)]
        profile = VIDEO
    else:
        lengths = draw(st.lists(st.sampled_from([128, 700, 2048, 5000, 16384, 40000, 100_000]), min_size=1, max_size=60))
        spans, profile = None, LLAMA
    return CostModel(profile, hardware, optimizer_shards=world, state_sharding=mode), world, lengths, spans


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=sharded_steps())
def test_every_rank_runs_the_same_number_of_rounds(case) -> None:
    cost, world, lengths, spans = case
    try:
        schedule = Planner(cost, world).plan(lengths, spans)
    except PlanningError:
        return  # a sequence fits on no group of this world
    check_rounds(cost, schedule, lengths, spans, world)
    plans = [StepPlan.from_schedule(schedule, step=0, epoch=0, rank=rank, indices=range(len(lengths)), lengths=lengths)
             for rank in range(world)]
    assert {plan.num_rounds for plan in plans} == {schedule.rounds}
    for plan in plans:
        assert len(plan.rounds) == schedule.rounds
        assert [mb for mb in plan.rounds if mb is not None] == list(plan.microbatches)  # run in round order
        for r, mb in enumerate(plan.rounds):
            if mb is not None:
                assert mb.round == r and plan.rank in mb.group_ranks
                for peer in mb.group_ranks:  # the whole group runs it in the same round
                    assert plans[peer].rounds[r] == mb
    assert len({plan.plan_hash() for plan in plans}) == 1


def test_a_replicated_plan_has_no_rounds() -> None:
    schedule = Planner(CostModel(LLAMA, Hardware.H100, optimizer_shards=8), 8).plan([4096] * 40)
    assert schedule.rounds == 0
    plan = StepPlan.from_schedule(schedule, step=0, epoch=0, rank=0, indices=range(40), lengths=[4096] * 40)
    assert plan.num_rounds == 0 and plan.rounds == () and all(mb.round == -1 for mb in plan.microbatches)


def test_the_planner_refuses_a_state_sharded_over_another_world() -> None:
    with pytest.raises(ValueError, match="optimizer_shards=8"):
        Planner(llama(4, "sharded"), 8)


def test_dearer_rounds_make_fewer_larger_micro_batches() -> None:
    """The planner trades micro-batch count against the round's collectives: the same step on a
    slower network (every round's all-gathers and reduce-scatters cost more) packs into fewer
    rounds, and it is never planned in more rounds than there are micro-batches on a rank."""
    # 250k tokens per rank: more than one round holds at SP 1 on the fast link. (30 x 20k, the step
    # this test used first, now packs into one round on either link: dynamic CP under full recompute,
    # a candidate since 052d8c7, beats the two rounds at SP 2 the planner chose before.)
    lengths = [50_000] * 40
    fast_model = llama(8, "sharded", TWO_PER_NODE)
    fast = Planner(fast_model, 8).plan(lengths)
    check_rounds(fast_model, fast, lengths, None, 8)
    slow_link = replace(TWO_PER_NODE, inter_node_bandwidth=TWO_PER_NODE.inter_node_bandwidth / 20)
    slow_model = llama(8, "sharded", slow_link)
    assert slow_model.state_round_seconds() > 10 * fast_model.state_round_seconds()
    slow = Planner(slow_model, 8).plan(lengths)
    check_rounds(slow_model, slow, lengths, None, 8)
    assert slow.rounds < fast.rounds, (slow.rounds, fast.rounds)  # 1 against 2 at this commit
    # 8 micro-batches against 16 at this commit: the slow link's hold twice the tokens (offloading
    # block inputs to fit them), the fast link's run at SP 1 under full recompute in two rounds
    assert len(slow.microbatches) <= len(fast.microbatches)


def test_rounds_keep_long_micro_batches_together() -> None:
    """A round takes its longest micro-batch, so long ones share rounds: rank 0 runs 10 s then 1 s,
    rank 1 (in plan order) 1 s then 10 s, and an SP-2 micro-batch of 4 s; rounds in plan order
    would cost 10 + 10 + 4, longest first costs 10 + 4 + 1."""
    from dcp_compile.schedule.plan import Schedule, ScheduledMicroBatch
    from dcp_compile.schedule.rounds import assign_rounds
    from dcp_compile.variant import RecomputePolicy

    def mb(position: int, size: int, first: int, seconds: float) -> ScheduledMicroBatch:
        return ScheduledMicroBatch([position], size, first, RecomputePolicy.NONE, seconds, 1)

    schedule = assign_rounds(Schedule(2, [mb(0, 1, 0, 10.0), mb(1, 1, 0, 1.0), mb(2, 1, 1, 1.0), mb(3, 1, 1, 10.0),
                                          mb(4, 2, 0, 4.0)]))
    assert schedule.rounds == 3
    assert round_times(schedule) == [10.0, 4.0, 1.0]
    assert schedule.makespan == 15.0
    assert [m.round for m in schedule.microbatches] == [0, 2, 2, 0, 1]
