"""FunctionDefs read without building a graph: the output layout of an op, argument shapes,
a function's header, the functions a function calls."""
from __future__ import annotations

from functools import lru_cache
from typing import Dict, Iterable, Iterator, List, Mapping, Optional, Tuple

from tensorflow.core.framework import function_pb2, node_def_pb2, op_def_pb2, types_pb2
from tensorflow.python.framework import op_def_registry

from vfgraph.errors import VerifyError

DataType = int  # a types_pb2 enum value
CALL_OPS = ("StatefulPartitionedCall", "PartitionedCall")  # the ops that call a library function by attribute


def _op_def(op: str, library: Mapping[str, function_pb2.FunctionDef]) -> op_def_pb2.OpDef:
    if op in library:
        return library[op].signature
    found = op_def_registry.get(op)
    if found is None:
        raise VerifyError(f"op type {op!r} is neither a registered op nor a library function")
    return found


def output_layout(
    node: node_def_pb2.NodeDef, library: Mapping[str, function_pb2.FunctionDef]
) -> List[Tuple[str, int, DataType]]:
    """The flat outputs of ``node``: (output arg name, index in arg, dtype) in order. An
    attribute the node leaves out has its registered default (exporters strip attributes at
    their default); reading never adds one to the node."""
    op = node.op
    recipe = None if op in library else _REGISTERED_OUTPUTS.get(op)
    if recipe is None:
        recipe = _output_recipe(op, library)
        if op not in library:
            _REGISTERED_OUTPUTS[op] = recipe
    get = node.attr.get  # (get: reading adds no entry)
    out: List[Tuple[str, int, DataType]] = []
    for name, type_list_attr, fixed, type_attr, number_attr, defaults in recipe:
        if type_list_attr:
            v = get(type_list_attr)
            types = list(v.list.type) if v is not None else list(defaults[type_list_attr])
        else:
            v = None if fixed else get(type_attr)
            dtype = fixed or (v.type if v is not None else defaults.get(type_attr, 0))
            v = get(number_attr) if number_attr else None
            count = (v.i if v is not None else defaults.get(number_attr, 0)) if number_attr else 1
            types = [dtype] * count
        out.extend([(name, k, t) for k, t in enumerate(types)])
    return out


# op type -> its outputs as in _output_recipe, for registered ops
_REGISTERED_OUTPUTS: Dict[str, tuple] = {}


def output_names(op: str, library: Mapping[str, function_pb2.FunctionDef]) -> Optional[Tuple[str, ...]]:
    """The output names of a registered op without list outputs, in order (each has index 0
    only); None for other ops."""
    if op in library:
        return None
    if op not in _OUTPUT_NAMES:
        od = op_def_registry.get(op)
        lists = od is None or any(a.number_attr or a.type_list_attr for a in od.output_arg)
        _OUTPUT_NAMES[op] = None if lists else tuple(a.name for a in od.output_arg)
    return _OUTPUT_NAMES[op]


_OUTPUT_NAMES: Dict[str, Optional[Tuple[str, ...]]] = {}


def _output_recipe(op: str, library: Mapping[str, function_pb2.FunctionDef]) -> tuple:
    """(name, type_list_attr, type, type_attr, number_attr, attribute defaults) per output."""
    od = _op_def(op, library)
    defaults = {}
    for a in od.attr:
        if a.HasField("default_value"):
            v = a.default_value
            defaults[a.name] = tuple(v.list.type) if a.type == "list(type)" else v.type if a.type == "type" else v.i
    return tuple((a.name, a.type_list_attr, a.type, a.type_attr, a.number_attr, defaults) for a in od.output_arg)


def arg_shape(fdef: function_pb2.FunctionDef, name: str) -> Optional[List[int]]:
    """Static shape ``fdef`` records for its argument ``name`` (None when unknown)."""
    for i, a in enumerate(fdef.signature.input_arg):
        if a.name == name:
            return arg_shape_at(fdef, i)
    raise KeyError(name)


def arg_shapes(fdef: function_pb2.FunctionDef) -> List[Optional[List[int]]]:
    """:func:`arg_shape` of every argument, in order (one pass)."""
    return [arg_shape_at(fdef, i) for i in range(len(fdef.signature.input_arg))]


def arg_shape_at(fdef: function_pb2.FunctionDef, i: int) -> Optional[List[int]]:
    if i in fdef.arg_attr:
        attrs = fdef.arg_attr[i].attr
        if "_output_shapes" in attrs and attrs["_output_shapes"].list.shape:
            return shape_list(attrs["_output_shapes"].list.shape[0])
    if "_input_shapes" in fdef.attr:
        shapes = fdef.attr["_input_shapes"].list.shape
        if i < len(shapes):
            return shape_list(shapes[i])
    return None


def copy_header(fdef: function_pb2.FunctionDef, into: Optional[function_pb2.FunctionDef] = None,
                skip: Tuple[str, ...] = ()) -> function_pb2.FunctionDef:
    """Everything of ``fdef`` but its nodes (signature, attributes, outputs) and the fields
    ``skip``, merged into ``into`` (a new FunctionDef when None): the header of a function a
    pass rebuilds, without copying what it would replace."""
    out = function_pb2.FunctionDef() if into is None else into
    for field, value in fdef.ListFields():
        if field.name != "node_def" and field.name not in skip:
            getattr(out, field.name).MergeFrom(value)
    return out


def shape_list(shape) -> Optional[List[int]]:
    """A TensorShapeProto as a list of dimensions (-1: unknown); None for unknown rank."""
    if shape.unknown_rank:
        return None
    return [d.size for d in shape.dim]


def iter_func_attrs(node: node_def_pb2.NodeDef, keys: Optional[Iterable[str]] = None) -> Iterator:
    """Yield every NameAttrList inside ``node``'s attrs (single and list-valued); only those
    of the attributes ``keys`` when given."""
    for v in node.attr.values() if keys is None else (node.attr[k] for k in keys if k in node.attr):
        if v.HasField("func"):
            yield v.func
        elif v.HasField("list"):
            yield from v.list.func


def function_dependencies(name: str, library: Mapping[str, function_pb2.FunctionDef]) -> List[str]:
    """``name`` and every library function it calls, transitively, in a stable order."""
    order: List[str] = []
    seen = set()
    stack = [name]
    while stack:
        f = stack.pop()
        if f in seen or f not in library:
            continue
        seen.add(f)
        order.append(f)
        for node in library[f].node_def:
            op = node.op
            if op in library:
                stack.append(op)
            stack.extend(fa.name for fa in iter_func_attrs(node, None if op in library else _func_attr_names(op)))
    return order


@lru_cache(maxsize=None)
def _func_attr_names(op: str) -> Optional[Tuple[str, ...]]:
    """The attributes of registered op ``op`` that can hold functions (None: not registered)."""
    od = op_def_registry.get(op)
    if od is None:
        return None
    return tuple(a.name for a in od.attr if a.type in ("func", "list(func)"))


def is_resource(dtype: DataType) -> bool:
    return dtype == types_pb2.DT_RESOURCE
