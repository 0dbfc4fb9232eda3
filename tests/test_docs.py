"""Docs that run as written: README.md and the guide in docs/.

Every Python and shell block is either run by a test, exactly as written (``doc_block`` reads its
text out of the Markdown, ``run_python_block`` executes it unchanged with the fixtures its
``# needs:`` line declares), or followed by a line starting ``*Not run by the doc tests`` that says
why. The guide builds with ``mkdocs build --strict`` (warnings are errors). The blocks not run
here are run by the tests named next to them in the guide: tests/test_readme.py, test_fsdp.py,
test_faults.py, test_html_report.py, test_device_profile.py.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dcp_compile.testing.process_world import free_port, run_in_process_world
from tiny_models import tiny_llama as shared_tiny_llama
from doc_blocks import NOT_RUN, REPO, RUN_LANGUAGES, all_blocks, doc_block, run_python_block

VOCAB = 64
LENGTHS = (12, 40, 20, 48, 16, 36, 9, 27, 30, 14)
TOKENS_PER_STEP = 96
MAX_TOKENS_PER_RANK = 32


# --- every block is run or says why not -------------------------------------------------------


def _doc_block_calls() -> dict[tuple[str, str, int], list[str]]:
    """Every ``doc_block("file", "heading"[, index])`` call in the tests, with where it is."""
    calls: dict[tuple[str, str, int], list[str]] = {}
    for path in sorted((REPO / "tests").glob("**/*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "doc_block":
                args = [ast.literal_eval(arg) for arg in node.args]
                key = (args[0], args[1], args[2] if len(args) > 2 else 0)
                calls.setdefault(key, []).append(f"{path.relative_to(REPO)}:{node.lineno}")
    return calls


def test_every_code_block_is_run_by_a_test_or_says_why_not() -> None:
    calls = _doc_block_calls()
    blocks = all_blocks()
    assert any(b.file == "README.md" for b in blocks) and any(b.file.startswith("docs/") for b in blocks)
    problems = []
    for block in blocks:
        where = f"{block.file}, under {block.heading!r}, block {block.index}"
        if not block.language:
            problems.append(f"{where}: a fence without a language (python, bash, or text for output)")
        if block.language not in RUN_LANGUAGES:
            continue
        run, not_run = block.key in calls, block.marked_not_run
        if run == not_run:
            problems.append(f"{where}: " + ("run by a test and marked not run" if run else
                                            f"neither run by a test (doc_block) nor marked {NOT_RUN!r}"))
        if not_run:
            reason = block.after.lstrip("\n")[len(NOT_RUN):].split("*", 1)[0].lstrip(":").strip()
            if len(reason) < 20:
                problems.append(f"{where}: marked not run without a reason")
    keys = {block.key for block in blocks}
    problems += [f"{key} read by {where} is not a block of the docs" for key, where in calls.items() if key not in keys]
    assert not problems, "\n".join(problems)


def test_the_readme_test_command_is_what_ci_runs() -> None:
    commands = next(b.text for b in all_blocks() if b.file == "README.md")  # the first block, marked not run
    lines = [line for line in commands.splitlines() if line and not line.startswith("#")]
    assert len(lines) == 2 and "python -m dcp_compile demo" in lines[0], commands
    ci = (REPO / ".ci" / "run").read_text().splitlines()
    assert lines[1] in ci, f"README's test command {lines[1]!r} is not a line of .ci/run"


def test_the_readme_quickstart_is_the_guide_quickstart() -> None:
    # Both files show the same block; the quickstart test below runs it (both keys are read).
    assert doc_block("README.md", "Quickstart") == doc_block("docs/index.md", "dcp-compile")


def test_the_guide_builds_with_warnings_as_errors(tmp_path: Path) -> None:
    result = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                            cwd=REPO, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert (tmp_path / "site" / "training" / "index.html").exists()


# --- fixtures ------------------------------------------------------------------------------------


def tiny_llama() -> torch.nn.Module:
    return shared_tiny_llama(VOCAB)


def token_dataset() -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(5)
    return [torch.randint(1, VOCAB, (n,), generator=generator) for n in LENGTHS]


def cost_model():
    from dcp_compile.schedule.cost_model import CostModel, ModelProfile
    from dcp_compile.schedule.hardware import Hardware

    return CostModel(ModelProfile.from_config("llama-3-8b"), Hardware.H200, optimizer_shards=2)


# --- the quickstart (README.md and docs/index.md) -----------------------------------------------


def _quickstart(rank: int, world_size: int, port: int) -> dict:
    import torch.distributed as dist

    # The block initialises the world itself, as under torchrun: leave the harness's world first.
    dist.destroy_process_group()
    os.environ["MASTER_PORT"] = str(port)
    model = tiny_llama()
    ids = torch.randint(1, VOCAB, (2, 37), generator=torch.Generator().manual_seed(1))
    namespace = run_python_block(doc_block("README.md", "Quickstart"), "README.md", model=model, ids=ids)
    grads = [p.grad.clone() for p in model.parameters()]
    for grad in grads:
        dist.all_reduce(grad)
    return {"loss": namespace["loss"].item(), "grads": [g.tolist() for g in grads]}


@pytest.mark.slow  # Inductor compiles the SP-2 variant: minutes on a small CPU
def test_the_quickstart_runs_as_written_and_matches_eager() -> None:
    results = run_in_process_world(_quickstart, 2, free_port(), timeout=1800)
    model = tiny_llama()
    ids = torch.randint(1, VOCAB, (2, 37), generator=torch.Generator().manual_seed(1))
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    for rank, result in enumerate(results):
        assert result["loss"] == pytest.approx(loss.item(), rel=1e-5), rank
        for (name, p), got in zip(model.named_parameters(), result["grads"]):
            torch.testing.assert_close(torch.tensor(got), p.grad, rtol=1e-5, atol=1e-5, msg=lambda m: f"{name}: {m}")


# --- packed micro-batches (docs/training.md) -----------------------------------------------------


def _packed(rank: int, world_size: int) -> dict:
    import dcp_compile as dcp
    from dcp_compile.runtime.huggingface import use_packed_attention
    from dcp_compile.schedule.plan import MicroBatch

    module = use_packed_attention(tiny_llama())
    model = torch.compile(module, backend="dcp", dynamic=True, options={"inner": "eager"})
    mb = MicroBatch(indices=(0, 4, 6), variant=dcp.Variant(1), loss_scale=0.25, group_ranks=(0,), predicted_time=0.0)
    namespace = run_python_block(doc_block("docs/training.md", "Packed micro-batches"), "docs/training.md",
                                 model=model, dataset=token_dataset(), mb=mb)
    return {"loss": namespace["loss"].item(), "tokens": namespace["packed"].input_ids.shape}


def test_the_packed_block_runs_as_written_with_the_mean_token_loss() -> None:
    from padded_batches import pad_right

    result = run_in_process_world(_packed, 1, timeout=600)[0]
    data = token_dataset()
    assert tuple(result["tokens"]) == (1, sum(len(data[i]) for i in (0, 4, 6)))
    expected = tiny_llama()(**pad_right([data[i] for i in (0, 4, 6)])).loss.item() * 0.25
    assert result["loss"] == pytest.approx(expected, rel=1e-5)


# --- the Hugging Face Trainer (docs/training.md) ------------------------------------------------


def _trainer(rank: int, world_size: int, directory: str) -> dict:
    from padded_batches import pad_right

    os.chdir(directory)  # the block writes to "out"
    model = tiny_llama()
    start = [p.detach().clone() for p in model.parameters()]
    dataset = [{"input_ids": sample} for sample in token_dataset()]
    namespace = run_python_block(
        doc_block("docs/training.md", "Hugging Face Trainer"), "docs/training.md", model=model, dataset=dataset,
        collate=lambda samples: pad_right([s["input_ids"] for s in samples]), cost_model=cost_model(),
        tokens_per_step=TOKENS_PER_STEP, max_tokens_per_rank=MAX_TOKENS_PER_RANK, inner="eager",
    )
    trainer = namespace["trainer"]
    return {
        "steps": trainer.state.global_step,
        "moved": any(not torch.equal(a, p.detach()) for a, p in zip(start, model.parameters())),
        "parameters": [p.detach().tolist() for p in model.parameters()],
    }


@pytest.mark.slow  # 70 s on 2 cores; the DataCentricTrainer itself is tested by tests/test_hf_trainer.py (25 s)
def test_the_trainer_block_runs_as_written_on_two_ranks(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    # as docs/training.md says to launch on CPU: the Trainer must see the 2-rank world (not DDP, dcp syncs)
    results = run_in_process_world(_trainer, 2, str(tmp_path), timeout=900, env={"ACCELERATE_USE_CPU": "1"})
    assert results[0]["steps"] >= 3 and results[0]["moved"], results[0]["steps"]
    assert results[0]["steps"] == results[1]["steps"]
    for a, b in zip(results[0]["parameters"], results[1]["parameters"]):
        torch.testing.assert_close(torch.tensor(a), torch.tensor(b), rtol=0, atol=0)


# --- Accelerate (docs/training.md) ---------------------------------------------------------------


def _accelerate(rank: int, world_size: int) -> dict:
    import multiprocessing

    from accelerate import Accelerator

    from padded_batches import pad_right
    from test_accelerate import EPS, LR, dataset, make_sampler
    from test_accelerate import tiny_llama as accelerate_llama

    multiprocessing.current_process()._config["daemon"] = False
    model = accelerate_llama()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS, weight_decay=0.0)
    namespace = run_python_block(
        doc_block("docs/training.md", "Accelerate"), "docs/training.md", accelerator=Accelerator(cpu=True),
        model=model, dataset=dataset(), sampler=make_sampler(), collate=pad_right, optimizer=optimizer,
        lr_scheduler=torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0), inner="eager",
    )
    return {n: p.detach().tolist() for n, p in namespace["model"].named_parameters()}


@pytest.mark.slow  # 50 s on 2 cores; dcp.accelerate itself is tested by tests/test_accelerate.py (25 s)
def test_the_accelerate_block_runs_as_written_and_equals_one_process() -> None:
    pytest.importorskip("accelerate")
    from padded_batches import pad_right
    from test_accelerate import EPS, LR, dataset, make_sampler
    from test_accelerate import tiny_llama as accelerate_llama

    results = run_in_process_world(_accelerate, 2, timeout=900)
    model = accelerate_llama()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS, weight_decay=0.0)
    data = dataset()
    for indices in make_sampler(world_size=2, rank=0).steps(0):
        model(**pad_right([data[i] for i in indices])).loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
    for rank, result in enumerate(results):
        for name, value in model.named_parameters():
            torch.testing.assert_close(torch.tensor(result[name]), value.detach(), rtol=1e-5, atol=1e-5,
                                       msg=lambda m: f"rank {rank} {name}: {m}")


# --- checkpoints (docs/training.md) --------------------------------------------------------------


def _checkpoints(rank: int, world_size: int, directory: str) -> dict:
    import dcp_compile as dcp
    from dcp_compile.demo.example_models import TinyGPT

    os.chdir(directory)  # the block writes to "checkpoints"
    torch.manual_seed(0)
    model = TinyGPT(VOCAB, 16, 1, 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randint(0, VOCAB, (1, 8)), torch.randint(0, VOCAB, (1, 8))).backward()
    optimizer.step()
    saved = [p.detach().clone() for p in model.parameters()]
    sampler = dcp.DataCentricSampler([len(s) for s in token_dataset()], tokens_per_step=TOKENS_PER_STEP,
                                     cost_model=cost_model(), seed=0)
    batches = dcp.DataCentricBatchSampler(sampler)
    namespace = run_python_block(doc_block("docs/training.md", "Checkpoints"), "docs/training.md",
                                 model=model, optimizer=optimizer, batches=batches, step=3)
    return {
        "step": namespace["step"],
        "latest": str(namespace["latest"]),
        "path": str(dcp.checkpoint.checkpoint_path("checkpoints", 3)),
        "same": all(torch.equal(a, p.detach()) for a, p in zip(saved, model.parameters())),
    }


def test_the_checkpoint_block_runs_as_written(tmp_path: Path) -> None:
    result = run_in_process_world(_checkpoints, 1, str(tmp_path), timeout=300)[0]
    assert result["step"] == 3 and result["same"], result
    assert Path(result["latest"]) == Path(result["path"]) and (tmp_path / result["path"]).exists(), result
