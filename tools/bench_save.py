"""Saving a rewritten SavedModel: time and peak memory of ``vfgraph.save`` with the checkpoint
written in groups of at most G bytes (then merged by MergeV2Checkpoints) against the whole
checkpoint in one SaveV2 call, measured in the same run.

The model is ResNet-50 (keras.applications, weights=None, 64x64 inputs, 10 classes, SGD with
momentum, as in bench_rewrite.py; the checkpoint holds its variables, optimizer slots and the
zeroed gradient accumulators the rewrite adds), rewritten with 8 virtual nodes of 16 (--quick:
MobileNetV2(alpha=0.35)). Each save runs in its own fresh process (rewrite first, not timed);
peak memory is the resident set's high-water mark during the save (reset just before it, read
after) less the resident set just before it. The group sizes alternate, three rounds;
reported: median time and median peak per group size, and their ratios to the whole
checkpoint's.

    python tools/bench_save.py [--quick] [--json PATH]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

from benchlib import git_state, proc_status, reset_hwm, write_report

WHOLE = 1 << 40  # larger than any checkpoint here: one SaveV2 call
GROUPS = [("whole", WHOLE), ("64 MB (default)", 64 << 20), ("16 MB", 16 << 20)]


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="MobileNetV2(0.35) instead of ResNet-50")
    p.add_argument("--json", default="/tmp/vfgraph_bench_save.json")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--child", nargs=2, metavar=("MODEL", "GROUP_BYTES"), help=argparse.SUPPRESS)
    return p.parse_args()


def child(model: str, group_bytes: int) -> None:
    """Rewrite ``model``, then save it once with checkpoint groups of ``group_bytes``; prints JSON."""
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    import vfgraph
    from vfgraph.io import checkpoint

    item = vfgraph.rewrite(model, vnodes=8, vnode_batch=16)
    checkpoint.GROUP_BYTES = group_bytes
    with tempfile.TemporaryDirectory(prefix="vfgraph-bench-save-") as d:
        before = proc_status("VmRSS")
        if not reset_hwm():  # the rewrite's own peak would be read as the save's
            raise SystemExit("bench_save: cannot reset the memory high-water mark (/proc/self/clear_refs)")
        t0 = time.perf_counter()
        out = vfgraph.save(item, os.path.join(d, "m"))
        seconds = time.perf_counter() - t0
        peak_mb = (proc_status("VmHWM") - before) / 2 ** 20
        var_dir = os.path.join(out, "variables")
        print(json.dumps({"seconds": seconds, "peak_mb": peak_mb,
                          "shards": sum(".data-" in f for f in os.listdir(var_dir)),
                          "checkpoint_mb": sum(os.path.getsize(os.path.join(var_dir, f))
                                               for f in os.listdir(var_dir)) / 2 ** 20}))


def main():
    args = parse_args()
    if args.child:
        child(args.child[0], int(args.child[1]))
        return
    import bench_rewrite

    which = "mobilenetv2-0.35" if args.quick else "resnet50"
    print(f"vfgraph bench_save: {which}, checkpoint groups {[g for g, _ in GROUPS]}, {args.rounds} rounds, "
          "each save in a fresh process", flush=True)
    work = tempfile.mkdtemp(prefix="vfgraph-bench-save-")
    model = os.path.join(work, "model")
    subprocess.run([sys.executable, "-c", "import sys; sys.path.insert(0, sys.argv[1]); import bench_rewrite; "
                    "bench_rewrite.export_keras_app(sys.argv[2], sys.argv[3])",
                    os.path.dirname(os.path.abspath(bench_rewrite.__file__)), model, which], check=True,
                   stderr=subprocess.DEVNULL)
    runs = {label: [] for label, _ in GROUPS}
    for r in range(args.rounds):
        for label, size in GROUPS:
            res = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", model, str(size)],
                                 capture_output=True, text=True)
            if res.returncode != 0:
                print(res.stderr[-3000:])
                raise SystemExit(f"save with groups of {label} failed")
            ev = json.loads(res.stdout.strip().splitlines()[-1])
            runs[label].append(ev)
            print(f"  round {r + 1} {label:>16}: {ev['seconds']:.2f} s, peak +{ev['peak_mb']:.0f} MB, "
                  f"{ev['shards']} shard(s)", flush=True)
    subprocess.run(["rm", "-rf", work])
    whole = runs["whole"]
    base_s = statistics.median(e["seconds"] for e in whole)
    base_mb = statistics.median(e["peak_mb"] for e in whole)
    rows = []
    print(f"\ncheckpoint {whole[0]['checkpoint_mb']:.0f} MB")
    print(f"{'groups':>16} {'save s':>8} {'peak MB':>8} {'time/whole':>11} {'peak/whole':>11} {'shards':>7}")
    for label, size in GROUPS:
        s = statistics.median(e["seconds"] for e in runs[label])
        mb = statistics.median(e["peak_mb"] for e in runs[label])
        rows.append({"groups": label, "group_bytes": size, "save_s": s, "peak_mb": mb, "time_ratio": s / base_s,
                     "peak_ratio": mb / base_mb, "shards": runs[label][0]["shards"], "runs": runs[label]})
        print(f"{label:>16} {s:8.2f} {mb:8.0f} {s / base_s:11.2f} {mb / base_mb:11.2f} {runs[label][0]['shards']:7d}")
    write_report(args.json, {"benchmark": "save", "model": which, "checkpoint_mb": whole[0]["checkpoint_mb"],
                             "rows": rows, "machine": platform.platform(), "cpus": os.cpu_count(), **git_state()})


if __name__ == "__main__":
    main()
