"""Training a (rewritten) SavedModel on arrays from an .npz file, on one process or on the ranks of
``mpiexec`` (data parallel: each rank feeds its share of every global batch)."""
from __future__ import annotations

import glob
import json
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import numpy as np

from vfgraph.errors import InputError, VfgraphError
from vfgraph.io import savedmodel
from vfgraph.runtime.world import place_threads, shares, world

log = logging.getLogger("vfgraph.train")


def load_npz(path: str) -> Dict[str, np.ndarray]:
    try:
        with np.load(path, allow_pickle=False) as z:
            return {k: z[k] for k in z.files}
    except FileNotFoundError:
        raise InputError(f"{path}: no such data file") from None
    except (ValueError, OSError, EOFError) as e:
        raise InputError(f"{path}: not a readable .npz file ({e})") from None


class TrainingError(VfgraphError):
    """Training stopped: the ranks disagree or a collective failed."""


TFRECORD = (".tfrecord", ".tfrecords", ".tfr")


def load_data(path: str, specs) -> Dict[str, np.ndarray]:
    """The training arrays: an .npz file, or TFRecord files of ``tf.train.Example`` records
    (a path or a glob pattern) whose features are named like the signature's inputs
    (``specs``: name -> TensorSpec) and hold one example each."""
    if not path.endswith(TFRECORD) and not glob.has_magic(path):
        return load_npz(path)
    import tensorflow as tf

    files = sorted(glob.glob(path))
    if not files:
        raise InputError(f"{path}: no such TFRecord file")
    features = {}
    for k, spec in specs.items():
        dtype = tf.float32 if spec.dtype.is_floating else tf.string if spec.dtype == tf.string else tf.int64
        if not spec.shape[1:].is_fully_defined():
            raise InputError(f"input {k!r} has shape {spec.shape}: TFRecord features need a fixed per-example "
                             "shape; convert the data to .npz")
        features[k] = tf.io.FixedLenFeature(spec.shape[1:], dtype)
    parts: Dict[str, list] = {k: [] for k in specs}
    try:
        for batch in tf.data.TFRecordDataset(files).batch(4096).map(lambda r: tf.io.parse_example(r, features)):
            for k, v in batch.items():
                parts[k].append(v.numpy())
    except (tf.errors.InvalidArgumentError, tf.errors.DataLossError) as e:
        raise InputError(f"{path}: records do not hold the features {sorted(specs)} of the training signature "
                         f"({e.message.splitlines()[0]})") from None
    if not parts or not next(iter(parts.values())):
        raise InputError(f"{path}: no records")
    return {k: np.concatenate(v) for k, v in parts.items()}


@dataclass
class TrainResult:
    out: str
    steps: int
    losses: List[float]


def batches_for(data: Dict[str, np.ndarray], keys: List[str], batch_size: int, step: int, seed: int = 0):
    """The ``step``-th batch of a deterministic shuffled order (a new permutation per epoch)."""
    n = len(next(iter(data.values())))
    per_epoch = n // batch_size
    epoch, k = divmod(step, per_epoch)
    order = np.random.default_rng(seed + epoch).permutation(n)
    idx = np.sort(order[k * batch_size:(k + 1) * batch_size])
    return {key: data[key][idx] for key in keys}


def vnode_layout(model: str, signature: str) -> Tuple[int, bool]:
    """(examples per virtual node b, or 0 when the graph divides the fed batch itself;
    whether the step all-reduces over ranks), from the rewrite record of ``model``."""
    meta = savedmodel.read_metadata(model) or {}
    rewrites = meta.get("rewrites", {})
    rec = rewrites.get("split-vnodes", {}).get(signature)
    return (rec["vnode_batch"] if rec else 0), signature in rewrites.get("insert-allreduce", {})


def train(model: str, data_path: str, steps: int, batch_size: int, out: str, resume: bool = False,
          force: bool = False, signature: str = "train", checkpoint_every: int = 100, seed: int = 0,
          progress: bool = True, vnodes_per_rank: Optional[List[int]] = None,
          threads: Optional[int] = None) -> Optional[TrainResult]:
    """Train ``model`` for ``steps`` global batches of ``batch_size`` examples. Under ``mpiexec``
    every rank feeds its share of each global batch (whole virtual nodes, from the same global
    order), the step all-reduces, and rank 0 writes checkpoints and the result; other ranks
    return None. ``threads``: TensorFlow intra-op threads per rank (default: this host's CPUs shared
    by the ranks on it)."""
    if not savedmodel.is_saved_model_dir(model):
        raise InputError(f"{model}: not a SavedModel directory")
    b, reduces = vnode_layout(model, signature)
    w = world(need_mpi=reduces)
    threads = w.agree(lambda: place_threads(w, threads))

    def prepare():
        if w.is_root:
            savedmodel.prepare_output(out, force or resume)

    w.agree(prepare)
    import tensorflow as tf
    from tqdm import tqdm

    def open_model():
        loaded = tf.saved_model.load(model)
        if signature not in loaded.signatures:
            raise InputError(f"{model}: no signature {signature!r} (has: {', '.join(sorted(loaded.signatures))}); "
                             "pass --train-signature NAME")
        fn = loaded.signatures[signature]
        _, specs = fn.structured_input_signature
        data = load_data(data_path, specs)
        missing = [k for k in specs if k not in data]
        if missing:
            raise InputError(f"{data_path}: arrays {missing} are missing; the {signature!r} signature takes "
                             f"{sorted(specs)} (have {sorted(data)})")
        keys = sorted(specs)
        lengths = {k: len(data[k]) for k in keys}
        if len(set(lengths.values())) != 1:
            raise InputError(f"{data_path}: arrays have different lengths {lengths}")
        n = next(iter(lengths.values()))
        if batch_size < 1 or batch_size > n:
            raise InputError(f"--batch-size {batch_size}: must be between 1 and the {n} examples in {data_path}")
        for k in keys:
            data[k] = data[k].astype(specs[k].dtype.as_numpy_dtype, copy=False)
        rows = (0, batch_size)
        if w.size > 1 and f"{signature}_broadcast" not in loaded.signatures:
            raise InputError(f"{model}: no {signature}_broadcast signature to start the ranks from the same "
                             "variables; rewrite it with a SavedModel input and --allreduce mpi")
        if w.size > 1 or vnodes_per_rank:
            if not b:
                raise InputError(f"{model}: its virtual-node batch is derived from the fed batch, so ranks cannot "
                                 "share a global batch; rewrite it with --vnode-batch B")
            if batch_size % b:
                raise InputError(f"--batch-size {batch_size}: not a multiple of the virtual-node batch b={b} "
                                 f"of {model}")
            per = shares(batch_size // b, w.size, vnodes_per_rank)
            rows = (sum(per[:w.rank]) * b, sum(per[:w.rank + 1]) * b)
        return loaded, fn, data, keys, rows

    loaded, fn, data, keys, (lo, hi) = w.agree(open_model)
    ckpt_dir = os.path.abspath(out) + ".ckpt"
    ckpt = tf.train.Checkpoint(variables=list(fn.variables))
    state_file = os.path.join(ckpt_dir, "progress.json")
    start, losses = 0, []
    if w.is_root and resume and os.path.isfile(state_file):
        with open(state_file) as f:
            state = json.load(f)
        ckpt.read(state["checkpoint"]).assert_consumed()
        start, losses = state["step"], state["losses"]
        log.info("resuming at step %d", start)
    start, losses = w.bcast((start, losses))
    where = "start"
    try:
        if w.size > 1:
            table = w.describe()
            if w.is_root:
                log.info("%d ranks, %d TensorFlow threads each (intra-op; one inter-op): %s", w.size, threads,
                         "; ".join(table))
            loaded.signatures[f"{signature}_broadcast"]()  # same graph everywhere, then rank 0's variables
        bar = tqdm(range(start, steps), initial=start, total=steps, disable=not (progress and w.is_root),
                   unit="step")
        for step in bar:
            where = f"step {step}"
            batch = batches_for(data, keys, batch_size, step, seed)
            result = fn(**{k: v[lo:hi] for k, v in batch.items()})
            loss = float(result["loss"]) if "loss" in result else float("nan")
            losses.append(loss)
            bar.set_postfix(loss=f"{loss:.4f}")
            if w.is_root and checkpoint_every and (step + 1) % checkpoint_every == 0 and step + 1 < steps:
                _checkpoint(ckpt, ckpt_dir, step + 1, losses)
    except tf.errors.OpError as e:
        ours = [x.strip() for x in e.message.splitlines() if x.strip().startswith("Vf")]
        if not ours:
            raise
        # A failed collective (different graphs on the ranks, an MPI error): one line naming the rank.
        raise TrainingError(f"rank {w.rank}, {where}: {ours[0]}") from None
    if not w.is_root:
        return None
    _save_trained(loaded, model, out, losses)
    shutil.rmtree(ckpt_dir, ignore_errors=True)
    return TrainResult(os.path.abspath(out), steps, losses)


def _checkpoint(ckpt, ckpt_dir: str, step: int, losses: List[float]) -> None:
    os.makedirs(ckpt_dir, exist_ok=True)
    path = ckpt.write(os.path.join(ckpt_dir, f"step-{step}"))
    tmp = os.path.join(ckpt_dir, "progress.json.tmp")
    with open(tmp, "w") as f:
        json.dump({"step": step, "checkpoint": path, "losses": losses}, f)
    os.replace(tmp, os.path.join(ckpt_dir, "progress.json"))
    keep = os.path.basename(path)
    for f in os.listdir(ckpt_dir):  # keep only the checkpoint progress.json names
        if f.startswith("step-") and not f.startswith(keep + "."):
            p = os.path.join(ckpt_dir, f)
            shutil.rmtree(p) if os.path.isdir(p) else os.remove(p)


def _save_trained(loaded, model: str, out: str, losses: List[float]) -> None:
    import tensorflow as tf

    out = os.path.abspath(out)
    tmp = tempfile.mkdtemp(prefix=".vfgraph-train-", dir=os.path.dirname(out))
    try:
        target = os.path.join(tmp, "model")
        tf.saved_model.save(loaded, target, signatures=dict(loaded.signatures))
        meta = savedmodel.read_metadata(model) or {}
        meta["training"] = {"steps": len(losses), "losses": losses}
        os.makedirs(os.path.join(target, "assets.extra"), exist_ok=True)
        with open(os.path.join(target, savedmodel.METADATA_FILE), "w") as f:
            json.dump(meta, f, indent=2, sort_keys=True)
        if os.path.exists(out):
            shutil.rmtree(out)
        os.rename(target, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    # Beside it, what a server loads: OUT.serving/1/ (serving signatures and their variables only,
    # no training functions, none of vfgraph's ops), replacing the one an earlier run wrote.
    from vfgraph.io import serving

    try:
        serving.save_serving_model(savedmodel.load_saved_model(out), serving.sibling_dir(out), force=True)
    except VfgraphError as e:  # a model without a servable signature still trained
        shutil.rmtree(serving.target_dir(serving.sibling_dir(out), 1), ignore_errors=True)
        log.warning("no serving export beside %s: %s", out, e)
