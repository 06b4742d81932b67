"""insert-allreduce: data-parallel training over MPI ranks.

``split-vnodes`` leaves a reduce function between a step's virtual-node loop and its update
(identity on one process). This pass gives it a body: the gradient sums, the loss sums and
the number of virtual nodes are packed into fused buffers (grouped by dtype, at most
``fusion-mb`` each) and summed over ranks with ``VfAllreduce``, one buffer after another in a
fixed chain (every rank runs the collectives in the same order); sparse gradient rows are
gathered with ``VfAllgather``. The step then divides by the global number of virtual nodes
and runs the original update once, so its result does not depend on how the virtual nodes
are spread over ranks. On one process the collectives are skipped at run time.

It also adds a ``<train>_broadcast`` signature that checks every rank loaded the same graph
(``VfCheck``) and copies every variable from rank 0: the runtime calls it once at start.
"""
from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from typing import ClassVar, Dict, List

import numpy as np
from tensorflow.core.framework import function_pb2, types_pb2

from vfgraph import records
from vfgraph.analysis import random_ops
from vfgraph.errors import PipelineError
from vfgraph.io.signatures import add_signature, entry_header, signature_wrapper
from vfgraph.ir.attrs import func_attr, shapes_attr, type_attr, types_attr
from vfgraph.ir.functions import arg_shapes
from vfgraph.ir.graph import FunctionGraph, verify_function_def
from vfgraph.ir.names import function_name
from vfgraph.item import GraphItem
from vfgraph.passes.base import Pass, PassResult, option, register
from vfgraph.records import Allreduce, Stages, VirtualNodes

DEFAULT_FUSION_MB = 4.0  # MiB; ResNet-50 gradients sum fastest in 1-4 MiB buffers (tools/bench_scaling.py)
ALIGN = 64  # bytes: TensorFlow's CPU split shares the input buffer for outputs aligned to this
_BYTES = {types_pb2.DT_HALF: 2, types_pb2.DT_BFLOAT16: 2, types_pb2.DT_FLOAT: 4, types_pb2.DT_DOUBLE: 8,
          types_pb2.DT_INT32: 4, types_pb2.DT_INT64: 8}
# What VfBroadcast and VfBroadcastVariables send (the all-reduce types and 1-byte ones).
_BROADCAST_TYPES = frozenset(_BYTES) | {types_pb2.DT_UINT8, types_pb2.DT_INT8, types_pb2.DT_BOOL}


@register
@dataclass(frozen=True)
class InsertAllreducePass(Pass):
    """Sum the virtual-node gradients of a training step over MPI ranks (fused all-reduce
    buffers), and add a broadcast signature that starts every rank from rank 0's variables."""

    name: ClassVar[str] = "insert-allreduce"
    requires: ClassVar[tuple] = (VirtualNodes,)
    produces: ClassVar[tuple] = (Allreduce,)
    fusion_mb: float = option(DEFAULT_FUSION_MB, f"largest fused all-reduce buffer, MiB (above 0, at most 1048576; "
                                                 f"default {DEFAULT_FUSION_MB:g})", above=0, high=1 << 20, flag=True,
                              metavar="MIB")
    signature: str = option("", "the training signature (default: every signature split into virtual nodes)")

    def differences(self, record: Allreduce) -> List[str]:
        """The fused buffers' size against the record's."""
        same = self.fusion_mb == record.fusion_mb
        return [] if same else [f"fusion-mb={self.fusion_mb:g} given, {record.fusion_mb:g} recorded"]

    def call(self, item: GraphItem) -> PassResult:
        from vfgraph import ops

        split = records.get(item, VirtualNodes)
        keys = [self.signature] if self.signature else sorted(split)
        missing = [k for k in keys if k not in split]
        if not keys or missing:
            raise PipelineError(f"{item.source}: insert-allreduce reduces the virtual-node sums of a training "
                                "signature; run split-vnodes first, e.g. "
                                "'split-vnodes{vnodes=8},insert-allreduce'")
        ops.load()  # a clear error when the MPI ops cannot be built
        notes = [n for n in (self.rewritten_before(item, k) for k in keys) if n]
        done = records.get(item, Allreduce)
        todo = [k for k in keys if k not in done]
        if not todo:
            return PassResult(item, False, notes)
        for key in todo:
            buffers = []
            staged = records.get(item, Stages).get(key)
            for fn in split[key].reduce_functions:
                over = staged.count if staged is not None and fn in staged.reduce_functions else 0
                functions, groups = reduce_functions(item.function(fn), int(self.fusion_mb * (1 << 20)), item.library,
                                                     item.new_function, stages=over)
                for f in functions:
                    item.set_function(f)
                verify_function_def(item.function(fn), item.library)
                buffers.append(groups)
            index_fn = split[key].index_function
            if index_fn:  # random ops keyed by the global virtual node index
                for f in random_ops.mpi_offset_functions(index_fn, item.library):
                    item.set_function(f)
            if index_fn and staged is not None and random_ops.stage_offset_name(index_fn) in item.library:
                for f in random_ops.mpi_offset_functions(random_ops.stage_offset_name(index_fn), item.library,
                                                         stages=staged.count):
                    item.set_function(f)
            fingerprint = graph_fingerprint(item)
            bcast, left_out = _add_broadcast(item, key, fingerprint)
            if bcast is None:
                notes.append(f"broadcast signature: not added to signature {key!r} ({item.kind} model)")
            elif left_out:
                notes.append(f"broadcast signature {bcast!r}: {len(left_out)} variable(s) of a type MPI cannot "
                             f"broadcast left out, each rank keeps its own ({', '.join(left_out[:3])})")
            records.put(item, key, Allreduce(self.fusion_mb, tuple(tuple(map(tuple, groups)) for groups in buffers),
                                             fingerprint, bcast))
        return PassResult(item, True, notes)


def _fused_buffers(header, shapes, limit: int) -> List[List[int]]:
    """Indices of the ``sum_`` arguments per fused buffer: grouped by dtype (in order of first
    appearance, the same on every rank), then cut at ``limit`` bytes."""
    by_dtype: Dict[int, List[int]] = {}
    for i, a in enumerate(header.signature.input_arg):
        if a.name.startswith(VirtualNodes.SUMMED):
            by_dtype.setdefault(a.type, []).append(i)
    buffers: List[List[int]] = []
    for dtype, idx in by_dtype.items():
        cur, size = [], 0
        for i in idx:
            nbytes = _elements(shapes[i]) * _BYTES.get(dtype, 8)
            if cur and size + nbytes > limit:
                buffers.append(cur)
                cur, size = [], 0
            cur.append(i)
            size += nbytes
        if cur:
            buffers.append(cur)
    return buffers


def _is_vector(shape) -> bool:
    return shape is not None and len(shape) == 1


def _elements(shape) -> int:
    """Elements of a static shape; 0 when it is not fully known."""
    if shape is None or any(d < 0 for d in shape):
        return 0
    return math.prod(shape)  # Python integers: exact, and no numpy call per tensor


def reduce_functions(header, limit: int, library, new_function=None, stages: int = 0):
    """A reduce function's new body and its two branches: ``VfSize() > 1`` picks
    ``<fn>_all`` (fused all-reduce, gathers) over ``<fn>_one`` (identity), so one process
    runs no collective and copies nothing. ``stages`` > 0: a pipeline stage's reduce function,
    summed over the ranks of its stage (the replicas of the pipeline; the identity without
    replicas). Returns (functions to add, argument names per
    buffer): the new body, and the branches unless ``new_function(name)`` gave the library
    entries they were written into."""
    fn = header.signature.name
    names = [a.name for a in header.signature.input_arg]
    shapes = arg_shapes(header)
    buffers = _fused_buffers(header, shapes, limit)
    gathers = [i for i, n in enumerate(names) if n.startswith(VirtualNodes.GATHERED)]
    over = {"stages": stages} if stages else {}
    multi = _reduce_all(header, library, new_function, shapes, buffers, gathers, over)
    one = new_function(f"{fn}_one") if new_function else function_pb2.FunctionDef()
    one.CopyFrom(header)  # split-vnodes' identity
    one.signature.name = f"{fn}_one"
    body = _reduce_switch(header, library, multi, one, shapes, over)
    groups = [[names[i] for i in buf] for buf in buffers] + [[names[i]] for i in gathers]
    return [body] + ([] if new_function else [multi, one]), groups


def _header_args(g: FunctionGraph, header) -> List:
    """The arguments of ``header`` (with their attributes) added to ``g``, in order."""
    return [g.arg(a.name, a.type, attr=header.arg_attr[i] if i in header.arg_attr else None)
            for i, a in enumerate(header.signature.input_arg)]


def _reduce_all(header, library, new_function, shapes, buffers: List[List[int]], gathers: List[int],
                over: Dict[str, int]) -> function_pb2.FunctionDef:
    """``<fn>_all``: each fused buffer summed with ``VfAllreduce`` and each ``gather_``
    argument gathered with ``VfAllgather``, one collective after another in a fixed chain."""
    fn = header.signature.name
    types = [a.type for a in header.signature.input_arg]
    outs = [a.name for a in header.signature.output_arg]
    i32 = types_pb2.DT_INT32
    b = FunctionGraph.new(f"{fn}_all", library, new_function(f"{fn}_all") if new_function else None)
    xs = _header_args(b, header)
    flat = b.const([-1], i32, "flat")[0]
    axis = b.const(0, i32, "axis")[0]
    out = list(xs)
    prev: List = []
    for buf in buffers:
        prev = _allreduce_buffer(b, xs, out, buf, types[buf[0]], shapes, flat, axis, prev, over)
    for i in gathers:
        x = b.op("Identity", [xs[i]], name="gather_input", deps=prev, T=type_attr(types[i]))
        prev = [b.op("VfAllgather", [x[0]], name="allgather", T=type_attr(types[i]), shapes=[shapes[i]], **over)]
        out[i] = prev[0][0]
    for name, ref, dtype in zip(outs, out, types):
        b.ret(name, ref, dtype)
    return b.finish()


def _allreduce_buffer(b: FunctionGraph, xs: List, out: List, buf: List[int], dtype: int, shapes, flat, axis,
                      prev: List, over: Dict[str, int]) -> List:
    """Sum the arguments ``buf`` (of one ``dtype``) over ranks in one fused buffer after the
    collectives ``prev``: flattened, each padded to start aligned, packed, all-reduced, split
    back and reshaped into ``out``. Returns the all-reduce, which the next collective waits for."""
    i32 = types_pb2.DT_INT32
    t = type_attr(dtype)
    static = all(shapes[i] is not None and all(d >= 0 for d in shapes[i]) for i in buf)
    lane = ALIGN // _BYTES.get(dtype, 8) if static else 1
    sizes = [_elements(shapes[i]) if static else 0 for i in buf]
    padded = [-(-n // lane) * lane for n in sizes]
    pieces = []
    for i, n, p in zip(buf, sizes, padded):  # a vector (a bias, say) is flat already
        pieces.append(xs[i] if _is_vector(shapes[i]) else
                      b.op("Reshape", [xs[i], flat], name="flat", T=t, Tshape=type_attr(i32))[0])
        if p > n:  # each tensor starts aligned, so splitting the sum back copies nothing
            pieces.append(b.const(np.zeros(p - n), dtype, "pad")[0])
    if len(pieces) > 1:
        packed = b.op("ConcatV2", pieces + [axis], name="pack", deps=prev, N=len(pieces), T=t,
                      Tidx=type_attr(i32))
    else:
        packed = b.op("Identity", pieces, name="pack", deps=prev, T=t)
    summed = b.op("VfAllreduce", [packed[0]], name="allreduce", T=t, **over)
    if len(buf) > 1:
        if static:
            splits = b.const(padded, types_pb2.DT_INT64, "splits")[0]
        else:
            sz = [b.op("Size", [xs[i]], name="size", T=t, out_type=type_attr(i32))[0] for i in buf]
            splits = b.op("Pack", sz, name="splits", N=len(sz), T=type_attr(i32))[0]
        parts = b.op("SplitV", [summed[0], splits, axis], name="unpack", num_split=len(buf), T=t,
                     Tlen=type_attr(types_pb2.DT_INT64 if static else i32)).outputs()
    else:
        parts = [summed[0]]
    for i, n, p, part in zip(buf, sizes, padded, parts):
        if static and p > n:
            part = b.op("Slice", [part, b.const([0], i32, "begin")[0], b.const([n], i32, "size")[0]],
                        name="unpad", T=t, Index=type_attr(i32))[0]
        if _is_vector(shapes[i]):
            out[i] = part
            continue
        shape = (b.const(shapes[i], i32, "shape") if static else
                 b.op("Shape", [xs[i]], name="shape", T=t, out_type=type_attr(i32)))[0]
        out[i] = b.op("Reshape", [part, shape], name=f"reduced_{i}", T=t, Tshape=type_attr(i32),
                      shapes=[shapes[i]])[0]
    return [summed]


def _reduce_switch(header, library, multi: function_pb2.FunctionDef, one: function_pb2.FunctionDef, shapes,
                   over: Dict[str, int]) -> function_pb2.FunctionDef:
    """The reduce function's body: ``If(VfSize() > 1)`` calls ``multi``, else ``one``; the
    header's attributes carry over."""
    fn = header.signature.name
    types = [a.type for a in header.signature.input_arg]
    outs = [a.name for a in header.signature.output_arg]
    i32 = types_pb2.DT_INT32
    lib = dict(library)
    lib.update({multi.signature.name: multi, one.signature.name: one})
    m = FunctionGraph.new(fn, lib)
    xs = _header_args(m, header)
    size = m.op("VfSize", name="size", **over)
    cond = m.op("Greater", [size[0], m.const(1, i32, "one")[0]], name="multi", T=type_attr(i32))
    branch = m.op("If", [cond[0]] + xs, name="reduce", Tcond=type_attr(types_pb2.DT_BOOL), Tin=types_attr(types),
                  Tout=types_attr(types), then_branch=func_attr(multi.signature.name),
                  else_branch=func_attr(one.signature.name), output_shapes=shapes_attr(shapes),
                  _lower_using_switch_merge=True, shapes=shapes)
    for k, (name, dtype) in enumerate(zip(outs, types)):
        m.ret(name, branch[k], dtype)
    for k, v in header.attr.items():
        m.fdef.attr[k].CopyFrom(v)
    return m.finish()


def graph_fingerprint(item: GraphItem) -> str:
    """SHA-256 of every library function (by name): ranks that loaded different graphs differ.
    The whole library, not only what the step calls: finding that takes a walk over every
    node, which costs more than serializing the few functions it would leave out."""
    h = hashlib.sha256()
    for _, f in sorted(item.library.items()):
        h.update(f.SerializeToString(deterministic=True))
    return h.hexdigest()


def _add_broadcast(item: GraphItem, key: str, fingerprint: str):
    """Add signature ``<key>_broadcast``: check the graph fingerprint on every rank, then copy
    every variable the step uses from rank 0 (one ``VfBroadcastVariables`` op). Returns its
    name (None: not added) and the variables left out (of a type the op cannot send)."""
    wrapper = signature_wrapper(item, key)
    if wrapper is None:
        return None, []
    sig = item.signatures[key]
    variables = wrapper.bound_args
    g = FunctionGraph.over(item.function(sig.function), item.library)  # read only
    fn = function_name(sig.function, "broadcast", "0")
    b, _ = FunctionGraph.like(entry_header(g, fn, variables), item.library)
    check = b.op("VfCheck", name="check", fingerprint=fingerprint, what=f"signature {key!r}")
    b.control_ret(check)
    # (captured constants are bound too: the same graph holds them on every rank)
    sent = [a for a in variables if a in sig.variables and sig.variables[a].dtype in _BROADCAST_TYPES]
    if sent:
        b.control_ret(b.op("VfBroadcastVariables", sent, name="broadcast", deps=[check], N=len(sent), root=0))
    item.set_function(b.finish())
    name = Allreduce.broadcast_name(key)
    add_signature(item, name, fn, wrapper, takes_inputs=False)
    return name, [sig.variables[a].name for a in variables
                  if a in sig.variables and sig.variables[a].dtype not in _BROADCAST_TYPES]
