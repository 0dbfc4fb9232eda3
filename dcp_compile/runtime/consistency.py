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

Off the critical path (``DCP_RANK_CHECK``): ``async``, the default on NCCL, issues the SP-group
check's all-gather without waiting, ahead of the call's own collectives on the same group, and
settles it once it has completed: at the end of the call when it has (a CUDA event says so, no
host synchronisation), else at the group's next call, at the next world check (``sync_gradients``)
or when the call raises. A disagreement raises the same :class:`RankMismatchError` on every rank,
naming each rank's call, at the latest before the step's gradients are reduced; the mismatched
call's collectives may have run first. A rank that never arrives leaves the others blocked in the
call's own collectives, not in the check: a watchdog thread notices the check outstanding past the
bounded wait (or completed with a disagreement while its call still runs), logs the error, writes
where this rank waits to the store (so the peers' errors name it) and aborts an NCCL group so the
blocked call fails with the check's error. ``sync``, the default on every other backend, waits on
every check before the call's first collective: gloo aborts the whole process when a collective's
sizes differ between ranks (``gloo::EnforceNotMet ... Received data size doesn't match expected
size``), so there the disagreement must be known first; it is also the mode for debugging.

Turn the per-call check off with ``options={"check_ranks": False}``; the sampler's plan check
with ``DataCentricSampler(..., verify_plan=False)``.
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import logging
import os
import pickle
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Iterator, Sequence

import torch
import torch.distributed as dist

from dcp_compile.errors import DCPError

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT_SECONDS = 300.0
CHECK_MODE_ENV = "DCP_RANK_CHECK"  # "auto" (default), "async" or "sync"
_STORE_PREFIX = "dcp/fault/"
_MASK = (1 << 62) - 1


class RankMismatchError(DCPError, RuntimeError):
    """Ranks that must agree (an SP group on a call, the world on a step) did not."""


class RankTimeoutError(DCPError, RuntimeError):
    """A rank did not reach a consistency check in time (it runs something else, or it failed)."""


class PeerFailureError(DCPError, RuntimeError):
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


def check_mode(backend: str | None = None) -> str:
    """``sync`` (the check is waited on before the call's collectives) or ``async`` (it runs beside
    the call), from ``DCP_RANK_CHECK``; unset or ``auto``: ``async`` on NCCL, ``sync`` on every other
    backend (gloo aborts the process on a collective whose sizes differ between ranks, so there a
    disagreement must be known before the call's first collective)."""
    mode = os.environ.get(CHECK_MODE_ENV, "auto").strip().lower() or "auto"
    if mode not in ("auto", "async", "sync"):
        raise ValueError(f"{CHECK_MODE_ENV}={mode!r}: use 'sync', 'async' or 'auto' (async on NCCL, else sync)")
    if mode == "auto":
        return "async" if backend == "nccl" else "sync"
    return mode


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


def _wait_rows(work: Any, gathered: list[torch.Tensor], ranks: Sequence[int], where: str,
               timeout: float | None = None) -> list[list[int]]:
    """Wait for an all-gather with a bounded wait; its rows in group order."""
    timeout = check_timeout_seconds() if timeout is None else timeout
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


def _exchange(values: torch.Tensor, group: Any, ranks: Sequence[int], where: str) -> list[list[int]]:
    """All-gather ``values`` over ``group`` with a bounded wait; rows in group order."""
    gathered = [torch.empty_like(values) for _ in ranks]
    work = dist.all_gather(gathered, values, group=group, async_op=True)
    return _wait_rows(work, gathered, ranks, where)


def _skipped(group: Any) -> bool:
    """No real peers to ask: one process, or torch's fake backend (structure tests)."""
    if not (dist.is_available() and dist.is_initialized()):
        return True
    return dist.get_backend(group) == "fake"


_variant_digests: dict[Any, int] = {}
_shape_digests: dict[tuple, int] = {}


def _cached_digest(cache: dict, key: Any) -> int:
    value = cache.get(key)
    if value is None:
        if len(cache) > 4096:
            cache.clear()
        value = cache[key] = _digest(str(key) if cache is _variant_digests else repr(key))
    return value


@dataclass
class PendingCheck:
    """An SP-group check issued beside its call and not yet compared (``DCP_RANK_CHECK=async``)."""

    work: Any
    gathered: list[torch.Tensor]
    group: Any
    ranks: tuple[int, ...]
    where: str
    graph_id: int
    variant: Any
    length: Any
    shapes: tuple[tuple[int, ...], ...]
    digests: torch.Tensor
    call_index: int
    others: tuple[Any, ...]
    issued: float
    host: torch.Tensor | None = None  # NCCL: the rows copied to pinned memory, ready when ``ready`` is
    ready: Any = None  # a CUDA event after the copy (None on CPU backends)
    settled: bool = False
    error: BaseException | None = None  # found by the watchdog: raised by the call that settles it
    timeout_message: str | None = None  # the watchdog's account of a check outstanding past the wait
    lock: threading.Lock = field(default_factory=threading.Lock)

    def completed(self) -> bool:
        if self.ready is not None:
            return bool(self.ready.query())
        return bool(self.work.is_completed())

    def rows(self) -> list[list[int]]:
        if self.host is not None:
            self.ready.synchronize()
            return self.host.view(len(self.ranks), -1).tolist()
        return [row.tolist() for row in self.gathered]

    def description(self) -> "CallDescription":
        return CallDescription(dist.get_rank(), str(self.variant), self.length, self.shapes,
                               tuple(int(d) for d in self.digests.tolist()), self.call_index, self.others)


_pending: deque[PendingCheck] = deque()
_pending_lock = threading.Lock()
_watchdog: list[threading.Thread] = []


def _signature(variant: Any, args: Sequence[Any], ranks: tuple[int, ...], length: Any,
               parameter_indices: Sequence[int], device: torch.device) -> tuple[torch.Tensor, tuple, tuple, torch.Tensor, int]:
    """(signature, shapes, other arguments, integer digests, call index) of one call."""
    call_index = _counter.calls.get(ranks, 0)
    _counter.calls[ranks] = call_index + 1
    skip = set(parameter_indices)
    inputs = [a for i, a in enumerate(args) if i not in skip] if skip else list(args)
    tensors = [a for a in inputs if isinstance(a, torch.Tensor)]
    shapes = tuple(tuple(t.shape) for t in tensors)
    others = tuple(a for a in inputs if isinstance(a, (int, float, bool)) and not isinstance(a, torch.Tensor))
    integers = [t for t in tensors if not t.is_floating_point() and not t.is_complex() and t.numel() > 0]
    # Neither the graph id nor the integer (SymInt) arguments: a rank whose chunk is 1 token long
    # fails a guard the others pass (PyTorch specialises sizes of 1), so dynamo recompiles there
    # only, and the same call reaches graph 1 with fresh size symbols on that rank ([2, 7, 7]) and
    # graph 0 on the others ([2, 7]). Those sizes are the tensors' shapes, which are compared.
    header = [0, _cached_digest(_variant_digests, variant), call_index, _cached_digest(_shape_digests, shapes),
              -1 if length is None or length == "-" else int(length)]
    if not integers:
        return torch.tensor(header + [0], dtype=torch.int64, device=device), shapes, others, _NO_DIGESTS, call_index
    digests = torch.stack([integer_digest(t).to(device) for t in integers])
    folded = (digests * torch.arange(1, len(integers) + 1, device=device, dtype=torch.int64)).sum().reshape(1)
    signature = torch.cat([torch.tensor(header, dtype=torch.int64, device=device), folded])
    return signature, shapes, others, digests, call_index


_NO_DIGESTS = torch.zeros(0, dtype=torch.int64)


def check_sp_group_agrees(variant: Any, args: Sequence[Any], group: Any, ranks: Sequence[int], *,
                          graph_id: int, length: Any, parameter_indices: Sequence[int] = (),
                          mode: str | None = None) -> PendingCheck | None:
    """Before a compiled call's first collective: the SP group agrees on variant and inputs.

    The signature is six int64s (a zero where the graph id would be, a digest of the variant, this
    group's call number, a digest of the non-parameter input shapes, the attention length, a
    digest of the integer tensors' values); one all-gather over the group. Only when
    they differ are the readable descriptions exchanged, so every rank raises the same error.

    ``mode`` (default :func:`check_mode`): ``sync`` waits and raises here; ``async`` settles this
    group's earlier checks, issues this one and returns it: the caller settles it after the call
    (:class:`SettledAfterCall`).
    """
    if group is None or _skipped(group):
        return None
    ranks = tuple(ranks)
    nccl = dist.get_backend(group) == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
    signature, shapes, others, digests, call_index = _signature(variant, args, ranks, length, parameter_indices, device)
    where = f"the SP-{len(ranks)} check of graph {graph_id} ({variant}, call {call_index} of group {list(ranks)})"
    if (mode or check_mode("nccl" if nccl else None)) == "sync":
        rows = _exchange(signature, group, ranks, where)
        if all(row == rows[0] for row in rows):
            return None
        mine = CallDescription(dist.get_rank(), str(variant), length, shapes,
                               tuple(int(d) for d in digests.tolist()), call_index, others)
        described: list[Any] = [None] * len(ranks)
        dist.all_gather_object(described, mine, group=group)
        raise RankMismatchError(_mismatch_message(described, graph_id))
    if _pending:
        settle_pending_checks(ranks)
    if nccl:
        gathered_all = torch.empty(len(ranks) * signature.numel(), dtype=torch.int64, device=device)
        work = dist.all_gather_into_tensor(gathered_all, signature, group=group, async_op=True)
        work.wait()  # the current stream waits for the gather; the host does not
        host = torch.empty(gathered_all.shape, dtype=torch.int64, pin_memory=True)
        host.copy_(gathered_all, non_blocking=True)
        ready = torch.cuda.Event()
        ready.record()
        gathered = [gathered_all]
    else:
        gathered = [torch.empty_like(signature) for _ in ranks]
        work = dist.all_gather(gathered, signature, group=group, async_op=True)
        host = ready = None
    pending = PendingCheck(work, gathered, group, ranks, where, graph_id, variant, length, shapes, digests, call_index,
                           others, time.monotonic(), host, ready)
    with _pending_lock:
        _pending.append(pending)
    if not _watchdog:
        _start_watchdog()
    return pending


def _settle(pending: PendingCheck, wait: bool, timeout: float | None = None) -> bool:
    """Compare a pending check's rows if it has completed (or ``wait``: with the bounded wait).
    True once settled; raises :class:`RankMismatchError` (on every rank) on a disagreement."""
    with pending.lock:
        if pending.error is not None:
            raise pending.error
        if pending.settled:
            return True
        if not wait and not pending.completed():
            return False
        try:
            if pending.host is not None:
                _wait_rows(pending.work, [], pending.ranks, pending.where, timeout)
                rows = pending.rows()
            else:
                rows = _wait_rows(pending.work, pending.gathered, pending.ranks, pending.where, timeout)
        except (RankTimeoutError, PeerFailureError) as error:
            pending.error = error
            _forget(pending)
            raise
        pending.settled = True
        _forget(pending)
        if all(row == rows[0] for row in rows):
            return True
        pending.error = RankMismatchError(_mismatch_message(_describe_through_store(pending), pending.graph_id))
        raise pending.error


def _forget(pending: PendingCheck) -> None:
    with _pending_lock:
        try:
            _pending.remove(pending)
        except ValueError:
            pass


def settle_pending_checks(ranks: tuple[int, ...] | None = None) -> None:
    """Wait on (bounded) and compare every outstanding SP-group check, or those of one group;
    raises the first disagreement. ``check_world_agrees`` (``sync_gradients``) runs it first."""
    with _pending_lock:
        outstanding = [p for p in _pending if ranks is None or p.ranks == ranks]
    for pending in outstanding:
        _settle(pending, wait=True)


class SettledAfterCall:
    """Around one compiled call: settle its check at the end if it has completed (a disagreement
    raises before the outputs are returned), and explain a failing call by its check."""

    __slots__ = ("pending",)

    def __init__(self, pending: PendingCheck | None) -> None:
        self.pending = pending

    def __enter__(self) -> "SettledAfterCall":
        return self

    def __exit__(self, kind: Any, error: BaseException | None, traceback: Any) -> bool:
        pending = self.pending
        if pending is None:
            return False
        if error is None:
            _settle(pending, wait=False)
            return False
        if not isinstance(error, Exception) or isinstance(error, (RankMismatchError, RankTimeoutError, PeerFailureError)):
            return False
        # The call's own collectives broke (a peer gave up, or mismatched messages): the check that
        # went ahead of them says why, if it can.
        if pending.timeout_message is not None and not pending.completed():
            raise RankTimeoutError(pending.timeout_message) from error
        try:
            _settle(pending, wait=True, timeout=min(check_timeout_seconds(), 10.0))
        except (RankMismatchError, RankTimeoutError, PeerFailureError) as found:
            raise found from error
        return False


def _describe_through_store(pending: PendingCheck) -> list["CallDescription"]:
    """Every rank's readable call, through the store (the group may be mid-collective or broken)."""
    mine = pending.description()
    store = _store()
    if store is None:
        return [mine]
    prefix = f"{_STORE_PREFIX}check/{'-'.join(map(str, pending.ranks))}/{pending.call_index}/"
    try:
        store.set(prefix + str(mine.rank), pickle.dumps(mine))
        keys = [prefix + str(r) for r in pending.ranks]
        store.wait(keys, datetime.timedelta(seconds=min(check_timeout_seconds(), 60.0)))
        return [pickle.loads(store.get(key)) for key in keys]
    except Exception:  # noqa: BLE001 - a peer that cannot answer: describe what is known
        return [mine]


def _start_watchdog() -> None:
    thread = threading.Thread(target=_watch, name="dcp-rank-check-watchdog", daemon=True)
    _watchdog.append(thread)
    thread.start()


def _watch() -> None:
    """Look at the outstanding checks now and then: one outstanding past the bounded wait gets its
    whereabouts written (peers' errors then name this rank) and logged; one completed while its call
    is still running (blocked in mismatched collectives?) is compared, and a disagreement logged."""
    while True:
        try:
            timeout = check_timeout_seconds()
        except ValueError:
            timeout = DEFAULT_TIMEOUT_SECONDS
        time.sleep(min(0.5, timeout / 4))
        with _pending_lock:
            outstanding = list(_pending)
        now = time.monotonic()
        for pending in outstanding:
            if pending.settled or pending.error is not None:
                continue
            if pending.completed():
                if now - pending.issued > 1.0:
                    try:
                        _settle(pending, wait=True, timeout=1.0)
                    except Exception as error:  # noqa: BLE001 - kept for the call; said now in the log
                        log.error("%s", error)
                        _abort_if_nccl(pending)
            elif pending.timeout_message is None and now - pending.issued > timeout:
                pending.timeout_message = _timeout_message(pending.ranks, pending.where, timeout,
                                                           "the check's all-gather did not complete")
                log.error("%s", pending.timeout_message)
                _abort_if_nccl(pending)


def _abort_if_nccl(pending: PendingCheck) -> None:
    """An NCCL group whose ranks disagree may hang on the device: abort it so the blocked call
    fails (and raises the check's error) instead of waiting for NCCL's own timeout. Gloo cannot be
    aborted mid-collective; there the peer giving up ends the wait."""
    try:
        if dist.get_backend(pending.group) == "nccl":
            pending.group.abort()
    except Exception:  # noqa: BLE001 - best effort: the error is logged either way
        pass


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
    if _pending:
        settle_pending_checks()  # every SP-group check of the step, before the step's reduction
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
