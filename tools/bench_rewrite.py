"""Rewrite speed: the pass pipeline (passes + verify, on a model loaded in memory) against
TensorFlow's own ``tf.graph_util.import_graph_def`` of the same training function (a GraphDef
in memory), measured in the same run; and the whole rewrite from the SavedModel directory
(load + pipeline).

Cases:
  resnet50   keras.applications.ResNet50(weights=None, input_shape=(64, 64, 3), classes=10),
             wrapped like examples/export.py's build_module, SGD with momentum
             (--quick: MobileNetV2(alpha=0.35) instead)
  dense-N    generated training graphs of about N nodes: a deep stack of small dense layers
             (tf.Variables, matmul + bias + relu) in a tf.Module train function with Keras SGD;
             the layer count is calibrated so the train function in the SavedModel library has
             about N nodes (``len(fdef.node_def)``). Full run: 1k, 2.5k, 10k, 100k; --quick:
             250, 500, 1k.

Every measurement runs in a fresh process with intra/inter-op threads set to 1, after a
warm-up on a 2-layer model (one-time costs out of the timed run): one process exports the
case, then an import and a rewrite alternate, each in its own process (what one leaves in
memory, a 100k-node graph's worth, weighed on the next when they shared one): five pairs,
then more (up to 15) while the case has used under two thirds of its budget, which steadies
the medians of the small cases, whose short runs a burst of load elsewhere moves the most.
The import converts the train function's FunctionDef to a GraphDef (function_def_to_graph_def,
not timed) and times importing it into a fresh tf.Graph; the rewrite process times
``item = vfgraph.load(path)`` (the load) and then
``vfgraph.rewrite(item, vnodes=8, vnode_batch=16, in_place=True)`` (the pipeline: no copy of
the item, as when ``vfgraph.rewrite`` is given the path); load + pipeline is the rewrite. A
case gets ``--budget`` seconds (default 180) for its pairs; a rewrite that runs past it is
stopped and reported as a lower bound, and the larger dense cases after it are skipped.

Reported per case: median pipeline time / median import time (the target is <= 1), beside two
other views of the same runs on a noisy shared machine: the median over the pairs of pipeline
/ import ("paired"), and the fastest pipeline / the fastest import ("fastest": noise only ever
adds time); the rewrite (load included) / import; how pipeline time scales from ~10k to ~100k
nodes (target: 10x nodes costs <= 12x time; from the medians, and from the fastest runs),
plus the scaling between every pair of consecutive dense sizes measured (pipeline, and
rewrite); and a memory reference: nanoseconds per dictionary lookup with 10k and with 100k
node-name-like keys, in order and at random, what the size alone costs on this machine then.

With ``--baseline REV``, every pair also times the rewrite with vfgraph as it was at git
revision REV (its files, from ``git archive``, first on the child's ``PYTHONPATH``), and the
report adds this vfgraph's pipeline time over the baseline's, per case (median over the runs,
the median of the paired ratios, and fastest over fastest): the check that a refactoring kept
the rewrite's speed.

    python tools/bench_rewrite.py [--quick] [--json PATH] [--budget SECONDS] [--baseline REV]
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import queue
import statistics
import subprocess
import sys
import tempfile
import threading
import time

from benchlib import git_state, write_report

VNODES, VNODE_BATCH = 8, 16
WIDTH = 16  # units of every generated dense layer


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true",
                   help="short run: MobileNetV2(0.35) and dense graphs of 250..1k nodes")
    p.add_argument("--json", default="/tmp/vfgraph_bench_rewrite.json")
    p.add_argument("--budget", type=float, default=None,
                   help="seconds allowed for one case's rewrite timing (default 180; --quick 60)")
    p.add_argument("--export-timeout", type=float, default=900, help="seconds allowed for one case's export")
    p.add_argument("--sizes", default=None, help="comma-separated dense graph sizes in nodes (overrides the default)")
    p.add_argument("--no-keras-app", action="store_true", help="skip the keras.applications case")
    p.add_argument("--keep-going", action="store_true", help="run larger dense sizes even after one ran out of budget")
    p.add_argument("--baseline", metavar="REV", default=None,
                   help="also time the rewrite of vfgraph at git revision REV, alternating, and report new / baseline")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--workdir", default=None, help=argparse.SUPPRESS)
    p.add_argument("--phase", choices=("export", "import", "rewrite"), default="export", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.budget is None:
        a.budget = 60.0 if a.quick else 180.0
    if a.sizes is None:
        a.sizes = "250,500,1000" if a.quick else "1000,2500,10000,100000"
    a.sizes = [int(s) for s in a.sizes.split(",") if s]
    return a


# ---------------------------------------------------------------------------------------------- models

def dense_module(layers: int):
    """A tf.Module whose 'train' signature trains ``layers`` dense+relu layers with Keras SGD."""
    import keras
    import tensorflow as tf

    class DenseStack(tf.Module):
        def __init__(self):
            super().__init__()
            init = tf.random.stateless_normal
            self.ws = [tf.Variable(init([WIDTH, WIDTH], seed=[k, 0]) * 0.25, name=f"w{k}") for k in range(layers)]
            self.bs = [tf.Variable(tf.zeros([WIDTH]), name=f"b{k}") for k in range(layers)]
            self.head = tf.Variable(init([WIDTH, 10], seed=[layers, 1]) * 0.25, name="head")
            self.vars = self.ws + self.bs + [self.head]
            self.opt = keras.optimizers.SGD(0.01)
            self.opt.build(self.vars)

        def logits(self, x):
            h = x
            for w, b in zip(self.ws, self.bs):
                h = tf.nn.relu(tf.matmul(h, w) + b)
            return tf.matmul(h, self.head)

        @tf.function(input_signature=[{"x": tf.TensorSpec([None, WIDTH], tf.float32, name="x"),
                                       "y": tf.TensorSpec([None], tf.int32, name="y")}])
        def train(self, batch):
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
                    labels=batch["y"], logits=self.logits(batch["x"])))
            grads = tape.gradient(loss, self.vars)
            self.opt.apply_gradients(zip(grads, self.vars))
            return {"loss": loss}

        @tf.function(input_signature=[tf.TensorSpec([None, WIDTH], tf.float32, name="x")])
        def serve(self, x):
            return {"logits": self.logits(x)}

    return DenseStack()


def export_dense(path: str, layers: int) -> None:
    import tensorflow as tf

    m = dense_module(layers)
    tf.saved_model.save(m, path, signatures={"train": m.train, "serving_default": m.serve})


def export_keras_app(path: str, which: str) -> None:
    import keras
    import tensorflow as tf
    from export import build_module, sparse_ce

    keras.utils.set_random_seed(0)
    if which == "resnet50":
        model = keras.applications.ResNet50(weights=None, input_shape=(64, 64, 3), classes=10,
                                            classifier_activation=None)
    else:  # mobilenetv2-0.35
        model = keras.applications.MobileNetV2(weights=None, input_shape=(64, 64, 3), alpha=0.35, classes=10,
                                               classifier_activation=None)
    specs = {"x": tf.TensorSpec([None, 64, 64, 3], tf.float32, name="x"),
             "y": tf.TensorSpec([None], tf.int32, name="y")}
    m = build_module(model, specs, "momentum", 0.05, sparse_ce)
    tf.saved_model.save(m, path, signatures={"train": m.train, "serving_default": m.serve})


def train_fdef(path: str):
    """The library function that holds the training step's ops (what vfgraph rewrites)."""
    import vfgraph

    item = vfgraph.load(path)
    sig = item.training_signature()
    return item.library[sig.function], item


def referenced_functions(fdef, library):
    """Names of the library functions ``fdef`` calls (transitively), so its GraphDef imports."""
    found, stack = set(), [fdef]
    while stack:
        f = stack.pop()
        for n in f.node_def:
            for v in n.attr.values():
                names = [v.func.name] if v.HasField("func") else [x.name for x in v.list.func]
                for name in names:
                    if name and name not in found and name in library:
                        found.add(name)
                        stack.append(library[name])
    return found


# ---------------------------------------------------------------------------------------------- child

def emit(event: str, **kw) -> None:
    print(json.dumps({"event": event, **kw}), flush=True)


def child(args) -> None:
    """One process of one case (``dense:LAYERS`` or ``app:NAME``): ``--phase export`` writes the
    model, ``import`` times one import of its train function, ``rewrite`` times one rewrite;
    reports JSON lines on stdout."""
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    from tensorflow.python.framework.function_def_to_graph import function_def_to_graph_def

    import vfgraph

    kind, _, arg = args.child.partition(":")
    path, warm = os.path.join(args.workdir, "model"), os.path.join(args.workdir, "warmup")
    if args.phase == "export":
        export_dense(warm, 2)
        t0 = time.perf_counter()
        if kind == "dense":
            export_dense(path, int(arg))
        else:
            export_keras_app(path, arg)
        export_s = time.perf_counter() - t0
        fdef, item = train_fdef(path)
        lib = item.library
        calls = referenced_functions(fdef, lib)
        emit("exported", export_s=export_s, nodes=len(fdef.node_def), function=fdef.signature.name,
             called_functions=len(calls), called_function_nodes=sum(len(lib[c].node_def) for c in calls),
             saved_model_pb_bytes=os.path.getsize(os.path.join(path, "saved_model.pb")))
        return

    if args.phase == "import":
        def graph_def(model):
            fdef, item = train_fdef(model)
            gd, _ = function_def_to_graph_def(fdef)
            for name in sorted(referenced_functions(fdef, item.library)):  # called functions travel with it
                gd.library.function.add().CopyFrom(item.library[name])
            return gd

        def run(gd):
            with tf.Graph().as_default():
                tf.graph_util.import_graph_def(gd, name="")

        run(graph_def(warm))  # one-time costs out of the timed run
        gd = graph_def(path)
        emit("import", import_s=_timed(lambda: run(gd)), graphdef_nodes=len(gd.node))
        return

    vfgraph.rewrite(vfgraph.load(warm), vnodes=VNODES, vnode_batch=VNODE_BATCH, in_place=True)  # one-time costs
    marks = []
    t0 = time.perf_counter()
    item = vfgraph.load(path)
    t1 = time.perf_counter()
    vfgraph.rewrite(item, vnodes=VNODES, vnode_batch=VNODE_BATCH, in_place=True,
                    after_each=lambda p, _i: marks.append((p.name, time.perf_counter())))
    t2 = time.perf_counter()
    segs, prev = {"load": t1 - t0}, t1
    for name, t in marks:
        segs[name] = t - prev
        prev = t
    segs["verify+record"] = t2 - prev
    emit("rewrite", seconds=t2 - t0, load_s=t1 - t0, pipeline_s=t2 - t1, segments=segs)


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


# ---------------------------------------------------------------------------------------------- parent

def _run_phase(args, cmd, log_path: str, res: dict, timeout: float, baseline: bool = False) -> int:
    """One child process; its events go into ``res`` (a rewrite of the baseline's vfgraph, with
    ``baseline``, into ``res["baseline_runs"]``). Returns its exit code (stopped at ``timeout``:
    ``res["timed_out"]`` names the phase)."""
    phase = cmd[-1]
    env = None
    if baseline:
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([args.baseline_dir] + [
            p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
    with open(log_path, "a") as log:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, text=True, env=env)
        lines: "queue.Queue" = queue.Queue()
        threading.Thread(target=lambda: [lines.put(l) for l in proc.stdout] + [lines.put(None)], daemon=True).start()
        start = time.monotonic()
        while True:
            try:
                line = lines.get(timeout=max(0.1, start + timeout - time.monotonic()))
            except queue.Empty:
                line = "TIMEOUT"
            if line == "TIMEOUT" or time.monotonic() > start + timeout:
                proc.kill()  # our own child, by its handle
                proc.wait()
                res["timed_out"], res["timed_out_after_s"] = phase, time.monotonic() - start
                return proc.returncode
            if line is None:
                return proc.wait()
            try:
                ev = json.loads(line)
            except ValueError:
                continue
            kind = ev.pop("event")
            if kind == "exported":
                res.update(ev)
                print(f"    exported: {ev['nodes']} nodes in the train function ({ev['export_s']:.1f} s)", flush=True)
            elif kind == "import":
                res.setdefault("import_reps", []).append(ev["import_s"])
                res["graphdef_nodes"] = ev["graphdef_nodes"]
            elif kind == "rewrite":
                res.setdefault("baseline_runs" if baseline else "rewrite_runs", []).append(ev)


def run_case(args, spec: str, label: str):
    """Export one case, then time imports and rewrites alternately, each in a fresh process (what
    one leaves in memory, a 100k-node graph's worth, would weigh on the next); returns the events."""
    work = tempfile.mkdtemp(prefix="vfgraph-bench-rewrite-")
    log_path = os.path.join(work, "child.log")
    cmd = [sys.executable, os.path.abspath(__file__), "--child", spec, "--workdir", work]
    res = {"case": label, "spec": spec}
    code = _run_phase(args, cmd + ["--phase", "export"], log_path, res, args.export_timeout)
    start = time.monotonic()
    while code == 0 and "timed_out" not in res and _more_pairs(len(res.get("rewrite_runs", [])),
                                                               time.monotonic() - start, args.budget):
        t0 = time.monotonic()
        code = _run_phase(args, cmd + ["--phase", "import"], log_path, res, args.export_timeout)
        if code == 0 and "timed_out" not in res:
            code = _run_phase(args, cmd + ["--phase", "rewrite"], log_path, res, args.budget)
        if code == 0 and "timed_out" not in res and args.baseline:
            code = _run_phase(args, cmd + ["--phase", "rewrite"], log_path, res, args.budget, baseline=True)
        if code == 0 and "timed_out" not in res:
            i, r = res["import_reps"][-1], res["rewrite_runs"][-1]
            old = f", baseline pipeline {res['baseline_runs'][-1]['pipeline_s']:.2f} s" if args.baseline else ""
            print(f"    import {i:.2f} s, pipeline {r['pipeline_s']:.2f} s (rewrite {r['seconds']:.2f} s, "
                  f"load {r['load_s']:.2f} s){old}", flush=True)
        pair = time.monotonic() - t0
        if time.monotonic() - start + pair > args.budget:
            break
    runs = [r["seconds"] for r in res.get("rewrite_runs", [])]
    pipes = [r["pipeline_s"] for r in res.get("rewrite_runs", [])]
    imports = res.get("import_reps", [])[:len(runs)]
    if runs:
        res.update(import_s=statistics.median(imports), rewrite_s=statistics.median(runs),
                   pipeline_s=statistics.median(pipes), pipeline_fastest_s=min(pipes),
                   load_s=statistics.median(r["load_s"] for r in res["rewrite_runs"]),
                   paired_ratio=statistics.median(p / i for p, i in zip(pipes, imports)),
                   fastest_ratio=min(pipes) / min(imports))
    elif imports:
        res["import_s"] = statistics.median(imports)
    old = [r["pipeline_s"] for r in res.get("baseline_runs", [])][:len(pipes)]
    if old:
        new = pipes[:len(old)]
        res.update(baseline_pipeline_s=statistics.median(old), baseline_rewrite_s=statistics.median(
                       r["seconds"] for r in res["baseline_runs"]),
                   pipeline_over_baseline=statistics.median(new) / statistics.median(old),
                   paired_over_baseline=statistics.median(n / o for n, o in zip(new, old)),
                   fastest_over_baseline=min(new) / min(old))
    res["returncode"] = code
    if code not in (0, None) and "timed_out" not in res:
        with open(log_path) as f:
            res["error_tail"] = f.read()[-3000:]
        print("    FAILED:\n" + res["error_tail"], flush=True)
    if "timed_out" in res:
        print(f"    stopped: {res['timed_out']} phase ran past its limit "
              f"({res['timed_out_after_s']:.0f} s)", flush=True)
    subprocess.run(["rm", "-rf", work])
    return res


MIN_PAIRS, MAX_PAIRS = 5, 15


def _more_pairs(done: int, spent: float, budget: float) -> bool:
    """Another import/rewrite pair? Five at least (within the budget); then more, up to 15, while
    the case has used under two thirds of its budget: a small case's runs are short, so a burst
    of load from elsewhere on the machine moves each of them by a larger fraction, and more of
    them steady its median."""
    return done < MIN_PAIRS or (done < MAX_PAIRS and spent < budget * 2 / 3)


def _baseline_tree(rev: str) -> str:
    """vfgraph's files at git revision ``rev``, importable as ``vfgraph`` from the directory
    returned (its ``rewrites/`` linked as ``vfgraph/rewrites``, as the package maps it)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = tempfile.mkdtemp(prefix="vfgraph-bench-baseline-")
    archive = subprocess.run(["git", "-C", root, "archive", rev, "vfgraph", "rewrites"], capture_output=True, check=True)
    subprocess.run(["tar", "-x", "-C", out], input=archive.stdout, check=True)
    os.symlink(os.path.join(out, "rewrites"), os.path.join(out, "vfgraph", "rewrites"))
    return out


def calibrate():
    """Nodes in the train function as a linear function of the dense layer count."""
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    counts = {}
    with tempfile.TemporaryDirectory(prefix="vfgraph-bench-calib-") as d:
        for layers in (4, 12):
            p = os.path.join(d, str(layers))
            export_dense(p, layers)
            counts[layers] = len(train_fdef(p)[0].node_def)
    per = (counts[12] - counts[4]) / 8
    base = counts[4] - 4 * per
    return per, base, counts


def memory_reference(sizes=(10_000, 100_000), probes: int = 1_000_000, repeats: int = 3) -> dict:
    """Nanoseconds per lookup in a dictionary of ``n`` node-name-like keys, in insertion order
    and in random order (fastest of ``repeats``): what the graph's size alone does to the cost
    of the lookups a rewrite is made of, on this machine at this time."""
    import random

    out = {}
    for n in sizes:
        keys = [sys.intern(f"gradient_tape/sequential/dense_{i}/MatMul/MatMul_1") for i in range(n)]
        table = {k: [i] for i, k in enumerate(keys)}
        ordered = keys * max(1, probes // n)
        shuffled = ordered[:]
        random.Random(0).shuffle(shuffled)
        for label, seq in (("in_order", ordered), ("random", shuffled)):
            best = min(_timed(lambda: [table[k][0] for k in seq]) for _ in range(repeats))
            out[f"{label}_ns_{n}"] = best * 1e9 / len(seq)
    a, b = sizes[0], sizes[-1]
    out["random_ratio"] = out[f"random_ns_{b}"] / out[f"random_ns_{a}"]
    out["in_order_ratio"] = out[f"in_order_ns_{b}"] / out[f"in_order_ns_{a}"]
    return out


def _cases(args, per: float, base: float) -> list:
    """(spec, label) of each case: a Keras application, then dense models of the sizes asked."""
    cases = []
    if not args.no_keras_app:
        app = "mobilenetv2-0.35" if args.quick else "resnet50"
        cases.append((f"app:{app}", app))
    for n in args.sizes:
        layers = max(1, round((n - base) / per))
        cases.append((f"dense:{layers}", f"dense-{n}"))
    return cases


def _run_cases(args, cases) -> list:
    """Each case run (run_case) with its ratios to import; the dense cases after one that ran
    past the budget skipped unless --keep-going."""
    results, stopped = [], None
    for spec, label in cases:
        if stopped and label.startswith("dense-") and not args.keep_going:
            results.append({"case": label, "spec": spec, "skipped": f"{stopped} ran past the budget"})
            print(f"  {label}: skipped ({stopped} ran past the budget)", flush=True)
            continue
        print(f"  {label} ({spec}) ...", flush=True)
        r = run_case(args, spec, label)
        if "import_s" in r and "rewrite_s" in r:
            r["pipeline_over_import"] = r["pipeline_s"] / r["import_s"]
            r["rewrite_over_import"] = r["rewrite_s"] / r["import_s"]
            r["meets_target"] = r["pipeline_over_import"] <= 1.0
        elif "import_s" in r and r.get("timed_out") == "rewrite":
            r["rewrite_over_import_lower_bound"] = r["timed_out_after_s"] / r["import_s"]
            r["meets_target"] = False
        if r.get("timed_out") and label.startswith("dense-"):
            stopped = label
        results.append(r)
    return results


def _scaling(results) -> list:
    """Scaling between consecutive dense sizes (a stopped larger case gives lower bounds)."""
    dense = [r for r in results if r["case"].startswith("dense-") and "nodes" in r]
    scaling = []
    for a, b in zip(dense, dense[1:]):
        if "rewrite_s" not in a:
            continue
        tb = b.get("pipeline_s")
        lower = tb is None
        if lower:
            if b.get("timed_out") != "rewrite":
                continue
            tb = b["timed_out_after_s"]
        nr, tr = b["nodes"] / a["nodes"], tb / a["pipeline_s"]
        scaling.append({"from": a["case"], "to": b["case"], "nodes_ratio": nr, "time_ratio": tr,
                        "time_ratio_is_lower_bound": lower, "exponent": math.log(tr) / math.log(nr),
                        "time_ratio_per_10x_nodes": 10 ** (math.log(tr) / math.log(nr)),
                        "rewrite_time_ratio": None if lower else b["rewrite_s"] / a["rewrite_s"],
                        "fastest_time_ratio": None if lower else b["pipeline_fastest_s"] / a["pipeline_fastest_s"]})
    return scaling


def _print_cases(results) -> None:
    """The table of cases, and where the rewrite time goes."""
    print("\nper case (pipeline = vfgraph.rewrite of the loaded model: passes + verify; rewrite = load + pipeline;")
    print("import = tf.graph_util.import_graph_def of the train function's GraphDef; target pipeline/import <= 1)")
    head = (f"{'case':<18}{'nodes':>8}{'export s':>10}{'import s':>10}{'pipeline s':>12}"
            f"{'pipeline/import':>17}{'paired':>8}{'fastest':>9}{'load s':>8}{'rewrite/import':>16}  note")
    print(head)
    print("-" * len(head))
    for r in results:
        if "skipped" in r:
            print(f"{r['case']:<18}{'':>8}{'':>10}{'':>10}{'':>12}{'':>17}{'':>8}{'':>9}{'':>8}{'':>16}  "
                  f"skipped: {r['skipped']}")
            continue
        rw = f"{r['pipeline_s']:.2f}" if "pipeline_s" in r else (
            f">{r['timed_out_after_s']:.0f}" if r.get("timed_out") == "rewrite" else "-")
        ratio = (f"{r['pipeline_over_import']:.2f}" if "pipeline_over_import" in r else
                 f">{r['rewrite_over_import_lower_bound']:.0f}" if "rewrite_over_import_lower_bound" in r else "-")
        note = []
        if r.get("timed_out"):
            note.append(f"{r['timed_out']} stopped after {r['timed_out_after_s']:.0f} s")
        if r.get("error_tail"):
            note.append("FAILED (see JSON)")
        if "meets_target" in r and not r["meets_target"]:
            note.append("above target")
        fmt = lambda k, f: (f % r[k]) if k in r else "-"  # noqa: E731
        print(f"{r['case']:<18}{fmt('nodes', '%d'):>8}{fmt('export_s', '%.1f'):>10}"
              f"{fmt('import_s', '%.3f'):>10}{rw:>12}{ratio:>17}{fmt('paired_ratio', '%.2f'):>8}"
              f"{fmt('fastest_ratio', '%.2f'):>9}{fmt('load_s', '%.2f'):>8}{fmt('rewrite_over_import', '%.2f'):>16}"
              f"  {'; '.join(note)}")
    seg_rows = [r for r in results if r.get("rewrite_runs")]
    if seg_rows:
        print("\nwhere the rewrite time goes (first timed run, seconds):")
        for r in seg_rows:
            segs = r["rewrite_runs"][0]["segments"]
            print(f"  {r['case']:<18}" + "  ".join(f"{k} {v:.2f}" for k, v in segs.items()))


def _print_comparisons(args, results, scaling, target, memory) -> None:
    """Scaling between sizes, against the baseline, and the memory reference."""
    if scaling:
        print("\nscaling of pipeline time between dense sizes (target for ~10k -> ~100k: <= 12x time for 10x nodes):")
        for s in scaling:
            lb = ">=" if s["time_ratio_is_lower_bound"] else ""
            note = " (lower bounds: the larger case was stopped)" if lb else (
                f"; fastest runs x{s['fastest_time_ratio']:.2f}; rewrite x{s['rewrite_time_ratio']:.2f}")
            print(f"  {s['from']} -> {s['to']}: nodes x{s['nodes_ratio']:.2f}, time x{lb}{s['time_ratio']:.2f}, "
                  f"time ~ nodes^{lb}{s['exponent']:.2f} (= x{lb}{s['time_ratio_per_10x_nodes']:.1f} per 10x nodes)"
                  f"{note}")
    if target is None:
        print("  ~10k -> ~100k: not measured in this run (see above)")
    against = [r for r in results if "pipeline_over_baseline" in r]
    if against:
        print(f"\npipeline time of this vfgraph over the baseline's ({args.baseline}), same run, alternating:")
        print(f"  {'case':<18}{'this s':>8}{'baseline s':>12}{'ratio':>8}{'paired':>8}{'fastest':>9}")
        for r in against:
            print(f"  {r['case']:<18}{r['pipeline_s']:>8.3f}{r['baseline_pipeline_s']:>12.3f}"
                  f"{r['pipeline_over_baseline']:>8.3f}{r['paired_over_baseline']:>8.3f}{r['fastest_over_baseline']:>9.3f}")
    print(f"\nmemory reference (dictionary lookups, ns each, 10k -> 100k keys): in order "
          f"{memory['in_order_ns_10000']:.0f} -> {memory['in_order_ns_100000']:.0f} (x{memory['in_order_ratio']:.2f}), "
          f"random {memory['random_ns_10000']:.0f} -> {memory['random_ns_100000']:.0f} (x{memory['random_ratio']:.2f})")


def main():
    args = parse_args()
    if args.child:
        child(args)
        return
    import tensorflow as tf

    print(f"vfgraph bench_rewrite: rewrite(vnodes={VNODES}, vnode_batch={VNODE_BATCH}) vs "
          f"tf.graph_util.import_graph_def "
          f"of the same train function; TF {tf.__version__}; every import and rewrite in a fresh process, "
          f"intra/inter-op threads = 1; "
          f"budget {args.budget:.0f} s per case", flush=True)
    if args.baseline:
        args.baseline_dir = _baseline_tree(args.baseline)
        print(f"  baseline: vfgraph at {args.baseline} ({args.baseline_dir})", flush=True)
    per, base, counts = calibrate()
    print(f"  calibration: {per:.1f} nodes per dense layer + {base:.0f} (from {counts})", flush=True)
    results = _run_cases(args, _cases(args, per, base))
    scaling = _scaling(results)  # (and the ~10k -> ~100k target)
    target = next((s for s in scaling if s["from"] == "dense-10000" and s["to"] == "dense-100000"), None)
    memory = memory_reference()
    _print_cases(results)
    _print_comparisons(args, results, scaling, target, memory)

    report = {"benchmark": "bench_rewrite", "config": {
        "vnodes": VNODES, "vnode_batch": VNODE_BATCH, "quick": args.quick, "budget_s": args.budget,
        "sizes": args.sizes, "dense_nodes_per_layer": per, "dense_nodes_base": base, "threads": 1,
        "tensorflow": tf.__version__, "python": platform.python_version(), "git": git_state(),
        "cpu_count": os.cpu_count(), "baseline": args.baseline,
        "targets": {"pipeline_over_import": 1.0, "time_ratio_for_10x_nodes": 12.0}},
        "results": results, "scaling": scaling, "target_10k_to_100k": target, "memory_reference": memory}
    write_report(args.json, report)
    if args.baseline:
        subprocess.run(["rm", "-rf", args.baseline_dir])

if __name__ == "__main__":
    main()
