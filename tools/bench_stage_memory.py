"""Memory per rank of a model cut into pipeline stages on MPI ranks ("half the resources"): a
parameter-heavy MLP trained with Adam, whose parameters and optimizer state are most of what a
process holds, trained by ``vfgraph train`` unpartitioned on one process and cut into K=2
stages on ``mpiexec -n 2``.

Each run reports, from ``vfgraph train -v``'s own log: the variable bytes each rank holds
(parameters and optimizer state; a stage rank reads only its own from the model) against the
whole model's, and each process's peak resident memory during training (VmHWM, before rank 0
gathers the stages' variables to write the trained model), with its rise above the process
before the model loaded (Python and TensorFlow).

    python tools/bench_stage_memory.py [--json docs/results/bench_stage_memory.json]
"""
from __future__ import annotations

import argparse
import os
import platform
import re
import subprocess
import sys
import tempfile

import numpy as np

from bench_pipeline import export_model
from benchlib import ROOT, git_state, write_report

K = 2
HELD = re.compile(r"rank (\d+) \(stage (\d+) of \d+, replica \d+\): holds .* \((\d+) of (\d+) bytes\)")
PEAK = re.compile(r"(?:rank (\d+): )?peak resident memory .* \((\d+) bytes\)")
VMHWM = re.compile(r"(?:rank (\d+): )?peak resident memory ([\d.]+) (B|KiB|MiB|GiB)")
UNITS = {"B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}


def train(model: str, data: str, out: str, ranks: int, a) -> dict:
    """One ``vfgraph train`` run; per rank: variable bytes held, peak resident memory and its rise."""
    launcher = [os.path.join(os.path.dirname(sys.executable), "mpiexec"), "-n", str(ranks)] if ranks else []
    cmd = launcher + [sys.executable, "-m", "vfgraph.cli", "-v", "train", model, "--data", data, "--steps",
                      str(a.steps), "--batch-size", str(a.vnodes * a.vnode_batch), "-o", out, "--no-progress",
                      "--threads", "1"]
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", "TF_ENABLE_ONEDNN_OPTS": "0", "OMP_NUM_THREADS": "1"}
    res = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if res.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{res.stderr[-3000:]}")
    rows = {}
    for m in PEAK.finditer(res.stderr):
        rows[int(m.group(1) or 0)] = {"rise_bytes": int(m.group(2))}
    for m in VMHWM.finditer(res.stderr):
        rows[int(m.group(1) or 0)]["peak_bytes"] = int(float(m.group(2)) * UNITS[m.group(3)])
    for m in HELD.finditer(res.stderr):
        rows[int(m.group(1))].update(stage=int(m.group(2)), held_bytes=int(m.group(3)))
    return {"ranks": [rows[r] for r in sorted(rows)]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", default="", help="write the report here")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--width", type=int, default=4096)
    p.add_argument("--vnodes", type=int, default=8)
    p.add_argument("--vnode-batch", type=int, default=16)
    p.add_argument("--steps", type=int, default=3)
    a = p.parse_args()
    sys.path.insert(0, os.path.join(ROOT, "examples"))
    import vfgraph
    from vfgraph import records
    from vfgraph.records import Stages

    with tempfile.TemporaryDirectory(prefix="vfgraph-bench-") as tmp:
        src = os.path.join(tmp, "src")
        export_model(src, a.layers, a.width, "adam", 0.001)
        rng = np.random.default_rng(0)
        n = a.vnodes * a.vnode_batch * 4
        data = os.path.join(tmp, "data.npz")
        np.savez(data, x=rng.normal(size=(n, a.width)).astype(np.float32), y=rng.integers(0, 10, n).astype(np.int32))
        one, staged = os.path.join(tmp, "one"), os.path.join(tmp, "staged")
        # (without the step-wise signatures' accumulators, which vfgraph train never reads)
        vfgraph.save(vfgraph.rewrite(src, pipeline=f"split-vnodes{{vnodes={a.vnodes},vnode-batch={a.vnode_batch},"
                                                   "stepwise=false}"), one)
        vfgraph.save(vfgraph.rewrite(src, vnodes=a.vnodes, vnode_batch=a.vnode_batch, stages=K), staged)
        whole = sum(p.parameter_bytes + p.optimizer_state_bytes for p in records.read(staged, Stages)["train"].parts)
        base = train(one, data, os.path.join(tmp, "one-out"), 0, a)
        base["ranks"][0].update(stage=0, held_bytes=whole)
        pipe = train(staged, data, os.path.join(tmp, "staged-out"), K, a)
    mib = float(1 << 20)
    print(f"model: {a.layers} x {a.width} MLP, Adam; parameters and optimizer state {whole / mib:.1f} MiB")
    print(f"{'run':<22}{'variables held':>16}{'share':>8}{'peak RSS':>12}{'rise':>12}{'rise / one process':>20}")
    b = base["ranks"][0]
    table = [("one process", b)] + [(f"2 stages, rank {r}", x) for r, x in enumerate(pipe["ranks"])]
    for label, x in table:
        print(f"{label:<22}{x['held_bytes'] / mib:>12.1f} MiB{x['held_bytes'] / whole:>8.0%}"
              f"{x['peak_bytes'] / mib:>8.0f} MiB{x['rise_bytes'] / mib:>8.0f} MiB"
              f"{x['rise_bytes'] / b['rise_bytes']:>20.2f}")
    if a.json:
        write_report(a.json, {
            "benchmark": "stage_memory", "git": git_state(), "machine": platform.machine(), "cpus": os.cpu_count(),
            "model": {"layers": a.layers, "width": a.width, "optimizer": "adam", "variable_bytes": whole},
            "vnodes": a.vnodes, "vnode_batch": a.vnode_batch, "steps": a.steps, "stages": K,
            "one_process": b, "staged": pipe["ranks"]})


if __name__ == "__main__":
    main()
