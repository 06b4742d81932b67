"""Canonical text form of a model's graphs: stable across runs, readable in a diff.

Functions reachable from the signatures, sorted by name; nodes in topological order (ties
by name); control inputs sorted after data inputs; large tensor contents replaced by dtype,
shape and sha256; debug info and version stamps stripped.
"""
from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING, Dict, Iterable, List

from google.protobuf import text_format
from tensorflow.core.framework import function_pb2, graph_pb2

from vfgraph.ir.functions import function_dependencies

from vfgraph.ir.graph import FunctionGraph
from vfgraph.ir.names import control_inputs, data_inputs

if TYPE_CHECKING:
    from vfgraph.item import GraphItem

LARGE_TENSOR_BYTES = 64


def _strip_tensors(node) -> None:
    for key in node.attr:
        v = node.attr[key]
        if v.HasField("tensor") and len(v.tensor.tensor_content) >= LARGE_TENSOR_BYTES:
            digest = hashlib.sha256(v.tensor.tensor_content).hexdigest()
            v.tensor.ClearField("tensor_content")
            v.tensor.string_val.append(f"sha256:{digest}".encode())


def canonical_function(fdef: function_pb2.FunctionDef, library: Dict[str, function_pb2.FunctionDef]) -> function_pb2.FunctionDef:
    g = FunctionGraph(fdef, library)
    out = function_pb2.FunctionDef()
    out.CopyFrom(fdef)
    del out.node_def[:]
    for name in g.topological_order():
        node = out.node_def.add()
        node.CopyFrom(g.nodes[name])
        data, ctl = data_inputs(node), sorted(control_inputs(node))
        del node.input[:]
        node.input.extend(data + ctl)
        node.ClearField("experimental_debug_info")
        _strip_tensors(node)
    return out


def canonical_text(item: GraphItem, roots: Iterable[str] = ()) -> str:
    """Text of every function reachable from the signatures and the functions passes added
    for the runtime (or from ``roots``), canonicalised."""
    lib = item.library
    roots = list(roots) or [s.function for s in item.signatures.values()] + sorted(item.preserve)
    names: List[str] = []
    for r in roots:
        for f in function_dependencies(r, lib):
            if f not in names:
                names.append(f)
    parts = []
    for key in sorted(item.signatures):
        s = item.signatures[key]
        parts.append(f"# signature {key}: function {s.function}\n")
    library = function_pb2.FunctionDefLibrary()
    for name in sorted(names):
        library.function.add().CopyFrom(canonical_function(lib[name], lib))
    parts.append(text_format.MessageToString(library))
    return "".join(parts)


def canonical_graph_def(gd: graph_pb2.GraphDef) -> str:
    out = graph_pb2.GraphDef()
    out.CopyFrom(gd)
    out.ClearField("versions")
    for n in out.node:
        _strip_tensors(n)
    nodes = sorted(out.node, key=lambda n: n.name)
    del out.node[:]
    out.node.extend(nodes)
    lib = {f.signature.name: f for f in out.library.function}
    funcs = [canonical_function(lib[k], lib) for k in sorted(lib)]
    out.library.ClearField("function")
    out.library.function.extend(funcs)
    return text_format.MessageToString(out)
