"""``recompute="block"``: whole blocks checkpointed, their all-to-alls sent again in backward.

Under ``block`` the recompute pass tags the collectives inside each block ``MUST_RECOMPUTE`` in the
block's region, so the compiled backward re-issues the block's forward all-to-alls instead of
keeping their outputs. That is only safe if every rank of the SP group issues the same
collectives in the same order in backward (their graphs differ in chunk sizes: uneven and empty
chunks): a rank that recomputed one collective more would hang the group. So this checks, on
real gloo ranks (2 and 4, lengths that divide the SP size, that do not, and shorter than it):

* parity: outputs on every rank and SP-summed gradients equal eager's, every attention sharded;
* the backward sends twice the forward's all-to-alls (its own and the re-sent ones) and every
  rank's backward lists the same collectives in the same order;

for a GPT-style model and a Hugging Face Llama (GQA 4/2: KV heads replicated at SP 4), under
``aot_eager`` and (slow) Inductor. What ``block`` keeps is checked against the cost model in
``tests/test_recompute_pricing.py``; regions compile it whole (below).
"""

from __future__ import annotations

import re

import pytest
import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

import dcp_compile as dcp
from dcp_compile.testing.process_world import run_in_process_world
from sharding_checks import sharding_problems
from model_zoo import ZOO
from parity import compare, compiled_run, eager_reference

A2A = "_c10d_functional.all_to_all_single.default("
COLLECTIVE = re.compile(r"torch\.ops\._c10d_functional\.(\w+)\.default\(")


def backward_collectives(backward_graph: str) -> list[str]:
    """The collectives a compiled backward issues, in order (op names; sizes differ per rank)."""
    return COLLECTIVE.findall(backward_graph)


def _block_parity_worker(rank: int, world_size: int, cases: list[str], lengths: list[int], inner: str,
                         rtol: float, atol: float) -> dict:
    torch.manual_seed(0)
    variant = dcp.Variant(world_size, "block")
    problems: list[str] = []
    sequences: dict[str, list[str]] = {}
    for name in cases:
        case = ZOO[name]
        torch._dynamo.reset()
        model = case.build()
        compiled = torch.compile(model, backend="dcp", dynamic=True, options={"inner": inner})
        for length in lengths:
            with dcp.use(variant):
                actual = compiled_run(model, compiled, case, case.make_inputs(length))
                records = dcp.explain(compiled, **case.make_inputs(length))
            problems += compare(f"{name}-block", length, eager_reference(case, length), actual, rtol, atol)
            problems += [f"{name}@{length}: {p}" for p in sharding_problems(records, case.gather_budget)]
        record = records.variant_records()
        (block,) = [r for r in record if r.variant == variant]
        forward = block.forward_graph.count(A2A) - block.output_gathers  # output gathers have no adjoint
        backward = block.backward_graph.count(A2A)
        if not (forward > 0 and backward == 2 * forward):
            problems.append(f"{name}: backward sends {backward} all-to-alls, forward {forward}: expected twice "
                            "(its own and the forward's again)")
        if not block.sharded_sites:
            problems.append(f"{name}: no attention site was sharded")
        sequences[name] = backward_collectives(block.backward_graph)
    if problems:
        raise AssertionError(f"rank {rank}: " + "\n".join(problems))
    return sequences


def run_block_parity(world_size: int, cases: list[str], lengths: list[int], inner: str = "aot_eager",
                     rtol: float = 1e-5, atol: float = 1e-5, timeout: int = 1200) -> None:
    results = run_in_process_world(_block_parity_worker, world_size, cases, lengths, inner, rtol, atol,
                                   timeout=timeout)
    for name in cases:  # every rank's backward issues the same collectives in the same order
        assert all(result[name] == results[0][name] for result in results), [r[name] for r in results]


@pytest.mark.slow
def test_gpt_and_llama_at_parity_on_two_ranks():
    pytest.importorskip("transformers", reason="the Hugging Face Llama needs `pip install .[hf]`")
    run_block_parity(2, ["gpt", "hf_llama"], [12, 7])


@pytest.mark.slow
def test_gpt_and_llama_at_parity_on_four_ranks_uneven_and_shorter_than_sp():
    # 7 splits 2/2/2/1 and 3 splits 1/1/1/0: uneven chunks and an empty one; Llama's 2 KV heads at P=4.
    pytest.importorskip("transformers", reason="the Hugging Face Llama needs `pip install .[hf]`")
    run_block_parity(4, ["gpt", "hf_llama"], [16, 7, 3])


@pytest.mark.slow
def test_inductor_on_two_ranks():
    pytest.importorskip("transformers", reason="the Hugging Face Llama needs `pip install .[hf]`")
    run_block_parity(2, ["gpt", "hf_llama"], [12, 7], inner="inductor", rtol=1e-4, atol=1e-5, timeout=2400)


@pytest.mark.slow
def test_inductor_on_four_ranks():
    pytest.importorskip("transformers", reason="the Hugging Face Llama needs `pip install .[hf]`")
    run_block_parity(4, ["gpt", "hf_llama"], [16, 7], inner="inductor", rtol=1e-4, atol=1e-5, timeout=2400)


def _ring_block_worker(rank: int, world_size: int, names: list[str], lengths: list[int]) -> dict:
    import ring_models

    variant = dcp.Variant(world_size, "block")
    problems, sequences = [], {}
    for name in names:
        torch._dynamo.reset()
        model = ring_models.build(name)
        compiled = torch.compile(model, backend="dcp", dynamic=True, options={"inner": "aot_eager"})
        for length in lengths:
            eager = ring_models.build(name)
            expected, expected_grads = ring_models._run(eager, eager, ring_models.make_input(length), reduce=False)
            with dcp.use(variant):
                out, grads = ring_models._run(model, compiled, ring_models.make_input(length), reduce=True)
                records = dcp.explain(compiled, ring_models.make_input(length))
            if not torch.allclose(out, expected, rtol=1e-5, atol=1e-5):
                problems.append(f"{name}@{length}: output differs")
            problems += [f"{name}@{length}: grad {k} differs" for k, want in expected_grads.items()
                         if not torch.allclose(grads[k], want, rtol=1e-5, atol=1e-5)]
            (record,) = [r for r in records.variant_records() if r.variant == variant]
            if not all("ring" in layout for _, layout, _ in record.attention_layouts):
                problems.append(f"{name}@{length}: not a ring layout: {record.attention_layouts}")
        sequences[name] = backward_collectives(record.backward_graph)
    if problems:
        raise AssertionError(f"rank {rank}: " + "\n".join(problems))
    return sequences


@pytest.mark.slow
def test_ring_and_hybrid_layouts_at_parity_on_four_ranks():
    """Two heads at SP 4: the ring (x4, GQA 2q/1kv) and ring x2 over Ulysses x2; under ``block`` the
    backward receives the ring's K/V blocks again instead of keeping them (priced in
    ``tests/test_memory_model.py``)."""
    names = ["causal_2h", "gqa_2q1kv_causal"]
    results = run_in_process_world(_ring_block_worker, 4, names, [16, 7], timeout=2400)
    for name in names:
        assert all(result[name] == results[0][name] for result in results), [r[name] for r in results]


# --- structure, on one process with a fake process group ---------------------------------------

@pytest.fixture(scope="module")
def fake_group():
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    torch._dynamo.reset()
    try:
        yield
    finally:
        dist.destroy_process_group()
        torch._dynamo.reset()


@pytest.mark.slow
def test_regions_compile_block_whole_and_say_why(fake_group):
    """Regions apply recomputation around each region at run time; a block spans several regions,
    cut at the very all-to-alls ``block`` re-sends, so the variant is compiled whole, as
    ``selective`` is, and its record says so."""
    case = ZOO["gpt"]
    compiled = torch.compile(case.build(), backend="dcp", dynamic=True, options={
        "inner": "aot_eager", "regions": True, "buckets": [{"max_len": None, "sp_size": 2}]})
    records = {}
    for policy in ("full", "block"):
        variant = dcp.Variant(2, policy)
        with dcp.use(variant):
            outputs = compiled(**case.make_inputs(24))
            case.loss_of(outputs).backward()
            record = dcp.explain(compiled, **case.make_inputs(24))
        records[policy] = record[0].variants[variant]
    assert records["full"].compiled_in_regions
    assert not records["block"].compiled_in_regions
    assert records["block"].regions.startswith("not used: recompute=block recomputes whole blocks"), records["block"].regions
    # compiled whole, it re-sends the all-to-alls: 2 attentions x (q, k, v, out), twice
    assert records["block"].backward_graph.count(A2A) == 16
