"""Elastic training: a running job changes its number of ranks at step boundaries
(``vfgraph train --max-ranks N``, with ``--elastic-schedule STEP:RANKS,...``, requests from
``vfgraph resize OUTPUT N``, or ``--host-discovery-script CMD``).

The global batch and its V virtual nodes stay fixed; only their shares over the ranks change,
so the training is the same on any layout (bit-identical in deterministic mode).

- **Growing** from n to m ranks: ranks that left the job come back first (at once: they are
  warm). For the rest, rank 0 starts new processes as a job of their own (``mpiexec``, the
  launcher beside this Python; on the free slots of the hosts a discovery script lists) as
  soon as the schedule's next change is that growth, so they import TensorFlow and load the
  model while the job trains on; they connect to a port rank 0 opened
  (``MPI_Comm_connect``/``MPI_Comm_accept``, on a thread of every rank). At the step of the
  growth (once the new processes say they are ready) every rank merges into one
  communicator (``MPI_Intercomm_merge``: the old ranks keep their numbers), the ops switch to
  it, and the model's ``train_broadcast`` signature checks that every rank runs the same graph
  and gives the new ranks every variable of rank 0, the optimizer's slots and step counter
  among them (they exist already: the new ranks loaded the same SavedModel). The step and the
  requests taken so far travel with the message that lets the new ranks in. A growth from the
  schedule waits at its step for new ranks still loading (the schedule's layouts are exact);
  one from a request trains on until they are ready.
- **Shrinking** to m ranks: ranks m.. leave the communicator (``MPI_Comm_split``) at the step
  of the change and wait, idle, for the end of the job (MPI ends its processes together) or
  for a growth to call them back (they connect to rank 0's port again).

- **Losing ranks**: each start of new ranks runs under a launcher of its own, so its end does
  not end the job's launcher. Rank 0 watches those launchers; when ranks that joined end
  while the job runs, it tells the other ranks that joined, every rank's waits for the lost
  ones give up, rank 0 goes back to its last completed step (its variables kept in memory
  while the job runs on more than one rank), and the ranks left connect to its port again,
  take its variables and train on with it, growing again as the schedule, requests or
  discovery say. Where it cannot, the job ends with a message (exit status 4; the last
  checkpoint is kept).

Every rank runs the same logic on the same schedule, so all reach each change at the same
step. A process that waits for others polls (sleeping) instead of spinning in MPI."""
from __future__ import annotations

import atexit
import json
import logging
import os
import re
import shutil
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, List, Optional, Tuple

from vfgraph.errors import InputError
from vfgraph.io import outputs
from vfgraph.runtime.world import World, arrive

log = logging.getLogger("vfgraph.train")


@dataclass
class ElasticOptions:
    """``schedule``: the --elastic-schedule text; ``max_ranks``: --max-ranks; ``argv``: the
    command line of this run (new processes run it too); ``join``: this is one of them;
    ``started``: when its command began (``time.time()``)."""

    schedule: str
    max_ranks: Optional[int]
    argv: List[str]
    join: bool = False
    started: float = 0.0  # time.time() when its command began
    discovery: str = ""  # --host-discovery-script
    interval: float = 5.0  # --discovery-interval


GO, READY, END, LOST = 3101, 3102, 3103, 3104  # message tags between the job's ranks and new or idle ones
JOIN_FLAG = "--elastic-join"  # (hidden) the command line option a new process runs with
PORT_ENV = "VFGRAPH_ELASTIC_PORT"  # the port a new process connects to (set by rank 0 for the processes it starts)
GROUP_ENV = "VFGRAPH_ELASTIC_GROUP"  # which start of new processes a process is (1, 2, ...; the job's own ranks: 0)
LOST_EXIT = 4  # the exit status of a job that lost ranks
# what a launcher tells the processes it starts: not passed on to a launcher of their own
# (HYDRA_* are the user's settings of MPICH's launcher, e.g. HYDRA_LAUNCHER_EXEC: passed on)
_LAUNCHER_ENV = ("PMI_", "PMIX_", "HYDI_", "MPI_LOCALNRANKS", "MPI_LOCALRANKID")


def survivable_transports() -> None:
    """(before MPI starts, in every process of an elastic job) Keep UCX, which carries the
    messages between the job's ranks and those that joined it, from copying through another
    process's memory (its ``cma`` transport, ``process_vm_readv``): a rank that reads from a
    peer that was just killed is then aborted by UCX, where the other transports leave the wait
    to give up. A ``UCX_TLS`` the user set is kept."""
    os.environ.setdefault("UCX_TLS", "^cma")


def launcher() -> str:
    """The mpiexec beside this Python (the one its MPI came with), else the first on PATH."""
    here = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    return here if os.access(here, os.X_OK) else (shutil.which("mpiexec") or "mpiexec")


def launch(n: int, command: List[str], port: str, group: int = 0,
           hosts: Optional[List[Tuple[str, int]]] = None) -> subprocess.Popen:
    """Start ``n`` processes running ``command`` as a launcher job of their own (on ``hosts``:
    (host, processes), else where the launcher places them), the job's ``group``-th start,
    told to connect to ``port``; they end when this process does."""
    from vfgraph.runtime.supervise import die_with_parent

    env = {k: v for k, v in os.environ.items() if not k.startswith(_LAUNCHER_ENV)}
    env[PORT_ENV], env[GROUP_ENV] = port, str(group)
    where = ["-host", ",".join(f"{h}:{k}" for h, k in hosts)] if hosts else []
    return subprocess.Popen([launcher(), *where, "-n", str(n), *command], env=env, stdin=subprocess.DEVNULL,
                            preexec_fn=die_with_parent)


# a process that connects to the job's port and ends: the job's accept of new processes whose
# launcher ended before they connected then ends too (MPI cannot cancel an accept)
_UNBLOCK = f"import os\nfrom mpi4py import MPI\nMPI.COMM_WORLD.Connect(os.environ['{PORT_ENV}'], root=0)\nos._exit(0)"


def request_path(out: str) -> str:
    """Where ``vfgraph resize OUT N`` asks the elastic job writing ``OUT`` for N ranks."""
    return os.path.abspath(out) + ".resize"


def request(out: str, ranks: int) -> str:
    """Ask the elastic job writing ``out`` for ``ranks`` ranks (it takes or refuses the request
    at its next step, and logs which); returns the request's path. Refused, writing nothing,
    when no job runs on ``out`` or the one that does is not elastic (its output lock tells)."""
    if not isinstance(ranks, int) or ranks < 1:
        raise InputError(f"resize to {ranks} ranks: give at least 1")
    out_abs = os.path.abspath(out)
    job = outputs.holder(out_abs)
    if job is None:
        raise InputError(f"{out_abs}: no training job is running on it (none holds {outputs.lock_path(out_abs)}); "
                         "resize asks a running elastic job: give the -o OUTPUT of one started with --max-ranks N")
    if not job.get("elastic"):
        raise InputError(f"{out_abs}: the job writing it (pid {job.get('pid', '?')}: {job.get('command') or '?'}) is "
                         "not elastic, so it cannot be resized; start a job with --max-ranks N and "
                         "--elastic-schedule or --host-discovery-script to resize it")
    path = request_path(out)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump({"ranks": ranks}, f)
    os.replace(tmp, path)
    return path


def parse_schedule(text: str, max_ranks: int) -> List[Tuple[int, int]]:
    """``STEP:RANKS,...`` as sorted (step, ranks) pairs, each rank count in 1..``max_ranks``."""
    what = f"--elastic-schedule {text}"
    pairs: List[Tuple[int, int]] = []
    if not text:
        return pairs
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
    """Wait until ``test()`` returns a true value, sleeping between tries; returns it. Gives up
    (:class:`RankLost`) when the job lost ranks."""
    from vfgraph.runtime import world

    while True:
        got = test()
        if got:
            return got
        if world.lost.is_set():
            raise world.RankLost()
        time.sleep(interval)


def _wait(request) -> Any:
    """Complete an mpi4py request by polling; its message."""
    while True:
        done, message = request.test()
        if done:
            return message
        time.sleep(0.002)


def group() -> int:
    """Which start of new processes this process is (see :data:`GROUP_ENV`); 0 for the job's
    own ranks."""
    return int(os.environ.get(GROUP_ENV) or 0)


def parse_hosts(output: str) -> List[Tuple[str, int]]:
    """The hosts a host-discovery script's output lists and their slots, in its order: one line
    per host, ``HOST`` (one slot) or ``HOST:SLOTS`` (the format of Horovod's elastic mode); the
    names of this host (``localhost``, its own name) as :func:`socket.gethostname` says it."""
    hosts: dict = {}
    for line in output.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        host, sep, slots = line.rpartition(":") if ":" in line else (line, "", "1")
        if not host or not slots.isdigit():
            raise ValueError(f"{line!r} is not HOST or HOST:SLOTS")
        host = socket.gethostname() if host in ("localhost", "127.0.0.1", socket.getfqdn()) else host
        hosts[host] = hosts.get(host, 0) + int(slots)
    return list(hosts.items())


def count_slots(output: str) -> int:
    """The slots a host-discovery script's output lists (:func:`parse_hosts`)."""
    return sum(n for _, n in parse_hosts(output))


def place(n: int, hosts: List[Tuple[str, int]], used: List[str]) -> List[Tuple[str, int]]:
    """Where to start ``n`` new ranks, as (host, ranks): the free slots of ``hosts`` ((host,
    slots), as discovered) in their order, a slot being used by each of the job's processes
    on its host (``used``: their hosts); beyond the free slots, one more rank on each host in
    turn."""
    free = [(h, max(0, k - used.count(h))) for h, k in hosts]
    got: dict = {}
    left = n
    for h, k in free:
        take = min(k, left)
        if take:
            got[h] = got.get(h, 0) + take
            left -= take
    for i in range(left):
        h = hosts[i % len(hosts)][0]
        got[h] = got.get(h, 0) + 1
    return list(got.items())


class Discovery:
    """(rank 0) Runs a host-discovery script every ``interval`` seconds on a thread of its own;
    :attr:`hosts` are the hosts and slots of its latest good run (None before one), :attr:`slots`
    their count. A run that fails or prints something else is logged once per distinct reason,
    and the hosts kept."""

    def __init__(self, command: str, interval: float):
        self.command, self.interval = command, interval
        self.hosts: Optional[List[Tuple[str, int]]] = None
        self._said = ""
        threading.Thread(target=self._loop, name="vfgraph-discovery", daemon=True).start()

    def _loop(self) -> None:
        import subprocess

        while True:
            try:
                res = subprocess.run(self.command, shell=True, capture_output=True, text=True,
                                     timeout=max(10.0, 2 * self.interval))
                if res.returncode:
                    raise ValueError(f"exit status {res.returncode}: {res.stderr.strip()[-200:]}")
                self.hosts = parse_hosts(res.stdout)
            except (OSError, ValueError, subprocess.SubprocessError) as e:
                if str(e) != self._said:
                    log.warning("host discovery script %r: %s; keeping the last hosts", self.command, e)
                    self._said = str(e)
            time.sleep(self.interval)

    @property
    def slots(self) -> Optional[int]:
        return None if self.hosts is None else sum(n for _, n in self.hosts)


@dataclass
class Start:
    """(rank 0) One start of new processes: its launcher, how many, which (:data:`GROUP_ENV`),
    whether they merged into the job, and whether all of them left it since."""

    proc: subprocess.Popen
    n: int
    group: int
    merged: bool = False
    left: bool = False
    unblocked: float = 0.0  # when a process of rank 0's connected in their place (they never did)
    hosts: str = ""  # where they were started (HOST:N,...), when a host-discovery script placed them


class Elastic:
    """The changes of a running job, on each of its ranks. ``argv``: the command line new
    processes run (with :data:`JOIN_FLAG` added); ``use_comm(comm)``: point vfgraph's ops at a
    new communicator; ``fingerprint``: of the model rank 0 loaded (new processes must match);
    ``requests``: the file ``vfgraph resize`` writes; ``discovery``: a host-discovery command
    run every ``interval`` seconds; ``started``: when the job's command began."""

    def __init__(self, schedule: List[Tuple[int, int]], argv: List[str], use_comm: Callable[[Any], None],
                 fingerprint: str = "", requests: str = "", max_ranks: int = 0, started: float = 0.0,
                 discovery: str = "", interval: float = 5.0):
        self.schedule, self.argv, self.use_comm, self.fingerprint = schedule, list(argv), use_comm, fingerprint
        self.requests, self.max_ranks = requests, max_ranks  # the file `vfgraph resize` writes
        self.requested: List[Tuple[int, int]] = []  # (step, ranks) of every request taken
        self.started = started or time.time()  # requests older than the job are not its own
        self.discovery_command, self.interval = discovery, interval
        self.discovery: Optional[Discovery] = None  # (rank 0) started at the first step
        self._discovered: Optional[List[Tuple[str, int]]] = None  # the last hosts acted on
        self.refused: Optional[int] = None  # the schedule entry (its step) whose new ranks were refused
        self.inter = None  # the intercommunicator to the processes started for the next growth
        self.spawning: Optional[threading.Thread] = None  # the connection of them, under way or done
        self.port: Optional[str] = None  # (rank 0) the port new processes connect to
        self.back_port: Optional[str] = None  # (rank 0) the port ranks coming back connect to
        self.back_to = ""  # (a rank that joined, after a loss) the port to connect to again
        self.groups: List[Start] = []  # (rank 0) each start of new processes still running
        self.launched = 0  # (rank 0) starts so far
        self.members: List[int] = []  # the group (:func:`group`) of each rank of the job, in rank order
        self.where: List[str] = []  # the host of each rank of the job, in rank order
        self.helpers: List[subprocess.Popen] = []  # (rank 0) processes that ended an accept (_UNBLOCK)
        self.calling: set = set()  # (rank 0) the groups of ranks that left being called back
        self.control = None  # the job's ranks, for rank 0 to tell the others that ranks were lost
        self.survivors = 0  # (rank 0) ranks that joined and outlived the latest loss: they connect again
        self._told: list = []  # (rank 0) the messages that say so, under way
        self.watching: Optional[threading.Thread] = None  # (rank 0) the watch over them
        self.ending = False  # (rank 0) the job is ending: new processes ending is expected
        self.lost: Optional[str] = None  # (rank 0) which ranks the job lost, while it goes on without them
        # held while a thread marks a loss (self.lost, the ops' and the world's waits give up) and while
        # recover() unmarks it: the training thread reacts to the first mark, and recovers only after all
        self._marking = threading.Lock()
        self.recovered = True  # (rank 0) whether the training went on after the latest loss
        self.lost_at = 0.0  # (rank 0) when the latest loss was seen (time.perf_counter())
        self.regrowing = False  # (rank 0) the next growth replaces lost ranks: the job trains on meanwhile
        self.spawned = 0
        self.spawn_seconds = 0.0
        self.fingerprints: dict = {}  # (rank 0) the model fingerprint of each new process that is ready
        self.parked: List[Tuple[Any, int, int, str]] = []  # (rank 0) (communicator, rank, group, host) of each that left

    def target(self, step: int) -> Optional[int]:
        return self._entry(step)[1]

    def _entry(self, step: int) -> Tuple[Optional[int], Optional[int]]:
        """(step, ranks) of the schedule's entry or the request in force at ``step``."""
        entries = sorted(self.schedule + self.requested, key=lambda e: e[0])  # (a request after an entry of its step)
        return next(((s, r) for s, r in reversed(entries) if s <= step), (None, None))

    def _scheduled(self, step: int) -> bool:
        """Whether the change in force at ``step`` comes from the schedule (the job then waits for
        new ranks still loading, so that the schedule's layouts are exact), not from a request
        (the job trains on until they are ready)."""
        return self._entry(step) in self.schedule and self._entry(step) not in self.requested

    def _request(self, w: World, step: int) -> Optional[int]:
        """(rank 0) The rank count to change to at this step, if any: from a resize request, or
        from the host-discovery script's latest count (capped at --max-ranks)."""
        if self.discovery_command and self.discovery is None:
            self.discovery = Discovery(self.discovery_command, self.interval)
        asked = self._read_request(w, step)
        if asked is not None or self.discovery is None or self.discovery.slots is None:
            return asked
        hosts, slots = self.discovery.hosts, self.discovery.slots
        if hosts == self._discovered or self.spawning is not None:  # (a change under way: after it)
            return None
        self._discovered = hosts
        want = max(1, min(slots, self.max_ranks))
        if want == (w.size if self.refused == self._entry(step)[0] else self.target(step) or w.size):
            return None
        log.info("host discovery: %d slot%s at step %d; resizing to %d rank%s", slots, "s" if slots != 1 else "",
                 step, want, "s" if want != 1 else "")
        return want

    def _read_request(self, w: World, step: int) -> Optional[int]:
        """(rank 0) A resize request (``vfgraph resize``) to take at this step, if any; a request
        the job cannot take is refused with one line and removed, and the job goes on."""
        path = self.requests
        try:
            if not path or os.path.getmtime(path) < self.started:
                return None
            with open(path) as f:
                text = f.read()
            os.remove(path)
        except OSError:  # none, or one being replaced
            return None
        try:
            n = json.loads(text)["ranks"]
            if not isinstance(n, int):
                raise ValueError
        except (ValueError, KeyError, TypeError):
            log.warning("refused the resize request in %s: it holds no rank count; the job goes on with %d ranks",
                        path, w.size)
            return None
        why = (f"outside 1..{self.max_ranks} (--max-ranks {self.max_ranks})" if not 1 <= n <= self.max_ranks
               else "new ranks are still being started for another change; ask again after it"
               if self.spawning is not None else "")
        if why:
            log.warning("refused the request for %d ranks at step %d: %s; the job goes on with %d ranks", n, step, why,
                        w.size)
            return None
        log.info("request for %d ranks taken at step %d", n, step)
        return n

    def check_start(self, w: World) -> None:
        self.members, self.where = [0] * w.size, w.gather(socket.gethostname())
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
        # rank 0 reads the requests and counts the ranks that left and could come back; every
        # rank takes them at the same step
        n, idle = w.bcast((self._request(w, step), len(self._reusable())) if w.is_root else None)
        if n is not None:
            self.requested.append((step, n))
        want = self.target(step) or w.size
        if want < w.size:
            return self._shrink(w, want, step)
        if want > w.size:
            if self.refused == self._entry(step)[0]:
                return w, None  # (its new ranks opened another model: the job goes on as it is)
            if self.spawning is None and idle:  # ranks that left come back first (at once: they are warm)
                return self._reuse(w, min(idle, want - w.size), step)
            if self.spawning is None:
                self._spawn(w, want - w.size)
            return self._grow(w, step)
        if self.spawning is None and (self._next_change(step) or 0) > w.size + idle:
            self._spawn(w, self._next_change(step) - w.size - idle)  # they warm up while the job trains on
        return w, None

    def _reusable(self) -> List[Tuple[Any, int, int, str]]:
        """(rank 0) The ranks that left the job and may come back for a growth: all of them, or,
        under a host-discovery script, those on the hosts it lists."""
        hosts = self.discovery.hosts if self.discovery is not None else None
        return [p for p in self.parked if not hosts or p[3] in dict(hosts)]

    def _reuse(self, w: World, n: int, step: int) -> Tuple[World, dict]:
        """(every rank of ``w``) Grow by ``n`` ranks that had left the job: rank 0 calls them
        back (the last to leave first), and they connect to its port, as survivors of a loss do."""
        from mpi4py import MPI

        began, old = time.perf_counter(), w.size
        if w.is_root:
            if self.back_port is None:
                self.back_port = MPI.Open_port()
            back = self._reusable()[-n:]
            self.parked = [p for p in self.parked if p not in back]
            self.calling = {p[2] for p in back}
            for comm, r, *_ in back:
                comm.send({"port": self.back_port}, dest=r, tag=END)
        w = self._take_back(w, n, step)
        if w.is_root:
            self.calling = set()
            for s in self.groups:
                s.left = s.left and s.group not in self.members
        return w, {"old": old, "new": w.size, "began": began, "back": n}

    def _spawn(self, w: World, n: int) -> None:
        """Start ``n`` new processes (rank 0, as a launcher job of their own) and accept their
        connection on a thread of each rank (over a communicator of its own), so that the job
        trains on while they start Python and MPI."""
        from mpi4py import MPI

        comm = w.comm.Dup()
        if w.is_root:
            if self.port is None:
                self.port = MPI.Open_port()
            if self.back_port is None:  # (opened here: MPICH crashes opening a port while an accept waits)
                self.back_port = MPI.Open_port()
            self.launched += 1
            hosts = None
            if self.discovery is not None and self.discovery.hosts:  # on the hosts' free slots
                hosts = place(n, self.discovery.hosts, self.where + [p[3] for p in self.parked])
            command = [sys.executable, "-m", "vfgraph.cli", *self.argv, JOIN_FLAG]
            self.groups.append(Start(launch(n, command, self.port, self.launched, hosts), n, self.launched,
                                     hosts=",".join(f"{h}:{k}" for h, k in hosts or ())))
            if self.watching is None:
                self.watching = threading.Thread(target=self._watch, name="vfgraph-watch", daemon=True)
                self.watching.start()
                atexit.register(self._reap)
        began = time.perf_counter()

        def accept():
            self.inter = comm.Accept(self.port if w.is_root else None, root=0)
            self.spawn_seconds = time.perf_counter() - began

        self.inter, self.spawned, self.fingerprints = None, n, {}
        self.spawning = threading.Thread(target=accept, name="vfgraph-spawn", daemon=True)
        self.spawning.start()
        if w.is_root:
            log.info("starting %d new rank%s for the next growth%s", n, "s" if n > 1 else "",
                     f" on {', '.join(f'{h}:{k}' for h, k in hosts)}" if hosts else "")

    def _spawned(self) -> None:
        """Wait (polling) until the new processes started by :meth:`_spawn` connected."""
        _poll(lambda: not self.spawning.is_alive())

    def _watch(self) -> None:
        """(rank 0, a thread) Watch the processes it started. When ranks that joined end while
        the job runs, the job goes on without them (:meth:`_lose`) when rank 0's own launcher
        started it alone and no new ranks are being started. When new processes end before
        they connected, a process of rank 0's connects in their place, so that the job's
        accept ends and :meth:`_grow` refuses them. Otherwise (or when that has not happened
        within 60 s) it stops every process it started and ends with a message. Ranks that had
        left the job may end."""
        from mpi4py import MPI

        while not self.ending:
            time.sleep(0.1)
            for start in list(self.groups):
                code = start.proc.poll()
                if code is None or code == 0 or self.ending:  # (0: the job's last step is done; ending)
                    continue
                if not start.merged and self.spawning is not None and not self.spawning.is_alive():
                    continue  # connected, then failed or was refused: _grow says so and goes on
                if not start.merged and start is self.groups[-1]:  # they never connected
                    if not start.unblocked:  # end the job's accept: _grow refuses them and goes on
                        start.unblocked = time.monotonic()
                        self.helpers.append(launch(1, [sys.executable, "-c", _UNBLOCK], self.port))
                        continue
                    if time.monotonic() - start.unblocked < 60:
                        continue
                n, pid = start.n, start.proc.pid
                if start.left and start.group not in self.calling:
                    log.warning("%d rank%s that had left the job (launcher pid %d) ended with status %d; the job "
                                "goes on", n, "s" if n > 1 else "", pid, code)
                    self.groups.remove(start)
                    self.parked = [p for p in self.parked if p[2] != start.group]
                    continue
                what = (f"{n} rank{'s' if n > 1 else ''} that joined the job" if start.merged else
                        f"{n} new process{'es' if n > 1 else ''} that never connected")
                what += f" on {start.hosts}" if start.hosts else ""
                if start.merged and self.spawning is None and MPI.COMM_WORLD.Get_size() == 1:
                    self._lose(f"{what} (launcher pid {pid}) ended with status {code}", start.group)
                    break
                log.error("%s (launcher pid %d) ended with status %d while the job ran; the job stops (resume from "
                          "the last checkpoint with --resume)", what, pid, code)
                self._stop_all()
                os._exit(LOST_EXIT)

    def _lose(self, what: str, lost: int, timeout: float = 60.0) -> None:
        """(rank 0, the watch thread) The ranks of group ``lost`` ended: make rank 0's waits
        give up and tell the other ranks that joined the job (they wait in a step for the lost
        ones), so that the training goes back to the last step rank 0 completed and on with
        those ranks (:meth:`recover`). If it has not within ``timeout`` seconds (a rank waits in
        a call that cannot give up), the job ends."""
        from vfgraph import ops
        from vfgraph.runtime import world

        with self._marking:
            self.lost, self.lost_at, self.recovered = what, time.perf_counter(), False
            world.lost.set()
            ops.abandon(True)
        gone = [s for s in self.groups if s.group == lost or not s.merged]
        self._stop(gone)
        self.groups = [s for s in self.groups if s not in gone]
        self.parked = [p for p in self.parked if p[2] != lost]
        others = [r for r, g in enumerate(self.members) if g not in (0, lost)]
        self.survivors = len(others)
        self._told = [self.control.isend({"what": what, "port": self.back_port}, dest=r, tag=LOST) for r in others]
        deadline = time.monotonic() + timeout
        while not self.recovered:
            if time.monotonic() > deadline:
                log.error("%s; rank 0 could not go on without them: the job stops (resume from the last checkpoint "
                          "with --resume)", what)
                os._exit(LOST_EXIT)
            time.sleep(0.05)

    def _listen(self, control) -> None:
        """(a rank that joined, a thread while ``control`` is the job's) Wait for rank 0 to say
        that the job lost ranks, and make this rank's waits for them give up."""
        from vfgraph import ops
        from vfgraph.runtime import world

        request = control.irecv(source=0, tag=LOST)
        while self.control is control:
            done, said = request.test()
            if done:
                with self._marking:
                    self.lost, self.back_to = said["what"], said["port"]
                    world.lost.set()
                    ops.abandon(True)
                return
            time.sleep(0.01)
        request.Cancel()

    def recover(self, step: int) -> Tuple[World, int]:
        """(every rank left in the job, after its step gave up because ranks were lost) Rank 0
        (``step``: the last it completed) takes the ranks that joined and outlived the loss
        back, one after another (they connect to its port again, as new ranks do); returns the
        world they make, the ops pointed at it, and rank 0's step. Rank 0 then gives them its
        variables; the schedule, requests and discovery grow the job again."""
        from mpi4py import MPI

        from vfgraph import ops
        from vfgraph.runtime import world

        with self._marking:  # (after the thread that marked the loss is done)
            world.lost.clear()
            ops.abandon(False)
        self.regrowing = True
        if group() == 0:  # rank 0 (its launcher started it alone)
            w = self._take_back(self._switch(MPI.COMM_WORLD.Dup()), self.survivors, step)
        else:
            w, step = self._come_back(self.back_to)
        self.recovered = True
        return w, step

    def _take_back(self, w: World, n: int, step: int) -> World:
        """(every rank of ``w``) Let ``n`` ranks that connect to rank 0's port
        (:meth:`_come_back`) into the job, one after another; rank 0 tells each the job's step
        and state. The world they make."""
        for i in range(n):
            inter = w.comm.Accept(self.back_port if w.is_root else None, root=0)
            if w.is_root:
                inter.send({"step": step, "requested": self.requested, "refused_entry": self.refused,
                            "regrowing": self.regrowing, "more": n - i - 1}, dest=0, tag=GO)
            w = self._switch(inter.Merge(high=False))
        return w

    def _come_back(self, port: str) -> Tuple[World, int]:
        """(a rank coming back into the job: one that outlived a loss, or had left) Connect to
        rank 0's ``port``, take the job's state, and let the ranks after it in; the world and
        the job's step."""
        from mpi4py import MPI

        inter = MPI.COMM_SELF.Connect(port, root=0)
        go = _wait(inter.irecv(source=0, tag=GO))
        self.requested, self.refused = [tuple(e) for e in go["requested"]], go["refused_entry"]
        self.regrowing, self.spawning, self.inter = go["regrowing"], None, None
        return self._take_back(self._switch(inter.Merge(high=True)), go["more"], go["step"]), go["step"]

    def _grow(self, w: World, step: int) -> Tuple[World, dict]:
        from mpi4py import MPI

        waited = time.perf_counter()

        def all_ready():  # (rank 0)
            status = MPI.Status()
            while self.inter.Iprobe(source=MPI.ANY_SOURCE, tag=READY, status=status):
                self.fingerprints[status.Get_source()] = self.inter.recv(source=status.Get_source(), tag=READY)
            code = self.groups[-1].proc.poll()
            if code is not None and len(self.fingerprints) < self.spawned:  # ended before it said it was ready
                why = (f"its launcher ended (status {code}) before it connected" if self.groups[-1].unblocked else
                       f"it ended (status {code}) before it loaded the model")
                for r in range(self.spawned):
                    self.fingerprints.setdefault(r, {"error": why, "ended": True})
            return len(self.fingerprints) >= self.spawned

        # a request, or growing back after a loss: train on until the new ranks are ready
        if not self._scheduled(step) or self.regrowing:
            if not w.bcast(not self.spawning.is_alive() and all_ready() if w.is_root else None):
                return w, None
        self._spawned()
        if w.is_root:  # wait (polling) until every new process has loaded the model
            _poll(all_ready)
        arrive(w.comm)
        began = time.perf_counter()
        old = w.size
        why = w.bcast(self._refusal() if w.is_root else None)
        if why:  # refused, all of them (they merge together or not at all); the job goes on
            line = (f"refused {self.spawned} new rank{'s' if self.spawned > 1 else ''} at step {step}: {why}; the job "
                    f"goes on with {old} rank{'s' if old > 1 else ''}")
            if w.is_root:
                for r, said in sorted(self.fingerprints.items()):
                    if "fingerprint" in said:  # (one that failed has ended)
                        self.inter.send({"refused": line}, dest=r, tag=GO)
                self.groups.pop()
            self.inter.Free()
            self.inter, self.spawning, self.refused = None, None, self._entry(step)[0]
            return w, {"refused": line}
        if w.is_root:  # what the new ranks need to follow the same changes as the others
            for r in range(self.spawned):
                self.inter.send({"step": step, "requested": self.requested, "refused_entry": self.refused}, dest=r,
                                tag=GO)
        if w.is_root:
            self.groups[-1].merged = True
        self.regrowing = False
        merged = self.inter.Merge(high=False)
        self.inter, self.spawning = None, None
        new = self._switch(merged)
        return new, {"old": old, "new": new.size, "waited": began - waited, "began": began,
                     "spawn": self.spawn_seconds}

    def _refusal(self) -> str:
        """(rank 0) Why the new processes cannot join, or ''."""
        for r, said in sorted(self.fingerprints.items()):
            if "error" in said:
                return f"new process {r} failed to start: {said['error']}"
            if said["fingerprint"] != self.fingerprint:
                return (f"new process {r} opened another model than rank 0 (fingerprint {said['fingerprint'][:12]} "
                        f"against {self.fingerprint[:12]}) at the same path")
        return ""

    def _shrink(self, w: World, want: int, step: int) -> Tuple[Optional[World], Optional[dict]]:
        from mpi4py import MPI

        began = time.perf_counter()
        stays = w.rank < want
        kept = w.comm.Split(0 if stays else MPI.UNDEFINED, w.rank)
        if w.is_root:
            self.parked.extend((w.comm, r, self.members[r], self.where[r]) for r in range(want, w.size))
            for s in self.groups:
                s.left = s.left or (s.merged and s.group not in self.members[:want])
        if not stays:
            return None, None
        return self._switch(kept), {"old": w.size, "new": want, "waited": 0.0, "began": began}

    def _switch(self, comm) -> World:
        """(every rank of ``comm``) Make ``comm`` the job's: the ops use it, each rank's
        group is known, and ranks that joined listen for a loss."""
        self.use_comm(comm.Dup())
        w = World(comm.Get_rank(), comm.Get_size(), comm)
        self.control = comm.Dup()
        self.members, self.where = (list(x) for x in zip(*w.gather((group(), socket.gethostname()))))
        if group():
            threading.Thread(target=self._listen, args=(self.control,), name="vfgraph-listen", daemon=True).start()
        return w

    def park(self, w: World) -> Optional[Tuple[World, int]]:
        """On a rank that left: wait, idle, until rank 0 ends the job (None) or calls it back
        for a growth (the world and the step it comes back at)."""
        said = _wait(w.comm.irecv(source=0, tag=END))
        return None if said is None else self._come_back(said["port"])

    def name_hosts(self, line: str) -> str:
        """(rank 0) A stall's ``line`` with the hosts of the ranks it waited for: a host cut off
        from the network is seen only as a wait that makes no progress."""
        m = re.search(r"for (ranks? )([\d, ]+) \(not seen entering it\)", line)
        if not m:
            return line
        ranks = [int(r) for r in m.group(2).split(",") if r.strip().isdigit()]
        hosts = sorted({self.where[r] for r in ranks if r < len(self.where)})
        if not hosts:
            return line
        return line.replace(m.group(0), f"for {m.group(1)}{m.group(2)} on {', '.join(hosts)} (not seen entering it)")

    def finish(self, w: World, failed: bool = False) -> None:
        """On rank 0 at the end of the job: release the ranks that left and any new processes
        still waiting to join; when the job ``failed``, stop every process it started instead
        (ranks that joined may be waiting in a step for ever)."""
        self.ending = True
        if failed:
            self._stop_all()
            return
        for comm, r, *_ in self.parked:
            comm.send(None, dest=r, tag=END)
        self.parked = []
        if self.spawning is not None:
            self._spawned()
            for r in range(self.spawned):
                self.inter.send(None, dest=r, tag=GO)
            self.inter, self.spawning = None, None

    def _stop_all(self) -> None:
        """(rank 0) Stop the launchers it started and what they run."""
        self._stop(self.groups)

    @staticmethod
    def _stop(starts: List[Start]) -> None:
        for s in starts:
            if s.proc.poll() is None:
                s.proc.terminate()
        for s in starts:
            try:
                s.proc.wait(10)
            except subprocess.TimeoutExpired:
                s.proc.kill()
                s.proc.wait()

    def _reap(self, timeout: float = 60.0) -> None:
        """(rank 0, at exit) Wait for the processes it started to end (they end with the job),
        stopping those still running after ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        for proc in [s.proc for s in self.groups] + self.helpers:
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.terminate()
                proc.wait()


def connect():
    """In a process a job started (``--elastic-join``): connect to the job at once, before
    TensorFlow is imported (its ranks accept while they train); the intercommunicator to it."""
    global _parent
    if _parent is None:
        from mpi4py import MPI

        port = os.environ.get(PORT_ENV)
        if not port:
            raise InputError(f"{JOIN_FLAG} is for the processes a running 'vfgraph train --elastic-schedule' starts")
        _parent = MPI.COMM_WORLD.Connect(port, root=0)
    return _parent


def parent():
    """The intercommunicator to the job (:func:`connect`), vfgraph's ops loaded."""
    from vfgraph import ops

    ops.load()
    return connect()


def report_failure(message: str) -> None:
    """In a new process that failed before it joined: tell the job (which then goes on without
    the new processes) instead of leaving it waiting."""
    if _parent is not None and not _joined:
        _parent.send({"error": message}, dest=0, tag=READY)


_parent = None  # (a new process) the intercommunicator to the job, once connected
_joined = False  # (a spawned process) whether it has joined the job


def join(inter, started: float, fingerprint: str, elastic: Elastic) -> Tuple[Optional[World], int]:
    """In a spawned process that has loaded the model (``fingerprint``: of its files) and the
    data: say so, wait (polling) for the job to let it in, and merge into the job's
    communicator; ``elastic`` takes the requests the job has taken so far. Returns the world
    and the step the job is at; the world is None when the job ended first or refused it
    (another model)."""
    inter.send({"fingerprint": fingerprint}, dest=0, tag=READY)
    go = _wait(inter.irecv(source=0, tag=GO))
    if go is None:
        return None, 0
    if "refused" in go:
        inter.Free()
        log.error("this new process was refused by the job (rank 0 logs why)")
        return None, 0
    global _joined
    elastic.requested, elastic.refused = [tuple(e) for e in go["requested"]], go["refused_entry"]
    merged = inter.Merge(high=True)
    _joined = True
    w = elastic._switch(merged)
    log.info("rank %d joined at step %d, %.3g s after its command began", w.rank, go["step"], time.time() - started)
    return w, go["step"]
