"""What a training function means: where the per-example work ends and the update begins.

The cut is derived from dataflow, not from names. Every variable write whose value depends
on the batch is a sink (a functional op whose functions write variables, an ``If`` applying
the update under a condition, is a write of those: :mod:`vfgraph.analysis.calls`); the batch
arguments are the sources; a tensor may be cut only if its shape does not depend on the
batch (a fully known static shape) and it is floating point.
The minimum cut closest to the batch is the set of per-step quantities that sum over
examples: the gradients, and the batch statistics that feed moving-average updates; whatever
the step then does with them (clipping, scaling, EMA) runs once, on the batch's value.
Averaging them over virtual nodes (or summing them, for a loss summed over the batch:
:mod:`vfgraph.analysis.reduction`) and running everything behind the cut once is the
virtual-node semantics (design.md section 2).
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Set, Tuple

import networkx as nx
from tensorflow.core.framework import types_pb2

from vfgraph.analysis import calls, reduction
from vfgraph.errors import DetectionError
from vfgraph.ir.graph import FunctionGraph, TensorRef
from vfgraph.item import GraphItem, SignatureInfo

FLOAT_TYPES = {types_pb2.DT_HALF, types_pb2.DT_BFLOAT16, types_pb2.DT_FLOAT, types_pb2.DT_DOUBLE}
_WRITE_PREFIXES = ("Assign", "ResourceApply", "ResourceSparseApply", "ResourceScatter",
                   "ResourceStridedSliceAssign")
_READ_THROUGH = ("Identity",)
_SRC, _SNK = "__source__", "__sink__"
_OP_VERTICES = ("op", "op+in", "op+out")


@dataclass
class CutTensor:
    """A per-virtual-node quantity that is averaged before the update runs once."""

    ref: TensorRef
    dtype: int
    shape: List[int]
    writes: List[str]            # resource args whose writes it feeds
    role: str = "gradient"       # "gradient" | "statistic" | "indices" (of a sparse gradient)
    variable: Optional[str] = None  # resource arg it is the gradient of
    combine: str = "mean"        # "mean"; sparse gradients: "concat_scaled" values, "concat" indices
    averaged: bool = True        # "mean" and "concat_scaled": divided by the number of virtual nodes
    #                              (False: the gradient of a loss summed over the batch)


@dataclass
class OutputPlan:
    name: str           # function output arg name
    ref: TensorRef
    side: str           # "vnode" (computed per virtual node) or "update" (computed once)
    combine: str        # "mean" | "concat" | "last"
    averaged: bool = True  # "mean": divided by the number of virtual nodes (False: a sum over the batch)


@dataclass
class TrainStep:
    """The training function split at the cut."""

    signature: SignatureInfo
    function: str
    cut: List[CutTensor]
    vnode_nodes: Set[str]          # nodes computed per virtual node (source side)
    writes: Dict[str, List[str]]   # resource arg -> write nodes
    outputs: List[OutputPlan]
    batch_dependent: Set[str] = field(default_factory=set)
    loss_reduction: str = "mean"   # how the loss reduces the batch: "mean" (gradients averaged) or "sum"

    @property
    def trainable(self) -> List[str]:
        return [c.variable for c in self.cut if c.role == "gradient" and c.variable]

    @property
    def batch_updated(self) -> List[str]:
        out: List[str] = []
        trainable = set(self.trainable)
        for c in self.cut:
            if c.role == "statistic":
                out.extend(w for w in c.writes if w not in out and w not in trainable)
        return out

    @property
    def optimizer_state(self) -> List[str]:
        known = set(self.trainable) | set(self.batch_updated)
        return [r for r in self.writes if r not in known]


def is_write(op: str) -> bool:
    return op.startswith(_WRITE_PREFIXES) and op not in ("Assert",)


def resource_root(g: FunctionGraph, ref: TensorRef) -> Optional[str]:
    """Follow Identity chains back to the resource argument a handle comes from."""
    seen = 0
    while not ref.is_function_arg and seen < 64:
        node = g.nodes.get(ref.node)
        if node is None or node.op not in _READ_THROUGH:
            return None
        ref = g.data_inputs(ref.node)[0]
        seen += 1
    return ref.node if ref.is_function_arg else None


def batch_dependent_nodes(g: FunctionGraph, batch_args: List[str]) -> Set[str]:
    """Nodes reachable from the batch arguments through data edges."""
    frontier = list(batch_args)
    seen: Set[str] = set()
    while frontier:
        for consumer in g.data_children(frontier.pop()):
            if consumer not in seen:
                seen.add(consumer)
                frontier.append(consumer)
    return seen


class _Cuttable:
    """Which tensors may be cut: floating point with a batch-free static shape, plus the
    values and indices of sparse (row-indexed) gradients, which are concatenated over virtual
    nodes instead of averaged. Nothing downstream of a sparse gradient's densification or
    scatter may be cut (that is optimizer math on the whole step's gradient). ``called``: the
    (node, values input, indices input) of functional ops whose functions apply sparse updates
    from those inputs (a loss-scale optimizer's conditional apply of an embedding's rows)."""

    def __init__(self, g: FunctionGraph, dep: Set[str], shapes: Dict[TensorRef, List[int]],
                 called: Sequence[Tuple[str, int, int]] = ()):
        self.g = g
        self.dep = dep
        self.shapes = shapes
        self.sparse: Dict[TensorRef, str] = {}
        self.indices_of: Dict[TensorRef, TensorRef] = {}  # a sparse gradient's values -> its indices
        self.blocked: Set[TensorRef] = set()
        self._flags: Dict[str, List[bool]] = {}
        roots = []
        candidates = sorted(n for op in g.present_ops() if _is_sparse_op(op) for n in g.nodes_of(op)
                            if n in dep and not _batch_sized(g, n, dep))
        sparse_ops = set(candidates)
        rows = []  # (sparse op, its values, its indices)
        for name in candidates:
            roles = _sparse_roles(g, name)
            if roles is not None and not _added_to_dense(g, name, dep, sparse_ops):
                rows.append((name, g.data_inputs(name)[roles[0]], g.data_inputs(name)[roles[1]]))
        rows.extend((name, g.data_inputs(name)[v], g.data_inputs(name)[i]) for name, v, i in called)
        for name, values, indices in rows:
            vals = _walk_back(g, values, _ROWWISE, dep)
            idx = _walk_back(g, indices, _INDEX_PASS, dep)
            if not (_batch_shaped(g, vals) and g.dtype(vals) in FLOAT_TYPES and _batch_shaped(g, idx)):
                continue
            self.sparse[vals] = "concat_scaled"
            self.sparse[idx] = "concat"
            self.indices_of[vals] = idx
            roots.append(name)
        seen: Set[str] = set()
        while roots:
            n = roots.pop()
            if n in seen:
                continue
            seen.add(n)
            for t in g.outputs(n):
                self.blocked.add(t)
                roots.extend(c for c, _ in g.consumers(t))
        self.statistics = _per_example_statistics(g, dep, shapes)

    def outputs(self, name: str) -> List[bool]:
        """Whether each output of node ``name`` may be cut (one pass over its recorded shapes,
        kept: a node with many outputs is asked once per output)."""
        flags = self._flags.get(name)
        if flags is None:
            flags = self._flags[name] = self._node_flags(name)
        return flags

    def _node_flags(self, name: str) -> List[bool]:
        g = self.g
        known = g.recorded_known(name)
        sparse, blocked, shapes = self.sparse, self.blocked, self.shapes
        layout = None
        flags = []
        for i, ref in enumerate(g.outputs(name)):
            if ref in sparse:
                flags.append(True)
                continue
            refined = shapes.get(ref)
            ok = _known(refined) if refined else i < len(known) and known[i]
            if ok and ref not in blocked:  # the dtype is read only for a tensor of known shape
                if layout is None:
                    layout = g.layout(name)
                ok = layout[i][2] in FLOAT_TYPES
            else:
                ok = False
            flags.append(ok)
        return flags

    def __call__(self, ref: TensorRef) -> bool:
        if ref in self.sparse:
            return True
        return not ref.is_function_arg and self.outputs(ref.node)[self.g.flat_index(ref)]


def _per_example_statistics(g: FunctionGraph, dep: Set[str], shapes: Dict[TensorRef, List[int]]) -> Set[TensorRef]:
    """Batch-free tensors that per-example work reads: a batch's mean and variance that batch
    normalization applies to every example, say. A virtual node's gradient combines them with
    its own sums (the gradient of batch norm's scale is a sum times the batch's inverse standard
    deviation), so the average of those gradients is not what the averaged parts would give:
    the cut goes through them only where nothing else separates the batch from a write (a
    moving average assigned the batch statistic itself)."""

    def per_example(ref: TensorRef) -> bool:
        shape = shapes.get(ref) or g.shape(ref)
        return bool(shape) and shape[0] < 0

    returned = {r for _, r in g.output_refs()}

    def read_per_example(name: str) -> List[TensorRef]:
        """The inputs of ``name`` that feed a per-example output something reads (an IdentityN's
        output k forwards its input k alone; an output nothing reads is no work)."""
        outs, ins = g.outputs(name), g.data_inputs(name)
        used = [per_example(t) and (t in returned or bool(g.consumers(t))) for t in outs]
        if g.nodes[name].op == "IdentityN":
            return [i for i, u in zip(ins, used) if u]
        return ins if any(used) else []

    found: Set[TensorRef] = set()
    stack = [ins for ins in (read_per_example(n) for n in dep if n in g.nodes) if ins]
    seen: Set[str] = set()
    while stack:
        for t in stack.pop():
            if t.is_function_arg or t.node not in dep or per_example(t):
                continue
            found.add(t)
            if t.node not in seen:  # a statistic's own inputs are statistics too
                seen.add(t.node)
                stack.append(g.data_inputs(t.node))
    return found


_SAME_SHAPE = {"Identity", "Neg", "Cast", "Square", "Sqrt", "Rsqrt", "Abs", "Sign", "StopGradient", "Snapshot"}
_BROADCASTING = {"Mul", "RealDiv", "AddV2", "Add", "Sub", "Maximum", "Minimum", "DivNoNan", "MulNoNan"}
_ASSIGNS = {"AssignVariableOp", "AssignAddVariableOp", "AssignSubVariableOp"}


def _known(shape: Optional[List[int]]) -> bool:
    return shape is not None and all(d >= 0 for d in shape)


def refine_shapes(g: FunctionGraph, sig: SignatureInfo, writes: Dict[str, List[str]]) -> Dict[TensorRef, List[int]]:
    """Static shapes the exporter left unknown, recovered backwards from variable writes.

    A value assigned to a variable has the variable's shape, and so has whatever reaches it
    through shape-preserving ops (gradients through a Tensordot lose their static shape on
    export, but the update that consumes them does not)."""
    found: Dict[TensorRef, List[int]] = {}
    seen: Set[TensorRef] = set()
    stack: List[TensorRef] = []

    def learn(ref: TensorRef, shape: List[int]) -> None:
        """``ref`` has ``shape``: recorded when the export left it unknown (and it agrees with
        what was recorded), and followed further up either way (an update's known shape
        carries through to the gradient it is computed from)."""
        if ref in seen:
            return
        recorded = g.shape(ref)
        if not _known(recorded):
            if recorded is not None and (len(recorded) != len(shape) or
                                         any(0 <= d != e for d, e in zip(recorded, shape))):
                return
            found[ref] = shape
        seen.add(ref)
        stack.append(ref)

    for res, ws in writes.items():
        vshape = sig.variables[res].shape if res in sig.variables else None
        if not _known(vshape):
            continue
        for w in ws:
            if g.nodes[w].op in _ASSIGNS:
                learn(g.data_inputs(w)[1], vshape)
    while stack:
        ref = stack.pop()
        if ref.is_function_arg:
            continue
        op, shape = g.nodes[ref.node].op, found.get(ref) or g.shape(ref)
        inputs = g.data_inputs(ref.node)
        if op in _SAME_SHAPE:
            learn(inputs[0], shape)
        elif op == "IdentityN":
            learn(inputs[ref.index], shape)
        elif op in _BROADCASTING and len(inputs) == 2:
            for mine, other in ((inputs[0], inputs[1]), (inputs[1], inputs[0])):
                s, o = g.shape(mine), found.get(other) or g.shape(other)
                if (s is not None and len(s) == len(shape)) or (s is None and o == []):
                    learn(mine, shape)
    _forward_shapes(g, found)
    return found


def _forward_shapes(g: FunctionGraph, found: Dict[TensorRef, List[int]]) -> None:
    """Carry recovered shapes forward through shape-preserving and broadcasting ops (the square
    of a gradient whose shape was recovered, for a norm, has that shape too)."""
    import numpy as np

    def known(ref: TensorRef) -> Optional[List[int]]:
        shape = found.get(ref) or g.shape(ref)
        return shape if _known(shape) else None

    for name in g.topological_order():
        op = g.nodes[name].op
        if op not in _SAME_SHAPE and op not in _BROADCASTING:
            continue
        out, inputs = g.outputs(name), g.data_inputs(name)
        if len(out) != 1 or out[0] in found or _known(g.shape(out[0])):
            continue
        shapes = [known(i) for i in (inputs[:1] if op in _SAME_SHAPE else inputs)]
        if not shapes or any(s is None for s in shapes):
            continue
        try:
            shape = list(np.broadcast_shapes(*map(tuple, shapes)))
        except ValueError:
            continue
        recorded = g.shape(out[0])
        if recorded is None or (len(recorded) == len(shape) and all(d < 0 or d == e for d, e in zip(recorded, shape))):
            found[out[0]] = shape


# Ops that sum rows of a sparse gradient into a variable's shape: (values input, indices input).
_SPARSE_INPUTS = {"UnsortedSegmentSum": ("data", "segment_ids"), "ResourceScatterAdd": ("updates", "indices"),
                  "ResourceScatterSub": ("updates", "indices")}
_SPARSE_DENSIFY = {"UnsortedSegmentSum"}  # rows summed into a dense tensor of the variable's shape
_ROWWISE = {"Identity", "Square", "Neg", "Cast", "Mul", "RealDiv", "Sqrt", "Abs", "Minimum", "Maximum", "ClipByValue"}
_INDEX_PASS = {"Identity", "Cast"}


def _is_sparse_op(op: str) -> bool:
    return op in _SPARSE_INPUTS or op.startswith("ResourceSparseApply")


def _sparse_roles(g: FunctionGraph, name: str) -> Optional[Tuple[int, int]]:
    op = g.nodes[name].op
    if op in _SPARSE_INPUTS:
        want = _SPARSE_INPUTS[op]
    elif op.startswith("ResourceSparseApply"):
        want = ("grad", "indices")
    else:
        return None
    from tensorflow.python.framework import op_def_registry

    names = [a.name for a in op_def_registry.get(op).input_arg]
    return names.index(want[0]), names.index(want[1])


_SUMS = {"AddN", "AddV2", "Add"}


def _batch_sized(g: FunctionGraph, name: str, dep: Set[str]) -> bool:
    """Whether sparse op ``name`` sums rows into a tensor whose size is computed from the batch
    (its segment count read from a batch-dependent shape): the gradient of a gather from an
    activation (DeBERTa's relative-position attention), which is per-example work, not a
    variable's gradient, so nothing marks its rows as cut or blocks what follows it."""
    if g.nodes[name].op not in _SPARSE_DENSIFY:
        return False
    from tensorflow.python.framework import op_def_registry

    names = [a.name for a in op_def_registry.get(g.nodes[name].op).input_arg]
    size = g.data_inputs(name)[names.index("num_segments")]
    return not size.is_function_arg and size.node in dep


def _added_to_dense(g: FunctionGraph, name: str, dep: Set[str], sparse_ops: Set[str]) -> bool:
    """Whether the rows sparse op ``name`` sums into a dense tensor are then added to a dense,
    batch-dependent gradient: a variable used both as a lookup table and as a weight (a token
    embedding tied to the output projection) gets the sum of both, which is dense, so it is
    averaged like any dense gradient rather than concatenated as rows."""
    if g.nodes[name].op not in _SPARSE_DENSIFY:
        return False
    frontier, seen = [name], {name}
    while frontier:
        n = frontier.pop()
        for t in g.outputs(n):
            for c, _ in g.consumers(t):
                if c in seen:
                    continue
                seen.add(c)
                op = g.nodes[c].op
                if op in _INDEX_PASS:
                    frontier.append(c)
                elif op in _SUMS and any(not i.is_function_arg and i.node in dep and i.node not in seen
                                         and i.node not in sparse_ops for i in g.data_inputs(c)):
                    return True
    return False


def _batch_shaped(g: FunctionGraph, ref: TensorRef) -> bool:
    shape = g.shape(ref)
    return bool(shape) and shape[0] < 0


def _walk_back(g: FunctionGraph, ref: TensorRef, through: Set[str], dep: Set[str]) -> TensorRef:
    """Follow ``ref`` up through row-wise ops that have exactly one batch-shaped input."""
    while not ref.is_function_arg and g.nodes[ref.node].op in through:
        batchy = [t for t in g.data_inputs(ref.node)
                  if (t.is_function_arg or t.node in dep) and _batch_shaped(g, t)]
        if len(batchy) != 1:
            break
        ref = batchy[0]
    return ref


def training_signature(item: GraphItem, key: str = "") -> SignatureInfo:
    """Training signature ``key`` of ``item`` (default: 'train', or the one found);
    DetectionError naming the signatures there are when there is none."""
    sig = item.training_signature(key or None)
    if sig is None:
        known = ", ".join(sorted(item.signatures)) or "none"
        want = repr(key) if key else "'train'"
        raise DetectionError(f"{item.source}: no training signature {want} (signatures: {known}); "
                             "export one named 'train' or pass --train-signature NAME")
    return sig


def check_batch_inputs(g: FunctionGraph, sig: SignatureInfo) -> None:
    """Every training input needs a leading batch dimension."""
    if not sig.batch_args:
        raise DetectionError(f"signature {sig.key!r}: function {g.name!r} has no batch inputs")
    for a in sig.batch_args:
        shape = g.arg_shape(a)
        if shape is None or not shape:
            raise DetectionError(
                f"signature {sig.key!r}: input {sig.input_keys.get(a, a)!r} has no batch dimension "
                f"(shape {shape}); every training input needs a leading batch dimension")


def analyze_train_step(g: FunctionGraph, sig: SignatureInfo) -> TrainStep:
    """Find the cut of ``g`` (the training signature's function)."""
    check_batch_inputs(g, sig)
    writes, functional, summaries = _variable_writes(g, sig)
    order = {r: i for i, r in enumerate(sig.resource_args)}
    dep = batch_dependent_nodes(g, sig.batch_args)
    sinks = list(dict.fromkeys(w for ws in writes.values() for w in ws if w in dep))
    if not sinks:
        raise DetectionError(
            f"signature {sig.key!r}: no variable update depends on the batch, so {g.name!r} is not a "
            "training step; pass --train-signature to name the training signature")

    shapes = refine_shapes(g, sig, writes)
    called = [(n, v, i) for n in functional if n in dep
              for v, i in summaries.sparse_inputs(g, n, _sparse_roles, _ROWWISE, _INDEX_PASS)]
    cuttable = _Cuttable(g, dep, shapes, called)
    flow = _FlowGraph(g, sig, dep, cuttable, sinks)
    earliest = flow.gradient_cut()
    if earliest is None:
        raise DetectionError(_unbounded_message(g, sig, _nx_flow_graph(g, sig, dep, cuttable, sinks), sinks))
    cut_refs = _through_shape_ops(g, cuttable, earliest)
    vnode_nodes = flow.region(set(cut_refs))
    reached = [w for w in sinks if w in vnode_nodes]
    if reached:
        raise DetectionError(f"signature {sig.key!r}: could not separate the update {reached[0]!r} from the "
                             "per-example computation")
    _check_one_phase(g, sig, writes, set(sinks), vnode_nodes)
    reach = _write_reach(g, cut_refs, writes, vnode_nodes, summaries, functional)
    forward = g.reachable([r.node for _, r in g.output_refs() if not r.is_function_arg],
                          lambda n: [t.node for t in g.data_inputs(n)])
    forward_reads = _forward_read_args(g, forward | vnode_nodes)
    cut: List[CutTensor] = []
    for ref in cut_refs:
        combine = cuttable.sparse.get(ref, "mean")
        # (a sparse gradient's values update what its indices do, whichever reaches the update first)
        fed = reach.get(ref) or reach.get(cuttable.indices_of.get(ref), [])
        c = CutTensor(ref=ref, dtype=g.dtype(ref), shape=shapes.get(ref) or g.shape(ref) or [], writes=fed,
                      combine=combine)
        # a gradient feeds a variable the forward reads (a statistic feeds only others: a moving
        # mean); of the same shape where one is (a slice's gradient, as of a position table, is not)
        grads_of = [r for r in fed if r in forward_reads]
        same = [r for r in grads_of if combine != "mean" or _same_shape(sig.variables[r].shape, c.shape)]
        if combine == "concat":
            c.role = "indices"
        elif grads_of:
            c.variable = (same or grads_of)[0]  # the nearest parameter
        else:
            c.role = "statistic"
        c.writes = sorted(fed, key=lambda r: order.get(r, 1 << 30))
        cut.append(c)
    cut.sort(key=lambda c: (order.get(c.variable, 1 << 30) if c.variable else 1 << 30,
                            min((order.get(w, 1 << 30) for w in c.writes), default=1 << 30), str(c.ref)))

    _check_conditions(g, sig, cut, [w for w in sinks if w in functional], vnode_nodes)
    counts = reduction.BatchCounts(g, dep, sig.batch_args, shapes)
    summed = _loss_reduction(g, sig, counts, vnode_nodes, cut, shapes) == "sum"
    for c in cut:  # (a sparse gradient's rows are a gradient whatever variable they are matched to)
        c.averaged = not (summed and (c.role in ("gradient", "indices") or c.combine == "concat_scaled"))
    outputs = _plan_outputs(g, sig, counts, dep, vnode_nodes)
    return TrainStep(signature=sig, function=g.name, cut=cut, vnode_nodes=vnode_nodes, writes=writes,
                     outputs=outputs, batch_dependent=dep, loss_reduction="sum" if summed else "mean")


def _plan_outputs(g: FunctionGraph, sig: SignatureInfo, counts: "reduction.BatchCounts", dep: Set[str],
                  vnode_nodes: Set[str]) -> List[OutputPlan]:
    """How each output of the step combines over virtual nodes: computed once by the update, or
    per virtual node and averaged (summed, for a sum over the batch), concatenated along a
    batch dimension, or the last virtual node's value."""
    outputs: List[OutputPlan] = []
    for out_name, ref in g.output_refs():
        if ref.is_function_arg:
            side = "vnode" if ref.node in sig.batch_args else "update"
        else:
            side = "vnode" if ref.node in vnode_nodes else "update"
        shape = g.shape(ref)
        combine = "mean"
        if side == "vnode" and (shape is None or (shape and shape[0] < 0) or g.dtype(ref) not in FLOAT_TYPES):
            combine = "concat" if shape and shape[0] < 0 else "last"
        plan = OutputPlan(out_name, ref, side, combine)
        if side == "vnode" and combine == "mean" and not ref.is_function_arg:
            plan.averaged = not reduction.sums_over_batch(g, counts, ref, lambda t: _batch_shaped(g, t),
                                                          lambda t: t.node in dep)
        outputs.append(plan)
    return outputs


def _variable_writes(g: FunctionGraph, sig: SignatureInfo) -> Tuple[Dict[str, List[str]], List[str], calls.Calls]:
    """The nodes that write each resource argument (in the signature's order); the functional
    ops among them (an ``If`` whose branches apply the update: a loss-scale optimizer's, Keras'
    gradient accumulation), and what their functions write (:mod:`vfgraph.analysis.calls`)."""
    found: Dict[str, List[str]] = {}
    functional: List[str] = []
    writing = {op: is_write(op) for op in g.present_ops()}
    summaries = calls.Calls(g.library, is_write, resource_root)

    def root(name: str, op: str, ref: TensorRef) -> str:
        res = resource_root(g, ref)
        if res is None:
            raise DetectionError(f"signature {sig.key!r}: variable write {name!r} ({op}) does not write a captured "
                                 "variable; vfgraph cannot tell which variable it updates")
        return res

    for name, op in g.op_types().items():
        if writing[op] and g.inputs(name):
            found.setdefault(root(name, op, g.data_inputs(name)[0]), []).append(name)
        elif calls.is_functional(op):
            inputs = g.data_inputs(name)
            written = sorted(summaries.written(g, name))
            functional.extend([name] if written else [])
            for w in written:
                ws = found.setdefault(root(name, op, inputs[w]), [])
                if name not in ws:
                    ws.append(name)
    order = {r: i for i, r in enumerate(sig.resource_args)}
    return {r: found[r] for r in sorted(found, key=lambda r: (order.get(r, 1 << 30), r))}, functional, summaries


def _check_conditions(g: FunctionGraph, sig: SignatureInfo, cut: List[CutTensor], conditional: List[str],
                      vnode_nodes: Set[str]) -> None:
    """Refuse an update under a condition (or branch index) computed from a cut tensor that is
    not a gradient: the update runs once, on the virtual nodes' average of that value, which is
    the batch's own only for gradients (a loss-scale optimizer's finite check of the gradients
    is; a condition on the batch's largest value is not). A sparse gradient's rows and indices
    are a gradient's too."""
    gradient = {c.ref: c.role != "statistic" or c.combine != "mean" for c in cut}
    for name in conditional:
        op = g.nodes[name].op
        stack = list(g.data_inputs(name)[:calls.leading_inputs(op)])
        seen = set(stack)
        while stack:
            t = stack.pop()
            if not gradient.get(t, True):
                raise DetectionError(
                    f"signature {sig.key!r}: the update {name!r} ({op}) runs under a condition computed from {t}, "
                    "a value of the batch that is not a gradient; vfgraph would decide it on the virtual nodes' "
                    "average of that value, not on the batch's: compute the condition from the gradients, or "
                    "apply the update unconditionally")
            if t in gradient or t.is_function_arg or t.node in vnode_nodes:
                continue
            for i in g.data_inputs(t.node):
                if i not in seen:
                    seen.add(i)
                    stack.append(i)


class DependentUpdates(DetectionError):
    """A step whose per-example work reads variables an earlier update of the same step wrote:
    ``reads`` are those reads (ReadVariableOp nodes), ``updates`` the (earlier write, later
    write) pairs the message names. Split into phases by :mod:`vfgraph.analysis.phases`."""

    def __init__(self, message: str, reads: List[str]):
        super().__init__(message)
        self.reads = reads


def _check_one_phase(g: FunctionGraph, sig: SignatureInfo, writes: Dict[str, List[str]], sinks: Set[str],
                     vnode_nodes: Set[str]) -> None:
    """Refuse (:class:`DependentUpdates`) a step whose per-example work reads a variable the same
    step updated before it (a GAN's generator loss through the discriminator it just updated):
    each virtual node would read the value before the update, which runs once after them all.
    Reads by the update itself (EMA of the new weights) are what the step computes once, and so
    are reads after writes that do not depend on the batch (a dropout seed's counter)."""
    def variable(res: str) -> str:  # (a variable captured twice is two arguments of one name)
        return sig.variables[res].name if res in sig.variables else res

    bit: Dict[str, int] = {}
    for r in writes:
        bit.setdefault(variable(r), 1 << len(bit))
    write_of = {w: variable(r) for r, ws in writes.items() for w in ws if w in sinks}
    before: Dict[str, int] = {}  # node -> the variables written before it (a bit each)
    found: List[Tuple[str, str, str]] = []  # (read, variable, the write before it)
    for name in g.topological_order():
        mask = 0
        for t, _ in g.inputs(name):  # (data and control inputs; arguments are in no ``before``)
            if t.node in before:
                mask |= before[t.node] | bit.get(write_of.get(t.node, ""), 0)
        before[name] = mask
        if not mask or g.nodes[name].op != "ReadVariableOp":
            continue
        res = resource_root(g, g.data_inputs(name)[0])
        if res is None or not mask & bit.get(variable(res), 0):
            continue
        if any(c in vnode_nodes for t in g.outputs(name) for c, _ in g.consumers(t)):
            found.append((name, variable(res), next(w for w, v in write_of.items() if v == variable(res))))
    if not found:
        return
    read, var, earlier = found[0]
    reads = {r for r, _, _ in found}
    later = _write_reached_from(g, reads, sinks) or "a later update"
    raise DependentUpdates(
        f"signature {sig.key!r}: the update {later!r} comes from a loss that reads {var} after the update "
        f"{earlier!r} wrote it in the same step (read by {read!r}; two dependent updates, as a GAN's "
        "discriminator then generator)", sorted(reads))


def _write_reached_from(g: FunctionGraph, reads: Set[str], sinks: Set[str]) -> str:
    """The first batch-dependent write (in stored order) whose inputs reach back to ``reads``."""
    kids: Dict[str, List[str]] = {}
    for n in g.nodes:
        for t, _ in g.inputs(n):
            kids.setdefault(t.node, []).append(n)
    after = g.reachable(reads, lambda n: kids.get(n, ()))
    return next((w for w in g.nodes if w in sinks and w in after), "")


def _loss_reduction(g: FunctionGraph, sig: SignatureInfo, counts: "reduction.BatchCounts", vnode_nodes: Set[str],
                    cut: List[CutTensor], shapes: Dict[TensorRef, List[int]]) -> str:
    """"mean" when the gradients are divided by the number of examples (averaged over virtual
    nodes), "sum" when no batch-dependent scalar scales them (summed); a DetectionError naming
    the scalar when they are divided by a batch-dependent value and no count (vnodes cannot
    give the full batch's gradient). See :mod:`vfgraph.analysis.reduction`."""
    targets = {c.ref.node for c in cut if c.role == "gradient" and not c.ref.is_function_arg}
    sized, valued = reduction.batch_scalars(g, counts, vnode_nodes, shapes)
    if reduction.first_reaching(g, sized, targets, vnode_nodes) is not None:
        return "mean"
    value = reduction.first_reaching(g, valued, targets, vnode_nodes)
    if value is not None:
        raise DetectionError(f"signature {sig.key!r}: the gradients are scaled by {value}, a scalar computed from "
                             "the batch's values and not from its size (a loss normalised by a sum of sample "
                             "weights, say), so neither averaging nor summing virtual nodes' gradients gives the "
                             "full batch's; reduce the loss over the batch with a mean or a sum")
    return "sum"


_SHAPE_ONLY = {"Identity", "Snapshot", "Reshape", "Squeeze", "ExpandDims"}


def _through_shape_ops(g: FunctionGraph, cuttable: "_Cuttable", cut: List[TensorRef]) -> List[TensorRef]:
    """Each cut tensor moved down through the ops that only reshape or rename it (its one
    consumer; an average commutes with them) or widen its floating-point type, so that a
    gradient is cut in its variable's shape where the step reshapes it on the way, and the
    gradients an ``IdentityN`` passes on together (Keras' optimizer step) are cut where it
    passes them, so that the update reads each variable's gradient on its own (pipeline stages
    split the update by variable)."""
    # (down to an IdentityN's inputs, through it, and on from its outputs)
    return _descend(g, cuttable, _through_identity_n(g, cuttable, _descend(g, cuttable, cut)))


def _descend(g: FunctionGraph, cuttable: "_Cuttable", cut: List[TensorRef]) -> List[TensorRef]:
    """Each of ``cut`` moved down through its one consumer while that only reshapes, renames or
    widens it."""
    out = []
    for ref in cut:
        while not ref.is_function_arg and ref not in cuttable.sparse:
            consumers = g.consumers(ref)
            if len(consumers) != 1:
                break
            node = consumers[0][0]
            if not (g.nodes[node].op in _SHAPE_ONLY or _widening(g, node)) or g.data_inputs(node)[0] != ref:
                break
            nxt = g.outputs(node)[0]
            if not cuttable(nxt):
                break
            ref = nxt
        out.append(ref)
    return sorted(set(out))


_FLOAT_BITS = {types_pb2.DT_HALF: 16, types_pb2.DT_BFLOAT16: 16, types_pb2.DT_FLOAT: 32, types_pb2.DT_DOUBLE: 64}


def _widening(g: FunctionGraph, node: str) -> bool:
    """Whether ``node`` casts a floating-point tensor to a wider floating-point type (a mixed
    precision gradient to its variable's float32): its average is then taken in the wider type."""
    n = g.nodes[node]
    if n.op != "Cast":
        return False
    src, dst = _FLOAT_BITS.get(n.attr["SrcT"].type, 0), _FLOAT_BITS.get(n.attr["DstT"].type, 0)
    return 0 < src < dst


def _through_identity_n(g: FunctionGraph, cuttable: "_Cuttable", cut: List[TensorRef]) -> List[TensorRef]:
    """``cut`` with the inputs of each ``IdentityN`` that passes on only cut tensors replaced
    by its outputs that are read, where nothing else reads those inputs (but a dead Identity)."""
    cut_set = set(cut)
    readers = sorted({c for ref in cut for c, _ in g.consumers(ref) if g.nodes[c].op == "IdentityN"})
    if not readers:
        return cut
    needed = ({n for name in g.nodes for n in g.control_inputs(name)} | {r.node for _, r in g.output_refs()}
              | set(g.header.control_ret.values()))

    def dead(node: str) -> bool:  # an Identity nothing reads (the exporter leaves some)
        return (g.nodes[node].op in _SAME_SHAPE and node not in needed
                and not any(g.consumers(t) for t in g.outputs(node)))

    for node in readers:
        inputs = g.data_inputs(node)
        mine = [t for t in inputs if t in cut_set]
        if any(t not in cut_set and (t.is_function_arg or t.node in cuttable.dep) for t in inputs):
            continue
        if any(c != node and not dead(c) for t in mine for c, _ in g.consumers(t)):
            continue
        used = [t for t in g.outputs(node) if g.consumers(t)]
        if not all(inputs[g.flat_index(t)] in cut_set and cuttable(t) for t in used):
            continue
        cut_set.difference_update(mine)
        cut_set.update(used)
    return sorted(cut_set)


class _FlowGraph:
    """The flow network the cut is found in, over integer vertices.

    Vertices: the source, the sink, ``("op", name)`` for every batch-dependent node, and
    ``("in", t)`` -> ``("out", t)`` for every cuttable tensor ``t`` they produce (an
    uncuttable tensor, and a batch argument, has only its "out" vertex). Every edge has
    unbounded capacity except ``in -> out`` (capacity 1, or more than all the others together
    for a per-example statistic: see ``_per_example_statistics``); every batch-dependent variable write
    feeds the sink. A node with one output (most of them) shares its vertex with that
    output's "in" (``("op+in", name, t)``, cuttable) or "out" (``("op+out", name, t)``): the
    edge between them is the only edge of either end, so merging them changes no cut, no
    region, and the network has a third fewer vertices.
    """

    def __init__(self, g: FunctionGraph, sig: SignatureInfo, dep: Set[str], cuttable: "_Cuttable",
                 sinks: List[str]):
        self.keys: List[tuple] = [("source", None), ("sink", None)]
        self.succ: List[List[int]] = [[], []]
        self.unit = bytearray(2)  # 1 for an "in" vertex whose one edge (to "out") has a finite capacity
        self.costly: Set[int] = set()  # "in" vertices of per-example statistics: cut only where nothing else does
        self._op: Dict[str, int] = {}
        self._in: Dict[TensorRef, int] = {}
        self._out: Dict[TensorRef, int] = {}
        batch = set(sig.batch_args)
        for a in sig.batch_args:
            self.succ[0].append(self._vertex(self._out, TensorRef(a), "out"))
        to_sink = set(sinks)
        # The common cases written out (this loop runs once per batch-dependent node and input).
        keys, succ, unit, out_ids = self.keys, self.succ, self.unit, self._out
        for name in (n for n in g.nodes if n in dep):  # stored order: producers before consumers, mostly
            outs = g.outputs(name)
            if len(outs) == 1 and name not in to_sink:
                t = outs[0]
                o = out_ids.get(t)
                if cuttable.outputs(name)[0]:
                    if o is None:
                        o = out_ids[t] = len(keys)
                        keys.append(("out", t))
                        succ.append([])
                        unit.append(0)
                    op = self._in[t] = len(keys)
                    keys.append(("op+in", name, t))
                    succ.append([o])
                    unit.append(1)
                    if t in cuttable.statistics:
                        self.costly.add(op)
                elif o is None:
                    op = out_ids[t] = len(keys)
                    keys.append(("op+out", name, t))
                    succ.append([])
                    unit.append(0)
                else:
                    op = o
                    keys[op] = ("op+out", name, t)
                self._op[name] = op
            else:
                op = self._vertex(self._op, name, "op")
                for t, cuttable_t in zip(outs, cuttable.outputs(name)):
                    o = self._vertex(out_ids, t, "out")
                    if cuttable_t:
                        i = self._vertex(self._in, t, "in")
                        succ[op].append(i)
                        succ[i].append(o)
                        unit[i] = 1
                        if t in cuttable.statistics:
                            self.costly.add(i)
                    else:  # "in" and "out" of an uncuttable tensor are one vertex (the edge between is unbounded)
                        succ[op].append(o)
            for t, ctl in g.inputs(name):
                if ctl or (t.node not in dep if t.arg is not None else t.node not in batch):
                    continue
                o = out_ids.get(t)
                if o is None:
                    o = out_ids[t] = len(keys)
                    keys.append(("out", t))
                    succ.append([op])
                    unit.append(0)
                else:
                    succ[o].append(op)
        for w in sinks:
            self.succ[self._op[w]].append(1)
        self.pred: List[List[int]] = [[] for _ in self.keys]
        for u, vs in enumerate(self.succ):
            for v in vs:
                self.pred[v].append(u)

    def _vertex(self, ids: dict, key, side: str) -> int:
        """The vertex of ``key`` in ``ids`` (op names, "in" or "out" tensors); labelled (side, key)."""
        i = ids.get(key)
        if i is None:
            i = ids[key] = len(self.keys)
            self.keys.append((side, key))
            self.succ.append([])
            self.unit.append(0)
        return i

    # ------------------------------------------------------------------ minimum cut
    def _closure(self, start: int, edges: List[List[int]], forward: bool) -> bytearray:
        """Vertices reached from ``start`` through unbounded edges only."""
        seen = bytearray(len(self.keys))
        seen[start] = 1
        stack = [start]
        unit = self.unit
        while stack:
            u = stack.pop()
            if forward and unit[u]:
                continue
            for v in edges[u]:
                if not seen[v] and not (not forward and unit[v]):
                    seen[v] = 1
                    stack.append(v)
        return seen

    def gradient_cut(self) -> Optional[List[TensorRef]]:
        """The cut tensors of the minimum cut closest to the source (None: no finite cut).

        Of the smallest sets of batch-free tensors that separate the batch from every variable
        write, this is the earliest: the first tensors where the per-example work has been
        summed (the gradients of the loss, the batch statistics), before whatever the step
        then does with them (learning-rate scaling, clipping by value, norm or global norm,
        loss-scale unscaling and checks, accumulation). Averaging anything later would run
        that nonlinear work once per virtual node instead of once on the batch's value.

        Every finite cut keeps what the source reaches through unbounded edges on the source
        side and what reaches the sink that way on the sink side, so both are contracted
        first; the maximum flow then runs on the rest, and the source side is what the source
        still reaches in its residual network (the same for every maximum flow)."""
        n = len(self.keys)
        head = self._closure(0, self.succ, True)
        tail = self._closure(1, self.pred, False)
        if any(a and b for a, b in zip(head, tail)):
            return None
        # The contracted network: vertex 0 is the source, 1 the sink, then the rest.
        local = [-1] * n
        rest = [u for u in range(n) if not head[u] and not tail[u]]
        for k, u in enumerate(rest):
            local[u] = k + 2
        for u in range(n):
            if head[u]:
                local[u] = 0
            elif tail[u]:
                local[u] = 1
        m = len(rest) + 2
        adj: List[List[int]] = [[] for _ in range(m)]
        to: List[int] = []
        cap: List[int] = []
        costly = sum(self.unit) + 1  # one statistic costs more than every other tensor together
        big = costly * (len(self.costly) + 1)
        for u in range(n):
            a = local[u]
            if a == 1:
                continue  # out of the sink
            c = (costly if u in self.costly else 1) if self.unit[u] else big
            for v in self.succ[u]:
                b = local[v]
                if b != 0 and a != b:  # not into the source, no loops
                    add_flow_edge(adj, to, cap, a, b, c)
        _max_flow(m, adj, to, cap)
        # Vertices the source still reaches in the residual network.
        reached = bytearray(m)
        reached[0] = 1
        stack = [0]
        while stack:
            v = stack.pop()
            for e in adj[v]:
                w = to[e]
                if not reached[w] and cap[e] > 0:
                    reached[w] = 1
                    stack.append(w)
        source_side = [bool(head[u]) or (local[u] > 1 and bool(reached[local[u]])) for u in range(n)]
        found = set()
        for u in range(n):
            if self.unit[u] and source_side[u] and not source_side[self.succ[u][0]]:
                found.add(self.keys[u][-1])
        return sorted(found)

    def region(self, cut: Set[TensorRef]) -> Set[str]:
        """Ops reachable from the batch without crossing the cut: the per-virtual-node part."""
        stop = bytearray(len(self.keys))
        for t in cut:
            i = self._in.get(t)
            if i is not None:
                stop[i] = 1
        seen = bytearray(len(self.keys))
        seen[0] = 1
        stack = [0]
        while stack:
            u = stack.pop()
            if stop[u]:
                continue
            for v in self.succ[u]:
                if not seen[v]:
                    seen[v] = 1
                    stack.append(v)
        return {key[1] for u, key in enumerate(self.keys) if seen[u] and key[0] in _OP_VERTICES}


def add_flow_edge(adj: List[List[int]], to: List[int], cap: List[int], a: int, b: int, c: int) -> None:
    """Add edge ``a -> b`` of capacity ``c``, and its residual ``b -> a`` of capacity 0, to the
    flow network ``(adj, to, cap)`` that :func:`_max_flow` reads: edge ``e`` goes to ``to[e]``
    with capacity ``cap[e]``, ``adj[u]`` lists the edges leaving ``u``, and ``e ^ 1`` is ``e``'s
    residual."""
    adj[a].append(len(to))
    to.append(b)
    cap.append(c)
    adj[b].append(len(to))
    to.append(a)
    cap.append(0)


def _max_flow(n: int, adj: List[List[int]], to: List[int], cap: List[int]) -> int:
    """Dinic's maximum flow from vertex 0 to vertex 1; leaves the residual capacities in
    ``cap`` (edge ``e``'s reverse is ``e ^ 1``)."""
    total = 0
    while True:
        level = [-1] * n
        level[0] = 0
        queue = [0]
        for u in queue:
            lu = level[u] + 1
            for e in adj[u]:
                v = to[e]
                if level[v] < 0 and cap[e] > 0:
                    level[v] = lu
                    queue.append(v)
        if level[1] < 0:
            return total
        it = [0] * n
        while True:
            path: List[int] = []
            u = 0
            while u != 1:
                edges, k = adj[u], it[u]
                lu = level[u] + 1
                while k < len(edges):
                    e = edges[k]
                    if cap[e] > 0 and level[to[e]] == lu:
                        break
                    k += 1
                it[u] = k
                if k < len(edges):
                    path.append(edges[k])
                    u = to[edges[k]]
                    continue
                if not path:
                    break  # blocking flow found
                level[u] = -1  # dead end
                e = path.pop()
                u = to[e ^ 1]
                it[u] += 1
            if u != 1:
                break
            f = min(cap[e] for e in path)
            for e in path:
                cap[e] -= f
                cap[e ^ 1] += f
            total += f


def _nx_flow_graph(g: FunctionGraph, sig: SignatureInfo, dep: Set[str], cuttable: Callable[[TensorRef], bool],
                   sinks: List[str]) -> nx.DiGraph:
    """The flow network as a networkx graph (to describe why there is no finite cut)."""
    flow = nx.DiGraph()
    for a in sig.batch_args:
        flow.add_edge(_SRC, ("out", TensorRef(a)))
    for name in dep:
        op = ("op", name)
        for t in g.data_inputs(name):
            if t.is_function_arg and t.node not in sig.batch_args:
                continue
            if not t.is_function_arg and t.node not in dep:
                continue
            flow.add_edge(("out", t), op)
        for t in g.outputs(name):
            flow.add_edge(op, ("in", t))
            if cuttable(t):
                flow.add_edge(("in", t), ("out", t), capacity=1)
            else:
                flow.add_edge(("in", t), ("out", t))
    for w in sinks:
        flow.add_edge(("op", w), _SNK)
    return flow


def _same_shape(a: Optional[List[int]], b: Optional[List[int]]) -> bool:
    """Equal up to dimensions of size 1 (a bias gradient summed with keepdims)."""
    return a is not None and b is not None and [d for d in a if d != 1] == [d for d in b if d != 1]


def _write_reach(g: FunctionGraph, cut_refs: List[TensorRef], writes: Dict[str, List[str]],
                 vnode_nodes: Set[str], summaries: Optional[calls.Calls] = None,
                 functional: Sequence[str] = ()) -> Dict[TensorRef, List[str]]:
    """For each cut tensor, the resource args whose updates it is the nearest cut tensor to
    (of ``functional`` ops, which write variables inside the functions they call, a variable
    goes to the cut tensor nearest to a write of it, counting the ops outside and inside)."""
    arrivals: Dict[str, Dict[int, Tuple[int, TensorRef]]] = {n: {} for n in functional}
    write_res = {w: r for r, ws in writes.items() for w in ws if w not in arrivals}
    reads_after: Dict[str, List[TensorRef]] = {}
    for name in g.nodes_of("ReadVariableOp"):
        if name not in vnode_nodes:
            res = resource_root(g, g.data_inputs(name)[0])
            if res in writes:
                reads_after.setdefault(res, []).extend(g.outputs(name))
    # One breadth-first pass from all cut tensors at once: every tensor downstream takes the
    # label of the nearest cut tensor, and each variable is claimed by the first label that
    # reaches one of its writes (linear in the size of the update, not quadratic).
    label: Dict[TensorRef, TensorRef] = {ref: ref for ref in cut_refs}
    depth: Dict[TensorRef, int] = dict.fromkeys(cut_refs, 0)
    out: Dict[TensorRef, List[str]] = {ref: [] for ref in cut_refs}
    claimed: Set[str] = set()
    frontier = deque(cut_refs)
    while frontier:
        t = frontier.popleft()
        src = label[t]
        for consumer, slot in g.consumers(t):
            if consumer in vnode_nodes:
                # Every path out of the per-virtual-node part leaves through a cut tensor, which
                # is labelled already (distance 0): walking it changes no claim.
                continue
            if consumer in arrivals:  # (breadth first: the first arrival at an input is the nearest)
                arrivals[consumer].setdefault(slot, (depth[t], src))
            res = write_res.get(consumer)
            if res is not None and res not in claimed:
                claimed.add(res)
                out[src].append(res)
                # Optimizers write a slot, then read it back for the parameter update.
                for r in reads_after.get(res, []):
                    if r not in label:
                        label[r], depth[r] = src, depth[t] + 1
                        frontier.append(r)
            outs = g.outputs(consumer)
            if g.op_types()[consumer] == "IdentityN":  # output k forwards input k only
                outs = [outs[slot]]
            for o in outs:
                if o not in label:
                    label[o], depth[o] = src, depth[t] + 1
                    frontier.append(o)
    inside: Dict[str, Tuple[int, TensorRef]] = {}  # resource -> (fewest ops to a write of it, cut tensor)
    for name, seeds in sorted(arrivals.items()):
        inputs = g.data_inputs(name)
        for slot, (d, src) in sorted(summaries.nearest(g, name, seeds).items()):
            res = resource_root(g, inputs[slot])
            if d < inside.get(res, (1 << 30,))[0]:
                inside[res] = (d, src)
    for res, (_, src) in sorted(inside.items(), key=lambda kv: (kv[1][0], kv[0])):
        if res not in claimed:
            claimed.add(res)
            out[src].append(res)
    return out


def _forward_read_args(g: FunctionGraph, vnode_nodes: Set[str]) -> Set[str]:
    """Resource args read by the forward pass (the model's parameters)."""
    found = set()
    for name in g.nodes_of("ReadVariableOp"):
        if any(c in vnode_nodes for c, _ in g.consumers(g.outputs(name)[0])):
            res = resource_root(g, g.data_inputs(name)[0])
            if res:
                found.add(res)
    return found


def _unbounded_message(g, sig, flow, sinks) -> str:
    path = None
    for w in sinks:
        sub = nx.DiGraph((u, v) for u, v, d in flow.edges(data=True) if "capacity" not in d)
        if sub.has_node(_SRC) and sub.has_node(("op", w)) and nx.has_path(sub, _SRC, ("op", w)):
            path = (w, nx.shortest_path(sub, _SRC, ("op", w)))
            break
    if path is None:
        return f"signature {sig.key!r}: the gradients of {g.name!r} could not be separated from the update"
    w, p = path
    tensors = [str(n[1]) for n in p if isinstance(n, tuple) and n[0] == "in"]
    op = g.nodes[w].op
    if calls.is_functional(op):
        return (f"signature {sig.key!r}: the update {w!r} ({op}) runs on values of the batch that cannot be "
                f"averaged over virtual nodes ({', '.join(tensors[-3:])}: not floating point, or shaped by the "
                "batch), so its condition or inputs come from per-example values, not from the gradients; "
                "compute the condition from the gradients, or apply the update unconditionally")
    return (f"signature {sig.key!r}: the update {w!r} depends on the batch through tensors whose shape "
            f"depends on the batch ({', '.join(tensors[-3:])}); vfgraph cannot match its gradient to a "
            "variable (sparse or per-example gradients are not supported for this update)")


def static_batch(g: FunctionGraph, sig: SignatureInfo) -> int:
    """The batch size the training inputs were exported with (0: dynamic)."""
    return next((g.arg_shape(a)[0] for a in sig.batch_args if g.arg_shape(a)[0] > 0), 0)


def with_dynamic_batch(g: FunctionGraph, sig: SignatureInfo, vnode_batch: int) -> FunctionGraph:
    """``g`` with its static shapes re-inferred for a batch dimension of unknown size.

    A signature exported with a static batch (``[32, 64]``) records activations as
    ``[32, 32]``, indistinguishable from a parameter's shape. TensorFlow's own shape
    inference is re-run on the body with the batch arguments' leading dimension unknown and
    each resource argument fed by a handle that knows its variable's shape.
    """
    import tensorflow as tf
    from tensorflow.python.framework.function_def_to_graph import function_def_to_graph_def

    fdef = g.to_function_def()
    for node in fdef.node_def:
        if "_output_shapes" in node.attr:
            del node.attr["_output_shapes"]
    gd, _ = function_def_to_graph_def(fdef)

    def infer(batch):
        graph = tf.Graph()
        with graph.as_default():
            feeds = {}
            for a in g.arg_names:
                if a in sig.batch_args:
                    shape = g.arg_shape(a)
                    feeds[a] = tf.compat.v1.placeholder(tf.dtypes.as_dtype(g.arg_type(a)), [batch] + list(shape[1:]))
                else:
                    var = sig.variables[a]
                    feeds[a] = tf.raw_ops.VarHandleOp(dtype=var.dtype, shape=var.shape, shared_name=f"vf_{a}")
            tf.graph_util.import_graph_def(gd, input_map={f"{a}:0": t for a, t in feeds.items()}, name="vf")
        return {op.name[len("vf/"):]: op for op in graph.get_operations() if op.name.startswith("vf/")}

    try:  # a graph with the exported batch size baked into constants cannot run on slices
        infer(vnode_batch)
    except ValueError as e:
        raise DetectionError(
            f"signature {sig.key!r} was exported with a static batch of {static_batch(g, sig)} that "
            f"its graph depends on, so it cannot run on slices of {vnode_batch} ({str(e).splitlines()[0][:160]}); "
            "re-export the training function with a None batch dimension") from None
    ops = infer(None)
    out = g.to_function_def()
    for node in out.node_def:
        op = ops.get(node.name)
        if op is None:
            continue
        shapes = node.attr["_output_shapes"].list
        del shapes.shape[:]
        for t in op.outputs:
            shapes.shape.add().CopyFrom(t.shape.as_proto())
    for i, a in enumerate(out.signature.input_arg):
        if a.name in sig.batch_args and i in out.arg_attr and "_output_shapes" in out.arg_attr[i].attr:
            out.arg_attr[i].attr["_output_shapes"].list.shape[0].dim[0].size = -1
    return FunctionGraph(out, g.library)
