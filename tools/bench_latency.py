"""What the all-reduce adds to a data-parallel training step, against MPI's own all-reduce of the
same bytes, measured in one run per model under mpiexec.

For each model (the digits MLP of examples/export.py at a hidden width chosen so that its fused
gradient buffer is about 64 KiB, 300 KiB, 1, 4, 16 and 64 MiB; --fusion-mb 64 makes it one
buffer), rewritten twice with the same virtual nodes (V x b), the same processes (--ranks, one
TensorFlow thread each, as ``vfgraph train --threads 1``) time, in alternating rounds:

  vfgraph    the rewritten ``train`` signature with the all-reduce (one step: the call and
             reading its loss), this rank's share of the global batch fed
  ceiling    the same rewrite with ``allreduce="none"``: no communication at all
  +exchange  each of the two followed by the runtime's per-step exchange of the ranks' flags and
             computing times (``World.gather``, as ``vfgraph train`` runs after every step)
  mpi4py     ``comm.Allreduce(MPI.IN_PLACE, buf)`` of a float32 buffer of the fused bytes, the
             calls back to back (MPI_Allreduce's latency and bandwidth on these ranks)

A round times each variant over a run of steps, after a barrier; a variant's time per step is the
slower rank's. Rounds alternate the variants' order; medians over rounds are reported, with
"over" = median over rounds of (vfgraph - ceiling) per step and vfgraph / ceiling as throughput.
The all-reduce's own time inside the step comes from VfAllreduce's counters
(``vfgraph.ops.allreduce_stats``): per step, the kernel's time (waiting for the other rank
included), split into waiting for the ranks to arrive and reducing, and the waits' sleeps.

With ``--baseline TREE`` (a checkout of vfgraph, with ``vfgraph/rewrites`` linked as installed),
each model's timing runs --runs times under each tree's op library, alternating (baseline first),
on the same rewritten models; each tree's figures are the medians over its runs.

Targets (2 ranks): over <= 2 x mpi4py; vfgraph / ceiling >= 0.85 (MLP 256) and >= 0.9 (MLP 1024).

    python tools/bench_latency.py [--quick] [--json PATH] [--ranks 2] [--rounds 9] [--models mlp256,mlp1024]
                                  [--baseline TREE --runs 2]
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

MPIEXEC = os.path.join(os.path.dirname(sys.executable), "mpiexec")
VNODES = 8
# name: (hidden width, examples per virtual node); fused bytes ~ 4 * 75 * hidden
MODELS = {"mlp256": (256, 16), "mlp1024": (1024, 64), "mlp4096": (3500, 16), "mlp16384": (14000, 16),
          "mlp65536": (56000, 16), "mlp262144": (212992, 16)}
QUICK = ["mlp256", "mlp1024", "mlp4096"]
TARGETS = {"over/mpi4py": 2.0, "vfgraph/ceiling mlp256": 0.85, "vfgraph/ceiling mlp1024": 0.9}
VARIANTS = ("vfgraph", "ceiling", "vfgraph+exchange", "ceiling+exchange", "mpi4py")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help=f"models {','.join(QUICK)}, fewer rounds")
    p.add_argument("--json", default="/tmp/vfgraph_bench_latency.json", help="where to write the results")
    p.add_argument("--ranks", type=int, default=2, help="ranks (mpiexec -n)")
    p.add_argument("--models", default=None, help=f"comma-separated subset of {','.join(MODELS)}")
    p.add_argument("--rounds", type=int, default=None, help="alternating rounds (default 9; --quick 5)")
    p.add_argument("--steps", type=int, default=30, help="at least this many steps per variant and round")
    p.add_argument("--min-round-seconds", type=float, default=0.3,
                   help="each variant's run in a round lasts about this")
    p.add_argument("--fusion-mb", type=float, default=64.0, help="insert-allreduce's fusion-mb (64: one buffer)")
    p.add_argument("--baseline", default=None, help="a checkout of vfgraph to compare with, run alternately")
    p.add_argument("--runs", type=int, default=2, help="with --baseline: runs of each tree per model")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--tree", default=None, help=argparse.SUPPRESS)
    p.add_argument("--b", type=int, default=16, help=argparse.SUPPRESS)
    p.add_argument("--hidden", type=int, default=0, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    a.rounds = a.rounds or (5 if a.quick else 9)
    a.models = a.models.split(",") if a.models else (QUICK if a.quick else list(MODELS))
    unknown = [m for m in a.models if m not in MODELS]
    if unknown:
        p.error(f"unknown model(s) {', '.join(unknown)}; choose from {', '.join(MODELS)}")
    return a


def _steps_for(call, comm, args) -> int:
    """Steps per run so that a run lasts about --min-round-seconds (the same on every rank)."""
    from mpi4py import MPI

    call()
    comm.Barrier()
    t = time.perf_counter()
    for _ in range(3):
        call()
    dt = comm.allreduce((time.perf_counter() - t) / 3, op=MPI.MAX)
    return max(args.steps, int(args.min_round_seconds / max(dt, 1e-7)))


def _timed(call, n: int, comm) -> float:
    """The slower rank's seconds per call over ``n`` calls started together."""
    from mpi4py import MPI

    comm.Barrier()
    t = time.perf_counter()
    for _ in range(n):
        call()
    return comm.allreduce((time.perf_counter() - t) / n, op=MPI.MAX)


def worker(args) -> dict:
    """Under mpiexec: time the variants of one model (``args.worker``: 'MPI_DIR,NONE_DIR')."""
    import numpy as np

    if args.tree:  # the baseline's vfgraph, ahead of this tree's
        sys.path.insert(0, args.tree)
    import vfgraph  # noqa: F401  (registers the ops)
    from vfgraph import ops
    from vfgraph.runtime.world import place_threads, shares, world

    w = world(need_mpi=True)
    place_threads(w, 1)
    import tensorflow as tf
    from mpi4py import MPI

    comm = w.comm
    mpi_dir, none_dir = args.worker.split(",")
    loaded = {"vfgraph": tf.saved_model.load(mpi_dir), "ceiling": tf.saved_model.load(none_dir)}
    fns = {k: m.signatures["train"] for k, m in loaded.items()}
    loaded["vfgraph"].signatures["train_broadcast"]()
    per = shares(VNODES, w.size)
    rows = per[w.rank] * args.b
    rng = np.random.default_rng(w.rank)
    feed = {"x": tf.constant(rng.standard_normal((rows, 64)).astype(np.float32)),
            "y": tf.constant(rng.integers(0, 10, rows).astype(np.int32))}
    hidden = args.hidden
    params, fused = _sizes(hidden)
    buf = np.ones(fused // 4, np.float32)

    def step(k):
        return lambda: float(fns[k](**feed)["loss"])

    def with_exchange(k):
        def call():
            began = time.perf_counter()
            loss = float(fns[k](**feed)["loss"])
            w.gather((0 if loss == loss else 1, time.perf_counter() - began))
        return call

    calls = {"vfgraph": step("vfgraph"), "ceiling": step("ceiling"), "vfgraph+exchange": with_exchange("vfgraph"),
             "ceiling+exchange": with_exchange("ceiling"),
             "mpi4py": lambda: comm.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM)}
    for _ in range(3):  # trace and warm up
        for c in calls.values():
            c()
    n = {k: _steps_for(c, comm, args) for k, c in calls.items()}
    times = {k: [] for k in calls}
    stats = []
    order = list(calls)
    for r in range(args.rounds):
        for k in (order if r % 2 == 0 else order[::-1]):
            before = ops.allreduce_stats() if k == "vfgraph" else None
            times[k].append(_timed(calls[k], n[k], comm))
            if before is not None:
                after = ops.allreduce_stats()
                stats.append({s: (after[s] - before[s]) / n[k] for s in after})
    # each rank's counters per step, medians over rounds; every rank's reported
    mine = {s: statistics.median(d[s] for d in stats) for s in stats[0]}
    every = comm.gather(mine, root=0)
    return {"ranks": w.size, "library": ops.library_path(), "params": params, "fused_bytes": fused,
            "steps_per_round": n, "seconds": times,
            "allreduce_per_step": every}


def _sizes(hidden: int):
    """Parameters of the MLP and bytes of its fused float32 buffer: each gradient padded to 64
    bytes, plus the loss and count slots (as insert-allreduce packs them)."""
    shapes = [64 * hidden, hidden, hidden * 10, 10]
    return sum(shapes), sum(-(-4 * n // 64) * 64 for n in shapes) + 2 * 64


def summarize(name: str, got: dict) -> dict:
    """Medians, the step over the ceiling (paired by round) and the ratios of one model."""
    secs = got["seconds"]
    med = {k: statistics.median(v) for k, v in secs.items()}
    over = statistics.median(a - b for a, b in zip(secs["vfgraph"], secs["ceiling"]))
    over_x = statistics.median(a - b for a, b in zip(secs["vfgraph+exchange"], secs["ceiling+exchange"]))
    per_step = got["allreduce_per_step"]
    own = max(r["total_ns"] for r in per_step) / 1e9
    return {"params": got["params"], "fused_bytes": got["fused_bytes"], "ranks": got["ranks"],
            "library": got["library"],
            "steps_per_round": got["steps_per_round"], "seconds_rounds": secs, "seconds_median": med,
            "over_ceiling_s": over, "over_ceiling_with_exchange_s": over_x,
            "vfgraph/ceiling": med["ceiling"] / med["vfgraph"],
            "vfgraph/ceiling with exchange": med["ceiling+exchange"] / med["vfgraph+exchange"],
            "over/mpi4py": over / med["mpi4py"], "allreduce_own_s": own,
            "allreduce_per_step": per_step, "noise": {k: (max(v) - min(v)) / statistics.median(v)
                                                       for k, v in secs.items()}}


def run_model(name: str, args, tmp: str) -> dict:
    import export

    import vfgraph

    hidden, b = MODELS[name]
    src = os.path.join(tmp, name)
    export.digits_mlp(src, optimizer="sgd", lr=0.01, hidden=hidden)
    outs = []
    for allreduce in ("mpi", "none"):
        out = os.path.join(tmp, f"{name}_{allreduce}")
        kw = {"fusion_mb": args.fusion_mb} if allreduce == "mpi" else {}
        vfgraph.save(vfgraph.rewrite(src, vnodes=VNODES, vnode_batch=b, allreduce=allreduce, **kw), out)
        outs.append(out)
    cmd = [MPIEXEC, "-n", str(args.ranks), sys.executable, os.path.abspath(__file__), "--worker", ",".join(outs),
           "--b", str(b), "--hidden", str(hidden), "--rounds", str(args.rounds), "--steps", str(args.steps),
           "--min-round-seconds", str(args.min_round_seconds)]
    if not args.baseline:
        return summarize(name, _run(cmd, name))
    runs = {"baseline": [], "this": []}
    for _ in range(args.runs):
        runs["baseline"].append(summarize(name, _run(cmd + ["--tree", os.path.abspath(args.baseline)], name)))
        runs["this"].append(summarize(name, _run(cmd, name)))
    return {tree: _median_run(got) for tree, got in runs.items()}


def _run(cmd, name: str) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    res = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=3600)
    if res.returncode:
        raise SystemExit(f"bench_latency: {name} failed under mpiexec:\n{res.stderr[-3000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def _median_run(runs: list) -> dict:
    """The run whose vfgraph / ceiling is the median of the runs' (the lower middle one), with
    every run's ratios and step over the ceiling."""
    ranked = sorted(runs, key=lambda r: r["vfgraph/ceiling"])
    pick = dict(ranked[(len(ranked) - 1) // 2])
    pick["runs"] = [{k: r[k] for k in ("vfgraph/ceiling", "over_ceiling_s", "over/mpi4py")} for r in runs]
    return pick


def report_table(results: dict) -> None:
    print("\nper step, slower rank, medians over rounds; over = vfgraph - ceiling (paired by round)")
    head = (f"{'model':<10}{'fused':>10} | {'ceiling ms':>10}{'vfgraph ms':>11}{'over us':>9}{'mpi4py us':>10}"
            f"{'over/mpi':>9}{'vf/ceil':>8} | {'op us':>7}{'arrive':>8}{'reduce':>8}{'sleeps':>7} | "
            f"{'+exch over':>10}{'vf/ceil':>8}")
    print(head)
    print("-" * len(head))
    for name, r in results.items():
        m = r["seconds_median"]
        a = r["allreduce_per_step"][0]
        print(f"{name:<10}{r['fused_bytes'] / 1024:>8.0f}KB | {m['ceiling'] * 1e3:>10.3f}{m['vfgraph'] * 1e3:>11.3f}"
              f"{r['over_ceiling_s'] * 1e6:>9.0f}{m['mpi4py'] * 1e6:>10.1f}{r['over/mpi4py']:>9.2f}"
              f"{r['vfgraph/ceiling']:>8.2f} | {a['total_ns'] / 1e3:>7.0f}{a['arrive_ns'] / 1e3:>8.0f}"
              f"{a['reduce_ns'] / 1e3:>8.0f}{a['sleeps']:>7.1f} | {r['over_ceiling_with_exchange_s'] * 1e6:>10.0f}"
              f"{r['vfgraph/ceiling with exchange']:>8.2f}")
    print("op us, arrive, reduce, sleeps: rank 0's VfAllreduce per step (kernel time, waiting for the ranks to "
          "arrive, reducing, sleeps in its waits)")


def _tree_commit(tree: str):
    """The commit a baseline tree is: its git HEAD, or the first word of its COMMIT file (a tree
    exported with ``git archive``), else None."""
    head = subprocess.run(["git", "-C", tree, "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    if head:
        return head
    try:
        with open(os.path.join(tree, "COMMIT")) as f:
            return f.read().split()[0]
    except (OSError, IndexError):
        return None


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker:
        from mpi4py import MPI

        got = worker(args)
        if MPI.COMM_WORLD.Get_rank() == 0:
            print(json.dumps(got))
        return 0
    import tensorflow as tf

    print(f"vfgraph bench_latency: {args.ranks} ranks, {VNODES} virtual nodes, fusion-mb {args.fusion_mb:g}, "
          f"{args.rounds} alternating rounds, load average {os.getloadavg()[0]:.2f}", flush=True)
    results = {}
    with tempfile.TemporaryDirectory(prefix="vfgraph-bench-latency-") as tmp:
        for name in args.models:
            print(f"  {name}: exporting, rewriting, timing ...", flush=True)
            results[name] = run_model(name, args, tmp)
            for tree, r in (results[name].items() if args.baseline else [("this", results[name])]):
                print(f"    {tree}: over {r['over_ceiling_s'] * 1e6:.0f} us, mpi4py "
                      f"{r['seconds_median']['mpi4py'] * 1e6:.1f} us, vfgraph/ceiling {r['vfgraph/ceiling']:.2f}",
                      flush=True)
    trees = {"baseline": {k: r["baseline"] for k, r in results.items()},
             "this tree": {k: r["this"] for k, r in results.items()}} if args.baseline else {"": results}
    for tree, rs in trees.items():
        if tree:
            print(f"\n{tree}:", end="")
        report_table(rs)
    mine = trees["this tree"] if args.baseline else results
    meets = {"over/mpi4py": all(r["over/mpi4py"] <= TARGETS["over/mpi4py"] for r in mine.values())}
    for name in ("mlp256", "mlp1024"):
        if name in mine:
            meets[f"vfgraph/ceiling {name}"] = mine[name]["vfgraph/ceiling"] >= TARGETS[f"vfgraph/ceiling {name}"]
    baseline = None
    if args.baseline:
        baseline = {"tree": os.path.abspath(args.baseline), "git": _tree_commit(args.baseline)}
    report = {"benchmark": "bench_latency", "config": {
        "ranks": args.ranks, "vnodes": VNODES, "models": {m: MODELS[m] for m in args.models},
        "fusion_mb": args.fusion_mb, "rounds": args.rounds, "min_steps": args.steps,
        "min_round_seconds": args.min_round_seconds, "quick": args.quick, "baseline": baseline, "runs": args.runs,
        "tensorflow": tf.__version__,
        "git": git_state(), "cpu_count": os.cpu_count(), "load_average_end": os.getloadavg(), "targets": TARGETS},
        "results": results, "meets_target": meets}
    write_report(args.json, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
