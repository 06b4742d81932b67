"""Builds new library functions: extracted pieces of a function, and bodies written node by
node (:class:`FunctionBuilder`: the virtual-node loop, the serving loop, reductions, broadcasts).

Writing NodeDefs directly costs microseconds per node; tracing costs about a millisecond per
op (TensorFlow builds, shape-infers and auto-orders every op in a FuncGraph), which made
tracing most of a rewrite's time. Direct construction also states every ordering the graph
needs as an explicit control dependency instead of relying on a tracer to infer it.
"""
from __future__ import annotations

from functools import lru_cache
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from tensorflow.core.framework import attr_value_pb2, function_pb2, node_def_pb2, types_pb2
from tensorflow.python.framework import op_def_registry

from vfgraph.errors import VerifyError
from vfgraph.ir.graph import FunctionGraph, TensorRef, arg_shape, copy_header, parse_input, remember_valid


def _stateful(g: FunctionGraph, name: str) -> bool:
    op = g.op_types()[name]
    if op in g.library:
        return g.library[op].signature.is_stateful
    return _registered_stateful(op)


@lru_cache(maxsize=None)
def _registered_stateful(op: str) -> bool:
    od = op_def_registry.get(op)
    return bool(od and od.is_stateful)


def extract_function(
    g: FunctionGraph,
    name: str,
    outputs: Sequence[Tuple[str, TensorRef]],
    new_args: Sequence[Tuple[str, TensorRef]] = (),
    keep_args: Optional[Sequence[str]] = None,
    drop: frozenset = frozenset(),
    side_effects: bool = False,
    into: Optional[function_pb2.FunctionDef] = None,
) -> function_pb2.FunctionDef:
    """A new function computing ``outputs`` from a copy of ``g`` (a verified graph), written
    into the empty FunctionDef ``into`` when given (see ``GraphItem.new_function``).

    ``new_args`` turns internal tensors into arguments (everything upstream of them that is
    no longer needed disappears); ``keep_args`` are the original arguments kept, in order;
    nodes in ``drop`` are never kept. With ``side_effects``, stateful nodes (variable
    writes) are kept as control outputs; otherwise only data ancestors of the outputs stay.
    """
    cut = {ref: arg_name for arg_name, ref in new_args}  # these tensors become arguments
    nodes = g.nodes
    roots = [r.node for _, r in outputs if not r.is_function_arg]
    effects: List[str] = []
    if side_effects:
        effects = [n for n in nodes if n not in drop and _stateful(g, n)]
        roots += effects
    kept = list(keep_args) if keep_args is not None else [a.name for a in g.header.signature.input_arg]
    # Every kept node and output must still find what it reads (``drop`` and ``keep_args`` can
    # take it away); output names and acyclicity carry over from ``g``, which was verified.
    # One walk up from the roots: data inputs (except the new arguments), and control inputs
    # with ``side_effects``; a node with an input that may need rewriting (it becomes an
    # argument, or waits for a node perhaps left out) or is wrong is looked at again after.
    args = set(kept).union(cut.values())
    keep: set = set()
    again: set = set()
    stack = [r for r in roots if r in nodes and r not in drop]
    while stack:
        n = stack.pop()
        if n in keep:
            continue
        keep.add(n)
        for t, ctl in g.inputs(n):
            p = t.node
            if ctl:
                if not side_effects or p not in nodes or p in drop:
                    again.add(n)
                    continue
            elif t in cut:
                again.add(n)
                continue
            elif p not in nodes or p in drop:
                if p not in args:
                    again.add(n)
                continue
            if p not in keep:
                stack.append(p)
    if side_effects:
        effects = [n for n in effects if n in keep]
    defined = keep.union(args)
    # Only the kept nodes are copied (in one call); the inputs of those that read a new
    # argument, or wait for a node left out, are rewritten after.
    header = g.header  # its arguments, outputs and control outputs are replaced below
    fdef = copy_header(header, into, skip=("arg_attr", "ret", "control_ret"))
    order = [n for n in nodes if n in keep]
    fdef.node_def.extend(nodes[n] for n in order)
    for k, n in enumerate(order):
        if n not in again:
            continue
        rewrite = False
        for t, ctl in g.inputs(n):
            if ctl:
                rewrite = rewrite or t.node not in keep
            elif t in cut:
                rewrite = True
            elif t.node not in defined:
                raise VerifyError(f"{name}: node {n!r} input {str(t)!r} refers to a node or argument left out")
        if rewrite:
            inputs = fdef.node_def[k].input
            renamed = [s if ctl else cut.get(t, s) for s, (t, ctl) in zip(inputs, g.inputs(n))
                       if not (ctl and t.node not in keep)]
            del inputs[:]
            inputs.extend(renamed)
    sig = fdef.signature
    sig.name = name
    old_args = {a.name: (i, a) for i, a in enumerate(header.signature.input_arg)}
    arg_attr = header.arg_attr
    del sig.input_arg[:]
    for arg_name, ref in new_args:
        a = sig.input_arg.add()
        a.name = arg_name
        a.type = g.dtype(ref)
        shape = g.shape(ref)
        if shape is not None:
            attr = fdef.arg_attr[len(sig.input_arg) - 1].attr["_output_shapes"].list.shape.add()
            for d in shape:
                attr.dim.add().size = d
    for arg_name in kept:
        i, a = old_args[arg_name]
        sig.input_arg.add().CopyFrom(a)
        if i in arg_attr:
            fdef.arg_attr[len(sig.input_arg) - 1].CopyFrom(arg_attr[i])
    del sig.output_arg[:]
    for out_name, ref in outputs:
        a = sig.output_arg.add()
        a.name = out_name
        a.type = g.dtype(ref)
        fdef.ret[out_name] = str(ref)
    del sig.control_output[:]
    for n in sorted(effects):
        sig.control_output.append(n)
        fdef.control_ret[n] = n
    sig.is_stateful = True
    if "_input_shapes" in fdef.attr:
        del fdef.attr["_input_shapes"]
    for k, v in fdef.ret.items():
        if parse_input(v)[0].node not in defined:
            raise VerifyError(f"{name}: output {k!r} refers to {v!r}, which was left out")
    return fdef


# --------------------------------------------------------------------------- tracing
def tf_dtype(enum: int):
    import tensorflow as tf

    return tf.dtypes.as_dtype(enum)


def arg_specs(fdef: function_pb2.FunctionDef) -> list:
    """TensorSpecs for ``fdef``'s arguments (resource args as scalar resource specs)."""
    import tensorflow as tf

    specs = []
    for a in fdef.signature.input_arg:
        if a.type == types_pb2.DT_RESOURCE:
            specs.append(tf.TensorSpec([], tf.resource))
            continue
        shape = arg_shape(fdef, a.name)
        dims = None if shape is None else [None if d < 0 else d for d in shape]
        specs.append(tf.TensorSpec(dims, tf_dtype(a.type)))
    return specs


def annotate_shapes(fdef: function_pb2.FunctionDef, graph) -> None:
    """Record each node's static output shapes (``_output_shapes``), as TensorFlow's own
    SavedModel export does, so later passes and ``inspect`` can read them."""
    ops = {op.name: op for op in graph.get_operations()}
    for node in fdef.node_def:
        op = ops.get(node.name)
        if op is None or not op.outputs or "_output_shapes" in node.attr:
            continue
        shapes = node.attr["_output_shapes"].list.shape
        for t in op.outputs:
            shapes.add().CopyFrom(t.shape.as_proto())


# --------------------------------------------------------------------------- direct construction
def shape_proto(dims: Optional[Sequence[int]]):
    """A TensorShapeProto: ``None`` is unknown rank, -1 an unknown dimension."""
    from tensorflow.core.framework import tensor_shape_pb2

    proto = tensor_shape_pb2.TensorShapeProto()
    if dims is None:
        proto.unknown_rank = True
    else:
        for d in dims:
            proto.dim.add().size = d
    return proto


@lru_cache(maxsize=None)
def type_attr(dtype: int):
    """A type AttrValue (shared between calls: copy it, do not change it)."""
    return attr_value_pb2.AttrValue(type=dtype)


def types_attr(dtypes: Sequence[int]):
    v = attr_value_pb2.AttrValue()
    v.list.SetInParent()
    v.list.type.extend(dtypes)
    return v


def shapes_attr(shapes: Sequence[Optional[Sequence[int]]]):
    """A list-of-shapes AttrValue (shared between calls: copy it, do not change it)."""
    return _shapes_attr(tuple(None if s is None else tuple(s) for s in shapes))


@lru_cache(maxsize=4096)
def _shapes_attr(shapes: Tuple[Optional[Tuple[int, ...]], ...]):
    v = attr_value_pb2.AttrValue()
    v.list.SetInParent()
    for s in shapes:
        v.list.shape.add().CopyFrom(shape_proto(s))
    return v


@lru_cache(maxsize=4096)
def _shape_arg_attrs(shape: Tuple[int, ...]) -> function_pb2.FunctionDef.ArgAttrs:
    """An argument's attributes recording its static ``shape`` (shared: copy, do not change)."""
    out = function_pb2.FunctionDef.ArgAttrs()
    out.attr["_output_shapes"].CopyFrom(_shapes_attr((shape,)))
    return out


@lru_cache(maxsize=None)
def _op_defaults(op: str) -> Optional[Tuple[Tuple[str, attr_value_pb2.AttrValue], ...]]:
    """The attributes registered op ``op`` has defaults for (None: not registered)."""
    op_def = op_def_registry.get(op)
    if op_def is None:
        return None
    return tuple((a.name, a.default_value) for a in op_def.attr if a.HasField("default_value"))


def func_attr(name: str):
    v = attr_value_pb2.AttrValue()
    v.func.name = name
    return v


_ATTR = attr_value_pb2.AttrValue


def _attr_value(value):
    if isinstance(value, attr_value_pb2.AttrValue):
        return value
    if isinstance(value, bool):
        return attr_value_pb2.AttrValue(b=value)
    if isinstance(value, int):
        return attr_value_pb2.AttrValue(i=value)
    if isinstance(value, float):
        return attr_value_pb2.AttrValue(f=value)
    if isinstance(value, (str, bytes)):
        return attr_value_pb2.AttrValue(s=value.encode() if isinstance(value, str) else value)
    raise TypeError(f"attribute value {value!r}: wrap it (type_attr, types_attr, shapes_attr, func_attr)")


class Node:
    """A node added by :class:`FunctionBuilder`; ``node[k]`` is its k-th flat output."""

    def __init__(self, proto: node_def_pb2.NodeDef, library, name: str, op: str, valid: Optional[set] = None):
        self.proto, self._library = proto, library
        self._valid = valid  # the builder's set of readable references, which learns the outputs
        self.name, self.op = name, op  # (what the proto holds, without reading it back)
        self._refs: Optional[List[str]] = None

    @property
    def ctl(self) -> str:
        return "^" + self.name

    def __getitem__(self, k: int) -> str:
        return self.outputs()[k]

    def outputs(self) -> List[str]:
        """Every flat output as an input reference (computed once: nodes can have thousands)."""
        from vfgraph.ir.graph import output_layout, output_names

        if self._refs is None:
            name = self.name
            simple = output_names(self.op, self._library)
            if simple is not None:
                self._refs = [f"{name}:{arg}:0" for arg in simple]
            else:
                self._refs = [f"{name}:{arg}:{idx}" for arg, idx, _ in output_layout(self.proto, self._library)]
            if self._valid is not None:
                self._valid.update(self._refs)
        return self._refs


class FunctionBuilder:
    """Writes a FunctionDef node by node: the fast path for the bodies passes generate (loops,
    reductions, broadcasts), where tracing Python with TensorFlow would create every op twice
    over. Registered ops get their default attributes, so the result is what TensorFlow
    would store."""

    def __init__(self, name: str, library: Optional[Dict[str, function_pb2.FunctionDef]] = None,
                 into: Optional[function_pb2.FunctionDef] = None):
        self.fdef = function_pb2.FunctionDef() if into is None else into  # into: an empty FunctionDef to fill
        self.fdef.signature.name = name
        self.fdef.signature.is_stateful = True
        self.library = library if library is not None else {}
        self._used: Dict[str, int] = {}
        self._consts: Dict[tuple, Node] = {}
        self.zeros: Dict[tuple, str] = {}  # see zeros()
        # What an input may name: arguments, "^node" and the outputs of nodes so far (added
        # with each node's outputs the first time one is read): a built function is valid and
        # acyclic by construction.
        self._valid: set = set()
        self._nodes: Dict[str, Node] = {}

    @classmethod
    def like(cls, header: function_pb2.FunctionDef, library,
             into: Optional[function_pb2.FunctionDef] = None) -> Tuple["FunctionBuilder", List[str]]:
        """A builder for a function with ``header``'s name, arguments and attributes (outputs
        are added with :meth:`ret`); returns it and the argument references."""
        fb = cls(header.signature.name, library, into)
        args = [fb.arg(a.name, a.type, attr=header.arg_attr[i] if i in header.arg_attr else None)
                for i, a in enumerate(header.signature.input_arg)]
        for k, v in header.attr.items():
            fb.fdef.attr[k].CopyFrom(v)
        return fb, args

    def arg(self, name: str, dtype: int, shape: Optional[Sequence[int]] = None, attr=None) -> str:
        sig = self.fdef.signature
        sig.input_arg.add(name=name, type=dtype)
        self._valid.add(name)
        if attr is None and shape is not None:
            attr = _shape_arg_attrs(tuple(shape))
        if attr is not None:
            self.fdef.arg_attr[len(sig.input_arg) - 1].CopyFrom(attr)
        return name

    def args_of(self, fdef: function_pb2.FunctionDef) -> List[str]:
        """Every argument of ``fdef``, another builder's function (names, types and attributes,
        copied in one call each), as this function's first arguments; returns their names."""
        sig = self.fdef.signature
        if sig.input_arg:
            raise ValueError(f"{sig.name}: args_of adds the first arguments; this function has some")
        sig.input_arg.extend(fdef.signature.input_arg)
        self.fdef.arg_attr.MergeFrom(fdef.arg_attr)
        names = [a.name for a in sig.input_arg]
        self._valid.update(names)
        return names

    def _unique(self, base: str) -> str:
        k = self._used.get(base, 0)
        self._used[base] = k + 1
        return base if k == 0 else f"{base}_{k}"

    def op(self, op: str, inputs: Sequence[str] = (), name: str = "", deps: Sequence = (),
           shapes: Optional[Sequence[Optional[Sequence[int]]]] = None, **attrs) -> Node:
        name = self._unique(name or op)
        inputs = list(inputs)
        for d in deps:
            inputs.append(d.ctl if isinstance(d, Node) else d if d.startswith("^") else "^" + d)
        valid = self._valid
        for s in inputs:
            if s not in valid:
                self._check(s, f"node {name!r} reads {s!r}")
        values = {k: v if type(v) is _ATTR else _attr_value(v) for k, v in attrs.items()}
        if op not in self.library:
            defaults = _op_defaults(op)
            if defaults is None:
                raise KeyError(f"op {op!r} is not registered")
            for a, value in defaults:
                if a not in values:
                    values[a] = value
        if shapes is not None:
            values["_output_shapes"] = shapes_attr(shapes)
        node = Node(self.fdef.node_def.add(name=name, op=op, input=inputs, attr=values), self.library, name, op, valid)
        self._nodes[name] = node
        valid.add("^" + name)
        return node

    def _check(self, ref: str, what: str) -> None:
        """Raise unless ``ref`` names an output of a node written so far (learning that
        node's outputs), or an argument."""
        node = self._nodes.get(ref.partition(":")[0])
        if node is None or ref not in node.outputs():
            raise KeyError(f"{self.fdef.signature.name}: {what}, which is not an argument or an output of a node "
                           "written before")

    def const(self, value, dtype: int, name: str = "Const") -> Node:
        import numpy as np
        from tensorflow.python.framework import dtypes

        array = np.asarray(value, dtype=dtypes.as_dtype(dtype).as_numpy_dtype)
        key = _const_key(array, dtype)
        if key not in self._consts:  # one node per distinct constant
            self._consts[key] = self.op("Const", [], name=name, dtype=type_attr(dtype), value=_tensor_attr(array, key),
                                        shapes=[list(array.shape)])
        return self._consts[key]

    def ret(self, name: str, ref: str, dtype: int) -> None:
        if ref not in self._valid:
            self._check(ref, f"output {name!r} is {ref!r}")
        self.fdef.signature.output_arg.add(name=name, type=dtype)
        self.fdef.ret[name] = ref

    def control_ret(self, node: Node) -> None:
        self.fdef.signature.control_output.append(node.name)
        self.fdef.control_ret[node.name] = node.name

    def finish(self) -> function_pb2.FunctionDef:
        """The function, recorded as valid (see ``remember_valid``): every input and output
        was checked as it was written, against the op definitions and ``library``."""
        remember_valid(self.fdef, self.library, {n.op for n in self._nodes.values()})
        return self.fdef


# Small constants' tensor attributes by (dtype, shape, bytes), shared by every builder.
_TENSORS: Dict[tuple, attr_value_pb2.AttrValue] = {}


def _tensor_attr(array, key: tuple) -> attr_value_pb2.AttrValue:
    tensor = _TENSORS.get(key)
    if tensor is None:  # make_tensor_proto is slow; the same small constants recur
        from tensorflow.python.framework.tensor_util import make_tensor_proto

        tensor = attr_value_pb2.AttrValue(tensor=make_tensor_proto(array))
        if array.size <= 64:
            _TENSORS[key] = tensor
    return tensor


def tensor_attr(value, dtype: int) -> attr_value_pb2.AttrValue:
    """A constant's ``value`` attribute (shared between calls: copy it, do not change it)."""
    import numpy as np
    from tensorflow.python.framework import dtypes

    array = np.asarray(value, dtype=dtypes.as_dtype(dtype).as_numpy_dtype)
    return _tensor_attr(array, _const_key(array, dtype))


def _const_key(array, dtype: int) -> tuple:
    return dtype, array.shape, array.tobytes() if array.dtype != object else repr(array.tolist())


# The pieces every generated loop uses.
I32 = types_pb2.DT_INT32


def zeros(fb: FunctionBuilder, shape: Sequence[int], dtype: int, name: str = "zeros", shapes=None) -> str:
    """A ``dtype`` tensor of zeros of the static ``shape`` (one node per function, shape and dtype:
    a model's many variables of the same shape share it)."""
    key = (tuple(shape), dtype, repr(shapes))
    if key not in fb.zeros:
        fb.zeros[key] = fb.op("Fill", [fb.const(shape, I32, "shape")[0], fb.const(0, dtype, "zero")[0]], name=name,
                              T=type_attr(dtype), index_type=type_attr(I32), shapes=shapes)[0]
    return fb.zeros[key]


def batch_size(fb: FunctionBuilder, x: str, dtype: int) -> str:
    """The leading dimension of ``x`` as an int32 scalar."""
    shape = fb.op("Shape", [x], name="shape", T=type_attr(dtype), out_type=type_attr(I32))[0]
    return fb.op("StridedSlice", [shape, fb.const([0], I32, "zero")[0], fb.const([1], I32, "one")[0],
                                  fb.const([1], I32, "one")[0]],
                 name="batch_size", T=type_attr(I32), Index=type_attr(I32), shrink_axis_mask=1)[0]


def check(fb: FunctionBuilder, ok: str, message: str) -> Node:
    """An ``Assert`` that fails with ``message`` unless the boolean ``ok`` holds."""
    import numpy as np

    text = fb.const(np.array(message.encode(), dtype=object), types_pb2.DT_STRING, "message")[0]
    return fb.op("Assert", [ok, text], name="check", T=types_attr([types_pb2.DT_STRING]), summarize=3)


def slice_rows(fb: FunctionBuilder, start: str, count: str) -> Callable[[str, int], str]:
    """A function taking (tensor, dtype) to its rows ``[start, start + count)`` (clamped)."""
    pack = dict(N=1, T=type_attr(I32), axis=0)
    end = fb.op("AddV2", [start, count], name="end", T=type_attr(I32))[0]
    begin_v = fb.op("Pack", [start], name="begin", **pack)[0]
    end_v = fb.op("Pack", [end], name="stop", **pack)[0]
    strides = fb.const([1], I32, "strides")[0]

    def rows(x: str, dtype: int) -> str:
        return fb.op("StridedSlice", [x, begin_v, end_v, strides], name="slice", T=type_attr(dtype),
                     Index=type_attr(I32))[0]

    return rows


def list_concat(fb: FunctionBuilder, ref: str, dtype: int, element_shape=-1, shape=None) -> str:
    """The elements of tensor list ``ref`` concatenated along their first dimension."""
    import numpy as np

    return fb.op("TensorListConcatV2", [ref, fb.const(element_shape, I32, "element_shape")[0],
                                        fb.const(np.zeros([0], np.int64), types_pb2.DT_INT64, "leading_dims")[0]],
                 name="concat", element_dtype=type_attr(dtype), shape_type=type_attr(I32),
                 shapes=None if shape is None else [shape, [-1]])[0]
