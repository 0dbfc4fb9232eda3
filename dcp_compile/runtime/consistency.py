"""Rank consistency: the ranks that must agree check that they do, and say who did not.

Why: in a data-centric job nothing is negotiated at run time; every rank of an SP group is
trusted to call the compiled graph with the same batch under the same variant, and every rank of
the world to reach ``sync_gradients`` for the same step. When that trust is broken (a data-loader
bug, a per-rank seed, a restarted rank) the collectives inside the graph either pair up wrong
messages (a silent wrong result), abort inside gloo, or wait forever. A check costs one tiny
all-gather of a fixed-size integer signature; a disagreement then raises
:class:`RankMismatchError` on *every* rank of the group, naming the ranks and what differed.

Never a hang: the check's all-gather is waited on with a bounded timeout
(``DCP_RANK_CHECK_TIMEOUT`` seconds, default 300, far below gloo's 30 minutes). A rank that does
not arrive (it runs another variant, skipped a micro-batch, or failed) makes the waiting ranks
raise :class:`RankTimeoutError`; before raising, each such rank writes where it was waiting to
the process group's key-value store and reads what the others wrote, so the error says e.g.
"rank 0: waiting in the SP-2 check of graph 0; rank 1: waiting in sync_gradients". A rank that
fails in user code inside :func:`fault_guard` writes its error there too, and peers whose
collectives then break name it.

Turn the per-call check off with ``options={"check_ranks": False}``; the sampler's plan check
with ``DataCentricSampler(..., verify_plan=False)``.
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any, Iterator, Sequence

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT_SECONDS = 300.0
_STORE_PREFIX = "dcp/fault/"
_MASK = (1 << 62) - 1


class RankMismatchError(RuntimeError):
    """Ranks that must agree (an SP group on a call, the world on a step) did not."""


class RankTimeoutError(RuntimeError):
    """A rank did not reach a consistency check in time (it runs something else, or it failed)."""


class PeerFailureError(RuntimeError):
    """Another rank failed, and this rank's collectives were cut short because of it."""


def check_timeout_seconds() -> float:
    """The bounded wait of every check: ``DCP_RANK_CHECK_TIMEOUT`` or 300 s."""
    value = os.environ.get("DCP_RANK_CHECK_TIMEOUT")
    if not value:
        return DEFAULT_TIMEOUT_SECONDS
    try:
        seconds = float(value)
    except ValueError:
        raise ValueError(f"DCP_RANK_CHECK_TIMEOUT={value!r} is not a number of seconds") from None
    if seconds <= 0:
        raise ValueError(f"DCP_RANK_CHECK_TIMEOUT must be > 0 seconds, got {seconds}")
    return seconds


def _digest(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little") & _MASK


def integer_digest(tensor: torch.Tensor) -> torch.Tensor:
    """A cheap order-sensitive digest of an integer tensor, on its own device (no host sync).

    Two position-weighted sums modulo nothing (int64 wraps): a different token, a swapped pair or
    a different batch changes it with overwhelming probability; it is not a cryptographic hash.
    """
    flat = tensor.reshape(-1).to(torch.int64)
    weights = torch.arange(1, flat.numel() + 1, device=flat.device, dtype=torch.int64)
    return (flat * weights).sum() * 1000003 + (flat * flat).sum()


@dataclass(frozen=True)
class CallDescription:
    """What one rank is about to run: compared across the group only when signatures differ."""

    rank: int
    variant: str
    length: Any
    shapes: tuple[tuple[int, ...], ...]
    integer_digests: tuple[int, ...]
    call_index: int
    scalars: tuple[Any, ...] = ()

    def differences(self, other: "CallDescription") -> list[str]:
        """This rank's values of the fields that differ from ``other``, for the error message."""
        out = []
        if self.variant != other.variant:
            out.append(f"variant {self.variant}")
        if self.length != other.length:
            out.append(f"length {self.length}")
        if self.shapes != other.shapes:
            out.append(f"input shapes {[tuple(s) for s in self.shapes]}")
        if self.call_index != other.call_index:
            out.append(f"call number {self.call_index} of this group")
        if self.scalars != other.scalars:
            out.append(f"integer arguments {list(self.scalars)}")
        if not out and self.integer_digests != other.integer_digests:
            different = [i for i, (a, b) in enumerate(zip(self.integer_digests, other.integer_digests)) if a != b]
            out.append(f"integer inputs {different} hold different values")
        return out


@dataclass
class _GroupCounter:
    calls: dict[tuple[int, ...], int] = field(default_factory=dict)


_counter = _GroupCounter()
_syncs = [0]


def next_sync_number() -> int:
    """How many times this process has entered ``sync_gradients`` before (the ranks must agree)."""
    _syncs[0] += 1
    return _syncs[0] - 1


def _exchange(values: torch.Tensor, group: Any, ranks: Sequence[int], where: str) -> list[list[int]]:
    """All-gather ``values`` over ``group`` with a bounded wait; rows in group order."""
    gathered = [torch.empty_like(values) for _ in ranks]
    work = dist.all_gather(gathered, values, group=group, async_op=True)
    timeout = check_timeout_seconds()
    try:
        work.wait(datetime.timedelta(seconds=timeout))
    except RuntimeError as error:
        failures = {r: t for r, t in reported_failures(wait_seconds=2.0).items() if r != dist.get_rank()}
        if failures:
            named = "; ".join(f"rank {r} failed with {text}" for r, text in sorted(failures.items()))
            raise PeerFailureError(f"dcp: rank {dist.get_rank()} stopped in {where} because another rank "
                                   f"failed ({named}); the collective said: {error}") from None
        raise RankTimeoutError(_timeout_message(ranks, where, timeout, error)) from None
    return [row.tolist() for row in gathered]


def _skipped(group: Any) -> bool:
    """No real peers to ask: one process, or torch's fake backend (structure tests)."""
    if not (dist.is_available() and dist.is_initialized()):
        return True
    return dist.get_backend(group) == "fake"


def check_sp_group_agrees(variant: Any, args: Sequence[Any], group: Any, ranks: Sequence[int], *,
                          graph_id: int, length: Any, parameter_indices: Sequence[int] = ()) -> None:
    """Before a compiled call's first collective: the SP group agrees on variant and inputs.

    The signature is six int64s (a zero where the graph id would be, a digest of the variant, this
    group's call number, a digest of the non-parameter input shapes, the attention length, a
    digest of the integer tensors' values); one all-gather over the group. Only when
    they differ are the readable descriptions exchanged, so every rank raises the same error.
    """
    if group is None or _skipped(group):
        return
    ranks = tuple(ranks)
    call_index = _counter.calls.get(ranks, 0)
    _counter.calls[ranks] = call_index + 1
    skip = set(parameter_indices)
    inputs = [a for i, a in enumerate(args) if i not in skip]
    tensors = [a for a in inputs if isinstance(a, torch.Tensor)]
    shapes = tuple(tuple(t.shape) for t in tensors)
    others = tuple(a for a in inputs if isinstance(a, (int, float, bool)) and not isinstance(a, torch.Tensor))
    integers = [t for t in tensors if not t.is_floating_point() and not t.is_complex() and t.numel() > 0]
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" else torch.device("cpu")
    # Neither the graph id nor the integer (SymInt) arguments: a rank whose chunk is 1 token long
    # fails a guard the others pass (PyTorch specialises sizes of 1), so dynamo recompiles there
    # only, and the same call reaches graph 1 with fresh size symbols on that rank ([2, 7, 7]) and
    # graph 0 on the others ([2, 7]). Those sizes are the tensors' shapes, which are compared.
    header = torch.tensor([
        0, _digest(str(variant)), call_index, _digest(repr(shapes)),
        -1 if length is None or length == "-" else int(length),
    ], dtype=torch.int64, device=device)
    if integers:
        digests = torch.stack([integer_digest(t).to(device) for t in integers])
        folded = (digests * torch.arange(1, len(integers) + 1, device=device, dtype=torch.int64)).sum().reshape(1)
    else:
        digests = torch.zeros(0, dtype=torch.int64, device=device)
        folded = torch.zeros(1, dtype=torch.int64, device=device)
    signature = torch.cat([header, folded])
    where = f"the SP-{len(ranks)} check of graph {graph_id} ({variant}, call {call_index} of group {list(ranks)})"
    rows = _exchange(signature, group, ranks, where)
    if all(row == rows[0] for row in rows):
        return
    mine = CallDescription(dist.get_rank(), str(variant), length, shapes,
                           tuple(int(d) for d in digests.tolist()), call_index, others)
    described: list[Any] = [None] * len(ranks)
    dist.all_gather_object(described, mine, group=group)
    raise RankMismatchError(_mismatch_message(described, graph_id))


def _mismatch_message(described: list[CallDescription], graph_id: int) -> str:
    reference = described[0]
    parts = []
    for description in described[1:]:
        theirs = description.differences(reference)
        if not theirs:
            continue
        if theirs == reference.differences(description) and "hold different values" in theirs[-1]:
            parts.append(f"rank {description.rank} and rank {reference.rank}: the same shapes, but different "
                         f"integer values (token ids or labels) in {theirs[-1].split(' hold')[0]}")
        else:
            ours = reference.differences(description)
            parts.append(f"rank {description.rank}: {', '.join(theirs)}, rank {reference.rank}: {', '.join(ours)}")
    if not parts:
        parts.append("their non-tensor arguments differ")
    ranks = [d.rank for d in described]
    return (
        f"dcp: the ranks {ranks} of one SP group disagree before graph {graph_id}'s collectives "
        f"({'; '.join(parts)}). Every rank of an SP group must call the compiled model with the same "
        "batch under the same dcp.use (the same micro-batch of the step plan): check the data loader "
        "(each rank of the group loads the micro-batch's indices, not its own shard) and that every rank "
        "built the sampler with the same seed. Turn this check off with options={'check_ranks': False}."
    )


def check_world_agrees(what: str, values: Sequence[int], labels: Sequence[str], group: Any = None) -> None:
    """Every rank of ``group`` (default: the world) holds the same ``values``; else raise on all.

    ``labels`` name each value for the message (``rank 1: 12 parameters, rank 0: 11 parameters``).
    """
    if _skipped(group):
        return
    if dist.get_world_size(group) == 1:
        return
    ranks = list(range(dist.get_world_size())) if group is None else dist.get_process_group_ranks(group)
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" else torch.device("cpu")
    local = torch.tensor([int(v) for v in values], dtype=torch.int64, device=device)
    rows = _exchange(local, group, ranks, what)
    if all(row == rows[0] for row in rows):
        return
    parts = []
    for rank, row in zip(ranks, rows):
        different = [f"{label} {value}" for label, value, ref in zip(labels, row, rows[0]) if value != ref] or \
                    [f"{label} {value}" for label, value, other in zip(labels, row, next(r for r in rows if r != rows[0])) if value != other]
        parts.append(f"rank {rank}: {', '.join(different)}")
    raise RankMismatchError(f"dcp: the ranks disagree at {what} ({'; '.join(parts)})")


# ---------------------------------------------------------------- faults: where each rank is


def _store() -> Any | None:
    try:
        return dist.distributed_c10d._get_default_store()
    except Exception:  # noqa: BLE001 - no store (fake backend, not initialised): nothing to share
        return None


def report_failure(error: BaseException) -> None:
    """Write this rank's failure to the store, so peers whose collectives break can name it."""
    store = _store()
    if store is None:
        return
    rank = dist.get_rank()
    try:
        store.set(f"{_STORE_PREFIX}failed/{rank}", f"{type(error).__name__}: {error}"[:500])
        store.add(f"{_STORE_PREFIX}failures", 1)
    except Exception:  # noqa: BLE001 - the store itself may be gone; the local error still raises
        pass


def reported_failures(wait_seconds: float = 0.0) -> dict[int, str]:
    """Failures other ranks reported, waiting up to ``wait_seconds`` for at least one."""
    store = _store()
    if store is None or not dist.is_initialized():
        return {}
    deadline = time.monotonic() + wait_seconds
    while True:
        try:
            count = store.add(f"{_STORE_PREFIX}failures", 0)
        except Exception:  # noqa: BLE001
            return {}
        if count or time.monotonic() >= deadline:
            break
        time.sleep(0.1)
    if not count:
        return {}
    failures = {}
    for rank in range(dist.get_world_size()):
        key = f"{_STORE_PREFIX}failed/{rank}"
        try:
            if store.check([key]):
                failures[rank] = store.get(key).decode()
        except Exception:  # noqa: BLE001
            continue
    return failures


def _timeout_message(ranks: Sequence[int], where: str, timeout: float, error: BaseException) -> str:
    """Say where every rank was: write ours, give the others a moment to time out too, read theirs."""
    store = _store()
    rank = dist.get_rank()
    whereabouts: dict[int, str] = {}
    if store is not None:
        try:
            store.set(f"{_STORE_PREFIX}waiting/{rank}", where)
            # The others time out too, up to their own arrival skew later: wait for their word a while
            # (stops as soon as every rank wrote; a dead or silent rank costs the whole grace).
            deadline = time.monotonic() + min(max(10.0, timeout), 60.0)
            others = [r for r in range(dist.get_world_size()) if r != rank]
            while time.monotonic() < deadline:
                if store.check([f"{_STORE_PREFIX}waiting/{r}" for r in others]):
                    break
                time.sleep(0.1)
            for r in range(dist.get_world_size()):
                key = f"{_STORE_PREFIX}waiting/{r}"
                if store.check([key]):
                    whereabouts[r] = store.get(key).decode()
        except Exception:  # noqa: BLE001 - best effort: the timeout itself is the error
            pass
    failures = reported_failures()
    lines = [f"rank {r}: failed with {text}" for r, text in sorted(failures.items())]
    lines += [f"rank {r}: waiting in {text}" for r, text in sorted(whereabouts.items()) if r not in failures]
    silent = [r for r in ranks if r not in whereabouts and r not in failures]
    if silent:
        lines.append(f"ranks {silent}: not heard from (still running, stuck elsewhere, or dead)")
    return (
        f"dcp: rank {rank} waited {timeout:.0f}s in {where} and not every rank of {list(ranks)} arrived "
        f"({'; '.join(lines)}). The ranks of an SP group must run the same micro-batches under the same "
        "dcp.use, and every rank must reach sync_gradients once per step. (Set DCP_RANK_CHECK_TIMEOUT to "
        f"change the wait; the collective said: {error})"
    )


@contextlib.contextmanager
def fault_guard() -> Iterator[None]:
    """Wrap a training step: a failure here is reported to the other ranks, and a collective that
    breaks because another rank failed re-raises as :class:`PeerFailureError` naming that rank.

    A rank that raises in user code between forward and backward leaves its SP group's backward
    collectives unanswered. Its process exit closes its gloo connections, and the peers' pending
    collectives fail at once (NCCL peers wait for the process group's timeout: pass ``timeout=`` to
    ``init_process_group``). Without this guard those peers see "Connection closed by peer" and no
    rank; with it they read the failed rank's error from the store.
    """
    try:
        yield
    except (RankMismatchError, RankTimeoutError, PeerFailureError):
        raise
    except BaseException as error:
        if not (dist.is_available() and dist.is_initialized()):
            raise
        failures = {r: t for r, t in reported_failures(wait_seconds=2.0 if _looks_collective(error) else 0.0).items()
                    if r != dist.get_rank()}
        if failures and _looks_collective(error):
            named = "; ".join(f"rank {r} failed with {text}" for r, text in sorted(failures.items()))
            raise PeerFailureError(f"dcp: rank {dist.get_rank()} stopped because another rank failed ({named}); "
                                   f"this rank's collective broke with: {error}") from error
        report_failure(error)
        raise


def _looks_collective(error: BaseException) -> bool:
    """A gloo/NCCL failure, as opposed to an error of the user's own code."""
    text = f"{type(error).__name__}: {error}"
    return isinstance(error, getattr(dist, "DistError", ())) or any(
        marker in text for marker in ("Connection closed by peer", "Gloo", "gloo", "NCCL", "Connection reset",
                                      "timed out", "Broken pipe"))
