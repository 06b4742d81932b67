"""Peak memory of one training step at V=1 versus V=16 virtual nodes, both rewritten by vfgraph.

The model is activation heavy: keras.applications.ResNet50(weights=None, input_shape=(64, 64, 3),
classes=10), wrapped like examples/export.py's build_module (SGD with momentum), global batch
256 (--quick: a small 64x64 batch-norm CNN at global batch 64). It is exported once and
rewritten twice through the same code path, ``vfgraph.rewrite(path, vnodes=V,
vnode_batch=B // V)`` for V = 1 and V = 16. Each configuration then runs in its own
subprocess (so peaks do not mix): load the rewritten SavedModel, build the batch, record the
RSS, run the training step ``--steps`` times.

Reported per configuration (MiB):
  step peak  = peak RSS over the steps (resource.getrusage ru_maxrss) - RSS just before the
               first step (after load and data creation); this is the headline number
  steady     = the largest peak of a later step alone: /proc/self/clear_refs resets the
               high-water mark before each step after the first, VmHWM after it, minus the same
               RSS before the first step (the first step's one-time peak, e.g. graph
               optimisation, excluded; memory it left allocated is included)
and the ratio V16 / V1 of each (target <= 0.30 for the step peak). The original, un-rewritten
SavedModel at the same global batch runs as a reference (--no-original to skip it).

TensorFlow runs with intra/inter-op threads = 1 (--threads) so that thread-local scratch
buffers do not differ between the runs.

    python tools/bench_memory.py [--quick] [--json PATH]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time

from benchlib import git_state, proc_status, reset_hwm, write_report

TARGET = 0.30
MIB = 1024.0 * 1024.0


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="small CNN at global batch 64")
    p.add_argument("--json", default="/tmp/vfgraph_bench_memory.json")
    p.add_argument("--model", default=None, choices=["resnet50", "smallcnn"],
                   help="default resnet50 (--quick: smallcnn)")
    p.add_argument("--batch", type=int, default=None, help="global batch (default 256; --quick 64)")
    p.add_argument("--vnodes", default="1,16", help="virtual-node counts to compare (first is the baseline)")
    p.add_argument("--steps", type=int, default=None, help="training steps per configuration (default 3; --quick 3)")
    p.add_argument("--threads", type=int, default=1, help="intra/inter-op threads (0 = TensorFlow default)")
    p.add_argument("--no-original", action="store_true", help="skip the un-rewritten reference run")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    a = p.parse_args()
    a.model = a.model or ("smallcnn" if a.quick else "resnet50")
    a.batch = a.batch or (64 if a.quick else 256)
    a.steps = a.steps or 3
    a.vnodes = [int(v) for v in a.vnodes.split(",")]
    return a


# ---------------------------------------------------------------------------------------------- helpers

def maxrss() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024.0  # Linux: kilobytes


def export_model(path: str, which: str) -> None:
    import keras
    import tensorflow as tf
    from export import build_module, sparse_ce

    keras.utils.set_random_seed(0)
    if which == "resnet50":
        model = keras.applications.ResNet50(weights=None, input_shape=(64, 64, 3), classes=10,
                                            classifier_activation=None)
    else:
        L = keras.layers
        model = keras.Sequential([keras.Input((64, 64, 3))] + [
            layer for filters, stride in ((32, 1), (32, 1), (64, 2), (64, 1)) for layer in (
                L.Conv2D(filters, 3, strides=stride, padding="same", use_bias=False), L.BatchNormalization(), L.ReLU())
        ] + [L.GlobalAveragePooling2D(), L.Dense(10)])
    specs = {"x": tf.TensorSpec([None, 64, 64, 3], tf.float32, name="x"),
             "y": tf.TensorSpec([None], tf.int32, name="y")}
    m = build_module(model, specs, "momentum", 0.05, sparse_ce)
    tf.saved_model.save(m, path, signatures={"train": m.train, "serving_default": m.serve})


# ---------------------------------------------------------------------------------------------- child

def child(args) -> None:
    spec = json.loads(args.child)
    import numpy as np
    import tensorflow as tf

    import vfgraph  # noqa: F401  (registers the ops rewritten graphs use, as a user's process does)

    if args.threads > 0:
        tf.config.threading.set_intra_op_parallelism_threads(args.threads)
        tf.config.threading.set_inter_op_parallelism_threads(args.threads)
    t0 = time.perf_counter()
    loaded = tf.saved_model.load(spec["path"])  # kept referenced while its signature runs
    fn = loaded.signatures["train"]
    load_s = time.perf_counter() - t0
    rng = np.random.default_rng(0)
    x = tf.constant(rng.standard_normal((spec["batch"], 64, 64, 3)).astype("float32"))
    y = tf.constant(rng.integers(0, 10, spec["batch"]).astype("int32"))
    import gc

    gc.collect()
    rss0, maxrss0 = proc_status("VmRSS"), maxrss()
    steps = []
    can_reset = True
    for k in range(spec["steps"]):
        rss_pre = proc_status("VmRSS")
        if k > 0:
            can_reset = reset_hwm() and can_reset
        t0 = time.perf_counter()
        loss = float(fn(x=x, y=y)["loss"])
        dt = time.perf_counter() - t0
        steps.append({"seconds": dt, "loss": loss, "rss_before": rss_pre, "rss_after": proc_status("VmRSS"),
                      "hwm_after": proc_status("VmHWM"), "maxrss_after": maxrss()})
    # ru_maxrss can only fall back after a clear_refs reset; the first step's own reading keeps
    # the peak across the whole run.
    peak = max(s["maxrss_after"] for s in steps)
    steady = [s["hwm_after"] - rss0 for s in steps[1:]] if can_reset else []
    print(json.dumps({
        "load_s": load_s, "rss_before_first_step": rss0, "maxrss_before_first_step": maxrss0,
        "peak_maxrss": peak, "step_peak_delta": peak - rss0,
        "steady_step_peak_delta": max(steady) if steady else None, "clear_refs": can_reset,
        "steps": steps}), flush=True)


# ---------------------------------------------------------------------------------------------- parent

def run_child(args, path: str, batch: int):
    spec = json.dumps({"path": path, "batch": batch, "steps": args.steps})
    cmd = [sys.executable, os.path.abspath(__file__), "--child", spec, "--threads", str(args.threads)]
    p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    for line in reversed(p.stdout.splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    return {"error": f"exit {p.returncode}", "stderr_tail": p.stderr[-3000:]}


def main():
    args = parse_args()
    if args.child:
        child(args)
        return
    import tensorflow as tf

    import vfgraph

    B = args.batch
    for v in args.vnodes:
        if B % v:
            sys.exit(f"global batch {B} is not divisible by vnodes={v}")
    print(f"vfgraph bench_memory: {args.model}, global batch {B}, V in {args.vnodes} (vnode_batch = {B} / V), "
          f"{args.steps} steps per configuration, each in its own process; TF {tf.__version__}, intra/inter-op "
          f"threads = {args.threads if args.threads > 0 else 'TF default'}", flush=True)
    results = {}
    with tempfile.TemporaryDirectory(prefix="vfgraph-bench-memory-") as work:
        src = os.path.join(work, "model")
        t0 = time.perf_counter()
        export_model(src, args.model)
        export_s = time.perf_counter() - t0
        print(f"  exported {args.model} ({export_s:.1f} s)", flush=True)
        configs = [(f"V={v}", v) for v in args.vnodes]
        paths = {}
        for label, v in configs:
            t0 = time.perf_counter()
            paths[label] = vfgraph.save(vfgraph.rewrite(src, vnodes=v, vnode_batch=B // v), os.path.join(work, f"v{v}"))
            print(f"  rewrote {label} (vnode_batch {B // v}) in {time.perf_counter() - t0:.1f} s", flush=True)
        if not args.no_original:
            configs.append(("original", 0))
            paths["original"] = src
        for label, v in configs:
            print(f"  running {label} ...", flush=True)
            r = run_child(args, paths[label], B)
            r["vnodes"] = v or None
            r["vnode_batch"] = B // v if v else B
            results[label] = r
            if "error" in r:
                print(f"    FAILED ({r['error']}):\n{r['stderr_tail']}", flush=True)
            else:
                print(f"    step peak +{r['step_peak_delta'] / MIB:.0f} MiB, first step "
                      f"{r['steps'][0]['seconds']:.1f} s", flush=True)

    base_label = f"V={args.vnodes[0]}"
    base = results.get(base_label, {})
    ratios = {}
    print(f"\nMiB; step peak = max ru_maxrss over the steps - RSS before the first step; steady = VmHWM of a later "
          f"step after a clear_refs reset - RSS before the first step; ratios against {base_label} "
          f"(target V16/V1 <= {TARGET})")
    head = (f"{'config':<10}{'b':>5}{'RSS before':>12}{'load peak':>11}{'step peak':>11}{'ratio':>8}"
            f"{'steady':>9}{'ratio':>8}{'step s':>9}  note")
    print(head)
    print("-" * len(head))
    for label, r in results.items():
        if "error" in r:
            print(f"{label:<10}{r['vnode_batch']:>5}  FAILED: {r['error']}")
            continue
        note = []
        q = r["step_peak_delta"] / base["step_peak_delta"] if "step_peak_delta" in base else float("nan")
        qs = (r["steady_step_peak_delta"] / base["steady_step_peak_delta"]
              if r.get("steady_step_peak_delta") and base.get("steady_step_peak_delta") else float("nan"))
        ratios[label] = {"step_peak": q, "steady": qs}
        if r["maxrss_before_first_step"] > r["peak_maxrss"] - 1:
            note.append("load peak >= step peak: step peak understated")
        if label != base_label and label.startswith("V=") and q > TARGET:
            note.append("above target")
        steady = r.get("steady_step_peak_delta")
        step_s = sorted(s["seconds"] for s in r["steps"][1:] or r["steps"])[0]
        print(f"{label:<10}{r['vnode_batch']:>5}{r['rss_before_first_step'] / MIB:>12.0f}"
              f"{r['maxrss_before_first_step'] / MIB:>11.0f}{r['step_peak_delta'] / MIB:>11.0f}{q:>8.3f}"
              f"{(steady / MIB if steady is not None else float('nan')):>9.0f}{qs:>8.3f}{step_s:>9.2f}"
              f"  {'; '.join(note)}")
    last = f"V={args.vnodes[-1]}"
    headline = ratios.get(last, {}).get("step_peak")
    if headline is not None:
        verdict = "meets" if headline <= TARGET else "MISSES"
        print(f"\n{last}/{base_label} step-peak ratio {headline:.3f}: {verdict} the target <= {TARGET}")

    report = {"benchmark": "bench_memory", "config": {
        "model": args.model, "global_batch": B, "vnodes": args.vnodes, "steps": args.steps, "threads": args.threads,
        "quick": args.quick, "tensorflow": tf.__version__, "python": platform.python_version(),
        "git": git_state(), "cpu_count": os.cpu_count(), "target_ratio": TARGET, "units": "bytes"},
        "results": results, "ratios": ratios, "headline_ratio": headline,
        "meets_target": None if headline is None else headline <= TARGET}
    write_report(args.json, report)


if __name__ == "__main__":
    main()
