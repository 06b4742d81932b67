"""Builds new library functions: extracted pieces of a function, and loops traced with TensorFlow.

TensorFlow itself is the builder for control flow (``tf.while_loop`` gives a functional
``While`` with correct shapes and attributes); what it produces is renamed into
deterministic names and handed back as plain FunctionDefs for the pass to install.
"""
from __future__ import annotations

import re
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from tensorflow.core.framework import function_pb2, types_pb2
from tensorflow.python.framework import op_def_registry

from vfgraph.ir.graph import FunctionGraph, TensorRef, arg_shape, parse_input, verify_function_def


def _stateful(g: FunctionGraph, name: str) -> bool:
    op = g.nodes[name].op
    if op in g.library:
        return g.library[op].signature.is_stateful
    od = op_def_registry.get(op)
    return bool(od and od.is_stateful)


def extract_function(
    g: FunctionGraph,
    name: str,
    outputs: Sequence[Tuple[str, TensorRef]],
    new_args: Sequence[Tuple[str, TensorRef]] = (),
    keep_args: Optional[Sequence[str]] = None,
    drop: frozenset = frozenset(),
    side_effects: bool = False,
) -> function_pb2.FunctionDef:
    """A new function computing ``outputs`` from a copy of ``g``.

    ``new_args`` turns internal tensors into arguments (everything upstream of them that is
    no longer needed disappears); ``keep_args`` are the original arguments kept, in order;
    nodes in ``drop`` are never kept. With ``side_effects``, stateful nodes (variable
    writes) are kept as control outputs; otherwise only data ancestors of the outputs stay.
    """
    work = FunctionGraph._adopt(g.to_function_def(), g.library)  # edits stay in the copy
    work.replace_uses({ref: TensorRef(arg_name) for arg_name, ref in new_args})
    roots = [r.node for _, r in outputs if not r.is_function_arg]
    effects: List[str] = []
    if side_effects:
        effects = [n for n in work.nodes if n not in drop and _stateful(work, n)]
        roots += effects

    def follow(n: str):
        if n in drop:
            return []
        return [t.node for t, ctl in work.inputs(n) if side_effects or not ctl]

    keep = {n for n in work.ancestors(roots, follow) if n not in drop}
    if side_effects:
        effects = [n for n in effects if n in keep]
    work.keep_only(keep)
    fdef = work.to_function_def()
    sig = fdef.signature
    sig.name = name
    old_args = {a.name: (i, a) for i, a in enumerate(sig.input_arg)}
    arg_attr = dict(fdef.arg_attr)
    kept = list(keep_args) if keep_args is not None else [a.name for a in sig.input_arg]
    del sig.input_arg[:]
    fdef.ClearField("arg_attr")
    for arg_name, ref in new_args:
        a = sig.input_arg.add()
        a.name = arg_name
        a.type = g.dtype(ref)
        shape = g.shape(ref)
        if shape is not None:
            attr = fdef.arg_attr[len(sig.input_arg) - 1].attr["_output_shapes"].list.shape.add()
            for d in shape:
                attr.dim.add().size = d
    for arg_name in kept:
        i, a = old_args[arg_name]
        sig.input_arg.add().CopyFrom(a)
        if i in arg_attr:
            fdef.arg_attr[len(sig.input_arg) - 1].CopyFrom(arg_attr[i])
    del sig.output_arg[:]
    fdef.ClearField("ret")
    for out_name, ref in outputs:
        a = sig.output_arg.add()
        a.name = out_name
        a.type = g.dtype(ref)
        fdef.ret[out_name] = str(ref)
    del sig.control_output[:]
    fdef.ClearField("control_ret")
    for n in sorted(effects):
        sig.control_output.append(n)
        fdef.control_ret[n] = n
    sig.is_stateful = True
    if "_input_shapes" in fdef.attr:
        del fdef.attr["_input_shapes"]
    verify_function_def(fdef, g.library)
    return fdef


# --------------------------------------------------------------------------- tracing
def tf_dtype(enum: int):
    import tensorflow as tf

    return tf.dtypes.as_dtype(enum)


def arg_specs(fdef: function_pb2.FunctionDef) -> list:
    """TensorSpecs for ``fdef``'s arguments (resource args as scalar resource specs)."""
    import tensorflow as tf

    specs = []
    for a in fdef.signature.input_arg:
        if a.type == types_pb2.DT_RESOURCE:
            specs.append(tf.TensorSpec([], tf.resource))
            continue
        shape = arg_shape(fdef, a.name)
        dims = None if shape is None else [None if d < 0 else d for d in shape]
        specs.append(tf.TensorSpec(dims, tf_dtype(a.type)))
    return specs


def trace_replacement(
    original: function_pb2.FunctionDef,
    body: Callable,
    prefix: str,
) -> List[function_pb2.FunctionDef]:
    """Trace ``body(*args)`` with ``original``'s argument specs into FunctionDefs.

    The first FunctionDef returned takes ``original``'s name, argument names and attributes
    and its output names, so every caller sees a drop-in replacement; nested functions
    (loop bodies and conditions) are renamed ``<prefix>_<role>`` deterministically.
    """
    import tensorflow as tf

    specs = arg_specs(original)
    traced = tf.function(body, input_signature=specs, autograph=False).get_concrete_function()
    main = function_pb2.FunctionDef()
    main.CopyFrom(traced.function_def)
    annotate_shapes(main, traced.graph)
    nested = [f for f in traced.graph.as_graph_def().library.function]
    renames: Dict[str, str] = {main.signature.name: original.signature.name}
    used: Dict[str, int] = {}
    for f in sorted(nested, key=lambda f: _trace_order(f.signature.name)):
        role = re.sub(r"_\d+$", "", f.signature.name).lstrip("_")
        k = used.get(role, 0)
        used[role] = k + 1
        renames[f.signature.name] = f"{prefix}_{role}" + (f"_{k}" if k else "")
    out = [main] + sorted(nested, key=lambda f: renames[f.signature.name])  # stable library order
    _rename_references(main, renames)
    for f in out[1:]:  # loop bodies and conditions: TensorFlow also derived argument names from them
        _rename_everywhere(f, renames)
    # Drop-in signature: the original's argument names, attributes and output names.
    arg_map = {a.name: b.name for a, b in zip(main.signature.input_arg, original.signature.input_arg)}
    for node in main.node_def:
        for i, s in enumerate(node.input):
            ref, ctl = parse_input(s)
            if ref.is_function_arg and ref.node in arg_map:
                node.input[i] = ("^" if ctl else "") + arg_map[ref.node]
    for k, v in list(main.ret.items()):
        ref, _ = parse_input(v)
        if ref.is_function_arg and ref.node in arg_map:
            main.ret[k] = arg_map[ref.node]
    for a, b in zip(main.signature.input_arg, original.signature.input_arg):
        a.name = b.name
    main.ClearField("arg_attr")
    for i, v in original.arg_attr.items():
        main.arg_attr[i].CopyFrom(v)
    rets = [main.ret[a.name] for a in main.signature.output_arg]
    main.ClearField("ret")
    for a, b, r in zip(main.signature.output_arg, original.signature.output_arg, rets):
        a.name = b.name
        main.ret[b.name] = r
    main.attr.clear()
    for k, v in original.attr.items():
        main.attr[k].CopyFrom(v)
    return out


def annotate_shapes(fdef: function_pb2.FunctionDef, graph) -> None:
    """Record each node's static output shapes (``_output_shapes``), as TensorFlow's own
    SavedModel export does, so later passes and ``inspect`` can read them."""
    ops = {op.name: op for op in graph.get_operations()}
    for node in fdef.node_def:
        op = ops.get(node.name)
        if op is None or not op.outputs or "_output_shapes" in node.attr:
            continue
        shapes = node.attr["_output_shapes"].list.shape
        for t in op.outputs:
            shapes.add().CopyFrom(t.shape.as_proto())


def _rename_references(fdef: function_pb2.FunctionDef, renames: Dict[str, str]) -> None:
    """Rename ``fdef`` and the functions its nodes call (op types and function attributes)."""
    from vfgraph.ir.graph import iter_func_attrs

    fdef.signature.name = renames.get(fdef.signature.name, fdef.signature.name)
    for node in fdef.node_def:
        node.op = renames.get(node.op, node.op)
        for fa in iter_func_attrs(node):
            fa.name = renames.get(fa.name, fa.name)


def _rename_everywhere(fdef: function_pb2.FunctionDef, renames: Dict[str, str]) -> None:
    """Rename functions, and every argument or node name TensorFlow derived from them."""
    if not renames:
        return
    pattern = re.compile("|".join(re.escape(k) for k in sorted(renames, key=len, reverse=True)))

    def sub(text: str) -> str:
        return pattern.sub(lambda m: renames[m.group(0)], text)

    _rename_references(fdef, renames)
    sig = fdef.signature
    for arg in list(sig.input_arg) + list(sig.output_arg):
        arg.name = sub(arg.name)
    sig.control_output[:] = [sub(c) for c in sig.control_output]
    for node in fdef.node_def:
        node.name = sub(node.name)
        node.input[:] = [sub(x) for x in node.input]
    for field in (fdef.ret, fdef.control_ret):
        items = [(sub(k), sub(v)) for k, v in field.items()]
        field.clear()
        for k, v in items:
            field[k] = v


def _trace_order(name: str) -> Tuple[int, str]:
    m = re.search(r"_(\d+)$", name)
    return (int(m.group(1)) if m else 0, name)
