"""microbatch-inference: serve requests of any size in slices of at most ``b`` examples.

Each inference signature's function moves to ``<name>__vf..._slice``; its original name then
holds a loop that feeds the request through it ``b`` examples at a time and concatenates the
outputs, so memory is bounded by one slice and results equal the original's.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, List

from vfgraph.builder import tf_dtype, trace_replacement
from vfgraph.errors import PipelineError
from vfgraph.ir.graph import FunctionGraph
from vfgraph.ir.names import function_name
from vfgraph.item import GraphItem, SignatureInfo
from vfgraph.passes.base import Pass, PassResult


@dataclass(frozen=True)
class MicrobatchInferencePass(Pass):
    """``vnode_batch``: the most examples one slice holds (0: the training rewrite's b, else 1
    slice per request, i.e. no change)."""

    name: ClassVar[str] = "microbatch-inference"
    vnode_batch: int = 0

    def call(self, item: GraphItem) -> PassResult:
        if self.vnode_batch < 0:
            raise PipelineError(f"vnode-batch={self.vnode_batch}: must be positive")
        b = self.vnode_batch or _training_b(item)
        if not b:
            return PassResult(item, False, ["microbatch-inference: no slice size (give vnode-batch); serving unchanged"])
        done = item.metadata.get("rewrites", {}).get(self.name, {})
        train = {r["function"] for r in item.metadata.get("rewrites", {}).get("split-vnodes", {}).values()}
        item = item.copy()
        notes: List[str] = []
        modified = False
        seen_functions = set()
        for sig in item.inference_signatures():
            if sig.key in done or sig.function in train or sig.function in seen_functions:
                continue
            seen_functions.add(sig.function)
            why = _unsliceable(item, sig)
            if why:
                notes.append(f"microbatch-inference: signature {sig.key!r} left as is: {why}")
                continue
            original = item.function(sig.function)
            slice_fn = original.__class__()
            slice_fn.CopyFrom(original)
            slice_fn.signature.name = function_name(sig.function, "slice")
            item.set_function(slice_fn)
            body = _loop_body(item, sig, slice_fn, b)
            for f in trace_replacement(original, body, function_name(sig.function, "microbatch")):
                item.set_function(f)
            FunctionGraph(item.function(sig.function), item.library).verify()
            item.preserve.add(sig.function)
            item.metadata.setdefault("rewrites", {}).setdefault(self.name, {})[sig.key] = {
                "function": sig.function, "slice_function": slice_fn.signature.name, "vnode_batch": b}
            modified = True
        return PassResult(item, modified, notes)


def _training_b(item: GraphItem) -> int:
    for rec in item.metadata.get("rewrites", {}).get("split-vnodes", {}).values():
        if rec.get("vnode_batch"):
            return int(rec["vnode_batch"])
    return 0


def _unsliceable(item: GraphItem, sig: SignatureInfo) -> str:
    g = FunctionGraph(item.function(sig.function), item.library)
    if not sig.batch_args:
        return "it has no batch inputs"
    for a in sig.batch_args:
        shape = g.arg_shape(a)
        if not shape or shape[0] >= 0:
            return f"input {sig.input_keys.get(a, a)!r} has no dynamic leading batch dimension (shape {shape})"
    for name, ref in g.output_refs():
        shape = g.shape(ref)
        if not shape or shape[0] >= 0:
            return f"output {name!r} has no dynamic leading batch dimension (shape {shape})"
    return ""


def _loop_body(item: GraphItem, sig: SignatureInfo, slice_fn, b: int):
    import tensorflow as tf

    g = FunctionGraph(item.function(sig.function), item.library)
    names = g.arg_names
    batch_idx = [names.index(a) for a in sig.batch_args]
    out_types = [tf_dtype(a.type) for a in slice_fn.signature.output_arg]
    out_shapes = [g.shape(ref) for _, ref in g.output_refs()]
    keys = [sig.input_keys.get(a, a) for a in sig.batch_args]

    def body(*args):
        args = list(args)
        n = tf.shape(args[batch_idx[0]])[0]
        checks = [tf.debugging.assert_equal(tf.shape(args[i])[0], n, message=(
            f"vfgraph: inputs {keys[0]!r} and {k!r} have different leading (batch) dimensions"))
            for k, i in zip(keys[1:], batch_idx[1:])]
        with tf.control_dependencies(checks):
            steps = (n + b - 1) // b
        arrays = [tf.TensorArray(t, size=steps, infer_shape=False,
                                 element_shape=tf.TensorShape([None] + [d if d >= 0 else None for d in s[1:]]))
                  for t, s in zip(out_types, out_shapes)]

        def cond(i, *_):
            return i < steps

        def loop(i, *tas):
            call_args = list(args)
            for j in batch_idx:
                call_args[j] = args[j][i * b:(i + 1) * b]
            got = tf.raw_ops.StatefulPartitionedCall(args=call_args, Tout=out_types, f=slice_fn.signature.name)
            return [i + 1] + [ta.write(i, v) for ta, v in zip(tas, got)]

        final = tf.while_loop(cond, loop, [tf.constant(0, tf.int32)] + arrays, parallel_iterations=1,
                              name="microbatches")
        return [ta.concat() for ta in final[1:]]

    return body
