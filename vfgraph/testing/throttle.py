"""Run a command on a fraction of the CPU time it would get: a slower machine stands in for
uneven hardware (heterogeneous training's tests and benchmarks, on one host).

``python -m vfgraph.testing.throttle --share 0.5 [--period-ms 2] -- COMMAND ...`` runs
COMMAND and lets it run for ``share`` of every period, stopping it (SIGSTOP, every thread
at once, and the processes it starts) for the rest, so everything it does takes about 1/share
as long (the time it is let run is measured and the stops follow it, so the share holds on a
loaded machine too). Under ``mpiexec`` it wraps one rank's command (MPMD: ``mpiexec -n 1 CMD : -n 1 python -m
vfgraph.testing.throttle --share 0.5 -- CMD``); the command inherits its file descriptors and
environment, the launcher's among them. SIGINT and SIGTERM are passed on (and the command
let run to handle them); the exit status is the command's."""
from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from typing import List, Optional

from vfgraph.runtime.supervise import die_with_parent


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m vfgraph.testing.throttle", description=__doc__.split("\n\n")[0])
    p.add_argument("--share", type=float, required=True, help="fraction of each period the command runs (0 < S <= 1)")
    p.add_argument("--period-ms", type=float, default=2.0, help="length of a run-and-stop cycle (default 2 ms)")
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- COMMAND ...")
    args = p.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        p.error("give the command to run after --")
    if not 0 < args.share <= 1 or args.period_ms <= 0:
        p.error("--share must be in (0, 1] and --period-ms positive")
    # its own process group: stopping the group stops the processes the command starts too;
    # killed with this process (a stopped command would otherwise be left behind stopped)
    proc = subprocess.Popen(command, close_fds=False, start_new_session=True, preexec_fn=die_with_parent)
    passing: List[int] = []

    def forward(signum, frame):
        passing.append(signum)

    for s in (signal.SIGINT, signal.SIGTERM):
        signal.signal(s, forward)
    run = args.period_ms * args.share / 1e3
    # the time the command is let run is measured, from just before each SIGCONT to just after
    # the SIGSTOP that ends it, and each stop lasts until that time is ``share`` of the time
    # since the start (a run is longer when the command fell behind): on a loaded machine this
    # process often waits for a CPU after it wakes or sends SIGCONT, which would otherwise let
    # the command run far more than its share
    start = began = time.monotonic()
    ran = 0.0
    try:
        while proc.poll() is None:
            if passing:
                os.kill(proc.pid, passing.pop(0))
            time.sleep(max(run, args.share * (time.monotonic() - start) - ran))
            if args.share < 1 and not passing:
                os.killpg(proc.pid, signal.SIGSTOP)
                ran += time.monotonic() - began
                time.sleep(max(0.0, start + ran / args.share - time.monotonic()))
                began = time.monotonic()
                os.killpg(proc.pid, signal.SIGCONT)
            else:
                ran, began = ran + time.monotonic() - began, time.monotonic()
    except ProcessLookupError:
        pass
    finally:
        # never leave the command stopped
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
    return proc.wait() if proc.returncode is None else proc.returncode


if __name__ == "__main__":
    sys.exit(main())
