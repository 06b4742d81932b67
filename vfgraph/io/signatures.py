"""Entry points added to a SavedModel: new signatures and the variables they use.

A loader finds a model's entry points in two places. ``tf.saved_model.load`` reads the
object graph: a bare concrete function under the root's ``signatures`` object, bound to
variable objects. TF1 sessions, ``saved_model_cli`` and TF Serving read the MetaGraph's
``signature_def`` map: tensors of graph nodes, here one call of the library function.
Passes write the library functions; the functions here register them in both places, so
that passes never edit the object graph, the signature map or the graph's nodes.

TF2 signatures are added *like* an existing one (:func:`signature_wrapper`): the same
function spec and bound variables, and the same graph tensors fed to its call.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Mapping, Optional, Sequence, Tuple

from tensorflow.core.framework import attr_value_pb2, function_pb2, types_pb2
from tensorflow.core.protobuf import meta_graph_pb2

from vfgraph.ir.attrs import shape_proto, tensor_attr, type_attr, types_attr
from vfgraph.ir.blocks import I32
from vfgraph.ir.functions import CALL_OPS
from vfgraph.ir.graph import FunctionGraph
from vfgraph.ir.names import data_inputs, tensor_index, tensor_node
from vfgraph.item import GraphItem

INIT_OP_KEY = "__saved_model_init_op"  # the signature whose output the loader runs first
PREDICT_METHOD = "tensorflow/serving/predict"
INIT_OP_NODE = "vf/init_op"  # the graph's init op once graph variables are added

# (name, dtype, shape) of a variable to add: its name under a holder, a types_pb2 enum,
# a static shape (-1 for a dimension that starts empty: sparse rows)
VariableSpec = Tuple[str, int, Sequence[int]]


@dataclass(frozen=True)
class SignatureWrapper:
    """A TF2 signature's entry in the object graph: the bare concrete function ``function``
    (object ``node_id``) that forwards each of its arguments to one call of the signature's
    library function."""

    key: str                # the signature
    function: str           # the wrapper function, named by the object graph
    args: Tuple[str, ...]   # the argument of the called function each wrapper argument feeds, in order
    n_bound: int            # how many of them, last, are bound to objects (variables, captured values)
    outputs: Tuple[str, ...]  # the wrapper's outputs
    node_id: int

    @property
    def input_args(self) -> Tuple[str, ...]:
        """The fed arguments (the signature's inputs)."""
        return self.args[:len(self.args) - self.n_bound]

    @property
    def bound_args(self) -> Tuple[str, ...]:
        """The arguments bound to objects."""
        return self.args[len(self.args) - self.n_bound:]


def has_object_graph(item: GraphItem) -> bool:
    """Whether ``item`` is a TF2 SavedModel with an object graph (what TF2 signatures need)."""
    return item.kind == "saved_model" and bool(item.meta_graph.object_graph_def.nodes)


def signature_wrapper(item: GraphItem, key: str) -> Optional[SignatureWrapper]:
    """Signature ``key``'s wrapper; None when the model has no object graph or the signature
    is not a wrapper forwarding every argument to one call (nothing can be added like it)."""
    if not has_object_graph(item):
        return None
    mg = item.meta_graph
    call = _signature_call(mg, key)
    if call is None or "f" not in call.attr:
        return None
    wrapper = item.function(call.attr["f"].func.name)
    calls = [n for n in wrapper.node_def if n.op in CALL_OPS]
    if len(calls) != 1:
        return None
    inner = item.function(calls[0].attr["f"].func.name)
    forwarded = [tensor_node(s) for s in data_inputs(calls[0])]
    forward = {w: i.name for w, i in zip(forwarded, inner.signature.input_arg)}
    args = wrapper.signature.input_arg
    if len(forward) != len(args) or any(a.name not in forward for a in args):
        return None
    og = mg.object_graph_def
    name = wrapper.signature.name
    if name not in og.concrete_functions:
        return None
    for i, node in enumerate(og.nodes):
        if node.WhichOneof("kind") == "bare_concrete_function" and \
                node.bare_concrete_function.concrete_function_name == name:
            return SignatureWrapper(key, name, tuple(forward[a.name] for a in args),
                                    len(og.concrete_functions[name].bound_inputs),
                                    tuple(a.name for a in wrapper.signature.output_arg), i)
    return None


def entry_header(g: FunctionGraph, name: str, args: Sequence[str], resources: Sequence[str] = (),
                 outputs: Sequence[str] = (), out_types: Sequence[int] = ()) -> function_pb2.FunctionDef:
    """The header (no nodes) of a new signature's function ``name``: arguments ``args`` of
    ``g``, with their attributes (the names and shapes a loader checks), then resource
    arguments ``resources``, and outputs ``outputs`` of types ``out_types``."""
    fdef = function_pb2.FunctionDef()
    sig = fdef.signature
    sig.name = name
    sig.is_stateful = True
    src = g.header
    src_args = list(src.signature.input_arg)
    index = {a.name: i for i, a in enumerate(src_args)}
    picked = [index[a] for a in args]
    sig.input_arg.extend([src_args[i] for i in picked])  # one call
    attrs = dict(src.arg_attr)
    for k, i in enumerate(picked):
        if i in attrs:
            fdef.arg_attr[k].CopyFrom(attrs[i])
    for a in resources:
        sig.input_arg.add(name=a, type=types_pb2.DT_RESOURCE)
    for o, t in zip(outputs, out_types):
        sig.output_arg.add(name=o, type=t)
    return fdef


def add_signature(item: GraphItem, key: str, fn: str, like: SignatureWrapper, takes_inputs: bool,
                  bound: Sequence[int] = (), graph_handles: Sequence[str] = ()) -> None:
    """Register library function ``fn`` as TF2 signature ``key``, made like signature
    ``like``: a bare concrete function with its function spec, bound to its objects and then
    the objects ``bound`` (``fn`` takes ``like``'s arguments, then one per bound object).
    ``takes_inputs``: ``fn`` takes ``like``'s inputs and returns its outputs; otherwise it
    takes no input and returns ``{}``. The signature map gets it too: a graph call fed what
    ``like``'s call is fed, then the graph tensors ``graph_handles`` (one per object in
    ``bound``, see :func:`add_graph_variables`)."""
    from tensorflow.python.saved_model import nested_structure_coder

    mg = item.meta_graph
    og = mg.object_graph_def
    cf = og.concrete_functions[like.function]
    sigs = next(og.nodes[c.node_id] for c in og.nodes[0].children if c.local_name == "signatures")
    node = og.nodes.add()
    node.CopyFrom(og.nodes[like.node_id])
    node.bare_concrete_function.concrete_function_name = fn
    entry = og.concrete_functions[fn]
    entry.CopyFrom(cf)
    entry.bound_inputs.extend(bound)
    if not takes_inputs:
        del node.bare_concrete_function.argument_keywords[:]
        _clear_kwonly(node.bare_concrete_function.function_spec)
        entry.canonicalized_input_signature.CopyFrom(nested_structure_coder.encode_structure(((), {})))
        entry.output_signature.CopyFrom(nested_structure_coder.encode_structure({}))
    sigs.children.add(node_id=len(og.nodes) - 1, local_name=key)
    item.preserve.add(fn)
    fed = data_inputs(_signature_call(mg, like.key))
    if takes_inputs:
        outputs = sorted(mg.signature_def[like.key].outputs.items(), key=lambda kv: tensor_index(kv[1].name))
        add_graph_signature(item, key, fn, fed + list(graph_handles), like.key, [k for k, _ in outputs])
    else:
        add_graph_signature(item, key, fn, fed[len(fed) - len(cf.bound_inputs):] + list(graph_handles))


def add_graph_signature(item: GraphItem, key: str, fn: str, inputs: Sequence[str], like: Optional[str] = None,
                        outputs: Sequence[str] = (), new_outputs: Sequence[Tuple[str, int, Sequence[int]]] = ()
                        ) -> None:
    """Signature map entry ``key``: a graph node calling library function ``fn`` on graph
    tensors ``inputs``. Its inputs and method are signature ``like``'s (None: no inputs, a
    predict method); ``fn``'s outputs, in order, are its outputs ``outputs`` (described as
    ``like``'s outputs of those keys), then ``new_outputs`` ((key, dtype, shape))."""
    mg = item.meta_graph
    fdef = item.function(fn)
    call = _graph_node(mg.graph_def, f"vf/{key}", "StatefulPartitionedCall", inputs,
                       f=attr_value_pb2.AttrValue(func=attr_value_pb2.NameAttrList(name=fn)),
                       Tin=types_attr([a.type for a in fdef.signature.input_arg]),
                       Tout=types_attr([a.type for a in fdef.signature.output_arg]))
    infos = [(k, mg.signature_def[like].outputs[k]) for k in outputs] if like is not None else []
    infos += [(k, tensor_info(dtype, shape)) for k, dtype, shape in new_outputs]
    sd = mg.signature_def[key]
    sd.method_name = mg.signature_def[like].method_name if like is not None else PREDICT_METHOD
    if like is not None:
        for k, t in mg.signature_def[like].inputs.items():
            sd.inputs[k].CopyFrom(t)
    for k, (out_key, info) in enumerate(infos):
        sd.outputs[out_key].CopyFrom(info)
        sd.outputs[out_key].name = f"{call}:{k}"
    item.preserve.add(fn)


def tensor_info(dtype: int, shape: Optional[Sequence[int]]) -> meta_graph_pb2.TensorInfo:
    """A signature's description of a tensor (no name yet); ``shape`` None: unknown rank."""
    info = meta_graph_pb2.TensorInfo(dtype=dtype)
    if shape is None:
        info.tensor_shape.unknown_rank = True
    else:
        info.tensor_shape.SetInParent()  # a scalar's shape is present, with no dimensions
        for d in shape:
            info.tensor_shape.dim.add().size = d
    return info


def add_object_variables(item: GraphItem, holder: str, specs: Sequence[VariableSpec]) -> List[int]:
    """Non-trainable variables in the object graph, children of a new object that is the
    root's child ``holder``, named ``<holder>/<name>``; returns their object ids (to bind a
    signature to, see :func:`add_signature`)."""
    og = item.meta_graph.object_graph_def
    holder_id = len(og.nodes)
    obj = og.nodes.add()
    obj.user_object.identifier = "_generic_user_object"
    obj.user_object.version.producer = 1
    obj.user_object.version.min_consumer = 1
    og.nodes[0].children.add(node_id=holder_id, local_name=holder)
    ids = []
    for local, dtype, shape in specs:
        node = og.nodes.add()
        node.variable.dtype = dtype
        for d in shape:
            node.variable.shape.dim.add().size = d
        node.variable.name = f"{holder}/{local}"
        node.variable.trainable = False
        obj.children.add(node_id=len(og.nodes) - 1, local_name=local)
        ids.append(len(og.nodes) - 1)
    return ids


def add_graph_variables(item: GraphItem, holder: str, specs: Sequence[VariableSpec]) -> List[str]:
    """The same variables as graph nodes (``VarHandleOp`` named ``<holder>/<name>``), for
    loaders that run the graph (TF1 sessions, ``saved_model_cli``, serving): zeroed by the
    SavedModel's init op, which runs them before the model's own init op (a dimension -1
    starts empty). Returns the node names (graph tensors to feed a signature's call)."""
    mg = item.meta_graph
    gd = mg.graph_def

    def const(name, value, dtype):
        return _graph_node(gd, name, "Const", dtype=type_attr(dtype), value=tensor_attr(value, dtype))

    handles, zeroed = [], []
    fills = {}  # (shape, dtype) -> a Fill node: one per distinct shape
    for local, dtype, shape in specs:
        name = f"{holder}/{local}"
        handles.append(_graph_node(gd, name, "VarHandleOp", dtype=type_attr(dtype),
                                   shape=attr_value_pb2.AttrValue(shape=shape_proto(shape)),
                                   shared_name=attr_value_pb2.AttrValue(s=name.encode()),
                                   container=attr_value_pb2.AttrValue(s=b"")))
        empty = tuple(max(d, 0) for d in shape)
        if (empty, dtype) not in fills:
            base = f"{holder}/zeros_{len(fills)}"
            fills[empty, dtype] = _graph_node(gd, base, "Fill",
                                              [const(f"{base}/shape", empty, I32), const(f"{base}/zero", 0, dtype)],
                                              T=type_attr(dtype), index_type=type_attr(I32))
        zeroed.append(_graph_node(gd, f"{name}/init", "AssignVariableOp", [name, fills[empty, dtype]],
                                  dtype=type_attr(dtype)))
    before = _init_op(mg)
    init = _graph_node(gd, INIT_OP_NODE, "NoOp",
                       ["^" + z for z in zeroed] + (["^" + tensor_node(before)] if before else []))
    mg.signature_def[INIT_OP_KEY].outputs[INIT_OP_KEY].name = init
    return handles


def _init_op(mg) -> str:
    """The tensor or node the loader runs as the model's init op ("" when none)."""
    if INIT_OP_KEY in mg.signature_def:
        return mg.signature_def[INIT_OP_KEY].outputs[INIT_OP_KEY].name
    for key in ("saved_model_main_op", "legacy_init_op"):  # what the loader would run otherwise
        if key in mg.collection_def and mg.collection_def[key].node_list.value:
            return mg.collection_def[key].node_list.value[0]
    return ""


def _graph_node(gd, name: str, op: str, inputs=(), **attrs) -> str:
    gd.node.add(name=name, op=op, input=inputs, attr=attrs)
    return name


def _signature_call(mg, key: str):
    """The graph node signature map entry ``key``'s outputs come from (None: no such entry,
    no output, or not in the graph)."""
    if key not in mg.signature_def or not mg.signature_def[key].outputs:
        return None
    out = tensor_node(next(iter(mg.signature_def[key].outputs.values())).name)
    return next((n for n in mg.graph_def.node if n.name == out), None)


def _clear_kwonly(spec) -> None:
    for v in spec.fullargspec.named_tuple_value.values:
        if v.key == "kwonlyargs":
            del v.value.list_value.values[:]


def set_variable_devices(item: GraphItem, key: str, devices: Mapping[str, str]) -> int:
    """Place the variables that TF2 signature ``key``'s function takes as resource arguments
    where ``devices`` says (argument -> device), in the object graph that
    ``tf.saved_model.load`` creates them from (it honours the device with
    ``LoadOptions(experimental_variable_policy=VariablePolicy.SAVE_VARIABLE_DEVICES)`` and
    ignores it by default). Returns how many variables were placed."""
    wrapper = signature_wrapper(item, key)
    if wrapper is None:
        return 0
    og = item.meta_graph.object_graph_def
    placed = 0
    for arg, node_id in zip(wrapper.bound_args, og.concrete_functions[wrapper.function].bound_inputs):
        obj = og.nodes[node_id]
        if arg in devices and obj.WhichOneof("kind") == "variable":
            obj.variable.device = devices[arg]
            placed += 1
    return placed
