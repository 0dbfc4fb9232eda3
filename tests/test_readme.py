"""The guide's data-centric loop (docs/training.md, "The data-centric loop"), run as written on 2 gloo ranks.

A user's first contact with the project is that block: it must run with nothing but a model, a
dataset and the settings its ``# needs:`` line declares (its imports, its ``collate``, its cost
model measured on the model), and the step it takes must be the gradient of the mean token loss
over the global batch, which is what the guide says.

The fixtures: ``tokens_per_step`` 96 fits the tiny dataset (several steps per epoch);
``max_tokens_per_rank`` 32 caps a rank's tokens so that the planner puts the long samples on SP 2
groups (a tiny model on a CPU would otherwise fit everything at SP 1, and the test would not cover
the sharded variants); ``inner`` is ``eager`` in the quick run (Inductor's C++ compiles of every
variant take minutes on a small CPU) and ``inductor`` in the slow one. The block's AdamW uses
``eps=1e-6``: with 1e-8 an element whose gradient is fp32 rounding noise (a different summation
order) moves by about lr per step on either side, which says nothing about the gradients.
"""

from __future__ import annotations

import pytest
import torch

from dcp_compile.testing.process_world import run_in_process_world
from tiny_models import tiny_llama as shared_tiny_llama
from doc_blocks import doc_block, run_python_block

VOCAB = 64
LENGTHS = (12, 40, 20, 48, 16, 36, 9, 27, 30, 14)
TOKENS_PER_STEP = 96
MAX_TOKENS_PER_RANK = 32
ADAM_EPS = 1e-6


def guide_block() -> str:
    """The block, exactly as written; the reference below trains with the optimizer it builds."""
    block = doc_block("docs/training.md", "The data-centric loop")
    for expected in ("AdamW(model.parameters(), lr=1e-4, eps=1e-6)", "def collate(", "padding_value=-100"):
        assert expected in block, f"the guide's data-centric block lost {expected!r}"
    return block


def tiny_llama() -> torch.nn.Module:
    return shared_tiny_llama(VOCAB)


def dataset() -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(5)
    return [torch.randint(1, VOCAB, (n,), generator=generator) for n in LENGTHS]


def _run_block(rank: int, world_size: int, block: str, inner: str) -> dict:
    model = tiny_llama()  # no dcp.runtime.create_sp_groups(): iterating the block's sampler creates them
    namespace = run_python_block(block, "docs/training.md", model=model, dataset=dataset(), inner=inner,
                                 tokens_per_step=TOKENS_PER_STEP, max_tokens_per_rank=MAX_TOKENS_PER_RANK)
    sampler = namespace["sampler"]  # the block rebinds "model" to the compiled one; ``model`` is the module
    sp_sizes = sorted({group.sp_size for i in range(len(sampler)) for group in sampler.plan(i).groups})
    return {
        "epochs": sampler.epoch,
        "steps": len(sampler),
        "global_batches": [list(indices) for indices in sampler.steps(0)],
        "lengths": namespace["lengths"],
        "sp_sizes": sp_sizes,
        "parameters": {name: p.detach().tolist() for name, p in model.named_parameters()},
    }


@pytest.mark.parametrize("inner", ["eager", pytest.param("inductor", marks=pytest.mark.slow, id="inductor")])
def test_the_guide_data_centric_loop_runs_and_trains_the_global_batches(inner: str) -> None:
    results = run_in_process_world(_run_block, 2, guide_block(), inner, timeout=600)
    steps = results[0]["global_batches"]  # every step's samples, from the sampler the block built
    assert all(r["global_batches"] == steps and r["lengths"] == list(LENGTHS) for r in results)
    assert len(steps) >= 3

    # Eager, one process: the mean token loss over each step's global batch, the same collate.
    data = dataset()
    model = tiny_llama()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, eps=ADAM_EPS)
    for indices in steps:
        samples = [data[i] for i in indices]
        ids = torch.nn.utils.rnn.pad_sequence(samples, batch_first=True, padding_value=0)
        labels = torch.nn.utils.rnn.pad_sequence(samples, batch_first=True, padding_value=-100)
        model(input_ids=ids, labels=labels).loss.backward()
        optimizer.step()
        optimizer.zero_grad()

    for rank, result in enumerate(results):
        assert result["epochs"] == 1 and result["steps"] == len(steps), result
        assert 2 in result["sp_sizes"], f"rank {rank}: no SP-2 micro-batch was planned: {result['sp_sizes']}"
        for name, value in model.named_parameters():
            got = torch.tensor(result["parameters"][name])
            torch.testing.assert_close(got, value.detach(), rtol=1e-5, atol=1e-5,
                                       msg=lambda m: f"rank {rank} {name}: {m}")
