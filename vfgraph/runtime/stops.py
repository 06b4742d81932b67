"""How a training run stops: the errors that end it, SIGINT and SIGTERM as requests to stop
after the step in progress, and the stall limits of the waits for other ranks."""
from __future__ import annotations

import atexit
import os
import signal
import sys
import threading
import time
from typing import Callable, Dict, List, Optional

from vfgraph.errors import VfgraphError


class TrainingError(VfgraphError):
    """Training stopped: the ranks disagree or a collective failed."""


STOP, NONFINITE = 1, 2  # what a rank saw in a step (bits)


class NonFiniteLoss(TrainingError):
    """The loss of a step was NaN or infinite (``--allow-nonfinite`` trains on)."""


class Interrupted(TrainingError):
    """Stopped by SIGINT or SIGTERM after a whole step, with a checkpoint of it."""

    exit_code = 130
    label = "interrupted"


class Stalled(TrainingError):
    """A wait for other ranks made no progress for ``--stall-timeout`` seconds."""

    exit_code = 75  # EX_TEMPFAIL: the job can be resumed from its last checkpoint
    label = "stalled"


class StopRequests:
    """While training: SIGINT and SIGTERM ask the run to stop after the step in progress (with
    a checkpoint) instead of killing it mid-step. A second signal, a second or more after the
    first (one Ctrl-C can reach a process twice, directly and through a launcher), stops at
    once."""

    def __init__(self):
        self.first: Optional[float] = None
        self._old: Dict[int, object] = {}

    @property
    def requested(self) -> bool:
        return self.first is not None

    def _handle(self, signum, frame):
        now = time.monotonic()
        if self.first is None:
            self.first = now
        elif now - self.first > 1.0:
            self.__exit__()
            raise KeyboardInterrupt

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            for s in (signal.SIGINT, signal.SIGTERM):
                self._old[s] = signal.signal(s, self._handle)
        return self

    def __exit__(self, *exc):
        for s, h in self._old.items():
            signal.signal(s, h)
        self._old = {}


STOP_GRACE = 2.0  # seconds a wait for other ranks goes on after a stop request (or its own start)


class WatchedExchanges:
    """The stall limits and stop requests for the runtime's own exchanges between ranks (the
    World's gathers, polled by ``world.complete``), as the ops apply them to their waits: one
    line past ``warning`` seconds, :class:`Stalled` past ``timeout``, :class:`Interrupted`
    :data:`STOP_GRACE` seconds after a stop request. ``where()`` and ``kept()`` say the step and
    the checkpoint kept. The line names the ranks not seen entering the exchange (the ranks
    announce an exchange they wait in, :class:`vfgraph.runtime.world._Exchanges`)."""

    def __init__(self, stop: "StopRequests", warning: float, timeout: float, rank, where, kept):
        self.stop, self.warning, self.timeout, self.rank = stop, warning, timeout, rank
        self.where, self.kept = where, kept
        self.warned: Optional[float] = None  # the start of the wait that printed its line

    def __call__(self, began: float, missing: Callable[[], Optional[List[int]]]) -> None:
        now = time.monotonic()
        what = f"the ranks' exchange at {self.where()}"
        if self.stop.first is not None and now - max(self.stop.first, began) > STOP_GRACE:
            end_before_finalize(Interrupted.exit_code)
            raise Interrupted(f"rank {self.rank()}, {self.where()}: stopped while waiting for other ranks{self.kept()}")
        if self.warning and now - began > self.warning and self.warned != began:
            self.warned = began
            limit = f"; the job ends after --stall-timeout {self.timeout:g} s without progress" if self.timeout \
                else "; no --stall-timeout: waiting on"
            print(f"vfgraph: rank {self.rank()}: waiting {now - began:.0f} s in {what} for "
                  f"{waited_for(missing())}{limit}", file=sys.stderr, flush=True)
        if self.timeout and now - began > self.timeout:
            end_before_finalize(Stalled.exit_code)
            raise Stalled(f"rank {self.rank()}, {self.where()}: waited {now - began:.0f} s in {what} for "
                          f"{waited_for(missing())} without progress (--stall-timeout {self.timeout:g}); the job ends"
                          f"{self.kept()}")


def waited_for(absent: Optional[List[int]]) -> str:
    """The ranks an exchange waits for, as a stall's line names them."""
    if absent is None:
        return "the other ranks (which ones, not known yet)"
    if not absent:
        return "the other ranks (each was seen entering it)"
    return f"rank{'s' if len(absent) > 1 else ''} {', '.join(map(str, absent))} (not seen entering it)"


def end_before_finalize(code: int) -> None:
    """After a wait for other ranks gave up (a stall, a stop request): at the interpreter's exit,
    end the job with ``code`` (``MPI_Abort``, whose code the launcher returns) before mpi4py
    finalizes MPI, which would wait for the very ranks given up on (a stopped rank never
    answers). The MPI library's own line about the abort is not printed: this rank's error
    says what happened."""
    def end() -> None:
        sys.stdout.flush()
        sys.stderr.flush()
        try:
            from mpi4py import MPI

            with open(os.devnull, "w") as null:
                os.dup2(null.fileno(), 2)
            MPI.COMM_WORLD.Abort(code)
        finally:
            os._exit(code)

    atexit.register(end)  # (runs before mpi4py's finalization, which Python runs after atexit's)
