"""Run a function on N local processes joined in a gloo (CPU) or NCCL process group.

The test suite, the demo and the benchmarks all need "a small world on this machine". Failures
must surface as the failing rank's traceback, and a rank stuck in a collective must not hang the
caller: every process is killed on the first error or when the timeout runs out.
"""

from __future__ import annotations

import os
import pickle
import queue
import socket
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable

import torch.multiprocessing as multiprocessing


class ProcessWorldError(RuntimeError):
    """A rank raised, died, or the world did not finish in time."""


@dataclass
class _RankOutcome:
    rank: int
    ok: bool
    value: Any = None
    error: str = ""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _rank_main(rank, world_size, port, backend, fn, args, kwargs, results, env):
    os.environ.update(env)
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
    )
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        if world_size > 0:
            dist.init_process_group(backend, rank=rank, world_size=world_size)
        value = fn(rank, world_size, *args, **kwargs)
        try:
            pickle.dumps(value)
        except Exception:  # an unpicklable result is reported, not lost silently
            value = repr(value)
        results.put(_RankOutcome(rank, True, value))
    except BaseException:  # noqa: BLE001 - every failure must reach the parent
        results.put(_RankOutcome(rank, False, error=traceback.format_exc()))
    finally:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:
                pass


def run_in_process_world(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 300.0,
    backend: str = "gloo",
    env: dict[str, str] | None = None,
    **kwargs: Any,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args, **kwargs)`` on ``world_size`` spawned processes.

    ``fn`` must be importable by name (a module-level function). Returns the per-rank return
    values, ordered by rank. Raises ``ProcessWorldError`` with the first failing rank's traceback,
    or naming the ranks still running when ``timeout`` seconds have passed; all processes are
    terminated before it returns or raises.
    """
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    port = free_port()
    child_env = {"OMP_NUM_THREADS": "1", **(env or {})}
    processes = [
        context.Process(
            target=_rank_main,
            args=(rank, world_size, port, backend, fn, args, kwargs, results, child_env),
            daemon=True,
        )
        for rank in range(world_size)
    ]
    for process in processes:
        process.start()
    outcomes: dict[int, _RankOutcome] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(outcomes) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                missing = sorted(set(range(world_size)) - set(outcomes))
                raise ProcessWorldError(
                    f"ranks {missing} of a {world_size}-process world did not finish within "
                    f"{timeout:.0f}s (a hang in a collective?); all processes were killed"
                )
            try:
                outcome = results.get(timeout=min(remaining, 0.5))
            except queue.Empty:
                dead = [
                    rank for rank, process in enumerate(processes)
                    if not process.is_alive() and rank not in outcomes and process.exitcode not in (0, None)
                ]
                if dead:
                    # Give the queue a moment: the rank may have reported just before exiting.
                    try:
                        outcome = results.get(timeout=1.0)
                    except queue.Empty:
                        raise ProcessWorldError(
                            f"rank {dead[0]} died with exit code {processes[dead[0]].exitcode} "
                            "without reporting (killed, out of memory, or a crash in C++)"
                        ) from None
                else:
                    continue
            if not outcome.ok:
                raise ProcessWorldError(f"rank {outcome.rank} failed:\n{outcome.error}")
            outcomes[outcome.rank] = outcome
    finally:
        for process in processes:
            if process.is_alive():
                process.terminate()
        for process in processes:
            process.join(timeout=5)
            if process.is_alive():
                process.kill()
                process.join()
    return [outcomes[rank].value for rank in range(world_size)]
