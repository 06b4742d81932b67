"""Elastic scheduling: job completion times of a trace of training jobs on a fixed number of
slots (one rank each), with static allocation against elastic allocation, replayed on step
times measured from real ``vfgraph train`` runs at each rank count.

- Static: each job runs on the ranks it asked for, first come first served; a job waits until
  that many slots are free.
- Elastic: at every arrival and completion the slots are shared again: every job in the system
  gets one slot in arrival order while slots last (a job waits only when there are more jobs
  than slots), and each remaining slot goes to the job it speeds up most (the largest cut in
  its remaining time), at the rank counts the profile has. A job whose rank count changes
  stops for ``--resize-stall`` seconds. Jobs keep their global batch and hyperparameters (the
  virtual nodes are redistributed), so a job needs the same steps on any number of ranks.

The profile gives each model's seconds per step at each rank count: ``--measure`` times the
models below with ``vfgraph train`` under ``mpiexec`` (median step after the first) at 1 and 2
ranks (the ranks this machine's CPUs hold), or ``--profile FILE`` reads one. The trace is
``--jobs`` jobs arriving as a Poisson process (``--interarrival`` mean seconds, seeded), each a
random model, step count and requested rank count.

    python tools/elastic_sched.py --measure [--json docs/results/elastic_sched.json]
"""
from __future__ import annotations

import argparse
import os
import platform
import random
import re
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from typing import Dict, List, Optional

BIN = os.path.dirname(sys.executable)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

Profile = Dict[str, Dict[int, float]]  # model -> ranks -> seconds per step


@dataclass
class Job:
    id: int
    model: str
    arrival: float
    steps: int
    ranks: int  # what it asks for under static allocation
    done_steps: float = 0.0
    start: Optional[float] = None
    end: Optional[float] = None
    alloc: int = 0
    stalled_until: float = 0.0
    resizes: int = 0


@dataclass
class Result:
    policy: str
    jobs: List[Job] = field(default_factory=list)

    @property
    def jct(self) -> List[float]:
        return [j.end - j.arrival for j in self.jobs]

    def summary(self) -> dict:
        jct = self.jct
        return {"policy": self.policy, "mean_jct_s": statistics.mean(jct), "median_jct_s": statistics.median(jct),
                "makespan_s": max(j.end for j in self.jobs) - min(j.arrival for j in self.jobs),
                "resizes": sum(j.resizes for j in self.jobs)}


def trace(models: List[str], jobs: int, interarrival: float, steps: List[int], ranks: List[int],
          seed: int) -> List[Job]:
    rng = random.Random(seed)
    t, out = 0.0, []
    for i in range(jobs):
        out.append(Job(i, rng.choice(models), t, rng.choice(steps), rng.choice(ranks)))
        t += rng.expovariate(1.0 / interarrival)
    return out


def _fresh(jobs: List[Job]) -> List[Job]:
    return [Job(j.id, j.model, j.arrival, j.steps, j.ranks) for j in jobs]


def _advance(running: List[Job], profile: Profile, now: float, until: float) -> None:
    """Progress every running job from ``now`` to ``until`` at its allocation's speed."""
    for j in running:
        begin = max(now, j.stalled_until)
        if until > begin:
            j.done_steps = min(j.steps, j.done_steps + (until - begin) / profile[j.model][j.alloc])


def _finish_time(j: Job, profile: Profile, now: float) -> float:
    return max(now, j.stalled_until) + (j.steps - j.done_steps) * profile[j.model][j.alloc]


def simulate(jobs: List[Job], profile: Profile, slots: int, policy: str, resize_stall: float = 1.0) -> Result:
    """Replay ``jobs`` on ``slots`` slots under ``policy`` ("static" or "elastic")."""
    jobs = _fresh(jobs)
    for j in jobs:
        counts = sorted(profile[j.model])
        if policy == "static" and (j.ranks not in profile[j.model] or j.ranks > slots):
            raise ValueError(f"job {j.id} asks for {j.ranks} ranks; the profile of {j.model} has {counts}")
    pending = sorted(jobs, key=lambda j: (j.arrival, j.id))
    waiting: List[Job] = []
    running: List[Job] = []
    now = 0.0
    while pending or waiting or running:
        # the next event: an arrival or the first completion
        next_arrival = pending[0].arrival if pending else float("inf")
        next_finish = min((_finish_time(j, profile, now), j.id) for j in running)[0] if running else float("inf")
        until = min(next_arrival, next_finish)
        _advance(running, profile, now, until)
        now = until
        for j in [j for j in running if j.done_steps >= j.steps - 1e-9]:
            j.end, j.alloc = now, 0
            running.remove(j)
        while pending and pending[0].arrival <= now:
            waiting.append(pending.pop(0))
        if policy == "static":
            free = slots - sum(j.alloc for j in running)
            while waiting and waiting[0].ranks <= free:  # first come first served
                j = waiting.pop(0)
                j.alloc, j.start = j.ranks, now
                free -= j.ranks
                running.append(j)
        else:
            _share(running, waiting, profile, slots, now, resize_stall)
    return Result(policy, sorted(jobs, key=lambda j: j.id))


def _share(running: List[Job], waiting: List[Job], profile: Profile, slots: int, now: float, stall: float) -> None:
    """Elastic allocation at an event: one slot per job in arrival order while slots last, then
    each remaining slot to the job whose remaining time it cuts most."""
    # (running jobs arrived before waiting ones: a later arrival never takes an earlier job's slot)
    jobs = sorted(running + waiting, key=lambda j: (j.arrival, j.id))[:slots]
    alloc = {j.id: 1 for j in jobs}
    left = slots - len(jobs)

    def remaining(j: Job, k: int) -> float:
        return (j.steps - j.done_steps) * profile[j.model][k]

    while left > 0:
        best = None
        for j in jobs:
            k = alloc[j.id]
            bigger = [c for c in sorted(profile[j.model]) if c > k and c - k <= left]
            if not bigger:
                continue
            c = bigger[0]
            gain = (remaining(j, k) - remaining(j, c)) / (c - k)  # seconds saved per extra slot
            if gain > 0 and (best is None or gain > best[0]):
                best = (gain, j, c)
        if best is None:
            break
        _, j, c = best
        left -= c - alloc[j.id]
        alloc[j.id] = c
    for j in jobs:
        if j in waiting:
            waiting.remove(j)
            running.append(j)
            j.start = now
        elif alloc[j.id] != j.alloc:  # a running job resized: it stops for the state transfer
            j.stalled_until = max(now, j.stalled_until) + stall
            j.resizes += 1
        j.alloc = alloc[j.id]


# ---------------------------------------------------------------------------------------------- measuring

MODELS = {"mlp": "digits MLP, 512 hidden units, Adam", "conv": "digits CNN, two 3x3 convolutions of 32 filters"}


def measure(ranks: List[int], steps: int, batch: int) -> Profile:
    """Seconds per step of each model at each rank count, from ``vfgraph train -v``'s log."""
    sys.path.insert(0, os.path.join(ROOT, "examples"))
    sys.path.insert(0, os.path.join(ROOT, "tools"))
    import export
    from bench_heterogeneous import conv_model

    import vfgraph

    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", "TF_ENABLE_ONEDNN_OPTS": "0", "OMP_NUM_THREADS": "1"}
    profile: Profile = {}
    with tempfile.TemporaryDirectory(prefix="vfgraph-sched-") as tmp:
        export.digits_data(tmp)
        data = os.path.join(tmp, "train.npz")
        export.digits_mlp(os.path.join(tmp, "mlp"), optimizer="adam", lr=0.01, hidden=512)
        conv_model(os.path.join(tmp, "conv"))
        for name in MODELS:
            model = os.path.join(tmp, f"{name}_v16")
            vfgraph.save(vfgraph.rewrite(os.path.join(tmp, name), vnodes=16, vnode_batch=batch // 16,
                                         allreduce="mpi"), model)
            profile[name] = {}
            for k in ranks:
                cmd = [os.path.join(BIN, "mpiexec"), "-n", str(k), os.path.join(BIN, "vfgraph"), "-v", "train", model,
                       "--data", data, "--steps", str(steps), "--batch-size", str(batch), "-o",
                       os.path.join(tmp, "out"), "--force", "--no-progress"]
                res = subprocess.run(cmd, capture_output=True, text=True, env=env)
                got = re.search(r"took ([\d.]+) ms each \(median\)", res.stderr)
                if res.returncode or not got:
                    raise SystemExit(f"{' '.join(cmd)} failed:\n{res.stderr[-3000:]}")
                profile[name][k] = float(got.group(1)) / 1e3
                print(f"{name:<5} {k} rank(s): {profile[name][k] * 1e3:.2f} ms per step", flush=True)
    return profile


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--measure", action="store_true", help="time the models at 1 and 2 ranks first")
    source.add_argument("--profile", help="JSON: {model: {ranks: seconds per step}} (or a report of this tool)")
    p.add_argument("--slots", type=int, default=2)
    p.add_argument("--jobs", type=int, default=40)
    p.add_argument("--interarrival", type=float, default=0.0, help="mean seconds between arrivals (default: "
                   "the mean job's one-slot run time, a loaded cluster)")
    p.add_argument("--steps", default="500,1000,2000,4000", help="job lengths in steps to draw from")
    p.add_argument("--resize-stall", default="0,1,5", help="seconds a job stops when its ranks change (a list: "
                   "one elastic replay each; default 0,1,5)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default="", help="write the report here")
    a = p.parse_args()
    import json

    if a.measure:
        profile = measure([1, 2], steps=40, batch=1024)
    else:
        with open(a.profile) as f:
            raw = json.load(f)
        raw = raw.get("profile", raw)
        profile = {m: {int(k): float(v) for k, v in times.items()} for m, times in raw.items()}
    counts = sorted({k for times in profile.values() for k in times if k <= a.slots})
    lengths = [int(s) for s in a.steps.split(",")]
    one_slot = statistics.mean(profile[m][min(profile[m])] for m in profile) * statistics.mean(lengths)
    interarrival = a.interarrival or one_slot
    jobs = trace(sorted(profile), a.jobs, interarrival, lengths, counts, a.seed)
    stalls = [float(x) for x in a.resize_stall.split(",")]
    static = simulate(jobs, profile, a.slots, "static").summary()
    results = [static]
    for stall in stalls:
        r = simulate(jobs, profile, a.slots, "elastic", stall).summary()
        r["policy"], r["resize_stall_s"] = f"elastic, {stall:g} s per resize", stall
        r["reduction"] = 1 - r["mean_jct_s"] / static["mean_jct_s"]
        results.append(r)
    print(f"\n{a.jobs} jobs on {a.slots} slots, mean interarrival {interarrival:.1f} s\n\n"
          "| policy | mean JCT | median JCT | makespan | resizes | mean JCT cut |\n|---|---|---|---|---|---|")
    for r in results:
        cut = f"{r['reduction']:.1%}" if "reduction" in r else ""
        print(f"| {r['policy']} | {r['mean_jct_s']:.1f} s | {r['median_jct_s']:.1f} s | {r['makespan_s']:.1f} s | "
              f"{r['resizes']} | {cut} |")
    if a.json:
        sys.path.insert(0, os.path.join(ROOT, "tools"))
        from benchlib import git_state, write_report

        write_report(a.json, {"benchmark": "elastic-scheduling", "git": git_state(), "machine": platform.machine(),
                              "cpus": os.cpu_count(), "slots": a.slots, "jobs": a.jobs, "interarrival_s": interarrival,
                              "steps": lengths, "seed": a.seed,
                              "profile": {m: {str(k): v for k, v in t.items()} for m, t in profile.items()},
                              "models": MODELS, "results": results})


if __name__ == "__main__":
    main()
