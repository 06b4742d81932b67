"""The set of processes a run spans: one process, or the ranks ``mpiexec`` started."""
from __future__ import annotations

import atexit
import os
import pickle
import socket
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple, TypeVar

from vfgraph.errors import InputError, InternalError, Quiet, VfgraphError

T = TypeVar("T")

# Environment variables MPI launchers set in every process they start.
_LAUNCHER_SIZE = ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "PMIX_SIZE", "MPI_LOCALNRANKS")


_SLOT = 128  # bytes per rank of World.gather's first call: its length, then a small value

# set in a process when its job lost ranks (elastic runs): waits for the others then give up
lost = threading.Event()


class RankLost(Exception):
    """A wait for the other ranks gave up: the job lost a rank (see :data:`lost`)."""


# called as a wait polls, with the time.monotonic() it began and a function giving the ranks not
# seen entering the exchange waited in (None: not known), where the runtime watches its waits (vfgraph train: stall
# limits, stop requests); it may raise to give the wait up
watcher: Optional[Callable[[float, Callable[[], Optional[List[int]]]], None]] = None

ANNOUNCE_AFTER = 1.0  # seconds a wait in an exchange lasts before the rank announces that it is in it


class _Exchanges:
    """The numbering of a communicator's exchanges (every rank makes the same exchanges in the same
    order, so the n-th exchange has number n on every rank) and the announcements by which a wait
    names the ranks not in it: a rank whose wait in exchange n passes :data:`ANNOUNCE_AFTER`
    sends n to the other ranks; the ranks whose latest announcement is below n were not seen
    entering it (or came within that time). The announcements travel on a duplicate of the
    communicator, made (nonblocking) by its first exchange: a message nobody received is left
    there, never on the communicator itself, where MPICH's finalization can trip over it. Kept
    as an attribute of the communicator, so a new communicator (an elastic resize) numbers from
    0 on every rank."""

    _keyval: Optional[int] = None
    _made: List["_Exchanges"] = []  # every one made in this process: their duplicates are freed at its exit
    TAG = 1

    def __init__(self, comm):
        self.size, self.rank = comm.Get_size(), comm.Get_rank()
        self.count = 0
        self.seen = [-1] * self.size
        self.sent: List[Any] = []  # the announcements' buffers
        self.channel, self.made = comm.Idup()

    @classmethod
    def of(cls, comm) -> "_Exchanges":
        from mpi4py import MPI

        if cls._keyval is None:
            cls._keyval = MPI.Comm.Create_keyval()
        state = comm.Get_attr(cls._keyval)
        if state is None:
            state = cls(comm)
            comm.Set_attr(cls._keyval, state)
            if not cls._made:
                atexit.register(cls.free_all)
            cls._made.append(state)
        return state

    @classmethod
    def free_all(cls) -> None:
        """Free the duplicates every rank made (before MPI's finalization, which would report
        a communicator left referring to the job's own), with any announcement left in them."""
        for state in cls._made:
            if state.ready():
                state.channel.Free()
        cls._made.clear()

    def ready(self) -> bool:
        """Whether the duplicate is made (every rank started its first exchange)."""
        if self.made is not None and self.made.Test():
            self.made = None
        return self.made is None

    def announce(self, number: int) -> None:
        import numpy as np

        if not self.ready():
            return
        buf = np.array([number], np.int64)
        self.sent.append(buf)  # (kept: a freed request's buffer must outlive its send)
        for r in range(self.size):
            if r != self.rank:
                self.channel.Isend(buf, dest=r, tag=self.TAG).Free()

    def missing(self, number: int) -> Optional[List[int]]:
        """The ranks whose announcements so far are all of exchanges before ``number`` (None
        before the duplicate is made: not known)."""
        import numpy as np
        from mpi4py import MPI

        if not self.ready():
            return None
        status = MPI.Status()
        while self.channel.Iprobe(source=MPI.ANY_SOURCE, tag=self.TAG, status=status):
            got = np.zeros(1, np.int64)
            self.channel.Recv(got, source=status.Get_source(), tag=self.TAG)
            self.seen[status.Get_source()] = max(self.seen[status.Get_source()], int(got[0]))
        return [r for r in range(self.size) if r != self.rank and self.seen[r] < number]


def complete(request, comm=None) -> None:
    """Wait for an MPI request (mpi4py) by testing it, yielding between tests for the first
    millisecond and then sleeping (0.2 ms, growing to an eighth of the time waited, at most 1 ms,
    as the ops' waits): a rank
    that waits for a slower one leaves it the CPU, and the wait gives up
    (:class:`RankLost`) when the job lost a rank, where a blocking call would wait for ever,
    or when :data:`watcher` raises. ``comm``: the communicator of the exchange the request
    belongs to, whose ranks not seen entering it the watcher is told (see :class:`_Exchanges`)."""
    began = time.monotonic()
    exchanges = _Exchanges.of(comm) if comm is not None else None
    number = -1
    if exchanges is not None:
        number, exchanges.count = exchanges.count, exchanges.count + 1
    announced = exchanges is None
    while not request.Test():
        if lost.is_set():
            raise RankLost()
        if not announced and time.monotonic() - began > ANNOUNCE_AFTER:
            exchanges.announce(number)
            announced = True
        if watcher is not None:
            watcher(began, (lambda: exchanges.missing(number)) if exchanges is not None else lambda: None)
        waited = time.monotonic() - began
        time.sleep(0 if waited < 0.001 else min(0.001, max(0.0002, waited / 8)))


def arrive(comm) -> None:
    """Wait until every rank of ``comm`` has arrived here (:func:`complete`)."""
    complete(comm.Ibarrier(), comm)


def launched_by_mpi() -> bool:
    """Whether this process was started by an MPI launcher (mpiexec, mpirun, srun)."""
    return any(k in os.environ for k in _LAUNCHER_SIZE)


@dataclass
class World:
    """``rank`` of ``size`` processes; ``comm`` is the mpi4py communicator (None on one process)."""

    rank: int = 0
    size: int = 1
    comm: Any = None

    @property
    def is_root(self) -> bool:
        return self.rank == 0

    def agree(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` on every rank; if it fails on any rank, every rank stops (so none waits
        forever in a collective its peers never reach). The lowest failing rank raises its
        error, named by rank unless every rank failed alike; the others raise :class:`Quiet`,
        so the error is printed once."""
        err: Optional[VfgraphError] = None
        result = None
        try:
            result = fn()
        except VfgraphError as e:
            err = e
        except Exception as e:  # noqa: BLE001 - a crash on one rank must not leave the others waiting
            if self.comm is None:
                raise
            err = InternalError(f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
        if self.comm is None:
            if err is not None:
                raise err
            return result
        errors = self.gather(None if err is None else (str(err), err.exit_code))
        failed = [r for r, e in enumerate(errors) if e is not None]
        if not failed:
            return result
        if self.rank != failed[0]:
            raise Quiet(errors[failed[0]][1])
        if len(failed) < self.size or len({e[0] for e in errors}) > 1:
            err.rank = self.rank
        raise err

    def gather(self, value: T) -> List[T]:
        """``value`` of every rank, in rank order."""
        if self.comm is None:
            return [value]
        import numpy as np
        from mpi4py import MPI

        # (nonblocking calls, completed by polling: a wait for a rank the job lost gives up). A
        # small value travels in one call, in a slot of fixed size after its length; a larger
        # one (any rank's) in a second call, every rank's at its length
        data = pickle.dumps(value)
        mine = np.zeros(_SLOT, np.uint8)
        mine[:8] = np.frombuffer(np.int64(len(data)).tobytes(), np.uint8)
        if len(data) <= _SLOT - 8:
            mine[8:8 + len(data)] = np.frombuffer(data, np.uint8)
        slots = np.zeros((self.size, _SLOT), np.uint8)
        complete(self.comm.Iallgather(mine, slots), self.comm)
        sizes = slots[:, :8].copy().view(np.int64)[:, 0].tolist()
        if max(sizes) <= _SLOT - 8:
            return [pickle.loads(slots[r, 8:8 + n].tobytes()) for r, n in enumerate(sizes)]
        starts = np.concatenate([[0], np.cumsum(sizes)[:-1]]).tolist()
        got = bytearray(sum(sizes))
        complete(self.comm.Iallgatherv([data, MPI.BYTE], [got, sizes, starts, MPI.BYTE]), self.comm)
        return [pickle.loads(got[a:a + n]) for a, n in zip(starts, sizes)]

    def bcast(self, value: T) -> T:
        """Rank 0's ``value`` on every rank."""
        if self.comm is None:
            return value
        import numpy as np
        from mpi4py import MPI

        data = pickle.dumps(value) if self.is_root else b""
        size = np.array([len(data)], np.int64)
        complete(self.comm.Ibcast(size, root=0), self.comm)
        got = bytearray(data) if self.is_root else bytearray(int(size[0]))
        complete(self.comm.Ibcast([got, MPI.BYTE], root=0), self.comm)
        return value if self.is_root else pickle.loads(got)

    def describe(self) -> List[str]:
        """One line per rank: host and process id (to match a launcher's report of a lost process)."""
        me = f"{socket.gethostname()} pid {os.getpid()}"
        table = self.gather(me)
        return [f"rank {r}: {t}" for r, t in enumerate(table)]


_launched: Optional[World] = None  # launched_world()'s, once it was asked for


def launched_world() -> World:
    """The ranks an MPI launcher started, with MPI started through mpi4py only (no TensorFlow,
    no ops: a second or less), so that a run's first checks already agree over the ranks (an
    error printed once); one process otherwise. Its first :meth:`World.agree` is the first
    collective call of every rank (:func:`agreeing`)."""
    global _launched
    if _launched is None:
        if not launched_by_mpi():
            return World()
        from vfgraph.ops import toolchain

        comm = toolchain.import_mpi().COMM_WORLD
        _launched = World(comm.Get_rank(), comm.Get_size(), comm)
    return _launched


def agreeing() -> bool:
    """Whether this process joined its ranks' agreements (:func:`launched_world`): an error
    from before that has not been shared with the other ranks yet."""
    return _launched is not None


def same_everywhere(w: World, values: Dict[str, Tuple[Any, str]]) -> None:
    """Collective over ``w``: refuse to go on (:class:`InputError`, printed once) unless every
    rank holds the same ``values``: what must be equal for the ranks to run the same steps,
    each an option's name -> (what is compared, how it is shown). The message names each
    option that differs and which ranks hold which value."""
    table = w.gather(values)

    def check() -> None:
        differ = []
        for key in dict.fromkeys(k for row in table for k in row):
            held: Dict[Any, Tuple[str, List[int]]] = {}
            for r, row in enumerate(table):
                compared, shown = row.get(key, (None, "nothing"))
                held.setdefault(compared, (shown, []))[1].append(r)
            if len(held) > 1:
                differ.append(f"{key} " + ", ".join(f"{shown} on {_rank_list(ranks)}"
                                                    for shown, ranks in held.values()))
        if differ:
            raise InputError(f"the ranks were started with different options: {'; '.join(differ)}; start every rank "
                             "with the same options, model and data")

    w.agree(check)


def _rank_list(ranks: List[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {','.join(map(str, ranks))}"


def world(need_mpi: bool, stages: int = 0) -> World:
    """This run's world. Under an MPI launcher (or when the model contains MPI ops), MPI is
    started through mpi4py and the ops use a private duplicate of ``COMM_WORLD``, split into
    the ranks of each of ``stages`` pipeline stages when that many stages divide the ranks."""
    if not (need_mpi or launched_by_mpi()):
        return World()
    from vfgraph import ops

    ops.load()
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    size = comm.Get_size()
    ops.set_communicator(comm.Dup(), stages=stages if stages > 1 and size > 1 and size % stages == 0 else 0)
    if size > 1 and not need_mpi:
        raise InputError("this model has no all-reduce, so its ranks would train separate copies; rewrite it "
                         "with virtual nodes and --allreduce mpi (the default when vfgraph's MPI ops build)")
    return World(comm.Get_rank(), comm.Get_size(), comm)


def shares(total: int, size: int, given: Optional[List[int]] = None) -> List[int]:
    """Virtual nodes per rank: ``given``, or ``total`` split as evenly as possible."""
    if given is not None:
        if len(given) != size or any(v < 1 for v in given) or sum(given) != total:
            raise InputError(f"--vnodes-per-rank {','.join(map(str, given))}: needs {size} positive counts "
                             f"(one per rank) that add up to the {total} virtual nodes of the global batch")
        return list(given)
    if total < size:
        raise InputError(f"the global batch holds {total} virtual nodes, fewer than the {size} ranks; "
                         "raise --batch-size or run fewer ranks")
    return [total // size + (1 if r < total % size else 0) for r in range(size)]


def resident_bytes(field: str) -> int:
    """This process's resident memory now (``VmRSS``) or at its peak (``VmHWM``), in bytes; 0
    where /proc does not say."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def threads_per_rank(visible: int, total: int, local_ranks: int) -> int:
    """TensorFlow threads for one rank: the CPUs it may run on when the launcher bound it to
    fewer than the machine has (``visible`` < ``total``), else the machine's CPUs shared by the
    ``local_ranks`` processes on this host. At least one."""
    if visible < total:
        return max(1, visible)
    return max(1, total // max(1, local_ranks))


def place_threads(w: World, threads: Optional[int] = None, stages: int = 1) -> int:
    """Give this process's TensorFlow ``threads`` intra-op threads (by default
    :func:`threads_per_rank`, shared by ``stages`` pipeline stages) and one inter-op thread
    per stage, before TensorFlow starts its runtime; returns the intra-op threads TensorFlow
    has. Ranks that share a host would otherwise each start a thread pool per CPU and spin
    against each other. One inter-op thread: a rewritten step runs its virtual nodes in
    sequence, the collectives in a fixed chain, and each op spreads over the intra-op threads
    (CPU tuning guides for TensorFlow advise about one inter-op thread per socket). A rank
    that runs one stage of a pipeline gets one too: its messages wait on threads of their own
    and its virtual nodes still overlap (the next one starts when its tensors arrive); a second
    inter-op thread would run two ops at once on the rank's core, each evicting the other's
    data from its caches (measured: a 2-stage MLP at 16 virtual nodes steps in 211-223 ms on 2
    ranks with one, 242-289 ms with two, 338-372 ms unpartitioned on one core)."""
    if threads is not None and threads < 1:
        raise InputError(f"--threads {threads}: give a positive number of threads per rank")
    local = 1
    if w.comm is not None:  # (a collective call: on every rank, whether it gave --threads or not)
        from mpi4py import MPI

        shared = w.comm.Split_type(MPI.COMM_TYPE_SHARED)
        local = shared.Get_size()
        shared.Free()
    if threads is None:
        visible = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        threads = max(1, threads_per_rank(visible, os.cpu_count() or visible, local) // max(stages, 1))
    import tensorflow as tf

    try:
        tf.config.threading.set_intra_op_parallelism_threads(threads)
        tf.config.threading.set_inter_op_parallelism_threads(max(stages, 1))
    except RuntimeError:  # TensorFlow already running in this process (the embedding program chose)
        pass
    return tf.config.threading.get_intra_op_parallelism_threads()
