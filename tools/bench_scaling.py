"""Data-parallel scaling and all-reduce fusion, measured under mpiexec in one invocation.

scaling  The digits MLP (hidden width --hidden, default 1024) and the batch-norm digits
         CNN of examples/export.py, rewritten with virtual nodes of b examples (--vnode-batch,
         default 16 and 64) and the all-reduce, trained at each global batch of --batch
         (default 128, 512 and 2048: 8, 32 and 128 virtual nodes of 16) with one TensorFlow
         thread per process (intra- and inter-op, as ``vfgraph train --threads 1``):
         examples/s on 2 ranks (half the virtual nodes each) against 1 rank, both launched
         with ``mpiexec`` by this script. Target: ratio >= 1.8. Also 2 ranks running the
         model rewritten without the all-reduce (each trains on its half alone): the ratio the
         machine allows with no communication, so the gap between the two is what summing
         the gradients costs. Each configuration
         runs --rounds times, interleaved with the others; the best run of each is kept.
fusion   The gradients of keras.applications.ResNet50 (weights=None, 10 classes: 161 tensors,
         23.6M parameters) summed over 2 ranks by insert-allreduce's reduce function, fused
         into buffers of at most 1, 4, 16 and 64 MiB against one all-reduce per tensor (a buffer
         limit of one byte), in the same processes. Reported as ratios.

    python tools/bench_scaling.py [--quick] [--json PATH]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

from benchlib import git_state, write_report

FUSION_MB = (1, 4, 16, 64)
MPIEXEC = os.path.join(os.path.dirname(sys.executable), "mpiexec")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="fewer steps and repetitions")
    p.add_argument("--json", default="/tmp/vfgraph_bench_scaling.json")
    p.add_argument("--hidden", type=int, default=1024, help="MLP hidden width")
    p.add_argument("--batch", default="128,512,2048", help="global batches, comma-separated (multiples of 32)")
    p.add_argument("--vnode-batch", default="16,64",
                   help="examples per virtual node, comma-separated (each global batch divides into 2x as many)")
    p.add_argument("--models", default="mlp,cnn", help="models to scale, comma-separated (mlp, cnn)")
    p.add_argument("--rounds", type=int, default=3, help="interleaved repetitions of each configuration (best kept)")
    p.add_argument("--no-fusion", action="store_true", help="skip the fusion measurement")
    p.add_argument("--worker", choices=("scaling", "fusion"), help=argparse.SUPPRESS)
    p.add_argument("--model", help=argparse.SUPPRESS)
    p.add_argument("--data", help=argparse.SUPPRESS)
    p.add_argument("--steps", type=int, default=60, help=argparse.SUPPRESS)
    p.add_argument("--reps", type=int, default=5, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def worker_scaling(args) -> dict:
    """Time training steps of ``args.model`` on this rank's share of a global batch."""
    import numpy as np

    import vfgraph  # noqa: F401  (registers the ops)
    from vfgraph.runtime.train import load_npz
    from vfgraph.runtime.world import place_threads, shares, world

    w = world(need_mpi=True)
    place_threads(w, 1)  # what ``vfgraph train --threads 1`` does: one intra-op and one inter-op thread
    import tensorflow as tf

    loaded = tf.saved_model.load(args.model)
    fn = loaded.signatures["train"]
    data = load_npz(args.data)
    b = int(args.vnode_batch)
    per = shares(int(args.batch) // b, w.size)
    lo, hi = sum(per[:w.rank]) * b, sum(per[:w.rank + 1]) * b
    rows = np.arange(lo, hi) % len(data["x"])  # a global batch larger than the data set wraps around it
    feed = {"x": tf.constant(data["x"][rows].astype(np.float32)), "y": tf.constant(data["y"][rows].astype(np.int32))}
    if w.size > 1 and "train_broadcast" in loaded.signatures:
        loaded.signatures["train_broadcast"]()
    for _ in range(5):
        fn(**feed)
    times = []
    for _ in range(args.reps):
        w.comm.Barrier()
        t = time.perf_counter()
        for _ in range(args.steps):
            out = fn(**feed)
        float(out["loss"])
        times.append(w.comm.allreduce(time.perf_counter() - t, op=_max()))
    return {"ranks": w.size, "examples_per_s": int(args.batch) * args.steps / statistics.median(times)}


def _max():
    from mpi4py import MPI

    return MPI.MAX


def worker_fusion(args) -> dict:
    """Time ResNet-50's gradients through the reduce function, fused and one op per tensor."""
    import keras
    import tensorflow as tf

    from tensorflow.python.eager import context

    from vfgraph.ir.tracing import arg_specs, tf_dtype
    from vfgraph.rewrites.insert_allreduce import reduce_functions
    from vfgraph.rewrites.split_vnodes import reduce_function
    from vfgraph.runtime.world import place_threads, world

    w = world(need_mpi=True)
    place_threads(w, 1)
    model = keras.applications.ResNet50(weights=None, input_shape=(64, 64, 3), classes=10)
    shapes = [list(v.shape) for v in model.trainable_variables]
    specs = [(f"sum_{k}", 1, s) for k, s in enumerate(shapes)] + [(f"sum_{len(shapes)}", 1, [])]
    values = [tf.ones(s, tf_dtype(1)) for _, _, s in specs]
    result = {"tensors": len(shapes), "parameters": int(sum(v.numpy().size for v in values))}
    for label, limit in [("per_tensor", 1)] + [(f"fused_{mb}mb", mb << 20) for mb in FUSION_MB]:
        header = reduce_function(f"bench_reduce_{label}", specs)
        functions, buffers = reduce_functions(header, limit, {})
        for f in reversed(functions):  # the branches before the function that calls them
            context.context().add_function_def(f)
        types = [tf_dtype(a.type) for a in header.signature.output_arg]

        fn = tf.function(_caller(header.signature.name, types), input_signature=arg_specs(header)).get_concrete_function()
        for _ in range(3):
            fn(*values)
        times = []
        for _ in range(args.reps * 2):
            w.comm.Barrier()
            t = time.perf_counter()
            out = fn(*values)
            float(out[-1])
            times.append(w.comm.allreduce(time.perf_counter() - t, op=_max()))
        result[label] = {"buffers": len(buffers), "ms": 1e3 * statistics.median(times)}
    for mb in FUSION_MB:
        result[f"per_tensor/fused_{mb}mb"] = result["per_tensor"]["ms"] / result[f"fused_{mb}mb"]["ms"]
    return result


def _caller(name: str, types: list):
    """A Python function that calls library function ``name``. A closure, not default
    arguments: a concrete function canonicalises default arguments on every call, which for
    a 215-element list of dtypes cost about 0.2 s a call and hid the collectives' time."""
    import tensorflow as tf

    def call(*xs):
        return tf.raw_ops.StatefulPartitionedCall(args=xs, Tout=types, f=name)

    return call


def _launch(n: int, *argv) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    res = subprocess.run([MPIEXEC, "-n", str(n), sys.executable, os.path.abspath(__file__), *argv],
                         capture_output=True, text=True, env=env, timeout=1800)
    if res.returncode:
        raise SystemExit(f"worker failed ({n} ranks):\n{res.stderr[-3000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def main() -> int:
    args = parse_args()
    if args.worker:
        from mpi4py import MPI

        got = worker_scaling(args) if args.worker == "scaling" else worker_fusion(args)
        if MPI.COMM_WORLD.Get_rank() == 0:
            print(json.dumps(got))
        return 0
    import export

    import vfgraph

    steps, reps, rounds = (20, 3, 1) if args.quick else (args.steps, args.reps, args.rounds)
    batches = [int(x) for x in args.batch.split(",")]
    vnode_batches = [int(x) for x in args.vnode_batch.split(",")]
    report = {"git": git_state(), "batches": batches, "vnode_batches": vnode_batches, "scaling": {}, "targets":
              {"scaling 2 ranks / 1 rank": 1.8}}
    with tempfile.TemporaryDirectory() as tmp:
        export.digits_data(os.path.join(tmp, "data"))
        data = os.path.join(tmp, "data", "train.npz")
        models = {"mlp": lambda p: export.digits_mlp(p, optimizer="momentum", hidden=args.hidden),
                  "cnn": lambda p: export.digits_cnn(p)}
        print(f"{'model':6} {'batch':>6} {'b':>4} {'1 rank ex/s':>12} {'2 ranks ex/s':>13} {'ratio':>6} "
              f"{'2 ranks, no all-reduce ex/s':>28} {'ratio':>6}")
        for name in args.models.split(","):
            src = os.path.join(tmp, name)
            models[name](src)
            for batch, b in [(batch, b) for batch in batches for b in vnode_batches if batch % (2 * b) == 0]:
                outs = {}
                for allreduce in ("mpi", "none"):
                    outs[allreduce] = os.path.join(tmp, f"{name}_{batch}_{b}_{allreduce}")
                    vfgraph.save(vfgraph.rewrite(src, vnodes=batch // b, vnode_batch=b,
                                                 allreduce=allreduce), outs[allreduce])
                common = ["--worker", "scaling", "--data", data, "--steps", str(steps), "--reps", str(reps),
                          "--batch", str(batch), "--vnode-batch", str(b)]
                runs = {"1 rank": [], "2 ranks": [], "2 ranks without all-reduce": []}
                for _ in range(rounds):  # interleaved, best of each: the machine is shared and noisy
                    runs["1 rank"].append(_launch(1, "--model", outs["mpi"], *common)["examples_per_s"])
                    runs["2 ranks"].append(_launch(2, "--model", outs["mpi"], *common)["examples_per_s"])
                    runs["2 ranks without all-reduce"].append(
                        _launch(2, "--model", outs["none"], *common)["examples_per_s"])
                got = {k: max(v) for k, v in runs.items()}
                got["ratio"] = got["2 ranks"] / got["1 rank"]
                got["ratio without all-reduce"] = got["2 ranks without all-reduce"] / got["1 rank"]
                got["runs"] = runs
                report["scaling"][f"{name} batch {batch} b {b}"] = got
                print(f"{name:6} {batch:6d} {b:4d} {got['1 rank']:12.0f} {got['2 ranks']:13.0f} {got['ratio']:6.2f} "
                      f"{got['2 ranks without all-reduce']:28.0f} {got['ratio without all-reduce']:6.2f}")
    if args.no_fusion:
        write_report(args.json, report)
        return 0
    fusion = _launch(2, "--worker", "fusion", "--reps", str(reps))
    report["fusion"] = fusion
    print(f"\nResNet-50 gradients ({fusion['tensors']} tensors, {fusion['parameters'] / 1e6:.1f}M parameters) "
          f"summed over 2 ranks:")
    print(f"{'buffers':>22} {'count':>6} {'ms':>8} {'one op per tensor / this':>26}")
    print(f"{'one op per tensor':>22} {fusion['per_tensor']['buffers']:6d} {fusion['per_tensor']['ms']:8.1f} {1:26.2f}")
    for mb in FUSION_MB:
        r = fusion[f"fused_{mb}mb"]
        print(f"{f'fused, <= {mb} MiB':>22} {r['buffers']:6d} {r['ms']:8.1f} {fusion[f'per_tensor/fused_{mb}mb']:26.2f}")
    write_report(args.json, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
