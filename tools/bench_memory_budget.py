"""A memory budget chooses the virtual-node batch b: is the budget kept, and is it used?

For each model (keras.applications MobileNetV2 and ResNet-50 at 64x64, weights=None, SGD with
momentum; a keras-hub GPT-2 backbone of 2 layers, width 128, 64 tokens, Adam): ``vfgraph
profile`` measures the training step's peak memory at b = 1, 2, 4, .., 32 (TensorFlow's BFC
allocator on the CPU, a process of its own), then for each of three budgets ``vfgraph.rewrite``
chooses b from that profile (``memory_budget``, ``profile``: the 10% margin). The check is of the
real rewritten step: the budget's rewrite (at the chosen b) and a rewrite at b + 1
(``vnode_batch``) are saved, and the peak of each rewritten training step is measured the same way on a global batch of two
virtual nodes (the loop, its sums, the fed batch). Reported: the chosen b, the peak at b
(target: <= the budget, and >= 0.7 of it: not wasted) and at b + 1 (target: over the budget
less the margin: b + 1 would not have fitted).

The three budgets are those that leave room, by the profile's fit, for about 4, 16 and 40
examples above the fixed part, rounded up to a MiB; the rewrite chooses b from them itself.

    python tools/bench_memory_budget.py [--models gpt2,mobilenet_v2,resnet50] [--workdir DIR]
        [--json docs/results/bench_memory_budget.json]
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import subprocess
import sys
import tempfile
import time

from benchlib import ROOT, git_state, write_report

MODELS = ("gpt2", "mobilenet_v2", "resnet50")
TARGETS = (4, 16, 40)  # examples of room above the fixed part, by the profile's fit: the three budgets
VNODES = 2  # virtual nodes of the measured global batch
MIB = 1 << 20


def export(name: str, out: str) -> str:
    """Write model ``name`` as a training SavedModel (examples/corpus.py's form) at ``out``."""
    import corpus

    if os.path.exists(out):
        return out
    corpus.IMAGE, corpus.SEQ = 64, 64
    if name in ("mobilenet_v2", "resnet50"):
        app = {"mobilenet_v2": "MobileNetV2", "resnet50": "ResNet50"}[name]
        corpus._application(app, out, "momentum", lr=0.01)
    else:
        import keras_hub

        corpus._seed()
        bb = keras_hub.models.GPT2Backbone(vocabulary_size=corpus.VOCAB, num_layers=2, num_heads=4, hidden_dim=128,
                                           intermediate_dim=512, max_sequence_length=corpus.SEQ)
        corpus._causal_lm(out, "adam", keras_hub.models.GPT2CausalLM(bb, preprocessor=None), lr=0.001)
    return out


def vf(*argv) -> str:
    res = subprocess.run([sys.executable, "-m", "vfgraph.cli", *map(str, argv)], capture_output=True, text=True)
    if res.returncode != 0:
        raise SystemExit(f"vfgraph {' '.join(map(str, argv))} failed: {res.stderr.strip()[-800:]}")
    return res.stdout


def step_peak(item, b: int, out: str) -> int:
    """The peak of the training step of the rewritten ``item`` (b examples per virtual node),
    saved at ``out``, on a global batch of VNODES x b."""
    import vfgraph
    from vfgraph.analysis.memory import measure_peaks

    vfgraph.save(item, out, force=True)
    return measure_peaks(out, "train", (VNODES * b,)).peaks[0]


def one_model(name: str, root: str) -> dict:
    import vfgraph
    from vfgraph.analysis.memory import DEFAULT_MARGIN, fit_line
    from vfgraph.records import VirtualNodes, get

    model = export(name, os.path.join(root, name))
    profile = os.path.join(root, name + ".profile.json")
    t0 = time.perf_counter()
    if not os.path.exists(profile):
        vf("profile", model, "--batch", 4, "--steps", 2, "-o", profile)
    profile_s = time.perf_counter() - t0
    with open(profile) as f:
        memory = json.load(f)["memory"]
    fixed, per = fit_line(memory["batches"], memory["peaks"])
    rows = []
    for target in TARGETS:
        budget = int(math.ceil((fixed + per * target) / (1 - DEFAULT_MARGIN) / MIB)) * MIB
        item = vfgraph.rewrite(model, memory_budget=str(budget), profile=profile, allreduce="none")
        fit = get(item, VirtualNodes)["train"].memory
        b = fit.chosen
        at_b = step_peak(item, b, os.path.join(root, f"{name}_b{b}"))
        at_next = step_peak(vfgraph.rewrite(model, vnode_batch=b + 1, allreduce="none"), b + 1,
                            os.path.join(root, f"{name}_b{b + 1}"))
        row = {"budget": budget, "chosen": b, "fixed": fit.fixed, "per_example": fit.per_example,
               "peak_at_b": at_b, "peak_at_next": at_next, "used": round(at_b / budget, 4),
               "next_over_margin": at_next > budget * (1 - fit.margin), "within_budget": at_b <= budget}
        rows.append(row)
        print(f"{name:13s} budget {budget / MIB:8.1f} MiB: b={b:3d}, peak {at_b / MIB:8.1f} MiB "
              f"({row['used']:.0%} of the budget), at b+1 {at_next / MIB:8.1f} MiB", flush=True)
    return {"model": name, "profile": memory, "profile_s": round(profile_s, 1), "margin": DEFAULT_MARGIN,
            "budgets": rows}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default=",".join(MODELS), help="models, comma-separated (default: all three)")
    p.add_argument("--workdir", default="", help="where the exported models go (default: a temporary directory)")
    p.add_argument("--json", default="", help="write the report here")
    a = p.parse_args()
    sys.path.insert(0, os.path.join(ROOT, "examples"))
    import tensorflow as tf

    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in a.models.split(","):
            results.append(one_model(name, a.workdir or tmp))
            if a.json:  # (after each model: a run cut short keeps what it measured)
                write_report(a.json, {"config": {"vnodes": VNODES, "targets": list(TARGETS),
                                                 "tensorflow": tf.__version__, "cpu_count": os.cpu_count(),
                                                 "machine": platform.machine(), "git": git_state()},
                                      "results": results})
    print(f"\n{'model':13s} {'budget MiB':>10s} {'b':>4s} {'peak at b':>10s} {'used':>5s} {'peak at b+1':>11s}  ok")
    for r in results:
        for x in r["budgets"]:
            ok = x["within_budget"] and x["used"] >= 0.7 and x["next_over_margin"]
            print(f"{r['model']:13s} {x['budget'] / MIB:10.1f} {x['chosen']:4d} {x['peak_at_b'] / MIB:10.1f} "
                  f"{x['used']:5.0%} {x['peak_at_next'] / MIB:11.1f}  {'yes' if ok else 'NO'}")

if __name__ == "__main__":
    main()
