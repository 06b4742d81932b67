"""Frozen GraphDefs (.pb binary, .pbtxt text): inference graphs without variables.

On load, the graph between its placeholders and its outputs becomes one library function
(``__vf_graph``) behind a signature named ``graph``, so the same passes that rewrite
SavedModel signatures rewrite it. On save, the GraphDef has the original placeholders, one
call of that function, and Identity nodes named after the original outputs: users feed and
fetch the same tensor names as before.
"""
from __future__ import annotations

import os
from typing import List, Optional, Sequence

from google.protobuf import text_format
from tensorflow.core.framework import graph_pb2, types_pb2
from tensorflow.core.protobuf import saved_model_pb2

from vfgraph.ir.tracing import annotate_shapes
from vfgraph.errors import InputError
from vfgraph.io import outputs
from vfgraph.io.files import GRAPH_CALL, GRAPH_FUNCTION, read_graph_def
from vfgraph.io.savedmodel import is_saved_model_text
from vfgraph.ir.functions import function_dependencies
from vfgraph.ir.names import is_tensor_name, tensor_name, tensor_node
from vfgraph.item import GraphItem, SignatureInfo

GRAPH_SIGNATURE = "graph"
_NOT_OUTPUTS = {"NoOp", "Assert", "Const", "Placeholder", "PlaceholderWithDefault", "SaveV2", "RestoreV2"}


def graph_outputs(gd: graph_pb2.GraphDef) -> List[str]:
    """Output tensors of a frozen graph: output 0 of every node nothing else consumes."""
    consumed = {tensor_node(s) for n in gd.node for s in n.input}
    return [f"{n.name}:0" for n in gd.node if n.name not in consumed and n.op not in _NOT_OUTPUTS]


def is_graph_def(path: str) -> bool:
    """Whether ``path`` is a frozen GraphDef file by its name: ``.pb`` (binary) or ``.pbtxt``
    (text; one holding a SavedModel is not)."""
    return os.path.isfile(path) and path.endswith((".pb", ".pbtxt")) and not is_saved_model_text(path)


def load_graph_def(path: str, outputs: Optional[Sequence[str]] = None) -> GraphItem:
    """Load a frozen GraphDef as an item with one inference signature."""
    import tensorflow as tf

    path = os.path.abspath(path)
    gd = read_graph_def(path)
    placeholders = [n for n in gd.node if n.op == "Placeholder"]
    if not placeholders:
        raise InputError(f"{path}: the graph has no Placeholder inputs")
    outs = list(outputs) if outputs else graph_outputs(gd)
    if not outs:
        raise InputError(f"{path}: no output found (every node is consumed); name them with --outputs")
    names = {n.name for n in gd.node}
    for o in outs:
        node = tensor_node(o)
        if not is_tensor_name(o) or node not in names:
            raise InputError(f"{path}: output {o!r} names no node of the graph")
        if o not in (node, node + ":0"):
            raise InputError(f"{path}: output {o!r}: only output 0 of a node can be kept under its name")
    outs = [tensor_name(o) for o in outs]
    specs = []
    for p in placeholders:
        shape = p.attr["shape"].shape
        dims = None if shape.unknown_rank else [None if d.size < 0 else d.size for d in shape.dim]
        specs.append(tf.TensorSpec(dims, tf.dtypes.as_dtype(p.attr["dtype"].type), name=p.name))

    def body(*args):
        return tf.graph_util.import_graph_def(
            gd, input_map={f"{p.name}:0": a for p, a in zip(placeholders, args)}, return_elements=outs, name="graph")

    try:
        traced = tf.function(body, input_signature=specs, autograph=False).get_concrete_function()
    except (ValueError, TypeError, tf.errors.OpError) as e:
        raise InputError(f"{path}: TensorFlow cannot import this graph ({str(e).splitlines()[0][:200]})") from None
    fdef = traced.function_def
    annotate_shapes(fdef, traced.graph)
    lib = {f.signature.name: f for f in traced.graph.as_graph_def().library.function}
    fdef.signature.name = GRAPH_FUNCTION
    sm = saved_model_pb2.SavedModel()
    mg = sm.meta_graphs.add()
    mg.graph_def.CopyFrom(gd)
    mg.graph_def.library.function.add().CopyFrom(fdef)
    for name in sorted(lib):
        if not any(f.signature.name == name for f in mg.graph_def.library.function):
            mg.graph_def.library.function.add().CopyFrom(lib[name])
    args = [a.name for a in fdef.signature.input_arg]
    sig = SignatureInfo(key=GRAPH_SIGNATURE, function=GRAPH_FUNCTION, batch_args=args,
                        input_keys={a: p.name for a, p in zip(args, placeholders)}, resource_args=[], variables={})
    item = GraphItem(source=path, kind="graph_def", saved_model=sm, signatures={GRAPH_SIGNATURE: sig})
    item.metadata = {"graph_outputs": outs}
    return item


def save_graph_def(item: GraphItem, out: str, force: bool = False) -> str:
    """Write the rewritten graph as a GraphDef (.pbtxt: text, otherwise binary), atomically."""
    out = outputs.check_output(out, [item.source], force)
    src = item.meta_graph.graph_def
    lib = item.library
    fdef = lib[GRAPH_FUNCTION]
    gd = graph_pb2.GraphDef()
    gd.versions.CopyFrom(src.versions)
    placeholders = [n for n in src.node if n.op == "Placeholder"]
    gd.node.extend(placeholders)
    call = gd.node.add()
    call.name = GRAPH_CALL
    call.op = "StatefulPartitionedCall"
    call.input.extend(p.name for p in placeholders)
    call.attr["f"].func.name = GRAPH_FUNCTION
    call.attr["Tin"].list.type.extend(a.type for a in fdef.signature.input_arg)
    call.attr["Tout"].list.type.extend(a.type for a in fdef.signature.output_arg)
    for k, o in enumerate(item.metadata["graph_outputs"]):
        ident = gd.node.add()
        ident.name = tensor_node(o)
        ident.op = "Identity"
        ident.input.append(f"{GRAPH_CALL}:{k}")
        ident.attr["T"].type = fdef.signature.output_arg[k].type or types_pb2.DT_FLOAT
    for name in sorted(function_dependencies(GRAPH_FUNCTION, lib)):
        gd.library.function.add().CopyFrom(lib[name])
    data = (text_format.MessageToString(gd).encode() if out.endswith(".pbtxt")
            else gd.SerializeToString(deterministic=True))
    outputs.write_file(out, data)
    return out
