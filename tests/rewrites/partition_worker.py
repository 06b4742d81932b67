"""Runs partitioned models and their unpartitioned rewrite in one process over logical CPU
devices; prints one JSON line with, per partitioned model, the largest relative parameter
difference after the steps, where its variables live, and the device of every op of the
training step (from TensorFlow's own partition graphs).

    python partition_worker.py CONFIG.json

CONFIG: {"devices": n, "steps": s, "batch": B, "cases": [{"name", "baseline", "model"}]}.
"""
import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def main() -> None:
    with open(sys.argv[1]) as f:
        config = json.load(f)
    import tensorflow as tf

    from vfgraph.runtime.devices import one_cpu_per_stage

    one_cpu_per_stage(config["devices"])
    from tensorflow.python.eager import context

    from vfgraph.io.savedmodel import load_to_run
    from vfgraph.testing.compare import make_inputs, rel_diff

    def run(path, placed):
        loaded = load_to_run(path, variable_devices=placed)
        fn = loaded.signatures["train"]
        feeds = [{k: tf.constant(v) for k, v in make_inputs(fn, config["batch"], seed=s).items()}
                 for s in range(config["steps"])]
        ops = {}
        losses = []
        for s, feed in enumerate(feeds):
            if s == 0 and placed:
                context.context().enable_run_metadata()
            losses.append(float(fn(**feed)["loss"]))
            if s == 0 and placed:
                md = context.context().export_run_metadata()
                context.context().disable_run_metadata()
                for fg in md.function_graphs:
                    for pg in fg.partition_graphs:
                        for n in pg.node:
                            ops[n.name] = n.device.split("/device:")[-1]
        values = {v.name: v.numpy() for v in fn.variables}
        devices = {v.name: v.device.split("/device:")[-1] for v in fn.variables}
        return values, devices, ops, losses

    out = {}
    baselines = {}
    for case in config["cases"]:
        if case["baseline"] not in baselines:
            baselines[case["baseline"]] = run(case["baseline"], False)
        want, _, _, want_losses = baselines[case["baseline"]]
        got, devices, ops, losses = run(case["model"], True)
        out[case["name"]] = {
            "params": max(rel_diff(want[k], got[k]) for k in want),
            "same_names": sorted(want) == sorted(got),
            "loss": max(abs(a - b) for a, b in zip(want_losses, losses)),
            "variable_devices": devices,
            "ops": ops,
        }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
