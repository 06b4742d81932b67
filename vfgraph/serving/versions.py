"""The versions of one served model: ``BASE_PATH/<N>/`` SavedModels, the newest served.

Like TF Serving's file-system source with its default version policy (the latest version):
the base path is polled; when the newest numbered directory is not the one served, it is
loaded (``tf.saved_model.load``, tag ``serve``) beside the served one, then takes the new
requests while the old one finishes those it has (drained) and is released. A version that
fails to load is reported in the model's status (state END, its error) and the served one
stays; it is tried again only once its files change. States and errors use TF Serving's
``ModelVersionStatus`` names (START, LOADING, AVAILABLE, UNLOADING, END).
"""
from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, Iterator, List, Optional

import numpy as np

from vfgraph.serving.status import ServingError, invalid, not_found

log = logging.getLogger("vfgraph.serve")

SERVE_TAG = "serve"
PREDICT_METHOD = "tensorflow/serving/predict"
WARMUP_FILE = os.path.join("assets.extra", "tf_serving_warmup_requests")  # TF Serving's
MAX_WARMUP = 1000  # TF Serving's WarmupConsts::kMaxNumRecords


@dataclass
class VersionState:
    """What the model's status says of one version."""

    version: int
    state: str = "START"
    error_code: str = "OK"
    error_message: str = ""
    fingerprint: tuple = ()  # the files' (path, size, mtime) when it last failed to load


class Servable:
    """One loaded version: its SignatureDefs (as saved_model.pb has them, for metadata and
    checks) and the loaded object's signature functions (to run)."""

    def __init__(self, name: str, version: int, path: str):
        import tensorflow as tf
        from tensorflow.core.protobuf import saved_model_pb2

        self.name, self.version, self.path = name, version, path
        proto = saved_model_pb2.SavedModel()
        pb = os.path.join(path, "saved_model.pb")
        if not os.path.isfile(pb):
            raise ServingError("NOT_FOUND", f"Could not find SavedModel .pb or .pbtxt at supplied export directory "
                                            f"path: {path}")
        with open(pb, "rb") as f:
            proto.ParseFromString(f.read())
        graphs = [mg for mg in proto.meta_graphs if SERVE_TAG in mg.meta_info_def.tags]
        if not graphs:
            tags = "; ".join(",".join(mg.meta_info_def.tags) for mg in proto.meta_graphs)
            raise ServingError("NOT_FOUND", f"Could not find meta graph def matching supplied tags: {{ {SERVE_TAG} }}."
                                            f" (tag sets in the model: {tags or 'none'})")
        self.signature_defs = dict(graphs[0].signature_def)
        self.slices = _slices(path)
        self._loaded = tf.saved_model.load(path, tags=[SERVE_TAG])
        self.functions = dict(self._loaded.signatures)
        self._lock = threading.Lock()
        self.in_flight = 0
        self.warm_ups = self._warm_up()

    def _warm_up(self) -> int:
        """Run the requests of ``assets.extra/tf_serving_warmup_requests`` (TF Serving's format:
        a TFRecord file of PredictionLog protos, at most 1000) before the version is served; the
        number run. One that fails fails the load (TF Serving's saved_model_warmup_util.cc)."""
        path = os.path.join(self.path, WARMUP_FILE)
        if not os.path.isfile(path):
            return 0
        import tensorflow as tf
        from google.protobuf.message import DecodeError
        from tensorflow_serving.apis import prediction_log_pb2

        count = 0
        try:
            for record in tf.data.TFRecordDataset(path):
                entry = prediction_log_pb2.PredictionLog()
                try:
                    entry.ParseFromString(record.numpy())
                except DecodeError:
                    raise invalid(f"Failed to parse warmup record: {record.numpy()[:64]!r} from {path}")
                self._warm_up_one(entry, count, path)
                count += 1
                if count > MAX_WARMUP:
                    raise invalid(f"Number of warmup records exceeds the maximum ({MAX_WARMUP}) at {path}")
        except tf.errors.DataLossError as e:
            raise ServingError("DATA_LOSS", f"{e.message}. Please verify your warmup data is in TFRecord format.")
        return count

    def _warm_up_one(self, entry, index: int, path: str) -> None:
        import tensorflow as tf

        kind = entry.WhichOneof("log_type")
        if kind != "predict_log":
            raise ServingError("UNIMPLEMENTED", f"warm-up record {index} of {path}: {kind or 'an empty log'} is not "
                                                "run by vfgraph serve (predict_log is)")
        req = entry.predict_log.request
        try:
            self.predict(req.model_spec.signature_name, {k: tf.make_ndarray(v) for k, v in req.inputs.items()},
                         list(req.output_filter))
        except ServingError as e:
            raise ServingError(e.code, f"warm-up record {index} of {path}: {e.message}")

    def predict(self, signature: str, inputs: Dict[str, np.ndarray], output_filter=()) -> Dict[str, np.ndarray]:
        """Run signature ``signature`` (default ``serving_default``) on ``inputs``; the outputs
        named in ``output_filter``, or all of them. Checked as TF Serving's predict_util.cc
        checks a request; TensorFlow's own errors keep their codes."""
        import tensorflow as tf

        key = signature or "serving_default"
        sig = self.signature_defs.get(key)
        if sig is None:
            raise ServingError("FAILED_PRECONDITION", f'Serving signature key "{key}" not found.')
        if sig.method_name and sig.method_name not in (PREDICT_METHOD, "tensorflow/serving/classify",
                                                         "tensorflow/serving/regress"):
            raise ServingError("INTERNAL", "Expected prediction signature method_name to be one of "
                                           "{tensorflow/serving/predict, tensorflow/serving/classify, "
                                           f"tensorflow/serving/regress}}. Was: {sig.method_name}")
        _check_input_names(sig, inputs)
        wanted = _output_names(sig, output_filter)
        fn = self.functions.get(key)
        if fn is None:
            raise ServingError("FAILED_PRECONDITION", f'Serving signature key "{key}" has no function to run in '
                                                      f"{self.path}")
        feeds = {name: _input_tensor(tf, name, value, sig.inputs[name]) for name, value in inputs.items()}
        try:
            out = fn(**feeds)
        except tf.errors.OpError as e:
            from vfgraph.serving.status import CODE_NAMES

            raise ServingError(CODE_NAMES.get(e.error_code, "UNKNOWN"), e.message.strip().splitlines()[0])
        except (TypeError, ValueError) as e:
            raise invalid(str(e).strip().splitlines()[0])
        return {k: out[k].numpy() for k in wanted}

    @contextlib.contextmanager
    def use(self) -> Iterator["Servable"]:
        try:
            yield self
        finally:
            with self._lock:
                self.in_flight -= 1

    def _enter(self) -> None:
        with self._lock:
            self.in_flight += 1


def _slices(path: str) -> Dict[str, int]:
    """Signature -> the examples of one slice, for the signatures micro-batched in the model's
    own loop (its microbatch-inference records); empty for a model vfgraph did not write."""
    from vfgraph import records
    from vfgraph.errors import VfgraphError
    from vfgraph.records import Microbatch

    try:
        return {key: int(r.vnode_batch) for key, r in sorted(records.read(path, Microbatch).items())}
    except VfgraphError as e:
        raise ServingError("DATA_LOSS", str(e))


def _check_input_names(sig, inputs: Dict[str, np.ndarray]) -> None:
    given, wanted = set(inputs), set(sig.inputs)
    if given != wanted:
        raise invalid(f"input size does not match signature: {len(given)}!={len(wanted)} len({{{','.join(sorted(given))}"
                      f"}}) != len({{{','.join(sorted(wanted))}}}). Sent extra: {{{','.join(sorted(given - wanted))}}}"
                      f". Missing but required: {{{','.join(sorted(wanted - given))}}}.")


def _output_names(sig, output_filter) -> List[str]:
    seen: List[str] = []
    for alias in output_filter:
        if alias not in sig.outputs:
            raise invalid(f"output tensor alias not found in signature: {alias} Outputs expected to be in the set "
                          f"{{{','.join(sorted(sig.outputs))}}}.")
        if alias in seen:
            raise invalid(f"duplicate output tensor alias: {alias}")
        seen.append(alias)
    return seen or sorted(sig.outputs)


def _input_tensor(tf, name: str, value: np.ndarray, info):
    """``value`` as the tensor signature input ``name`` takes: of its dtype and a shape its
    static shape allows (an INVALID_ARGUMENT naming the input otherwise, as TensorFlow refuses
    a feed of another type)."""
    dtype = tf.dtypes.as_dtype(info.dtype)
    shape = [] if info.tensor_shape.unknown_rank else [d.size for d in info.tensor_shape.dim]
    value = np.asarray(value)
    if not info.tensor_shape.unknown_rank and (value.ndim != len(shape) or any(
            want >= 0 and got != want for got, want in zip(value.shape, shape))):
        want = "[" + ",".join("?" if d < 0 else str(d) for d in shape) + "]"
        raise invalid(f"input {name}: shape [{','.join(map(str, value.shape))}] given, the signature takes {want}")
    if dtype == tf.string:
        if value.dtype.kind not in "OSU":
            raise invalid(f"input {name}: expects string but {value.dtype} is provided")
        return tf.constant(value.astype(object), dtype=tf.string)
    if value.dtype != dtype.as_numpy_dtype:
        got = tf.dtypes.as_dtype(value.dtype).name if value.dtype.kind not in "OSU" else "string"
        raise invalid(f"input {name}: expects {dtype.name} but {got} is provided")
    return tf.constant(value)


def fingerprint(path: str) -> tuple:
    """The files under ``path`` with their sizes and modification times: what changes when a
    version directory is written again."""
    out = []
    for dirpath, dirnames, filenames in os.walk(path):
        dirnames.sort()
        for f in sorted(filenames):
            p = os.path.join(dirpath, f)
            with contextlib.suppress(OSError):
                st = os.stat(p)
                out.append((os.path.relpath(p, path), st.st_size, st.st_mtime_ns))
    return tuple(out)


def numbered_versions(base: str) -> Dict[int, str]:
    """``base``'s version directories: names that are non-negative integers (TF Serving reads
    ``00000123`` as version 123), by version."""
    found = {}
    with contextlib.suppress(FileNotFoundError, NotADirectoryError):
        for entry in os.scandir(base):
            if entry.name.isdigit() and entry.is_dir():
                found.setdefault(int(entry.name), entry.path)
    return found


@dataclass
class Manager:
    """Serves the newest version of model ``name`` under ``base``, polled every
    ``poll_seconds`` by :meth:`start`'s thread (or by calls of :meth:`poll`)."""

    name: str
    base: str
    poll_seconds: float = 1.0
    load: Callable[[str, int, str], Servable] = Servable
    states: Dict[int, VersionState] = field(default_factory=dict)
    serving: Optional[Servable] = None
    polls: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _draining: List[Servable] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)

    def acquire(self, version: Optional[int] = None):
        """The servable for a request (the newest, or version ``version``), counted in flight
        until the returned context ends; NOT_FOUND as TF Serving words it when there is none."""
        with self._lock:
            s = self.serving
            if s is None or (version is not None and s.version != version):
                what = f"Latest({self.name})" if version is None else f"Specific({self.name}, {version})"
                raise not_found(f"Servable not found for request: {what}")
            s._enter()
        return s.use()

    def poll(self) -> None:
        """Look at the base path once: load the newest version if it is not served (and did not
        fail with the same files), switch to it, release drained versions."""
        self.polls += 1
        found = numbered_versions(self.base)
        if found:
            newest = max(found)
            current = self.serving.version if self.serving else None
            st = self.states.get(newest)
            if newest != current and not (st and st.state == "END" and st.error_code != "OK"
                                          and st.fingerprint == fingerprint(found[newest])):
                self._load(newest, found[newest])
        elif self.polls == 1:
            log.warning("no version of model %r under %s yet (numbered directories); polling every %gs", self.name,
                        self.base, self.poll_seconds)
        self._release_drained()

    def _load(self, version: int, path: str) -> None:
        with self._lock:  # (the APIs' threads read the states)
            st = self.states.setdefault(version, VersionState(version))
        st.state, st.error_code, st.error_message = "LOADING", "OK", ""
        files = fingerprint(path)
        started = time.monotonic()
        try:
            servable = self.load(self.name, version, path)
        except Exception as e:  # (any failure: reported in the status, the served version stays)
            code = e.code if isinstance(e, ServingError) else "UNKNOWN"
            message = e.message if isinstance(e, ServingError) else f"{type(e).__name__}: {str(e).strip()}"
            st.state, st.error_code, st.error_message = "END", code, message.splitlines()[0][:500]
            st.fingerprint = files
            if self.polls > 1:  # (at start-up, the command line says it)
                log.error("model %r version %d failed to load from %s: %s; %s", self.name, version, path,
                          st.error_message, f"still serving version {self.serving.version}" if self.serving
                          else "nothing served")
            return
        with self._lock:
            old, self.serving = self.serving, servable
            st.state = "AVAILABLE"
            if old is not None:
                self.states[old.version].state = "UNLOADING"
                self._draining.append(old)
        warm, slices = getattr(servable, "warm_ups", 0), getattr(servable, "slices", {})
        sliced = ", ".join(f"{k} in slices of {b}" for k, b in slices.items())
        log.warning("serving model %r version %d (%s, %s%sloaded in %.1fs)", self.name, version, path,
                    f"micro-batched: {sliced}, " if sliced else "", f"{warm} warm-up request(s), " if warm else "",
                    time.monotonic() - started)

    def _release_drained(self) -> None:
        for old in list(self._draining):
            with old._lock:
                busy = old.in_flight
            if not busy:
                self._draining.remove(old)
                self.states[old.version].state = "END"
                log.warning("model %r version %d unloaded", self.name, old.version)

    def statuses(self, version: Optional[int] = None) -> List[VersionState]:
        """The states of every version seen (or of ``version``), newest first; NOT_FOUND as
        TF Serving's GetModelStatus words it."""
        with self._lock:
            states = dict(self.states)
        if version is not None:
            if version not in states:
                raise not_found(f"Could not find version {version} of model {self.name}")
            return [states[version]]
        if not states:
            raise not_found(f"Could not find any versions of model {self.name}")
        return [states[v] for v in sorted(states, reverse=True)]

    def start(self) -> threading.Thread:
        def run():
            while not self._stop.wait(self.poll_seconds):
                try:
                    self.poll()
                except Exception:  # (a poll that fails is logged; the next one tries again)
                    log.exception("polling %s failed", self.base)

        t = threading.Thread(target=run, name="vfgraph-serve-poll", daemon=True)
        t.start()
        return t

    def stop(self) -> None:
        self._stop.set()

    def in_flight(self) -> int:
        with self._lock:
            live = ([self.serving] if self.serving else []) + self._draining
        return sum(s.in_flight for s in live)

