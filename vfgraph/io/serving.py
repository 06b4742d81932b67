"""Serving-only SavedModels: the serving signatures and the variables they read, nothing else.

Written in TF Serving's versioned layout (``DIR/<version>/``) with tag ``serve``, without the
training functions and without vfgraph's ops, so that any TensorFlow runtime loads it without
vfgraph: ``tf.saved_model.load`` (the object graph and its checkpoint) and the C++ loader
behind TF Serving and the C API (``TF_LoadSessionFromSavedModel``: the graph, its saver's
restore op, the signatures' tensors).

Why the graph is written anew. ``tf.saved_model.save`` gives the graph one ``VarHandleOp``
per tracked variable for its saver, and the signatures' calls read the handles their
functions captured. For plain ``tf.Variable``s these are the same nodes; for Keras 3
variables (wrappers around a ``tf.Variable``) they are not: the calls read
``sequential/dense/kernel`` while the saver's restore function writes ``Variable_13`` (its
initializer copies from the other), two resources in a C++ session. The Python loader never
runs that graph (it binds the functions to variables rebuilt from the object graph and
restores those by checkpoint key), so it works there; the C++ loader runs the restore op and
then the serving call fails with ``Could not find variable sequential/dense/kernel``. Here
every variable a signature reads gets one handle node, shared by the calls and by a restore
op (``RestoreV2`` then one ``AssignVariableOp`` per variable) that reads the export's own
checkpoint, whose keys and object graph match the export's object graph.
"""
from __future__ import annotations

import json
import os
from typing import Dict, List, Tuple

import numpy as np
from tensorflow.core.framework import attr_value_pb2, graph_pb2, op_def_pb2, tensor_shape_pb2, types_pb2
from tensorflow.core.protobuf import saved_model_pb2, saved_object_graph_pb2, saver_pb2, trackable_object_graph_pb2

from vfgraph import records
from vfgraph.errors import InputError, OutputError
from vfgraph.io import checkpoint, keras_file, outputs, savedmodel
from vfgraph.io.checkpoint import OBJECT_GRAPH_KEY, CheckpointReader
from vfgraph.io.signatures import INIT_OP_KEY
from vfgraph.ir.functions import CALL_OPS, function_dependencies, iter_func_attrs
from vfgraph.ir.graph import verify_function_def
from vfgraph.ir.names import data_inputs, tensor_node
from vfgraph.ir.walk import walk
from vfgraph.item import GraphItem
from vfgraph.records import Microbatch, VirtualNodes
from vfgraph.version import __version__

SERVE_TAG = "serve"
_PREFIX = "vf/serving/"  # names of the nodes written here (loader plumbing)
_VALUE = ".ATTRIBUTES/VARIABLE_VALUE"


def serving_keys(item: GraphItem) -> List[str]:
    """The signatures a serving export keeps: every signature that is not a training step
    (``train`` and ``train*``, the training signatures a rewrite recorded, and the runtime
    entry points vfgraph added, which the loader already leaves out of ``item.signatures``)."""
    training = set(records.get(item, VirtualNodes))
    return [k for k, s in sorted(item.signatures.items()) if not s.is_training and k not in training]


def sibling_dir(model_out: str) -> str:
    """Where ``vfgraph train`` writes the serving export of the model it wrote at ``model_out``."""
    return os.path.abspath(model_out) + ".serving"


def target_dir(out: str, version: int) -> str:
    return os.path.join(os.path.abspath(out), str(version))


def prepare_target(out: str, version: int, force: bool, sources=()) -> str:
    """Check that ``out/<version>`` may be written, by vfgraph.io.outputs' rule: the base
    ``out`` is new, or a serving base (version directories only) that contains no input but
    a version of its own (exporting ``base/1`` as ``base/2``); an existing version is replaced
    only with ``force`` and only when vfgraph wrote it. Returns the version directory's path."""
    if not isinstance(version, int) or isinstance(version, bool) or version < 0:
        raise InputError(f"--version {version}: give a non-negative integer (TF Serving's version directories)")
    base = os.path.abspath(out)
    if os.path.lexists(base) and not os.path.isdir(base):
        raise OutputError(f"{base}: exists and is not a directory; choose another output path")
    if not os.path.isdir(base):  # made whole by the export, holding the version: the base is what is checked
        outputs.check_output(base, sources, force=False)
        return target_dir(out, version)
    others = sorted(e for e in os.listdir(base) if not e.isdigit() and not e.startswith("."))
    if others:
        raise OutputError(f"{base}: not a serving base directory (it holds {', '.join(others[:3])}"
                          f"{' ...' if others[3:] else ''}, not only version directories); choose a new or empty "
                          "directory for the export")
    real_base = outputs.real(base)
    versions = [s for s in sources if s and os.path.dirname(outputs.real(s)) == real_base]
    outputs.check_apart(base, [s for s in sources if s not in versions])
    return outputs.check_output(target_dir(out, version), sources, force, what=f"version {version}")


def save_serving_model(item: GraphItem, out: str, version: int = 1, force: bool = False) -> str:
    """Write the serving-only SavedModel of ``item`` at ``out/<version>/`` atomically (temp dir
    in ``out``, then rename); returns that directory. The input is only read."""
    path = prepare_target(out, version, force, savedmodel.input_paths(item))
    if item.kind != "saved_model":
        what = {"tf1_saved_model": "a TF1 model", "graph_def": "a frozen GraphDef"}.get(item.kind, item.kind)
        raise InputError(f"{item.source}: a serving export is made from a TF2 SavedModel (this is {what}); "
                         "save the model with tf.saved_model.save first")
    proto, variables = build_serving_proto(item)
    base = os.path.dirname(path)
    if os.path.isdir(base):  # the version is written beside the others
        tmp = outputs.temp_dir(base, ".vfgraph-serving-")
        dst, final = tmp, path
    else:  # the base directory is written whole, holding the version
        tmp = outputs.temp_dir(os.path.dirname(base), ".vfgraph-serving-")
        dst, final = os.path.join(tmp, str(version)), base
        os.mkdir(dst)
    with outputs.writing(path, tmp):
        if variables:
            _write_checkpoint(item, os.path.join(dst, "variables", "variables"), variables,
                              proto.meta_graphs[0].object_graph_def)
        with open(os.path.join(dst, savedmodel.SAVED_MODEL_PB), "wb") as f:
            f.write(proto.SerializeToString(deterministic=True))
        meta = _metadata(item, proto)
        os.makedirs(os.path.join(dst, "assets.extra"))
        with open(os.path.join(dst, records.METADATA_FILE), "w") as f:
            json.dump(meta, f, indent=2, sort_keys=True)
            f.write("\n")
        savedmodel._write_fingerprint(dst, proto)
        outputs.write_manifest(dst)
        outputs.publish(tmp, final, manifest=False)
    return path


# One variable of the export: (index in the export's variable list, node id in the source's
# object graph, the handle node the export's graph reads it through, its dtype).
_Var = Tuple[int, int, str, int]


def build_serving_proto(item: GraphItem) -> Tuple[saved_model_pb2.SavedModel, List[_Var]]:
    """The serving-only SavedModel proto of ``item`` and the variables it keeps."""
    keys = _exportable_keys(item)
    src = item.meta_graph
    og = src.object_graph_def
    nodes = {n.name: n for n in src.graph_def.node}
    sigmap = _signature_map(item, og)
    keep, bound = _kept_nodes(item, keys, nodes)
    handle_of, const_ids = _saved_objects(item, keep, nodes, bound)

    out = saved_model_pb2.SavedModel(saved_model_schema_version=item.saved_model.saved_model_schema_version or 1)
    mg = out.meta_graphs.add()
    graph = mg.graph_def
    graph.versions.CopyFrom(src.graph_def.versions)
    for name in keep:
        node = graph.node.add()
        node.CopyFrom(nodes[name])
        node_id = bound.get(name)
        if node.op == "VarHandleOp":  # every handle of one variable names the same resource
            node.attr["shared_name"].s = handle_of[node_id].encode()

    variables = _object_graph(item, keys, sigmap, handle_of, const_ids, mg.object_graph_def)
    reached = _copy_library(item, keys, graph)
    if variables:
        _add_saver(mg, graph, variables, mg.object_graph_def)
    init = graph.node.add(name=_PREFIX + "init", op="NoOp")
    for key in keys:
        mg.signature_def[key].CopyFrom(src.signature_def[key])
    mg.signature_def[INIT_OP_KEY].outputs[INIT_OP_KEY].name = init.name
    mg.signature_def[INIT_OP_KEY].outputs[INIT_OP_KEY].tensor_shape.unknown_rank = True
    _copy_meta_info(mg, src, reached, graph)
    return out, variables


def _exportable_keys(item: GraphItem) -> List[str]:
    """The serving signatures of ``item``; an ``InputError`` when there are none or when the
    model has no object graph to export them from."""
    keys = serving_keys(item)
    if not keys:
        raise InputError(f"{item.source}: no serving signature to export (signatures: "
                         f"{', '.join(sorted(item.signatures)) or 'none'}); export a model with an inference "
                         "signature such as 'serving_default'")
    if not item.meta_graph.object_graph_def.nodes:
        raise InputError(f"{item.source}: no object graph (a TF1 SavedModel?); a serving export is made from a "
                         "TF2 SavedModel")
    return keys


def _kept_nodes(item: GraphItem, keys: List[str], nodes) -> Tuple[Dict[str, None], Dict[str, int]]:
    """The graph nodes the signatures ``keys`` read (an ordered set), and the saved objects
    their calls are bound to (graph node, a handle or constant a call captures -> object
    graph node id)."""
    src = item.meta_graph
    og = src.object_graph_def
    keep: Dict[str, None] = {}  # ordered set
    bound: Dict[str, int] = {}
    for key in keys:
        sd = src.signature_def[key]
        roots = [tensor_node(t.name) for t in list(sd.inputs.values()) + list(sd.outputs.values())]
        for name in _closure(item, key, nodes, roots):
            keep[name] = None
            node = nodes[name]
            if node.op in CALL_OPS and node.attr["f"].func.name in og.concrete_functions:
                ids = list(og.concrete_functions[node.attr["f"].func.name].bound_inputs)
                data = [tensor_node(i) for i in data_inputs(node)]
                for src_name, node_id in zip(data[len(data) - len(ids):], ids):
                    if bound.setdefault(src_name, node_id) != node_id:
                        raise InputError(f"{item.source}: graph node {src_name!r} is bound to two saved objects; "
                                         "re-export the model")
    return keep, bound


def _saved_objects(item: GraphItem, keep: Dict[str, None], nodes,
                   bound: Dict[str, int]) -> Tuple[Dict[int, str], Dict[int, str]]:
    """The saved variables and constants the kept nodes are bound to: variable's object id ->
    its one handle (the first graph node found for it; others share its name), and constant's
    object id -> its graph node. Anything else a signature captures is an ``InputError``."""
    og = item.meta_graph.object_graph_def
    handle_of: Dict[int, str] = {}
    const_ids: Dict[int, str] = {}
    for name in keep:
        node = nodes[name]
        node_id = bound.get(name)
        kind = og.nodes[node_id].WhichOneof("kind") if node_id is not None else None
        if node.op == "VarHandleOp" and kind == "variable":
            handle_of.setdefault(node_id, name)
        elif node.op == "VarHandleOp" or kind == "variable":
            raise InputError(f"{item.source}: graph node {name!r} ({node.op}) read by the serving signatures is not a "
                             "variable handle bound to a saved variable; re-export the model")
        elif kind == "constant":
            const_ids.setdefault(node_id, name)
        elif kind is not None:
            raise InputError(f"{item.source}: a serving signature captures a {kind} ({name!r}); a serving export "
                             "keeps variables and constants only")
    return handle_of, const_ids


def _object_graph(item: GraphItem, keys: List[str], sigmap: Dict[str, int], handle_of: Dict[int, str],
                  const_ids: Dict[int, str], new_og) -> List[_Var]:
    """Fill the export's object graph ``new_og``: root -> 'variables' (a list) and 'signatures'
    (the signature map), then the kept variables, constants and signature functions, with the
    functions' bound inputs renumbered. Returns the export's variables."""
    og = item.meta_graph.object_graph_def
    root = new_og.nodes.add()
    root.user_object.CopyFrom(_user_object("_generic_user_object"))
    var_list = new_og.nodes.add()
    var_list.user_object.CopyFrom(_user_object("trackable_list_wrapper"))
    sig_node = new_og.nodes.add()
    sig_node.user_object.CopyFrom(_user_object("signature_map"))
    root.children.add(node_id=1, local_name="variables")
    root.children.add(node_id=2, local_name="signatures")
    new_id: Dict[int, int] = {}
    variables: List[_Var] = []
    for node_id, handle in handle_of.items():
        new_id[node_id] = len(new_og.nodes)
        var_list.children.add(node_id=new_id[node_id], local_name=str(len(variables)))
        new_og.nodes.add().variable.CopyFrom(og.nodes[node_id].variable)
        variables.append((len(variables), node_id, handle, og.nodes[node_id].variable.dtype))
    for node_id in const_ids:
        new_id[node_id] = len(new_og.nodes)
        new_og.nodes.add().constant.CopyFrom(og.nodes[node_id].constant)
    for key in keys:
        fname = og.nodes[sigmap[key]].bare_concrete_function.concrete_function_name if key in sigmap else ""
        if fname not in og.concrete_functions:
            raise InputError(f"{item.source}: signature {key!r} has no concrete function in the object graph; "
                             "re-export the model with tf.saved_model.save(..., signatures=...)")
        sig_node.children.add(node_id=len(new_og.nodes), local_name=key)
        new_og.nodes.add().bare_concrete_function.CopyFrom(og.nodes[sigmap[key]].bare_concrete_function)
        if fname not in new_og.concrete_functions:
            cf = new_og.concrete_functions[fname]
            cf.CopyFrom(og.concrete_functions[fname])
            del cf.bound_inputs[:]
            cf.bound_inputs.extend(new_id[i] for i in og.concrete_functions[fname].bound_inputs)
    return variables


def _copy_library(item: GraphItem, keys: List[str], graph) -> set:
    """Copy into ``graph`` only the library functions its nodes reach (in the source's order),
    check its ops and that nothing the kept functions call was left behind; returns the names
    reached."""
    src_lib = item.meta_graph.graph_def.library
    library = {f.signature.name: f for f in src_lib.function}
    reached = set()
    for node in graph.node:
        for fa in iter_func_attrs(node):
            reached.update(function_dependencies(fa.name, library))
    for f in src_lib.function:  # in the source's order
        if f.signature.name in reached:
            graph.library.function.add().CopyFrom(f)
    _check_ops(item, keys, graph)
    kept = {f.signature.name: f for f in graph.library.function}
    for f in graph.library.function:  # nothing the kept functions call was left behind
        verify_function_def(f, kept)
    return reached


def _copy_meta_info(mg, src, reached: set, graph) -> None:
    """The export's meta info: the source's, tagged ``serve`` only, with the function aliases
    of the functions kept and the op list of ``graph``."""
    info = mg.meta_info_def
    info.CopyFrom(src.meta_info_def)
    del info.tags[:]
    info.tags.append(SERVE_TAG)
    info.ClearField("function_aliases")
    for fname, alias in sorted(src.meta_info_def.function_aliases.items()):
        if fname in reached:
            info.function_aliases[fname] = alias
    info.stripped_op_list.CopyFrom(_op_list(graph))


def _signature_map(item: GraphItem, og) -> Dict[str, int]:
    """Signature key -> object graph node of its concrete function."""
    for c in og.nodes[0].children:
        node = og.nodes[c.node_id]
        if c.local_name == "signatures" and node.WhichOneof("kind") == "user_object":
            return {s.local_name: s.node_id for s in node.children
                    if og.nodes[s.node_id].WhichOneof("kind") == "bare_concrete_function"}
    raise InputError(f"{item.source}: the object graph has no signature map; re-export the model with "
                     "tf.saved_model.save(..., signatures=...)")


def _closure(item: GraphItem, key: str, nodes, roots: List[str]) -> List[str]:
    """The graph nodes ``roots`` depend on, in the graph's order."""
    seen = set()
    for name in walk(nodes, roots):
        if name not in nodes:
            raise InputError(f"{item.source}: signature {key!r} reads graph node {name!r}, which is missing; "
                             "re-export the model")
        seen.add(name)
    return [n for n in nodes if n in seen]


def _check_ops(item: GraphItem, keys: List[str], graph: graph_pb2.GraphDef) -> None:
    """Every op of the export is one stock TensorFlow registers: none of vfgraph's (``Vf*``)."""
    from tensorflow.python.framework import op_def_registry

    kept = {f.signature.name for f in graph.library.function}
    where = [("the graph", n) for n in graph.node] + [(f"function {f.signature.name!r}", n)
                                                     for f in graph.library.function for n in f.node_def]
    for place, node in where:
        if node.op in kept:
            continue
        if node.op.startswith("Vf") or op_def_registry.get(node.op) is None:
            raise InputError(f"{item.source}: the serving signatures ({', '.join(keys)}) use op {node.op!r} "
                             f"(node {node.name!r} in {place}), which stock TensorFlow does not provide; a "
                             "serving export cannot hold it")


def _user_object(identifier: str) -> saved_object_graph_pb2.SavedUserObject:
    obj = saved_object_graph_pb2.SavedUserObject(identifier=identifier)
    obj.version.producer = 1
    obj.version.min_consumer = 1
    return obj


def _key(index: int) -> str:
    return f"variables/{index}/{_VALUE}"


def _add_saver(mg, graph: graph_pb2.GraphDef, variables: List[_Var], og) -> None:
    """A TF1-style saver over the handles: RestoreV2 + one AssignVariableOp per variable (the
    restore op the C++ loader runs), SaveV2 of their values and the checkpoint's object graph."""
    dtypes = [dtype for _, _, _, dtype in variables]
    names = [_key(index) for index, _, _, _ in variables]

    def node(name, op, inputs=(), **attrs):
        n = graph.node.add(name=_PREFIX + name, op=op)
        n.input.extend(inputs)
        for k, v in attrs.items():
            n.attr[k].CopyFrom(v)
        return n

    def strings(values):
        return node_attrs_const(np.array(values, dtype=object))

    filename = node("filename", "Placeholder", dtype=attr_value_pb2.AttrValue(type=types_pb2.DT_STRING),
                    shape=attr_value_pb2.AttrValue(shape=tensor_shape_pb2.TensorShapeProto()))
    node("restore/tensor_names", "Const", **strings(names))
    node("restore/shape_and_slices", "Const", **strings([""] * len(names)))
    node("restore/RestoreV2", "RestoreV2",
         [filename.name, _PREFIX + "restore/tensor_names", _PREFIX + "restore/shape_and_slices"],
         dtypes=attr_value_pb2.AttrValue(list=attr_value_pb2.AttrValue.ListValue(type=dtypes)))
    assigns = []
    for index, _, handle, dtype in variables:
        assigns.append(node(f"restore/assign_{index}", "AssignVariableOp",
                            [handle, f"{_PREFIX}restore/RestoreV2:{index}"],
                            dtype=attr_value_pb2.AttrValue(type=dtype)).name)
    restore = node("restore", "NoOp", ["^" + a for a in assigns])

    ckpt_graph = checkpoint_object_graph(og).SerializeToString(deterministic=True)
    node("save/tensor_names", "Const", **strings(names + [OBJECT_GRAPH_KEY]))
    node("save/shape_and_slices", "Const", **strings([""] * (len(names) + 1)))
    node("save/object_graph", "Const", **node_attrs_const(np.array(ckpt_graph, dtype=object)))
    reads = [node(f"save/read_{index}", "ReadVariableOp", [handle], dtype=attr_value_pb2.AttrValue(type=dtype)).name
             for index, _, handle, dtype in variables]
    node("save/SaveV2", "SaveV2", [filename.name, _PREFIX + "save/tensor_names", _PREFIX + "save/shape_and_slices"]
         + reads + [_PREFIX + "save/object_graph"],
         dtypes=attr_value_pb2.AttrValue(list=attr_value_pb2.AttrValue.ListValue(
             type=dtypes + [types_pb2.DT_STRING])))
    save = node("save", "Identity", [filename.name, "^" + _PREFIX + "save/SaveV2"],
                T=attr_value_pb2.AttrValue(type=types_pb2.DT_STRING))
    mg.saver_def.CopyFrom(saver_pb2.SaverDef(filename_tensor_name=filename.name + ":0",
                                             save_tensor_name=save.name + ":0", restore_op_name=restore.name,
                                             version=saver_pb2.SaverDef.V2))


def node_attrs_const(value: np.ndarray) -> Dict[str, attr_value_pb2.AttrValue]:
    import tensorflow as tf

    tensor = tf.make_tensor_proto(value)
    return {"value": attr_value_pb2.AttrValue(tensor=tensor), "dtype": attr_value_pb2.AttrValue(type=tensor.dtype)}


def checkpoint_object_graph(og) -> trackable_object_graph_pb2.TrackableObjectGraph:
    """The checkpoint's object graph for the export's object graph ``og`` (the same nodes and
    children; its variables hold values under ``variables/<i>/.ATTRIBUTES/VARIABLE_VALUE``)."""
    g = trackable_object_graph_pb2.TrackableObjectGraph()
    index = {c.node_id: c.local_name for c in og.nodes[1].children}  # root -> 'variables' -> '0', '1', ...
    for k, saved in enumerate(og.nodes):
        node = g.nodes.add()
        for c in saved.children:
            node.children.add(node_id=c.node_id, local_name=c.local_name)
        if saved.WhichOneof("kind") == "variable":
            node.attributes.add(name="VARIABLE_VALUE", full_name=saved.variable.name,
                                checkpoint_key=_key(int(index[k])))
        if k < 2 or saved.WhichOneof("kind") == "variable":  # root, the variable list, the variables
            node.has_checkpoint_values.value = True
    return g


def _source_keys(item: GraphItem, variables: List[_Var]) -> Tuple[str, List[str]]:
    """The source checkpoint's prefix and the key of each kept variable in it (the source's
    checkpoint object graph has the saved object graph's node ids)."""
    import tensorflow as tf

    prefix = savedmodel.checkpoint_prefix(item)
    if not os.path.isfile(prefix + ".index"):
        raise InputError(f"{prefix}.index: variables are missing; copy the whole SavedModel directory")
    reader = CheckpointReader(prefix)
    if not reader.has_tensor(OBJECT_GRAPH_KEY):
        raise InputError(f"{prefix}: checkpoint without an object graph (a TF1 checkpoint?); a serving export is "
                         "made from a TF2 SavedModel")
    ckpt = trackable_object_graph_pb2.TrackableObjectGraph()
    ckpt.ParseFromString(reader.get_tensor(OBJECT_GRAPH_KEY))
    og = item.meta_graph.object_graph_def
    keys = []
    for _, node_id, handle, _ in variables:
        attrs = [a for a in ckpt.nodes[node_id].attributes if a.name == "VARIABLE_VALUE"] \
            if node_id < len(ckpt.nodes) else []
        name = og.nodes[node_id].variable.name
        if not attrs or not reader.has_tensor(attrs[0].checkpoint_key) or (
                attrs[0].full_name and name and attrs[0].full_name != name):
            raise InputError(f"{prefix}: no value for variable {name or handle!r} (saved object {node_id}); the "
                             "checkpoint does not match saved_model.pb: re-export the model")
        keys.append(attrs[0].checkpoint_key)
    return prefix, keys


def _write_checkpoint(item: GraphItem, dst_prefix: str, variables: List[_Var], og) -> None:
    """The export's checkpoint: each kept variable's value from the source under its new key,
    and the checkpoint object graph; written in groups of about checkpoint.GROUP_BYTES (each its own
    SaveV2, merged by MergeV2Checkpoints) so memory stays near one group."""
    import tensorflow as tf

    src_prefix, src_keys = _source_keys(item, variables)
    reader = CheckpointReader(src_prefix)
    shapes, dtypes = reader.get_variable_to_shape_map(), reader.get_variable_to_dtype_map()
    entries = [(_key(index), int(np.prod(shapes[key])) * dtypes[key].size, key)
               for (index, _, _, _), key in zip(variables, src_keys)]
    graph = checkpoint_object_graph(og).SerializeToString(deterministic=True)
    groups: List[list] = [[]]
    size = 0
    for entry in entries:
        if groups[-1] and size + entry[1] > checkpoint.GROUP_BYTES:
            groups.append([])
            size = 0
        groups[-1].append(entry)
        size += entry[1]
    groups[-1].append((OBJECT_GRAPH_KEY, len(graph), None))
    parent = os.path.dirname(dst_prefix)
    os.makedirs(parent, exist_ok=True)
    parts = [dst_prefix] if len(groups) == 1 else [os.path.join(parent, f".part-{k}", "part")
                                                   for k in range(len(groups))]
    with tf.device("/cpu:0"):
        for prefix, group in zip(parts, groups):
            names = [key for key, _, _ in group]
            tensors = [tf.constant(np.array(graph, dtype=object) if src is None else reader.get_tensor(src))
                       for _, _, src in group]
            tf.raw_ops.SaveV2(prefix=prefix, tensor_names=names, shape_and_slices=[""] * len(names), tensors=tensors)
            del tensors
        if len(parts) > 1:
            tf.raw_ops.MergeV2Checkpoints(checkpoint_prefixes=parts, destination_prefix=dst_prefix,
                                          delete_old_dirs=True)


def _op_list(graph: graph_pb2.GraphDef) -> op_def_pb2.OpList:
    """The registered OpDefs of every op in the graph and its library (the MetaGraph's
    stripped_op_list), by name."""
    from tensorflow.python.framework import op_def_registry

    functions = {f.signature.name for f in graph.library.function}
    ops = {n.op for n in graph.node} | {n.op for f in graph.library.function for n in f.node_def}
    out = op_def_pb2.OpList()
    for op in sorted(ops - functions):
        od = op_def_registry.get(op)
        if od is not None:
            out.op.add().CopyFrom(od)
            for a in out.op[-1].input_arg:
                a.ClearField("description")
            for a in out.op[-1].output_arg:
                a.ClearField("description")
            for a in out.op[-1].attr:
                a.ClearField("description")
            out.op[-1].ClearField("summary")
            out.op[-1].ClearField("description")
    return out


def _metadata(item: GraphItem, proto: saved_model_pb2.SavedModel) -> dict:
    """What the export records in assets.extra/vfgraph.json: how its serving functions were
    made (the source's history and micro-batching), its signatures, and its source."""
    mg = proto.meta_graphs[0]
    keys = sorted(k for k in mg.signature_def if k != INIT_OP_KEY)
    sliced = records.get(item, Microbatch)
    source = savedmodel.source_fingerprint(item.source, keras_file.variables_read(item))
    meta = {"serving_export": {"signatures": keys, "vfgraph_version": __version__, "source_fingerprint": source,
                               "vnode_batch": {k: sliced[k].vnode_batch for k in keys if k in sliced}}}
    if item.metadata.get("history"):
        meta["history"] = item.metadata["history"]
    for k in keys:
        if k in sliced:
            records.put(meta, k, sliced[k])
    return meta
