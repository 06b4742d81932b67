"""Attribute values of the nodes passes write: types, shapes, functions, constants.

The values made here are shared between calls (cached): copy one into a node, never change it.
"""
from __future__ import annotations

from functools import lru_cache
from typing import Dict, Optional, Sequence, Tuple

from tensorflow.core.framework import attr_value_pb2, function_pb2, tensor_shape_pb2
from tensorflow.python.framework import op_def_registry

AttrValue = attr_value_pb2.AttrValue


def shape_proto(dims: Optional[Sequence[int]]) -> tensor_shape_pb2.TensorShapeProto:
    """A TensorShapeProto: ``None`` is unknown rank, -1 an unknown dimension."""
    proto = tensor_shape_pb2.TensorShapeProto()
    if dims is None:
        proto.unknown_rank = True
    else:
        for d in dims:
            proto.dim.add().size = d
    return proto


@lru_cache(maxsize=None)
def type_attr(dtype: int) -> AttrValue:
    """A type AttrValue."""
    return AttrValue(type=dtype)


def types_attr(dtypes: Sequence[int]) -> AttrValue:
    v = AttrValue()
    v.list.SetInParent()
    v.list.type.extend(dtypes)
    return v


def shapes_attr(shapes: Sequence[Optional[Sequence[int]]]) -> AttrValue:
    """A list-of-shapes AttrValue."""
    return _shapes_attr(tuple(None if s is None else tuple(s) for s in shapes))


@lru_cache(maxsize=4096)
def _shapes_attr(shapes: Tuple[Optional[Tuple[int, ...]], ...]) -> AttrValue:
    v = AttrValue()
    v.list.SetInParent()
    for s in shapes:
        v.list.shape.add().CopyFrom(shape_proto(s))
    return v


@lru_cache(maxsize=4096)
def shape_arg_attrs(shape: Tuple[int, ...]) -> function_pb2.FunctionDef.ArgAttrs:
    """A function argument's attributes recording its static ``shape``."""
    out = function_pb2.FunctionDef.ArgAttrs()
    out.attr["_output_shapes"].CopyFrom(_shapes_attr((shape,)))
    return out


@lru_cache(maxsize=None)
def op_defaults(op: str) -> Optional[Tuple[Tuple[str, AttrValue], ...]]:
    """The attributes registered op ``op`` has defaults for (None: not registered)."""
    op_def = op_def_registry.get(op)
    if op_def is None:
        return None
    return tuple((a.name, a.default_value) for a in op_def.attr if a.HasField("default_value"))


def func_attr(name: str) -> AttrValue:
    v = AttrValue()
    v.func.name = name
    return v


def attr_value(value) -> AttrValue:
    """``value`` as an AttrValue: an AttrValue as it is, a bool, int, float or string wrapped."""
    if isinstance(value, AttrValue):
        return value
    if isinstance(value, bool):
        return AttrValue(b=value)
    if isinstance(value, int):
        return AttrValue(i=value)
    if isinstance(value, float):
        return AttrValue(f=value)
    if isinstance(value, (str, bytes)):
        return AttrValue(s=value.encode() if isinstance(value, str) else value)
    raise TypeError(f"attribute value {value!r}: wrap it (type_attr, types_attr, shapes_attr, func_attr)")


def const_array(value, dtype: int):
    """``value`` as a numpy array of TensorFlow type ``dtype``, and its cache key."""
    import numpy as np
    from tensorflow.python.framework import dtypes

    array = np.asarray(value, dtype=dtypes.as_dtype(dtype).as_numpy_dtype)
    return array, (dtype, array.shape, array.tobytes() if array.dtype != object else repr(array.tolist()))


# Small constants' tensor attributes by (dtype, shape, bytes), shared by every function.
_TENSORS: Dict[tuple, AttrValue] = {}


def array_attr(array, key: tuple) -> AttrValue:
    """The ``value`` attribute of a constant holding numpy ``array`` (``key``: see
    :func:`const_array`)."""
    tensor = _TENSORS.get(key)
    if tensor is None:  # make_tensor_proto is slow; the same small constants recur
        from tensorflow.python.framework.tensor_util import make_tensor_proto

        tensor = AttrValue(tensor=make_tensor_proto(array))
        if array.size <= 64:
            _TENSORS[key] = tensor
    return tensor


def tensor_attr(value, dtype: int) -> AttrValue:
    """A constant's ``value`` attribute."""
    return array_attr(*const_array(value, dtype))
