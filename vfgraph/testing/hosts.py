"""Separate hosts on one Linux machine, for testing MPI jobs across hosts: each host is a set of
namespaces (network, UTS, IPC and mount) with its own interface ``eth0`` on a bridge, its own
address (10.77.S.H/24), its own host name, its own ``/dev/shm`` and an ``/etc/hosts`` naming
the others, so processes on two hosts reach each other only over TCP, as across machines.

MPICH's hydra starts processes on them through a launcher script of ours that stands in for
``ssh`` (``-launcher ssh -launcher-exec SCRIPT``: hydra calls ``SCRIPT -x HOST COMMAND``) and
runs COMMAND inside that host's namespaces::

    with Hosts(2) as hosts:
        subprocess.run(hosts.mpiexec(["node0", "node1"]) + ["-n", "2", "python", "x.py"],
                       env=hosts.env())

Needs root and ``ip`` (iproute2), ``unshare`` and ``nsenter`` (util-linux); :func:`missing`
says what is not there. Every object a run makes is named after its process id
(``vf<pid>...``), so runs side by side do not collide, and is removed when the run ends, also
on failure; what a run killed before its end left behind is removed by the next run
(:func:`clean_leftovers`).
"""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
from typing import Dict, List, Optional

IP = shutil.which("ip") or "/usr/sbin/ip"
PREFIX = "vf"  # every object: vf<pid>br (bridge), vf<pid>v<i> (host end of a veth), vf<pid>h<i> (namespace)
RUN_DIR = os.path.join(tempfile.gettempdir(), "vfgraph-hosts")

LAUNCH = """#!/bin/sh
# Stands in for ssh: hydra calls it as `{script} -x HOST COMMAND` (COMMAND one shell string).
[ "$1" = -x ] && shift
host=$1; shift
pid=$(cat "{run}/$host.pid" 2>/dev/null) || {{ echo "no such host: $host" >&2; exit 255; }}
exec nsenter -t "$pid" -n -u -i -m sh -c "$*"
"""


def missing() -> Optional[str]:
    """Why hosts cannot be made here (None when they can)."""
    if os.name != "posix" or not hasattr(os, "geteuid"):
        return "network namespaces need Linux"
    if os.geteuid() != 0:
        return "network namespaces need root"
    for tool in (IP, "unshare", "nsenter"):
        if not shutil.which(tool):
            return f"{tool} is not installed"
    name = f"{PREFIX}{os.getpid()}h999"  # (named as a host: removed with the run's left-overs)
    made = subprocess.run([IP, "netns", "add", name], capture_output=True, text=True)
    if made.returncode != 0:
        return f"ip netns add fails here: {made.stderr.strip()}"
    subprocess.run([IP, "netns", "delete", name], capture_output=True)
    return None


def _run(*args: str) -> str:
    res = subprocess.run(list(args), capture_output=True, text=True)
    if res.returncode != 0:
        raise RuntimeError(f"{' '.join(args)}: {res.stderr.strip()}")
    return res.stdout


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def _kill_namespace(ns: str) -> None:
    """Kill every process in network namespace ``ns`` and delete it."""
    pids = subprocess.run([IP, "netns", "pids", ns], capture_output=True, text=True).stdout.split()
    for pid in pids:
        try:
            os.kill(int(pid), signal.SIGKILL)
        except (ProcessLookupError, ValueError):
            pass
    subprocess.run([IP, "netns", "delete", ns], capture_output=True)
    shutil.rmtree(f"/etc/netns/{ns}", ignore_errors=True)


def _remove(owner: int) -> None:
    """Remove every object of the run of process ``owner``."""
    names = subprocess.run([IP, "netns", "list"], capture_output=True, text=True).stdout.split()
    for ns in names:
        if re.fullmatch(rf"{PREFIX}{owner}h\d+", ns):
            _kill_namespace(ns)
    subprocess.run([IP, "link", "delete", f"{PREFIX}{owner}br"], capture_output=True)
    shutil.rmtree(os.path.join(RUN_DIR, str(owner)), ignore_errors=True)


def clean_leftovers() -> List[int]:
    """Remove what runs whose process has ended left behind (killed before their teardown); the
    process ids of those runs."""
    owners = set()
    listed = subprocess.run([IP, "netns", "list"], capture_output=True, text=True).stdout
    owners.update(int(m) for m in re.findall(rf"^{PREFIX}(\d+)h\d+", listed, re.M))
    links = subprocess.run([IP, "-o", "link", "show"], capture_output=True, text=True).stdout
    owners.update(int(m) for m in re.findall(rf"^\d+: {PREFIX}(\d+)br[:@]", links, re.M))
    if os.path.isdir(RUN_DIR):
        owners.update(int(d) for d in os.listdir(RUN_DIR) if d.isdigit())
    gone = sorted(o for o in owners if o != os.getpid() and not _alive(o))
    for owner in gone:
        _remove(owner)
    return gone


def _free_subnet(start: int) -> int:
    """A third octet S such that no interface of this machine has an address in 10.77.S.0/24."""
    used = set(re.findall(r"inet 10\.77\.(\d+)\.", _run(IP, "-o", "addr", "show")))
    for k in range(250):
        s = 1 + (start + k) % 250
        if str(s) not in used:
            return s
    raise RuntimeError("no free subnet in 10.77.0.0/16")


class Hosts:
    """``count`` hosts named ``node0``, ``node1``, ... (:attr:`names`), with addresses
    :attr:`addresses`, reached from this machine's bridge address :attr:`gateway`. A context
    manager: everything is removed at its end."""

    def __init__(self, count: int):
        self.count = count
        self.owner = os.getpid()
        self.names = [f"node{i}" for i in range(count)]
        self.namespaces = [f"{PREFIX}{self.owner}h{i}" for i in range(count)]
        self.bridge = f"{PREFIX}{self.owner}br"
        self.run_dir = os.path.join(RUN_DIR, str(self.owner))
        self.script = os.path.join(self.run_dir, "launch")
        self.subnet = 0
        self.addresses: List[str] = []
        self.gateway = ""
        self._holders: List[subprocess.Popen] = []

    def __enter__(self) -> "Hosts":
        clean_leftovers()
        _remove(self.owner)  # (a run of this process that did not end cleanly)
        try:
            self._make()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _make(self) -> None:
        self.subnet = _free_subnet(self.owner)
        self.gateway = f"10.77.{self.subnet}.1"
        self.addresses = [f"10.77.{self.subnet}.{i + 2}" for i in range(self.count)]
        os.makedirs(self.run_dir, exist_ok=True)
        _run(IP, "link", "add", self.bridge, "type", "bridge")
        _run(IP, "addr", "add", f"{self.gateway}/24", "dev", self.bridge)
        _run(IP, "link", "set", self.bridge, "up")
        table = "127.0.0.1 localhost\n" + "".join(f"{a} {n}\n" for a, n in zip(self.addresses, self.names))
        for i, ns in enumerate(self.namespaces):
            _run(IP, "netns", "add", ns)
            _run(IP, "link", "add", self.veth(i), "type", "veth", "peer", "name", "eth0", "netns", ns)
            _run(IP, "link", "set", self.veth(i), "master", self.bridge, "up")
            _run(IP, "-n", ns, "addr", "add", f"{self.addresses[i]}/24", "dev", "eth0")
            _run(IP, "-n", ns, "link", "set", "eth0", "up")
            _run(IP, "-n", ns, "link", "set", "lo", "up")
            os.makedirs(f"/etc/netns/{ns}", exist_ok=True)
            with open(f"/etc/netns/{ns}/hosts", "w") as f:  # (ip netns exec binds it over /etc/hosts)
                f.write(table)
            self._hold(i)
        with open(self.script, "w") as f:
            f.write(LAUNCH.format(script=self.script, run=self.run_dir))
        os.chmod(self.script, 0o755)

    def _hold(self, i: int) -> None:
        """Start host ``i``'s holder: a process that makes the host's own UTS, IPC and mount
        namespaces (host name, System V IPC, a private /dev/shm) inside its network namespace and
        sleeps; commands enter its namespaces (``nsenter``)."""
        ready = os.path.join(self.run_dir, f"{self.names[i]}.ready")
        body = (f'hostname {self.names[i]} && mount -t tmpfs -o mode=1777 tmpfs /dev/shm && touch {ready} '
                '&& exec sleep 2147483647')
        holder = subprocess.Popen([IP, "netns", "exec", self.namespaces[i], "unshare", "--uts", "--ipc", "--mount",
                                   "--propagation", "private", "sh", "-c", body],
                                  stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        self._holders.append(holder)
        deadline = time.time() + 10
        while not os.path.exists(ready):
            if holder.poll() is not None or time.time() > deadline:
                raise RuntimeError(f"host {self.names[i]} did not start: {holder.stderr.read().decode().strip()}")
            time.sleep(0.01)
        with open(os.path.join(self.run_dir, f"{self.names[i]}.pid"), "w") as f:
            f.write(str(holder.pid))

    def close(self) -> None:
        """Kill every process on the hosts and remove them (idempotent)."""
        _remove(self.owner)
        for holder in self._holders:
            try:
                holder.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
        self._holders = []

    def veth(self, i: int) -> str:
        """The name, on this machine, of host ``i``'s link to the bridge."""
        return f"{PREFIX}{self.owner}v{i}"

    def mpiexec(self, hosts: List[str], mpiexec: Optional[str] = None) -> List[str]:
        """The command line start of an ``mpiexec`` (MPICH's hydra) that runs its processes on
        ``hosts`` (names of these hosts, ``NAME`` or ``NAME:SLOTS``)."""
        import sys

        exe = mpiexec or os.path.join(os.path.dirname(sys.executable), "mpiexec")
        return [exe, "-launcher", "ssh", "-launcher-exec", self.script, "-localhost", self.gateway,
                "-hosts", ",".join(hosts)]

    def env(self, base: Optional[Dict[str, str]] = None) -> Dict[str, str]:
        """``base`` (this process's environment) with what an ``mpiexec`` run on one of the hosts
        needs to start processes on the others (an elastic job's new ranks) and the network
        interface MPI's transport takes (``eth0``, the hosts' only one besides loopback)."""
        env = dict(os.environ if base is None else base)
        env.update(HYDRA_LAUNCHER="ssh", HYDRA_LAUNCHER_EXEC=self.script, UCX_NET_DEVICES="eth0")
        return env

    def run(self, i: int, *cmd: str, timeout: float = 60) -> subprocess.CompletedProcess:
        """Run ``cmd`` on host ``i`` and wait for it."""
        return subprocess.run(["nsenter", "-t", self._pid(i), "-n", "-u", "-i", "-m", *cmd], capture_output=True,
                              text=True, timeout=timeout)

    def _pid(self, i: int) -> str:
        with open(os.path.join(self.run_dir, f"{self.names[i]}.pid")) as f:
            return f.read().strip()

    def bytes(self, i: int) -> Dict[str, int]:
        """Host ``i``'s interface byte counters: ``{"rx": ..., "tx": ...}``."""
        out = _run(IP, "-n", self.namespaces[i], "-j", "-s", "link", "show", "eth0")
        stats = json.loads(out)[0]["stats64"]
        return {"rx": stats["rx"]["bytes"], "tx": stats["tx"]["bytes"]}

    def processes(self, i: int) -> List[int]:
        """The processes running on host ``i`` (its holder left out)."""
        pids = subprocess.run([IP, "netns", "pids", self.namespaces[i]], capture_output=True, text=True).stdout
        return [int(p) for p in pids.split() if p != self._pid(i)]

    def kill(self, i: int) -> None:
        """Host ``i``'s processes all die (SIGKILL); its kernel still closes their connections."""
        for pid in self.processes(i):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def cut(self, i: int, up: bool = False) -> None:
        """Host ``i``'s link goes down (``up``: back up): its processes run on, unreachable, and
        their peers see nothing close."""
        _run(IP, "link", "set", self.veth(i), "up" if up else "down")
