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
