"""Request batching with TF Serving's parameters: concurrent predict requests for the same
signature merged into one call of the model and split back per request.

As TF Serving's basic batch scheduler (TensorFlow's batching_util): a request joins the open
batch of its queue (one queue per version, signature, output filter and input types and
shapes past the batch dimension) while the batch stays within ``max_batch_size`` rows; else a
new batch opens, unless ``max_enqueued_batches`` are waiting, when the request is refused at
once (UNAVAILABLE, TF Serving's message: HTTP 503). A batch runs when it is full or
``batch_timeout_micros`` after its first request, on one of ``num_batch_threads`` threads,
padded up to the next of ``allowed_batch_sizes`` with copies of its first row. A request of
more rows than ``max_batch_size`` runs alone, unbatched: a micro-batched model runs it slice by
slice in its own loop, in the memory of one slice.
"""
from __future__ import annotations

import os
import re
import threading
import time
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Tuple

import numpy as np

from vfgraph.errors import InputError
from vfgraph.serving.status import ServingError

FULL = "The batch scheduling queue to which this task was submitted is full"  # TensorFlow's batching_util


@dataclass(frozen=True)
class BatchingParameters:
    """TF Serving's BatchingParameters (session_bundle_config.proto) with its defaults."""

    max_batch_size: int = 1000
    batch_timeout_micros: int = 0
    max_enqueued_batches: int = 10
    num_batch_threads: int = os.cpu_count() or 1
    allowed_batch_sizes: Tuple[int, ...] = ()
    pad_variable_length_inputs: bool = False
    source: str = "the batching parameters"

    def __post_init__(self):
        where = self.source
        for name in ("max_batch_size", "max_enqueued_batches", "num_batch_threads"):
            if getattr(self, name) < 1:
                raise InputError(f"{where}: {name} {getattr(self, name)}: give at least 1")
        if self.batch_timeout_micros < 0:
            raise InputError(f"{where}: batch_timeout_micros {self.batch_timeout_micros}: give 0 or more")
        sizes = self.allowed_batch_sizes
        if sizes and (list(sizes) != sorted(set(sizes)) or sizes[0] < 1):
            raise InputError(f"{where}: allowed_batch_sizes entries must be monotonically increasing")
        if sizes and sizes[-1] != self.max_batch_size:
            raise InputError(f"{where}: the final entry in allowed_batch_sizes ({sizes[-1]}) must equal "
                             f"max_batch_size ({self.max_batch_size})")
        if self.pad_variable_length_inputs:
            raise InputError(f"{where}: pad_variable_length_inputs is not supported by vfgraph serve yet; remove it "
                             "(requests whose inputs differ past the batch dimension are batched apart)")

    @classmethod
    def read(cls, path: str) -> "BatchingParameters":
        """The text-format file of ``--batching_parameters_file``, e.g. ``max_batch_size { value:
        32 }``, ``allowed_batch_sizes: 8``; unknown fields are one line naming them."""
        try:
            with open(path) as f:
                text = f.read()
        except OSError as e:
            raise InputError(f"--batching-parameters-file {path}: {e.strerror}")
        text = re.sub(r"#[^\n]*", "", text)
        values: Dict[str, object] = {}
        sizes: List[int] = []
        scalar = {"max_batch_size", "batch_timeout_micros", "max_enqueued_batches", "num_batch_threads"}
        pos = 0
        pattern = re.compile(r"\s*(\w+)\s*(?:\{\s*value\s*:\s*([^\s}]+)\s*\}|:\s*([^\s{}]+))\s*")
        while pos < len(text.rstrip()):
            m = pattern.match(text, pos)
            if m is None:
                raise InputError(f"{path}: cannot read {text[pos:].strip()[:40]!r}: write TF Serving's text format, "
                                 "e.g. 'max_batch_size { value: 32 }'")
            name, value = m.group(1), m.group(2) or m.group(3)
            try:
                if name in scalar:
                    values[name] = int(value)
                elif name == "allowed_batch_sizes":
                    sizes.append(int(value))
                elif name == "pad_variable_length_inputs" and value in ("true", "false"):
                    values[name] = value == "true"
                else:
                    raise InputError(f"{path}: unknown field {name!r} (TF Serving's batching parameters: "
                                     f"{', '.join(sorted(scalar | {'allowed_batch_sizes', 'pad_variable_length_inputs'}))})")
            except ValueError:
                raise InputError(f"{path}: {name}: {value!r} is not a whole number")
            pos = m.end()
        return cls(**values, allowed_batch_sizes=tuple(sizes), source=path)


@dataclass
class _Batch:
    tasks: List[Tuple[Dict[str, np.ndarray], int, Future]] = field(default_factory=list)
    rows: int = 0
    opened: float = 0.0


class Batcher:
    """Merges the requests given to :meth:`predict` from concurrent threads into batches run
    on its own threads; ``on_batch(rows)`` is told each batch's size."""

    def __init__(self, params: BatchingParameters, on_batch: Optional[Callable[[int], None]] = None):
        self.params, self.on_batch = params, on_batch
        self._cond = threading.Condition()
        self._queues: Dict[tuple, Tuple[object, str, tuple, deque]] = {}
        self._stopped = False
        self._threads = [threading.Thread(target=self._work, name=f"vfgraph-batch-{k}", daemon=True)
                         for k in range(params.num_batch_threads)]
        for t in self._threads:
            t.start()

    def predict(self, servable, signature: str, inputs: Dict[str, np.ndarray], output_filter=()):
        rows = {v.shape[0] if np.ndim(v) else None for v in inputs.values()}
        n = rows.pop() if len(rows) == 1 else None
        if not n or n > self.params.max_batch_size:  # (no batch dimension, or runs alone)
            return servable.predict(signature, inputs, output_filter)
        key = (id(servable), signature, tuple(output_filter),
               tuple(sorted((k, np.asarray(v).dtype.str, np.shape(v)[1:]) for k, v in inputs.items())))
        done: Future = Future()
        with self._cond:
            if key not in self._queues:
                self._queues[key] = (servable, signature, tuple(output_filter), deque())
            batches = self._queues[key][3]
            if not batches or batches[-1].rows + n > self.params.max_batch_size:
                if len(batches) >= self.params.max_enqueued_batches:
                    raise ServingError("UNAVAILABLE", FULL)
                batches.append(_Batch(opened=time.monotonic()))
            batches[-1].tasks.append((inputs, n, done))
            batches[-1].rows += n
            self._cond.notify()
        return done.result()

    def _next(self):
        """The oldest batch that is ready (full, followed by another, or past its timeout),
        taken from its queue; None when stopped."""
        timeout = self.params.batch_timeout_micros / 1e6
        with self._cond:
            while not self._stopped:
                now, wait = time.monotonic(), None
                for key, (servable, signature, output_filter, batches) in list(self._queues.items()):
                    if not batches:
                        del self._queues[key]
                        continue
                    first = batches[0]
                    left = first.opened + timeout - now
                    if first.rows >= self.params.max_batch_size or len(batches) > 1 or left <= 0:
                        return servable, signature, output_filter, batches.popleft()
                    wait = left if wait is None else min(wait, left)
                self._cond.wait(wait)
        return None

    def _work(self) -> None:
        while True:
            job = self._next()
            if job is None:
                return
            self._run(*job)

    def _run(self, servable, signature: str, output_filter: tuple, batch: _Batch) -> None:
        size = next((s for s in self.params.allowed_batch_sizes if s >= batch.rows), batch.rows)
        try:
            merged = {k: np.concatenate([t[0][k] for t in batch.tasks]) for k in batch.tasks[0][0]}
            if size > batch.rows:  # padded with copies of the first row (as TF Serving pads)
                merged = {k: np.concatenate([v, np.repeat(v[:1], size - batch.rows, axis=0)]) for k, v in merged.items()}
            if self.on_batch:
                self.on_batch(size)
            out = servable.predict(signature, merged, output_filter)
            for name, value in out.items():
                if np.ndim(value) == 0 or np.shape(value)[0] != size:
                    raise ServingError("INTERNAL", f"Batched output tensor's 0th dimension does not equal the sum of "
                                                   f"the 0th dimension sizes of the input tensors (output {name})")
        except BaseException as e:  # (each request of the batch gets the error)
            for _, _, done in batch.tasks:
                done.set_exception(e)
            return
        start = 0
        for _, n, done in batch.tasks:
            done.set_result({k: v[start:start + n] for k, v in out.items()})
            start += n

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify_all()
