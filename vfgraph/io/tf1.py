"""TF1 SavedModels (graph-level ops, resource variables): each signature becomes a function.

On load, the subgraph a signature runs (its outputs and everything they depend on,
control dependencies included, so a loss fetched after ``train_op`` brings the update
with it) becomes a library function whose arguments are the signature's placeholders and
the variables' handles. Passes rewrite that function like any TF2 signature function. On
save, the graph keeps every original node (initialisers, saver, collections); each
rewritten signature points at a call of its function, and the train op (``train_op`` or
``saved_model_train_op`` collection, ``__saved_model_train_op`` signature) is replaced by a
NoOp of the same name that runs the call.

A training signature that computes no variable update (its outputs only the loss, the
update left to the train op a TF1 loop runs beside it) runs the train op when that op reads
the signature's inputs (``trainop.attach_train_op``).
"""
from __future__ import annotations

import re
from typing import Dict, List, Optional, Set

from tensorflow.core.framework import function_pb2, types_pb2
from tensorflow.core.protobuf import saved_model_pb2

from vfgraph.errors import InputError
from vfgraph.io import refvars
from vfgraph.io.trainop import attach_train_op, train_op_candidates
from vfgraph.ir.functions import output_layout
from vfgraph.ir.names import is_control, tensor_index, tensor_node
from vfgraph.ir.walk import walk
from vfgraph.item import GraphItem, SignatureInfo, VariableInfo

_VARIABLE_OPS = ("VarHandleOp",)
_REF_VARIABLES = ("VariableV2", "Variable")


def function_name(key: str) -> str:
    return "__vf_tf1_" + re.sub(r"[^A-Za-z0-9_]", "_", key)


def _arg_name(node: str) -> str:
    return re.sub(r"[^A-Za-z0-9_]", "_", node).lower() or "arg"


def is_tf1(sm: saved_model_pb2.SavedModel) -> bool:
    mg = sm.meta_graphs[0]
    return not mg.object_graph_def.nodes and bool(mg.graph_def.node)


def convert(sm: saved_model_pb2.SavedModel, path: str, skip: Set[str] = frozenset()) -> GraphItem:
    """Turn each signature of a TF1 MetaGraph (but those in ``skip``) into a library function."""
    import tensorflow as tf

    mg = sm.meta_graphs[0]
    refvars.to_resource_variables(mg, path)
    for key in sorted(mg.signature_def):
        if key not in skip and SignatureInfo(key, "", [], {}, [], {}).is_training:
            attach_train_op(mg, key, path)
    gd = mg.graph_def
    nodes = {n.name: n for n in gd.node}
    graph = tf.Graph()
    with graph.as_default():
        try:
            tf.graph_util.import_graph_def(gd, name="")
        except (ValueError, tf.errors.OpError) as e:
            raise InputError(f"{path}: TensorFlow cannot import this graph ({str(e).splitlines()[0][:200]})") from None
    shapes = {op.name: [t.shape for t in op.outputs] for op in graph.get_operations()}
    library = {f.signature.name: f for f in gd.library.function}
    signatures: Dict[str, SignatureInfo] = {}
    for key in sorted(mg.signature_def):
        if key.startswith("__") or key in skip:
            continue
        fdef, info = _signature_function(path, key, mg.signature_def[key], nodes, shapes, library)
        mg.graph_def.library.function.add().CopyFrom(fdef)
        signatures[key] = info
    item = GraphItem(source=path, kind="tf1_saved_model", saved_model=sm, signatures=signatures)
    return item


def _signature_function(path, key, sig, nodes, shapes, library):
    """The library function of TF1 signature ``key`` (the subgraph from its placeholders and
    variables to its outputs) and its :class:`SignatureInfo`."""
    feeds = _feeds(path, key, sig, nodes)
    outs = [(k, t.name) for k, t in sorted(sig.outputs.items())]
    body, variables = _subgraph(path, key, nodes, feeds, [t for _, t in outs])
    placeholders = sorted(feeds, key=lambda n: feeds[n])
    args = _argument_names(placeholders, variables)
    fdef = _function_def(key, nodes, feeds, placeholders + variables, args)

    def ref(s: str) -> Optional[str]:  # an input of the graph as the function names it (None: dropped)
        ctl = is_control(s)
        name = tensor_node(s)
        if name in args:
            return None if ctl else args[name]
        if ctl:
            return s
        arg, k, _ = output_layout(nodes[name], library)[tensor_index(s)]
        return f"{name}:{arg}:{k}"

    for n in sorted(body):
        _copy_node(fdef, nodes[n], shapes.get(n), ref)
    for k, t in outs:
        a = fdef.signature.output_arg.add()
        a.name = _arg_name(k)
        name = tensor_node(t)
        if name in args:
            raise InputError(f"{path}: signature {key!r} output {k!r} is one of its inputs")
        a.type = output_layout(nodes[name], library)[tensor_index(t)][2]
        fdef.ret[a.name] = ref(t)
    variables_info = {}
    for v in variables:
        shape = [d.size for d in nodes[v].attr["shape"].shape.dim]
        variables_info[args[v]] = VariableInfo(name=nodes[v].attr["shared_name"].s.decode() or v,
                                               dtype=nodes[v].attr["dtype"].type, shape=shape)
    info = SignatureInfo(key=key, function=fdef.signature.name, batch_args=[args[n] for n in placeholders],
                         input_keys={args[n]: feeds[n] for n in placeholders},
                         resource_args=[args[v] for v in variables], variables=variables_info,
                         call_inputs=placeholders + variables, output_keys=[k for k, _ in outs])
    return fdef, info


def _feeds(path, key, sig, nodes) -> Dict[str, str]:
    """The placeholders signature ``key`` feeds: node name -> input key."""
    feeds = {}
    for k, t in sorted(sig.inputs.items()):
        name = tensor_node(t.name)
        if nodes.get(name) is None or nodes[name].op != "Placeholder":
            raise InputError(f"{path}: signature {key!r} input {k!r} ({t.name}) is not a placeholder")
        feeds[name] = k
    return feeds


def _subgraph(path, key, nodes, feeds, outputs: List[str]):
    """The nodes between the signature's inputs and ``outputs``: (the body's nodes, the
    variables it reads, sorted); placeholders and variables become arguments."""
    body: List[str] = []
    variables: List[str] = []

    def inside(node) -> bool:  # placeholders and variables become arguments: their inputs stay out
        return node.op != "Placeholder" and node.op not in _VARIABLE_OPS

    for n in walk(nodes, [tensor_node(t) for t in outputs], follow=inside):
        node = nodes.get(n)
        if node is None:
            raise InputError(f"{path}: signature {key!r} refers to missing node {n!r}")
        if node.op in _REF_VARIABLES:
            raise InputError(f"{path}: signature {key!r} uses reference variable {n!r}; vfgraph needs resource "
                             "variables (create them with use_resource=True or under TF2 behaviour)")
        if node.op == "Placeholder":
            if n not in feeds:
                raise InputError(f"{path}: signature {key!r} depends on placeholder {n!r} that is not one of its "
                                 "inputs; add it to the signature")
            continue
        if node.op in _VARIABLE_OPS:
            variables.append(n)
            continue
        body.append(n)
    return body, sorted(variables)


def _argument_names(placeholders: List[str], variables: List[str]) -> Dict[str, str]:
    """The function's argument for each placeholder and variable node, unique."""
    args = {n: _arg_name(n) for n in placeholders}
    used = set(args.values())
    for v in variables:
        a = _arg_name(v) + "_resource"
        while a in used:
            a += "_"
        used.add(a)
        args[v] = a
    return args


def _function_def(key, nodes, feeds, inputs: List[str], args: Dict[str, str]) -> function_pb2.FunctionDef:
    """The function's signature: an argument for each of ``inputs`` (placeholders with their
    dtype and shape, variables as resources), no outputs yet."""
    fdef = function_pb2.FunctionDef()
    fdef.signature.name = function_name(key)
    fdef.signature.is_stateful = True
    for i, n in enumerate(inputs):
        a = fdef.signature.input_arg.add()
        a.name = args[n]
        if n in feeds:
            a.type = nodes[n].attr["dtype"].type
            fdef.arg_attr[i].attr["_output_shapes"].list.shape.add().CopyFrom(nodes[n].attr["shape"].shape)
        else:
            a.type = types_pb2.DT_RESOURCE
    return fdef


def _copy_node(fdef: function_pb2.FunctionDef, original, shapes, ref) -> None:
    """``original`` into ``fdef``'s body: no device, inputs as ``ref`` names them (those it
    drops left out), its output shapes (``shapes``) where it has none recorded."""
    node = fdef.node_def.add()
    node.CopyFrom(original)
    node.ClearField("device")
    inputs = [r for r in (ref(s) for s in original.input) if r is not None]
    del node.input[:]
    node.input.extend(inputs)
    if shapes is not None and "_output_shapes" not in node.attr:
        for s in shapes:
            node.attr["_output_shapes"].list.shape.add().CopyFrom(s.as_proto())


def emit(item: GraphItem) -> saved_model_pb2.SavedModel:
    """The SavedModel to write: original graph, plus calls of the rewritten signature functions."""
    sm = saved_model_pb2.SavedModel()
    sm.CopyFrom(item.saved_model)
    mg = sm.meta_graphs[0]
    lib = item.library
    train_ops = train_op_candidates(mg)
    for key, sig in sorted(item.signatures.items()):
        if sig.function not in item.preserve:
            continue  # not rewritten: the signature keeps running the original graph
        fdef = lib[sig.function]
        call = mg.graph_def.node.add()
        call.name = f"vf/{key}"
        call.op = "StatefulPartitionedCall"
        call.input.extend(sig.call_inputs)
        call.attr["f"].func.name = sig.function
        call.attr["Tin"].list.type.extend(a.type for a in fdef.signature.input_arg)
        call.attr["Tout"].list.type.extend(a.type for a in fdef.signature.output_arg)
        for k, out_key in enumerate(sig.output_keys):
            mg.signature_def[key].outputs[out_key].name = f"{call.name}:{k}"
        if item.training_signature() is sig:
            for op_name in train_ops:
                _replace_train_op(mg.graph_def, op_name, call.name)
    return sm


def _replace_train_op(gd, name: str, call: str) -> None:
    """Rename the original train op aside and give its name to a NoOp that runs ``call``."""
    for node in gd.node:
        if node.name == name:
            node.name = f"{name}/vf_original"
            break
    else:
        return
    noop = gd.node.add()
    noop.name = name
    noop.op = "NoOp"
    noop.input.append(f"^{call}")
