"""The loops over slices of a batch that passes write: split-vnodes' virtual-node loop and
microbatch-inference's serving loop.

Both are a ``While`` whose loop variables are laid out as :class:`LoopLayout` says: the
slice index ``i``, the values each iteration updates (sums, tensor lists of outputs), the
number of slices, then what every iteration reads unchanged (the batch, variables). The
condition is ``i < count``; the body reads its rows ``[i * per, (i + 1) * per)`` of the
batch and returns ``i + 1``, the updated values and the rest as they were.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, List, Optional, Sequence, Tuple, Union

from tensorflow.core.framework import function_pb2, types_pb2

from vfgraph.ir.attrs import func_attr, shapes_attr, type_attr, types_attr
from vfgraph.ir.blocks import I32, batch_size, check, slice_rows
from vfgraph.ir.graph import FunctionGraph, Node, TensorRef

Shape = Optional[Sequence[int]]
Ref = Union[TensorRef, str]  # a tensor of the function being written


@dataclass(frozen=True)
class LoopLayout:
    """Types and shapes of a slice loop's variables: ``(i, carried..., count, fixed...)``,
    ``i`` and ``count`` int32 scalars."""

    carried_types: Tuple[int, ...]
    carried_shapes: Tuple[Shape, ...]
    fixed_types: Tuple[int, ...]
    fixed_shapes: Tuple[Shape, ...]

    @classmethod
    def of(cls, carried: Sequence[Tuple[int, Shape]], fixed: Sequence[Tuple[int, Shape]]) -> "LoopLayout":
        """The layout of ``carried`` and ``fixed`` values, each given as (dtype, shape)."""
        return cls(tuple(t for t, _ in carried), tuple(s for _, s in carried),
                   tuple(t for t, _ in fixed), tuple(s for _, s in fixed))

    @property
    def count_index(self) -> int:
        """Where the number of slices stands among the loop variables."""
        return 1 + len(self.carried_types)

    @property
    def types(self) -> List[int]:
        return [I32, *self.carried_types, I32, *self.fixed_types]

    @property
    def shapes(self) -> List[Shape]:
        return [[], *self.carried_shapes, [], *self.fixed_shapes]

    def split(self, values: Sequence[Ref]) -> Tuple[Ref, List[Ref], Ref, List[Ref]]:
        """Loop variables (the body's arguments, the loop's outputs) as (i, carried, count, fixed)."""
        c = self.count_index
        return values[0], list(values[1:c]), values[c], list(values[c + 1:])

    def join(self, i: Ref, carried: Sequence[Ref], count: Ref, fixed: Sequence[Ref]) -> List[Ref]:
        """The loop variables in order."""
        return [i, *carried, count, *fixed]

    def args(self, g: FunctionGraph, names: Sequence[str]) -> List[Ref]:
        """The loop variables as ``g``'s next arguments, named ``names``, with their shapes."""
        return [g.arg(n, t, s) for n, t, s in zip(names, self.types, self.shapes)]


def condition(name: str, body: function_pb2.FunctionDef, layout: LoopLayout, library,
              into: Optional[function_pb2.FunctionDef] = None) -> function_pb2.FunctionDef:
    """The loop's condition ``i < count``, taking the arguments of ``body``."""
    g = FunctionGraph.new(name, library, into)
    args = g.args_of(body)
    g.ret("more", g.op("Less", [args[0], args[layout.count_index]], name="more", T=type_attr(I32))[0],
          types_pb2.DT_BOOL)
    g.fdef.signature.is_stateful = False
    return g.finish()


def slice_reader(g: FunctionGraph, i: Ref, per: Ref) -> Callable[[Ref, int], Ref]:
    """A function taking (tensor, dtype) to its rows ``[i * per, (i + 1) * per)``."""
    return slice_rows(g, g.op("Mul", [i, per], name="start", T=type_attr(I32))[0], per)


def next_index(g: FunctionGraph, i: Ref) -> Ref:
    """``i + 1``: the next iteration's index."""
    return g.op("AddV2", [i, g.const(1, I32, "one")[0]], name="next", T=type_attr(I32))[0]


def append(g: FunctionGraph, items: Ref, i: Ref, value: Ref, dtype: int) -> Ref:
    """Tensor list ``items`` with ``value`` as its item ``i``."""
    return g.op("TensorListSetItem", [items, i, value], name="append", element_dtype=type_attr(dtype))[0]


def reserve(g: FunctionGraph, count: Ref, dtype: int, element_shape=-1, name: str = "list") -> Ref:
    """A tensor list of ``count`` items of ``dtype``, to :func:`append` to."""
    return g.op("TensorListReserve", [g.const(element_shape, I32, "element_shape")[0], count], name=name,
                element_dtype=type_attr(dtype), shape_type=type_attr(I32))[0]


def same_batch(g: FunctionGraph, batch: Sequence[Ref], types: Sequence[int], keys: Sequence[str],
               what: str) -> Tuple[Ref, List[Node]]:
    """The leading dimension of the first of tensors ``batch`` and the checks that every
    other one has the same (``what`` and ``keys`` name them in the message)."""
    n = batch_size(g, batch[0], types[0])
    checks = []
    for k, x, t in zip(keys[1:], batch[1:], types[1:]):
        same = g.op("Equal", [batch_size(g, x, t), n], name="same_batch", T=type_attr(I32))[0]
        checks.append(check(g, same, f"vfgraph: {what} {keys[0]!r} and {k!r} have different leading (batch) "
                                     "dimensions"))
    return n, checks


def while_loop(g: FunctionGraph, layout: LoopLayout, carried: Sequence[Ref], count: Ref, fixed: Sequence[Ref],
               cond: str, body: str, name: str, lower: bool, parallel_iterations: int = 1) -> Node:
    """The ``While`` node running library functions ``cond`` and ``body`` from ``i = 0``, at
    most ``parallel_iterations`` iterations at once (lowered, TensorFlow starts iteration i+1
    while i is still running where the dataflow allows); ``lower``: TensorFlow may lower it to
    TF1 control flow."""
    i = g.const(0, I32, "zero")[0]
    return g.op("While", layout.join(i, carried, count, fixed), name=name, T=types_attr(layout.types),
                cond=func_attr(cond), body=func_attr(body), output_shapes=shapes_attr(layout.shapes),
                parallel_iterations=parallel_iterations, _lower_using_switch_merge=lower)
