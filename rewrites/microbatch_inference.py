"""microbatch-inference: serve requests of any size in slices of at most ``b`` examples.

Each inference signature's function becomes, in place, the body of a loop
(``__vf_<name>_microbatch_body``) that takes rows ``[i * b, (i + 1) * b)`` of the batch inputs;
its original name then holds a function that checks the inputs and runs the loop, which
appends each slice's outputs to tensor lists and concatenates them at the end: memory is
bounded by one slice and results equal the original's.

The loop runs on TensorFlow's single-threaded executor: the loop and each slice's kernels on
the one thread that serves the request (a kernel still spreads its own work over the
intra-op threads). On the default executor the slices' ops go to whichever inter-op thread is
free, and glibc's malloc keeps an arena per thread that holds on to what it freed: with many
inter-op threads a request stayed resident at several slices' activations, up to as much as
the whole request unsliced, and so does a hand-written ``tf.while_loop`` over slices
(docs/benchmarks.md). The single-threaded executor cannot run TF1 control flow, partitioned
graphs, collectives or reference variables, and a function called inside the loop would run
on the default executor (and could wait forever on a server's one inter-op thread): a serving
function with any of these keeps the default executor, and a note says so.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, List, Tuple

from tensorflow.core.framework import types_pb2

from vfgraph import records
from vfgraph.ir.attrs import func_attr, shape_proto, type_attr, types_attr
from vfgraph.ir.blocks import I32, list_concat
from vfgraph.ir.functions import arg_shapes, copy_header, function_dependencies
from vfgraph.ir.graph import FunctionGraph, parse_input, verify_function_def
from vfgraph.ir.loops import LoopLayout, append, condition, next_index, reserve, same_batch, slice_reader, while_loop
from vfgraph.ir.names import function_name, tensor_node
from vfgraph.item import GraphItem, SignatureInfo
from vfgraph.passes.base import Pass, PassResult, option, register
from vfgraph.records import Microbatch, VirtualNodes

SINGLE_THREADED = "SINGLE_THREADED_EXECUTOR"
# what TensorFlow's single-threaded executor refuses (TF1 control flow, partitioned graphs,
# collectives, reference variables)
_NOT_SINGLE_THREADED = frozenset((
    "Switch", "RefSwitch", "_SwitchN", "Merge", "RefMerge", "Enter", "RefEnter", "Exit", "RefExit", "NextIteration",
    "RefNextIteration", "LoopCond", "ControlTrigger", "_Send", "_Recv", "_HostSend", "_HostRecv", "Send", "Recv",
    "VariableV2", "Variable", "TemporaryVariable"))


@register
@dataclass(frozen=True)
class MicrobatchInferencePass(Pass):
    """Run each serving signature over a request in slices of at most b examples, one after
    another, so serving memory follows b rather than the request's size."""

    name: ClassVar[str] = "microbatch-inference"
    produces: ClassVar[tuple] = (Microbatch,)
    vnode_batch: int = option(0, "the most examples one serving slice holds (0: the training rewrite's b; with none, "
                                 "serving is left as it is)", low=0, flag=True, metavar="B")

    def differences(self, record: Microbatch) -> List[str]:
        """The slice size (when given) against the record's."""
        same = not self.vnode_batch or self.vnode_batch == record.vnode_batch
        return [] if same else [f"vnode-batch={self.vnode_batch} given, {record.vnode_batch} recorded"]

    def call(self, item: GraphItem) -> PassResult:
        b = self.vnode_batch or _training_b(item)
        if not b:
            return PassResult(item, False, ["microbatch-inference: no slice size (give vnode-batch); serving unchanged"])
        done = records.get(item, Microbatch)
        train = {r.function for r in records.get(item, VirtualNodes).values()}
        notes: List[str] = []
        modified = False
        seen_functions = set()
        for sig in item.inference_signatures():
            if sig.key in done:
                notes.append(self.rewritten_before(item, sig.key))
                continue
            if sig.function in train or sig.function in seen_functions:
                continue
            seen_functions.add(sig.function)
            why = _unsliceable(item, sig)
            if why:
                notes.append(f"microbatch-inference: signature {sig.key!r} left as is: {why}")
                continue
            serving_fn = item.function(sig.function)
            header = copy_header(serving_fn)  # the serving function's name, arguments, outputs, attributes
            single, why_not = _single_threaded(item, serving_fn)
            if not single:
                notes.append(f"microbatch-inference: signature {sig.key!r} runs its slices on TensorFlow's default "
                             f"executor ({why_not}), so its peak memory can grow with the inter-op threads")
            # the serving function becomes the loop body in place (no copy); its name then
            # holds the new serving function
            new = _loop_functions(item, sig, header, serving_fn, b, single)
            for f in new:
                item.set_function(f)
            verify_function_def(item.function(sig.function), item.library)
            item.preserve.add(sig.function)
            records.put(item, sig.key, Microbatch(
                function=sig.function, vnode_batch=b, loop_function=new[1].signature.name,
                body_function=serving_fn.signature.name, executor=SINGLE_THREADED if single else "default"))
            modified = True
        return PassResult(item, modified, notes)


def _training_b(item: GraphItem) -> int:
    for rec in records.get(item, VirtualNodes).values():
        if rec.vnode_batch:
            return int(rec.vnode_batch)
    return 0


def _unsliceable(item: GraphItem, sig: SignatureInfo) -> str:
    g = FunctionGraph.over(item.function(sig.function), item.library)  # read only
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


def _single_threaded(item: GraphItem, fdef) -> Tuple[bool, str]:
    """(whether serving function ``fdef`` can run on the single-threaded executor, why not)."""
    called = function_dependencies(fdef.signature.name, item.library)[1:]
    if called:
        return False, f"it calls function {called[0]!r}"
    for node in fdef.node_def:
        if node.op in _NOT_SINGLE_THREADED or node.op.startswith("Collective"):
            return False, f"it has a {node.op} op ({node.name!r})"
    return True, ""


def _loop_functions(item: GraphItem, sig: SignatureInfo, header, slice_fn, b: int, single: bool = True):
    """The serving loop: (replacement function, loop function, loop condition); the loop body
    is ``slice_fn`` itself (the serving function's nodes, edited in place). The replacement
    checks the inputs and counts the ``ceil(n / b)`` slices; the loop function runs a ``While``
    over them whose body takes its slice of the batch inputs, runs the serving nodes on it and
    appends their outputs to tensor lists, concatenated at the end. The serving nodes sit in
    the body itself rather than behind a call: a call there would start its own executor,
    which hands its ops to the inter-op threads (and, waiting on them from the one inter-op
    thread a server may have, would never return). ``single``: the loop function runs on the
    single-threaded executor (never inlined, the ``While`` not lowered to TF1 control flow,
    which that executor cannot run), and with it each iteration. ``header`` is the serving
    function's without its nodes."""
    g = FunctionGraph.over(slice_fn, item.library)  # read only, before the edit
    lib = item.library
    names = g.arg_names
    types = [a.type for a in header.signature.input_arg]
    batch_idx = [names.index(a) for a in sig.batch_args]
    out_types = [a.type for a in slice_fn.signature.output_arg]
    out_shapes = [g.shape(ref) for _, ref in g.output_refs()]
    elements = [[-1] + [d if d >= 0 else -1 for d in s[1:]] for s in out_shapes]
    keys = [sig.input_keys.get(a, a) for a in sig.batch_args]
    i32 = type_attr(I32)
    executor = SINGLE_THREADED if single else ""
    loop_name = function_name(sig.function, "microbatch", "loop")
    body_name = function_name(sig.function, "microbatch", "body")
    cond_name = function_name(sig.function, "microbatch", "cond")
    # loop variables: i, one list per output, number of slices, every argument
    layout = LoopLayout.of([(types_pb2.DT_VARIANT, [])] * len(out_types), list(zip(types, arg_shapes(header))))
    _to_loop_body(slice_fn, body_name, lib, b, names, layout, batch_idx, out_types)
    lib[body_name] = slice_fn
    verify_function_def(slice_fn, lib)

    cond = condition(cond_name, slice_fn, layout, lib)
    lib[cond_name] = cond
    fb = FunctionGraph.new(loop_name, lib)
    slices = fb.arg("slices", I32, [])
    args = [fb.arg(n, t, s) for n, t, s in zip(names, types, layout.fixed_shapes)]
    if single:
        fb.fdef.attr["_noinline"].b = True  # an inlined call would leave the default executor running it
    lists = [reserve(fb, slices, t, e, "outputs") for t, e in zip(out_types, elements)]
    loop = while_loop(fb, layout, lists, slices, args, cond_name, body_name, "microbatches", lower=not single)
    _, outs, _, _ = layout.split(loop.outputs())
    for k, (t, e, s) in enumerate(zip(out_types, elements, out_shapes)):
        fb.ret(f"output_{k}", list_concat(fb, outs[k], t, e, s), t)
    loop_fn = fb.finish()

    lib[loop_name] = loop_fn
    fb, args = FunctionGraph.like(header, lib)
    n, checks = same_batch(fb, [args[j] for j in batch_idx], [types[j] for j in batch_idx], keys, "inputs")
    up = fb.op("AddV2", [n, fb.const(b - 1, I32, "round_up")[0]], name="rounded_up", T=i32)[0]
    slices = fb.op("FloorDiv", [up, fb.const(b, I32, "slice")[0]], name="slices", deps=checks, T=i32)[0]
    run = fb.op("StatefulPartitionedCall", [slices] + args, name="microbatches", Tin=types_attr([I32] + types),
                Tout=types_attr(out_types), f=func_attr(loop_name), executor_type=executor, shapes=out_shapes)
    for k, (a, t) in enumerate(zip(header.signature.output_arg, out_types)):
        fb.ret(a.name, run[k], t)
    return [fb.finish(), loop_fn, cond]


def _to_loop_body(fdef, name: str, lib, b: int, names, layout: LoopLayout, batch_idx, out_types) -> None:
    """Turn serving function ``fdef`` in place into the ``While`` body ``name``: its arguments
    become (i, one tensor list per output, number of slices, its own arguments), each batch
    argument is read as rows ``[i * b, (i + 1) * b)`` of itself, and it returns the loop
    variables with its outputs set as item i of the lists. The nodes this adds are named under
    a prefix none of ``fdef``'s names use."""
    taken = {a.name for a in fdef.signature.input_arg} | {n.name.split("/")[0] for n in fdef.node_def}
    p = "vf_microbatch"
    while p in taken or any(t.startswith(p + "_") for t in taken):
        p += "_"
    types = layout.fixed_types
    # the bookkeeping nodes, written as a function of the loop variables and one stand-in
    # argument per output of the serving nodes (replaced by those outputs below)
    fb = FunctionGraph.new(name, lib)
    loop_vars = layout.args(fb, [f"{p}_i"] + [f"{p}_outputs_{k}" for k in range(len(out_types))] + [f"{p}_slices"] +
                            list(names))
    i, lists, slices, own = layout.split(loop_vars)
    got = [fb.arg(f"{p}_got_{k}", t) for k, t in enumerate(out_types)]
    rows = slice_reader(fb, i, fb.const(b, I32, "slice")[0])
    sliced = {names[j]: rows(own[j], types[j]) for j in batch_idx}
    new = [append(fb, lst, i, got[k], t) for k, (lst, t) in enumerate(zip(lists, out_types))]
    nxt = next_index(fb, i)
    added = fb.fdef

    renamed = {n.name: f"{p}/{n.name}" for n in added.node_def}

    def bookkeeping(ref) -> str:  # a bookkeeping node's reference, under its new name
        t, ctl = parse_input(str(ref))
        if t.node not in renamed:
            return str(ref)
        moved = t._replace(node=renamed[t.node])
        return "^" + moved.node if ctl else str(moved)

    def serving(ref: str) -> str:  # a reference inside the serving nodes: batch arguments read sliced
        t, ctl = parse_input(ref)
        return bookkeeping(sliced[t.node]) if not ctl and t.node in sliced else ref

    for node in fdef.node_def:
        if any(tensor_node(s) in sliced for s in node.input):
            inputs = [serving(s) for s in node.input]
            del node.input[:]
            node.input.extend(inputs)
    outputs = {f"{p}_got_{k}": serving(fdef.ret[a.name]) for k, a in enumerate(fdef.signature.output_arg)}
    for node in added.node_def:
        node.name = renamed[node.name]
        inputs = [outputs.get(s, bookkeeping(s)) for s in node.input]
        del node.input[:]
        node.input.extend(inputs)
    fdef.node_def.extend(added.node_def)

    sig = fdef.signature
    sig.name = name
    sig.is_stateful = True
    shift = layout.count_index + 1  # the loop variables before the serving function's own arguments
    own_args = [_copy(a) for a in sig.input_arg]  # copies: what a cleared field held is not kept
    del sig.input_arg[:]
    sig.input_arg.extend(list(added.signature.input_arg)[:shift] + own_args)
    arg_attr = {k: _copy(v) for k, v in fdef.arg_attr.items()}
    unique_ids = dict(fdef.resource_arg_unique_id)
    fdef.ClearField("arg_attr")
    fdef.ClearField("resource_arg_unique_id")
    for k in range(shift):
        fdef.arg_attr[k].CopyFrom(added.arg_attr[k])
    for k, v in arg_attr.items():
        fdef.arg_attr[k + shift].CopyFrom(v)
    for k, v in unique_ids.items():
        fdef.resource_arg_unique_id[k + shift] = v
    if "_input_shapes" in fdef.attr:
        shapes = list(fdef.attr["_input_shapes"].list.shape)
        fdef.attr["_input_shapes"].list.ClearField("shape")
        fdef.attr["_input_shapes"].list.shape.extend([shape_proto([])] * shift + shapes)
    rets = layout.join(bookkeeping(nxt), [bookkeeping(r) for r in new], slices, names)
    del sig.output_arg[:]
    fdef.ClearField("ret")
    for k, (ref, t) in enumerate(zip(rets, layout.types)):
        sig.output_arg.add(name=f"out_{k}", type=t)
        fdef.ret[f"out_{k}"] = str(ref)


def _copy(message):
    out = type(message)()
    out.CopyFrom(message)
    return out
