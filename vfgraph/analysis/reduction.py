"""How a training step's loss is reduced over the batch: a mean (divided by the batch's size,
so virtual nodes' gradients are averaged) or a sum (not divided, so they are summed).

Read from dataflow, not assumed. A quantity that depends on the batch only through its
size (the count a mean divides by: ``Shape``, ``Size`` and arithmetic on them) is evaluated
at two batch sizes by a small interpreter of shape arithmetic; its exponent in the batch size
says what it is (``1``: the number of examples; ``0``: a per-example count such as a sequence
length, which ``Prod(shape(x)) / Prod(shape(mean))`` gives). A step whose gradients are
divided by such a count averages; a step whose gradients depend on no batch-sized scalar sums;
a step whose gradients are divided by a batch-dependent value (a sum of sample weights) with
no count is refused, since neither averaging nor summing gives the full batch's gradient.
"""
from __future__ import annotations

from typing import Callable, Dict, List, Optional, Set

import numpy as np
from tensorflow.core.framework import types_pb2

from vfgraph.ir.graph import FunctionGraph, TensorRef

FLOATS = {types_pb2.DT_HALF, types_pb2.DT_BFLOAT16, types_pb2.DT_FLOAT, types_pb2.DT_DOUBLE}
_BATCHES = (3, 6)     # the two batch sizes the counts are evaluated at
_OTHER_DIM = 5        # an unknown non-batch dimension (the same at both)
_SAME = {"Identity", "Snapshot", "StopGradient", "PreventGradient"}
_BINARY: Dict[str, Callable] = {
    "Mul": np.multiply, "RealDiv": np.true_divide, "Div": np.true_divide, "FloorDiv": np.floor_divide,
    "FloorMod": np.mod, "AddV2": np.add, "Add": np.add, "Sub": np.subtract, "Maximum": np.maximum,
    "Minimum": np.minimum, "Pow": np.power,
    "DivNoNan": lambda a, b: np.where(b == 0, 0, a / np.where(b == 0, 1, b)),
}
_UNARY: Dict[str, Callable] = {"Reciprocal": np.reciprocal, "Neg": np.negative, "Sqrt": np.sqrt,
                               "Square": np.square, "Rsqrt": lambda a: 1 / np.sqrt(a)}
_REDUCE = {"Prod": np.prod, "Sum": np.sum, "Max": np.max, "Min": np.min, "Mean": np.mean}
# the ops _apply computes from its inputs' values
_KNOWN = frozenset(_SAME | {"Cast", "Gather", "GatherV2", "Pack", "ConcatV2", "Reshape", "ExpandDims", "Squeeze",
                            "Fill", "Range", "StridedSlice"} | set(_BINARY) | set(_UNARY) | set(_REDUCE))


class BatchCounts:
    """The exponent in the batch size of batch-free tensors that depend on the batch only
    through its size (``None`` for one that depends on its values, or that the interpreter
    does not know)."""

    def __init__(self, g: FunctionGraph, dep: Set[str], batch_args: List[str],
                 shapes: Dict[TensorRef, List[int]]):
        self.g, self.dep, self.batch = g, dep, set(batch_args)
        self.shapes = shapes
        self._memo: Dict[tuple, Optional[np.ndarray]] = {}

    def exponent(self, ref: TensorRef) -> Optional[int]:
        a, b = (self.value(ref, k) for k in range(2))
        if a is None or b is None or a.shape != b.shape or a.size == 0:
            return None
        a, b = a.astype(np.float64).ravel(), b.astype(np.float64).ravel()
        if np.any(a == 0) or np.any(b == 0) or not (np.all(np.isfinite(a)) and np.all(np.isfinite(b))):
            return None if np.any(a != b) else 0
        e = np.log(b / a) / np.log(_BATCHES[1] / _BATCHES[0])
        k = np.round(e)
        return int(k[0]) if np.allclose(e, k, atol=1e-6) and np.all(k == k[0]) else None

    def shape(self, ref: TensorRef) -> Optional[List[int]]:
        return self.shapes.get(ref) or self.g.shape(ref)

    def _depends(self, ref: TensorRef) -> bool:
        return ref.node in self.batch if ref.is_function_arg else ref.node in self.dep

    def value(self, ref: TensorRef, k: int) -> Optional[np.ndarray]:
        """``ref``'s value at the ``k``-th batch size (None: unknown), its inputs evaluated first
        from an explicit stack: the chain of a deep model's layers is deeper than Python's
        recursion. An input on a cycle evaluates to unknown."""
        root = (ref, k)
        stack, entered = [ref], set()
        while root not in self._memo:
            r = stack[-1]
            if (r, k) in self._memo:
                stack.pop()
            elif r not in entered:  # (an entered input not yet evaluated is on a cycle through r)
                entered.add(r)
                stack.extend(t for t in self._needs(r) if (t, k) not in self._memo and t not in entered)
            else:
                stack.pop()
                try:
                    self._memo[(r, k)] = self._evaluate(r, k)
                except (ValueError, TypeError, IndexError, ArithmeticError, KeyError):
                    self._memo[(r, k)] = None
        return self._memo[root]

    def _needs(self, ref: TensorRef) -> List[TensorRef]:
        """The inputs whose values ``ref``'s value is computed from (none for an op the
        interpreter does not know, or one that reads only its inputs' shapes)."""
        if ref.is_function_arg or ref.node not in self.g.nodes or self.g.nodes[ref.node].op not in _KNOWN:
            return []
        return self.g.data_inputs(ref.node)

    def _shape_value(self, ref: TensorRef, k: int) -> Optional[np.ndarray]:
        """The shape of ``ref`` at the ``k``-th batch size (its leading dimension the batch's)."""
        shape = self.shape(ref)
        if shape is None:
            return None
        batched = bool(shape) and shape[0] < 0 and self._depends(ref)
        return np.array([_BATCHES[k] if (i == 0 and batched) else (d if d >= 0 else _OTHER_DIM)
                         for i, d in enumerate(shape)], dtype=np.int64)

    def _evaluate(self, ref: TensorRef, k: int) -> Optional[np.ndarray]:
        g = self.g
        if ref.is_function_arg:
            return None
        node = g.nodes[ref.node]
        op = node.op
        if op == "Const":
            from tensorflow.python.framework import tensor_util

            return np.asarray(tensor_util.MakeNdarray(node.attr["value"].tensor))
        inputs = g.data_inputs(ref.node)
        if op in ("Shape", "ShapeN", "Size", "Rank"):
            src = inputs[ref.index if op == "ShapeN" else 0]
            shape = self._shape_value(src, k)
            if shape is None:
                return None
            return {"Size": np.prod(shape), "Rank": np.int64(len(shape))}.get(op, shape)
        if op in ("OnesLike", "ZerosLike"):
            shape = self._shape_value(inputs[0], k)
            return None if shape is None else np.full(shape, 1 if op == "OnesLike" else 0)
        if op not in _KNOWN:
            return None
        args = [self._memo.get((t, k)) for t in inputs]  # (evaluated first: value)
        if any(a is None for a in args):
            return None
        return _apply(op, node, args)


def _apply(op: str, node, args: List[np.ndarray]) -> Optional[np.ndarray]:
    """``op`` on constant ``args`` (None: an op the interpreter does not know)."""
    if op in _SAME:
        return args[0]
    if op == "Cast":
        from tensorflow.python.framework import dtypes

        return args[0].astype(dtypes.as_dtype(node.attr["DstT"].type).as_numpy_dtype)
    if op in _BINARY:
        return np.asarray(_BINARY[op](args[0], args[1]))
    if op in _UNARY:
        return np.asarray(_UNARY[op](args[0]))
    if op in _REDUCE:
        axis = tuple(int(a) % max(args[0].ndim, 1) for a in np.atleast_1d(args[1])) if args[0].ndim else None
        keep = "keep_dims" in node.attr and node.attr["keep_dims"].b
        return np.asarray(_REDUCE[op](args[0], axis=axis, keepdims=keep))
    if op in ("Gather", "GatherV2"):
        return np.take(args[0], args[1], axis=int(args[2]) if len(args) > 2 else 0)
    if op == "Pack":
        return np.stack(args, axis=node.attr["axis"].i if "axis" in node.attr else 0)
    if op == "ConcatV2":
        return np.concatenate(args[:-1], axis=int(args[-1]))
    if op == "Reshape":
        return np.reshape(args[0], args[1])
    if op == "ExpandDims":
        return np.expand_dims(args[0], int(args[1]))
    if op == "Squeeze":
        dims = tuple(node.attr["squeeze_dims"].list.i) if "squeeze_dims" in node.attr else ()
        return np.squeeze(args[0], axis=dims or None)
    if op == "Fill":
        return np.full(args[0], args[1])
    if op == "Range":
        return np.arange(args[0], args[1], args[2])
    if op == "StridedSlice":
        return _strided_slice(node, *args)
    return None


def _strided_slice(node, x, begin, end, strides) -> Optional[np.ndarray]:
    mask = {k: node.attr[k].i if k in node.attr else 0  # (reading a missing key of a proto map adds it)
            for k in ("ellipsis_mask", "new_axis_mask", "shrink_axis_mask", "begin_mask", "end_mask")}
    if mask["ellipsis_mask"] or mask["new_axis_mask"]:
        return None
    index = []
    for i, (b, e, s) in enumerate(zip(begin, end, strides)):
        bit = 1 << i
        if mask["shrink_axis_mask"] & bit:
            index.append(int(b))
            continue
        index.append(slice(None if mask["begin_mask"] & bit else int(b),
                           None if mask["end_mask"] & bit else int(e), int(s)))
    return np.asarray(x[tuple(index)])


def numel_one(shape: Optional[List[int]]) -> bool:
    return shape is not None and all(d == 1 for d in shape)


def batch_scalars(g: FunctionGraph, counts: BatchCounts, nodes: Set[str], shapes) -> tuple:
    """Float scalars computed by ``nodes`` (the per-virtual-node side) that depend on the batch:
    (those that are a power of its size, those that depend on its values)."""
    sized, valued = [], []
    for name in sorted(nodes):
        if name not in g.nodes:
            continue
        for i, ref in enumerate(g.outputs(name)):
            if not numel_one(shapes.get(ref) or g.shape(ref)) or g.layout(name)[i][2] not in FLOATS:
                continue
            e = counts.exponent(ref)
            if e is None:
                valued.append(ref)
            elif e:
                sized.append(ref)
    return sized, valued


def first_reaching(g: FunctionGraph, starts: List[TensorRef], targets: Set[str], within: Set[str]) -> Optional[TensorRef]:
    """The first of ``starts`` (in order) from which a data path within ``within`` reaches a
    node of ``targets``."""
    for ref in starts:
        stack, seen = [ref.node], {ref.node}
        while stack:
            n = stack.pop()
            if n in targets:
                return ref
            for c in g.data_children(n):
                if c in within and c not in seen:
                    seen.add(c)
                    stack.append(c)
    return None


def sums_over_batch(g: FunctionGraph, counts: BatchCounts, ref: TensorRef, per_example: Callable[[TensorRef], bool],
                    depends: Callable[[TensorRef], bool]) -> bool:
    """Whether the batch-free output ``ref`` is a sum over the batch's examples: walking up
    through batch-free tensors, every reduction of per-example values met is a ``Sum`` and no
    count of the batch's examples divides it (a mean, ``Mean`` or a sum over a count, is
    averaged over virtual nodes; so is anything the walk does not recognise)."""
    stack, seen, sums = [ref], {ref}, 0
    while stack:
        t = stack.pop()
        if t.is_function_arg or not depends(t):
            continue
        e = counts.exponent(t)
        if e:
            return False  # divided (or multiplied) by the number of examples
        if e == 0:
            continue  # depends on the batch's size only, and not on the number of examples
        node = g.nodes[t.node]
        inputs = g.data_inputs(t.node)
        if any(per_example(i) for i in inputs):
            if node.op != "Sum" or not _reduces_batch_axis(counts, inputs):
                return False
            sums += 1
            continue
        for i in inputs:
            if i not in seen:
                seen.add(i)
                stack.append(i)
    return sums > 0


def _reduces_batch_axis(counts: BatchCounts, inputs: List[TensorRef]) -> bool:
    axes = counts.value(inputs[1], 0)
    return axes is not None and 0 in {int(a) % max(len(counts.shape(inputs[0]) or [0]), 1)
                                      for a in np.atleast_1d(axes)}
