"""Elastic training: a running job changes its number of ranks at step boundaries
(``vfgraph train --max-ranks N --elastic-schedule STEP:RANKS,...``).

The global batch and its V virtual nodes stay fixed; only their shares over the ranks change,
so the training is the same on any layout (bit-identical in deterministic mode).

- **Growing** from n to m ranks: the ranks start m - n new processes with MPI dynamic
  processes (``MPI_Comm_spawn``) as soon as the schedule's next change is that growth, so the
  new processes import TensorFlow and load the model while the job trains on. At the step of
  the growth (once the new processes say they are ready) every rank merges into one
  communicator (``MPI_Intercomm_merge``: the old ranks keep their numbers), the ops switch to
  it, and the model's ``train_broadcast`` signature checks that every rank runs the same graph
  and gives the new ranks every variable of rank 0, the optimizer's slots and step counter
  among them (they exist already: the new ranks loaded the same SavedModel). The step count
  and losses so far travel with the message that lets the new ranks in.
- **Shrinking** to m ranks: ranks m.. leave the communicator (``MPI_Comm_split``) at the step
  of the change and wait, idle, for the end of the job (MPI ends its processes together).

Every rank runs the same logic on the same schedule, so all reach each change at the same
step. A process that waits for others polls (sleeping) instead of spinning in MPI."""
from __future__ import annotations

import logging
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable, List, Optional, Tuple

from vfgraph.errors import InputError
from vfgraph.runtime.world import World

log = logging.getLogger("vfgraph.train")

@dataclass
class ElasticOptions:
    """``schedule``: the --elastic-schedule text; ``max_ranks``: --max-ranks; ``argv``: the
    command line of this run (new processes run it too); ``join``: this is one of them."""

    schedule: str
    max_ranks: Optional[int]
    argv: List[str]
    join: bool = False


GO, READY, END = 3101, 3102, 3103  # message tags between the job's ranks and new or idle ones
JOIN_FLAG = "--elastic-join"  # (hidden) the command line option a new process runs with


def parse_schedule(text: str, max_ranks: int) -> List[Tuple[int, int]]:
    """``STEP:RANKS,...`` as sorted (step, ranks) pairs, each rank count in 1..``max_ranks``."""
    what = f"--elastic-schedule {text}"
    pairs = []
    for part in text.split(","):
        step, sep, ranks = part.strip().partition(":")
        try:
            pairs.append((int(step), int(ranks)))
        except ValueError:
            raise InputError(f"{what}: give STEP:RANKS pairs, e.g. 0:1,5:2,10:4 (not {part.strip()!r})") from None
        if not sep:
            raise InputError(f"{what}: give STEP:RANKS pairs, e.g. 0:1,5:2,10:4 (not {part.strip()!r})")
    steps = [s for s, _ in pairs]
    if steps != sorted(set(steps)) or steps[0] < 0:
        raise InputError(f"{what}: the steps must increase from 0 or more")
    bad = [r for _, r in pairs if not 1 <= r <= max_ranks]
    if bad:
        raise InputError(f"{what}: {bad[0]} ranks is outside 1..{max_ranks} (--max-ranks {max_ranks})")
    return pairs


def _poll(test: Callable[[], Any], interval: float = 0.002) -> Any:
    """Wait until ``test()`` returns a true value, sleeping between tries; returns it."""
    while True:
        got = test()
        if got:
            return got
        time.sleep(interval)


def _wait(request) -> Any:
    """Complete an mpi4py request by polling; its message."""
    while True:
        done, message = request.test()
        if done:
            return message
        time.sleep(0.002)


def _barrier(comm) -> None:
    request = comm.Ibarrier()
    _poll(request.Test)


class Elastic:
    """The schedule on the ranks of a running job. ``argv``: the command line new processes
    run (with :data:`JOIN_FLAG` added); ``use_comm(comm)``: point vfgraph's ops at a new
    communicator."""

    def __init__(self, schedule: List[Tuple[int, int]], argv: List[str], use_comm: Callable[[Any], None]):
        self.schedule, self.argv, self.use_comm = schedule, list(argv), use_comm
        self.inter = None  # the intercommunicator to the processes spawned for the next growth
        self.spawned = 0
        self.spawn_seconds = 0.0
        self.ready = 0  # (rank 0) how many of them said they are ready
        self.parked: List[Tuple[Any, int]] = []  # (rank 0) (communicator, rank) of every rank that left

    def target(self, step: int) -> int:
        ranks = None
        for s, r in self.schedule:
            if s <= step:
                ranks = r
        return ranks

    def check_start(self, w: World) -> None:
        first = self.target(0)
        if first is not None and first != w.size:
            raise InputError(f"--elastic-schedule starts with {first} ranks at step 0, but the job was started "
                             f"with {w.size}: start it with mpiexec -n {first}")

    def _next_change(self, step: int) -> Optional[int]:
        return next((r for s, r in self.schedule if s > step), None)

    def boundary(self, w: World, step: int) -> Tuple[Optional[World], Optional[dict]]:
        """Before step ``step`` on every rank of ``w``: the world to run it on (None on a rank
        that leaves) and, when it changed, what happened (``old``, ``new`` ranks, ``waited``:
        seconds spent waiting for new ranks to load the model, ``began``: when the change
        itself began, a ``time.perf_counter()``). Collective over ``w``."""
        want = self.target(step) or w.size
        if want < w.size:
            return self._shrink(w, want, step)
        if want > w.size:
            if self.inter is None:
                self._spawn(w, want - w.size)
            return self._grow(w, step)
        if self.inter is None and (self._next_change(step) or 0) > w.size:
            self._spawn(w, self._next_change(step) - w.size)  # they warm up while the job trains on
        return w, None

    def _spawn(self, w: World, n: int) -> None:
        from mpi4py import MPI

        began = time.perf_counter()
        self.inter = w.comm.Spawn(sys.executable, args=["-m", "vfgraph.cli", *self.argv, JOIN_FLAG], maxprocs=n,
                                  root=0)
        self.spawned, self.ready, self.spawn_seconds = n, 0, time.perf_counter() - began
        if w.is_root:
            log.info("started %d new rank%s for the next growth (%.3g s)", n, "s" if n > 1 else "",
                     self.spawn_seconds)
        assert self.inter != MPI.COMM_NULL

    def _grow(self, w: World, step: int) -> Tuple[World, dict]:
        from mpi4py import MPI

        waited = time.perf_counter()
        if w.is_root:  # wait (polling) until every new process has loaded the model
            def all_ready():
                while self.inter.Iprobe(source=MPI.ANY_SOURCE, tag=READY):
                    self.inter.recv(source=MPI.ANY_SOURCE, tag=READY)
                    self.ready += 1
                return self.ready >= self.spawned
            _poll(all_ready)
        _barrier(w.comm)
        began = time.perf_counter()
        old = w.size
        if w.is_root:
            for r in range(self.spawned):
                self.inter.send({"step": step}, dest=r, tag=GO)
        merged = self.inter.Merge(high=False)
        self.inter = None
        new = self._switch(merged)
        return new, {"old": old, "new": new.size, "waited": began - waited, "began": began}

    def _shrink(self, w: World, want: int, step: int) -> Tuple[Optional[World], Optional[dict]]:
        from mpi4py import MPI

        began = time.perf_counter()
        stays = w.rank < want
        kept = w.comm.Split(0 if stays else MPI.UNDEFINED, w.rank)
        if w.is_root:
            self.parked.extend((w.comm, r) for r in range(want, w.size))
        if not stays:
            return None, None
        return self._switch(kept), {"old": w.size, "new": want, "waited": 0.0, "began": began}

    def _switch(self, comm) -> World:
        self.use_comm(comm.Dup())
        return World(comm.Get_rank(), comm.Get_size(), comm)

    def park(self, w: World) -> None:
        """On a rank that left: wait, idle, until rank 0 ends the job."""
        _wait(w.comm.irecv(source=0, tag=END))

    def finish(self, w: World) -> None:
        """On rank 0 at the end of the job (or when it fails): release the ranks that left and
        any new processes still waiting to join."""
        for comm, r in self.parked:
            comm.send(None, dest=r, tag=END)
        self.parked = []
        if self.inter is not None:
            for r in range(self.spawned):
                self.inter.send(None, dest=r, tag=GO)
            self.inter = None


def parent():
    """In a process a job spawned (``--elastic-join``): initialise MPI at once (the job's ranks
    wait in the spawn until it has) and return the intercommunicator to the job."""
    from vfgraph import ops

    ops.load()
    from mpi4py import MPI

    comm = MPI.Comm.Get_parent()
    if comm == MPI.COMM_NULL:
        raise InputError(f"{JOIN_FLAG} is for the processes a running 'vfgraph train --elastic-schedule' starts")
    return comm


def join(inter, use_comm: Callable[[Any], None], started: float) -> Tuple[Optional[World], int]:
    """In a spawned process that has loaded the model and the data: say so, wait (polling) for
    the job to let it in, and merge into the job's communicator. Returns the world and the step
    the job is at; the world is None when the job ended before letting it in."""
    inter.send(None, dest=0, tag=READY)
    go = _wait(inter.irecv(source=0, tag=GO))
    if go is None:
        return None, 0
    merged = inter.Merge(high=True)
    use_comm(merged.Dup())
    w = World(merged.Get_rank(), merged.Get_size(), merged)
    log.info("rank %d joined at step %d, %.3g s after it started", w.rank, go["step"], time.perf_counter() - started)
    return w, go["step"]
