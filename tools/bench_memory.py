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

--serving measures serving instead: keras.applications.ResNet50 (64x64 inputs, 10 classes)
exported with Keras's model.export(), and vfgraph.rewrite(path, vnodes=16, vnode_batch=16),
against two baselines from the same run: a hand-written tf.while_loop over slices of 16 in
plain TensorFlow (a tf.Module around the same Keras model, parallel_iterations=1, outputs in a
TensorArray) and the rewrite with its loop left on TensorFlow's default executor (what
microbatch-inference wrote before it used the single-threaded one). Each configuration runs
in its own process for each inter-op thread count (--serving-inter-op, 0 = TensorFlow's
default; intra-op threads TensorFlow's default): load, call with 16 examples, then with 256.

  growth     = VmHWM after the 256-example call - VmHWM after the 16-example call (the headline;
               ratio against the original at the same thread count, target <= 0.25)
  again      = a second 256-example call alone: VmHWM after it (reset by /proc/self/clear_refs)
               - RSS before it
  time       = seconds of that second 256-example call
and, as the size of one slice's activations, the original's growth / 16.

    python tools/bench_memory.py --serving [--serving-inter-op 0,16] [--json PATH]
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
    p.add_argument("--serving", action="store_true", help="serving memory (ResNet-50 model.export, 256 vs 16)")
    p.add_argument("--serving-inter-op", default="0,16",
                   help="inter-op thread counts for --serving (0 = TensorFlow's default)")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--serving-child", default=None, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.serving and a.json == "/tmp/vfgraph_bench_memory.json":
        a.json = "/tmp/vfgraph_bench_memory_serving.json"
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


# ---------------------------------------------------------------------------------------------- serving

SERVING_TARGET = 0.25
SERVING_SLICE = 16
SERVING_REQUEST = 256


def export_serving(work: str) -> dict:
    """The serving configurations' SavedModels: {label: (path, signature)}."""
    import keras
    import tensorflow as tf

    import vfgraph

    keras.utils.set_random_seed(0)
    model = keras.applications.ResNet50(weights=None, input_shape=(64, 64, 3), classes=10,
                                        classifier_activation=None)
    src = os.path.join(work, "original")
    model.export(src, verbose=False)

    class Loop(tf.Module):  # the yardstick: what one would write by hand in plain TensorFlow
        def __init__(self):
            super().__init__()
            self.model = model

        @tf.function(input_signature=[tf.TensorSpec([None, 64, 64, 3], tf.float32)])
        def serve(self, x):
            b = SERVING_SLICE
            k = (tf.shape(x)[0] + b - 1) // b
            out = tf.TensorArray(tf.float32, size=k, infer_shape=False, element_shape=tf.TensorShape([None, 10]))

            def body(i, out):
                return i + 1, out.write(i, self.model(x[i * b:(i + 1) * b], training=False))

            _, out = tf.while_loop(lambda i, out: i < k, body, [0, out], parallel_iterations=1)
            return {"output_0": out.concat()}

    loop = Loop()
    hand = os.path.join(work, "hand")
    tf.saved_model.save(loop, hand, signatures={"serving_default": loop.serve})
    paths = {"original": src, "tf.while_loop by hand": hand}
    from vfgraph.rewrites import microbatch_inference

    single = microbatch_inference._single_threaded
    microbatch_inference._single_threaded = lambda item, fdef: (False, "bench_memory: the default executor")
    try:
        paths["rewritten, default executor"] = vfgraph.save(
            vfgraph.rewrite(src, vnodes=16, vnode_batch=SERVING_SLICE), os.path.join(work, "default"))
    finally:
        microbatch_inference._single_threaded = single
    paths["rewritten"] = vfgraph.save(vfgraph.rewrite(src, vnodes=16, vnode_batch=SERVING_SLICE),
                                      os.path.join(work, "rewritten"))
    return paths


def serving_child(args) -> None:
    spec = json.loads(args.serving_child)
    import numpy as np
    import tensorflow as tf

    import vfgraph  # noqa: F401

    if spec["inter_op"] > 0:
        tf.config.threading.set_inter_op_parallelism_threads(spec["inter_op"])
    loaded = tf.saved_model.load(spec["path"])
    fn = loaded.signatures["serving_default"]
    (key,) = fn.structured_input_signature[1]
    rng = np.random.default_rng(0)
    small = tf.constant(rng.standard_normal((SERVING_SLICE, 64, 64, 3)).astype("float32"))
    large = tf.constant(rng.standard_normal((SERVING_REQUEST, 64, 64, 3)).astype("float32"))
    fn(**{key: small})
    hwm_small = proc_status("VmHWM")
    fn(**{key: large})
    hwm_large = proc_status("VmHWM")

    def alone(x):
        rss = proc_status("VmRSS")
        reset_hwm()
        t0 = time.perf_counter()
        out = fn(**{key: x})
        dt = time.perf_counter() - t0
        return proc_status("VmHWM") - rss, dt, out

    again, seconds, out = alone(large)
    print(json.dumps({"hwm_after_small": hwm_small, "hwm_after_large": hwm_large, "growth": hwm_large - hwm_small,
                      "again": again, "seconds": seconds,
                      "output_shape": list(next(iter(out.values())).shape)}), flush=True)


def serving_main(args) -> None:
    import tensorflow as tf

    inter_ops = [int(t) for t in args.serving_inter_op.split(",")]
    print(f"vfgraph bench_memory --serving: ResNet-50 (64x64, model.export), request of {SERVING_REQUEST} after one "
          f"of {SERVING_SLICE}, slices of {SERVING_SLICE}; each configuration in its own process; TF "
          f"{tf.__version__}, inter-op threads {inter_ops} (0 = TF default: {os.cpu_count()} CPUs here)", flush=True)
    results = {}
    with tempfile.TemporaryDirectory(prefix="vfgraph-bench-memory-serving-") as work:
        t0 = time.perf_counter()
        paths = export_serving(work)
        print(f"  exported and rewrote ({time.perf_counter() - t0:.1f} s)", flush=True)
        for inter in inter_ops:
            for label, path in paths.items():
                spec = json.dumps({"path": path, "inter_op": inter})
                cmd = [sys.executable, os.path.abspath(__file__), "--serving-child", spec]
                p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                line = next((ln for ln in reversed(p.stdout.splitlines()) if ln.startswith("{")), None)
                r = json.loads(line) if line else {"error": f"exit {p.returncode}", "stderr_tail": p.stderr[-3000:]}
                results[f"{label} @ {inter}"] = dict(r, config=label, inter_op=inter)
                print(f"  {label}, inter-op {inter or 'default'}: "
                      + (f"growth {r['growth'] / 1e6:.0f} MB" if "growth" in r else f"FAILED {r['error']}"), flush=True)

    ratios = {}
    print(f"\nMB (10^6 bytes); growth = VmHWM after the {SERVING_REQUEST}-example call - VmHWM after the "
          f"{SERVING_SLICE}-example call; again = VmHWM of a second {SERVING_REQUEST}-example call alone after a "
          f"clear_refs reset - RSS before it; ratio = growth / the original's at the same inter-op threads "
          f"(target <= {SERVING_TARGET})")
    head = (f"| configuration | inter-op threads | growth (MB) | ratio | again (MB) | "
            f"{SERVING_REQUEST} examples (s) |")
    print(head)
    print("|" + "---|" * 6)
    for key, r in results.items():
        if "error" in r:
            print(f"| {r['config']} | {r['inter_op'] or 'default'} | FAILED | | | |")
            continue
        base = results.get(f"original @ {r['inter_op']}", {})
        q = r["growth"] / base["growth"] if base.get("growth") else float("nan")
        ratios[key] = q
        print(f"| {r['config']} | {r['inter_op'] or 'default'} | {r['growth'] / 1e6:.0f} | {q:.2f} | "
              f"{r['again'] / 1e6:.0f} | {r['seconds']:.2f} |")
    headline = {k: v for k, v in ratios.items() if k.startswith("rewritten @")}
    for k, v in headline.items():
        base = results[f"original @ {results[k]['inter_op']}"]["growth"]
        print(f"{k}: growth ratio {v:.2f}, {'meets' if v <= SERVING_TARGET else 'MISSES'} the target <= "
              f"{SERVING_TARGET}; one slice's share of the original's growth: {base / 16e6:.0f} MB")
    report = {"benchmark": "bench_memory --serving", "config": {
        "model": "resnet50 64x64 model.export", "slice": SERVING_SLICE, "request": SERVING_REQUEST,
        "inter_op": inter_ops, "tensorflow": tf.__version__, "python": platform.python_version(), "git": git_state(),
        "cpu_count": os.cpu_count(), "target_ratio": SERVING_TARGET, "units": "bytes"},
        "results": results, "ratios": ratios,
        "meets_target": bool(headline) and all(v <= SERVING_TARGET for v in headline.values())}
    write_report(args.json, report)


def _measure(args, B: int) -> dict:
    """Each configuration (V in --vnodes, and the original) exported, rewritten and run in a
    process of its own (run_child): label -> its measurements."""
    import vfgraph

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

    return results


def _print_table(args, results: dict) -> dict:
    """The table of the configurations' peaks, with their ratios to the first V's (returned)."""
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
    return ratios


def main():
    args = parse_args()
    if args.child:
        child(args)
        return
    if args.serving_child:
        serving_child(args)
        return
    if args.serving:
        serving_main(args)
        return
    import tensorflow as tf

    B = args.batch
    for v in args.vnodes:
        if B % v:
            sys.exit(f"global batch {B} is not divisible by vnodes={v}")
    print(f"vfgraph bench_memory: {args.model}, global batch {B}, V in {args.vnodes} (vnode_batch = {B} / V), "
          f"{args.steps} steps per configuration, each in its own process; TF {tf.__version__}, intra/inter-op "
          f"threads = {args.threads if args.threads > 0 else 'TF default'}", flush=True)
    results = _measure(args, B)
    ratios = _print_table(args, results)
    base_label = f"V={args.vnodes[0]}"
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
