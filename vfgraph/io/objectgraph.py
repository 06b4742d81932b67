"""What TensorFlow's SavedModel loader reads beyond the signatures: the object graph's
concrete functions, the objects their calls are bound to, and the tensors it captures from
function graphs (``tf.custom_gradient`` keeps the forward tensors its gradient function
needs as captured tensors of the forward function: Keras' SiLU and swish, among others)."""
from __future__ import annotations

from typing import Dict, List, Mapping, Set

from tensorflow.core.framework import function_pb2

from vfgraph.ir.names import function_name, is_tensor_name, tensor_node


def _node_names(fdef: function_pb2.FunctionDef) -> Set[str]:
    return {n.name for n in fdef.node_def}


def relink_captured_tensors(object_graph, library: Mapping[str, function_pb2.FunctionDef]) -> int:
    """Point each captured tensor whose node left the function it names at the function that
    now holds the node. Passes move a function's nodes into functions named after it
    (split-vnodes: the virtual-node and update functions; microbatch-inference: its loop
    body), so the candidates are the functions whose names derive from the original one,
    in sorted order. Returns how many were moved."""
    names: Dict[str, Set[str]] = {}

    def holds(fn: str, node: str) -> bool:
        if fn not in names:
            names[fn] = _node_names(library[fn])
        return node in names[fn]

    derived: Dict[str, List[str]] = {}
    moved = 0
    for obj in object_graph.nodes:
        if obj.WhichOneof("kind") != "captured_tensor":
            continue
        ct = obj.captured_tensor
        node = tensor_node(ct.name)
        if ct.concrete_function in library and holds(ct.concrete_function, node):
            continue
        if ct.concrete_function not in derived:
            prefix = function_name(ct.concrete_function) + "_"
            derived[ct.concrete_function] = sorted(f for f in library if f.startswith(prefix))
        for fn in derived[ct.concrete_function]:
            if holds(fn, node):
                ct.concrete_function = fn
                moved += 1
                break
    return moved


def object_graph_functions(object_graph) -> Set[str]:
    """Every library function the object graph names (concrete functions, functions' and bare
    concrete functions' entries, captured tensors' functions)."""
    out = set(object_graph.concrete_functions)
    for obj in object_graph.nodes:
        kind = obj.WhichOneof("kind")
        if kind == "function":
            out.update(obj.function.concrete_functions)
        elif kind == "bare_concrete_function":
            out.add(obj.bare_concrete_function.concrete_function_name)
        elif kind == "captured_tensor":
            out.add(obj.captured_tensor.concrete_function)
    return out


def loader_problems(object_graph, library: Mapping[str, function_pb2.FunctionDef]) -> List[str]:
    """What would make ``tf.saved_model.load`` fail on this object graph: a function it names
    that the library lacks, a bound input that is no object, a captured tensor whose node or
    output is not in its function."""
    problems: List[str] = []
    n_objects = len(object_graph.nodes)
    names: Dict[str, Set[str]] = {}
    for name in sorted(object_graph_functions(object_graph)):
        if name not in library:
            problems.append(f"the object graph names function {name!r}, which is not in the library")
    for name, cf in sorted(object_graph.concrete_functions.items()):
        bad = [b for b in cf.bound_inputs if not 0 <= b < n_objects]
        if bad:
            problems.append(f"concrete function {name!r} is bound to objects {bad} that do not exist")
    for i, obj in enumerate(object_graph.nodes):
        if obj.WhichOneof("kind") != "captured_tensor":
            continue
        ct = obj.captured_tensor
        fdef = library.get(ct.concrete_function)
        if fdef is None:
            continue  # reported above
        if ct.concrete_function not in names:
            names[ct.concrete_function] = _node_names(fdef)
        if not is_tensor_name(ct.name, indexed=True) or tensor_node(ct.name) not in names[ct.concrete_function]:
            problems.append(f"object {i} captures tensor {ct.name!r} of function {ct.concrete_function!r}, "
                            "which has no such node")
    return problems
