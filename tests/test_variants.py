"""Length buckets, dcp.use and recompute variants: one trace, every variant at parity."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

import dcp_compile as dcp
from dcp_compile.testing.process_world import run_in_process_world
from sharding_checks import sharding_problems
from model_zoo import ZOO
from parity import compare, compiled_run, eager_reference

BUCKETS = [
    {"max_len": 24, "sp_size": 1, "recompute": "none"},
    {"max_len": 40, "sp_size": 2, "recompute": "attention"},
    {"max_len": None, "sp_size": 2, "recompute": "full"},
]
# 20 distinct lengths over the three buckets; every rank's chunk holds >= 2 tokens.
LENGTHS = [13, 9, 10, 11, 14, 17, 19, 22, 24, 25, 27, 30, 33, 38, 40, 41, 47, 49, 55, 63]


def _trace_once_worker(rank, world_size, inner):
    case = ZOO["gpt"]
    model = case.build()
    compiled = torch.compile(model, backend="dcp", dynamic=True, options={"inner": inner, "buckets": BUCKETS})
    problems = []
    for index, length in enumerate(LENGTHS):
        alone = length <= 24  # SP=1: each rank computes the whole batch by itself
        actual = compiled_run(model, compiled, case, case.make_inputs(length), reduce=not alone)
        problems += compare("gpt", length, eager_reference(case, length), actual)
        if index == 0:
            torch.compiler.set_stance("fail_on_recompile")
    torch.compiler.set_stance("default")
    record = dcp.explain(compiled, **case.make_inputs(30))
    assert len(record) == 1, "more than one graph: the model was traced again"
    chosen = {str(v) for v in record[0].variants}
    problems += sharding_problems(record, 0)  # every SP 2 variant sharded every site, no gather
    if problems:
        raise AssertionError("\n".join(problems))
    return sorted(chosen)


def test_trace_once_over_three_buckets():
    results = run_in_process_world(_trace_once_worker, 2, "eager", timeout=900)
    assert results[0] == sorted(["sp=1/recompute=none", "sp=2/recompute=attention", "sp=2/recompute=full"])


def _different_variants_worker(rank, world_size):
    case = ZOO["gpt"]
    model = case.build()
    compiled = torch.compile(model, backend="dcp", dynamic=True, options={"inner": "eager"})
    problems = []
    # Step 1: each rank alone (SP=1), each on its own length: no collective may be issued.
    length = 11 if rank == 0 else 17
    with dcp.use(dcp.Variant(sp_size=1)):
        actual = compiled_run(model, compiled, case, case.make_inputs(length), reduce=False)
    problems += compare("gpt-sp1", length, eager_reference(case, length), actual)
    # Step 2: both ranks in one SP=2 group on the same batch.
    with dcp.use(dcp.Variant(sp_size=2)):
        actual = compiled_run(model, compiled, case, case.make_inputs(21))
    problems += compare("gpt-sp2", 21, eager_reference(case, 21), actual)
    if problems:
        raise AssertionError("\n".join(problems))
    return True


def test_ranks_on_different_variants_in_one_step():
    assert run_in_process_world(_different_variants_worker, 2, timeout=600) == [True, True]


def _recompute_parity_worker(rank, world_size):
    """Recompute policies change what backward recomputes: gradients must not change."""
    case = ZOO["gpt"]
    model = case.build()
    compiled = torch.compile(model, backend="dcp", dynamic=True, options={"inner": "aot_eager"})
    problems = []
    for variant, length in ((dcp.Variant(1, "attention"), 14), (dcp.Variant(2, "attention"), 19),
                            (dcp.Variant(2, "selective"), 23), (dcp.Variant(2, "full"), 17)):
        with dcp.use(variant):
            actual = compiled_run(model, compiled, case, case.make_inputs(length), reduce=variant.sp_size > 1)
        problems += compare(f"gpt-{variant}", length, eager_reference(case, length), actual)
    if problems:
        raise AssertionError("\n".join(problems))
    return True


@pytest.mark.slow
def test_recompute_policies_keep_parity_through_the_partitioner():
    assert run_in_process_world(_recompute_parity_worker, 2, timeout=900) == [True, True]


def _world_of_three_worker(rank, world_size):
    """3 ranks: SP 2 on ranks 0-1 (one batch), SP 1 on rank 2 (another), in the same step."""
    from dcp_compile.runtime.process_groups import sp_group

    case = ZOO["gpt"]
    model = case.build()
    compiled = torch.compile(model, backend="dcp", dynamic=True, options={"inner": "eager"})
    dcp.runtime.create_sp_groups()  # every group on every rank, before any rank reads its own
    sp_size, length = (2, 19) if rank < 2 else (1, 12)
    with dcp.use(dcp.Variant(sp_size)):
        group = sp_group(2).process_group if sp_size == 2 else None
        actual = compiled_run(model, compiled, case, case.make_inputs(length), group=group, reduce=sp_size > 1)
        record = dcp.explain(compiled, **case.make_inputs(length))  # runs the model: inside dcp.use
    problems = compare(f"gpt-world3-sp{sp_size}", length, eager_reference(case, length), actual)
    if problems:
        raise AssertionError("\n".join(problems))
    variant = record[0].variants[dcp.Variant(sp_size)]
    return variant.collectives.get("all_to_all_single", 0) - variant.output_gathers


def test_sp_groups_that_do_not_tile_the_world():
    # Ulysses on ranks 0-1: 2 attentions x (q, k, v, out); rank 2 alone issues none
    assert run_in_process_world(_world_of_three_worker, 3, timeout=600) == [8, 8, 0]


def _inductor_worker(rank, world_size):
    case = ZOO["gpt"]
    model = case.build()
    compiled = torch.compile(model, backend="dcp", dynamic=True, options={
        "inner": "inductor", "buckets": [{"max_len": 16, "sp_size": 1}, {"max_len": None, "sp_size": 2}]})
    problems = []
    for length in (12, 23):
        actual = compiled_run(model, compiled, case, case.make_inputs(length), reduce=length > 16)
        problems += compare("gpt-inductor", length, eager_reference(case, length), actual, rtol=1e-4, atol=1e-5)
    if problems:
        raise AssertionError("\n".join(problems))
    return True


@pytest.mark.slow
def test_inductor_variants():
    assert run_in_process_world(_inductor_worker, 2, timeout=1200) == [True, True]


# --- recompute, on one process with a fake process group (structure only) ----------------------

@pytest.fixture(scope="module")
def recompute_records():
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    torch._dynamo.reset()
    try:
        case = ZOO["gpt"]
        model = case.build()
        # Compiled whole: these tests read the partitioner's forward and backward graphs (a regional
        # variant has neither; test_regional_saved_bytes.py counts what one keeps).
        compiled = torch.compile(model, backend="dcp", dynamic=True, options={
            "inner": "aot_eager", "regions": False, "buckets": [{"max_len": None, "sp_size": 2}]})
        records = {}
        for name in ("none", "attention", "selective", "full", "none@sp1", "attention@sp1"):
            policy, _, sp = name.partition("@sp")
            variant = dcp.Variant(int(sp or 2), policy)
            with dcp.use(variant):
                # Traced at 48 tokens: the saved bytes are read at the traced length, and there
                # per-token activations outweigh the constant-size RNG state a recomputed
                # attention keeps (5 KB per attention on CPU).
                outputs = compiled(**case.make_inputs(48))
                case.loss_of(outputs).backward()
                record = dcp.explain(compiled, **case.make_inputs(48))
            records[name] = record[0].variants[variant]
        yield records
    finally:
        dist.destroy_process_group()
        torch._dynamo.reset()


A2A = "_c10d_functional.all_to_all_single.default("


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["none", "attention", "selective", "full"])
def test_backward_sends_as_many_all_to_alls_as_forward(recompute_records, policy):
    record = recompute_records[policy]
    forward = record.forward_graph.count(A2A) - record.output_gathers  # outputs gather without autograd
    assert forward == record.backward_graph.count(A2A) == 8  # 2 attentions x (q, k, v, out)


ALL_REDUCE = "_c10d_functional.all_reduce.default("


@pytest.mark.slow
def test_returned_loss_needs_no_collective_in_backward(recompute_records):
    # The loss (a shard-local sum and count, all-reduced) is returned as it is: its gradient is the
    # same on every rank, so backward multiplies by P locally instead of all-reducing again.
    record = recompute_records["none"]
    assert record.forward_graph.count(ALL_REDUCE) == 1
    assert record.backward_graph.count(ALL_REDUCE) == 0


@pytest.mark.slow
def test_recompute_trades_saved_activations(recompute_records):
    saved = {policy: record.saved_activation_bytes for policy, record in recompute_records.items()}
    assert saved["none"] > saved["attention"] > saved["selective"] > saved["full"], saved


@pytest.mark.slow
def test_attention_recompute_saves_less_than_none(recompute_records):
    saved = {policy: record.saved_activation_bytes for policy, record in recompute_records.items()}
    assert saved["none"] > saved["attention"] > saved["full"], saved
    # what it gives up per attention: SDPA's output and logsumexp, [B, H/P, S, D + 1] floats
    # (batch 2, 2 local heads, 48 tokens, head dim 8, 2 attentions); besides, ``attention`` tiles
    # the loss (dcp_compile.tiled_loss), which drops the head's fp32 log-probabilities, at most
    # [48 local tokens, vocabulary 128] floats (tests/passes/test_tiled_loss.py checks which)
    attention_sites = 2 * (2 * 2 * 48 * (8 + 1) * 4)
    log_probabilities = 48 * 128 * 4
    assert attention_sites < saved["none"] - saved["attention"] <= attention_sites + log_probabilities + 8, saved
    # the generator state that lets recomputation repeat any dropout draw, and nothing else
    rng = {policy: record.saved_rng_state_bytes for policy, record in recompute_records.items()}
    assert rng["none"] == 0 and rng["attention"] == 2 * torch.get_rng_state().numel(), rng
    assert saved["none"] > saved["attention"] + rng["attention"], (saved, rng)


@pytest.mark.slow
def test_attention_recompute_without_sequence_parallelism_also_drops_projections(recompute_records):
    """At SP 1 there is no all-to-all to stop at: q, k, v are recomputed from the normed input."""
    saved = {name: record.saved_activation_bytes for name, record in recompute_records.items()}
    sdpa_outputs = 2 * (2 * 4 * 48 * (8 + 1) * 4)  # 2 attentions x [B, H, S, D + 1]
    qkv = 2 * (3 * 2 * 48 * 32 * 4)  # 2 attentions x 3 x [B, S, hidden]
    assert saved["none@sp1"] - saved["attention@sp1"] >= sdpa_outputs + qkv, saved
