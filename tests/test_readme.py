"""The README's data-centric loop, copied out of README.md and run as written on 2 gloo ranks.

A user's first contact with the project is that block: it must run with nothing but a model and a
dataset (its imports, its ``collate``, its cost model measured on the model), and the step it takes
must be the gradient of the mean token loss over the global batch, which is what the README says.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from dcp_compile.testing.process_world import run_in_process_world

VOCAB = 64
LENGTHS = (12, 40, 20, 48, 16, 36, 9, 27, 30, 14)
TOKENS_PER_STEP = 96
MAX_TOKENS_PER_RANK = 32
ADAM_EPS = 1e-6


def readme_block(inner: str | None = None) -> str:
    """The block under "Data-centric training", with two test-sized substitutions.

    ``tokens_per_step`` shrinks to fit the tiny dataset (several steps per epoch), and
    ``max_tokens_per_rank`` caps a rank's tokens so that the planner puts the long samples on SP 2
    groups (a tiny model on a CPU would otherwise fit everything at SP 1, and the test would not
    cover the sharded variants). AdamW's eps goes from 1e-8 to 1e-6: with 1e-8 an element whose
    gradient is fp32 rounding noise (a different summation order) moves by about lr per step on
    either side, which says nothing about the gradients. ``inner`` swaps the default inner compiler
    (Inductor, whose C++ compiles of every variant take minutes on a small CPU) for the quick tier.
    """
    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    section = readme.split("\nData-centric training", 1)[1].split("\nPacked micro-batches", 1)[0]
    block = re.search(r"```python\n(.*?)```", section, flags=re.S).group(1)
    for expected in ("tokens_per_step=65536,", "AdamW(model.parameters(), lr=1e-4)", "def collate("):
        assert expected in block, f"the README's data-centric block lost {expected!r}"
    block = block.replace(
        "tokens_per_step=65536,", f"tokens_per_step={TOKENS_PER_STEP}, max_tokens_per_rank={MAX_TOKENS_PER_RANK},"
    )
    block = block.replace("AdamW(model.parameters(), lr=1e-4)", f"AdamW(model.parameters(), lr=1e-4, eps={ADAM_EPS})")
    if inner is not None:
        compile_call = 'backend="dcp", dynamic=True)'
        assert compile_call in block
        block = block.replace(compile_call, f'backend="dcp", dynamic=True, options={{"inner": "{inner}"}})')
    return block


def tiny_llama() -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=64, max_position_embeddings=512, use_cache=False, bos_token_id=0, eos_token_id=1,
        pad_token_id=None, attn_implementation="sdpa",
    )
    return LlamaForCausalLM(config)


def dataset() -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(5)
    return [torch.randint(1, VOCAB, (n,), generator=generator) for n in LENGTHS]


def _run_block(rank: int, world_size: int, block: str) -> dict:
    model = tiny_llama()  # no dcp.create_sp_groups(): iterating the README's sampler creates them
    namespace = {"model": model, "dataset": dataset()}
    exec(block, namespace)  # imports torch and dcp_compile itself; rebinds "model" to the compiled one
    sampler = namespace["sampler"]
    sp_sizes = sorted({group.sp_size for i in range(len(sampler)) for group in sampler.plan(i).groups})
    return {
        "epochs": sampler.epoch,
        "steps": len(sampler),
        "sp_sizes": sp_sizes,
        "parameters": {name: p.detach().tolist() for name, p in model.named_parameters()},
    }


def _global_batches(block: str) -> list[list[int]]:
    """Every step's samples, from the same sampler the block builds (the cost model included)."""
    import dcp_compile as dcp

    lengths = list(LENGTHS)
    namespace = {"model": tiny_llama(), "dataset": dataset()}
    setup = block.split("\nfor step in sampler:", 1)[0]
    setup = setup.replace("seed=0,", "seed=0, world_size=2, rank=0,")
    exec(setup, namespace)
    assert namespace["sampler"].world_size == 2 and namespace["lengths"] == lengths
    return namespace["sampler"].steps(0)


@pytest.mark.parametrize("inner", ["eager", pytest.param(None, marks=pytest.mark.slow, id="as-written")])
def test_the_readme_data_centric_loop_runs_and_trains_the_global_batches(inner: str | None) -> None:
    block = readme_block(inner)
    results = run_in_process_world(_run_block, 2, block, timeout=600)
    steps = _global_batches(block)
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
