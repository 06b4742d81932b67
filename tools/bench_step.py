"""Step overhead of a vfgraph-rewritten training step, against baselines run in the same process.

For each model (the digits MLP and the batch-norm digits CNN of examples/export.py) it exports
the SavedModel, rewrites it with ``vfgraph.rewrite(path, vnodes=8, vnode_batch=16)`` and times,
on the same random batch of 128 examples (x float32 [128, 64], y int32 in [0, 10)):

  (a) vfgraph   the rewritten SavedModel's ``train`` signature fed 128 examples (8 x 16)
  (b) expert    one tf.function with a tf.while_loop over the 8 slices of 16 (GradientTape per
                slice on a Keras model of the same architecture), gradients accumulated and
                applied once with the same optimizer
  (c) pyloop    a tf.function computing one slice's gradients, called 8 times from Python,
                gradients summed eagerly, then one apply_gradients (itself in a tf.function)
  (d) original  the original SavedModel's ``train`` signature at batch 128 (one step, no
                virtual nodes)
  (b2) expert_sm diagnostic: the expert step of (b) exported as a SavedModel and called through
                its ``train`` signature, the same call path as (a) and (d)

Throughput is examples per second; each repetition times a run of steps of every variant in
turn (round robin, so load from other processes hits all variants alike); the median over
``--reps`` repetitions is reported after ``--warmup`` warm-up steps (a repetition runs at least
``--steps`` steps and at least ``--min-rep-seconds``). Ratios (a)/(b) (target
>= 0.95), (a)/(c) (target >= 1.3) and (a)/(d) (reported only) are computed from the medians.

    python tools/bench_step.py [--quick] [--json PATH] [--threads 1]
"""
from __future__ import annotations

import argparse
import math
import os
import platform
import statistics
import tempfile
import time

from benchlib import git_state, write_report

BATCH = 128
VNODES = 8
VNODE_BATCH = 16
TARGETS = {"vfgraph/expert": 0.95, "vfgraph/pyloop": 1.3}


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="short run: fewer models, steps and repetitions")
    p.add_argument("--json", default="/tmp/vfgraph_bench_step.json", help="where to write the results")
    p.add_argument("--threads", type=int, default=1,
                   help="intra- and inter-op threads for TensorFlow (default 1: fairer on a shared machine; "
                        "0 = TensorFlow's default)")
    p.add_argument("--models", default=None,
                   help="comma-separated subset of mlp64,mlp256,mlp1024,cnn (default: all; --quick: mlp64,cnn)")
    p.add_argument("--optimizer", default="sgd", choices=["sgd", "momentum"], help="optimizer of every model")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--steps", type=int, default=None, help="steps per timed repetition")
    p.add_argument("--reps", type=int, default=None, help="timed repetitions (median reported)")
    p.add_argument("--warmup", type=int, default=None, help="warm-up steps per variant")
    p.add_argument("--min-rep-seconds", type=float, default=None,
                   help="each timed repetition runs at least this long (default 0.3; --quick 0.1)")
    a = p.parse_args()
    a.steps = a.steps or (10 if a.quick else 30)
    a.reps = a.reps or (3 if a.quick else 11)
    a.min_rep_seconds = a.min_rep_seconds or (0.1 if a.quick else 0.3)
    a.warmup = a.warmup or (3 if a.quick else 10)
    a.models = (a.models or ("mlp64,cnn" if a.quick else "mlp64,mlp256,mlp1024,cnn")).split(",")
    return a


def keras_model(kind: str, hidden: int):
    """The same layers examples/export.py builds (digits_mlp / digits_cnn)."""
    import keras

    keras.utils.set_random_seed(0)
    if kind == "mlp":
        return keras.Sequential([keras.Input((64,)), keras.layers.Dense(hidden, activation="relu"),
                                 keras.layers.Dense(10)])
    return keras.Sequential([
        keras.Input((64,)), keras.layers.Reshape((8, 8, 1)),
        keras.layers.Conv2D(8, 3, padding="same", use_bias=False), keras.layers.BatchNormalization(),
        keras.layers.ReLU(), keras.layers.MaxPooling2D(), keras.layers.Flatten(), keras.layers.Dense(10)])


def expert_body(model, opt):
    """The body of (b): a tf.while_loop over the slices, gradients accumulated, one apply."""
    import tensorflow as tf
    from export import sparse_ce

    variables = model.trainable_variables

    def step(x, y):
        n = tf.shape(x)[0] // VNODE_BATCH

        def body(i, loss_acc, *grad_acc):
            start = i * VNODE_BATCH
            xs, ys = x[start:start + VNODE_BATCH], y[start:start + VNODE_BATCH]
            with tf.GradientTape() as tape:
                loss = sparse_ce(ys, model(xs, training=True))
            grads = tape.gradient(loss, variables)
            return [i + 1, loss_acc + loss] + [a + g for a, g in zip(grad_acc, grads)]

        init = [tf.constant(0), tf.constant(0.0)] + [tf.zeros_like(v) for v in variables]
        out = tf.while_loop(lambda i, *_: i < n, body, init, parallel_iterations=1)
        count = tf.cast(n, tf.float32)
        opt.apply_gradients(zip([g / count for g in out[2:]], variables))
        return {"loss": out[1] / count}

    return step


def expert_step(model, opt):
    """(b): the expert body as one tf.function called directly."""
    import tensorflow as tf

    specs = [tf.TensorSpec([None, 64], tf.float32), tf.TensorSpec([None], tf.int32)]
    return tf.function(expert_body(model, opt), input_signature=specs)


def expert_savedmodel(model, opt, path):
    """Diagnostic (b'): the same expert body exported as a SavedModel 'train' signature, so it is
    called through the same path as (a) and (d) (signature call with keyword tensors)."""
    import tensorflow as tf

    body = expert_body(model, opt)
    specs = {"x": tf.TensorSpec([None, 64], tf.float32, name="x"), "y": tf.TensorSpec([None], tf.int32, name="y")}

    class Expert(tf.Module):
        def __init__(self):
            super().__init__()
            self.model, self.opt = model, opt

        @tf.function(input_signature=[specs])
        def train(self, batch):
            return body(batch["x"], batch["y"])

    m = Expert()
    tf.saved_model.save(m, path, signatures={"train": m.train})
    return tf.saved_model.load(path)


def pyloop_step(model, opt):
    """(c): gradients of one slice in a tf.function, called V times from Python, one apply."""
    import tensorflow as tf
    from export import sparse_ce

    variables = model.trainable_variables
    specs = [tf.TensorSpec([None, 64], tf.float32), tf.TensorSpec([None], tf.int32)]

    @tf.function(input_signature=specs)
    def grad_fn(x, y):
        with tf.GradientTape() as tape:
            loss = sparse_ce(y, model(x, training=True))
        return loss, tape.gradient(loss, variables)

    @tf.function
    def apply_fn(grads):
        opt.apply_gradients(zip(grads, variables))

    def step(x, y):
        total, acc = None, None
        xs, ys = tf.split(x, VNODES), tf.split(y, VNODES)  # one eager op each (cheaper than 8 slices)
        for i in range(VNODES):
            loss, grads = grad_fn(xs[i], ys[i])
            if acc is None:
                total, acc = loss, list(grads)
            else:
                total = total + loss
                acc = [a + g for a, g in zip(acc, grads)]
        apply_fn([a / VNODES for a in acc])
        return {"loss": total / VNODES}

    return step


def build_variants(name: str, args, workdir: str):
    """Export, rewrite and load one model; returns ({variant: callable(x, y)}, keep-alive list, info)."""
    import tensorflow as tf
    import vfgraph
    from export import digits_cnn, digits_mlp, make_optimizer

    kind, hidden = ("cnn", 0) if name == "cnn" else ("mlp", int(name[3:]))
    src = os.path.join(workdir, name)
    t0 = time.perf_counter()
    if kind == "mlp":
        digits_mlp(src, optimizer=args.optimizer, lr=args.lr, hidden=hidden)
    else:
        digits_cnn(src, optimizer=args.optimizer, lr=args.lr)
    t_export = time.perf_counter() - t0
    dst = src + "_v8"
    t0 = time.perf_counter()
    vfgraph.save(vfgraph.rewrite(src, vnodes=VNODES, vnode_batch=VNODE_BATCH), dst)
    t_rewrite = time.perf_counter() - t0
    rewritten = tf.saved_model.load(dst)
    original = tf.saved_model.load(src)
    rew_train, orig_train = rewritten.signatures["train"], original.signatures["train"]

    m_b, m_c = keras_model(kind, hidden), keras_model(kind, hidden)
    opt_b, opt_c = make_optimizer(args.optimizer, args.lr), make_optimizer(args.optimizer, args.lr)
    opt_b.build(m_b.trainable_variables)
    opt_c.build(m_c.trainable_variables)
    m_e, opt_e = keras_model(kind, hidden), make_optimizer(args.optimizer, args.lr)
    opt_e.build(m_e.trainable_variables)
    expert_loaded = expert_savedmodel(m_e, opt_e, os.path.join(workdir, name + "_expert"))
    expert_sig = expert_loaded.signatures["train"]
    variants = {
        "vfgraph": lambda x, y: rew_train(x=x, y=y),
        "expert": expert_step(m_b, opt_b),
        "pyloop": pyloop_step(m_c, opt_c),
        "original": lambda x, y: orig_train(x=x, y=y),
        "expert_sm": lambda x, y: expert_sig(x=x, y=y),
    }
    # the loaded SavedModels must stay referenced while their signatures are called
    keep = [rewritten, original, expert_loaded, m_b, m_c, opt_b, opt_c]
    info = {"export_s": t_export, "rewrite_and_save_s": t_rewrite,
            "params": int(sum(int(tf.size(v)) for v in m_b.trainable_variables))}
    return variants, keep, info


def bench_model(name, args, workdir, x, y):
    variants, keep, info = build_variants(name, args, workdir)
    first_loss, steps = {}, {}
    for v, fn in variants.items():
        out = fn(x, y)
        first_loss[v] = float(out["loss"])
        t0 = time.perf_counter()
        for _ in range(args.warmup - 1):
            out = fn(x, y)
        float(out["loss"])
        per_step = (time.perf_counter() - t0) / max(1, args.warmup - 1)
        # at least --steps steps and --min-rep-seconds per repetition, so timer noise stays small
        steps[v] = max(args.steps, math.ceil(args.min_rep_seconds / max(per_step, 1e-6)))
    per_rep = {v: [] for v in variants}
    for _ in range(args.reps):
        for v, fn in variants.items():
            t0 = time.perf_counter()
            for _ in range(steps[v]):
                out = fn(x, y)
            float(out["loss"])  # make sure the last step finished
            per_rep[v].append(steps[v] * BATCH / (time.perf_counter() - t0))
    med = {v: statistics.median(r) for v, r in per_rep.items()}
    ratios = {"vfgraph/expert": med["vfgraph"] / med["expert"], "vfgraph/pyloop": med["vfgraph"] / med["pyloop"],
              "vfgraph/original": med["vfgraph"] / med["original"],
              "vfgraph/expert_sm": med["vfgraph"] / med["expert_sm"]}
    del keep
    return {"info": info, "first_step_loss": first_loss, "steps_per_rep": steps, "examples_per_s_reps": per_rep,
            "examples_per_s_median": med, "step_ms_median": {v: 1000.0 * BATCH / m for v, m in med.items()},
            "ratios": ratios,
            "meets_target": {k: ratios[k] >= t for k, t in TARGETS.items()}}


def main():
    args = parse_args()
    import numpy as np
    import tensorflow as tf

    if args.threads > 0:
        tf.config.threading.set_intra_op_parallelism_threads(args.threads)
        tf.config.threading.set_inter_op_parallelism_threads(args.threads)
    rng = np.random.default_rng(0)
    x = tf.constant(rng.standard_normal((BATCH, 64)).astype("float32"))
    y = tf.constant(rng.integers(0, 10, BATCH).astype("int32"))
    print(f"vfgraph bench_step: batch {BATCH} = {VNODES} virtual nodes x {VNODE_BATCH}, optimizer {args.optimizer}, "
          f"TF {tf.__version__}, threads intra/inter = "
          f"{args.threads if args.threads > 0 else 'TF default'} (set so variants compete for the same CPU alike), "
          f"{args.warmup} warm-up steps, median of {args.reps} reps of >= {args.steps} steps and "
          f">= {args.min_rep_seconds} s each", flush=True)
    results = {}
    with tempfile.TemporaryDirectory(prefix="vfgraph-bench-step-") as workdir:
        for name in args.models:
            print(f"  {name}: exporting, rewriting, timing ...", flush=True)
            results[name] = bench_model(name, args, workdir, x, y)

    head = (f"{'model':<9}{'params':>8} | {'(a) vfgraph':>12}{'(b) expert':>12}{'(c) pyloop':>12}{'(d) orig':>12}"
            f"{'(b2) exp-SM':>12} | {'a/b':>6}{'a/c':>6}{'a/d':>6}{'a/b2':>6}")
    print("\nexamples/s (median); ratios of medians; targets a/b >= 0.95, a/c >= 1.3 (a/d, a/b2 reported only)")
    print("(b2) = the expert step of (b) exported as a SavedModel and called through its signature, like (a)")
    print(head)
    print("-" * len(head))
    for name, r in results.items():
        m, q = r["examples_per_s_median"], r["ratios"]
        flags = "".join("" if ok else f"  [{k} below target]" for k, ok in r["meets_target"].items())
        print(f"{name:<9}{r['info']['params']:>8} | {m['vfgraph']:>12.0f}{m['expert']:>12.0f}{m['pyloop']:>12.0f}"
              f"{m['original']:>12.0f}{m['expert_sm']:>12.0f} | {q['vfgraph/expert']:>6.2f}{q['vfgraph/pyloop']:>6.2f}"
              f"{q['vfgraph/original']:>6.2f}{q['vfgraph/expert_sm']:>6.2f}{flags}")
    print("\nstep time, ms (median):")
    for name, r in results.items():
        s = r["step_ms_median"]
        print(f"  {name:<9} " + "  ".join(f"{v} {s[v]:.2f}" for v in ("vfgraph", "expert", "pyloop", "original",
                                                                      "expert_sm")))
    print("\nspread over repetitions, examples/s (min..max):")
    for name, r in results.items():
        print(f"  {name:<9} " + "  ".join(f"{v} {min(x):.0f}..{max(x):.0f}"
                                          for v, x in r["examples_per_s_reps"].items()))
    print("first-step loss per variant (sanity; same init for a/d, b/c use a fresh Keras model of the same layers):")
    for name, r in results.items():
        print(f"  {name:<9} " + "  ".join(f"{v} {l:.4f}" for v, l in r["first_step_loss"].items()))

    report = {"benchmark": "bench_step", "config": {
        "batch": BATCH, "vnodes": VNODES, "vnode_batch": VNODE_BATCH, "optimizer": args.optimizer, "lr": args.lr,
        "threads": args.threads, "warmup": args.warmup, "reps": args.reps, "min_steps_per_rep": args.steps,
        "min_rep_seconds": args.min_rep_seconds,
        "quick": args.quick, "tensorflow": tf.__version__, "python": platform.python_version(),
        "git": git_state(), "cpu_count": os.cpu_count(), "targets": TARGETS}, "results": results}
    write_report(args.json, report)


if __name__ == "__main__":
    main()
