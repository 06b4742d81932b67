"""Single-process training of a (rewritten) SavedModel on arrays from an .npz file."""
from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from typing import Dict, List

import numpy as np

from vfgraph.errors import InputError
from vfgraph.io import savedmodel

log = logging.getLogger("vfgraph.train")


def load_npz(path: str) -> Dict[str, np.ndarray]:
    try:
        with np.load(path, allow_pickle=False) as z:
            return {k: z[k] for k in z.files}
    except FileNotFoundError:
        raise InputError(f"{path}: no such data file") from None
    except (ValueError, OSError, EOFError) as e:
        raise InputError(f"{path}: not a readable .npz file ({e})") from None


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


def train(model: str, data_path: str, steps: int, batch_size: int, out: str, resume: bool = False,
          force: bool = False, signature: str = "train", checkpoint_every: int = 100, seed: int = 0,
          progress: bool = True) -> TrainResult:
    if not savedmodel.is_saved_model_dir(model):
        raise InputError(f"{model}: not a SavedModel directory")
    savedmodel.prepare_output(out, force or resume)
    data = load_npz(data_path)
    import tensorflow as tf
    from tqdm import tqdm

    loaded = tf.saved_model.load(model)
    if signature not in loaded.signatures:
        raise InputError(f"{model}: no signature {signature!r} (has: {', '.join(sorted(loaded.signatures))}); "
                         "pass --train-signature NAME")
    fn = loaded.signatures[signature]
    _, specs = fn.structured_input_signature
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
    ckpt_dir = os.path.abspath(out) + ".ckpt"
    ckpt = tf.train.Checkpoint(variables=list(fn.variables))
    state_file = os.path.join(ckpt_dir, "progress.json")
    start, losses = 0, []
    if resume and os.path.isfile(state_file):
        with open(state_file) as f:
            state = json.load(f)
        ckpt.read(state["checkpoint"]).assert_consumed()
        start, losses = state["step"], state["losses"]
        log.info("resuming at step %d", start)
    bar = tqdm(range(start, steps), initial=start, total=steps, disable=not progress, unit="step")
    for step in bar:
        result = fn(**batches_for(data, keys, batch_size, step, seed))
        loss = float(result["loss"]) if "loss" in result else float("nan")
        losses.append(loss)
        bar.set_postfix(loss=f"{loss:.4f}")
        if checkpoint_every and (step + 1) % checkpoint_every == 0 and step + 1 < steps:
            _checkpoint(ckpt, ckpt_dir, step + 1, losses)
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
