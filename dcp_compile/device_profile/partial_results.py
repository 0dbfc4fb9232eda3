"""Benchmark tables that survive a timeout.

A lent GPU gives a session minutes, and ``benchmarks/gpu_check.sh`` stops each step with
``timeout --signal=INT``: a script that writes its table only at the end loses everything it
measured. The scripts the check runs therefore rewrite their tables after every measured case, each
write saying how far the run got (:meth:`Progress.status`), and :func:`interruptible` turns SIGINT
and SIGTERM into one last write that says "partial: stopped after N of M cases" before the process
exits. Files are replaced atomically (:func:`write_atomic`), so a kill in the middle of a write
leaves the previous complete version, never half a file.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Callable, Iterator

DRY_RUN_LABEL = "dry run on CPU"


@dataclass
class Progress:
    """How many of a run's cases are measured, and why it stopped early (if it did)."""

    total: int
    unit: str = "cases"
    done: int = 0
    stopped: str | None = None  # set when the run ends before its last case: the reason

    @property
    def complete(self) -> bool:
        return self.stopped is None and self.done >= self.total

    def status(self) -> str:
        """One line for the table's header: what a reader may conclude from the rows below."""
        if self.stopped is not None:
            return f"partial: stopped after {self.done} of {self.total} {self.unit} ({self.stopped})"
        if self.done >= self.total:
            return f"complete: {self.done} of {self.total} {self.unit}"
        return (f"partial: {self.done} of {self.total} {self.unit} so far (written while the run was going; "
                "if nothing follows, it was killed)")


def write_atomic(path: str | os.PathLike[str], text: str) -> Path:
    """Write ``text`` to ``path`` through a temporary file and a rename: readers (and a kill) see the
    old file or the new one, never a truncated one."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    handle, temporary = tempfile.mkstemp(prefix=f".{target.name}.", dir=target.parent)
    try:
        with os.fdopen(handle, "w") as stream:
            stream.write(text)
        os.chmod(temporary, 0o644)  # mkstemp makes it private; a results file is not
        os.replace(temporary, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        raise
    return target


class Stopped(KeyboardInterrupt):
    """SIGTERM, raised where the program is (as Python raises KeyboardInterrupt for SIGINT)."""


def _raise_stopped(signum: int, frame: FrameType | None) -> None:
    raise Stopped(f"signal {signal.Signals(signum).name}")


@contextlib.contextmanager
def interruptible(progress: Progress, flush: Callable[[], None]) -> Iterator[Progress]:
    """Run the block; on SIGINT or SIGTERM mark ``progress`` stopped, call ``flush`` (which rewrites
    the tables with ``progress.status()``) and exit with 128 + the signal's number, so the caller
    sees a stopped run and still finds a valid, partial table. An exception is marked and flushed the
    same way, then raised again."""
    previous = signal.getsignal(signal.SIGTERM)
    previous_int = signal.getsignal(signal.SIGINT)
    in_main_thread = True
    try:
        signal.signal(signal.SIGTERM, _raise_stopped)
    except ValueError:  # not the main thread: leave SIGTERM alone
        in_main_thread = False
    try:
        yield progress
    except KeyboardInterrupt as stop:
        name = "SIGTERM" if isinstance(stop, Stopped) else "SIGINT"
        progress.stopped = f"{name}: the step's time limit, or a user, stopped the run"
        # A second signal during the last write must not lose it: ignore both while flushing.
        if in_main_thread:
            signal.signal(signal.SIGINT, signal.SIG_IGN)
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
        flush()
        print(f"stopped by {name}: wrote what was measured ({progress.status()})", file=sys.stderr, flush=True)
        raise SystemExit(128 + (signal.SIGTERM if name == "SIGTERM" else signal.SIGINT)) from None
    except Exception as error:  # a failing case: the tables say where it stopped and why, then the error goes on
        progress.stopped = f"error: {type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
        flush()
        raise
    finally:
        if in_main_thread:
            signal.signal(signal.SIGTERM, previous)
            signal.signal(signal.SIGINT, previous_int)
