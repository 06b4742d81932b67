"""The training data: checking it against the training signature, the global batch of each
step, and the rows of it that each rank reads (:class:`TrainData`, from a source by index:
:mod:`.sources`), prepared a few steps ahead."""
from __future__ import annotations

import logging
import math
import threading
from concurrent.futures import Future
from typing import Dict, List, Optional, Tuple

import numpy as np

from vfgraph import records
from vfgraph.errors import InputError
from vfgraph.records import VirtualNodes
from vfgraph.runtime.preprocess import InputFn, Preprocessor
from vfgraph.runtime.sources import (ArraySource, Source, data_digest, data_fingerprint,  # noqa: F401 (read
                                     load_npz, open_source)  # from here too)

log = logging.getLogger("vfgraph.train")


def load_data(path: str, specs) -> Dict[str, np.ndarray]:
    """All the training arrays: an .npz file, or TFRecord or ArrayRecord files of
    ``tf.train.Example`` records (a path or a glob pattern) whose features are named like the
    signature's inputs (``specs``: name -> TensorSpec) and hold one example each. (Training
    reads examples by index instead: :class:`TrainData`.)"""
    source = open_source(path, specs)
    if isinstance(source, ArraySource):
        return source.arrays
    if not len(source):
        raise InputError(f"{path}: no records")
    return source.read(np.arange(len(source)))


def batch_indices(n: int, batch_size: int, step: int, seed: int = 0) -> np.ndarray:
    """The sorted indices, among ``n`` examples, of the ``step``-th global batch: a slice of a
    deterministic shuffled order (a new permutation per epoch)."""
    epoch, k = divmod(step, n // batch_size)
    return np.sort(epoch_order(n, seed, epoch)[k * batch_size:(k + 1) * batch_size])


def epoch_order(n: int, seed: int, epoch: int) -> np.ndarray:
    """The order of the ``n`` examples in epoch ``epoch``: a permutation from ``seed + epoch``."""
    return np.random.default_rng(seed + epoch).permutation(n)


def batches_for(data: Dict[str, np.ndarray], keys: List[str], batch_size: int, step: int, seed: int = 0):
    """The ``step``-th batch of a deterministic shuffled order (a new permutation per epoch)."""
    idx = batch_indices(len(next(iter(data.values()))), batch_size, step, seed)
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


def rank_rows(per: List[int], rank: int, b: int) -> Tuple[int, int]:
    """The rows of the global batch that ``rank`` feeds: its share of ``per`` virtual nodes of
    ``b`` examples, after the lower ranks' shares."""
    return sum(per[:rank]) * b, sum(per[:rank + 1]) * b


class Prefetcher:
    """Feeds prepared ahead on a background thread: ``read(step, lo, hi)`` run for the keys
    :meth:`get` is told come next, at most ``depth`` of them held at a time; a key that is not
    asked for next (a share changed) is dropped and read afresh when asked for."""

    def __init__(self, read, depth: int):
        self.read, self.depth = read, depth
        self.pending: Dict[tuple, Future] = {}
        self.queue: List[Tuple[tuple, Future]] = []
        self.ready = threading.Condition()
        self.thread: Optional[threading.Thread] = None

    def get(self, key: tuple, upcoming: List[tuple]) -> Dict[str, np.ndarray]:
        """The feed of ``key`` (prepared, or read now); then prepare those of ``upcoming``."""
        fut = self.pending.pop(key, None)
        upcoming = upcoming[:self.depth]
        for k in [k for k in self.pending if k not in upcoming]:
            self.pending.pop(k).cancel()
        with self.ready:
            for k in upcoming:
                if k not in self.pending:
                    self.pending[k] = Future()
                    self.queue.append((k, self.pending[k]))
            self.ready.notify()
        if self.thread is None and upcoming:
            self.thread = threading.Thread(target=self._work, name="vfgraph-input", daemon=True)
            self.thread.start()
        if fut is None or fut.cancel():  # (not prepared, or not started yet: read it here)
            return self.read(*key)
        return fut.result()

    def _work(self) -> None:
        while True:
            with self.ready:
                while not self.queue:
                    self.ready.wait()
                key, fut = self.queue.pop(0)
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(self.read(*key))
            except BaseException as e:  # (raised where the feed is taken)
                fut.set_exception(e)


class TrainData:
    """The global batches a run trains on, from its data ``source``: the same on every rank and
    layout (:func:`batch_indices`), each rank reading and decoding only its rows of them
    (:meth:`feed`), the next ``depth`` steps' rows prepared while a step runs (``steps``: the
    run's steps, none prepared beyond them)."""

    def __init__(self, source: Source, specs, signature: str, batch_size: int, seed: int,
                 steps: Optional[int] = None, depth: int = 3, input_fn: Optional[InputFn] = None):
        self.source, self.specs, self.signature = source, specs, signature
        self.path, self.keys = source.path, sorted(specs)
        self.batch_size, self.seed, self.steps = batch_size, seed, steps
        self.orders: Dict[int, np.ndarray] = {}
        self.lock = threading.Lock()
        self.preprocess = None if input_fn is None else Preprocessor(input_fn, specs, signature, seed, self.where)
        ahead = input_fn is not None or not isinstance(source, ArraySource)
        self.prefetch = Prefetcher(self._read, depth) if ahead else None

    @classmethod
    def load(cls, path: str, specs, signature: str, batch_size: int, seed: int,
             steps: Optional[int] = None, input_fn: Optional[InputFn] = None) -> "TrainData":
        """The data at ``path`` for the inputs ``specs`` (name -> TensorSpec) of ``signature``,
        checked (:func:`check_data`: the whole of an .npz file, the first records of TFRecord or
        ArrayRecord files; with ``input_fn``, its output for the first examples) and holding at
        least one global batch."""
        source = open_source(path, None if input_fn else specs)
        if isinstance(source, ArraySource):
            lengths = {k: len(v) for k, v in source.arrays.items()}
            if input_fn is None:
                source.arrays = check_data(source.arrays, specs, path, signature)
            elif len(set(lengths.values())) > 1:
                raise InputError(f"{path}: arrays have different lengths {lengths}")
        elif not len(source):
            raise InputError(f"{path}: no records")
        data = cls(source, specs, signature, batch_size, seed, steps, input_fn=input_fn)
        if input_fn is not None:
            data.check_input_fn()
        elif not isinstance(source, ArraySource):
            data.check_records()
        n = len(source)
        if batch_size > n:
            raise InputError(f"--batch-size {batch_size}: must be between 1 and the {n} examples in {path}")
        return data

    def check_input_fn(self, first: int = 16) -> None:
        """Run ``--input-fn`` on the first ``first`` examples (at step 0) and check what it returns."""
        if len(self.source):
            self.preprocessed(np.arange(min(first, len(self.source))), 0)
        self.source.decoded = self.source.bytes_read = 0

    def where(self, index: int) -> str:
        """Where example ``index`` lies: its record and file, or its row of an .npz file."""
        at = getattr(self.source, "where", None)
        return at(index) if at is not None else f"row {index} of {self.path}"

    def check_records(self, first: int = 256) -> None:
        """Decode and check (:func:`check_data`) the first ``first`` records and the first of each file."""
        source = self.source
        check_data(source.read(np.arange(min(first, len(source)))), self.specs, self.path, self.signature)
        heads = np.unique(source.starts[:-1][np.diff(source.starts) > 0])
        check_data(source.read(heads[heads >= first]), self.specs, self.path, self.signature)
        source.decoded = source.bytes_read = 0

    def __len__(self) -> int:
        return len(self.source)

    def indices(self, step: int) -> np.ndarray:
        """The sorted indices of the examples of the global batch of ``step``: those of
        :func:`batch_indices`, each epoch's order computed once."""
        n = len(self.source)
        epoch, k = divmod(step, n // self.batch_size)
        with self.lock:  # (the last two epochs' orders kept)
            order = self.orders.get(epoch)
            if order is None:
                order = self.orders[epoch] = epoch_order(n, self.seed, epoch)
                for old in sorted(self.orders)[:-2]:
                    del self.orders[old]
        return np.sort(order[k * self.batch_size:(k + 1) * self.batch_size])

    def feed(self, step: int, lo: int, hi: int) -> Dict[str, np.ndarray]:
        """Rows ``lo:hi`` of the global batch of ``step``, by input; only they are read."""
        if self.prefetch is None:
            return self._read(step, lo, hi)
        last = self.steps if self.steps is not None else step + 1 + self.prefetch.depth
        return self.prefetch.get((step, lo, hi), [(s, lo, hi) for s in range(step + 1, last)])

    def _read(self, step: int, lo: int, hi: int) -> Dict[str, np.ndarray]:
        rows = self.indices(step)[lo:hi]
        if self.preprocess is not None:
            return self.preprocessed(rows, step)
        return self._cast(self.source.read(rows), rows, self.path)

    def preprocessed(self, rows: np.ndarray, step: int) -> Dict[str, np.ndarray]:
        """The examples ``rows`` through ``--input-fn`` at ``step``, stacked into the signature's inputs."""
        outs = self.preprocess.examples(self.source.raw(rows), rows, step)
        what = f"{self.path} through --input-fn {self.preprocess.input_fn.name}"
        stacked = {}
        for k in self.keys:
            shapes = [o[k].shape for o in outs]
            odd = next((i for i, s in enumerate(shapes) if s != shapes[0]), None)
            if odd is not None:
                raise InputError(f"{what}: {k!r} of example {int(rows[odd])} has shape {list(shapes[odd])}, of example "
                                 f"{int(rows[0])} {list(shapes[0])}; a batch stacks examples of one shape: return "
                                 "that shape for every example")
            stacked[k] = np.stack([o[k] for o in outs])
        return self._cast(stacked, rows, what)

    def _cast(self, got: Dict[str, np.ndarray], rows: np.ndarray, what: str) -> Dict[str, np.ndarray]:
        """``got`` (the examples ``rows``) cast to the signature's dtypes (:func:`cast_exactly`)."""
        try:
            return {k: cast_exactly(got[k], self.specs[k].dtype.as_numpy_dtype, k, what, self.signature)
                    for k in self.keys}
        except InputError as e:  # (its row is one of the batch's: name the data's)
            import re

            raise InputError(re.sub(r"\brow (\d+)", lambda m: f"row {int(rows[int(m.group(1))])}", str(e), 1)) \
                from None

    def rows(self, step: int, lo: int, hi: int) -> np.ndarray:
        """The data's row of each example :meth:`feed` gives."""
        return self.indices(step)[lo:hi]

    def fingerprint(self) -> str:
        """A hash of the data for a checkpoint's record (:meth:`Source.fingerprint`)."""
        return self.source.fingerprint()

    def digest(self) -> str:
        """A hash of the data the ranks of a job compare (:meth:`Source.digest`)."""
        return self.source.digest()

    def log_reads(self, w) -> None:
        """Log the examples and bytes this rank read (of the data's examples)."""
        s, p = self.source, self.preprocess
        through = f" through --input-fn {p.input_fn.name} ({p.workers} threads)" if p is not None else ""
        log.info("%sread %d examples (%d bytes) of the %d in %s%s", f"rank {w.rank}: " if w.size > 1 else "",
                 s.decoded, s.bytes_read, len(s), self.path, through)
