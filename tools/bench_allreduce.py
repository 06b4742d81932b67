"""Allreduce bandwidth across processes: vfgraph's VfAllreduce in a tf.function against mpi4py and
TensorFlow's own collectives, measured in the same run.

Runs on 2 ranks under MPI (started directly, it relaunches itself under the mpiexec beside the
Python executable). For a scalar and for 1, 4, 16, 64 and 256 MiB of float32 it times:

  (a)  ours      one VfAllreduce inside a graph, on an input it can reduce in place (an
                 intermediate tensor, as a gradient is): a tf.function chaining --chain ops, each
                 reducing the previous one's output, is timed against a tf.function of one op;
                 ours = (chain - one) / (chain - 1), per repetition
  (a') call      the tf.function of one VfAllreduce on the tensor the caller passes in: the call
                 overhead, plus a copy into a new output (the caller still holds the input buffer),
                 plus the reduction (reported only)
  (b)  mpi4py    comm.Allreduce(MPI.IN_PLACE, buf) on a numpy array (numpy asks for transparent
                 huge pages behind arrays of >= 4 MiB)
  (b') mpi4py-4k the same on a numpy array allocated without that request (4 KiB pages, as
                 TensorFlow's own buffers are; reported only)
  (c)  tf        TensorFlow's collective all-reduce across the 2 processes: CollectiveReduceV2
                 (RING, gRPC over loopback) in a tf.function, the cluster enabled by a
                 MultiWorkerMirroredStrategy built from TF_CONFIG with free ports; --no-tf skips it

A repetition starts every rank together (barrier) and times a batch of calls; its time is the
slower rank's. Reported: the median per call, and algorithm bandwidth = bytes / time (GB/s,
1e9 bytes). Repetitions cycle over the MPI variants (round robin), so load from other processes
hits all of them alike; TensorFlow's collectives are warmed up and timed after them, on their own.
Targets: ours/mpi4py >= 0.9 and ours/tf >= 5 at >= 16 MiB.

    python tools/bench_allreduce.py [--quick] [--json PATH] [--no-tf] [--bfc] [--ranks 2] [--threads 1]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import sys
import time

from benchlib import git_state, write_report

MIB = 1 << 20
SIZES = [("scalar", 4), ("1 MiB", MIB), ("4 MiB", 4 * MIB), ("16 MiB", 16 * MIB), ("64 MiB", 64 * MIB),
         ("256 MiB", 256 * MIB)]
TARGETS = {"ours/mpi4py": 0.9, "ours/tf": 5.0}  # at >= 16 MiB
TARGET_MIN_BYTES = 16 * MIB


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="fewer repetitions, sizes up to 64 MiB")
    p.add_argument("--json", default="/tmp/vfgraph_bench_allreduce.json", help="where to write the results")
    p.add_argument("--no-tf", action="store_true", help="leave out TensorFlow's collectives (c)")
    p.add_argument("--ranks", type=int, default=2, help="ranks to launch when not already under MPI")
    p.add_argument("--reps", type=int, default=None, help="timed repetitions per size (default 11; --quick 5)")
    p.add_argument("--tf-reps", type=int, default=None, help="repetitions of (c) (default 5; --quick 3)")
    p.add_argument("--chain", type=int, default=8, help="VfAllreduce ops chained in the tf.function of (a)")
    p.add_argument("--threads", type=int, default=1,
                   help="intra- and inter-op threads for TensorFlow per rank (default 1: the ranks share the "
                        "machine's cores; 0 = TensorFlow's default)")
    p.add_argument("--bfc", action="store_true",
                   help="set TF_CPU_ALLOCATOR_USE_BFC=true (TensorFlow's BFC allocator on the CPU reuses "
                        "memory instead of touching fresh pages for every large output)")
    p.add_argument("--min-rep-seconds", type=float, default=None,
                   help="a repetition repeats the call until it has run about this long, as measured in "
                        "warm-up (default 0.2; --quick 0.05)")
    a = p.parse_args(argv)
    a.reps = a.reps or (5 if a.quick else 11)
    a.tf_reps = a.tf_reps or (3 if a.quick else 5)
    a.min_rep_seconds = a.min_rep_seconds or (0.05 if a.quick else 0.2)
    return a


def under_mpi() -> bool:
    return any(k in os.environ for k in ("PMI_RANK", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "PMIX_RANK"))


def relaunch(args) -> int:
    """Run this script under the venv's mpiexec with --ranks ranks; returns its exit code."""
    import subprocess

    mpiexec = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    if not os.path.exists(mpiexec):
        print(f"bench_allreduce: no mpiexec beside {sys.executable} (pip install mpich)", file=sys.stderr)
        return 2
    cmd = [mpiexec, "-n", str(args.ranks), sys.executable, os.path.abspath(__file__)] + sys.argv[1:]
    print("+ " + " ".join(cmd), flush=True)
    return subprocess.call(cmd)


def free_ports(n):
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def tf_collective_setup(comm):
    """Enable TensorFlow's collectives across the ranks (a MultiWorkerMirroredStrategy over
    loopback, one worker per rank; must run before TensorFlow executes anything) and return the
    strategy and a factory of tf.functions summing a tensor with ``CollectiveReduceV2`` (RING),
    one per instance key (one key per tensor shape)."""
    import tensorflow as tf

    nranks = comm.Get_size()
    ports = comm.bcast(free_ports(nranks) if comm.Get_rank() == 0 else None, root=0)
    os.environ["TF_CONFIG"] = json.dumps({
        "cluster": {"worker": [f"127.0.0.1:{p}" for p in ports]},
        "task": {"type": "worker", "index": comm.Get_rank()}})
    options = tf.distribute.experimental.CommunicationOptions(
        implementation=tf.distribute.experimental.CommunicationImplementation.RING)
    strategy = tf.distribute.MultiWorkerMirroredStrategy(communication_options=options)
    device = strategy.extended.worker_devices[0]

    def make_reduce(instance_key):
        @tf.function
        def reduce(x):
            with tf.device(device):
                return tf.raw_ops.CollectiveReduceV2(
                    input=x, group_size=nranks, group_key=1, instance_key=instance_key, ordering_token=[],
                    merge_op="Add", final_op="Id", communication_hint="ring")
        return reduce

    return strategy, make_reduce


def main(argv=None):
    args = parse_args(argv)
    if args.bfc:
        os.environ["TF_CPU_ALLOCATOR_USE_BFC"] = "true"
    if not under_mpi():
        return relaunch(args)

    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    rank, nranks = comm.Get_rank(), comm.Get_size()
    say = (lambda *a, **k: print(*a, **k, flush=True)) if rank == 0 else (lambda *a, **k: None)

    import tensorflow as tf

    if args.threads > 0:
        tf.config.threading.set_intra_op_parallelism_threads(args.threads)
        tf.config.threading.set_inter_op_parallelism_threads(args.threads)
    strategy = make_tf_reduce = None
    if not args.no_tf:
        say("setting up TensorFlow's collectives (MultiWorkerMirroredStrategy over loopback) ...")
        strategy, make_tf_reduce = tf_collective_setup(comm)


    import vfgraph.ops as ops

    ops.load()
    chain = args.chain

    @tf.function
    def chain_fn(x):
        y = x
        for _ in range(chain):
            y = ops.allreduce(y)
        return y

    @tf.function
    def call_fn(x):
        return ops.allreduce(x)

    sizes = [s for s in SIZES if not (args.quick and s[1] > 64 * MIB)]
    say(f"vfgraph bench_allreduce: {nranks} ranks, float32, TF {tf.__version__}, "
        f"{MPI.Get_library_version().splitlines()[0].strip()}, TF threads {args.threads or 'default'}, "
        f"TF_CPU_ALLOCATOR_USE_BFC={os.environ.get('TF_CPU_ALLOCATOR_USE_BFC', '(unset)')}, chain of {chain} ops, "
        f"median of {args.reps} reps ({args.tf_reps} for tf)")
    results = {}
    for index, (label, nbytes) in enumerate(sizes):
        results[label] = bench_size(label, nbytes, index, args, comm, chain_fn, call_fn,
                                    make_tf_reduce(index + 1) if make_tf_reduce else None)
        r = results[label]
        say(f"  {label:>8}: " + "  ".join(f"{v} {t * 1e3:.3f} ms" for v, t in r["seconds_median"].items()))

    if rank == 0:
        report_table(results, chain)
        meets = {k: all(r["ratios"][k] >= t for r in results.values() if r["bytes"] >= TARGET_MIN_BYTES)
                 for k, t in TARGETS.items() if all(k in r["ratios"] for r in results.values())}
        report = {"benchmark": "bench_allreduce", "config": {
            "ranks": nranks, "dtype": "float32", "chain": chain, "reps": args.reps, "tf_reps": args.tf_reps,
            "min_rep_seconds": args.min_rep_seconds, "threads": args.threads, "quick": args.quick,
            "tf_collectives": not args.no_tf, "tensorflow": tf.__version__,
            "mpi": MPI.Get_library_version().splitlines()[0].strip(),
            "python": platform.python_version(), "git": git_state(), "cpu_count": os.cpu_count(),
            "env": {k: os.environ.get(k) for k in ("TF_CPU_ALLOCATOR_USE_BFC",)},
            "targets": TARGETS, "target_min_bytes": TARGET_MIN_BYTES},
            "results": results, "meets_target": meets}
        write_report(args.json, report)
    comm.Barrier()
    del strategy
    return 0


def small_pages_array(shape):
    """A float32 array of ones that numpy allocates without asking for transparent huge pages."""
    import numpy as np

    try:
        from numpy._core import multiarray
    except ImportError:  # numpy < 2
        from numpy.core import multiarray
    before = multiarray._get_madvise_hugepage()
    multiarray._set_madvise_hugepage(False)
    try:
        return np.ones(shape, np.float32)
    finally:
        multiarray._set_madvise_hugepage(before)


def bench_size(label, nbytes, index, args, comm, chain_fn, call_fn, tf_reduce):
    """Times every variant on one size; returns medians per call (per op for "ours"), GB/s, ratios."""
    import numpy as np
    import tensorflow as tf
    from mpi4py import MPI

    nranks = comm.Get_size()
    chain = args.chain
    shape = [] if label == "scalar" else [nbytes // 4]
    x = tf.ones(shape, tf.float32)
    buf = np.ones(shape, np.float32)
    buf4k = small_pages_array(shape)
    calls = {
        "chain": lambda: chain_fn(x),
        "call": lambda: call_fn(x),
        "mpi4py": lambda: comm.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM),
        "mpi4py-4k": lambda: comm.Allreduce(MPI.IN_PLACE, buf4k, op=MPI.SUM),
    }
    if tf_reduce is not None:
        calls["tf"] = lambda: tf_reduce(x)

    # correctness, once per size
    got = chain_fn(x).numpy()
    assert np.all(got == float(nranks ** chain)), (label, got.ravel()[:4])
    assert np.all(call_fn(x).numpy() == nranks), label

    repeat, times = {}, {v: [] for v in calls}

    def warm_up(v):
        """One untimed call, then one timed call sets how many calls a repetition makes (the same
        on every rank)."""
        calls[v]()
        comm.Barrier()
        t0 = time.perf_counter()
        calls[v]()
        dt = comm.allreduce(time.perf_counter() - t0, op=MPI.MAX)
        repeat[v] = max(1, min(1000, int(args.min_rep_seconds / max(dt, 1e-7))))

    def rep(v):
        comm.Barrier()
        t0 = time.perf_counter()
        for _ in range(repeat[v]):
            calls[v]()
        dt = time.perf_counter() - t0
        times[v].append(comm.allreduce(dt, op=MPI.MAX) / repeat[v])

    # round robin over the MPI variants; TensorFlow's collectives afterwards, on their own, so that
    # their gRPC threads never run beside the MPI variants
    mpi_variants = [v for v in calls if v != "tf"]
    for v in mpi_variants:
        warm_up(v)
    for _ in range(args.reps):
        for v in mpi_variants:
            rep(v)
    if "tf" in calls:
        assert np.all(tf_reduce(x).numpy() == nranks), label
        warm_up("tf")
        for _ in range(args.tf_reps):
            rep("tf")
        time.sleep(0.5)
    # (a): what one more VfAllreduce on a forwarded input adds to a graph, per repetition
    times["ours"] = [(c - s) / (chain - 1) for c, s in zip(times["chain"], times["call"])]
    med = {v: statistics.median(t) for v, t in times.items()}
    ratios = {"ours/mpi4py": med["mpi4py"] / med["ours"], "call/mpi4py": med["mpi4py"] / med["call"],
              "ours/mpi4py-4k": med["mpi4py-4k"] / med["ours"]}
    if "tf" in med:
        ratios.update({"ours/tf": med["tf"] / med["ours"], "call/tf": med["tf"] / med["call"]})
    return {"bytes": nbytes, "calls_per_rep": repeat, "seconds_median": med, "seconds_reps": times,
            "gb_per_s": {v: nbytes / t / 1e9 for v, t in med.items() if v != "chain"}, "ratios": ratios}


def report_table(results, chain):
    have_tf = all("tf" in r["gb_per_s"] for r in results.values())
    cols = ["ours", "call", "mpi4py", "mpi4py-4k"] + (["tf"] if have_tf else [])
    ratios = ["ours/mpi4py", "call/mpi4py", "ours/mpi4py-4k"] + (["ours/tf", "call/tf"] if have_tf else [])
    print("\nalgorithm bandwidth, GB/s (median over repetitions of the slower rank); scalar row: microseconds")
    print(f"(a) ours = one VfAllreduce on a forwarded input inside a graph: (chain of {chain} - single op) / "
          f"{chain - 1}, per repetition")
    print("(a') call = a tf.function of one VfAllreduce on the caller's tensor: call overhead + copy + reduce")
    print("(b') mpi4py-4k = mpi4py on a numpy array without transparent huge pages")
    head = f"{'size':>8} | " + "".join(f"{c:>10}" for c in cols) + " | " + "".join(f"{k:>15}" for k in ratios)
    print(head)
    print("-" * len(head))
    for label, r in results.items():
        if label == "scalar":
            vals = "".join(f"{r['seconds_median'][c] * 1e6:>8.1f}us" for c in cols)
        else:
            vals = "".join(f"{r['gb_per_s'][c]:>10.3f}" for c in cols)
        print(f"{label:>8} | {vals} | " + "".join(f"{r['ratios'][k]:>15.2f}" for k in ratios))
    print("targets at >= 16 MiB: " + ", ".join(f"{k} >= {t}" for k, t in TARGETS.items()))


if __name__ == "__main__":
    sys.exit(main())
