"""Pipeline memory: what a training step holds in tensors, beyond the variables, when the
model is cut into K=2 stages and run under the 1F1B and GPipe schedules, for M = 1, 2, 4, 8,
16 virtual nodes (the pipeline's micro-batches), against the unpartitioned step.

The model is tools/bench_pipeline.py's MLP. Each configuration runs in a fresh process under
TensorFlow's BFC allocator for the CPU (``TF_CPU_ALLOCATOR_USE_BFC=true``), whose counts give
the bytes held in tensors: a step's figure is the allocator's peak during the step less what
it held before the step (the variables, the inputs), the most of ``--steps`` steps after a
first. Configurations (as tools/bench_pipeline.py runs them):

  one-core     the unpartitioned rewrite in one process: one virtual node at a time
  1f1b, gpipe  the stages on two logical CPU devices of one process (both stages' tensors)
  ranks        the stages on 2 MPI ranks (``mpiexec -bind-to core -n 2``), 1F1B: each
               rank's own figure
  ranks-gpipe  the same under GPipe

A step holds, besides its variables, memory that does not grow with the examples of a virtual
node (the gradient sums, a virtual node's gradients) and memory that does (activations kept
for the backward, their gradients, messages in flight). The second is what the schedule
bounds: each configuration runs at two virtual-node batches b1 < b2 (``--vnode-batches``), and
its activation memory per example is (figure at b2 - figure at b1) / (b2 - b1). The batches
are large enough that the activations, not a virtual node's gradients, set the peak. In
virtual nodes held at once: that over the same configuration's (the same rank's) at M = 1,
where one virtual node is in flight. The target: under 1F1B, at most K virtual nodes'
activations at once, in one process and on each rank, at any M. Each process's peak resident
memory during the measured steps is reported too.

    python tools/bench_pipeline_memory.py [--quick] [--json docs/results/bench_pipeline_memory.json]
"""
from __future__ import annotations

import argparse
import os
import platform
import tempfile

from bench_pipeline import K, add_model_options, export_model, run_worker
from benchlib import git_state, write_report

MODES = ("one-core", "1f1b", "gpipe", "ranks", "ranks-gpipe")
MIB = float(1 << 20)


def per_process(report: dict) -> list:
    """A run's figures per process (a run on ranks reports each rank's)."""
    return report.get("ranks", [report])


def analyse(results: list, b1: int, b2: int) -> dict:
    """Per configuration and process, at each M: the step's tensor memory at each batch, its
    activation memory per example, and that in virtual nodes (over its own at M = 1)."""
    out = {}
    for mode in MODES:
        out[mode] = []
        for p in range(len(per_process(results[0][mode][str(b1)]))):
            at = {b: [per_process(row[mode][str(b)])[p] for row in results] for b in (b1, b2)}
            per_example = [(y["step_tensor_bytes"] - x["step_tensor_bytes"]) / (b2 - b1)
                           for x, y in zip(at[b1], at[b2])]
            out[mode].append({
                "step_tensor_bytes": {str(b): [x["step_tensor_bytes"] for x in at[b]] for b in (b1, b2)},
                "peak_rss_bytes": {str(b): [x["peak_rss_bytes"] for x in at[b]] for b in (b1, b2)},
                "activation_bytes_per_example": per_example,
                "held_vnodes": [e / per_example[0] for e in per_example]})
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="M = 1, 2, 8 only")
    p.add_argument("--json", default="", help="write the report here")
    add_model_options(p)
    p.add_argument("--vnode-batches", default="1024,4096", help="the two virtual-node batches b1,b2")
    p.add_argument("--steps", type=int, default=6)
    a = p.parse_args()
    a.inputs = a.inputs or a.width * 2
    b1, b2 = sorted(int(b) for b in a.vnode_batches.split(","))
    counts = [1, 2, 8] if a.quick else [1, 2, 4, 8, 16]
    import tensorflow as tf

    import vfgraph

    tmp = tempfile.mkdtemp(prefix="bench_pipeline_memory_")
    src = os.path.join(tmp, "mlp")
    export_model(src, a.layers, a.width, inputs=a.inputs)
    env = {"TF_CPU_ALLOCATOR_USE_BFC": "true"}
    results = []
    for m in counts:
        row = {"vnodes": m}
        for mode in MODES:
            ranks = mode.startswith("ranks")
            kw = {} if mode == "one-core" else dict(stages=K, schedule="gpipe" if "gpipe" in mode else "1f1b")
            if mode in ("1f1b", "gpipe"):
                kw["devices"] = [f"/CPU:{i}" for i in range(K)]
            row[mode] = {}
            for b in (b1, b2):
                path = os.path.join(tmp, f"{mode}_{m}_{b}")
                vfgraph.save(vfgraph.rewrite(src, vnodes=m, vnode_batch=b, allreduce="mpi" if ranks else "none",
                                             **kw), path)
                row[mode][str(b)] = run_worker(path, mode, m, argparse.Namespace(**{**vars(a), "vnode_batch": b}),
                                               env)
        results.append(row)
        print(f"M={m:>2}: " + ", ".join(f"{mode} " + " | ".join(
            "/".join(f"{x['step_tensor_bytes'] / MIB:.1f}" for x in per_process(row[mode][str(b)])) for b in (b1, b2))
            for mode in MODES) + f" MiB (b = {b1} | {b2})")
    summary = analyse(results, b1, b2)
    print(f"\nactivation memory per example (KiB), and in virtual nodes held at once:\n"
          f"{'configuration':<14} {'process':>7} " + " ".join(f"{'M=' + str(m):>14}" for m in counts))
    for mode in MODES:
        for i, x in enumerate(summary[mode]):
            print(f"{mode:<14} {i:>7} " + " ".join(
                f"{e / 1024:>7.1f} ({h:>4.2f})" for e, h in zip(x["activation_bytes_per_example"], x["held_vnodes"])))
    worst = max(h for mode in ("1f1b", "ranks") for x in summary[mode] for h in x["held_vnodes"])
    print(f"\n1F1B: at most {worst:.2f} virtual nodes' activations held at once (target <= K = {K})")
    if a.json:
        write_report(a.json, {
            "config": {"layers": a.layers, "width": a.width, "inputs": a.inputs, "vnode_batches": [b1, b2],
                       "stages": K, "steps": a.steps, "vnodes": counts, "quick": a.quick,
                       "tensorflow": tf.__version__, "cpu_count": os.cpu_count(),
                       "python": platform.python_version(), "git": git_state()},
            "results": results, "summary": summary, "max_held_1f1b": worst})


if __name__ == "__main__":
    main()
