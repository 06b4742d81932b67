"""One rank of an ``mpiexec`` job as a small supervisor and its worker.

MPI launchers end a whole job when one process dies, and the other ranks are killed without a
chance to say why; the launcher itself only reports a process id. So under a launcher,
``vfgraph train`` keeps the launched process light (it never imports TensorFlow) and runs the
real rank as its child: when the child dies from a signal (killed, out of memory), the
supervisor reports it with the rank's number (and pipeline stage, for a model cut into stages
on ranks) and exits non-zero, which makes the launcher stop the other ranks. A child dies with its supervisor (``PR_SET_PDEATHSIG``), so stopping the job
never leaves a worker behind.
"""
from __future__ import annotations

import ctypes
import os
import signal
import socket
import subprocess
import sys
from typing import List

WORKER_ENV = "VFGRAPH_RANK_WORKER"


def is_worker() -> bool:
    return os.environ.get(WORKER_ENV) == "1"


def launcher_rank() -> str:
    for k in ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "SLURM_PROCID"):
        if k in os.environ:
            return os.environ[k]
    return "?"


def die_with_parent() -> None:
    """In a child before exec: be killed when the parent dies."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def supervise(argv: List[str], role: str = "") -> int:
    """Run ``python -m vfgraph.cli ARGV`` as this rank's worker; report how it ended (naming
    ``role``, what the rank runs, where given)."""
    env = dict(os.environ, **{WORKER_ENV: "1"})
    fds = tuple(int(os.environ[k]) for k in ("PMI_FD",) if os.environ.get(k, "").isdigit())
    child = subprocess.Popen([sys.executable, "-m", "vfgraph.cli", *argv], env=env, pass_fds=fds,
                             preexec_fn=die_with_parent)

    def forward(signum, _frame):
        child.send_signal(signum)

    for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(s, forward)
    code = child.wait()
    if code < 0:
        name = signal.Signals(-code).name
        where = f"{role}; " if role else ""
        print(f"\nvfgraph train: rank {launcher_rank()} ({where}{socket.gethostname()} pid {child.pid}) was killed by "
              f"{name}; the job stops (resume from the last checkpoint with --resume)", file=sys.stderr, flush=True)
        return 128 - code
    return code
