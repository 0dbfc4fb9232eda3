"""``recompute="lean"`` (and ``offload``) at parity with eager: the MLPs tiled (``dcp::tiled_mlp``), whole blocks
checkpointed, their inputs offloaded to host memory.

On real gloo ranks (2, and 4 in the slow run; lengths that divide the SP size and that do not, and
one shorter than it: empty shares), for the zoo's GPT-style decoder and a Hugging Face Llama: the
outputs on every rank and the SP-summed parameter gradients equal eager's on the full batch, every
attention site ran sharded, and every layer's MLP was tiled (its op in the compiled forward, its
backward op in the compiled backward), with 2-token chunks so every rank's share splits into
several, the last one short. A model left untiled would be exact too: the records tell them apart.

On one process: TinyGPT (a plain GELU MLP with biases) at SP 1 under ``lean`` with 16-token chunks
over 100 tokens (seven chunks, the last of 4), loss and gradients against eager, under
``aot_eager`` and (slow) Inductor. Graph structure and the kernel: ``tests/passes/test_tiled_mlp.py``.
"""

from __future__ import annotations

import pytest
import torch

import dcp_compile as dcp
from dcp_compile.demo.example_models import TinyGPT
from dcp_compile.testing.process_world import run_in_process_world
from sharding_checks import sharding_problems
from model_zoo import ZOO
from parity import compare, compiled_run, eager_reference

CHUNK = 2


def _lean_parity_worker(rank: int, world_size: int, names: list[str], lengths: list[int],
                        policy: str = "lean") -> dict[str, int]:
    torch.manual_seed(0)
    variant = dcp.Variant(world_size, policy)
    problems: list[str] = []
    checked = 0
    for name in names:
        case = ZOO[name]
        torch._dynamo.reset()
        model = case.build()
        compiled = torch.compile(model, backend="dcp", dynamic=True, options={"inner": "aot_eager",
                                                                            "mlp_chunk": CHUNK})
        for length in lengths:
            where = f"{name}/{policy}@{length}"
            try:
                with dcp.use(variant):
                    actual = compiled_run(model, compiled, case, case.make_inputs(length))
                    records = dcp.explain(compiled, **case.make_inputs(length))
            except Exception as error:  # noqa: BLE001 - every case reports
                problems.append(f"{where}: raised {type(error).__name__}: {error}")
                continue
            problems += compare(where, length, eager_reference(case, length), actual)
            problems += [f"{where}: {p}" for p in sharding_problems(records, case.gather_budget)]
            ran = [r for r in records.variant_records() if r.variant == variant]
            if not any(r.sharded_sites and r.is_sharded for r in ran):
                problems.append(f"{where}: no attention site ran sharded: {[r.summary() for r in ran]}")
            # The blocks' kept inputs went to the host (forward) and came back (backward). What
            # stays is what the partitioner cannot offload (views: HF Llama's RoPE cos and sin).
            offloaded = [r for r in ran if r.offloaded_activation_bytes > 4 * r.saved_activation_bytes
                         and "cpu_offload_" in r.forward_graph and "gpu_reload_" in (r.backward_graph or "")]
            if not offloaded:
                problems.append(f"{where}: the block inputs were not offloaded: "
                                f"{[(r.saved_activation_bytes, r.offloaded_activation_bytes) for r in ran]}")
            tiled = [note for r in ran for note in r.tiled_mlps]
            if policy == "offload":
                if tiled:
                    problems.append(f"{where}: offload tiled MLPs: {tiled}")
                checked += 1
                continue
            if len(tiled) != 2 or not all(f"over {CHUNK}-token chunks" in note for note in tiled):
                problems.append(f"{where}: expected its 2 layers' MLPs tiled, got {tiled} "
                                f"(refused: {[r.untiled_mlps for r in ran]})")
            forward = sum(r.forward_graph.count("dcp.tiled_mlp.default(") for r in ran)
            backward = sum((r.backward_graph or "").count("dcp.tiled_mlp_backward.default(") for r in ran)
            if forward != 2 or backward != 2:
                problems.append(f"{where}: {forward} tiled MLP ops in the compiled forward, {backward} backward ops "
                                "in the compiled backward (expected 2 and 2)")
            checked += 1
    if problems:
        raise AssertionError(f"rank {rank}: {len(problems)} problem(s):\n" + "\n".join(problems))
    return {"checked": checked}


def run_lean_parity(world_size: int, names: list[str], lengths: list[int], policy: str = "lean") -> None:
    results = run_in_process_world(_lean_parity_worker, world_size, names, lengths, policy, timeout=1800)
    assert all(result["checked"] == len(names) * len(lengths) for result in results), results


@pytest.mark.slow
def test_gpt_and_llama_on_two_ranks() -> None:
    pytest.importorskip("transformers", reason="the Hugging Face Llama needs `pip install .[hf]`")
    run_lean_parity(2, ["gpt", "hf_llama"], [12, 7])


def test_offload_alone_on_two_ranks() -> None:
    """``offload``: ``block`` with its kept inputs in host memory, the MLPs left whole."""
    run_lean_parity(2, ["gpt"], [12, 7], policy="offload")


@pytest.mark.slow
def test_offload_alone_on_four_ranks() -> None:
    pytest.importorskip("transformers", reason="the Hugging Face Llama needs `pip install .[hf]`")
    run_lean_parity(4, ["gpt", "hf_llama"], [16, 7, 3], policy="offload")


@pytest.mark.slow
def test_gpt_and_llama_on_four_ranks_uneven_and_empty_shares() -> None:
    # 7 splits 2/2/2/1 and 3 splits 1/1/1/0: short chunks and an empty share; Llama's 2 KV heads at SP 4.
    pytest.importorskip("transformers", reason="the Hugging Face Llama needs `pip install .[hf]`")
    run_lean_parity(4, ["gpt", "hf_llama"], [16, 7, 3])


def _tinygpt_at_sp1(inner: str, rtol: float, atol: float) -> None:
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = TinyGPT(vocab=96, hidden=32, layers=2, heads=4)
    ids = torch.randint(0, 96, (1, 100), generator=torch.Generator().manual_seed(0))
    parameters = list(model.parameters())
    expected = model(ids, ids)
    expected_grads = torch.autograd.grad(expected, parameters)
    compiled = torch.compile(model, backend="dcp", dynamic=True, options={
        "inner": inner, "sp_size": 1, "recompute": "lean", "mlp_chunk": 16})
    loss = compiled(ids, ids)
    grads = torch.autograd.grad(loss, parameters)
    (record,) = dcp.explain(compiled, ids, ids).variant_records()
    assert len(record.tiled_mlps) == 2, (record.tiled_mlps, record.untiled_mlps)
    assert all("gelu MLP of width 128 tiled over 16-token chunks" in note for note in record.tiled_mlps)
    assert record.untiled_mlps == []
    torch.testing.assert_close(loss, expected, rtol=rtol, atol=atol)
    for (name, _), got, want in zip(model.named_parameters(), grads, expected_grads):
        torch.testing.assert_close(got, want, rtol=rtol, atol=atol, msg=lambda m: f"{name}: {m}")
    torch._dynamo.reset()


def test_tinygpt_at_sp1_over_several_chunks() -> None:
    _tinygpt_at_sp1("aot_eager", rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_tinygpt_at_sp1_under_inductor() -> None:
    _tinygpt_at_sp1("inductor", rtol=1e-4, atol=1e-5)
