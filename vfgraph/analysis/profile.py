"""A measured profile of a training step: what each op of the training function costs.

The step runs here, on this machine's CPU, on a synthetic batch (floats drawn from a normal
distribution, integers zero, booleans true), as one TensorFlow graph in a session of its own
with one intra-op and one inter-op thread (as a pipeline stage's rank runs it) and with
TensorFlow's per-op step statistics turned on (``RunOptions.SOFTWARE_TRACE``: a timestamp
before and after each kernel, no profiler threads). The model's variables are copied into
that session, so the model and its files are left as they were. The session runs the graph
as TensorFlow runs a training step: function calls inlined, Grappler's rewrites applied, so
an op Grappler fused into the op after it (a MatMul and its BiasAdd into the Relu) has no
time of its own; its share of the fused op's time, in proportion to the ops' estimated
costs, is given back to it.

The result is each op's time in microseconds per step (the median over the profiled steps),
keyed by the op's name in the training function; an op inside a called function counts for
its call. :func:`vfgraph.analysis.stages.plan_stages` balances stages with it.

A profile is of the machine it ran on and varies from run to run. :func:`write_profile` keeps
one in a JSON file (``vfgraph profile``) and :func:`read_profile` reads it back, so that a
model can be profiled once where it will train and rewritten anywhere, the same rewrite from
the same file. ``vfgraph profile`` also records the step's peak memory at a few batches
(:mod:`vfgraph.analysis.memory`), from which a memory budget chooses the virtual-node batch.
"""
from __future__ import annotations

import json
import statistics
from dataclasses import dataclass, field
from typing import Dict, Mapping, Optional, Sequence, Tuple

from vfgraph.errors import InputError
from vfgraph.io.outputs import PROFILE_FORMAT, write_file
from vfgraph.ir.graph import FunctionGraph
from vfgraph.item import SignatureInfo


@dataclass(frozen=True)
class Peaks:
    """The measured peaks of a step: ``peaks[i]`` bytes at ``batches[i]`` examples, on
    ``device`` ("CPU" or "GPU"), where ``measured_on`` says."""

    batches: Tuple[int, ...]
    peaks: Tuple[int, ...]
    device: str = "CPU"
    measured_on: Tuple[Tuple[str, str], ...] = ()

    def to_json(self) -> dict:
        return {"batches": list(self.batches), "peaks": list(self.peaks), "device": self.device,
                "measured_on": dict(self.measured_on)}

    @classmethod
    def from_json(cls, d: dict) -> "Peaks":
        """Raises ValueError (or KeyError, TypeError) for a damaged record."""
        batches, peaks = tuple(int(b) for b in d["batches"]), tuple(int(p) for p in d["peaks"])
        if len(batches) != len(peaks) or len(set(batches)) < 2 or min(batches) < 1 or min(peaks, default=0) < 0:
            raise ValueError(f"{len(batches)} batches, {len(peaks)} peaks: two or more distinct batches needed")
        return cls(batches, peaks, str(d.get("device", "CPU")),
                   tuple(sorted((str(k), str(v)) for k, v in d.get("measured_on", {}).items())))


@dataclass(frozen=True)
class StepProfile:
    """Measured times of a training step's ops (microseconds per step, medians)."""

    signature: str
    function: str
    batch: int
    steps: int
    step_us: float                                    # the whole step's median wall time
    ops: Mapping[str, float] = field(default_factory=dict)    # session node -> time per step
    kinds: Mapping[str, str] = field(default_factory=dict)    # session node -> the op it ran
    measured_on: Mapping[str, str] = field(default_factory=dict)  # machine, CPU, TensorFlow, threads
    memory: Optional[Peaks] = None  # the step's peak memory at a few batches (vfgraph.analysis.memory)


def synthetic_batch(specs: Sequence[Tuple[str, int, Optional[Sequence[int]]]], batch: int, where: str,
                    seed: int = 0) -> Dict[str, "object"]:
    """A batch of ``batch`` examples for inputs ``specs`` (key, dtype enum, shape with -1 for an
    unknown dimension) of signature ``where``: normal floats, zero integers (an index, a label
    and a token id are valid at zero), true booleans. Raises InputError for an input whose
    shape it cannot make (an unknown dimension past the batch's) or whose type it has no
    values for."""
    import numpy as np
    from tensorflow.python.framework import dtypes

    rng = np.random.default_rng(seed)
    out = {}
    for key, dtype, shape in specs:
        if shape is None:
            raise InputError(f"signature {where!r}: input {key!r} has an unknown rank, so a batch for the "
                             "profile cannot be made; export the signature with its input shapes")
        shape = list(shape)
        if shape and shape[0] < 0:
            shape[0] = batch
        if any(d < 0 for d in shape):
            raise InputError(f"signature {where!r}: input {key!r} has shape {list(shape)}, unknown past the "
                             "batch dimension, so a batch for the profile cannot be made; export the signature "
                             "with a fixed size there (e.g. the sequence length), or balance by the estimate")
        dt = dtypes.as_dtype(dtype)
        if dt.is_floating:
            out[key] = rng.standard_normal(shape).astype(dt.as_numpy_dtype)
        elif dt.is_integer:
            out[key] = np.zeros(shape, dt.as_numpy_dtype)
        elif dt == dtypes.bool:
            out[key] = np.ones(shape, bool)
        else:
            raise InputError(f"signature {where!r}: input {key!r} is of type {dt.name}, for which the profile "
                             "makes no values; balance by the estimate (or give --split-at)")
    return out


def profile_step(path: str, sig: SignatureInfo, batch: int = 32, steps: int = 10, warmup: int = 3) -> StepProfile:
    """Run the training signature ``sig`` of the SavedModel at ``path`` ``warmup + steps``
    times on a synthetic batch of ``batch`` examples and measure each op (see the module's
    note). Raises InputError when ``path`` is not a SavedModel directory TensorFlow can load or
    its step fails on the batch."""
    import time

    import tensorflow as tf

    from vfgraph.io.savedmodel import is_saved_model_dir, load_to_run

    if batch < 1 or steps < 1:
        raise InputError(f"a profile needs a batch of at least 1 example and at least 1 step (given {batch}, {steps})")
    if not is_saved_model_dir(path):
        raise InputError(f"a profile runs the training step of a SavedModel directory; {path} is not one (balance by "
                         "the estimate, or give the cuts with --split-at)")
    loaded = load_to_run(path)
    fn = loaded.signatures.get(sig.key) if hasattr(loaded, "signatures") else None
    if fn is None:
        raise InputError(f"{path}: no signature {sig.key!r} to profile")
    structured = fn.structured_input_signature[1]
    feed_values = synthetic_batch(
        [(k, structured[k].dtype.as_datatype_enum,
          None if structured[k].shape.rank is None else [-1 if d is None else d for d in structured[k].shape.as_list()])
         for k in sorted(structured)], batch, sig.key)
    g, fetches, init, feeds, initial = _session_graph(fn, feed_values)
    # the loaded model goes: its values wait in ``initial`` until the session's variables take
    # them, so that no more than two copies of the model are held at once, and then one
    del loaded, fn
    config = tf.compat.v1.ConfigProto(intra_op_parallelism_threads=1, inter_op_parallelism_threads=1,
                                      device_count={"GPU": 0}, allow_soft_placement=True)
    trace = tf.compat.v1.RunOptions(trace_level=tf.compat.v1.RunOptions.SOFTWARE_TRACE)
    per_node: Dict[str, list] = {}
    kinds: Dict[str, str] = {}
    walls = []
    with tf.compat.v1.Session(graph=g, config=config) as session:
        try:
            session.run(init, initial)
            initial.clear()
            for _ in range(warmup):
                session.run(fetches, feeds)
            for _ in range(steps):
                meta = tf.compat.v1.RunMetadata()
                t0 = time.perf_counter()
                session.run(fetches, feeds, options=trace, run_metadata=meta)
                walls.append((time.perf_counter() - t0) * 1e6)
                seen: Dict[str, float] = {}
                for dev in meta.step_stats.dev_stats:
                    for ns in dev.node_stats:
                        seen[ns.node_name] = seen.get(ns.node_name, 0.0) + ns.op_end_rel_micros
                        kinds.setdefault(ns.node_name, _executed_op(ns.timeline_label))
                for name, us in seen.items():
                    per_node.setdefault(name, []).append(us)
        except tf.errors.OpError as e:
            first = (str(getattr(e, "message", "") or e).strip().splitlines() or [type(e).__name__])[0][:300]
            raise InputError(f"{path}: signature {sig.key!r} fails on a synthetic batch of {batch} examples "
                             f"({first}); balance by the estimate, or give --split-at") from None
    times = {n: statistics.median(v + [0.0] * (steps - len(v))) for n, v in per_node.items()}
    return StepProfile(sig.key, sig.function, batch, steps, statistics.median(walls), times, kinds, _machine())


def profile_of(path: str, sig: SignatureInfo, batch: int, file: str = "") -> StepProfile:
    """The profile the stages of ``sig`` balance: the one in ``file`` where given (refused when
    it is of another signature), else a step of ``batch`` examples of the SavedModel at
    ``path`` profiled here."""
    if not file:
        return profile_step(path, sig, batch=batch)
    profile = read_profile(file)
    if profile.signature != sig.key:
        raise InputError(f"{file}: a profile of signature {profile.signature!r}, and the step to cut into stages is "
                         f"{sig.key!r}: profile that one (vfgraph profile MODEL --train-signature {sig.key} -o FILE)")
    return profile


def _machine() -> Dict[str, str]:
    """Where a profile ran: the machine, its CPU, TensorFlow's version, the threads."""
    import platform

    import tensorflow as tf

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    return {"host": platform.node(), "cpu": cpu, "tensorflow": tf.__version__,
            "threads": "1 intra-op, 1 inter-op (CPU)"}


_PROFILE_VERSION = 1


def write_profile(profile: StepProfile, path: str, model: str = "") -> None:
    """Write ``profile`` (of ``model``) to the JSON file ``path``, whole or not at all (through
    a temporary file beside it); the same profile gives the same bytes."""
    record = {"format": PROFILE_FORMAT, "version": _PROFILE_VERSION, "model": model,
              "signature": profile.signature, "function": profile.function, "batch": profile.batch,
              "steps": profile.steps, "step_us": round(profile.step_us, 3), "measured_on": dict(profile.measured_on),
              "ops": {n: round(us, 3) for n, us in profile.ops.items()}, "kinds": dict(profile.kinds)}
    if profile.memory is not None:
        record["memory"] = profile.memory.to_json()
    write_file(path, (json.dumps(record, indent=1, sort_keys=True) + "\n").encode())


def read_profile(path: str) -> StepProfile:
    """The profile :func:`write_profile` wrote to ``path``. Raises InputError for a file that
    is missing, not JSON, or not such a profile."""
    try:
        with open(path) as f:
            record = json.load(f)
    except FileNotFoundError:
        raise InputError(f"{path}: no such profile; write one with 'vfgraph profile MODEL -o {path}'") from None
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise InputError(f"{path}: cannot read a profile from it ({getattr(e, 'strerror', None) or e}); give a file "
                         "'vfgraph profile' wrote") from None
    if not isinstance(record, dict) or record.get("format") != PROFILE_FORMAT:
        raise InputError(f"{path}: not a step profile (no \"format\": \"{PROFILE_FORMAT}\"); give a file "
                         "'vfgraph profile' wrote")
    if record.get("version") != _PROFILE_VERSION:
        raise InputError(f"{path}: a profile of format version {record.get('version')!r}, this vfgraph reads version "
                         f"{_PROFILE_VERSION}; profile the model again with this vfgraph")
    try:
        ops = {str(n): float(us) for n, us in record["ops"].items()}
        kinds = {str(n): str(k) for n, k in record.get("kinds", {}).items()}
        profile = StepProfile(str(record["signature"]), str(record["function"]), int(record["batch"]),
                              int(record["steps"]), float(record["step_us"]), ops, kinds,
                              {str(k): str(v) for k, v in record.get("measured_on", {}).items()},
                              Peaks.from_json(record["memory"]) if "memory" in record else None)
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise InputError(f"{path}: a damaged profile ({type(e).__name__}: {e}); profile the model again") from None
    if profile.batch < 1 or not ops or any(us < 0 for us in ops.values()):
        raise InputError(f"{path}: a damaged profile (batch {profile.batch}, {len(ops)} op times); profile the model "
                         "again")
    return profile


def _session_graph(fn, feed_values: Mapping[str, "object"], device: str = "/CPU:0"):
    """A graph that runs the loaded training function ``fn`` as a session runs a step: its
    inputs placeholders fed ``feed_values``, its variables and captured values variables of
    the graph, initialised from the values they hold now (fed, not written into the graph: a
    graph proto holds at most 2 GiB). Returns (graph, fetches, initializer, feeds, the
    initializer's feeds). ``device``: where the graph runs."""
    import tensorflow as tf
    from tensorflow.python.ops import resource_variable_ops

    def value_of(captured):  # (its value, its dtype, whether it is a variable's)
        if captured.dtype != tf.resource:
            return captured.numpy(), captured.dtype, False
        dtype = tf.dtypes.as_dtype(resource_variable_ops.get_eager_safe_handle_data(captured).shape_and_type[0].dtype)
        return tf.raw_ops.ReadVariableOp(resource=captured, dtype=dtype).numpy(), dtype, True

    structured = fn.structured_input_signature[1]
    captures = list(fn.graph.internal_captures)
    fed = [t for t in fn.graph.inputs if all(t is not c for c in captures)]
    values = [value_of(c) for c in fn.captured_inputs]  # (eagerly: before the graph is the default)
    g = tf.Graph()
    with g.as_default(), tf.device(device):
        input_map, feeds, initial = {}, {}, {}
        for ph, (value, dtype, variable) in zip(captures, values):
            given = tf.compat.v1.placeholder(dtype, value.shape, name="profiled_value")
            initial[given] = value
            if variable:
                input_map[ph.name] = tf.compat.v1.Variable(given, name="profiled_variable", use_resource=True).handle
            else:
                input_map[ph.name] = tf.compat.v1.Variable(given, name="profiled_capture", trainable=False,
                                                           use_resource=True).read_value()
        for key, ph in zip(sorted(structured), fed):
            p = tf.compat.v1.placeholder(structured[key].dtype, feed_values[key].shape, name="profiled_" + key)
            input_map[ph.name] = p
            feeds[p] = feed_values[key]
        fetches = tf.compat.v1.import_graph_def(fn.graph.as_graph_def(), input_map=input_map,
                                                return_elements=[t.name for t in fn.graph.outputs], name="step")
        init = tf.compat.v1.global_variables_initializer()
    return g, fetches, init, feeds, initial


def _executed_op(label: str) -> str:
    """The op a step-statistics timeline label names ("name = Op(inputs)") ("" when none)."""
    _, eq, rest = label.partition(" = ")
    return rest.split("(", 1)[0].strip() if eq else ""


def function_costs(profile: StepProfile, g: FunctionGraph, estimate: Mapping[str, int]) -> Dict[str, int]:
    """The profiled time of each op of the training function ``g``, in nanoseconds per step.

    The session's nodes are the function's, inlined under the names of the calls that reached
    it (``step/StatefulPartitionedCall/...``): the prefix is the one under which the most of
    them are the function's ops. An inlined op of a function ``g`` calls counts for the call.
    An op Grappler fused into another (the session ran the other under its own name as a
    ``_Fused...`` op, its inputs' ops not at all) shares that op's time with the ops it
    absorbed, the chain of ops feeding only it that ran no kernel of their own, in proportion
    to their ``estimate``. Raises InputError when the profile is not of ``g`` (few of its ops
    found)."""
    names = g.nodes
    votes: Dict[int, int] = {}
    for n in profile.ops:
        parts = n.split("/")
        for k in range(len(parts)):
            if "/".join(parts[k:]) in names:
                votes[k] = votes.get(k, 0) + 1
                break
    if not votes:
        raise InputError(f"the profile of signature {profile.signature!r} names none of the ops of {g.name!r}: it is "
                         "of another model")
    depth = max(votes, key=lambda k: (votes[k], -k))
    ran: Dict[str, float] = {}
    kind: Dict[str, str] = {}
    for n, us in profile.ops.items():
        parts = n.split("/")[depth:]
        for j in range(len(parts), 0, -1):
            op = "/".join(parts[:j])
            if op in names:
                ran[op] = ran.get(op, 0.0) + us
                if j == len(parts):
                    kind[op] = profile.kinds.get(n, "")
                break
    costed = [n for n, c in estimate.items() if c > 0]
    found = sum(1 for n in costed if n in ran)
    if costed and found < 0.25 * len(costed):
        raise InputError(f"the profile of signature {profile.signature!r} times {found} of the {len(costed)} ops of "
                         f"{g.name!r} with an estimated cost: it is of another model or version")
    ops = g.op_types()
    cost = {n: int(round(us * 1000)) for n, us in ran.items()}
    for n, k in kind.items():
        if not k.startswith("_Fused") or ops.get(n) == k:
            continue
        group, frontier = [n], [n]
        while frontier and len(group) < 8:
            nxt = []
            for m in frontier:
                for t in g.data_inputs(m):
                    p = t.node
                    if t.is_function_arg or p in ran or p in group or p not in estimate:
                        continue
                    if all(c in group for r in g.outputs(p) for c, _ in g.consumers(r)):
                        group.append(p)
                        nxt.append(p)
            frontier = nxt
        weights = [max(estimate.get(m, 0), 0) for m in group]
        total = sum(weights)
        if len(group) > 1 and total > 0:
            whole = cost[n]
            for m, w in zip(group, weights):
                cost[m] = whole * w // total
            cost[n] += whole - sum(cost[m] for m in group)
    return cost
