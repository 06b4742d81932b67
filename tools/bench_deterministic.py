"""The cost of deterministic mode: step time of the digits MLP (Adam) and the batch-norm CNN
(momentum), rewritten with V=8 virtual nodes with and without ``--deterministic`` (exact
fixed-point sums of the gradients and the loss), on one process and on 2 MPI ranks (2x4).

Each configuration runs in a fresh process (one intra-op and one inter-op thread per
process), timing ``--steps`` steps after two warm-up steps; the configurations alternate over
``--rounds`` rounds, and the table gives the median step time of each and the ratio of the
medians (target: deterministic under 1.15x the default).

    python tools/bench_deterministic.py [--json docs/results/bench_deterministic.json]
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

MODELS = {"digits MLP (Adam)": ("digits_mlp", "adam", 0.01), "digits CNN, batch norm (momentum)":
          ("digits_cnn", "momentum", 0.05)}


def worker(args) -> None:
    """Time one configuration in this process; prints a JSON line (the slowest rank's median)."""
    import numpy as np
    import tensorflow as tf

    tf.config.threading.set_inter_op_parallelism_threads(1)
    tf.config.threading.set_intra_op_parallelism_threads(1)
    from vfgraph.runtime.world import world

    w = world(need_mpi=True)
    import vfgraph  # noqa: F401  (the ops)

    fn = tf.saved_model.load(args.model).signatures["train"]
    with np.load(args.data) as z:
        x, y = z["x"], z["y"]
    rows = args.batch // w.size
    feed = {"x": tf.constant(x[w.rank * rows:(w.rank + 1) * rows]), "y": tf.constant(y[w.rank * rows:(w.rank + 1) * rows])}
    for _ in range(2):
        fn(**feed)
    times = []
    for _ in range(args.steps):
        t = time.perf_counter()
        fn(**feed)["loss"].numpy()
        times.append(time.perf_counter() - t)
    medians = w.gather(statistics.median(times))
    if w.is_root:
        print(json.dumps({"step_s": max(medians)}))


def run(model: str, data: str, ranks: int, a) -> float:
    launcher = [os.path.join(os.path.dirname(sys.executable), "mpiexec"), "-n", str(ranks)] if ranks > 1 else []
    cmd = launcher + [sys.executable, os.path.abspath(__file__), "--worker", "--model", model, "--data", data,
                      "--steps", str(a.steps), "--batch", str(a.batch)]
    env = {**os.environ, "PYTHONPATH": ROOT, "TF_CPP_MIN_LOG_LEVEL": "2", "TF_ENABLE_ONEDNN_OPTS": "0"}
    res = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if res.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{res.stderr[-3000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])["step_s"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", default="", help="write the report here")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--batch", type=int, default=64, help="global batch: V=8 virtual nodes of batch/8")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--model", help=argparse.SUPPRESS)
    p.add_argument("--data", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.worker:
        return worker(a)
    sys.path.insert(0, os.path.join(ROOT, "examples"))
    import export

    import vfgraph

    rows = []
    with tempfile.TemporaryDirectory(prefix="vfgraph-bench-") as tmp:
        export.digits_data(tmp)
        data = os.path.join(tmp, "train.npz")
        for label, (fn, optimizer, lr) in MODELS.items():
            src = os.path.join(tmp, fn)
            getattr(export, fn)(src, optimizer, lr)
            paths = {}
            for mode in ("default", "deterministic"):
                paths[mode] = os.path.join(tmp, f"{fn}_{mode}")
                vfgraph.save(vfgraph.rewrite(src, vnodes=8, vnode_batch=a.batch // 8,
                                             deterministic=mode == "deterministic"), paths[mode])
            for ranks in (1, 2):
                times = {"default": [], "deterministic": []}
                for _ in range(a.rounds):
                    for mode in times:
                        times[mode].append(run(paths[mode], data, ranks, a))
                row = {"model": label, "ranks": ranks, **{f"{m}_s": statistics.median(t) for m, t in times.items()},
                       "times": times}
                row["ratio"] = row["deterministic_s"] / row["default_s"]
                rows.append(row)
                print(f"{label:<36} {ranks} rank(s): default {row['default_s'] * 1000:7.2f} ms, deterministic "
                      f"{row['deterministic_s'] * 1000:7.2f} ms, x{row['ratio']:.3f}", flush=True)
    if a.json:
        write_report(a.json, {"benchmark": "deterministic", "git": git_state(), "machine": platform.machine(),
                              "cpus": os.cpu_count(), "batch": a.batch, "vnodes": 8, "steps": a.steps,
                              "rounds": a.rounds, "results": rows})


if __name__ == "__main__":
    main()
