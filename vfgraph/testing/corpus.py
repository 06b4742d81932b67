"""The checks every model of the real-architecture corpus passes (tests/corpus, tools/corpus_sweep.py).

For one exported model: the rewrite succeeds; the output loads in a fresh process and serves
what it serves here; serving (micro-batched) equals the original's; V=1 is bit-identical to
the original step; V=4 equals the full-batch step under SGD (no batch statistics or dropout),
or a reference built from the original run on each slice (batch norm: per-virtual-node
statistics, moving averages averaged); with dropout, the step trains.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Callable, Dict, List, Optional

import numpy as np

import vfgraph
from vfgraph.errors import VfgraphError
from vfgraph.testing import c_api
from vfgraph.testing.compare import rel_diff, variable_values

VNODES = 4
VNODE_BATCH = 2
BATCH = VNODES * VNODE_BATCH
SERVE_BATCH = 7  # not a multiple of the slice: the last slice is short


@dataclass
class CorpusResult:
    name: str
    params: int = 0
    nodes: int = 0                   # nodes of the training (or serving) function
    rewrite_s: float = 0.0           # vfgraph.rewrite, V=4
    refused: str = ""
    serving_error: Optional[float] = None     # max |rewritten - original| / max(|original|, 1)
    v1_identical: Optional[bool] = None
    v1_differing: List[str] = field(default_factory=list)
    v1_error: Optional[float] = None                        # worst relative difference when not identical
    # Grappler's arithmetic optimizer reassociates the original graph's arithmetic across what
    # becomes the cut (batch norm's gradients): V=1 compared with it off, in a fresh process
    v1_identical_without_arithmetic: Optional[bool] = None
    v4_error: Optional[float] = None          # worst relative parameter difference
    v4_reference: str = ""                    # what V=4 was compared with
    fresh_load: Optional[bool] = None
    fresh_error: str = ""
    export_error: Optional[float] = None       # vfgraph export, served by a process without vfgraph
    export_c_api_error: Optional[float] = None  # the same export served through the C API
    export_problem: str = ""
    # (train_save) vfgraph train on the V=4 rewrite: the trained model served in a fresh process
    # (without vfgraph when it holds none of its ops) and its serving export (without vfgraph),
    # against the trained model here
    trained_error: Optional[float] = None
    trained_export_error: Optional[float] = None
    trained_problem: str = ""

    def checks(self) -> List[str]:
        out = []
        if self.serving_error is not None:
            out.append("serving")
        if self.v1_identical:
            out.append("V=1 exact")
        elif self.v1_identical_without_arithmetic:
            out.append(f"V=1 exact without Grappler arithmetic ({self.v1_error:.0e} with)")
        if self.v4_error is not None:
            out.append(f"V=4 ({self.v4_reference})")
        if self.fresh_load:
            out.append("fresh load")
        if self.export_error is not None and self.export_error < 1e-5:
            out.append("export served without vfgraph")
        if self.export_c_api_error is not None and self.export_c_api_error < 1e-5:
            out.append("export served by the C API")
        if self.trained_error is not None and self.trained_error < 1e-5 and (self.trained_export_error or 0) < 1e-5:
            out.append("trained, saved and served")
        return out


Sample = Callable[[object, int, int], Dict[str, np.ndarray]]


def _serving_key(loaded) -> Optional[str]:
    keys = sorted(k for k in loaded.signatures if not k.startswith("train"))
    return "serving_default" if "serving_default" in keys else (keys[0] if keys else None)


def _serve(fn, inputs) -> Dict[str, np.ndarray]:
    return {k: v.numpy() for k, v in fn(**inputs).items()}


def _output_error(a: Dict[str, np.ndarray], b: Dict[str, np.ndarray]) -> float:
    worst = 0.0
    for k in a:
        x, y = np.asarray(a[k], np.float64), np.asarray(b[k], np.float64)
        if x.shape != y.shape:
            return float("inf")
        if x.size:
            worst = max(worst, float(np.max(np.abs(x - y)) / max(float(np.max(np.abs(x))), 1.0)))
    return worst


def _steps(fn, sample: Sample, steps: int, seed0: int = 0) -> List[float]:
    return [float(fn(**sample(fn, BATCH, seed0 + s))["loss"]) for s in range(steps)]


def _param_count(fn) -> int:
    return int(sum(np.prod(v.shape) for v in fn.variables if v.trainable))


def _per_slice_reference(fn, inputs: Dict[str, np.ndarray], vnodes: int) -> Dict[str, np.ndarray]:
    """The original step run on each slice from the same state; float variables averaged
    (for SGD, and for momentum from zero velocity, the parameter change is linear in the
    gradient, so the mean of the slices' changes is the virtual-node step's)."""
    start = variable_values(fn)
    b = len(next(iter(inputs.values()))) // vnodes
    finals = []
    for k in range(vnodes):
        for v in fn.variables:
            v.assign(start[v.name])
        fn(**{key: val[k * b:(k + 1) * b] for key, val in inputs.items()})
        finals.append(variable_values(fn))
    for v in fn.variables:
        v.assign(start[v.name])
    return {n: np.mean([f[n] for f in finals], axis=0) if start[n].dtype.kind == "f" else finals[-1][n] for n in start}


class _Fresh:
    """A check running in a new Python process while this one goes on; ``result()`` waits."""

    def __init__(self, argv: List[str], workdir: str, dst: str = ""):
        self.dst = dst
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=workdir,
                                     env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2"))

    def output(self) -> str:
        try:
            out, err = self.proc.communicate(timeout=600)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.communicate()
            raise
        if self.proc.returncode:
            raise RuntimeError((err.strip().splitlines() or ["no output"])[-1])
        return out

    def result(self) -> Dict[str, np.ndarray]:
        self.output()
        return dict(np.load(self.dst))


def _fresh_serve(path: str, key: str, inputs: Dict[str, np.ndarray], workdir: str, tags=None,
                 vfgraph: bool = True) -> _Fresh:
    """Start loading ``path`` in a new Python process to serve ``inputs``: stock TensorFlow, with
    vfgraph imported only for its ops (which a training model with the all-reduce needs, as the
    README says), or (``vfgraph=False``) in an isolated interpreter that never imports it."""
    tag = "vf" if vfgraph else "stock"
    src = os.path.join(workdir, f"fresh_in_{tag}.npz")
    dst = os.path.join(workdir, f"fresh_out_{tag}.npz")
    np.savez(src, **inputs)
    code = (
        f"import sys, numpy as np, tensorflow as tf{', vfgraph' if vfgraph else ''}\n"
        f"m = tf.saved_model.load({path!r}{', tags=' + repr(tags) if tags else ''})\n"
        f"x = dict(np.load({src!r}))\n"
        f"out = m.signatures[{key!r}](**x)\n"
        "assert any(n.startswith('vfgraph') for n in sys.modules) or not " + repr(vfgraph) + "\n"
        "assert not any(n.startswith('vfgraph') for n in sys.modules) or " + repr(vfgraph) + "\n"
        f"np.savez({dst!r}, **{{k: v.numpy() for k, v in out.items()}})\n")
    flags = [] if vfgraph else ["-I"]  # isolated: neither the working directory nor PYTHON* variables
    return _Fresh([sys.executable, *flags, "-c", code], workdir, dst)


def _v1_fresh(original: str, v1: str, batches: List[Dict[str, np.ndarray]], workdir: str) -> _Fresh:
    """Start training ``original`` and ``v1`` on ``batches`` in a process whose Grappler runs
    without its arithmetic optimizer; its output says whether the variables are bit-identical."""
    files = []
    for k, batch in enumerate(batches):
        files.append(os.path.join(workdir, f"v1_batch_{k}.npz"))
        np.savez(files[-1], **batch)
    code = (
        "import numpy as np, tensorflow as tf, vfgraph\n"
        "tf.config.optimizer.set_experimental_options({'arithmetic_optimization': False})\n"
        "vals = []\n"
        f"for p in ({original!r}, {v1!r}):\n"
        "    m = tf.saved_model.load(p); fn = m.signatures['train']\n"
        f"    [fn(**dict(np.load(f))) for f in {files!r}]\n"
        "    vals.append({v.name: v.numpy() for v in fn.variables})\n"
        "print('SAME' if all(np.array_equal(vals[0][n], vals[1].get(n)) for n in vals[0]) else 'DIFFERENT')\n")
    return _Fresh([sys.executable, "-c", code], workdir)


def check_model(name: str, original: str, workdir: str, sample: Sample, *, optimizer: str = "",
                batch_stats: bool = False, dropout: bool = False, sgd_variant: Optional[Callable[[], str]] = None,
                tags: Optional[List[str]] = None, c_api_client: str = "", train_save: bool = False) -> CorpusResult:
    """Run every corpus check on the exported model ``original``; outputs go under ``workdir``.
    ``sgd_variant()`` exports the same model with SGD, for the V=4 comparison of a model
    trained with an adaptive optimizer; ``c_api_client`` (vfgraph.testing.c_api.build_client)
    serves the serving export through TensorFlow's C API too; ``train_save``: the rewrite is
    trained with ``vfgraph train``, saved, served and resumed (:func:`_check_trained`). A
    refusal is returned in ``refused``."""
    import tensorflow as tf

    from vfgraph.ir.graph import FunctionGraph

    res = CorpusResult(name)
    os.makedirs(workdir, exist_ok=True)
    t = time.perf_counter()
    try:  # (a model without a training step: its serving micro-batched, the one rewrite it takes)
        trains = vfgraph.load(original).training_signature() is not None
        item = vfgraph.rewrite(original, vnodes=VNODES if trains else 1, vnode_batch=VNODE_BATCH)
    except VfgraphError as e:
        res.refused = str(e)
        return res
    res.rewrite_s = time.perf_counter() - t
    sig = item.training_signature() or (item.inference_signatures() or [None])[0]
    if sig is not None:
        src = vfgraph.load(original)
        res.nodes = len(FunctionGraph.over(src.function(sig.function), src.library).nodes)
    v4 = vfgraph.save(item, os.path.join(workdir, "v4"), force=True)
    training = item.training_signature() is not None and tags is None

    orig = tf.saved_model.load(original, tags=tags) if tags else tf.saved_model.load(original)
    new = tf.saved_model.load(v4, tags=tags) if tags else tf.saved_model.load(v4)
    _check_serving(res, orig, new, v4, workdir, sample, tags, c_api_client, train_save)
    if not training:
        return res
    res.params = _param_count(orig.signatures["train"])

    # V=1: the original step, bit for bit
    v1 = vfgraph.save(vfgraph.rewrite(original, vnodes=1), os.path.join(workdir, "v1"), force=True)
    # the original as loaded above (only served so far: its variables are as saved); a signature
    # needs its object alive
    held = [orig, tf.saved_model.load(v1)]
    exact = _check_v1(res, original, v1, *(m.signatures["train"] for m in held), workdir, sample)
    try:
        _check_v4(res, original, v4, new, workdir, sample, optimizer, batch_stats, dropout, sgd_variant)
    finally:
        if exact is not None:
            try:
                res.v1_identical_without_arithmetic = "SAME" in exact.output()
            except (RuntimeError, subprocess.TimeoutExpired):
                res.v1_identical_without_arithmetic = False
    return res


def _check_serving(res: CorpusResult, orig, new, v4: str, workdir: str, sample: Sample, tags: Optional[List[str]],
                   c_api_client: str, train_save: bool) -> None:
    """The serving checks of :func:`check_model`: the rewrite ``v4`` (loaded as ``new``) serves
    as the original ``orig`` does, here and in a fresh process; its serving export (without
    ``tags``) serves so without vfgraph (and through the C API with ``c_api_client``); with
    ``train_save``, :func:`_check_trained`. Nothing without a serving signature."""
    key = _serving_key(orig)
    if not key:
        return
    inputs = sample(orig.signatures[key], SERVE_BATCH, 100)
    want = _serve(orig.signatures[key], inputs)
    got = _serve(new.signatures[key], inputs)
    res.serving_error = _output_error(want, got)
    fresh = _fresh_serve(v4, key, inputs, workdir, tags)  # runs while the export is written
    if not tags:  # the serving export of the rewritten model, served without vfgraph
        exported = vfgraph.export(v4, os.path.join(workdir, "serving"), force=True)
        stock = _fresh_serve(exported, key, inputs, workdir, vfgraph=False)
        try:
            if c_api_client:
                res.export_c_api_error = _output_error(want, c_api.serve(c_api_client, exported, inputs, key))
            res.export_error = _output_error(want, stock.result())
        except (RuntimeError, subprocess.TimeoutExpired) as e:
            res.export_problem = str(e)
    try:
        res.fresh_load = _output_error(got, fresh.result()) < 1e-6
    except (RuntimeError, subprocess.TimeoutExpired) as e:
        res.fresh_load, res.fresh_error = False, str(e)
    if train_save:
        _check_trained(res, v4, new.signatures["train"], key, inputs, os.path.join(workdir, "trained"), sample)


def _check_v1(res: CorpusResult, original: str, v1: str, a, b, workdir: str, sample: Sample) -> Optional[_Fresh]:
    """The V=1 check of :func:`check_model`: two steps of the original's training signature
    ``a`` and of its V=1 rewrite's ``b`` (saved at ``v1``) leave the same losses and variables.
    Where they differ, returns the same comparison started in a process without Grappler's
    arithmetic optimizer (:func:`_v1_fresh`), to run while the V=4 checks run here."""
    la, lb = _steps(a, sample, 2), _steps(b, sample, 2)
    va, vb = variable_values(a), variable_values(b)
    res.v1_differing = sorted(n for n in va if n not in vb or not np.array_equal(va[n], vb[n]))
    res.v1_identical = not res.v1_differing and la == lb
    if res.v1_identical:
        return None
    res.v1_error = max(rel_diff(va[n], vb[n]) for n in res.v1_differing if n in vb)
    return _v1_fresh(original, v1, [sample(a, BATCH, s) for s in range(2)], workdir)


def _check_trained(res: CorpusResult, model: str, train_fn, key: str, inputs: Dict[str, np.ndarray], workdir: str,
                   sample: Sample) -> None:
    """``vfgraph train`` on ``model`` (fed ``sample`` data for ``train_fn``), then the trained
    model and its serving export serve ``inputs`` in fresh processes as the trained model does
    here (the model without vfgraph when it holds none of its ops, the export always without)."""
    import tensorflow as tf

    from vfgraph import records
    from vfgraph.errors import VfgraphError
    from vfgraph.records import Allreduce
    from vfgraph.runtime.train import train

    os.makedirs(workdir, exist_ok=True)
    data = os.path.join(workdir, "data.npz")
    np.savez(data, **sample(train_fn, 4 * BATCH, 11))
    trained = os.path.join(workdir, "out")
    try:
        train(model, data, 6, BATCH, trained, checkpoint_every=2, progress=False, force=True)
    except VfgraphError as e:
        res.trained_problem = str(e)
        return
    plain = not records.get(records.read_metadata(trained) or {}, Allreduce)
    serving = os.path.join(workdir, "out.serving", "1")
    fresh = _fresh_serve(trained, key, inputs, workdir, vfgraph=not plain)
    here = tf.saved_model.load(trained)
    want = _serve(here.signatures[key], inputs)
    try:
        res.trained_error = _output_error(want, fresh.result())
        res.trained_export_error = _output_error(want, _fresh_serve(serving, key, inputs, workdir, False).result())
    except (RuntimeError, subprocess.TimeoutExpired) as e:
        res.trained_problem = str(e)


def _check_v4(res: CorpusResult, original: str, v4: str, new, workdir: str, sample: Sample, optimizer: str,
              batch_stats: bool, dropout: bool, sgd_variant: Optional[Callable[[], str]]) -> None:
    """V=4 against the full-batch step (SGD), or a per-slice reference (batch norm); with
    dropout, that the step trains."""
    import tensorflow as tf

    if dropout:  # per-virtual-node masks: the step differs from the full batch by design
        fn = new.signatures["train"]
        before = variable_values(fn)
        losses = _steps(fn, sample, 2)
        after = variable_values(fn)
        moved = any(not np.array_equal(before[n], after[n]) for n in before if before[n].dtype.kind == "f")
        res.v4_error = 0.0 if moved and all(np.isfinite(losses)) else float("inf")
        res.v4_reference = "trains, finite loss"
        return
    if optimizer in ("sgd", "momentum"):
        ref_model, ref_v4 = original, v4
    elif sgd_variant is not None:
        ref_model = sgd_variant()
        ref_v4 = vfgraph.save(vfgraph.rewrite(ref_model, vnodes=VNODES, vnode_batch=VNODE_BATCH),
                              os.path.join(workdir, "v4_sgd"), force=True)
    else:
        return
    # a fresh original (the V=1 check stepped the first); the V=4 model as loaded before when it
    # is the one compared (only served so far)
    held = [tf.saved_model.load(ref_model), new if ref_v4 == v4 else tf.saved_model.load(ref_v4)]
    fa, fb = (m.signatures["train"] for m in held)
    if batch_stats:
        inputs = sample(fa, BATCH, 7)
        ref = _per_slice_reference(fa, inputs, VNODES)
        fb(**inputs)
        got = variable_values(fb)
        res.v4_reference = "per-slice reference"
    else:
        _steps(fa, sample, 2)
        _steps(fb, sample, 2)
        ref, got = variable_values(fa), variable_values(fb)
        res.v4_reference = "full batch" + ("" if ref_model == original else ", SGD")
    res.v4_error = max((rel_diff(ref[n], got[n]) for n in ref if n in got and ref[n].dtype.kind == "f"), default=0.0)


def write_json(results: List[CorpusResult], path: str) -> None:
    with open(path, "w") as f:
        json.dump([asdict(r) for r in results], f, indent=1, sort_keys=True)
