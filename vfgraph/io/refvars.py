"""Reference variables (TF1's ``VariableV2``) rewritten as resource variables.

TF1 code run with ``tf.compat.v1.disable_v2_behavior()`` (or written before TF 2) builds
reference variables: their tensors alias the variable's buffer and ops such as
``ApplyMomentum`` take them as mutable inputs. Nothing in a function body may hold one, so
before a TF1 graph is turned into functions each ``VariableV2`` becomes a ``VarHandleOp`` of
the same name and every use of it the resource form of the same kernel: ``Assign`` ->
``AssignVariableOp``, ``ApplyMomentum`` -> ``ResourceApplyMomentum``, a read (``w/read``)
-> ``ReadVariableOp`` keeping its name. The values computed are the same, checkpoints keep
their keys (the saver saves by name), and the variable collections are marked as resource
variables so ``import_meta_graph`` rebuilds them. An op that needs a reference this module
cannot map (TF1 control flow over a variable, ``RefSwitch``) is an error naming the node.
"""
from __future__ import annotations

from typing import Dict, List, Tuple

from tensorflow.core.framework import node_def_pb2, variable_pb2

from vfgraph.errors import InputError
from vfgraph.ir.names import control_inputs, is_control, tensor_node
from vfgraph.ir.walk import topological

_VARIABLE = ("VariableV2", "Variable")
_ASSIGN = {"Assign": "AssignVariableOp", "AssignAdd": "AssignAddVariableOp", "AssignSub": "AssignSubVariableOp"}
_SCATTER = {"ScatterAdd": "ResourceScatterAdd", "ScatterSub": "ResourceScatterSub",
            "ScatterUpdate": "ResourceScatterUpdate", "ScatterMul": "ResourceScatterMul",
            "ScatterDiv": "ResourceScatterDiv", "ScatterMin": "ResourceScatterMin", "ScatterMax": "ResourceScatterMax"}


def _resource_op(op: str) -> str:
    """The resource form of a reference-taking op, or '' when there is none."""
    if op in _ASSIGN:
        return _ASSIGN[op]
    if op in _SCATTER:
        return _SCATTER[op]
    if op.startswith(("Apply", "SparseApply")):
        return "Resource" + op
    return ""


def _op_defs():
    from tensorflow.python.framework import op_def_registry

    return op_def_registry.get


def _ref_inputs(node: node_def_pb2.NodeDef, get_op_def) -> List[bool]:
    """For each data input of ``node``: does its op take a reference there?"""
    op_def = get_op_def(node.op)
    if op_def is None:
        return []
    flags: List[bool] = []
    for arg in op_def.input_arg:
        if arg.number_attr:
            n = node.attr[arg.number_attr].i
        elif arg.type_list_attr:
            n = len(node.attr[arg.type_list_attr].list.type)
        else:
            n = 1
        flags.extend([arg.is_ref] * n)
    return flags


def to_resource_variables(mg, where: str) -> int:
    """Rewrite the reference variables of MetaGraphDef ``mg`` in place; returns how many."""
    gd = mg.graph_def
    variables = {n.name for n in gd.node if n.op in _VARIABLE}
    if not variables:
        return 0
    get_op_def = _op_defs()
    nodes = {n.name: n for n in gd.node}
    # ref tensor -> (variable whose buffer it aliases, the write it follows or '')
    aliases: Dict[str, Tuple[str, str]] = {v: (v, "") for v in variables}
    reads: Dict[Tuple[str, str], str] = {}
    new_nodes: List[node_def_pb2.NodeDef] = []
    for name in topological(nodes):
        node = nodes[name]
        if node.op in _VARIABLE:
            _to_handle(node)
            continue
        data = [(i, s) for i, s in enumerate(node.input) if not is_control(s)]
        if not any(_tensor(s) in aliases for _, s in data):
            continue
        if node.op == "Identity":
            _to_read(node, *aliases[_tensor(data[0][1])], nodes)
            continue
        if node.op == "IsVariableInitialized":
            node.op = "VarIsInitializedOp"
            node.input[data[0][0]] = aliases[_tensor(data[0][1])][0]
            node.attr.clear()
            continue
        takes_ref = _ref_inputs(node, get_op_def)
        resource_op = _resource_op(node.op)
        written = ""
        for k, (i, s) in enumerate(data):
            needs_ref = k < len(takes_ref) and takes_ref[k]
            if _tensor(s) not in aliases:
                if needs_ref:
                    raise InputError(f"{where}: node {node.name!r} ({node.op}) takes a reference to {s!r}, which is "
                                     "not a variable; vfgraph cannot convert this graph to resource variables")
                continue
            var, after = aliases[_tensor(s)]
            if not needs_ref:  # a value: read the variable through its handle
                node.input[i] = _read_for(var, after, nodes, reads, new_nodes)
                continue
            if not resource_op:
                raise InputError(f"{where}: node {node.name!r} ({node.op}) takes reference variable {var!r} and "
                                 "has no resource-variable form; export the graph with resource variables "
                                 "(tf.compat.v1.enable_resource_variables())")
            node.input[i] = var
            if after:
                node.input.append("^" + after)
            written = written or var
        if written:
            _to_resource_kernel(node, resource_op)
            # its reference output: consumers now use the variable, after this write
            aliases[node.name] = (written, node.name)
    # tensors named outside the graph (collections such as update_ops, signatures) that were
    # the reference outputs of writes become reads after those writes
    def value_of(t: str) -> str:
        name = _tensor(t)
        if name in aliases and aliases[name][1] == name:
            return _read_for(*aliases[name], nodes, reads, new_nodes) + ":0"
        return t

    for key in sorted(mg.collection_def):
        col = mg.collection_def[key]
        if col.WhichOneof("kind") == "node_list":
            values = [value_of(v) if ":" in v else v for v in col.node_list.value]
            del col.node_list.value[:]
            col.node_list.value.extend(values)
    for key in sorted(mg.signature_def):
        for t in list(mg.signature_def[key].inputs.values()) + list(mg.signature_def[key].outputs.values()):
            if t.name:
                t.name = value_of(t.name)
    gd.node.extend(new_nodes)
    _mark_collections(mg, variables)
    return len(variables)


def _tensor(s: str) -> str:
    return s[:-2] if s.endswith(":0") else s


def _to_handle(node: node_def_pb2.NodeDef) -> None:
    dtype, shape = node.attr["dtype"].type, node.attr["shape"]
    container, shared = node.attr["container"].s, node.attr["shared_name"].s or node.name.encode()
    keep = {k: node.attr[k] for k in ("_class",) if k in node.attr}
    node.op = "VarHandleOp"
    node.attr.clear()
    node.attr["dtype"].type = dtype
    node.attr["shape"].CopyFrom(shape)
    node.attr["container"].s = container
    node.attr["shared_name"].s = shared
    node.attr["allowed_devices"].list.SetInParent()
    for k, v in keep.items():
        node.attr[k].CopyFrom(v)


def _to_read(node: node_def_pb2.NodeDef, var: str, after: str, nodes) -> None:
    """Identity of a reference -> ReadVariableOp of the same name (after ``after``)."""
    controls = control_inputs(node) + ([f"^{after}"] if after else [])
    node.op = "ReadVariableOp"
    del node.input[:]
    node.input.extend([var] + controls)
    dtype = nodes[var].attr["dtype"].type
    shapes = node.attr["_output_shapes"] if "_output_shapes" in node.attr else None
    node.attr.clear()
    node.attr["dtype"].type = dtype
    if shapes is not None:
        node.attr["_output_shapes"].CopyFrom(shapes)


def _read_for(var, after, nodes, reads, new_nodes) -> str:
    """A ReadVariableOp of ``var`` (after the write ``after`` when given), shared by its users."""
    key = (var, after)
    if key in reads:
        return reads[key]
    name = (after or var) + "/vf_read"
    while name in nodes:
        name += "_"
    read = node_def_pb2.NodeDef(name=name, op="ReadVariableOp", input=[var] + ([f"^{after}"] if after else []))
    read.attr["dtype"].type = nodes[var].attr["dtype"].type
    nodes[name] = read
    new_nodes.append(read)
    reads[key] = name
    return name


def _to_resource_kernel(node: node_def_pb2.NodeDef, op: str) -> None:
    """Apply*/Assign*/Scatter* -> the resource kernel: the same inputs, attrs renamed."""
    t = node.attr["T"].type
    node.op = op
    if op.endswith("VariableOp") or op.startswith("ResourceScatter"):
        keep_index = node.attr["Tindices"].type if "Tindices" in node.attr else None
        for k in ("T", "use_locking", "validate_shape"):
            if k in node.attr:
                del node.attr[k]
        node.attr["dtype"].type = t
        if keep_index is not None:
            node.attr["Tindices"].type = keep_index
    if "_output_shapes" in node.attr:
        del node.attr["_output_shapes"]


def _mark_collections(mg, variables) -> None:
    """VariableDefs of converted variables say ``is_resource`` so import_meta_graph agrees."""
    for key in sorted(mg.collection_def):
        col = mg.collection_def[key]
        if col.WhichOneof("kind") != "bytes_list":
            continue
        values = list(col.bytes_list.value)
        changed = False
        for i, raw in enumerate(values):
            vd = variable_pb2.VariableDef()
            try:
                vd.ParseFromString(raw)
            except Exception:  # not a VariableDef collection
                break
            if tensor_node(vd.variable_name) in variables and not vd.is_resource:
                vd.is_resource = True
                values[i] = vd.SerializeToString(deterministic=True)
                changed = True
        if changed:
            del col.bytes_list.value[:]
            col.bytes_list.value.extend(values)
