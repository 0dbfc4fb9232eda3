"""The tiled loss at parity with eager on real gloo ranks: loss (every output) on every rank and the
parameter gradients summed over the SP group, for TinyGPT (the demo's model: its loss only), the
zoo's GPT-style decoder and a Hugging Face Llama (both also return their logits), under a policy
that tiles (``attention``; ``block`` at SP > 1), with 4-token chunks so that every rank's share
splits into several chunks, the last one short, and a rank's share may be empty (3 tokens at SP 4).

Besides parity, every variant must be sharded (every attention site under its all-to-all) and hold
the tiled op in its compiled forward and its backward op in its compiled backward: a loss left as
it was is exact too, so parity alone would not tell. Hugging Face GPT-2 reaches the backend as two
graphs (a graph break in transformers' own code between the head and the loss): the loss graph
receives the logits as an input, so it is left as it is, with that reason on the record, and is
at parity too. Graph structure: ``tests/passes/test_tiled_loss.py``.
"""

from __future__ import annotations

import pytest
import torch

import dcp_compile as dcp
from dcp_compile.demo.example_models import TinyGPT
from dcp_compile.testing.process_world import run_in_process_world
from sharding_checks import sharding_problems
from model_zoo import ZOO, ZooCase, _ids_len
from parity import compare, compiled_run, eager_reference

CHUNK = 4



def tiled_op_runs(record) -> bool:
    """The tiled loss's op runs forward and backward: in the partitioned graphs of a variant compiled
    whole; in regions (the default) in the variant's graph, where it is an exchange region run as
    the op it is, its backward the op's own."""
    if record.compiled_in_regions:
        return "dcp.tiled_cross_entropy.default" in str(record.graph.code).replace("torch.ops.", "")
    return ("dcp.tiled_cross_entropy.default(" in record.forward_graph
            and "dcp.tiled_cross_entropy_backward.default(" in (record.backward_graph or ""))

def _tinygpt_inputs(seq_len: int, batch_size: int, generator: torch.Generator) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, 96, (batch_size, seq_len), generator=generator)
    labels = ids.clone()
    labels[:, ::5] = -100  # some targets ignored
    return {"input_ids": ids, "labels": labels}


CASES = {
    "tinygpt": ZooCase("tinygpt", lambda: TinyGPT(vocab=96, hidden=32, layers=2, heads=4), _tinygpt_inputs,
                       lambda loss: loss, _ids_len, causal=True),
    **{name: ZOO[name] for name in ("gpt", "hf_llama", "hf_gpt2")},
}
UNTILED = {"hf_gpt2": "the logits are an input of this graph"}  # the reason its loss graph gives


def _tiled_parity_worker(rank: int, world_size: int, names: list[str], lengths: list[int],
                         policies: list[str]) -> dict[str, int]:
    torch.manual_seed(0)
    problems: list[str] = []
    checked = 0
    for name in names:
        case = CASES[name]
        torch._dynamo.reset()
        model = case.build()
        compiled = torch.compile(model, backend="dcp", dynamic=True, options={"inner": "aot_eager",
                                                                            "loss_chunk": CHUNK})
        for policy in policies:
            variant = dcp.Variant(world_size, policy)
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
                with_loss = [r for r in ran if r.tiled_losses or r.untiled_losses]
                if not with_loss:
                    problems.append(f"{where}: no graph with a loss among {[r.summary() for r in ran]}")
                for record in with_loss:
                    if name in UNTILED:
                        reasons = [why for _, why in record.untiled_losses]
                        if record.tiled_losses or not reasons[0].startswith(UNTILED[name]):
                            problems.append(f"{where}: expected untiled ({UNTILED[name]}), got {record.tiled_losses} "
                                            f"{record.untiled_losses}")
                    elif not (record.tiled_losses and tiled_op_runs(record)):
                        problems.append(f"{where}: the tiled op is missing: {record.tiled_losses} {record.untiled_losses}")
                if world_size > 1 and not any(r.sharded_sites and r.is_sharded for r in ran):
                    problems.append(f"{where}: no attention site ran sharded: {[r.summary() for r in ran]}")
                checked += 1
    if problems:
        raise AssertionError(f"rank {rank}: {len(problems)} problem(s):\n" + "\n".join(problems))
    return {"checked": checked}


def run_tiled_parity(world_size: int, names: list[str], lengths: list[int], policies: list[str]) -> None:
    results = run_in_process_world(_tiled_parity_worker, world_size, names, lengths, policies, timeout=1800)
    assert all(result["checked"] == len(names) * len(lengths) * len(policies) for result in results), results


@pytest.mark.slow
def test_one_process() -> None:
    pytest.importorskip("transformers", reason="the Hugging Face Llama needs `pip install .[hf]`")
    run_tiled_parity(1, ["tinygpt", "gpt", "hf_llama"], [12, 7], ["attention", "full"])


@pytest.mark.slow
def test_two_ranks() -> None:
    pytest.importorskip("transformers", reason="the Hugging Face models need `pip install .[hf]`")
    run_tiled_parity(2, ["tinygpt", "hf_llama", "hf_gpt2"], [12, 7], ["selective", "block"])


@pytest.mark.slow
def test_four_ranks_uneven_and_empty_shares() -> None:
    # 7 tokens split 2/2/2/1 and 3 split 1/1/1/0: short chunks and an empty share; Llama's 2 KV heads at SP 4.
    pytest.importorskip("transformers", reason="the Hugging Face Llama needs `pip install .[hf]`")
    run_tiled_parity(4, ["tinygpt", "hf_llama"], [16, 7, 3], ["attention", "block"])
