"""Read and write TF2 SavedModels without touching the input, writing atomically."""
from __future__ import annotations

import hashlib
import json
import os
import shutil
from typing import Dict, List, Optional, Set, Tuple

from google.protobuf.message import DecodeError
from tensorflow.core.framework import types_pb2
from tensorflow.core.protobuf import saved_model_pb2

from vfgraph import records
from vfgraph.errors import InputError
from vfgraph.io import outputs, tf1
from vfgraph.io.checkpoint import checkpoint_files, extend_checkpoint
from vfgraph.io.files import read_bytes
from vfgraph.ir.functions import CALL_OPS
from vfgraph.ir.names import data_inputs, tensor_node
from vfgraph.item import GraphItem, SignatureInfo, TensorSpecInfo, VariableInfo
from vfgraph.records import Allreduce, VirtualNodes

SAVED_MODEL_PB = "saved_model.pb"
_PASSTHROUGH = ("Identity", "NoOp")


def is_saved_model_dir(path: str) -> bool:
    return os.path.isdir(path) and os.path.isfile(os.path.join(path, SAVED_MODEL_PB))


def is_saved_model_text(path: str) -> bool:
    """Whether ``path`` is a ``.pbtxt`` file holding a SavedModel (not a GraphDef): its first
    4 KiB name a SavedModel's fields."""
    if not (path.endswith(".pbtxt") and os.path.isfile(path)):
        return False
    try:
        with open(path, "rb") as f:
            head = f.read(4096)
    except OSError:
        return False
    return b"meta_graphs" in head or b"saved_model_schema_version" in head


def read_saved_model_proto(path: str) -> saved_model_pb2.SavedModel:
    pb = os.path.join(path, SAVED_MODEL_PB)
    data = read_bytes(pb)
    sm = saved_model_pb2.SavedModel()
    try:
        sm.ParseFromString(data)
    except (DecodeError, RuntimeError, ValueError) as e:
        raise InputError(f"{pb}: not a valid SavedModel protobuf ({e}); re-export the model") from None
    if not sm.meta_graphs:
        raise InputError(f"{pb}: SavedModel holds no MetaGraph; re-export the model")
    return sm


def load_saved_model(path: str) -> GraphItem:
    """Load a SavedModel directory into a :class:`GraphItem` (the input is only read)."""
    path = os.path.abspath(path)
    sm = read_saved_model_proto(path)
    mg = sm.meta_graphs[0]
    var_dir = os.path.join(path, "variables")
    if not os.path.isfile(os.path.join(var_dir, "variables.index")):
        if _has_variables(mg) or (tf1.is_tf1(sm) and mg.HasField("saver_def")):
            raise InputError(f"{var_dir}: variables are missing (no variables.index); copy the whole SavedModel directory")
    try:
        metadata = records.read_metadata(path) or {}
    except (ValueError, OSError) as e:
        raise InputError(f"{os.path.join(path, records.METADATA_FILE)}: unreadable ({e})") from None
    try:
        item = item_from_proto(sm, path, added_signatures(metadata))
    except (KeyError, IndexError, ValueError, TypeError, AttributeError) as e:
        raise InputError(f"{os.path.join(path, SAVED_MODEL_PB)}: inconsistent SavedModel ({type(e).__name__}: {e}); "
                         "re-export the model") from None
    item.metadata = metadata
    return item


def added_signatures(metadata: dict) -> Set[str]:
    """Keys of the signatures vfgraph added to a model it rewrote (step-wise pairs,
    broadcasts): runtime entry points, not the model's own signatures, so passes leave them
    alone."""
    keys = set()
    for key, rec in records.get(metadata, VirtualNodes).items():
        if rec.accumulate_signature:
            keys |= {rec.accumulate_signature, rec.apply_signature}
    for rec in records.get(metadata, Allreduce).values():
        if rec.broadcast_signature:
            keys.add(rec.broadcast_signature)
    return keys


def load_saved_model_text(path: str) -> GraphItem:
    """A SavedModel protobuf in text form (graph only, no variables): golden-test inputs."""
    from google.protobuf import text_format

    sm = saved_model_pb2.SavedModel()
    try:
        with open(path) as f:
            text_format.Parse(f.read(), sm)
    except (text_format.ParseError, UnicodeDecodeError) as e:
        raise InputError(f"{path}: not a SavedModel in protobuf text form ({e})") from None
    if not sm.meta_graphs:
        raise InputError(f"{path}: SavedModel holds no MetaGraph")
    return item_from_proto(sm, os.path.abspath(path))


def item_from_proto(sm: saved_model_pb2.SavedModel, path: str, skip: Set[str] = frozenset()) -> GraphItem:
    """Build the item for a parsed SavedModel; ``path`` names it in messages; signatures in
    ``skip`` are left out."""
    mg = sm.meta_graphs[0]
    graph_nodes = {n.name: n for n in mg.graph_def.node}
    library = {f.signature.name: f for f in mg.graph_def.library.function}
    signatures: Dict[str, SignatureInfo] = {}
    handles: Dict[str, Tuple[int, Optional[List[int]]]] = {}  # variable handle node -> (dtype, shape), read once
    for key in sorted(mg.signature_def):
        if key.startswith("__") or key in skip:
            continue
        info = _signature_info(path, key, mg.signature_def[key], graph_nodes, library, handles)
        if info is not None:
            signatures[key] = info
    if not signatures and tf1.is_tf1(sm):
        return tf1.convert(sm, path, skip)
    return GraphItem(source=path, kind="saved_model", saved_model=sm, signatures=signatures)


def _has_variables(mg) -> bool:
    return any(n.WhichOneof("kind") == "variable" for n in mg.object_graph_def.nodes)


def _signature_info(path, key, sig, graph_nodes, library, handles) -> Optional[SignatureInfo]:
    """Follow signature tensors to the call node and down through thin wrappers."""
    out_nodes = {tensor_node(t.name) for t in sig.outputs.values()}
    calls = [graph_nodes[n] for n in sorted(out_nodes) if n in graph_nodes and graph_nodes[n].op in CALL_OPS]
    if len(calls) != 1:
        return None  # not a function-backed signature (TF1 graphs are handled elsewhere)
    call = calls[0]
    fname = call.attr["f"].func.name
    if fname not in library:
        raise InputError(f"{path}: signature {key!r} calls missing function {fname!r}; the SavedModel is incomplete")
    # Graph-level inputs of the call: placeholders (signature inputs) and variable handles.
    placeholder_key = {tensor_node(t.name): k for k, t in sig.inputs.items()}
    arg_source = [tensor_node(s) for s in data_inputs(call)]
    fdef = library[fname]
    arg_names = [a.name for a in fdef.signature.input_arg]
    source_of = dict(zip(arg_names, arg_source))
    # Descend through wrappers that only forward their arguments to one call.
    while True:
        inner = _single_call(fdef, library)
        if inner is None:
            break
        node, inner_fdef = inner
        inner_args = [a.name for a in inner_fdef.signature.input_arg]
        forwarded = [tensor_node(s) for s in data_inputs(node)]
        source_of = {ia: source_of.get(fa, fa) for ia, fa in zip(inner_args, forwarded)}
        fdef = inner_fdef
    batch_args, resource_args, captured_args, input_keys, variables = [], [], [], {}, {}
    for a in fdef.signature.input_arg:
        src = source_of.get(a.name)
        if a.type == types_pb2.DT_RESOURCE:
            resource_args.append(a.name)
            found = handles.get(src)
            if found is None:
                handle = graph_nodes.get(src)
                attrs = handle.attr if handle is not None else {}
                found = handles[src] = (attrs["dtype"].type if "dtype" in attrs else 0,
                                        [d.size for d in attrs["shape"].shape.dim] if "shape" in attrs else None)
            dtype, shape = found
            variables[a.name] = VariableInfo(name=src or a.name, dtype=dtype, shape=None if shape is None else list(shape))
        elif src in placeholder_key or not placeholder_key:
            batch_args.append(a.name)
            input_keys[a.name] = placeholder_key.get(src, a.name)
        else:  # fed by a graph node that is no input of the signature: a captured value
            captured_args.append(a.name)
    inputs = [TensorSpecInfo(k, t.dtype, None if t.tensor_shape.unknown_rank else [d.size for d in t.tensor_shape.dim])
              for k, t in sorted(sig.inputs.items())]
    outputs = [TensorSpecInfo(k, t.dtype, None if t.tensor_shape.unknown_rank else [d.size for d in t.tensor_shape.dim])
               for k, t in sorted(sig.outputs.items())]
    return SignatureInfo(key=key, function=fdef.signature.name, batch_args=batch_args, input_keys=input_keys,
                         resource_args=resource_args, variables=variables, inputs=inputs, outputs=outputs,
                         captured_args=captured_args)


def _single_call(fdef, library):
    """If ``fdef`` only forwards all its arguments to one library call, return (node, callee)."""
    calls = []
    for n in fdef.node_def:  # stops at the first node that does more than forward (a model's body)
        if n.op in CALL_OPS:
            calls.append(n)
        elif n.op not in _PASSTHROUGH:
            return None
    if len(calls) != 1:
        return None
    node = calls[0]
    callee = library.get(node.attr["f"].func.name)
    if callee is None:
        return None
    forwarded = data_inputs(node)
    args = {a.name for a in fdef.signature.input_arg}
    if not all(s in args for s in forwarded):
        return None
    return node, callee


def load_to_run(path: str, tags=None, variable_devices: bool = False, without_values: bool = False):
    """``tf.saved_model.load`` for running a model (training, comparing): a model TensorFlow
    cannot load (a truncated checkpoint, an op this TensorFlow lacks) is one line naming it.
    ``variable_devices``: create each variable on the device the model saved for it (a model
    partitioned into pipeline stages). ``without_values``: read no variable, leaving each
    uninitialized (no memory) until :func:`restore_signature_variables` gives it its value."""
    import tensorflow as tf

    policy = tf.saved_model.experimental.VariablePolicy
    options = tf.saved_model.LoadOptions(
        experimental_variable_policy=policy.SAVE_VARIABLE_DEVICES if variable_devices else policy.NONE,
        experimental_skip_checkpoint=without_values)
    try:
        return tf.saved_model.load(path, tags=tags, options=options)
    except (tf.errors.OpError, IndexError, ValueError, KeyError) as e:
        first = (str(getattr(e, "message", "") or e).strip().splitlines() or [type(e).__name__])[0][:300]
        raise InputError(f"{path}: TensorFlow cannot load this SavedModel ({first}); if its files were copied, copy "
                         "the whole directory again") from None


def restore_signature_variables(path: str, fn, key: str, names=None) -> list:
    """Give the variables signature ``key`` (the loaded function ``fn``) captures, or those of
    them named in ``names``, their values in the checkpoint of the SavedModel at ``path``,
    reading only those tensors: a process that runs one signature holds only its variables.
    Returns the variables restored."""
    import tensorflow as tf
    from tensorflow.core.protobuf import trackable_object_graph_pb2

    og = read_saved_model_proto(path).meta_graphs[0].object_graph_def
    nodes = {}
    for child in og.nodes[0].children:
        if child.local_name == "signatures":
            nodes = {c.local_name: c.node_id for c in og.nodes[child.node_id].children}
    if key not in nodes:
        raise InputError(f"{path}: no signature {key!r} in its object graph")
    node = og.nodes[nodes[key]]
    name = (node.bare_concrete_function.concrete_function_name if node.HasField("bare_concrete_function")
            else node.function.concrete_functions[0] if node.function.concrete_functions else "")
    bound = list(og.concrete_functions[name].bound_inputs) if name in og.concrete_functions else []
    captured = list(fn.captured_inputs)
    if len(bound) != len(captured):
        raise InputError(f"{path}: signature {key!r} captures {len(captured)} tensors, its object graph binds "
                         f"{len(bound)}; re-export the model")
    prefix = os.path.join(path, "variables", "variables")
    try:
        reader = tf.train.load_checkpoint(prefix)
        graph = trackable_object_graph_pb2.TrackableObjectGraph()
        graph.ParseFromString(reader.get_tensor("_CHECKPOINTABLE_OBJECT_GRAPH"))
    except (tf.errors.OpError, ValueError) as e:
        raise InputError(f"{prefix}: not a readable checkpoint ({str(e).splitlines()[0]}); if the model's files "
                         "were copied, copy the whole directory again") from None
    by_handle = {id(v.handle): v for v in fn.variables}
    restored, keys = [], []
    for node_id, handle in zip(bound, captured):
        v = by_handle.get(id(handle))
        if v is None or og.nodes[node_id].WhichOneof("kind") != "variable":
            continue  # a captured constant, restored with the function
        if names is not None and v.name.rsplit(":", 1)[0] not in names:
            continue
        key = [a.checkpoint_key for a in graph.nodes[node_id].attributes if a.name == "VARIABLE_VALUE"]
        if not key:
            raise InputError(f"{prefix}: holds no value for variable {v.name!r}; re-export the model")
        restored.append(v)
        keys.append(key[0])

    @tf.function(autograph=False)
    def read():  # each value read into its variable's buffer, not copied through Python
        for v, key in zip(restored, keys):
            v.assign(tf.raw_ops.RestoreV2(prefix=prefix, tensor_names=[key], shape_and_slices=[""],
                                          dtypes=[v.dtype])[0])

    if restored:
        read()
    return restored


def source_fingerprint(path: str, variables_prefix: str = "") -> str:
    """sha256 over the SavedModel protobuf and the variables of ``path`` (or over a file and
    the checkpoint at ``variables_prefix``). A checkpoint's data shards count by name and
    size: their content is covered by the index, which holds every tensor's CRC32C, so the
    fingerprint does not read gigabytes of weights."""
    h = hashlib.sha256()
    if os.path.isfile(path):
        files = [("", path)] + [(os.path.basename(f), f) for f in (checkpoint_files(variables_prefix)
                                                                  if variables_prefix else [])]
    else:
        var_dir = os.path.join(path, "variables")
        files = [(rel, os.path.join(path, rel)) for rel in [SAVED_MODEL_PB] + sorted(
            os.path.join("variables", f) for f in (os.listdir(var_dir) if os.path.isdir(var_dir) else []))]
    for rel, full in files:
        h.update(rel.encode())
        if ".data-" in os.path.basename(full):
            h.update(str(os.path.getsize(full)).encode())
            continue
        with open(full, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
    return h.hexdigest()


def save_saved_model(item: GraphItem, out: str, force: bool = False) -> str:
    """Write ``item`` as a SavedModel at ``out`` atomically (temp dir, then rename)."""
    inputs = input_paths(item)
    out = outputs.check_output(out, inputs, force, need_bytes=outputs.tree_bytes(*inputs))
    tmp = outputs.temp_dir(os.path.dirname(out), ".vfgraph-")
    with outputs.writing(out, tmp):
        proto = without_unsaved_gradient_types(tf1.emit(item) if item.kind == "tf1_saved_model" else item.saved_model)
        prefix = os.path.join("variables", "variables")
        extended = False  # the checkpoint written again with the object graph's new variables
        built = item.kind == "saved_model" and bool(item.variables_prefix)  # from a .keras file (io.keras_file)
        src_prefix = checkpoint_prefix(item)
        src_prefix = src_prefix if os.path.isfile(src_prefix + ".index") else ""
        if src_prefix:
            extended = extend_checkpoint(src_prefix, os.path.join(tmp, prefix), proto.meta_graphs[0].object_graph_def)
        for sub in ("variables", "assets"):
            src = os.path.join(item.source, sub)
            if os.path.isdir(src) and not (sub == "variables" and (extended or built)):
                shutil.copytree(src, os.path.join(tmp, sub))
        if item.variables_prefix and not extended:  # a TF1 checkpoint becomes the SavedModel's variables
            os.makedirs(os.path.join(tmp, "variables"), exist_ok=True)
            for f in checkpoint_files(item.variables_prefix):
                suffix = f[len(item.variables_prefix):]
                shutil.copyfile(f, os.path.join(tmp, "variables", "variables" + suffix))
        extra = os.path.join(item.source, "assets.extra")
        if os.path.isdir(extra):
            shutil.copytree(extra, os.path.join(tmp, "assets.extra"))
        with open(os.path.join(tmp, SAVED_MODEL_PB), "wb") as f:
            f.write(proto.SerializeToString(deterministic=True))
        if item.metadata:
            os.makedirs(os.path.join(tmp, "assets.extra"), exist_ok=True)
            with open(os.path.join(tmp, records.METADATA_FILE), "w") as f:
                json.dump(item.metadata, f, indent=2, sort_keys=True)
                f.write("\n")
        _write_fingerprint(tmp, proto)
        outputs.publish(tmp, out)
    return out


def without_unsaved_gradient_types(proto: saved_model_pb2.SavedModel) -> saved_model_pb2.SavedModel:
    """``proto``, or a copy whose custom gradients' own functions name no custom gradient the
    SavedModel does not hold. TensorFlow saves the gradient function of each custom gradient a
    signature uses, but not the custom gradients inside those functions (gradients of gradients,
    which no signature computes); their ops keep the type of a gradient never saved, and every
    load of the model warns "Importing a function ... with ops with unsaved custom gradients".
    Without the type, such an op has its own gradient; with it, a gradient of it could not be
    taken at all."""
    drop = set()  # (function, node)
    for mg in proto.meta_graphs:
        lib = mg.graph_def.library
        saved = {g.registered_op_type.encode() for g in lib.registered_gradients}
        by_name = {f.signature.name: f for f in lib.function}
        todo = [g.gradient_func for g in lib.registered_gradients if g.gradient_func in by_name]
        seen = set(todo)
        while todo:  # the gradient functions and every function they call
            fdef = by_name[todo.pop()]
            for node in fdef.node_def:
                called = [node.op] + [a.func.name for a in node.attr.values() if a.WhichOneof("value") == "func"]
                called += [fn.name for a in node.attr.values() if a.WhichOneof("value") == "list" for fn in a.list.func]
                for name in called:
                    if name in by_name and name not in seen:
                        seen.add(name)
                        todo.append(name)
                kind = node.attr["_gradient_op_type"].s if "_gradient_op_type" in node.attr else b""
                if kind and node.op not in CALL_OPS and kind not in saved:
                    drop.add((fdef.signature.name, node.name))
    if not drop:
        return proto
    out = saved_model_pb2.SavedModel()
    out.CopyFrom(proto)
    for mg in out.meta_graphs:
        for fdef in mg.graph_def.library.function:
            for node in fdef.node_def:
                if (fdef.signature.name, node.name) in drop:
                    del node.attr["_gradient_op_type"]
    return out


def checkpoint_prefix(item: GraphItem) -> str:
    """The checkpoint prefix of a SavedModel item's variables: beside its protobuf, or for a
    model built from another file (:mod:`vfgraph.io.keras_file`) its ``variables_prefix``."""
    if item.kind == "saved_model" and item.variables_prefix:
        return item.variables_prefix
    return os.path.join(item.source, "variables", "variables")


def input_paths(item: GraphItem) -> List[str]:
    """The files and directories ``item`` was read from (the model, a TF1 checkpoint's files)."""
    paths = [item.source]
    if item.variables_prefix:
        paths += checkpoint_files(item.variables_prefix)
    return paths


def _write_fingerprint(path: str, proto: saved_model_pb2.SavedModel) -> None:
    """TensorFlow's fingerprint.pb for the SavedModel written at ``path`` (``proto``), with a
    uuid derived from the content (deterministic)."""
    from tensorflow.core.protobuf import fingerprint_pb2
    from tensorflow.python.saved_model.pywrap_saved_model import fingerprinting

    fp = fingerprint_pb2.FingerprintDef()
    fp.ParseFromString(fingerprinting.CreateFingerprintDef(path))
    # TensorFlow's object-graph hash varies between runs once functions share a canonical name
    # (accumulate_0 / apply_0); a hash of the serialized object graph is stable.
    og = proto.meta_graphs[0].object_graph_def.SerializeToString(deterministic=True)
    fp.saved_object_graph_hash = int(hashlib.sha256(og).hexdigest()[:16], 16)
    fp.ClearField("uuid")
    fp.uuid = str(int(hashlib.sha256(fp.SerializeToString(deterministic=True)).hexdigest()[:30], 16))
    with open(os.path.join(path, "fingerprint.pb"), "wb") as f:
        f.write(fp.SerializeToString(deterministic=True))

