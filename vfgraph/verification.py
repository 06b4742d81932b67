"""What TensorFlow's loader will read of a model, checked without loading it."""
from __future__ import annotations

from vfgraph.errors import VerifyError
from vfgraph.io import objectgraph
from vfgraph.ir.functions import function_dependencies
from vfgraph.ir.graph import verify_function_def
from vfgraph.item import GraphItem


def verify(item: GraphItem, relinked: bool = False) -> None:
    """Check what TensorFlow's loader reads: every library function reachable from a signature
    or from the object graph (concrete functions, the objects they are bound to, captured
    tensors), and each function those call. ``relinked``: check the object graph as
    :func:`vfgraph.io.objectgraph.relink_captured_tensors` will leave it (a pass's result,
    before the pipeline's end relinks it), without changing the item."""
    lib = item.library
    og = item.meta_graph.object_graph_def
    if relinked:
        og = type(og).FromString(og.SerializeToString())
        objectgraph.relink_captured_tensors(og, lib)
    problems = objectgraph.loader_problems(og, lib)
    if problems:
        raise VerifyError(f"{item.source}: {problems[0]}" + (f" (and {len(problems) - 1} more)" if problems[1:] else ""))
    roots = {sig.function for sig in item.signatures.values()} | item.preserve | objectgraph.object_graph_functions(og)
    missing = sorted(r for r in roots if r not in lib)
    if missing:
        raise VerifyError(f"{item.source}: function {missing[0]!r} is used but not in the library")
    seen = set()
    for root in sorted(roots):
        for name in function_dependencies(root, lib):
            if name not in seen:
                seen.add(name)
                verify_function_def(lib[name], lib)
                _check_attr_values(lib[name], item.source)


def _allowed(op: str):
    """(attr, allowed values) of registered op ``op``'s attributes that restrict their values
    (a type among a list), as TensorFlow checks a node's when it loads a function."""
    if op not in _ALLOWED:
        from tensorflow.python.framework import op_def_registry

        op_def = op_def_registry.get(op)
        _ALLOWED[op] = () if op_def is None else tuple(
            (a.name, frozenset(a.allowed_values.list.type)) for a in op_def.attr
            if a.type in ("type", "list(type)") and a.HasField("allowed_values") and a.allowed_values.list.type)
    return _ALLOWED[op]


_ALLOWED: dict = {}


def _check_attr_values(fdef, source: str) -> None:
    """VerifyError for a node whose type attribute holds a type its op does not take (a
    variant where only numbers go): TensorFlow's loader refuses the whole model for it."""
    from tensorflow.python.framework import dtypes

    for node in fdef.node_def:
        for name, allowed in _allowed(node.op):
            if name not in node.attr:
                continue
            value = node.attr[name]
            for t in (value.list.type if value.WhichOneof("value") == "list" else [value.type]):
                if t not in allowed:
                    raise VerifyError(f"{source}: node {node.name!r} of function {fdef.signature.name!r}: {node.op} "
                                      f"takes no {dtypes.as_dtype(t).name} (attr {name!r})")
