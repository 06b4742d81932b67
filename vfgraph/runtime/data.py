"""The training data: loading it (an .npz file or TFRecord files), checking it against the
training signature, the global batch of each step, and the rows of it that each rank feeds."""
from __future__ import annotations

import glob
import hashlib
import math
import os
from dataclasses import dataclass
from typing import Dict, List, Tuple

import numpy as np

from vfgraph import records
from vfgraph.errors import InputError
from vfgraph.records import VirtualNodes


def load_npz(path: str) -> Dict[str, np.ndarray]:
    """The arrays of the .npz file at ``path``; one line for a missing, truncated or damaged file."""
    import zipfile

    try:
        with np.load(path, allow_pickle=False) as z:
            return {k: z[k] for k in z.files}
    except FileNotFoundError:
        raise InputError(f"{path}: no such data file") from None
    except (ValueError, OSError, EOFError, zipfile.BadZipFile) as e:
        raise InputError(f"{path}: not a readable .npz file ({str(e).strip() or type(e).__name__}); if it was "
                         "copied or written by a run that stopped, write it again") from None


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


def batches_for(data: Dict[str, np.ndarray], keys: List[str], batch_size: int, step: int, seed: int = 0):
    """The ``step``-th batch of a deterministic shuffled order (a new permutation per epoch)."""
    n = len(next(iter(data.values())))
    per_epoch = n // batch_size
    epoch, k = divmod(step, per_epoch)
    order = np.random.default_rng(seed + epoch).permutation(n)
    idx = np.sort(order[k * batch_size:(k + 1) * batch_size])
    return {key: data[key][idx] for key in keys}


def check_batch(model: str, signature: str, batch_size: int, what: str = "") -> None:
    """A batch the rewritten step of ``model`` can take: a multiple of its virtual-node batch
    b, or of its V virtual nodes when it divides the fed batch itself. ``what`` names the batch
    in the message (default: the --batch-size option)."""
    rec = records.read(model, VirtualNodes).get(signature)
    if not rec:
        return
    what = what or f"--batch-size {batch_size}"
    b, v = int(rec.vnode_batch or 0), int(rec.vnodes or 1)
    if b and batch_size % b:
        raise InputError(f"{what}: not a multiple of the virtual-node batch b={b} of {model}; give a multiple of {b}")
    if not b and batch_size % v:
        raise InputError(f"{what}: not a multiple of the vnodes={v} virtual nodes of {model} (each step splits the "
                         f"batch into {v} equal slices); give a multiple of {v}")


def check_data(data: Dict[str, np.ndarray], specs, data_path: str, signature: str) -> Dict[str, np.ndarray]:
    """The arrays the signature takes (``specs``: name -> TensorSpec), cast to its dtypes when
    the cast changes no value (:func:`cast_exactly`); one line naming the array for a missing
    input, a wrong example shape or dtype, a value its dtype cannot hold, or arrays of different
    lengths."""
    missing = [k for k in specs if k not in data]
    if missing:
        raise InputError(f"{data_path}: arrays {missing} are missing; the {signature!r} signature takes "
                         f"{sorted(specs)} (have {sorted(data)})")
    out = {}
    for k in sorted(specs):
        arr, want = data[k], specs[k].shape[1:]
        if want.rank is not None and (arr.ndim != want.rank + 1 or not want.is_compatible_with(arr.shape[1:])):
            raise InputError(f"{data_path}: array {k!r} holds examples of shape {list(arr.shape[1:])}, the "
                             f"{signature!r} signature takes {[d if d is not None else -1 for d in want.as_list()]} "
                             f"(the array's shape is {list(arr.shape)}, examples first)")
        out[k] = cast_exactly(arr, specs[k].dtype.as_numpy_dtype, k, data_path, signature)
    lengths = {k: len(v) for k, v in out.items()}
    if len(set(lengths.values())) > 1:
        raise InputError(f"{data_path}: arrays have different lengths {lengths}")
    return out


def cast_exactly(arr: np.ndarray, dtype, key: str, data_path: str, signature: str) -> np.ndarray:
    """``arr`` (input ``key`` of ``data_path``) as ``dtype`` when every value survives the cast
    unchanged (an integer that fits, a float that is a whole number where an integer is
    expected, a float the narrower float holds exactly); otherwise one line naming the input,
    the dtypes, the first row that does not survive, its value and the fix."""
    want, what = np.dtype(dtype), f"{data_path}: array {key!r}"
    if arr.dtype == want:
        return arr
    try:
        with np.errstate(invalid="ignore", over="ignore"):
            out = arr.astype(want)
    except (TypeError, ValueError):
        raise InputError(f"{what} has dtype {arr.dtype}, the {signature!r} signature takes {want.name}") from None
    if arr.dtype.kind not in "biuf" or want.kind not in "biuf":
        return out
    with np.errstate(invalid="ignore", over="ignore"):
        back = out.astype(arr.dtype)
        changed = back != arr
    if arr.dtype.kind == "f":
        changed &= ~(np.isnan(arr) & np.isnan(back))
    if not changed.any():
        return out
    first = np.argwhere(changed)[0]
    value = arr[tuple(first)].item()
    at = f"row {first[0]}" + (f" (element {[int(i) for i in first[1:]]})" if len(first) > 1 else "")
    takes = f"{what} holds {arr.dtype.name} values, the {signature!r} signature takes {want.name}"
    if want.kind in "iu" and arr.dtype.kind == "f" and (not math.isfinite(value) or value != int(value)):
        raise InputError(f"{takes}: {at} holds {value!r}, not a whole number, and casting would truncate it; "
                         f"give whole numbers (save the array as {want.name} once they are)")
    if want.kind in "iub":
        info = np.iinfo(want) if want.kind in "iu" else None
        room = f"lie between {info.min} and {info.max}" if info else "be 0 or 1"
        raise InputError(f"{takes}: {at} holds {value!r}, which {want.name} cannot hold (values must {room}); "
                         "check the data, or give the model an input of a wider dtype")
    if math.isfinite(value) and not np.isfinite(out[tuple(first)]):
        raise InputError(f"{takes}: {at} holds {value!r}, beyond the largest {want.name} ({np.finfo(want).max}); "
                         f"check the data, or give the model {arr.dtype.name} inputs")
    raise InputError(f"{takes}: {at} holds {value!r}, which {want.name} does not hold exactly; if that precision "
                     f"is enough, save it as {want.name}: {key}.astype({want.name!r}) (or give the model "
                     f"{arr.dtype.name} inputs)")


def data_fingerprint(data: Dict[str, np.ndarray]) -> str:
    h = hashlib.sha256()
    for k in sorted(data):
        a = np.ascontiguousarray(data[k])
        h.update(f"{k}:{a.dtype.str}:{a.shape};".encode())
        h.update(memoryview(a).cast("B"))
    return h.hexdigest()


def rank_rows(per: List[int], rank: int, b: int) -> Tuple[int, int]:
    """The rows of the global batch that ``rank`` feeds: its share of ``per`` virtual nodes of
    ``b`` examples, after the lower ranks' shares."""
    return sum(per[:rank]) * b, sum(per[:rank + 1]) * b


def data_digest(data: Dict[str, np.ndarray], files: List[str], examples: int = 64, most: int = 1 << 20) -> str:
    """A digest of the training data that takes every rank milliseconds whatever the data's
    size (the data is read once, to train on): the data files' sizes, each array's name,
    dtype and shape, and the bytes of up to ``examples`` examples of each array (``most``
    bytes at most), evenly spaced from its first to its last. Not covered: the files' paths
    and times (copies on different hosts are the same data), and a difference only in
    examples it does not sample in files of the same sizes (rank 0's checkpoint record hashes
    all of the data)."""
    h = hashlib.sha256()
    for f in files:
        h.update(f"{os.path.getsize(f) if os.path.isfile(f) else -1};".encode())
    for k in sorted(data):
        a = data[k]
        h.update(f"{k}:{a.dtype.str}:{a.shape};".encode())
        if not len(a):
            continue
        count = int(min(len(a), examples, max(1, most // max(1, a[:1].nbytes))))
        rows = np.unique(np.linspace(0, len(a) - 1, count).astype(np.int64))
        sample = a[rows]
        if sample.dtype.kind == "O":  # (strings from TFRecord files)
            for x in sample.ravel():
                h.update(x if isinstance(x, bytes) else repr(x).encode())
                h.update(b"\0")
        else:
            h.update(np.ascontiguousarray(sample).tobytes())
    return h.hexdigest()


@dataclass
class TrainData:
    """The checked arrays of a run (``arrays``, the signature's inputs; ``keys`` their names,
    sorted) and the global batches it trains on: the same on every rank and layout, each rank
    feeding its rows of them."""

    path: str
    arrays: Dict[str, np.ndarray]
    keys: List[str]
    batch_size: int
    seed: int

    @classmethod
    def load(cls, path: str, specs, signature: str, batch_size: int, seed: int) -> "TrainData":
        """The data at ``path`` for the inputs ``specs`` (name -> TensorSpec) of ``signature``,
        checked (:func:`check_data`) and holding at least one global batch."""
        arrays = check_data(load_data(path, specs), specs, path, signature)
        keys = sorted(specs)
        n = len(arrays[keys[0]])
        if batch_size > n:
            raise InputError(f"--batch-size {batch_size}: must be between 1 and the {n} examples in {path}")
        return cls(path, arrays, keys, batch_size, seed)

    def feed(self, step: int, lo: int, hi: int) -> Dict[str, np.ndarray]:
        """Rows ``lo:hi`` of the global batch of ``step`` (:func:`batches_for`), by input."""
        batch = batches_for(self.arrays, self.keys, self.batch_size, step, self.seed)
        return {k: v[lo:hi] for k, v in batch.items()}

    def rows(self, step: int, lo: int, hi: int) -> np.ndarray:
        """The data's row of each example :meth:`feed` gives."""
        n = len(self.arrays[self.keys[0]])
        return batches_for({"row": np.arange(n)}, ["row"], self.batch_size, step, self.seed)["row"][lo:hi]
