"""Heterogeneous training: steps/s of 2 MPI ranks of uneven speed with ``--vnodes-per-rank
auto`` against the even split, in the same run (target: auto at least 1.3x the even split).

Rank 1 runs on ``--share`` of the CPU time (vfgraph.testing.throttle; 0.5 stands in for
hardware of half the speed), rank 0 on all of its own. The model is a convolutional digits
classifier whose step is mostly convolutions (a small fixed cost per step, so the virtual
nodes are what takes the time), rewritten with V=16 virtual nodes of 64 examples. Each run is
``vfgraph train`` under ``mpiexec`` for ``--steps`` steps; its median step time (after the
first) is what ``vfgraph train -v`` logs. The even and auto runs alternate over ``--rounds``
rounds; the table gives each run, the plans auto chose and the speed ratio it measured.

    python tools/bench_heterogeneous.py [--json docs/results/bench_heterogeneous.json]
"""
from __future__ import annotations

import argparse
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile

from benchlib import ROOT, git_state, write_report

BIN = os.path.dirname(sys.executable)


def conv_model(out: str) -> None:
    """Two 3x3 convolutions of 32 filters over the 8x8 digits: about 3.6 MFLOP per example
    to train, 30k parameters."""
    import export
    import keras

    keras.utils.set_random_seed(0)
    model = keras.Sequential([
        keras.Input((64,)), keras.layers.Reshape((8, 8, 1)),
        keras.layers.Conv2D(32, 3, padding="same", activation="relu"),
        keras.layers.Conv2D(32, 3, padding="same", activation="relu"),
        keras.layers.Flatten(), keras.layers.Dense(10)])
    export._digits_module(out, model, "momentum", 0.02)


def run(model: str, data: str, out: str, split: str, a) -> dict:
    cmd = [os.path.join(BIN, "vfgraph"), "-v", "train", model, "--data", data, "--steps", str(a.steps),
           "--batch-size", str(a.batch), "-o", out, "--force", "--no-progress", "--vnodes-per-rank", split]
    throttle = [sys.executable, "-m", "vfgraph.testing.throttle", "--share", str(a.share), "--"]
    env = {**os.environ, "PYTHONPATH": ROOT, "TF_CPP_MIN_LOG_LEVEL": "2", "TF_ENABLE_ONEDNN_OPTS": "0",
           "OMP_NUM_THREADS": "1"}
    res = subprocess.run([os.path.join(BIN, "mpiexec"), "-n", "1", *cmd, "--threads", "1", ":", "-n", "1",
                          *throttle, *cmd, "--threads", "1"], capture_output=True, text=True, env=env)
    if res.returncode:
        raise SystemExit(f"{split}: vfgraph train failed:\n{res.stderr[-3000:]}")
    step = re.search(r"took ([\d.]+) ms each \(median\)", res.stderr)
    plans = re.findall(r"virtual nodes per rank (\d+\+\d+) from step (\d+).*?rank 0 ([\d.]+) ms, rank 1 ([\d.]+) ms",
                       res.stderr)
    return {"split": split, "step_ms": float(step.group(1)),
            "plans": [{"shares": s, "from_step": int(f), "per_vnode_ms": [float(x), float(y)]} for s, f, x, y in plans]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", default="", help="write the report here")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--batch", type=int, default=1024, help="global batch: V=16 virtual nodes of batch/16")
    p.add_argument("--share", type=float, default=0.5, help="CPU time share of the slow rank (default 0.5)")
    a = p.parse_args()
    import export

    import vfgraph

    runs = {"even": [], "auto": []}
    with tempfile.TemporaryDirectory(prefix="vfgraph-bench-") as tmp:
        export.digits_data(tmp)
        data = os.path.join(tmp, "train.npz")
        conv_model(os.path.join(tmp, "conv"))
        model = os.path.join(tmp, "conv_v16")
        vfgraph.save(vfgraph.rewrite(os.path.join(tmp, "conv"), vnodes=16, vnode_batch=a.batch // 16,
                                     allreduce="mpi"), model)
        even = ",".join([str(16 // 2)] * 2)
        for r in range(a.rounds):
            for label, split in (("even", even), ("auto", "auto")):
                got = run(model, data, os.path.join(tmp, "out"), split, a)
                runs[label].append(got)
                plans = " -> ".join(p["shares"] for p in got["plans"]) or "-"
                print(f"round {r + 1} {label:<5} {got['step_ms']:8.2f} ms per step  plans: {plans}", flush=True)
    even_ms = statistics.median(x["step_ms"] for x in runs["even"])
    auto_ms = statistics.median(x["step_ms"] for x in runs["auto"])
    first = [x["plans"][0]["per_vnode_ms"] for x in runs["auto"] if x["plans"]]
    ratio = statistics.median(y / x for x, y in first) if first else float("nan")
    final = [x["plans"][-1]["shares"] if x["plans"] else even.replace(",", "+") for x in runs["auto"]]
    print(f"\n| split | step (median of {a.rounds} runs) | steps/s |\n|---|---|---|")
    print(f"| even {even.replace(',', '+')} | {even_ms:.2f} ms | {1e3 / even_ms:.2f} |")
    print(f"| auto (final plans {', '.join(final)}) | {auto_ms:.2f} ms | {1e3 / auto_ms:.2f} |")
    print(f"\nauto / even steps/s: {even_ms / auto_ms:.3f}x; measured speed ratio of the ranks: {ratio:.2f}:1")
    if a.json:
        write_report(a.json, {"benchmark": "heterogeneous", "git": git_state(), "machine": platform.machine(),
                              "cpus": os.cpu_count(), "batch": a.batch, "vnodes": 16, "steps": a.steps,
                              "rounds": a.rounds, "share": a.share, "even_step_ms": even_ms, "auto_step_ms": auto_ms,
                              "speedup": even_ms / auto_ms, "speed_ratio": ratio, "runs": runs})


if __name__ == "__main__":
    main()
