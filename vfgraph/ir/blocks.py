"""Building blocks of the functions passes write: pieces every generated loop uses."""
from __future__ import annotations

from typing import Callable, Sequence

from tensorflow.core.framework import types_pb2

from vfgraph.ir.attrs import type_attr, types_attr
from vfgraph.ir.graph import FunctionGraph, Node, TensorRef

I32 = types_pb2.DT_INT32


def zeros(g: FunctionGraph, shape: Sequence[int], dtype: int, name: str = "zeros", shapes=None) -> TensorRef:
    """A ``dtype`` tensor of zeros of the static ``shape`` (one node per function, shape and dtype:
    a model's many variables of the same shape share it)."""
    key = ("zeros", tuple(shape), dtype, repr(shapes))
    if key not in g.memo:
        g.memo[key] = g.op("Fill", [g.const(shape, I32, "shape")[0], g.const(0, dtype, "zero")[0]], name=name,
                           T=type_attr(dtype), index_type=type_attr(I32), shapes=shapes)[0]
    return g.memo[key]


def batch_size(g: FunctionGraph, x: TensorRef, dtype: int) -> TensorRef:
    """The leading dimension of ``x`` as an int32 scalar."""
    shape = g.op("Shape", [x], name="shape", T=type_attr(dtype), out_type=type_attr(I32))[0]
    return g.op("StridedSlice", [shape, g.const([0], I32, "zero")[0], g.const([1], I32, "one")[0],
                                 g.const([1], I32, "one")[0]],
                name="batch_size", T=type_attr(I32), Index=type_attr(I32), shrink_axis_mask=1)[0]


def check(g: FunctionGraph, ok: TensorRef, message: str) -> Node:
    """An ``Assert`` that fails with ``message`` unless the boolean ``ok`` holds."""
    import numpy as np

    text = g.const(np.array(message.encode(), dtype=object), types_pb2.DT_STRING, "message")[0]
    return g.op("Assert", [ok, text], name="check", T=types_attr([types_pb2.DT_STRING]), summarize=3)


def slice_rows(g: FunctionGraph, start: TensorRef, count: TensorRef) -> Callable[[TensorRef, int], TensorRef]:
    """A function taking (tensor, dtype) to its rows ``[start, start + count)`` (clamped)."""
    pack = dict(N=1, T=type_attr(I32), axis=0)
    end = g.op("AddV2", [start, count], name="end", T=type_attr(I32))[0]
    begin_v = g.op("Pack", [start], name="begin", **pack)[0]
    end_v = g.op("Pack", [end], name="stop", **pack)[0]
    strides = g.const([1], I32, "strides")[0]

    def rows(x: TensorRef, dtype: int) -> TensorRef:
        return g.op("StridedSlice", [x, begin_v, end_v, strides], name="slice", T=type_attr(dtype),
                    Index=type_attr(I32))[0]

    return rows


def list_concat(g: FunctionGraph, ref: TensorRef, dtype: int, element_shape=-1, shape=None) -> TensorRef:
    """The elements of tensor list ``ref`` concatenated along their first dimension."""
    import numpy as np

    return g.op("TensorListConcatV2", [ref, g.const(element_shape, I32, "element_shape")[0],
                                       g.const(np.zeros([0], np.int64), types_pb2.DT_INT64, "leading_dims")[0]],
                name="concat", element_dtype=type_attr(dtype), shape_type=type_attr(I32),
                shapes=None if shape is None else [shape, [-1]])[0]


# ----------------------------------------------------------------------------- exact sums
# A floating-point value x, truncated toward zero to a multiple of 2^-60, becomes
# N = x * 2^60 in two int64 words with the sign of x, hi = N / 2^40 and lo = N % 2^40, exactly
# (the VfExactAdd op). Integer sums of such words are exact and do not depend on the order of
# the additions, so a sum over virtual nodes and ranks is the same, bit for bit, however they
# are laid out; VfExactValue makes a sum floating point: hi * 2^-20 + lo * 2^-60.
EXACT_MAX_TERMS = 1024  # terms per sum: |hi| < 2^51 each, |lo| < 2^40 each, both sums stay in int64
EXACT_LIMIT = 2.0 ** 31  # a term holding a larger value (or a non-finite one) makes the sum NaN
I64 = types_pb2.DT_INT64


def exact_add(g: FunctionGraph, acc: TensorRef, values: Sequence[TensorRef], dtype: int, n: int) -> TensorRef:
    """``acc`` (int64 ``[2n + 1]``) plus the exact words of ``values`` (float ``dtype``, ``n``
    values in all): one ``VfExactAdd`` op (vfgraph's op library): ``n`` high words, ``n`` low
    words, and a last word counting the calls that saw a value outside the limit."""
    return g.op("VfExactAdd", [acc, *values], name="exact_sum", N=len(values), T=type_attr(dtype),
                shapes=[[2 * n + 1]])[0]


def from_exact(g: FunctionGraph, words: TensorRef, dtype: int, n: int) -> TensorRef:
    """The ``n`` ``dtype`` values of summed words (all NaN when a term was outside the limit):
    one ``VfExactValue`` op."""
    return g.op("VfExactValue", [words], name="exact_value", T=type_attr(dtype), shapes=[[n]])[0]
