"""The main job: train a small GPT on variable-length data with ``backend="dcp"``.

Without arguments it spawns a local gloo world; under ``torchrun`` it uses the world it is given.
Every step prints the batch's length, the SP size that ran it, the loss and the throughput.
"""

from __future__ import annotations

import os
import random
import time

import torch
import torch.distributed as dist

from dcp_compile.example_models import TinyGPT


def long_tailed_lengths(count: int, seed: int, shortest: int = 16, longest: int = 1024) -> list[int]:
    """Lengths whose log is uniform: most batches short, a few long (as in real corpora)."""
    rng = random.Random(seed)
    return [int(shortest * (longest / shortest) ** rng.random()) for _ in range(count)]


def train(rank: int, world_size: int, steps: int, inner: str, seed: int) -> list[dict]:
    torch.manual_seed(seed)
    model = TinyGPT()
    compiled = torch.compile(model, backend="dcp", dynamic=True, options={"sp_size": world_size, "inner": inner})
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    lengths = long_tailed_lengths(steps, seed)
    rows = []
    for step, length in enumerate(lengths):
        generator = torch.Generator().manual_seed(seed * 1000 + step)
        ids = torch.randint(0, 512, (2, length), generator=generator)
        start = time.perf_counter()
        loss = compiled(ids, ids)
        loss.backward()
        for param in model.parameters():  # SP ranks hold partial gradients: sum them
            if param.grad is not None and world_size > 1:
                dist.all_reduce(param.grad)
        optimizer.step()
        optimizer.zero_grad()
        seconds = time.perf_counter() - start
        row = {"step": step, "length": length, "sp": world_size, "loss": loss.item(),
               "tokens_per_s": 2 * length / seconds, "seconds": seconds}
        rows.append(row)
        if rank == 0:
            note = " (includes compile)" if step == 0 else ""
            print(f"step {step:3d}  length {length:5d}  sp {world_size}  loss {row['loss']:.4f}  "
                  f"{row['tokens_per_s']:9.0f} tokens/s{note}", flush=True)
    return rows


def _worker(rank: int, world_size: int, steps: int, inner: str, seed: int) -> list[dict]:
    return train(rank, world_size, steps, inner, seed)


def run_demo(world_size: int = 2, steps: int = 6, inner: str = "aot_eager", seed: int = 0) -> int:
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # under torchrun
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group(backend)
        train(dist.get_rank(), dist.get_world_size(), steps, inner, seed)
        dist.destroy_process_group()
        return 0
    from dcp_compile.process_world import run_in_process_world

    print(f"dcp demo: {world_size}-process gloo world, TinyGPT, {steps} steps of variable length")
    run_in_process_world(_worker, world_size, steps, inner, seed, timeout=1800)
    return 0
