"""Trains models cut into pipeline stages on logical CPU devices and their unpartitioned
rewrites, in one process, one intra-op thread per device; prints one JSON line per case as it
finishes (a case that hangs leaves the cases before it reported, and its "start" line names it).

    python stage_diff_worker.py CONFIG.json

CONFIG: {"devices": n, "steps": s, "cases": [...]}, each case either {"name", "baseline",
"model", "batch", "corpus"}: the model and its baseline trained on the same random batches
(vfgraph.testing.compare.make_inputs, or with "corpus" examples/corpus.py's sample), reported as
{"name", "params": the largest relative parameter difference after the steps, "worst": the
variable it is in, "same_names", "loss": the largest relative loss difference}; or {"name",
"train", "data", "batch", "out"}: the model trained by ``vfgraph train`` on DATA into OUT,
reported as {"name", "trained": OUT}. A case that fails: {"name", "error": its first line}.
"""
import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                                "examples"))  # corpus.py: its models' inputs


def _say(obj) -> None:
    print(json.dumps(obj), flush=True)


def main() -> None:
    with open(sys.argv[1]) as f:
        config = json.load(f)

    from vfgraph.runtime.devices import one_cpu_per_stage

    one_cpu_per_stage(config["devices"])

    from vfgraph.io.savedmodel import load_to_run
    import corpus
    from vfgraph.testing.compare import _tf_line, make_inputs, rel_diff

    def run(path, placed, batch, inputs):
        loaded = load_to_run(path, variable_devices=placed)  # (a signature needs its object alive)
        fn = loaded.signatures["train"]
        losses = [float(fn(**inputs(fn, batch, seed=s))["loss"]) for s in range(config["steps"])]
        return {v.name: v.numpy() for v in fn.variables}, losses

    baselines = {}
    for case in config["cases"]:
        _say({"start": case["name"]})
        try:
            if "train" in case:  # vfgraph train here (its threads as this process's)
                from vfgraph.runtime.train import train

                train(case["train"], case["data"], config["steps"], case["batch"], case["out"], progress=False,
                      force=True)
                _say({"name": case["name"], "trained": case["out"]})
                continue
            inputs = corpus.sample if case.get("corpus") else make_inputs
            key = (case["baseline"], case["batch"])
            if key not in baselines:
                baselines[key] = run(case["baseline"], False, case["batch"], inputs)
            want, want_losses = baselines[key]
            got, losses = run(case["model"], True, case["batch"], inputs)
            worst = max(((rel_diff(want[k], got[k]), k) for k in want if k in got and want[k].dtype.kind == "f"),
                        default=(0.0, ""))
            loss = max(abs(a - b) / max(abs(a), 1e-3) for a, b in zip(want_losses, losses))
            _say({"name": case["name"], "params": worst[0], "worst": worst[1],
                  "same_names": sorted(want) == sorted(got), "loss": loss})
        except Exception as e:  # reported, and the next case runs
            _say({"name": case["name"], "error": f"{type(e).__name__}: {_tf_line(str(e))}"})


if __name__ == "__main__":
    main()
