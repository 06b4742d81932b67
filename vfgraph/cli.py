"""vfgraph command line: rewrite | inspect | diff | verify | train | export | build-ops."""
from __future__ import annotations

import argparse
import collections
import difflib
import json
import logging
import os
import sys
from typing import List, Optional

from vfgraph import __version__

log = logging.getLogger("vfgraph")


def _quiet_tf() -> None:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="vfgraph", description=(
        "Rewrite exported TensorFlow models: virtual nodes (large batches on small hardware, the same "
        "training on any hardware) and micro-batched serving."))
    p.add_argument("--version", action="version", version=f"vfgraph {__version__}")
    p.add_argument("-v", "--verbose", action="store_true", help="log each pass")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    r = sub.add_parser("rewrite", help="rewrite a model with virtual nodes")
    r.add_argument("model", help="SavedModel directory, frozen GraphDef (.pb, .pbtxt), or TF1 MetaGraphDef (.meta, "
                                 "or a checkpoint directory) with its checkpoint")
    r.add_argument("--vnodes", type=int, default=1, help="virtual nodes per training step (V)")
    r.add_argument("--vnode-batch", type=int, default=0,
                   help="examples per virtual node (b); default: static batch / V, or fed batch / V")
    r.add_argument("-o", "--output", help="output SavedModel directory (default: MODEL_vnodesV)")
    r.add_argument("--pipeline", help="pass pipeline, e.g. 'split-vnodes{vnodes=8},microbatch-inference'")
    r.add_argument("--train-signature", default="", help="name of the training signature (default: 'train')")
    r.add_argument("--print-after-all", action="store_true", help="print the canonical graph after each pass")
    r.add_argument("--force", action="store_true", help="replace OUTPUT if it exists")
    r.add_argument("--outputs", help="frozen GraphDefs: comma-separated output tensors (default: unconsumed nodes)")
    r.add_argument("--allreduce", choices=("mpi", "none"), default="mpi",
                   help="data-parallel all-reduce over MPI ranks in a TF2 training step (default mpi: the same "
                        "output on every machine; loading it needs vfgraph's ops, so serve a 'vfgraph export' of it; "
                        "none: no collectives)")
    r.add_argument("--fusion-mb", type=float, default=4, help="largest fused all-reduce buffer, MiB (default 4)")
    _tf1_options(r)

    i = sub.add_parser("inspect", help="show what vfgraph detects in a model")
    i.add_argument("model")
    i.add_argument("--train-signature", default="")
    i.add_argument("--json", action="store_true", help="machine-readable output")
    _tf1_options(i)

    d = sub.add_parser("diff", help="canonical unified diff of two models (exit 1 when they differ)")
    d.add_argument("a")
    d.add_argument("b")

    v = sub.add_parser("verify", help="run original and rewritten models on the same inputs and compare")
    v.add_argument("original")
    v.add_argument("rewritten")
    v.add_argument("--steps", type=int, default=3)
    v.add_argument("--batch-size", type=int, default=32)
    v.add_argument("--data", help=".npz with the signature's inputs (default: random inputs)")
    v.add_argument("--train-signature", default="train")
    v.add_argument("--rtol", type=float, default=1e-5, help="largest relative parameter difference accepted")

    t = sub.add_parser("train", help="train a SavedModel on arrays from an .npz file")
    t.add_argument("model")
    t.add_argument("--data", required=True, help=".npz whose array names match the training signature's inputs, "
                   "or TFRecord files (.tfrecord, or a glob) of tf.train.Example records with those features")
    t.add_argument("--steps", type=int, required=True)
    t.add_argument("--batch-size", type=int, required=True, help="global batch per step")
    t.add_argument("-o", "--output", required=True)
    t.add_argument("--resume", action="store_true", help="continue from the last checkpoint of OUTPUT")
    t.add_argument("--force", action="store_true")
    t.add_argument("--train-signature", default="train")
    t.add_argument("--checkpoint-every", type=int, default=100)
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--no-progress", action="store_true")
    t.add_argument("--vnodes-per-rank", help="under mpiexec: virtual nodes of each rank, e.g. 5,3 "
                   "(default: the global batch's virtual nodes split evenly)")
    t.add_argument("--threads", type=int, help="TensorFlow intra-op threads per rank, with one inter-op thread (default: the "
                   "CPUs a rank is bound to, or this host's CPUs divided by the ranks on it)")

    e = sub.add_parser("export", help="write a serving-only SavedModel (TF Serving's OUTPUT/VERSION/ layout) that "
                                      "TensorFlow serves without vfgraph")
    e.add_argument("model", help="SavedModel directory (an original model or a rewritten one)")
    e.add_argument("-o", "--output", required=True, help="base directory; the model is written to OUTPUT/VERSION/")
    e.add_argument("--version", type=int, default=1, help="version directory under OUTPUT (default 1)")
    e.add_argument("--vnode-batch", type=int, default=0,
                   help="serve in slices of at most this many examples (default: the model's own b, if it has one)")
    e.add_argument("--force", action="store_true", help="replace OUTPUT/VERSION if it exists")

    bo = sub.add_parser("build-ops", help="build (or find) vfgraph's MPI ops for this TensorFlow and MPI")
    bo.add_argument("--force", action="store_true", help="build again even if the cache holds them")
    return p


def _tf1_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--checkpoint", help="TF1 .meta input: checkpoint prefix (default: the .meta path without .meta)")
    p.add_argument("--loss", default="", help="TF1 .meta input without a 'train' signature: the loss tensor "
                                              "(default: found from the gradient computation)")


def main(argv: Optional[List[str]] = None) -> int:
    _quiet_tf()
    args = _parser().parse_args(argv)
    if args.command == "train":
        from vfgraph.runtime.supervise import is_worker, supervise
        from vfgraph.runtime.world import launched_by_mpi

        if launched_by_mpi() and not is_worker():  # one rank of mpiexec: report how it ends
            return supervise(sys.argv[1:] if argv is None else list(argv))
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("vfgraph: %(message)s"))
    log.addHandler(handler)
    log.setLevel(logging.INFO if args.verbose else logging.WARNING)
    log.propagate = False
    from vfgraph.errors import VfgraphError

    try:
        return {"rewrite": cmd_rewrite, "inspect": cmd_inspect, "diff": cmd_diff,
                "verify": cmd_verify, "train": cmd_train, "export": cmd_export,
                "build-ops": cmd_build_ops}[args.command](args)
    except VfgraphError as e:
        print(f"vfgraph {args.command}: error: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print("vfgraph: interrupted", file=sys.stderr)
        return 130


def cmd_rewrite(args) -> int:
    import vfgraph
    from vfgraph.errors import InputError
    from vfgraph.io.savedmodel import prepare_output
    from vfgraph.ir.canonical import canonical_text

    if args.vnodes < 1:
        raise InputError(f"--vnodes {args.vnodes}: needs at least 1 virtual node")
    stem, ext = os.path.splitext(os.path.normpath(args.model))
    out = args.output or (stem + f"_vf{ext}" if ext in (".pb", ".pbtxt") else
                          stem + ("" if ext == ".meta" else ext) + f"_vnodes{args.vnodes}")
    prepare_output(out, args.force)
    after = None
    if args.print_after_all:
        def after(p, item):
            print(f"// ----- after {p.spec()}")
            print(canonical_text(item))
    item = vfgraph.rewrite(args.model, vnodes=args.vnodes, vnode_batch=args.vnode_batch,
                           pipeline=args.pipeline, train_signature=args.train_signature, after_each=after,
                           outputs=args.outputs.split(",") if args.outputs else None,
                           allreduce=args.allreduce, fusion_mb=args.fusion_mb, checkpoint=args.checkpoint,
                           loss=args.loss)
    path = vfgraph.save(item, out, force=args.force)
    for note in item.metadata.get("notes", []):
        print(f"note: {note}", file=sys.stderr)
    reduced = bool(item.metadata.get("rewrites", {}).get("insert-allreduce"))
    print(f"wrote {path} (all-reduce: {'mpi' if reduced else 'none'}; {item.metadata['history'][-1]['pipeline']})")
    return 0


def cmd_inspect(args) -> int:
    import vfgraph
    from vfgraph.analysis.train_step import analyze_train_step
    from vfgraph.ir.graph import FunctionGraph, function_dependencies

    item = vfgraph.load(args.model, checkpoint=args.checkpoint, loss=args.loss)
    lib = item.library
    report = {"model": item.source, "signatures": {}, "rewrites": item.metadata.get("rewrites", {}),
              "history": item.metadata.get("history", [])}
    train = item.training_signature(args.train_signature or None)
    for key, sig in sorted(item.signatures.items()):
        g = FunctionGraph(lib[sig.function], lib)
        hist = collections.Counter(n.op for f in function_dependencies(sig.function, lib) for n in lib[f].node_def)
        entry = {
            "function": sig.function,
            "inputs": {sig.input_keys[a]: g.arg_shape(a) for a in sig.batch_args},
            "outputs": {name: g.shape(ref) for name, ref in g.output_refs()},
            "variables": [sig.variables[r].name for r in sig.resource_args],
            "ops": dict(sorted(hist.items(), key=lambda kv: (-kv[1], kv[0]))),
        }
        if train is not None and key == train.key and key not in item.metadata.get("rewrites", {}).get("split-vnodes", {}):
            step = analyze_train_step(g, sig)
            name = lambda r: sig.variables[r].name  # noqa: E731
            entry["training"] = {
                "gradients": [{"variable": name(c.variable) if c.variable else None, "tensor": str(c.ref),
                               "shape": c.shape, "role": c.role} for c in step.cut],
                "trainable": [name(r) for r in step.trainable],
                "batch_dependent_updates": [name(r) for r in step.batch_updated],
                "optimizer_state": [name(r) for r in step.optimizer_state],
                "per_vnode_nodes": len(step.vnode_nodes),
            }
        report["signatures"][key] = entry
    if args.json:
        print(json.dumps(report, indent=2, sort_keys=True))
        return 0
    print(f"model: {item.source}")
    for r in report["history"]:
        print(f"rewritten by vfgraph {r.get('vfgraph_version')}: {r['pipeline']} (source {str(r.get('source_fingerprint'))[:16]})")
    for key, e in report["signatures"].items():
        kind = "training" if "training" in e or key in report["rewrites"].get("split-vnodes", {}) else "inference"
        print(f"\nsignature {key!r} ({kind}) -> {e['function']}")
        print(f"  inputs:  {', '.join(f'{k}{v}' for k, v in e['inputs'].items())}")
        print(f"  outputs: {', '.join(f'{k}{v if v is not None else [-1]}' for k, v in e['outputs'].items())}")
        print(f"  variables: {len(e['variables'])}")
        rw = report["rewrites"].get("split-vnodes", {}).get(key)
        if rw:
            print(f"  virtual nodes: V={rw['vnodes']} b={rw['vnode_batch'] or 'fed batch / V'}")
            if rw.get("stepwise"):
                print(f"  step-wise: signatures {key + '_accumulate'!r} (repeat) and {key + '_apply'!r}")
        ar = report["rewrites"].get("insert-allreduce", {}).get(key)
        if ar:
            fused = [b for b in ar["buffers"][0] if b[0].startswith("sum_")]
            print(f"  all-reduce over MPI ranks: {len(fused)} fused buffer(s) of at most {ar['fusion_mb']:g} MiB "
                  f"({sum(map(len, fused))} tensors), {len(ar['buffers'][0]) - len(fused)} gathered; "
                  f"start with signature {ar['broadcast_signature']!r}; graph fingerprint {ar['fingerprint'][:16]}")
        elif rw:
            print("  all-reduce: none (each process trains alone; rewrite with --allreduce mpi for mpiexec)")
        if "training" in e:
            t = e["training"]
            print("  gradients (tensor -> variable):")
            for gr in t["gradients"]:
                print(f"    {gr['tensor']} {gr['shape']} -> {gr['variable'] or '(' + gr['role'] + ')'}")
            print(f"  optimizer state: {', '.join(t['optimizer_state']) or 'none'}")
            print(f"  batch-dependent updates: {', '.join(t['batch_dependent_updates']) or 'none'}")
        top = list(e["ops"].items())[:12]
        print(f"  ops: {', '.join(f'{k} {v}' for k, v in top)}{' ...' if len(e['ops']) > 12 else ''}")
    return 0


def cmd_diff(args) -> int:
    import vfgraph
    from vfgraph.ir.canonical import canonical_text

    a, b = (canonical_text(vfgraph.load(p)).splitlines(keepends=True) for p in (args.a, args.b))
    lines = list(difflib.unified_diff(a, b, fromfile=args.a, tofile=args.b))
    sys.stdout.writelines(lines)
    return 1 if lines else 0


def cmd_verify(args) -> int:
    from vfgraph.testing.compare import compare_models

    data = None
    if args.data:
        from vfgraph.runtime.train import load_npz

        data = load_npz(args.data)
    rep = compare_models(args.original, args.rewritten, steps=args.steps, batch=args.batch_size,
                         data=data, train_signature=args.train_signature)
    for key, err in rep.serving.items():
        print(f"serving {key}: max abs output difference {err:.3g}")
    for step, la, lb in rep.loss:
        print(f"train step {step}: loss original {la:.6g} rewritten {lb:.6g}")
    if rep.params:
        worst = max(rep.params, key=rep.params.get)
        print(f"parameters after {args.steps} steps: max relative difference {rep.worst_param:.3g} ({worst})")
    ok = rep.worst_param <= args.rtol
    print("OK" if ok else f"MISMATCH: parameter difference above --rtol {args.rtol}")
    return 0 if ok else 1


def cmd_train(args) -> int:
    from vfgraph.errors import InputError
    from vfgraph.runtime.train import train

    per_rank = None
    if args.vnodes_per_rank:
        try:
            per_rank = [int(v) for v in args.vnodes_per_rank.split(",")]
        except ValueError:
            raise InputError(f"--vnodes-per-rank {args.vnodes_per_rank}: give comma-separated integers, e.g. 5,3")
    res = train(args.model, args.data, args.steps, args.batch_size, args.output, resume=args.resume,
                force=args.force, signature=args.train_signature, checkpoint_every=args.checkpoint_every,
                seed=args.seed, progress=not args.no_progress, vnodes_per_rank=per_rank, threads=args.threads)
    if res is not None:  # rank 0 (or the only process)
        from vfgraph.io.serving import sibling_dir, target_dir

        serve = target_dir(sibling_dir(res.out), 1)
        print(f"trained {res.steps} steps: loss {res.losses[0]:.4f} -> {res.losses[-1]:.4f}; wrote {res.out}"
              + (f" and, to serve, {serve}" if os.path.isdir(serve) else ""))
    return 0


def cmd_export(args) -> int:
    import vfgraph
    from vfgraph.io.savedmodel import read_metadata

    path = vfgraph.export(args.model, args.output, version=args.version, vnode_batch=args.vnode_batch,
                          force=args.force)
    rec = (read_metadata(path) or {}).get("serving_export", {})
    sliced = rec.get("vnode_batch", {})
    sigs = ", ".join(f"{k} (slices of {sliced[k]})" if k in sliced else k for k in rec.get("signatures", []))
    print(f"wrote {path} (serving only: {sigs})")
    return 0


def cmd_build_ops(args) -> int:
    from vfgraph.ops import build_ops_main

    return build_ops_main(["--force"] if args.force else [])


if __name__ == "__main__":
    sys.exit(main())
