"""insert-allreduce: data-parallel training over MPI ranks.

``split-vnodes`` leaves a reduce function between a step's virtual-node loop and its update
(identity on one process). This pass gives it a body: the gradient sums, the loss sums and
the number of virtual nodes are packed into fused buffers (grouped by dtype, at most
``fusion-mb`` each) and summed over ranks with ``VfAllreduce``, one buffer after another in a
fixed chain (every rank runs the collectives in the same order); sparse gradient rows are
gathered with ``VfAllgather``. The step then divides by the global number of virtual nodes
and runs the original update once, so its result does not depend on how the virtual nodes
are spread over ranks. On one process the collectives are skipped at run time.

It also adds a ``<train>_broadcast`` signature that checks every rank loaded the same graph
(``VfCheck``) and copies every variable from rank 0: the runtime calls it once at start.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import ClassVar, Dict, List

from tensorflow.core.framework import types_pb2

from vfgraph.builder import arg_specs, trace_replacement
from vfgraph.errors import PipelineError
from vfgraph.ir.graph import FunctionGraph, function_dependencies
from vfgraph.ir.names import function_name
from vfgraph.item import GraphItem
from vfgraph.passes.base import Pass, PassResult
from vfgraph.rewrites.split_vnodes import _header, _signature_wrapper, add_signature

DEFAULT_FUSION_MB = 4.0  # MiB; ResNet-50 gradients sum fastest in 1-4 MiB buffers (tools/bench_scaling.py)
ALIGN = 64  # bytes: TensorFlow's CPU split shares the input buffer for outputs aligned to this
_BYTES = {types_pb2.DT_HALF: 2, types_pb2.DT_BFLOAT16: 2, types_pb2.DT_FLOAT: 4, types_pb2.DT_DOUBLE: 8,
          types_pb2.DT_INT32: 4, types_pb2.DT_INT64: 8}


@dataclass(frozen=True)
class InsertAllreducePass(Pass):
    """``fusion_mb``: largest fused buffer in MiB; ``signature``: training signature (default: all
    signatures split into virtual nodes)."""

    name: ClassVar[str] = "insert-allreduce"
    fusion_mb: float = DEFAULT_FUSION_MB
    signature: str = ""

    def call(self, item: GraphItem) -> PassResult:
        from vfgraph import ops

        if self.fusion_mb <= 0:
            raise PipelineError(f"fusion-mb={self.fusion_mb}: must be positive")
        split = item.metadata.get("rewrites", {}).get("split-vnodes", {})
        keys = [self.signature] if self.signature else sorted(split)
        missing = [k for k in keys if k not in split]
        if not keys or missing:
            raise PipelineError(f"{item.source}: insert-allreduce reduces the virtual-node sums of a training "
                                "signature; run split-vnodes first, e.g. "
                                "'split-vnodes{vnodes=8},insert-allreduce'")
        ops.load()  # a clear error when the MPI ops cannot be built
        done = item.metadata.get("rewrites", {}).get(self.name, {})
        todo = [k for k in keys if k not in done]
        if not todo:
            return PassResult(item, False, ["all-reduce already inserted"])
        item = item.copy()
        notes: List[str] = []
        record = item.metadata.setdefault("rewrites", {}).setdefault(self.name, {})
        for key in todo:
            buffers = []
            for fn in split[key]["reduce_functions"]:
                header = item.function(fn)
                body, groups = _reduce_body(header, int(self.fusion_mb * (1 << 20)))
                for f in trace_replacement(header, body, fn):
                    item.set_function(f)
                FunctionGraph(item.function(fn), item.library).verify()
                buffers.append(groups)
            sig = item.signatures[key]
            fingerprint = graph_fingerprint(item, sig.function)
            bcast = _add_broadcast(item, key, fingerprint)
            if bcast is None:
                notes.append(f"broadcast signature: not added to signature {key!r} ({item.kind} model)")
            record[key] = {"fusion_mb": self.fusion_mb, "buffers": buffers, "fingerprint": fingerprint,
                           "broadcast_signature": bcast}
        return PassResult(item, True, notes)


def _reduce_body(header, limit: int):
    """The traced body of a reduce function, and its fused buffers (argument names per buffer)."""
    import tensorflow as tf

    from vfgraph import ops

    names = [a.name for a in header.signature.input_arg]
    specs = arg_specs(header)
    by_dtype: Dict[int, List[int]] = {}
    for i, a in enumerate(header.signature.input_arg):
        if a.name.startswith("sum_"):
            by_dtype.setdefault(a.type, []).append(i)
    buffers: List[List[int]] = []
    for dtype, idx in by_dtype.items():  # first-appearance order of dtypes: the same on every rank
        cur, size = [], 0
        for i in idx:
            shape = specs[i].shape
            n = shape.num_elements() if shape.is_fully_defined() else 0
            nbytes = n * _BYTES.get(dtype, 8)
            if cur and size + nbytes > limit:
                buffers.append(cur)
                cur, size = [], 0
            cur.append(i)
            size += nbytes
        if cur:
            buffers.append(cur)
    gathers = [i for i, n in enumerate(names) if n.startswith("gather_")]

    def reduce_all(xs):
        out, prev = list(xs), []
        for buf in buffers:
            static = all(specs[i].shape.is_fully_defined() for i in buf)
            lane = ALIGN // _BYTES.get(header.signature.input_arg[buf[0]].type, 8) if static else 1
            sizes = [specs[i].shape.num_elements() if static else tf.size(xs[i]) for i in buf]
            padded = [-(-n // lane) * lane for n in sizes] if static else sizes
            with tf.control_dependencies(prev):
                pieces = []
                for i, n, p in zip(buf, sizes, padded):
                    pieces.append(tf.reshape(xs[i], [-1]))
                    if p > n:  # each tensor starts aligned, so splitting the sum back copies nothing
                        pieces.append(tf.zeros([p - n], xs[i].dtype))
                packed = tf.concat(pieces, 0) if len(pieces) > 1 else tf.identity(pieces[0])
            summed = ops.allreduce(packed)
            prev = [summed]
            parts = tf.split(summed, padded if static else tf.stack(padded)) if len(buf) > 1 else [summed]
            for i, n, p, part in zip(buf, sizes, padded, parts):
                if static and p > n:
                    part = part[:n]
                out[i] = tf.reshape(part, specs[i].shape if static else tf.shape(xs[i]))
        for i in gathers:
            with tf.control_dependencies(prev):
                x = tf.identity(xs[i])
            out[i] = ops.allgather(x)
            prev = [out[i]]
        return out

    def body(*xs):
        xs = list(xs)
        reduced = tf.cond(ops.size() > 1, lambda: reduce_all(xs), lambda: xs)
        return [r if r.shape.is_fully_defined() else tf.ensure_shape(r, x.shape) for r, x in zip(reduced, xs)]

    return body, [[names[i] for i in buf] for buf in buffers] + [[names[i]] for i in gathers]


def graph_fingerprint(item: GraphItem, function: str) -> str:
    """SHA-256 of every library function a step runs: ranks that loaded different graphs differ."""
    lib = item.library
    h = hashlib.sha256()
    for name in sorted(function_dependencies(function, lib)):
        h.update(lib[name].SerializeToString(deterministic=True))
    return h.hexdigest()


def _add_broadcast(item: GraphItem, key: str, fingerprint: str):
    """Add signature ``<key>_broadcast``: check the graph fingerprint on every rank, then copy
    every variable the step uses from rank 0 (one after another). Returns its name, or None."""
    og = item.meta_graph.object_graph_def
    if item.kind != "saved_model" or not og.nodes:
        return None
    found = _signature_wrapper(item, key)
    if found is None:
        return None
    wrapper, forward, bare_id = found
    cf = og.concrete_functions[wrapper.signature.name]
    sig = item.signatures[key]
    inner = [forward[a.name] for a in wrapper.signature.input_arg]
    variables = inner[len(inner) - len(cf.bound_inputs):]
    g = FunctionGraph(item.function(sig.function), item.library)
    fn = function_name(sig.function, "broadcast", "0")
    header = _header(g, fn, variables, [], [], [])

    def broadcast(*handles):
        import tensorflow as tf

        from vfgraph import ops

        prev = [ops.check(fingerprint, what=f"signature {key!r}")]
        for h, a in zip(handles, variables):
            dtype = tf.dtypes.as_dtype(sig.variables[a].dtype)
            with tf.control_dependencies(prev):
                value = tf.raw_ops.ReadVariableOp(resource=h, dtype=dtype)
            prev = [tf.raw_ops.AssignVariableOp(resource=h, value=ops.broadcast(value, root=0))]
        with tf.control_dependencies(prev):
            return []

    for f in trace_replacement(header, broadcast, fn):
        item.set_function(f)
    name = f"{key}_broadcast"
    add_signature(item, name, fn, cf, bare_id, [], takes_inputs=False)
    return name
