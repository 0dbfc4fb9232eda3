"""The examples run as a user runs them: ``torchrun``, 2 gloo ranks, ``--tiny``, a few steps.

Each run is a subprocess (``python -m torch.distributed.run --standalone --nproc_per_node 2``) in a
fresh directory, so the script writes its own dataset there. It must exit 0 and print, per step,
the tokens/s and the plan (SP groups, micro-batches per rank, recompute), with plans that mix SP
sizes; the causal LM is then resumed from its checkpoint with ``--resume`` and must continue at the
next step; so is the Accelerate video DiT (``save_state`` / ``load_state``). Each prints the sharding
summary once (every attention site of the SP-2 variants sharded). No GPU is used (``CUDA_VISIBLE_DEVICES=""``: the scripts pick gloo). Both run in the
quick tier (about 2 and 1 minutes on 2 CPU cores, mostly compiling the SP variants) so that CI
runs them on every change: marked slow, the time budget skipped the second one.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest


EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
STEP_LINE = re.compile(r"^step (\d+): \d+ tokens, [\d,]+ tokens/s, loss [\d.]+ \| plan: (.*) \| "
                       r"micro-batches per rank \[\d+, \d+\] \| recompute \w+", re.M)
# printed once after the first step (dcp.report.sharding_summary): graphs, sharded attention, gathers
SUMMARY = re.compile(r"^dcp: \d+ graph\(s\) ran, \d+ with attention\n(  .*\n)*  SP 2: attention sites sharded "
                     r"(\d+)/(\d+) .*\| gathers \d+", re.M)


def sharding_summary(output: str) -> tuple[int, int]:
    """(sites sharded, sites) from the summary line; the examples print it exactly once."""
    assert output.count("graph(s) ran") == 1, output[-3000:]
    match = SUMMARY.search(output)
    assert match, f"no sharding summary with an SP 2 line:\n{output[-3000:]}"
    return int(match.group(2)), int(match.group(3))


def run_example(script: str, directory: Path, *arguments: str, timeout: float = 900) -> str:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
               str(EXAMPLES / script), "--tiny", "--num-workers", "1", *arguments]
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(EXAMPLES.parent), os.environ.get("PYTHONPATH")]))}
    result = subprocess.run(command, cwd=directory, env=env, capture_output=True, text=True, timeout=timeout)
    output = result.stdout + result.stderr
    assert result.returncode == 0, f"{script} {' '.join(arguments)} exited {result.returncode}:\n{output[-6000:]}"
    return result.stdout


def trained_steps(output: str) -> dict[int, str]:
    """Step number -> that step's SP groups, from the per-step lines."""
    return {int(match.group(1)): match.group(2) for match in STEP_LINE.finditer(output)}


@pytest.mark.slow
def test_the_causal_lm_example_trains_shows_plans_and_resumes(tmp_path: Path) -> None:
    output = run_example("train_causal_lm.py", tmp_path, "--steps", "2", "--checkpoint-every", "2")
    first = trained_steps(output)
    sharded, sites = sharding_summary(output)
    assert sharded == sites > 0, (sharded, sites)
    assert sorted(first) == [1, 2], first
    assert any("sp2" in groups and "sp1" in groups for groups in first.values()), first
    assert (tmp_path / "example_data" / "texts.jsonl").is_file()
    assert (tmp_path / "checkpoints" / "causal_lm" / "step_000000002" / ".metadata").is_file()

    resumed = trained_steps(run_example("train_causal_lm.py", tmp_path, "--steps", "3", "--resume"))
    assert sorted(resumed) == [3], f"--resume should continue at step 3, ran {sorted(resumed)}"


@pytest.mark.slow
def test_the_video_dit_example_trains_on_mixed_resolutions_and_shows_plans(tmp_path: Path) -> None:
    output = run_example("train_video_dit.py", tmp_path, "--steps", "3", "--checkpoint-every", "3")
    steps = trained_steps(output)
    sharded, sites = sharding_summary(output)
    assert sharded == sites > 0, (sharded, sites)
    assert sorted(steps) == [1, 2, 3], steps
    assert any("sp2" in groups for groups in steps.values()), steps
    latents = tmp_path / "example_data" / "video_latents"
    manifest = json.loads((latents / "manifest.json").read_text())
    shapes = {tuple(entry["shape"]) for entry in manifest}
    assert len({shape[1] for shape in shapes}) > 1 and len({shape[2:] for shape in shapes}) > 1, "frames and sizes mix"
    assert len(list(latents.glob("clip_*.pt"))) == len(manifest), "one .pt file per clip"
    assert (tmp_path / "checkpoints" / "video_dit" / "step_000000003" / ".metadata").is_file()


@pytest.mark.slow  # 80 s on 2 cores; the Accelerate loop itself is tested by tests/test_accelerate.py (25 s)
def test_the_accelerate_video_dit_example_trains_resumes_and_prints_the_sharding_summary(tmp_path: Path) -> None:
    output = run_example("train_video_dit_accelerate.py", tmp_path, "--steps", "2", "--checkpoint-every", "2")
    assert sorted(trained_steps(output)) == [1, 2], output[-3000:]
    assert any("sp2" in groups for groups in trained_steps(output).values())
    sharded, sites = sharding_summary(output)
    assert sharded == sites > 0, (sharded, sites)
    checkpoint = tmp_path / "checkpoints" / "video_dit_accelerate" / "checkpoint-2"
    assert (checkpoint / "complete").is_file() and (checkpoint / "custom_checkpoint_0.pkl").is_file()

    resumed = trained_steps(run_example("train_video_dit_accelerate.py", tmp_path, "--steps", "3", "--resume"))
    assert sorted(resumed) == [3], f"--resume should continue at step 3, ran {sorted(resumed)}"
