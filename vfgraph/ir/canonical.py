"""Canonical text form of a model's graphs: stable across runs, readable in a diff.

Functions reachable from the signatures, sorted by name; nodes in topological order (ties
by name); control inputs sorted after data inputs; large tensor contents replaced by dtype,
shape and sha256; debug info and version stamps stripped.

With ``generated_names`` (what ``vfgraph diff`` compares), names that only say when a
function was made are replaced by names made from what it is, so two exports of one model
compare equal: the number tracing appends to a function's name (``__inference_train_123``,
``__backward_f_12_34``, and the same number inside the names vfgraph builds from them,
``__vf_inference_train_123_reduce``) is dropped, and where that leaves several functions of one
name, each gets a digest of its canonical content (its callees already renamed) instead;
``tf.custom_gradient``'s op types (``CustomGradient-247``) are numbered in the order the text
first uses them. Node and argument names are kept as they are.
"""
from __future__ import annotations

import hashlib
import re
from typing import Collection, Dict, Iterable, List, Mapping, Protocol

from google.protobuf import text_format
from tensorflow.core.framework import function_pb2, graph_pb2

from vfgraph.ir.functions import function_dependencies, iter_func_attrs

from vfgraph.ir.graph import FunctionGraph
from vfgraph.ir.names import control_inputs, data_inputs

LARGE_TENSOR_BYTES = 64
_TRACED = re.compile(r"^__(?:inference|forward|backward)_.+?((?:_\d+)+)$")  # tracing's number at the end
_GRADIENT_OP_TYPE = "_gradient_op_type"
_CUSTOM_GRADIENT = re.compile(rb"^CustomGradient-\d+$")


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


class Signature(Protocol):
    """What :func:`canonical_text` reads of a signature: the library function it calls."""

    @property
    def function(self) -> str: ...


class Model(Protocol):
    """What :func:`canonical_text` reads of a model (a :class:`vfgraph.item.GraphItem` is one):
    its functions by name, its signatures by key, and the functions kept for the runtime."""

    @property
    def library(self) -> Dict[str, function_pb2.FunctionDef]: ...

    @property
    def signatures(self) -> Mapping[str, Signature]: ...

    @property
    def preserve(self) -> Collection[str]: ...


def canonical_text(item: Model, roots: Iterable[str] = (), generated_names: bool = False) -> str:
    """Text of every function reachable from the signatures and the functions passes added
    for the runtime (or from ``roots``), canonicalised; ``generated_names``: generated names
    replaced as the module's docstring says."""
    lib = item.library
    roots = list(roots) or [s.function for s in item.signatures.values()] + sorted(item.preserve)
    names: List[str] = []
    for r in roots:
        for f in function_dependencies(r, lib):
            if f not in names:
                names.append(f)
    functions = {name: canonical_function(lib[name], lib) for name in names}
    renamed = _content_names(functions, lib) if generated_names else {}
    parts = []
    for key in sorted(item.signatures):
        s = item.signatures[key]
        parts.append(f"# signature {key}: function {renamed.get(s.function, s.function)}\n")
    library = function_pb2.FunctionDefLibrary()
    for name in sorted(names, key=lambda n: (renamed.get(n, n), n)):
        library.function.add().CopyFrom(functions[name])
    if generated_names:
        _number_gradient_op_types(library)
    parts.append(text_format.MessageToString(library))
    return "".join(parts)


def _stems(library: Iterable[str]) -> Dict[str, str]:
    """Generated function names of ``library`` -> the name without tracing's numbers: in a
    traced function's name, and in a name vfgraph built from one."""
    traced = {n: n[:m.start(1)] for n in library if (m := _TRACED.match(n))}
    out = dict(traced)
    inner = {n.strip("_"): stem.strip("_") for n, stem in traced.items()}
    if inner:
        pattern = re.compile("|".join(re.escape(n) + r"(?!\d)" for n in sorted(inner, key=len, reverse=True)))
        for n in library:
            if n.startswith("__vf_") and n not in out:
                stem = pattern.sub(lambda m: inner[m.group(0)], n)
                if stem != n:
                    out[n] = stem
    return out


def _rename(fdef: function_pb2.FunctionDef, renamed: Dict[str, str]) -> None:
    """Point ``fdef``'s calls (ops, and function-valued attributes) at the new names."""
    for node in fdef.node_def:
        if node.op in renamed:
            node.op = renamed[node.op]
        for fa in iter_func_attrs(node):
            if fa.name in renamed:
                fa.name = renamed[fa.name]


def _callees(fdef: function_pb2.FunctionDef, names) -> List[str]:
    out = []
    for node in fdef.node_def:
        out += [n for n in [node.op] + [fa.name for fa in iter_func_attrs(node)] if n in names and n not in out]
    return sorted(out)


def _content_names(functions: Dict[str, function_pb2.FunctionDef], lib) -> Dict[str, str]:
    """Rename the generated functions of ``functions`` (canonical, edited in place) by content,
    callees before callers; returns old name -> new name for those renamed."""
    stems = {n: s for n, s in _stems(lib).items() if n in functions}
    count: Dict[str, int] = {}
    for n, stem in stems.items():
        count[stem] = count.get(stem, 0) + 1 + (stem in functions)  # a stem that is another function's name
    renamed: Dict[str, str] = {}
    done: set = set()

    def visit(name: str) -> None:
        if name in done:
            return
        done.add(name)
        fdef = functions[name]
        for callee in _callees(fdef, functions):
            visit(callee)
        _rename(fdef, renamed)
        if name not in stems:
            return
        new = stems[name]
        if count[new] > 1:
            new += "_" + _content_digest(fdef)
        renamed[name] = new
        fdef.signature.name = new

    for name in sorted(functions):
        visit(name)
    return renamed


def _content_digest(fdef: function_pb2.FunctionDef) -> str:
    """12 hex digits of sha256 of a canonical function without its name and its custom
    gradients' numbers."""
    body = function_pb2.FunctionDef()
    body.CopyFrom(fdef)
    body.signature.name = ""
    for node in body.node_def:
        if _GRADIENT_OP_TYPE in node.attr and _CUSTOM_GRADIENT.match(node.attr[_GRADIENT_OP_TYPE].s):
            node.attr[_GRADIENT_OP_TYPE].s = b"CustomGradient"
    return hashlib.sha256(body.SerializeToString(deterministic=True)).hexdigest()[:12]


def _number_gradient_op_types(library: function_pb2.FunctionDefLibrary) -> None:
    """``CustomGradient-N`` op types numbered 1, 2, ... in the order the library uses them."""
    numbers: Dict[bytes, int] = {}
    for fdef in library.function:
        for node in fdef.node_def:
            v = node.attr[_GRADIENT_OP_TYPE] if _GRADIENT_OP_TYPE in node.attr else None
            if v is not None and _CUSTOM_GRADIENT.match(v.s):
                v.s = b"CustomGradient-%d" % numbers.setdefault(v.s, len(numbers) + 1)


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
