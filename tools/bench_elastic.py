"""Elastic runs: what a resize costs the ranks that keep training (target: at most 1 s from the
step of the change to the first step on the new layout, the new ranks pre-warmed), and each new
rank's own start-up, reported apart.

One ``vfgraph train`` job under ``mpiexec -n 1`` on a digits MLP with 4096 hidden units and
Adam (3.6 MB of parameters and optimizer state, all of which the new ranks receive), V=16
virtual nodes of 64 examples, on the schedule ``--schedule`` (default 1 -> 2 -> 4 -> 2 ranks,
the steps far enough apart that the new ranks have loaded the model before the growth). The
figures are the ones the job logs: for each change, the wait for new ranks still loading (0
when pre-warmed) and the change itself (merge or split, the ops' new communicator, and for a
growth the check of the graph and the broadcast of every variable); for each new rank, the
time from its command's start to joining. ``--rounds`` runs.

    python tools/bench_elastic.py [--json docs/results/bench_elastic.json]
"""
from __future__ import annotations

import argparse
import os
import platform
import re
import subprocess
import sys
import tempfile

from benchlib import ROOT, git_state, write_report

BIN = os.path.dirname(sys.executable)


def run(model: str, data: str, out: str, a) -> dict:
    steps = max(int(s) for s, _ in (x.split(":") for x in a.schedule.split(","))) + 20
    cmd = [os.path.join(BIN, "mpiexec"), "-n", "1", os.path.join(BIN, "vfgraph"), "-v", "train", model, "--data", data,
           "--steps", str(steps), "--batch-size", "1024", "-o", out, "--force", "--no-progress", "--threads", "1",
           "--max-ranks", str(a.max_ranks), "--elastic-schedule", a.schedule]
    env = {**os.environ, "PYTHONPATH": ROOT, "TF_CPP_MIN_LOG_LEVEL": "2", "TF_ENABLE_ONEDNN_OPTS": "0",
           "OMP_NUM_THREADS": "1"}
    res = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if res.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{res.stderr[-3000:]}")
    changes = [{"from": int(a_), "to": int(b_), "step": int(s), "waited_s": float(w),
                "spawn_s": float(sp) if sp else None, "change_s": float(c)}
               for a_, b_, s, w, sp, c in re.findall(
                   r"resized (\d+) -> (\d+) ranks at step (\d+): ([\d.e-]+) s waiting for new ranks to load the "
                   r"model(?: \(they started in ([\d.e-]+) s, beside the training\))?, then ([\d.e-]+) s to change",
                   res.stderr)]
    joined = [{"rank": int(r), "step": int(s), "startup_s": float(t)} for r, s, t in
              re.findall(r"rank (\d+) joined at step (\d+), ([\d.e-]+) s after its command began", res.stderr)]
    step = re.search(r"took ([\d.]+) ms each \(median\)", res.stderr)
    return {"changes": changes, "joined": joined, "median_step_ms": float(step.group(1)) if step else None}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", default="", help="write the report here")
    p.add_argument("--schedule", default="0:1,250:2,650:4,700:2")
    p.add_argument("--max-ranks", type=int, default=4)
    p.add_argument("--rounds", type=int, default=2)
    a = p.parse_args()
    import export

    import vfgraph

    runs = []
    with tempfile.TemporaryDirectory(prefix="vfgraph-bench-") as tmp:
        export.digits_data(tmp)
        export.digits_mlp(os.path.join(tmp, "mlp"), optimizer="adam", lr=0.01, hidden=4096)
        model = os.path.join(tmp, "mlp_v16")
        vfgraph.save(vfgraph.rewrite(os.path.join(tmp, "mlp"), vnodes=16, vnode_batch=64, allreduce="mpi"), model)
        for r in range(a.rounds):
            got = run(model, os.path.join(tmp, "train.npz"), os.path.join(tmp, "out"), a)
            runs.append(got)
            for c in got["changes"]:
                print(f"round {r + 1}: {c['from']} -> {c['to']} at step {c['step']}: waited {c['waited_s']:.3g} s, "
                      f"change {c['change_s'] * 1e3:.1f} ms" + (f", spawn {c['spawn_s']:.3g} s beside the training"
                                                               if c["spawn_s"] is not None else ""), flush=True)
            for j in got["joined"]:
                print(f"round {r + 1}: rank {j['rank']} joined at step {j['step']}, {j['startup_s']:.3g} s after its "
                      "command began", flush=True)
    worst = max(c["change_s"] for x in runs for c in x["changes"])
    print(f"\nlongest change: {worst * 1e3:.1f} ms (target <= 1000 ms)")
    if a.json:
        write_report(a.json, {"benchmark": "elastic", "git": git_state(), "machine": platform.machine(),
                              "cpus": os.cpu_count(), "schedule": a.schedule, "max_ranks": a.max_ranks,
                              "model": "digits MLP, 4096 hidden units, Adam; V=16 virtual nodes of 64 examples",
                              "rounds": a.rounds, "runs": runs, "longest_change_s": worst})


if __name__ == "__main__":
    main()
