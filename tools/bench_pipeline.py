"""Pipeline stages in one process: step time of a model cut into K=2 stages on two logical CPU
devices (one core each) against the same model's unpartitioned step, for M = 2, 4, 8, 16
virtual nodes (the pipeline's micro-batches), next to GPipe's bound. The schedules' memory:
tools/bench_pipeline_memory.py, on the same model.

The model is an MLP of ``--layers`` equal Dense layers (``--width`` units, ReLU) and a
10-class head, trained with SGD, on inputs of ``--inputs`` features (default 2 x width,
which balances its two stages as they run: the first layer computes no gradient for its
input, and its wider input makes up for that and for what the second half adds, the head,
the loss and a fifth layer's bias and activation gradients; each half's forward and
backward, timed alone on one core, take the same time, while the FLOP estimate, which
counts elementwise ops as almost free, gives the first half 8% more); a virtual node holds
``--vnode-batch`` examples, so a step of M virtual nodes trains M * b examples. Every
configuration runs in a fresh process:

  one-core    the unpartitioned rewrite, one intra-op and one inter-op thread (one device)
  two-threads the unpartitioned rewrite, two intra-op threads (the same two cores, each op
              spread over both)
  two-ops     the unpartitioned rewrite, one intra-op thread and two inter-op threads (the
              same two cores, two independent ops of a virtual node at once)
  1f1b, gpipe the rewrite with --stages 2 --devices /CPU:0,/CPU:1 and that schedule, one
              intra-op thread and one inter-op thread per stage
  ranks       with --ranks: the rewrite with --stages 2 (no devices, 1F1B), under
              ``mpiexec -bind-to core -n 2`` (each rank bound to a core of its own), each rank
              running its stage with one intra-op thread and one inter-op thread, as
              ``vfgraph train`` runs it (the slower rank's median step); and the same under
              ``mpiexec -n 2`` (MPICH's default: no binding, the ranks' threads move between
              the cores)

With ``--rounds R`` the one-core step and the runs on ranks (what the 2-rank figures are
compared with) run R times each, alternating, and report the run whose median step is the
median of theirs (of an even number, the faster of the middle two).

GPipe's bound on the speed-up of K stages over one device is K * M / (M + K - 1) (the
pipeline's bubble); efficiency is the measured speed-up (one-core time / pipeline time) over
that bound. Parameter bytes per stage come from the rewrite's stage record.

    python tools/bench_pipeline.py [--quick] [--json docs/results/bench_pipeline.json]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

from benchlib import ROOT, git_state, write_report

K = 2
RANK_INTER_OP = 1  # inter-op threads of a stage rank (vfgraph.runtime.world.place_threads)


def export_model(path: str, layers: int, width: int, optimizer: str = "sgd", lr: float = 0.01,
                 inputs: int = 0) -> None:
    """An MLP of ``layers`` Dense layers of ``width`` units (ReLU) and a 10-class head on
    ``inputs`` features (default ``width``), trained with ``optimizer``, saved with its train
    and serving signatures."""
    inputs = inputs or width
    import keras
    import tensorflow as tf

    import export

    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((inputs,))] + [keras.layers.Dense(width, activation="relu")
                                                        for _ in range(layers)] + [keras.layers.Dense(10)])
    specs = {"x": tf.TensorSpec([None, inputs], tf.float32, name="x"), "y": tf.TensorSpec([None], tf.int32, name="y")}
    m = export.build_module(model, specs, optimizer, lr, export.sparse_ce)
    tf.saved_model.save(m, path, signatures={"train": m.train, "serving_default": m.serve})


def stage_signature(model: str, rank: int) -> str:
    """The training signature MPI rank ``rank`` runs of the stages of ``model``: the one the
    Stages record names for stage ``rank mod K + 1`` (as 'vfgraph train' runs them)."""
    from vfgraph import records
    from vfgraph.records import Stages

    signatures = records.read(model, Stages)["train"].signatures
    return signatures[rank % len(signatures)]


def worker(args) -> None:
    """One configuration, in this process: prints a JSON line of step times and memory."""
    import numpy as np
    import tensorflow as tf

    from benchlib import proc_status, reset_hwm
    from vfgraph.runtime.devices import one_cpu_per_stage

    rank = 0
    ranks = args.mode.startswith("ranks")
    if ranks:
        from mpi4py import MPI

        import vfgraph.ops

        rank = MPI.COMM_WORLD.Get_rank()
        tf.config.threading.set_inter_op_parallelism_threads(RANK_INTER_OP)  # as vfgraph train gives a stage rank
        tf.config.threading.set_intra_op_parallelism_threads(1)
        vfgraph.ops.set_communicator(MPI.COMM_WORLD.Dup(), stages=K)  # (the stages' reduce runs on it)
    elif args.mode in ("1f1b", "gpipe"):
        one_cpu_per_stage(K)
    else:
        tf.config.threading.set_inter_op_parallelism_threads(2 if args.mode == "two-ops" else 1)
        tf.config.threading.set_intra_op_parallelism_threads(2 if args.mode == "two-threads" else 1)
    from vfgraph.io.savedmodel import load_to_run

    loaded = load_to_run(args.model, variable_devices=args.mode in ("1f1b", "gpipe"))
    fn = loaded.signatures[stage_signature(args.model, rank) if ranks else "train"]
    rng = np.random.default_rng(0)
    n = args.vnodes * args.vnode_batch
    feed = {"x": tf.constant(rng.normal(size=(n, args.inputs)).astype(np.float32)),
            "y": tf.constant(rng.integers(0, 10, n).astype(np.int32))}
    fn(**feed)
    # under TensorFlow's BFC allocator for the CPU (TF_CPU_ALLOCATOR_USE_BFC=true), its counts of
    # the bytes held in tensors, one allocator for all the process's CPU devices
    tensors = os.environ.get("TF_CPU_ALLOCATOR_USE_BFC", "").lower() in ("1", "true")
    reset_hwm()
    times, step_tensor_bytes = [], 0
    for _ in range(args.steps):
        if tensors:
            tf.config.experimental.reset_memory_stats("CPU:0")
            held = tf.config.experimental.get_memory_info("CPU:0")["current"]
        t = time.perf_counter()
        fn(**feed)["loss"].numpy()
        times.append(time.perf_counter() - t)
        if tensors:
            step_tensor_bytes = max(step_tensor_bytes, tf.config.experimental.get_memory_info("CPU:0")["peak"] - held)
    # the resident high-water mark over the timed steps (reset before them)
    report = {"step_s": statistics.median(times), "times": times, "peak_rss_bytes": proc_status("VmHWM")}
    if tensors:  # the most a step held in tensors beyond what was held before it (variables, inputs)
        report.update(step_tensor_bytes=step_tensor_bytes, held_tensor_bytes=held)
    if ranks:
        reports = MPI.COMM_WORLD.gather(report, root=0)
        if rank:
            return
        report = dict(max(reports, key=lambda r: r["step_s"]))
        report["ranks"] = reports
    print(json.dumps(report))


def run_worker(model: str, mode: str, vnodes: int, a, env: dict = None) -> dict:
    """Run configuration ``mode`` of ``model`` in a fresh process (``env`` added to its
    environment); its report."""
    ranks = mode.startswith("ranks")
    launcher = ([os.path.join(os.path.dirname(sys.executable), "mpiexec")] +
                ([] if mode == "ranks-unbound" else ["-bind-to", "core"]) + ["-n", str(K)]) if ranks else []
    cmd = launcher + [sys.executable, os.path.abspath(__file__), "--worker", "--model", model, "--mode", mode,
           "--vnodes", str(vnodes), "--vnode-batch", str(a.vnode_batch), "--width", str(a.width), "--inputs", str(a.inputs),
           "--steps", str(a.steps)]
    res = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": ROOT, **(env or {})})
    if res.returncode:
        raise SystemExit(f"{mode} M={vnodes} failed:\n{res.stderr[-3000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def median_run(runs: list) -> dict:
    """The run whose median step is the median of ``runs``' (the lower middle one of an even
    number), with every run's median step under ``round_step_s``."""
    order = sorted(runs, key=lambda r: r["step_s"])
    return {**order[(len(order) - 1) // 2], "round_step_s": [r["step_s"] for r in runs]}


def add_model_options(p: argparse.ArgumentParser) -> None:
    """The benchmark model's options (``export_model``'s layers, width and inputs)."""
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--inputs", type=int, default=0, help="input features (default: 2 x width)")


def _row(a, paths: dict, m: int) -> dict:
    """The step times of M = m virtual nodes in each mode (the one-core step and the ranks' in
    alternating rounds, medians), the speed-ups and the efficiency against GPipe's bound."""
    rounds = {mode: [] for mode in ("one-core", "ranks", "ranks-unbound")}
    for _ in range(a.rounds):  # alternating, so that the machine's load moves all alike
        rounds["one-core"].append(run_worker(paths["base"], "one-core", m, a))
        if a.ranks:
            rounds["ranks"].append(run_worker(paths["ranks"], "ranks", m, a))
            rounds["ranks-unbound"].append(run_worker(paths["ranks"], "ranks-unbound", m, a))
    row = {"vnodes": m, **{mode: median_run(runs) for mode, runs in rounds.items() if runs},
           "two-threads": run_worker(paths["base"], "two-threads", m, a),
           "two-ops": run_worker(paths["base"], "two-ops", m, a),
           "1f1b": run_worker(paths["1f1b"], "1f1b", m, a),
           "gpipe": run_worker(paths["gpipe"], "gpipe", m, a)}
    if a.ranks:
        row["speedup_ranks"] = row["one-core"]["step_s"] / row["ranks"]["step_s"]
        row["speedup_ranks_unbound"] = row["one-core"]["step_s"] / row["ranks-unbound"]["step_s"]
    best = min(row["1f1b"]["step_s"], row["gpipe"]["step_s"])
    row["speedup"] = row["one-core"]["step_s"] / best
    row["speedup_1f1b"] = row["one-core"]["step_s"] / row["1f1b"]["step_s"]
    row["speedup_over_two_threads"] = row["two-threads"]["step_s"] / best
    row["speedup_over_two_ops"] = row["two-ops"]["step_s"] / best
    row["bound"] = K * m / (m + K - 1)
    row["efficiency"] = row["speedup"] / row["bound"]
    if a.ranks:
        row["efficiency_ranks"] = row["speedup_ranks"] / row["bound"]
    return row


def _parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="M = 2, 8 only, fewer steps")
    p.add_argument("--json", default="", help="write the report here")
    add_model_options(p)
    p.add_argument("--vnode-batch", type=int, default=256)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--ranks", action="store_true", help="also time the stages on 2 MPI ranks")
    p.add_argument("--rounds", type=int, default=1, help="runs of the one-core step and of the ranks' (median)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--model", help=argparse.SUPPRESS)
    p.add_argument("--mode", help=argparse.SUPPRESS)
    p.add_argument("--vnodes", type=int, help=argparse.SUPPRESS)
    return p.parse_args()


def main() -> None:
    a = _parse_args()
    if a.worker:
        return worker(a)
    a.inputs = a.inputs or a.width * 2
    if a.quick:
        a.steps = 3
    counts = [2, 8] if a.quick else [2, 4, 8, 16]
    import tensorflow as tf

    import vfgraph
    from vfgraph import records
    from vfgraph.records import Stages

    tmp = tempfile.mkdtemp(prefix="bench_pipeline_")
    src = os.path.join(tmp, "mlp")
    export_model(src, a.layers, a.width, inputs=a.inputs)
    results, stages_info = [], None
    print(f"{'M':>3} {'one-core s':>10} {'two-thr s':>10} {'two-ops s':>10} {'1f1b s':>8} {'gpipe s':>8} "
          f"{'speed-up':>8} {'bound':>6} {'efficiency':>10}")
    for m in counts:
        paths = {}
        on_ranks = ("ranks",) if a.ranks else ()
        for mode in ("base", "1f1b", "gpipe") + on_ranks:
            kw = ({} if mode == "base" else dict(stages=K)
                  if mode == "ranks" else
                  dict(stages=K, devices=[f"/CPU:{i}" for i in range(K)], schedule=mode))
            item = vfgraph.rewrite(src, vnodes=m, vnode_batch=a.vnode_batch,
                                   allreduce="mpi" if mode.startswith("ranks") else "none", **kw)
            paths[mode] = os.path.join(tmp, f"{mode}_{m}")
            vfgraph.save(item, paths[mode])
            if mode == "1f1b" and stages_info is None:
                rec = records.get(item, Stages)["train"]
                stages_info = [{"device": s.device, "parameter_bytes": s.parameter_bytes, "ops": s.ops,
                                "flops": s.flops} for s in rec.parts]
        row = _row(a, paths, m)
        results.append(row)
        print(f"{m:>3} {row['one-core']['step_s']:>10.3f} {row['two-threads']['step_s']:>10.3f} "
              f"{row['two-ops']['step_s']:>10.3f} "
              f"{row['1f1b']['step_s']:>8.3f} {row['gpipe']['step_s']:>8.3f} {row['speedup']:>8.2f} "
              f"{row['bound']:>6.2f} {row['efficiency']:>10.2f}"
              + (f"   2 ranks {row['ranks']['step_s']:.3f} s, x{row['speedup_ranks']:.2f} "
                 f"(efficiency {row['efficiency_ranks']:.2f}); unbound {row['ranks-unbound']['step_s']:.3f} s"
                 if a.ranks else ""))
    mib = float(1 << 20)
    total = sum(s["parameter_bytes"] for s in stages_info)
    for k, s in enumerate(stages_info, 1):
        print(f"stage {k} on {s['device']}: {s['parameter_bytes'] / mib:.2f} MiB of parameters "
              f"({s['parameter_bytes'] / total:.0%} of the model)")
    if a.json:
        write_report(a.json, {
            "config": {"layers": a.layers, "width": a.width, "inputs": a.inputs, "vnode_batch": a.vnode_batch, "stages": K,
                       "rank_inter_op_threads": RANK_INTER_OP,
                       "steps": a.steps, "rounds": a.rounds, "quick": a.quick, "tensorflow": tf.__version__,
                       "cpu_count": os.cpu_count(), "python": platform.python_version(), "git": git_state()},
            "results": results, "stages": stages_info, "parameter_bytes": total})


if __name__ == "__main__":
    main()
