"""microbatch-inference: serve requests of any size in slices of at most ``b`` examples.

Each inference signature's function moves to ``<name>__vf..._slice``; its original name then
holds a loop that feeds the request through it ``b`` examples at a time and concatenates the
outputs, so memory is bounded by one slice and results equal the original's.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, List

from tensorflow.core.framework import types_pb2

from vfgraph.builder import (I32, FunctionBuilder, batch_size, check, func_attr, list_concat, shapes_attr, slice_rows,
                             type_attr, types_attr)
from vfgraph.errors import PipelineError
from vfgraph.ir.graph import FunctionGraph, arg_shapes, copy_header, verify_function_def
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
        item = item.for_edit()
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
            slice_fn = item.function(sig.function)
            header = copy_header(slice_fn)  # the serving function's name, arguments, outputs, attributes
            slice_fn.signature.name = function_name(sig.function, "slice")  # renamed in place: no copy
            for f in _loop_functions(item, sig, header, slice_fn, b):
                item.set_function(f)
            verify_function_def(item.function(sig.function), item.library)
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
    g = FunctionGraph._over(item.function(sig.function), item.library)  # read only
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


def _loop_functions(item: GraphItem, sig: SignatureInfo, header, slice_fn, b: int):
    """The serving loop: (replacement function, loop body, loop condition). A ``While`` over
    ``ceil(n / b)`` slices calls ``slice_fn`` (the serving function's nodes) on each and appends
    its outputs to tensor lists, concatenated at the end; ``header`` is the serving
    function's without its nodes."""
    g = FunctionGraph._over(slice_fn, item.library)  # read only
    lib = item.library
    lib[slice_fn.signature.name] = slice_fn
    names = g.arg_names
    types = [a.type for a in header.signature.input_arg]
    batch_idx = [names.index(a) for a in sig.batch_args]
    out_types = [a.type for a in slice_fn.signature.output_arg]
    out_shapes = [g.shape(ref) for _, ref in g.output_refs()]
    elements = [[-1] + [d if d >= 0 else -1 for d in s[1:]] for s in out_shapes]
    keys = [sig.input_keys.get(a, a) for a in sig.batch_args]
    i32 = type_attr(I32)
    body_name = function_name(sig.function, "microbatch", "body")
    cond_name = function_name(sig.function, "microbatch", "cond")
    # loop variables: i, one list per output, number of slices, every argument
    loop_types = [I32] + [types_pb2.DT_VARIANT] * len(out_types) + [I32] + types
    loop_shapes = [[]] + [[]] * len(out_types) + [[]] + arg_shapes(header)

    fb = FunctionBuilder(body_name, lib)
    arg_names = ["i"] + [f"outputs_{k}" for k in range(len(out_types))] + ["slices"] + names
    args = [fb.arg(n, t, s) for n, t, s in zip(arg_names, loop_types, loop_shapes)]
    i, lists, rest = args[0], args[1:1 + len(out_types)], args[2 + len(out_types):]
    start = fb.op("Mul", [i, fb.const(b, I32, "slice")[0]], name="start", T=i32)[0]
    rows = slice_rows(fb, start, fb.const(b, I32, "slice")[0])
    call_args = list(rest)
    for j in batch_idx:
        call_args[j] = rows(call_args[j], types[j])
    got = fb.op("StatefulPartitionedCall", call_args, name="slice", Tin=types_attr(types),
                Tout=types_attr(out_types), f=func_attr(slice_fn.signature.name))
    new = [fb.op("TensorListSetItem", [lst, i, got[k]], name="append", element_dtype=type_attr(t))[0]
           for k, (lst, t) in enumerate(zip(lists, out_types))]
    nxt = fb.op("AddV2", [i, fb.const(1, I32, "one")[0]], name="next", T=i32)[0]
    for k, (ref, t) in enumerate(zip([nxt] + new + args[1 + len(out_types):], loop_types)):
        fb.ret(f"out_{k}", ref, t)
    body = fb.finish()

    fb = FunctionBuilder(cond_name, lib)
    args = fb.args_of(body)  # the loop variables, as the body takes them
    fb.ret("more", fb.op("Less", [args[0], args[1 + len(out_types)]], name="more", T=i32)[0], types_pb2.DT_BOOL)
    fb.fdef.signature.is_stateful = False
    cond = fb.finish()

    lib.update({body_name: body, cond_name: cond})
    fb, args = FunctionBuilder.like(header, lib)
    n = batch_size(fb, args[batch_idx[0]], types[batch_idx[0]])
    checks = [check(fb, fb.op("Equal", [batch_size(fb, args[j], types[j]), n], name="same_batch", T=i32)[0],
                    f"vfgraph: inputs {keys[0]!r} and {k!r} have different leading (batch) dimensions")
              for k, j in zip(keys[1:], batch_idx[1:])]
    up = fb.op("AddV2", [n, fb.const(b - 1, I32, "round_up")[0]], name="rounded_up", T=i32)[0]
    slices = fb.op("FloorDiv", [up, fb.const(b, I32, "slice")[0]], name="slices", deps=checks, T=i32)[0]
    lists = [fb.op("TensorListReserve", [fb.const(e, I32, "element_shape")[0], slices], name="outputs",
                   element_dtype=type_attr(t), shape_type=i32)[0] for t, e in zip(out_types, elements)]
    loop = fb.op("While", [fb.const(0, I32, "zero")[0]] + lists + [slices] + args, name="microbatches",
                 T=types_attr(loop_types), cond=func_attr(cond_name), body=func_attr(body_name),
                 output_shapes=shapes_attr(loop_shapes), parallel_iterations=1, _lower_using_switch_merge=True)
    outs = loop.outputs()
    for k, (a, t, e, s) in enumerate(zip(header.signature.output_arg, out_types, elements, out_shapes)):
        fb.ret(a.name, list_concat(fb, outs[1 + k], t, e, s), t)
    return [fb.finish(), body, cond]
