"""split-vnodes: run a training step as virtual nodes in an in-graph loop.

The training function is cut where per-example work ends (see
:mod:`vfgraph.analysis.train_step`). The part before the cut becomes the *virtual-node
function* (one slice of ``b`` examples in, loss and gradients out); the part after it becomes
the *update function* (averaged gradients in, the original optimizer update, run once).
The original function's name then holds a ``While`` loop over the slices of the fed batch:
the number of virtual nodes a process runs is read from the batch it is fed.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from tensorflow.core.framework import node_def_pb2, types_pb2
from tensorflow.python.framework.tensor_util import make_tensor_proto
from typing import ClassVar, List, Tuple

from vfgraph.analysis.train_step import TrainStep, analyze_train_step, check_batch_inputs, with_dynamic_batch
from vfgraph.builder import extract_function, tf_dtype, trace_replacement
from vfgraph.errors import DetectionError, PipelineError
from vfgraph.ir.graph import FunctionGraph, TensorRef
from vfgraph.ir.names import function_name
from vfgraph.item import GraphItem
from vfgraph.passes.base import Pass, PassResult


@dataclass(frozen=True)
class SplitVnodesPass(Pass):
    """``vnodes``: virtual nodes per step (V); ``vnode_batch``: examples per virtual node (b),
    0 to derive it (static batch / V, or the fed batch / V at run time)."""

    name: ClassVar[str] = "split-vnodes"
    vnodes: int = 1
    vnode_batch: int = 0
    signature: str = ""
    stepwise: bool = True

    def call(self, item: GraphItem) -> PassResult:
        if self.vnodes < 1:
            raise PipelineError(f"vnodes={self.vnodes}: the number of virtual nodes must be at least 1")
        if self.vnode_batch < 0:
            raise PipelineError(f"vnode-batch={self.vnode_batch}: must be positive (or 0 to derive it)")
        sig = item.training_signature(self.signature or None)
        if sig is None:
            known = ", ".join(sorted(item.signatures)) or "none"
            want = repr(self.signature) if self.signature else "'train'"
            raise DetectionError(f"{item.source}: no training signature {want} (signatures: {known}); "
                                 "export one named 'train' or pass --train-signature NAME")
        done = item.metadata.get("rewrites", {}).get(self.name, {})
        if sig.key in done:
            return PassResult(item, False, [f"signature {sig.key!r} already has virtual nodes"])
        item = item.copy()
        original = FunctionGraph(item.function(sig.function), item.library)
        original.verify()
        check_batch_inputs(original, sig)
        b = self._vnode_batch(original, sig)
        static = any(original.arg_shape(a)[0] > 0 for a in sig.batch_args)
        g = with_dynamic_batch(original, sig, b) if static else original
        step = analyze_train_step(g, sig)
        vnode_fn = function_name(sig.function, "vnode")
        update_fn = function_name(sig.function, "update")
        vnode_outputs = [o for o in step.outputs if o.side == "vnode"]
        update_outputs = [o for o in step.outputs if o.side == "update"]
        cut_args = [(f"grad_{k}", c.ref) for k, c in enumerate(step.cut)]
        vdef = extract_function(g, vnode_fn, [(f"out_{o.name}", o.ref) for o in vnode_outputs] + cut_args)
        seeded = _distinct_seeds(vdef, item.library)
        udef = extract_function(g, update_fn, [(f"out_{o.name}", o.ref) for o in update_outputs],
                                new_args=cut_args, keep_args=sig.resource_args,
                                drop=frozenset(step.vnode_nodes), side_effects=True)
        item.set_function(vdef)
        item.set_function(udef)
        reduce_fn = function_name(sig.function, "reduce")
        item.set_function(reduce_function(reduce_fn, _reduce_specs(g, step)))
        body = _loop_body(g, step, vdef, udef, self.vnodes, b, reduce_fn)
        for f in trace_replacement(item.function(sig.function), body, function_name(sig.function, "vnodes")):
            item.set_function(f)
        FunctionGraph(item.function(sig.function), item.library).verify()
        item.preserve.add(sig.function)
        notes = add_stepwise(item, g, step, vdef, udef, self.vnodes, b) if self.stepwise else []
        record = item.metadata.setdefault("rewrites", {}).setdefault(self.name, {})
        record[sig.key] = {
            "function": sig.function,
            "vnodes": self.vnodes,
            "vnode_batch": b,
            "vnode_function": vnode_fn,
            "update_function": update_fn,
            "per_vnode_seeds": seeded,
            "stepwise": not notes and self.stepwise,
            "reduce_functions": [f for f in (reduce_fn, function_name(sig.function, "apply_reduce"))
                                 if f in item.library],
            "gradients": [{"tensor": str(c.ref), "variable": sig.variables[c.variable].name if c.variable else None,
                           "role": c.role, "shape": c.shape} for c in step.cut],
        }
        return PassResult(item, True, notes)

    def _vnode_batch(self, g: FunctionGraph, sig) -> int:
        if self.vnode_batch:
            return self.vnode_batch
        static = g.arg_shape(sig.batch_args[0])[0]
        if static > 0:
            if static % self.vnodes:
                raise DetectionError(
                    f"signature {sig.key!r}: static batch {static} is not divisible by vnodes={self.vnodes}; "
                    "choose vnodes that divide it or give --vnode-batch")
            return static // self.vnodes
        return 0


_STATELESS_RANDOM = ("StatelessRandom", "StatelessTruncatedNormal", "StatelessMultinomial",
                     "StatelessParameterizedTruncatedNormal")
VNODE_INDEX = "vnode_index"


def _distinct_seeds(fdef, library) -> List[str]:
    """Give each virtual node its own random stream.

    Keras draws dropout masks with stateless random ops seeded from a seed-state variable
    that the step advances once. Read once per step, every virtual node would reuse one mask
    pattern; instead the seed each virtual node reads is offset by ``[0, index << 32]``
    (index 0 keeps the original seed, so one virtual node reproduces the original step).
    Returns the seed reads changed; adds the ``vnode_index`` argument when there are any.
    """
    g = FunctionGraph(fdef, library)
    reads = []
    for name in g.topological_order():
        node = g.nodes[name]
        if node.op != "ReadVariableOp" or node.attr["dtype"].type not in (types_pb2.DT_INT64, types_pb2.DT_INT32):
            continue
        seen, stack = set(), [name]
        while stack:
            n = stack.pop()
            if n in seen:
                continue
            seen.add(n)
            if g.nodes[n].op.startswith(_STATELESS_RANDOM):
                reads.append(name)
                break
            stack.extend(c for t in g.outputs(n) for c, _ in g.consumers(t))
    if not reads:
        return []
    arg = fdef.signature.input_arg.add()
    arg.name = VNODE_INDEX
    arg.type = types_pb2.DT_INT64
    g = FunctionGraph(fdef, library)
    for name in reads:
        dtype = g.nodes[name].attr["dtype"].type
        value = g.outputs(name)[0]
        shift = 32 if dtype == types_pb2.DT_INT64 else 16
        base = f"vf/split-vnodes/{name}"
        g.add_node(_node(f"{base}/stride", "Const", [], dtype=dtype,
                         value=make_tensor_proto(np.array([0, 1 << shift], dtype=tf_dtype(dtype).as_numpy_dtype))))
        g.add_node(_node(f"{base}/index", "Cast", [VNODE_INDEX], SrcT=types_pb2.DT_INT64, DstT=dtype, Truncate=False))
        g.add_node(_node(f"{base}/offset", "Mul", [f"{base}/stride:output:0", f"{base}/index:y:0"], T=dtype))
        g.replace_all_uses_with(value, TensorRef(f"{base}/seed", "z", 0))
        g.add_node(_node(f"{base}/seed", "AddV2", [str(value), f"{base}/offset:z:0"], T=dtype))
    g.verify()
    fdef.CopyFrom(g.to_function_def())
    return reads


def _node(name: str, op: str, inputs: List[str], **attrs):
    node = node_def_pb2.NodeDef(name=name, op=op, input=inputs)
    for k, v in attrs.items():
        if isinstance(v, bool):
            node.attr[k].b = v
        elif k in ("dtype", "T", "SrcT", "DstT"):
            node.attr[k].type = v
        else:
            node.attr[k].tensor.CopyFrom(v)
    return node


class _Loop:
    """The virtual-node loop shared by the training step and the step-wise accumulate."""

    def __init__(self, g: FunctionGraph, step: TrainStep, vdef, vnodes: int, b: int):
        self.g, self.step, self.vdef, self.vnodes, self.b = g, step, vdef, vnodes, b
        sig = step.signature
        self.keys = [sig.input_keys.get(a, a) for a in sig.batch_args]
        self.vnode_outs = [o for o in step.outputs if o.side == "vnode"]
        self.v_types = [tf_dtype(a.type) for a in vdef.signature.output_arg]
        self.v_args = [a.name for a in vdef.signature.input_arg]
        self.cut_shapes = [c.shape for c in step.cut]
        self.out_shapes = [g.shape(o.ref) for o in self.vnode_outs]

    def run(self, batch: List, res: List):
        """Run every virtual node of the fed batch; returns (per-output results, gradient
        sums (or concatenations), number of virtual nodes)."""
        import tensorflow as tf

        sig, b, vnodes, keys = self.step.signature, self.b, self.vnodes, self.keys
        n_out = len(self.vnode_outs)
        n = tf.shape(batch[0])[0]
        checks = [tf.debugging.assert_equal(tf.shape(x)[0], n, message=(
            f"vfgraph: training inputs {keys[0]!r} and {k!r} have different leading (batch) dimensions"))
            for k, x in zip(keys[1:], batch[1:])]
        if b:
            per = tf.constant(b, tf.int32)
            nv = n // per
            checks.append(tf.debugging.assert_equal(n % per, 0, message=(
                f"vfgraph: the fed batch is not a multiple of the virtual-node batch b={b}; "
                f"feed a multiple of {b} examples")))
        else:
            nv = tf.constant(vnodes, tf.int32)
            per = n // nv
            checks.append(tf.debugging.assert_equal(n % nv, 0, message=(
                f"vfgraph: the fed batch is not divisible by vnodes={vnodes}; feed a multiple of {vnodes} examples")))
        checks.append(tf.debugging.assert_positive(nv, message="vfgraph: the fed batch holds no virtual node"))
        with tf.control_dependencies(checks):
            nv = tf.identity(nv)
        accs = [tf.zeros(s, t) if c.combine == "mean" else tf.TensorArray(t, size=nv, infer_shape=False)
                for c, s, t in zip(self.step.cut, self.cut_shapes, self.v_types[n_out:])]
        outs = [tf.zeros(s, t) if o.combine == "mean" else tf.TensorArray(t, size=nv, infer_shape=False)
                for o, t, s in zip(self.vnode_outs, self.v_types, self.out_shapes)]

        def cond(i, *_):
            return i < nv

        def loop(i, *carry):
            start = i * per
            by_name = dict(zip(sig.batch_args, [x[start:start + per] for x in batch]))
            by_name.update(zip(sig.resource_args, res))
            if VNODE_INDEX in self.v_args:
                by_name[VNODE_INDEX] = tf.cast(i, tf.int64)
            got = tf.raw_ops.StatefulPartitionedCall(args=[by_name[a] for a in self.v_args], Tout=self.v_types,
                                                     f=self.vdef.signature.name)
            new = []
            for k, (o, acc) in enumerate(zip(self.vnode_outs, carry[:n_out])):
                new.append(acc + tf.ensure_shape(got[k], self.out_shapes[k]) if o.combine == "mean"
                           else acc.write(i, got[k]))
            new += [acc + tf.ensure_shape(v, s) if c.combine == "mean" else acc.write(i, v)
                    for c, acc, v, s in zip(self.step.cut, carry[n_out:], got[n_out:], self.cut_shapes)]
            return [i + 1] + new

        final = tf.while_loop(cond, loop, [tf.constant(0, tf.int32)] + outs + accs,
                              parallel_iterations=1, name="vnodes")
        return list(final[1:1 + n_out]), list(final[1 + n_out:]), nv

    def outputs(self, outs: List, count) -> List:
        """The loop's per-output results: sums divided by ``count``, concatenations, last values."""
        import tensorflow as tf

        results = []
        for o, v in zip(self.vnode_outs, outs):
            if o.combine == "mean":
                v = v / tf.cast(count, v.dtype)
            elif o.combine == "concat":
                v = v.concat()
            else:
                v = v.stack()[-1]
            results.append(v)
        return results

    def reduce(self, outs: List, sums: List, nv, reduce_fn) -> Tuple[List, List, object]:
        """Hand the loop's sums to the step's reduce function (identity on one process; the
        all-reduce over ranks once ``insert-allreduce`` has run). Returns (output sums,
        gradient sums or concatenations, number of virtual nodes as float32)."""
        import tensorflow as tf

        cut = self.step.cut
        mean_outs = [v for o, v in zip(self.vnode_outs, outs) if o.combine == "mean"]
        grads = [a if c.combine == "mean" else a.concat() for c, a in zip(cut, sums)]
        args = mean_outs + grads + [tf.cast(nv, tf.float32)]
        got = list(tf.raw_ops.StatefulPartitionedCall(args=args, Tout=[a.dtype for a in args], f=reduce_fn))
        it = iter(got[:len(mean_outs)])
        outs = [next(it) if o.combine == "mean" else v for o, v in zip(self.vnode_outs, outs)]
        return outs, got[len(mean_outs):-1], got[-1]


def _assemble(step: TrainStep, vnode_results: List, updated) -> List:
    """The function's outputs in the original order."""
    vi = iter(vnode_results)
    ui = iter(updated if isinstance(updated, (list, tuple)) else [])
    return [next(vi) if o.side == "vnode" else next(ui) for o in step.outputs]


def _loop_body(g: FunctionGraph, step: TrainStep, vdef, udef, vnodes: int, b: int, reduce_fn: str):
    """The Python body traced into the replacement training function."""
    import tensorflow as tf

    sig = step.signature
    names = g.arg_names
    batch_idx = [names.index(a) for a in sig.batch_args]
    res_idx = [names.index(a) for a in sig.resource_args]
    u_types = [tf_dtype(a.type) for a in udef.signature.output_arg]
    loop = _Loop(g, step, vdef, vnodes, b)

    def body(*args):
        res = [args[i] for i in res_idx]
        outs, sums, nv = loop.run([args[i] for i in batch_idx], res)
        outs, sums, count = loop.reduce(outs, sums, nv, reduce_fn)
        results = loop.outputs(outs, count)
        means = [a if c.combine == "concat" else a / tf.cast(count, a.dtype)  # sparse rows: scaled too
                 for c, a in zip(step.cut, sums)]
        updated = tf.raw_ops.StatefulPartitionedCall(args=means + res, Tout=u_types, f=udef.signature.name)
        deps = list(updated) if isinstance(updated, (list, tuple)) else [updated]
        with tf.control_dependencies(deps):
            return [tf.identity(r) for r in _assemble(step, results, updated)]

    return body


# --------------------------------------------------------------------------- reduce point
def _reduce_specs(g: FunctionGraph, step: TrainStep, with_outputs: bool = True) -> List[Tuple[str, int, list]]:
    """(argument name, dtype, shape) of what a step reduces over processes: the loop's output
    sums, the gradient sums (``sum_k``) or sparse rows (``gather_k``), and the number of
    virtual nodes (last, float32)."""
    specs = []
    if with_outputs:
        specs += [(g.dtype(o.ref), g.shape(o.ref), "sum") for o in step.outputs
                  if o.side == "vnode" and o.combine == "mean"]
    specs += [(c.dtype, c.shape, "sum" if c.combine == "mean" else "gather") for c in step.cut]
    specs.append((types_pb2.DT_FLOAT, [], "sum"))
    return [(f"{kind}_{k}", dtype, shape) for k, (dtype, shape, kind) in enumerate(specs)]


def reduce_function(name: str, specs: List[Tuple[str, int, list]]):
    """The identity function a step calls at its reduce point: one process reduces nothing.
    ``insert-allreduce`` replaces its body; the arguments name what each one needs
    (``sum_k``: summed over processes, ``gather_k``: rows concatenated)."""
    from tensorflow.core.framework import function_pb2

    fdef = function_pb2.FunctionDef()
    fdef.signature.name = name
    for k, (arg, dtype, shape) in enumerate(specs):
        fdef.signature.input_arg.add(name=arg, type=dtype)
        fdef.signature.output_arg.add(name=f"reduced_{k}", type=dtype)
        fdef.ret[f"reduced_{k}"] = arg
        if shape is not None:
            proto = fdef.arg_attr[k].attr["_output_shapes"].list.shape.add()
            for d in shape:
                proto.dim.add().size = d
    return fdef


# --------------------------------------------------------------------------- step-wise mode
ACCUMULATORS = "vf_accumulators"


def add_stepwise(item: GraphItem, g: FunctionGraph, step: TrainStep, vdef, udef, vnodes: int, b: int) -> List[str]:
    """Add ``<train>_accumulate`` (run the fed batch's virtual nodes, add their gradient sums
    and count into accumulator variables, return their mean loss) and ``<train>_apply``
    (average the accumulators, apply the original update once, reset them): the step-wise
    mode for runtimes that feed virtual nodes one call at a time. Returns notes."""
    sig = step.signature
    og = item.meta_graph.object_graph_def
    if item.kind != "saved_model" or not og.nodes:
        return [f"step-wise signatures: not added to {item.kind} models"]
    if any(c.combine != "mean" for c in step.cut):
        return ["step-wise signatures: not added (sparse gradients have no fixed-size accumulator)"]
    if any(o.side != "vnode" for o in step.outputs):
        return ["step-wise signatures: not added (an output is computed by the update)"]
    found = _signature_wrapper(item, sig.key)
    if found is None:
        return [f"step-wise signatures: signature {sig.key!r} has no wrapper vfgraph can extend"]
    wrapper, forward, bare_id = found
    cf = og.concrete_functions[wrapper.signature.name]
    # Accumulator variables in the object graph, under the root's "vf_accumulators".
    holder_id = len(og.nodes)
    holder = og.nodes.add()
    holder.user_object.identifier = "_generic_user_object"
    holder.user_object.version.producer = 1
    holder.user_object.version.min_consumer = 1
    og.nodes[0].children.add(node_id=holder_id, local_name=ACCUMULATORS)
    acc_ids = []
    specs = [(f"grad_{k}", c.dtype, c.shape) for k, c in enumerate(step.cut)] + [("count", types_pb2.DT_FLOAT, [])]
    for local, dtype, shape in specs:
        node = og.nodes.add()
        node.variable.dtype = dtype
        for d in shape:
            node.variable.shape.dim.add().size = d
        node.variable.name = f"{ACCUMULATORS}/{local}"
        node.variable.trainable = False
        holder.children.add(node_id=len(og.nodes) - 1, local_name=local)
        acc_ids.append(len(og.nodes) - 1)
    acc_args = [f"vf_accumulator_{k}" for k in range(len(step.cut))] + ["vf_count"]
    # Library functions, with the wrapper's argument order (inputs, then bound variables).
    inner = [forward[a.name] for a in wrapper.signature.input_arg]
    n_inputs = len(inner) - len(cf.bound_inputs)
    # Names of object-graph functions end in an integer (TensorFlow's fingerprinting needs it).
    acc_fn = function_name(sig.function, "accumulate", "0")
    apply_fn = function_name(sig.function, "apply", "0")
    acc_header = _header(g, acc_fn, inner, acc_args, [a.name for a in wrapper.signature.output_arg],
                         [g.dtype(o.ref) for o in step.outputs])
    apply_header = _header(g, apply_fn, inner[n_inputs:], acc_args, [], [])
    loop = _Loop(g, step, vdef, vnodes, b)
    u_types = [tf_dtype(a.type) for a in udef.signature.output_arg]
    reduce_fn = function_name(sig.function, "apply_reduce")
    item.set_function(reduce_function(reduce_fn, _reduce_specs(g, step, with_outputs=False)))
    cut_types = [tf_dtype(c.dtype) for c in step.cut]

    def accumulate(*args):
        import tensorflow as tf

        by = dict(zip(inner + acc_args, args))
        outs, sums, nv = loop.run([by[a] for a in sig.batch_args], [by[a] for a in sig.resource_args])
        ops = [tf.raw_ops.AssignAddVariableOp(resource=by[a], value=s) for a, s in zip(acc_args, sums)]
        ops.append(tf.raw_ops.AssignAddVariableOp(resource=by["vf_count"], value=tf.cast(nv, tf.float32)))
        with tf.control_dependencies(ops):
            return [tf.identity(r) for r in _assemble(step, loop.outputs(outs, nv), [])]

    def apply(*args):
        import tensorflow as tf

        by = dict(zip(inner[n_inputs:] + acc_args, args))
        sums = [tf.raw_ops.ReadVariableOp(resource=by[a], dtype=t) for a, t in zip(acc_args, cut_types + [tf.float32])]
        got = tf.raw_ops.StatefulPartitionedCall(args=sums, Tout=[s.dtype for s in sums], f=reduce_fn)
        count = got[-1]
        means = [s / tf.cast(count, t) for s, t in zip(got[:-1], cut_types)]
        updated = tf.raw_ops.StatefulPartitionedCall(args=means + [by[a] for a in sig.resource_args], Tout=u_types,
                                                     f=udef.signature.name)
        deps = list(updated) if isinstance(updated, (list, tuple)) else [updated]
        with tf.control_dependencies(deps):
            resets = [tf.raw_ops.AssignVariableOp(resource=by[a], value=tf.zeros(c.shape, t))
                      for a, c, t in zip(acc_args, step.cut, cut_types)]
            resets.append(tf.raw_ops.AssignVariableOp(resource=by["vf_count"], value=tf.constant(0.0)))
        with tf.control_dependencies(resets):
            return []

    for header, body in ((acc_header, accumulate), (apply_header, apply)):
        for f in trace_replacement(header, body, header.signature.name):
            item.set_function(f)
    add_signature(item, f"{sig.key}_accumulate", acc_fn, cf, bare_id, acc_ids, takes_inputs=True)
    add_signature(item, f"{sig.key}_apply", apply_fn, cf, bare_id, acc_ids, takes_inputs=False)
    return []


def add_signature(item: GraphItem, key: str, fn: str, cf, bare_id: int, extra_bound: List[int],
                  takes_inputs: bool) -> None:
    """Register library function ``fn`` as signature ``key``: a bare concrete function like
    the training signature's (object-graph entry ``cf``, node ``bare_id``), bound to the same
    variables plus ``extra_bound``; without ``takes_inputs`` it takes no inputs and returns {}."""
    from tensorflow.python.saved_model import nested_structure_coder

    og = item.meta_graph.object_graph_def
    sigs = next(og.nodes[c.node_id] for c in og.nodes[0].children if c.local_name == "signatures")
    node = og.nodes.add()
    node.CopyFrom(og.nodes[bare_id])
    node.bare_concrete_function.concrete_function_name = fn
    entry = og.concrete_functions[fn]
    entry.CopyFrom(cf)
    entry.bound_inputs.extend(extra_bound)
    if not takes_inputs:
        del node.bare_concrete_function.argument_keywords[:]
        _clear_kwonly(node.bare_concrete_function.function_spec)
        entry.canonicalized_input_signature.CopyFrom(nested_structure_coder.encode_structure(((), {})))
        entry.output_signature.CopyFrom(nested_structure_coder.encode_structure({}))
    sigs.children.add(node_id=len(og.nodes) - 1, local_name=key)
    item.preserve.add(fn)


def _signature_wrapper(item: GraphItem, key: str):
    """(wrapper FunctionDef, wrapper arg -> inner arg, object-graph node id) for signature ``key``."""
    mg = item.meta_graph
    out = next(iter(mg.signature_def[key].outputs.values())).name.split(":")[0]
    call = next((n for n in mg.graph_def.node if n.name == out), None)
    if call is None or "f" not in call.attr:
        return None
    wrapper = item.function(call.attr["f"].func.name)
    calls = [n for n in wrapper.node_def if n.op in ("StatefulPartitionedCall", "PartitionedCall")]
    if len(calls) != 1:
        return None
    inner = item.function(calls[0].attr["f"].func.name)
    forwarded = [s.split(":")[0] for s in calls[0].input if not s.startswith("^")]
    forward = {w: i.name for w, i in zip(forwarded, inner.signature.input_arg)}
    if len(forward) != len(wrapper.signature.input_arg) or any(a.name not in forward for a in wrapper.signature.input_arg):
        return None
    og = mg.object_graph_def
    for i, node in enumerate(og.nodes):
        if node.WhichOneof("kind") == "bare_concrete_function" and \
                node.bare_concrete_function.concrete_function_name == wrapper.signature.name:
            return wrapper, forward, i
    return None


def _header(g: FunctionGraph, name: str, args: List[str], resources: List[str], outputs: List[str], out_types):
    """A FunctionDef signature to trace into: ``args`` taken from ``g``, then resources."""
    from tensorflow.core.framework import function_pb2

    fdef = function_pb2.FunctionDef()
    fdef.signature.name = name
    fdef.signature.is_stateful = True
    src = g.to_function_def()
    index = {a.name: i for i, a in enumerate(src.signature.input_arg)}
    for a in args:
        fdef.signature.input_arg.add().CopyFrom(src.signature.input_arg[index[a]])
        if index[a] in src.arg_attr:
            fdef.arg_attr[len(fdef.signature.input_arg) - 1].CopyFrom(src.arg_attr[index[a]])
    for a in resources:
        fdef.signature.input_arg.add(name=a, type=types_pb2.DT_RESOURCE)
    for o, t in zip(outputs, out_types):
        fdef.signature.output_arg.add(name=o, type=t)
    return fdef


def _clear_kwonly(spec) -> None:
    for v in spec.fullargspec.named_tuple_value.values:
        if v.key == "kwonlyargs":
            del v.value.list_value.values[:]
