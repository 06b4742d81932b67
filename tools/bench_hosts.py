"""What crossing hosts costs: 2 ranks on two hosts (TCP) against 2 ranks on one host (shared
memory), measured in the same run.

The two hosts are Linux namespaces of this machine (vfgraph.testing.hosts: each its own
interface on a bridge, address, host name and /dev/shm), so MPICH moves the data over TCP
through the kernel's network stack; on one host it uses shared memory. One kernel, one pair of
cores: no real network's latency or bandwidth limit. Needs root.

allreduce  mpi4py's in-place Allreduce of float32 buffers (a scalar, 64 KiB, 1, 4, 16 and 64
           MiB): the median per call of the slower rank, algorithm bandwidth = bytes / time.
step       ``vfgraph train``'s step (the digits MLP, hidden width --hidden, default 4096: its
           gradients are 1.3 MB; 8 virtual nodes of 16 per global batch of 128, one thread
           per rank), examples/s of 2 ranks, timed as tools/bench_scaling.py does.

Each configuration runs --rounds times, interleaved (TCP, shared memory, ...), and the best
run of each is kept (other load on the machine only slows a run down). Reported: both, and
TCP / shared memory.

    python tools/bench_hosts.py [--quick] [--json PATH]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

from benchlib import git_state, write_report

MIB = 1 << 20
SIZES = [("scalar", 4), ("64 KiB", 64 << 10), ("1 MiB", MIB), ("4 MiB", 4 * MIB), ("16 MiB", 16 * MIB),
         ("64 MiB", 64 * MIB)]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="1 round, fewer repetitions")
    p.add_argument("--json", default="/tmp/vfgraph_bench_hosts.json", help="where to write the results")
    p.add_argument("--rounds", type=int, default=3, help="runs of each configuration, interleaved")
    p.add_argument("--hidden", type=int, default=4096, help="hidden width of the digits MLP of the step")
    p.add_argument("--worker", choices=["allreduce", "scaling"], help=argparse.SUPPRESS)
    p.add_argument("--model", help=argparse.SUPPRESS)
    p.add_argument("--data", help=argparse.SUPPRESS)
    p.add_argument("--vnode-batch", default="16", help=argparse.SUPPRESS)
    p.add_argument("--batch", default="128", help=argparse.SUPPRESS)
    p.add_argument("--steps", type=int, default=20, help=argparse.SUPPRESS)
    p.add_argument("--reps", type=int, default=5, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def worker_allreduce(args) -> dict:
    """(a rank) Time in-place Allreduce of each size; the slower rank's median per call."""
    import numpy as np
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    got = {}
    for label, size in SIZES:
        buf = np.ones(size // 4, np.float32)
        calls = max(1, min(200, (64 * MIB) // (4 * size)))  # about 16 MiB moved per repetition, at least
        comm.Allreduce(MPI.IN_PLACE, buf)
        times = []
        for _ in range(args.reps):
            comm.Barrier()
            t = time.perf_counter()
            for _ in range(calls):
                comm.Allreduce(MPI.IN_PLACE, buf)
            times.append(comm.allreduce((time.perf_counter() - t) / calls, op=MPI.MAX))
        got[label] = {"bytes": size, "seconds": statistics.median(times)}
    return {"sizes": got, "host": MPI.Get_processor_name()}


def launch(prefix, argv, env) -> dict:
    """Run this script's worker as 2 ranks (``prefix``: the mpiexec command's start); rank 0's JSON."""
    res = subprocess.run(prefix + ["-n", "2", sys.executable, os.path.abspath(__file__), *argv], capture_output=True,
                         text=True, env=env, timeout=1800)
    if res.returncode:
        raise SystemExit(f"bench_hosts: worker failed ({' '.join(prefix[:1] + argv[:2])}):\n{res.stderr[-3000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def prepare(root: str, hidden: int):
    """The digits data and the MLP of width ``hidden`` rewritten with 8 virtual nodes of 16."""
    import export

    import vfgraph

    data = os.path.join(root, "data")
    export.digits_data(data)
    export.digits_mlp(os.path.join(root, "mlp"), optimizer="sgd", lr=0.05, hidden=hidden)
    model = os.path.join(root, "mlp_v8")
    vfgraph.save(vfgraph.rewrite(os.path.join(root, "mlp"), vnodes=8, vnode_batch=16, allreduce="mpi"), model)
    return model, os.path.join(data, "train.npz")


def measure(args, hosts, model, data, rounds, reps) -> dict:
    """Every configuration ``rounds`` times, interleaved; the best run of each."""
    shm = [os.path.join(os.path.dirname(sys.executable), "mpiexec")]
    tcp = hosts.mpiexec(hosts.names[:2])
    env = dict(os.environ, OMP_NUM_THREADS="1")
    work = {"allreduce": ["--worker", "allreduce", "--reps", str(reps)],
            "step": ["--worker", "scaling", "--model", model, "--data", data, "--steps", str(args.steps),
                     "--reps", str(reps)]}
    best = {}
    for r in range(rounds):
        for kind, argv in work.items():
            for where, prefix, e in (("tcp", tcp, hosts.env(env)), ("shm", shm, env)):
                got = launch(prefix, argv, e)
                print(f"round {r + 1}: {kind} over {where} done", flush=True)
                key = (kind, where)
                if kind == "allreduce":
                    old = best.get(key, {}).get("sizes", {})
                    for label, x in got["sizes"].items():
                        if label in old and old[label]["seconds"] < x["seconds"]:
                            got["sizes"][label] = old[label]
                    best[key] = got
                elif key not in best or got["examples_per_s"] > best[key]["examples_per_s"]:
                    best[key] = got
    return best


def report(best, hosts_used: bool, args, rounds) -> dict:
    rows = []
    for label, _ in SIZES:
        t, s = best[("allreduce", "tcp")]["sizes"][label], best[("allreduce", "shm")]["sizes"][label]
        rows.append({"size": label, "bytes": t["bytes"], "tcp_s": t["seconds"], "shm_s": s["seconds"],
                     "tcp_gbps": t["bytes"] / t["seconds"] / 1e9, "shm_gbps": s["bytes"] / s["seconds"] / 1e9,
                     "tcp_over_shm_time": t["seconds"] / s["seconds"]})
    step = {"tcp_examples_per_s": best[("step", "tcp")]["examples_per_s"],
            "shm_examples_per_s": best[("step", "shm")]["examples_per_s"]}
    step["tcp_over_shm"] = step["tcp_examples_per_s"] / step["shm_examples_per_s"]
    return {"benchmark": "hosts", "allreduce": rows, "step": step, "hidden": args.hidden,
            "gradient_bytes": 4 * (64 * args.hidden + args.hidden + 10 * args.hidden + 10), "rounds": rounds,
            "batch": 128, "vnodes": 8, "cpus": os.cpu_count(), "git": git_state(), "hosts": hosts_used,
            "date": time.strftime("%Y-%m-%d")}


def print_table(r: dict) -> None:
    print(f"\n{'size':>8} {'TCP (GB/s)':>11} {'shm (GB/s)':>11} {'TCP time / shm time':>20}")
    for x in r["allreduce"]:
        print(f"{x['size']:>8} {x['tcp_gbps']:11.3f} {x['shm_gbps']:11.3f} {x['tcp_over_shm_time']:20.2f}")
    s = r["step"]
    print(f"\nstep, 2 ranks (examples/s): TCP {s['tcp_examples_per_s']:.0f}, shared memory "
          f"{s['shm_examples_per_s']:.0f}; TCP / shared memory {s['tcp_over_shm']:.2f}")


def main() -> int:
    args = parse_args()
    if args.worker:
        from mpi4py import MPI

        if args.worker == "allreduce":
            got = worker_allreduce(args)
        else:
            from bench_scaling import worker_scaling

            got = worker_scaling(args)
        if MPI.COMM_WORLD.Get_rank() == 0:
            print(json.dumps(got))
        return 0
    from vfgraph.testing.hosts import Hosts, missing

    why = missing()
    if why:
        print(f"bench_hosts: cannot make separate hosts here: {why}", file=sys.stderr)
        return 2
    rounds, reps = (1, 3) if args.quick else (args.rounds, args.reps)
    with tempfile.TemporaryDirectory(prefix="vfgraph-bench-hosts-") as root:
        model, data = prepare(root, args.hidden)
        with Hosts(2) as hosts:
            best = measure(args, hosts, model, data, rounds, reps)
    r = report(best, True, args, rounds)
    print_table(r)
    write_report(args.json, r)
    return 0


if __name__ == "__main__":
    sys.exit(main())
