"""Pipeline stages on two MPI ranks, this tree against a baseline checkout of vfgraph, in one
run: does the way the ops wait for a message or a collective cost the pipeline anything?

The MPI ops' waits back off (a wait yields, then sleeps up to 1 ms) and are watched (stall
warnings, stop requests), where they used to spin. A balanced pipeline's ranks wait briefly and
often, so this is where backing off could cost. The model is tools/bench_pipeline.py's MLP,
rewritten by each tree with ``--stages 2`` (1F1B), each stage on a rank bound to a core of its
own, as ``vfgraph train`` runs it; bench_pipeline's worker of each tree times the step (the
slower rank's median). Rounds alternate between the trees, so the machine's load moves both
alike; the report is the median round of each and the ratio this tree / baseline (1.00: the
same; the target is within 5%).

    git worktree add --detach /tmp/vf-baseline 461bfeb   # the commit before the backoff
    ln -s ../rewrites /tmp/vf-baseline/vfgraph/rewrites   # (the package's layout, as installed)
    python tools/bench_wait_backoff.py --baseline /tmp/vf-baseline [--json docs/results/bench_wait_backoff.json]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

from benchlib import ROOT, git_state, write_report
from bench_pipeline import K, export_model

REWRITE = ("import sys, vfgraph; vfgraph.save(vfgraph.rewrite(sys.argv[1], vnodes=int(sys.argv[3]), "
           "vnode_batch=int(sys.argv[4]), stages=2, allreduce='mpi'), sys.argv[2])")


def _env(tree: str) -> dict:
    return {**os.environ, "PYTHONPATH": tree, "TF_CPP_MIN_LOG_LEVEL": "2", "TF_ENABLE_ONEDNN_OPTS": "0"}


def rewrite(tree: str, src: str, out: str, vnodes: int, b: int) -> None:
    """``src`` rewritten by the vfgraph of ``tree`` into ``out``."""
    res = subprocess.run([sys.executable, "-c", REWRITE, src, out, str(vnodes), str(b)], capture_output=True,
                         text=True, cwd=tree, env=_env(tree))
    if res.returncode:
        raise SystemExit(f"rewrite by {tree} failed:\n{res.stderr[-3000:]}")


def step(tree: str, model: str, vnodes: int, a) -> float:
    """The slower rank's median step of ``model`` on 2 ranks, timed by ``tree``'s worker."""
    mpiexec = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    cmd = [mpiexec, "-bind-to", "core", "-n", str(K), sys.executable, os.path.join(tree, "tools", "bench_pipeline.py"),
           "--worker", "--model", model, "--mode", "ranks", "--vnodes", str(vnodes), "--vnode-batch", str(a.vnode_batch),
           "--width", str(a.width), "--inputs", str(a.inputs), "--steps", str(a.steps)]
    res = subprocess.run(cmd, capture_output=True, text=True, cwd=tree, env=_env(tree), timeout=900)
    if res.returncode:
        raise SystemExit(f"{tree} M={vnodes} failed:\n{res.stderr[-3000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])["step_s"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--baseline", required=True, help="a checkout of the vfgraph to compare with")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--vnode-batch", type=int, default=256)
    p.add_argument("--vnodes", default="2,8", help="virtual nodes per step (comma-separated)")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--json", default="")
    a = p.parse_args()
    a.inputs = 2 * a.width
    trees = {"baseline": os.path.abspath(a.baseline), "this": ROOT}
    tmp = tempfile.mkdtemp(prefix="bench_wait_backoff_")
    src = os.path.join(tmp, "mlp")
    export_model(src, a.layers, a.width, inputs=a.inputs)
    rows = []
    print(f"{'M':>3} {'baseline s':>10} {'this s':>8} {'this / baseline':>16}   rounds (baseline | this)")
    for m in (int(v) for v in a.vnodes.split(",")):
        models = {name: os.path.join(tmp, f"{name}_{m}") for name in trees}
        for name, tree in trees.items():
            rewrite(tree, src, models[name], m, a.vnode_batch)
        runs = {name: [] for name in trees}
        for _ in range(a.rounds):
            for name, tree in trees.items():
                runs[name].append(step(tree, models[name], m, a))
        med = {name: statistics.median(r) for name, r in runs.items()}
        rows.append({"vnodes": m, "baseline_step_s": med["baseline"], "this_step_s": med["this"],
                     "ratio": med["this"] / med["baseline"], "rounds": runs})
        print(f"{m:>3} {med['baseline']:>10.4f} {med['this']:>8.4f} {med['this'] / med['baseline']:>16.3f}   "
              f"{' '.join(f'{t:.4f}' for t in runs['baseline'])} | {' '.join(f'{t:.4f}' for t in runs['this'])}")
    if a.json:
        base = subprocess.run(["git", "-C", trees["baseline"], "rev-parse", "HEAD"], capture_output=True,
                              text=True).stdout.strip()
        write_report(a.json, {"config": {"layers": a.layers, "width": a.width, "inputs": a.inputs,
                                         "vnode_batch": a.vnode_batch, "steps": a.steps, "rounds": a.rounds,
                                         "stages": K, "cpu_count": os.cpu_count(), "git": git_state(),
                                         "baseline": base},
                              "results": rows})


if __name__ == "__main__":
    main()
