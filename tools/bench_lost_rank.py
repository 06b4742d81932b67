"""Elastic runs that lose a rank: how often the job survives a rank killed at a random moment,
how long the ranks left take to train on, and whether the result is still the uninterrupted
one.

One ``vfgraph train`` job under ``mpiexec -n 1`` per trial, on the digits MLP with Adam
rewritten in deterministic mode (V=8 virtual nodes of 8 examples), one thread per rank, grows
on its schedule; a moment drawn uniformly from ``--after`` seconds after the last growth, the
rank of the last start of new ranks is killed (SIGKILL). Layouts: ``2`` (schedule 0:1,2:2:
rank 0 goes on alone) and ``3`` (0:1,2:2,4:3: the rank of the first start comes back and trains
on with rank 0). A trial survives when the job ends with status 0 after logging that it went
on; its result is compared, bit for bit, with the same model trained on one rank. Reported per
trial: the moment of the kill, the step lost, the seconds from the loss seen to training on
(as the job logs them), and whether the job grew back.

    python tools/bench_lost_rank.py [--trials 6] [--layouts 2,3] [--json PATH]
"""
from __future__ import annotations

import argparse
import os
import platform
import random
import re
import signal
import subprocess
import sys
import tempfile
import time

import numpy as np

from benchlib import ROOT, git_state, write_report

BIN = os.path.dirname(sys.executable)
SCHEDULES = {2: "0:1,2:2", 3: "0:1,2:2,4:3"}
ENV = {**os.environ, "PYTHONPATH": ROOT, "TF_CPP_MIN_LOG_LEVEL": "2", "TF_ENABLE_ONEDNN_OPTS": "0",
       "OMP_NUM_THREADS": "1"}


def train_cmd(model: str, data: str, out: str, steps: int, *extra: str) -> list:
    return [os.path.join(BIN, "mpiexec"), "-n", "1", os.path.join(BIN, "vfgraph"), "-v", "train", model, "--data",
            data, "--steps", str(steps), "--batch-size", "64", "-o", out, "--force", "--no-progress", "--threads", "1",
            *extra]


def joined_rank(out: str, group: int) -> list:
    """The pids of the ranks of the ``group``-th start of new ranks of the job writing ``out``."""
    found = []
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                args = f.read().decode(errors="replace").split("\0")
            with open(f"/proc/{entry}/environ", "rb") as f:
                env = f.read().split(b"\0")
        except (ValueError, OSError):
            continue
        if "--elastic-join" in args and out in args and "vfgraph.cli" in args[1:3] \
                and f"VFGRAPH_ELASTIC_GROUP={group}".encode() in env:
            found.append(int(entry))
    return found


def variables(out: str) -> dict:
    import tensorflow as tf

    reader = tf.train.load_checkpoint(os.path.join(out, "variables", "variables"))
    return {k: reader.get_tensor(k) for k in reader.get_variable_to_shape_map()}


def trial(model: str, data: str, out: str, steps: int, layout: int, after: tuple, rng: random.Random) -> dict:
    cmd = train_cmd(model, data, out, steps, "--max-ranks", str(layout), "--elastic-schedule", SCHEDULES[layout])
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, env=ENV)
    lines = []
    for line in proc.stderr:
        lines.append(line)
        if f"resized {layout - 1} -> {layout} ranks" in line:
            break
    delay = rng.uniform(*after)
    time.sleep(delay)
    for pid in joined_rank(out, layout - 1):
        os.kill(pid, signal.SIGKILL)
    lines.extend(proc.stderr)
    proc.wait()
    text = "".join(lines)
    went_on = re.search(r"ended with status \d+ at step (\d+); the job goes on (alone|with \d+ ranks) from step (\d+)"
                        r".*\(([\d.e-]+) s after the loss was seen\)", text)
    survived = proc.returncode == 0 and went_on is not None
    return {"layout": layout, "kill_after_s": round(delay, 3), "exit": proc.returncode, "survived": survived,
            "lost_at_step": int(went_on.group(1)) if went_on else None,
            "went_on": went_on.group(2) if went_on else None,
            "from_step": int(went_on.group(3)) if went_on else None,
            "recovery_s": float(went_on.group(4)) if went_on else None,
            "grew_back": bool(went_on) and f"-> {layout} ranks" in text[went_on.end():],
            "log_tail": "" if survived else text[-2000:]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", default="", help="write the report here")
    p.add_argument("--trials", type=int, default=6, help="trials per layout")
    p.add_argument("--layouts", default="2,3")
    p.add_argument("--steps", type=int, default=6000)
    p.add_argument("--after", default="0.25,3", help="the kill's moment: uniform between these seconds after the "
                   "last growth")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    import export

    import vfgraph

    rng = random.Random(a.seed)
    after = tuple(float(x) for x in a.after.split(","))
    layouts = [int(x) for x in a.layouts.split(",")]
    trials = []
    with tempfile.TemporaryDirectory(prefix="vfgraph-bench-") as tmp:
        export.digits_data(tmp)
        export.digits_mlp(os.path.join(tmp, "mlp"), optimizer="adam", lr=0.01)
        model = os.path.join(tmp, "mlp_v8")
        vfgraph.save(vfgraph.rewrite(os.path.join(tmp, "mlp"), vnodes=8, vnode_batch=8, allreduce="mpi",
                                     deterministic=True), model)
        data = os.path.join(tmp, "train.npz")
        one = os.path.join(tmp, "one")
        res = subprocess.run(train_cmd(model, data, one, a.steps), capture_output=True, text=True, env=ENV)
        if res.returncode:
            raise SystemExit(f"the one-rank reference failed:\n{res.stderr[-3000:]}")
        reference = variables(one)
        for layout in layouts:
            for t in range(a.trials):
                out = os.path.join(tmp, f"out{layout}_{t}")
                got = trial(model, data, out, a.steps, layout, after, rng)
                got["same_result"] = got["survived"] and all(
                    np.array_equal(v, variables(out)[k]) for k, v in reference.items())
                trials.append(got)
                rec = f"{got['recovery_s']:.3g} s" if got["recovery_s"] is not None else "-"
                print(f"{layout} ranks, kill {got['kill_after_s']:.2f} s after the growth: exit {got['exit']}, "
                      f"{'survived' if got['survived'] else 'NOT survived'} (went on {got['went_on'] or '-'} from "
                      f"step {got['from_step']}, {rec}), grew back {got['grew_back']}, same result "
                      f"{got['same_result']}", flush=True)
    summary = {str(n): {"trials": sum(t["layout"] == n for t in trials),
                        "survived": sum(t["survived"] for t in trials if t["layout"] == n),
                        "same_result": sum(t["same_result"] for t in trials if t["layout"] == n),
                        "recovery_s": [t["recovery_s"] for t in trials if t["layout"] == n and t["survived"]]}
               for n in layouts}
    print()
    print(f"{'ranks':>5}  {'trials':>6}  {'survived':>8}  {'same result':>11}  recovery (s)")
    for n, s in summary.items():
        r = s["recovery_s"]
        span = f"{min(r):.3g}-{max(r):.3g}" if r else "-"
        print(f"{n:>5}  {s['trials']:>6}  {s['survived']:>8}  {s['same_result']:>11}  {span}")
    if a.json:
        write_report(a.json, {"benchmark": "lost-rank", "git": git_state(), "machine": platform.machine(),
                              "cpus": os.cpu_count(), "steps": a.steps, "after_s": list(after), "seed": a.seed,
                              "model": "digits MLP, Adam, deterministic; V=8 virtual nodes of 8 examples",
                              "schedules": {str(n): SCHEDULES[n] for n in layouts}, "trials": trials,
                              "summary": summary})


if __name__ == "__main__":
    main()
