"""Input read by virtual node: what `vfgraph train` costs against the data's size, and against
data in memory.

1. Memory and start-up against the data's size: `mpiexec -n 2 vfgraph train` for --steps 20
   of --batch-size 64 on the digits MLP (V=8 virtual nodes of 8, the all-reduce), from 10
   TFRecord shards of N examples of 64 float features and an int64 label, for each N of
   --sizes (default 100k and 1M). Per rank: peak resident memory (VmHWM at exit), time from
   the launch to the end of the first step, the examples and bytes the rank read against its
   share (20 steps x its 32 rows); and the run's wall time. Targets: the largest data's peak
   within 1.15x of the smallest's, its wall time within 1.5x.
2. Steps/s from TFRecord against the same data in memory (.npz): the digits CNN (V=8 of 8,
   the all-reduce) at 2 ranks, --cnn-steps of 64, the median step time after the first as
   `vfgraph train -v` logs it (the step's time includes waiting for its input), runs
   alternating over --rounds. Target: TFRecord / .npz >= 0.95.

The data sets are written under --tmp (1M examples take about 300 MB) and deleted after.

    python tools/bench_input.py [--sizes 100000,1000000] [--json docs/results/bench_input.json]
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

from benchlib import ROOT, git_state, write_report

BIN = os.path.dirname(sys.executable)
MPIEXEC = os.path.join(BIN, "mpiexec")
ENV = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", TF_ENABLE_ONEDNN_OPTS="0", OMP_NUM_THREADS="1",
           PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
READ = re.compile(r"(?:rank (\d): )?read (\d+) examples \((\d+) bytes\) of the (\d+)")
SPEED = re.compile(r"took ([\d.e+-]+) ms each \(median\), ([\d.e+-]+) steps/s")


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="100000,1000000", help="examples of each TFRecord data set")
    p.add_argument("--shards", type=int, default=10)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--cnn-steps", type=int, default=300)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--tmp", default=tempfile.gettempdir(), help="where the data sets are written")
    p.add_argument("--json", default="/tmp/vfgraph_bench_input.json")
    p.add_argument("--child", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    return p.parse_args()


def child(argv) -> None:
    """One rank: `vfgraph train ARGV` in this process; its peak memory, the time its first step
    ended and its exit code go to $BENCH_OUT.RANK.json."""
    from vfgraph import cli
    from vfgraph.runtime import step

    first = []
    run = step.StepRunner.run

    def timed(self, *a, **k):
        out = run(self, *a, **k)
        if not first:
            first.append(time.time())
        return out

    step.StepRunner.run = timed
    try:
        code = cli.main(argv)
    except SystemExit as e:
        code = e.code
    from vfgraph.runtime.world import resident_bytes

    rank = int(os.environ.get("PMI_RANK", "0"))
    with open(f"{os.environ['BENCH_OUT']}.{rank}.json", "w") as f:
        json.dump({"rank": rank, "peak": resident_bytes("VmHWM"), "first_step_end": first[0] if first else None,
                   "code": code}, f)
    sys.exit(code)


def train(model: str, data: str, out: str, steps: int, ranks: int = 2) -> dict:
    """A `vfgraph train -v` run under mpiexec of this script's child: per-rank figures and the log."""
    marker = out + ".bench"
    cmd = [MPIEXEC, "-n", str(ranks), sys.executable, os.path.abspath(__file__), "--child", "-v", "train", model,
           "--data", data, "--steps", str(steps), "--batch-size", "64", "-o", out, "--no-progress", "--force"]
    began = time.time()
    # each rank runs as the worker itself (no supervising parent): its memory and first step are measured here
    env = dict(ENV, BENCH_OUT=marker, VFGRAPH_RANK_WORKER="1")
    res = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
    wall = time.time() - began
    if res.returncode:
        sys.exit(f"bench_input: training failed:\n{res.stderr[-3000:]}")
    ranks_out = []
    for path in sorted(glob.glob(marker + ".*.json")):
        with open(path) as f:
            r = json.load(f)
        os.remove(path)
        r["first_step_s"] = r.pop("first_step_end") - began
        ranks_out.append(r)
    reads = {int(r or 0): (int(n), int(b), int(total)) for r, n, b, total in READ.findall(res.stderr)}
    for r in ranks_out:
        r["examples_read"], r["bytes_read"], _ = reads.get(r["rank"], (None, None, None))
    speed = SPEED.search(res.stderr)
    shutil.rmtree(out, ignore_errors=True)
    shutil.rmtree(out + ".serving", ignore_errors=True)
    return {"wall_s": wall, "ranks": ranks_out, "step_ms": float(speed.group(1)) if speed else None,
            "steps_per_s": float(speed.group(2)) if speed else None}


def models(work: str) -> dict:
    """The digits MLP and CNN rewritten with 8 virtual nodes of 8 examples and the all-reduce."""
    import export

    import vfgraph

    out = {}
    for name, make in (("mlp", export.digits_mlp), ("cnn", export.digits_cnn)):
        original, rewritten = os.path.join(work, name), os.path.join(work, name + "_v8")
        make(original)
        vfgraph.save(vfgraph.rewrite(original, vnodes=8, vnode_batch=8, allreduce="mpi"), rewritten)
        out[name] = rewritten
    return out


def memory_runs(a, model: str, work: str) -> list:
    """Part 1: each data size's run."""
    import numpy as np

    from vfgraph.testing.records import write_tfrecords

    rows = []
    for n in [int(s) for s in a.sizes.split(",")]:
        root = os.path.join(a.tmp, f"vfgraph_bench_input_{n}")
        os.makedirs(root, exist_ok=True)
        try:
            rng = np.random.default_rng(0)
            for s in range(a.shards):  # (a shard at a time: the writer's memory stays small)
                part = n // a.shards + (s < n % a.shards)
                x, y = rng.random((part, 64), dtype=np.float32), rng.integers(0, 10, part)
                write_tfrecords(os.path.join(root, f"part{s:03d}"), x, y, shards=1)
            files = sorted(glob.glob(os.path.join(root, "*.tfrecord")))
            size = sum(os.path.getsize(f) for f in files)
            run = train(model, os.path.join(root, "*.tfrecord"), os.path.join(work, f"o{n}"), a.steps)
            record = size / n  # (every record the same size here)
            for r in run["ranks"]:
                r["share_examples"] = a.steps * 32
                r["share_bytes"] = int(a.steps * 32 * (record - 16))
            rows.append({"examples": n, "data_bytes": size, **run})
        finally:
            shutil.rmtree(root, ignore_errors=True)
        print(f"  {n} examples: wall {rows[-1]['wall_s']:.1f} s, peaks "
              f"{[round(r['peak'] / 2**20) for r in rows[-1]['ranks']]} MiB", flush=True)
    return rows


def speed_runs(a, model: str, work: str) -> dict:
    """Part 2: the digits CNN from TFRecord and from .npz, alternating."""
    import export
    import numpy as np

    from vfgraph.testing.records import write_tfrecords

    data = os.path.join(work, "digits")
    export.digits_data(data)
    with np.load(os.path.join(data, "train.npz")) as z:
        write_tfrecords(os.path.join(data, "train"), z["x"], z["y"], shards=a.shards)
    sources = {"npz": os.path.join(data, "train.npz"), "tfrecord": os.path.join(data, "train-*.tfrecord")}
    runs = {k: [] for k in sources}
    for i in range(a.rounds):
        for kind, path in sources.items():
            runs[kind].append(train(model, path, os.path.join(work, f"cnn_{kind}"), a.cnn_steps))
            print(f"  round {i + 1} {kind}: {runs[kind][-1]['steps_per_s']:.1f} steps/s", flush=True)
    med = {k: statistics.median(r["steps_per_s"] for r in v) for k, v in runs.items()}
    return {"runs": runs, "median_steps_per_s": med, "ratio": med["tfrecord"] / med["npz"]}


def show(report: dict) -> None:
    print(f"\n{'examples':>9} {'rank':>4} {'peak MiB':>9} {'first step s':>12} {'read':>7} {'share':>6} "
          f"{'bytes read':>11} {'share bytes':>11} {'wall s':>7}")
    for row in report["memory"]:
        for r in row["ranks"]:
            print(f"{row['examples']:>9} {r['rank']:>4} {r['peak'] / 2**20:>9.0f} {r['first_step_s']:>12.2f} "
                  f"{r['examples_read']:>7} {r['share_examples']:>6} {r['bytes_read']:>11} {r['share_bytes']:>11} "
                  f"{row['wall_s']:>7.1f}")
    print(f"peak ratio (largest / smallest data, worst rank): {report['peak_ratio']:.3f} (target <= 1.15); "
          f"wall ratio {report['wall_ratio']:.3f} (target <= 1.5)")
    s = report["speed"]
    print(f"digits CNN, 2 ranks: {s['median_steps_per_s']['tfrecord']:.1f} steps/s from TFRecord, "
          f"{s['median_steps_per_s']['npz']:.1f} from .npz: ratio {s['ratio']:.3f} (target >= 0.95)")


def main() -> None:
    a = parse_args()
    if a.child is not None:
        return child(a.child)
    work = tempfile.mkdtemp(prefix="vfgraph_bench_input_")
    try:
        made = models(work)
        print("memory and start-up against the data's size", flush=True)
        memory = memory_runs(a, made["mlp"], work)
        print("steps/s from TFRecord against .npz", flush=True)
        speed = speed_runs(a, made["cnn"], work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    peak = [max(r["peak"] for r in row["ranks"]) for row in memory]
    report = {"benchmark": "input", "steps": a.steps, "batch": 64, "shards": a.shards, "cnn_steps": a.cnn_steps,
              "rounds": a.rounds, "memory": memory, "speed": speed, "peak_ratio": peak[-1] / peak[0],
              "wall_ratio": memory[-1]["wall_s"] / memory[0]["wall_s"], "cpus": os.cpu_count(),
              "machine": platform.machine(), **git_state()}
    show(report)
    write_report(a.json, report)


if __name__ == "__main__":
    main()
