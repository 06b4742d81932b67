"""Stage cuts balanced by a profile against cuts balanced by the FLOP estimate, on models of the
real-architecture corpus (examples/corpus.py) and the pipeline benchmark's MLP.

For each model and K: the training step is profiled twice on a synthetic batch of ``--batch``
examples (vfgraph.analysis.profile: one thread, per-op step statistics, each run a median of
10 steps). The first profile chooses the cuts (``--balance profile``); the second, taken
after it, times both plans' stages, so that the comparison does not favour the profile that
chose the cuts by its own noise. Reported: each plan's largest stage as a share of the
stages' total measured time (1/K is perfect balance) and the speed-up of the slowest stage
(what bounds a pipeline's cycle) from the estimate's cuts to the profile's.

    python tools/bench_balance.py [--models vit,t5,...] [--stages 2,3] [--json docs/results/bench_balance.json]
"""
from __future__ import annotations

import argparse
import os
import platform
import sys
import tempfile
import time

from benchlib import ROOT, git_state, write_report

MODELS = ("gpt2", "bart", "t5", "vit", "gru", "mixtral", "densenet121", "mlp")


def export(name: str, root: str) -> str:
    out = os.path.join(root, name)
    if os.path.exists(out):
        return out
    if name == "mlp":  # the pipeline benchmark's model: 8 Dense(512) on 768 inputs
        import bench_pipeline

        bench_pipeline.export_model(out, 8, 512, inputs=768)
    else:
        import corpus

        corpus.export(name, out)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default=",".join(MODELS), help="corpus models (and 'mlp'), comma-separated")
    p.add_argument("--stages", default="2,3", help="stage counts K, comma-separated")
    p.add_argument("--batch", type=int, default=4, help="examples in the profiled batch (default 4)")
    p.add_argument("--workdir", default="", help="where the exported models go (default: a temporary directory)")
    p.add_argument("--json", default="", help="write the report here")
    a = p.parse_args()
    sys.path.insert(0, os.path.join(ROOT, "tools"))
    import tensorflow as tf

    import vfgraph
    from vfgraph.analysis.profile import profile_step
    from vfgraph.analysis.stages import plan_stages
    from vfgraph.analysis.train_step import analyze_train_step
    from vfgraph.ir.graph import FunctionGraph

    ks = [int(k) for k in a.stages.split(",")]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        root = a.workdir or tmp
        for name in a.models.split(","):
            path = export(name, root)
            item = vfgraph.load(path)
            sig = item.training_signature()
            g = FunctionGraph(item.library[sig.function], item.library)
            step = analyze_train_step(g, sig)
            t0 = time.perf_counter()
            chooser = profile_step(path, sig, batch=a.batch)
            profile_s = time.perf_counter() - t0
            judge = profile_step(path, sig, batch=a.batch)
            for k in ks:
                est = plan_stages(g, step, k)
                prof = plan_stages(g, step, k, profile=chooser)
                timed = {how: plan_stages(g, step, k, plan.split_at, judge)
                         for how, plan in (("estimate", est), ("profile", prof))}
                row = {"model": name, "stages": k, "nodes": len(g.nodes), "profile_s": round(profile_s, 2),
                       "step_ms": round(judge.step_us / 1e3, 3),
                       "same_cuts": est.split_at == prof.split_at}
                for how, plan in timed.items():
                    ms = [st.measured_ns / 1e6 for st in plan.stages]
                    row[how] = {"cuts": list(plan.split_at), "stage_ms": [round(x, 3) for x in ms],
                                "largest_share": round(max(ms) / max(sum(ms), 1e-9), 4),
                                "flops_share": round(max(st.flops for st in plan.stages) / max(plan.flops, 1), 4)}
                row["slowest_stage_speedup"] = round(max(row["estimate"]["stage_ms"]) /
                                                     max(max(row["profile"]["stage_ms"]), 1e-9), 3)
                rows.append(row)
                print(f"{name:12s} K={k}: largest stage {row['estimate']['largest_share']:.0%} (estimate's cuts) -> "
                      f"{row['profile']['largest_share']:.0%} (profile's); slowest stage "
                      f"{row['slowest_stage_speedup']:.2f}x faster; profile {profile_s:.1f} s", flush=True)
    print(f"\n{'model':12s} {'K':>2s} {'estimate':>9s} {'profile':>8s} {'speed-up':>9s}")
    for r in rows:
        print(f"{r['model']:12s} {r['stages']:2d} {r['estimate']['largest_share']:9.0%} "
              f"{r['profile']['largest_share']:8.0%} {r['slowest_stage_speedup']:9.2f}")
    if a.json:
        write_report(a.json, {"config": {"batch": a.batch, "stages": ks, "tensorflow": tf.__version__,
                                         "cpu_count": os.cpu_count(), "machine": platform.machine(),
                                         "git": git_state()},
                              "results": rows})


if __name__ == "__main__":
    main()
