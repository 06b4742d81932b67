"""The partition plan of a training step into K pipeline stages (model parallelism).

The forward computation of the step (the per-example ops the loss and the per-example
outputs depend on) is ordered and cut into K consecutive stages. Every backward op goes on
the stage of the forward op it differentiates, as TensorFlow colocates gradients with their
ops; every variable, its gradient, its update and its optimizer state go on the stage whose
forward ops read it. The cut positions minimise the largest stage's estimated cost, ties
broken by the bytes of activations that cross the cuts (design.md section 2, pipeline
stages), and never part a contraction from the bias or activation TensorFlow fuses into it
unless the stages cannot be had otherwise. This module plans only: it reads the graph and writes nothing.

The cost is an estimate from the static shapes the exporter recorded, in floating-point
operations per example (an unknown dimension, the batch's among them, counts as one):
a matrix product ``2 * output elements * inner dimension``, a convolution
``2 * output elements * filter window * input channels`` (a depthwise one without the
channels), an einsum ``2 * the product of its index sizes``, an op that only moves or
relabels data (Identity, Reshape, Shape, ...) nothing, any other op its output elements.
It ranks stages against each other; it is not a measured time. Given a profile of the step
(:mod:`vfgraph.analysis.profile`), the plan balances each op's measured time instead.
"""
from __future__ import annotations

import bisect
import difflib
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Dict, List, Mapping, Optional, Sequence, Set, Tuple

from vfgraph.analysis.train_step import TrainStep
from vfgraph.errors import DetectionError, InputError
from vfgraph.ir.graph import FunctionGraph, TensorRef

if TYPE_CHECKING:
    from vfgraph.analysis.profile import StepProfile

# Ops that alias, relabel or describe their input: no arithmetic.
_FREE = frozenset({"Identity", "IdentityN", "Snapshot", "StopGradient", "PreventGradient", "Shape", "ShapeN",
                   "Size", "Rank", "Reshape", "ExpandDims", "Squeeze", "Const", "NoOp", "ReadVariableOp",
                   "BroadcastGradientArgs", "EnsureShape", "CheckNumerics"})
_MATMUL = {"MatMul": "transpose_a", "BatchMatMul": "adj_x", "BatchMatMulV2": "adj_x", "BatchMatMulV3": "adj_x"}
# TensorFlow's CPU and GPU kernels fuse a contraction with the bias and activation that
# follow it (Grappler's remapper: _FusedMatMul, _FusedConv2D), which a cut between them would
# prevent, running both halves slower: the plan does not cut there unless told to.
_CONTRACTIONS = frozenset({"MatMul", "Conv2D", "Conv3D", "DepthwiseConv2dNative"})
_FUSED_ACTIVATIONS = frozenset({"Relu", "Relu6", "Elu", "LeakyRelu", "Tanh", "Sigmoid"})
_ACTIVATED = _CONTRACTIONS | {"BiasAdd", "FusedBatchNorm", "FusedBatchNormV3"}  # what an activation fuses into
# The dtypes a tensor crossing a cut between MPI ranks can have: those VfSend and VfRecv take
# (their T attribute in vfgraph/ops/mpi_ops.cc). A variant (a TensorList, an optional),
# a resource handle or a string cannot cross; no cut is placed where one would.
MESSAGE_DTYPES = ("half", "bfloat16", "float32", "float64", "int8", "int16", "int32", "int64", "uint8", "uint16",
                  "bool")
_GRADIENT_SCOPE = re.compile(r"^(gradient_tape|gradients(_\d+)?)$")
_GRAD_SUFFIX = "_grad"
# How a backward op was placed (the keys of StagePlan.placement).
PLACED_BY = ("name", "gradient", "forward-input", "backward-input", "per-output", "unplaced")


@dataclass(frozen=True)
class Stage:
    """One pipeline stage: a run of consecutive forward ops and what goes with them."""

    index: int                       # 1-based
    first: str                       # its first and last forward op
    last: str
    forward_ops: int
    backward_ops: int                # per-example ops placed with its forward ops (a split IdentityN counts on each)
    forward_flops: int               # estimated, per example
    backward_flops: int
    variables: Tuple[str, ...]       # variables it owns (read by its forward ops), by name
    parameter_bytes: int
    optimizer_state: Tuple[str, ...]  # slot variables of its variables' updates
    optimizer_state_bytes: int
    shared: Tuple[str, ...] = ()     # variables its forward ops read that other stages read too
    inputs: Tuple[str, ...] = ()     # signature inputs its ops read directly
    forward_ns: int = -1             # measured, per step of the profile (-1: not profiled)
    backward_ns: int = -1

    @property
    def flops(self) -> int:
        return self.forward_flops + self.backward_flops

    @property
    def measured_ns(self) -> int:
        """Its forward and backward ops' measured time (-1: not profiled)."""
        return self.forward_ns + self.backward_ns if self.forward_ns >= 0 else -1

    def to_json(self) -> dict:
        measured = {} if self.forward_ns < 0 else {
            "forward_us": self.forward_ns / 1000, "backward_us": self.backward_ns / 1000,
            "measured_us": self.measured_ns / 1000}
        return {**measured, "index": self.index, "first": self.first, "last": self.last,
                "forward_ops": self.forward_ops, "backward_ops": self.backward_ops, "forward_flops": self.forward_flops,
                "backward_flops": self.backward_flops, "flops": self.flops, "variables": list(self.variables),
                "parameter_bytes": self.parameter_bytes, "optimizer_state": list(self.optimizer_state),
                "optimizer_state_bytes": self.optimizer_state_bytes, "shared": list(self.shared),
                "inputs": list(self.inputs)}


@dataclass(frozen=True)
class Cut:
    """The boundary between stage ``index`` and ``index + 1``."""

    index: int
    after: str                           # the last forward op before it and the first after it
    before: str
    tensors: Tuple[Tuple[str, int], ...]  # forward tensors live across it: (tensor, bytes per example)
    bytes: int                           # their sum: activations sent forward, their gradients sent back
    gradient_bytes: int = 0              # backward tensors crossing it besides those gradients

    def to_json(self) -> dict:
        return {"index": self.index, "after": self.after, "before": self.before,
                "tensors": [{"tensor": t, "bytes": b} for t, b in self.tensors], "bytes": self.bytes,
                "gradient_bytes": self.gradient_bytes}


@dataclass(frozen=True)
class SharedVariable:
    """A variable read by forward ops of several stages (weight sharing, tied embeddings):
    each of those stages needs it and contributes to its gradient."""

    name: str
    stages: Tuple[int, ...]
    bytes: int


@dataclass(frozen=True)
class StagePlan:
    """Where each part of a training step runs when it is cut into ``len(stages)`` stages."""

    signature: str
    function: str
    stages: Tuple[Stage, ...]
    cuts: Tuple[Cut, ...]
    chosen: str                          # "balanced" (cost model), "measured" (profile) or "split-at" (given)
    shared: Tuple[SharedVariable, ...]
    replicated: Tuple[str, ...]          # every stage keeps a copy (step counters, learning rates)
    replicated_bytes: int
    placement: Mapping[str, int]         # backward ops by how they were placed (PLACED_BY)
    misplaced: Tuple[Tuple[str, int, int], ...]  # (gradient tensor, its stage, its variable's stage)
    order: Tuple[str, ...] = field(repr=False, default=())  # the forward ops, in the order cut
    node_stage: Mapping[str, int] = field(repr=False, default_factory=dict)     # per-example op -> stage
    split_nodes: Mapping[str, Tuple[int, ...]] = field(repr=False, default_factory=dict)  # IdentityN: per output
    profile_batch: int = 0               # the batch of the profile its measured times are of (0: none)
    terms: Mapping[str, int] = field(repr=False, default_factory=dict)  # a regularization term's op -> its stage

    @property
    def flops(self) -> int:
        return sum(s.flops for s in self.stages)

    @property
    def split_at(self) -> Tuple[str, ...]:
        """The first forward op of stages 2..K: what ``split_at`` repeats this plan with."""
        return tuple(c.before for c in self.cuts)

    @property
    def max_stage_flops(self) -> int:
        return max(s.flops for s in self.stages)

    @property
    def parameter_bytes(self) -> int:
        return sum(s.parameter_bytes for s in self.stages) + sum(v.bytes for v in self.shared)

    @property
    def optimizer_state_bytes(self) -> int:
        return sum(s.optimizer_state_bytes for s in self.stages)

    def to_json(self) -> dict:
        return {
            "signature": self.signature, "function": self.function, "count": len(self.stages),
            "chosen": self.chosen, "stages": [s.to_json() for s in self.stages],
            **({"profile_batch": self.profile_batch} if self.profile_batch else {}),
            "cuts": [c.to_json() for c in self.cuts],
            "shared": [{"variable": v.name, "stages": list(v.stages), "bytes": v.bytes} for v in self.shared],
            "replicated": list(self.replicated), "replicated_bytes": self.replicated_bytes,
            "placement": dict(self.placement),
            "misplaced": [{"tensor": t, "stage": s, "variable_stage": v} for t, s, v in self.misplaced],
            "totals": {"flops": self.flops, "max_stage_flops": self.max_stage_flops,
                       "forward_ops": sum(s.forward_ops for s in self.stages),
                       "parameter_bytes": self.parameter_bytes, "optimizer_state_bytes": self.optimizer_state_bytes,
                       "crossing_bytes": sum(c.bytes for c in self.cuts)},
        }


# ---------------------------------------------------------------------------- sizes and costs
def _elements(shape: Optional[Sequence[int]]) -> int:
    n = 1
    for d in shape or ():
        n *= d if d > 0 else 1
    return n


_DTYPE_SIZE: Dict[int, int] = {}


def dtype_size(dtype: int) -> int:
    """Bytes per element (0 for handles, strings and variants)."""
    size = _DTYPE_SIZE.get(dtype)
    if size is None:
        from tensorflow.python.framework import dtypes

        try:
            d = dtypes.as_dtype(dtype)
            size = 0 if d in (dtypes.resource, dtypes.variant, dtypes.string) else d.size
        except (TypeError, ValueError):
            size = 0
        _DTYPE_SIZE[dtype] = size
    return size


def carried(dtype: int) -> bool:
    """Whether a tensor of ``dtype`` (a DataType enum) can cross a cut between stages on MPI
    ranks (MESSAGE_DTYPES)."""
    from tensorflow.python.framework import dtypes

    try:
        return dtypes.as_dtype(dtype).name in MESSAGE_DTYPES
    except (TypeError, ValueError):
        return False


def tensor_bytes(g: FunctionGraph, ref: TensorRef) -> int:
    """Bytes of ``ref`` per example, from its static shape (unknown dimensions count as one)."""
    return _elements(g.shape(ref)) * dtype_size(g.dtype(ref))


def op_flops(g: FunctionGraph, name: str) -> int:
    """Estimated floating-point operations of node ``name`` per example (see the module's note)."""
    op = g.op_types()[name]
    if op in _FREE:
        return 0
    outs = g.outputs(name)
    out = _elements(g.shape(outs[0])) if outs else 1
    ins = g.data_inputs(name)
    attr = g.nodes[name].attr
    if op in _MATMUL and len(ins) >= 2:
        a = g.shape(ins[0]) or []
        flag = _MATMUL[op]
        inner = (a[-2] if flag in attr and attr[flag].b else a[-1]) if len(a) >= 2 else 1
        return 2 * out * max(inner, 1)
    if op in ("Conv2D", "Conv3D", "DepthwiseConv2dNative") and len(ins) >= 2:
        f = g.shape(ins[1]) or []
        window = _elements(f[:-2]) * (1 if op == "DepthwiseConv2dNative" or len(f) < 2 else max(f[-2], 1))
        return 2 * out * window
    if op in ("Conv2DBackpropInput", "Conv2DBackpropFilter", "DepthwiseConv2dNativeBackpropInput",
              "DepthwiseConv2dNativeBackpropFilter", "Conv3DBackpropInputV2", "Conv3DBackpropFilterV2") \
            and len(ins) >= 3:
        f = g.shape(ins[1]) if "Input" in op else g.shape(outs[0])
        f = f or []
        window = _elements(f[:-2]) * (1 if op.startswith("Depthwise") or len(f) < 2 else max(f[-2], 1))
        return 2 * _elements(g.shape(ins[2])) * window
    if op == "Einsum" and "equation" in attr:
        return 2 * _einsum_size(attr["equation"].s.decode(), [g.shape(t) for t in ins])
    return sum(_elements(g.shape(t)) for t in outs)


def _einsum_size(equation: str, shapes: List[Optional[List[int]]]) -> int:
    """The product of the sizes of every index an einsum names."""
    lhs = equation.replace(" ", "").split("->")[0].split(",")
    sizes: Dict[str, int] = {}
    for spec, shape in zip(lhs, shapes):
        if shape is None or "." in spec:
            continue
        for letter, d in zip(spec, shape):
            if d > 0:
                sizes[letter] = max(sizes.get(letter, 1), d)
    n = 1
    for d in sizes.values():
        n *= d
    return n


# ---------------------------------------------------------------------------- the plan
class _Step:
    """The per-example part of a step, its forward order, and every backward op's anchor (the
    position in that order of the forward op it goes with), independent of where the cuts are."""

    def __init__(self, g: FunctionGraph, step: TrainStep):
        self.g, self.step = g, step
        sig = step.signature
        self.resources = set(sig.resource_args)
        self.batch = set(sig.batch_args)
        dep = step.batch_dependent
        preds = lambda n: [t.node for t in g.data_inputs(n)]  # noqa: E731
        out_refs = [o.ref for o in step.outputs if o.side == "vnode" and not o.ref.is_function_arg]
        # What the per-virtual-node function computes: the batch-dependent ancestors of its
        # outputs and of the cut (batch norm's normalisation behind a statistic of the cut too;
        # not a gradient nothing reads, such as that of the input images).
        fwd = g.reachable([r.node for r in out_refs], preds) & dep
        per_example = fwd | (g.reachable([c.ref.node for c in step.cut if not c.ref.is_function_arg], preds) & dep)
        if not fwd:
            raise DetectionError(f"signature {sig.key!r}: {g.name!r} has no per-example output (loss) to cut "
                                 "into stages")
        self.per_example = per_example
        self.order = self._late_order(fwd)
        self.pos = {n: i for i, n in enumerate(self.order)}
        topo = [n for n in g.topological_order() if n in per_example]
        self.topo = topo
        self.backward = [n for n in topo if n not in self.pos]
        self.cost = {n: op_flops(g, n) for n in topo}
        self._anchor_backward()

    def _late_order(self, fwd: Set[str]) -> List[str]:
        """The forward ops in topological order, each as late as its consumers allow (ties by
        name): an op that feeds only the end of the model (the labels' cast) sits beside its
        consumer, so it does not stretch over the cuts in between."""
        g = self.g
        height: Dict[str, int] = {}
        for n in reversed([m for m in g.topological_order() if m in fwd]):
            kids = [c for c in g.data_children(n) if c in fwd]
            height[n] = 1 + max((height[c] for c in kids), default=-1)
        top = max(height.values())
        return sorted(fwd, key=lambda n: (top - height[n], n))

    # ------------------------------------------------------------------ anchors
    def _anchor_backward(self) -> None:
        g, pos = self.g, self.pos
        fwd_names = pos
        scopes: Dict[str, List[int]] = {}
        for n, p in pos.items():
            parts = n.split("/")
            for k in range(1, len(parts)):
                scopes.setdefault("/".join(parts[:k]), []).append(p)
        self.split_ops = {n for n in self.backward if g.op_types()[n] == "IdentityN"}
        reach = self._gradient_reach()
        var_pos = self.variable_readers()
        self.anchor: Dict[str, int] = {}
        self.how: Dict[str, str] = {}
        self.split: Dict[str, List[int]] = {}   # IdentityN: the anchor of each output
        for n in self.backward:
            ins = g.data_inputs(n)
            if n in self.split_ops:
                self.split[n] = [self.tensor_anchor(t) for t in ins]
                self.how[n] = "per-output"
                continue
            a, how = self._by_name(n, ins, fwd_names, scopes), "name"
            if a is None:
                v = reach.get(n)
                if v is not None and v is not _MANY and var_pos.get(v):
                    a, how = min(var_pos[v]), "gradient"
            if a is None:
                f = [pos[t.node] if not t.is_function_arg else 0 for t in ins
                     if t.node in pos or (t.is_function_arg and t.node in self.batch)]
                if f:
                    a, how = max(f), "forward-input"
            if a is None:
                b = [self.tensor_anchor(t) for t in ins if not t.is_function_arg and t.node in self.per_example]
                b = [x for x in b if x is not None]
                if b:
                    a, how = min(b), "backward-input"
            self.how[n] = how if a is not None else "unplaced"
            if a is not None:
                self.anchor[n] = a

    def tensor_anchor(self, t: TensorRef) -> Optional[int]:
        if t.is_function_arg:
            return 0 if t.node in self.batch else None
        if t.node in self.pos:
            return self.pos[t.node]
        if t.node in self.split:
            return self.split[t.node][self.g.flat_index(t)]
        return self.anchor.get(t.node)

    def reader_anchor(self, node: str, slot: int) -> Optional[int]:
        """Where the consumer ``node`` reading input ``slot`` runs (an IdentityN: that output's)."""
        if node in self.pos:
            return self.pos[node]
        if node in self.split:  # output k forwards input k
            return self.split[node][slot]
        return self.anchor.get(node)

    def _by_name(self, n: str, ins: List[TensorRef], fwd_names, scopes) -> Optional[int]:
        """The forward op a backward op's name points to. A gradient function's ops are named
        in the forward op's scope, ``gradient_tape/<forward op>/<op>`` (``gradients/<forward
        op>_grad/<op>`` in TF1); a gradient of one op is named ``gradient_tape/<scope>/<op type>``,
        uniquified, so it goes with the last op of that scope whose output it reads."""
        parts = n.split("/")
        if len(parts) > 1 and _GRADIENT_SCOPE.match(parts[0]):
            parts = parts[1:]
        parts = [p[:-len(_GRAD_SUFFIX)] if p.endswith(_GRAD_SUFFIX) and len(p) > len(_GRAD_SUFFIX) else p
                 for p in parts]
        for k in range(len(parts) - 1, 0, -1):  # the last part alone may be uniquified (Reshape_1)
            prefix = "/".join(parts[:k])
            if prefix in fwd_names:
                return fwd_names[prefix]
            if prefix in self.g.nodes:
                return None  # the gradient of an op that runs once (a kernel's reshape)
        read = {self.pos[t.node] for t in ins if t.node in self.pos}
        for k in range(len(parts) - 1, 0, -1):
            inside = scopes.get("/".join(parts[:k]))
            if inside:
                mine = read.intersection(inside)
                return max(mine) if mine else None
        return None

    def _gradient_reach(self) -> Dict[str, object]:
        """For each backward op, the one variable whose gradient it contributes to (``_MANY``
        when several do, absent when none)."""
        g = self.g
        grads = {c.ref: c.variable for c in self.step.cut if c.role == "gradient" and c.variable}
        bwd = set(self.backward)
        node_reach: Dict[str, object] = {}
        out_reach: Dict[TensorRef, object] = {}  # IdentityN outputs, each on its own

        def merge(a, b):
            return b if a is None else a if b is None or a == b else _MANY

        for n in reversed(self.backward):
            r = None
            for t in g.outputs(n):
                rt = grads.get(t)
                for c, slot in g.consumers(t):
                    if c in bwd:
                        rt = merge(rt, out_reach.get(g.outputs(c)[slot]) if c in self.split_ops
                                   else node_reach.get(c))
                if n in self.split_ops:
                    out_reach[t] = rt
                r = merge(r, rt)
            if r is not None:
                node_reach[n] = r
        return node_reach

    def variable_readers(self) -> Dict[str, List[int]]:
        """Resource arg -> positions of the forward ops that read it (through batch-free reads)."""
        if hasattr(self, "_readers"):
            return self._readers
        g = self.g
        dep = self.step.batch_dependent
        memo: Dict[str, frozenset] = {}

        def vars_of(node: str) -> frozenset:
            stack = [node]
            while stack:
                n = stack[-1]
                if n in memo:
                    stack.pop()
                    continue
                pending = [t.node for t in g.data_inputs(n)
                           if not t.is_function_arg and t.node not in dep and t.node not in memo]
                if pending:
                    stack.extend(pending)
                    continue
                found = set()
                for t in g.data_inputs(n):
                    if t.is_function_arg:
                        if t.node in self.resources:
                            found.add(t.node)
                    elif t.node not in dep:
                        found |= memo[t.node]
                memo[n] = frozenset(found)
                stack.pop()
            return memo[node]

        readers: Dict[str, List[int]] = {}
        self.terms: List[Tuple[TensorRef, frozenset, int]] = []
        for n, p in self.pos.items():
            vars_of(n)
            reads, terms = self._reads_at(n, memo)
            for v in reads:
                readers.setdefault(v, []).append(p)
            self.terms += [(t, vs, p) for t, vs in terms]
        for t, vs, p in self.terms:  # a variable read by nothing but a term: where the term is read
            for v in vs:
                if v not in readers:
                    readers.setdefault(v, []).append(p)
        self._readers = readers
        self._memo = memo
        return readers

    def _reads_at(self, n: str, memo: Mapping[str, frozenset]) -> Tuple[Set[str], List[Tuple[TensorRef, frozenset]]]:
        """The variables forward op ``n`` reads (through batch-free reads), and the terms among
        its inputs: a scalar computed from variables alone (a regularization term, such as an L2
        penalty), which goes with its variables' stage, not with the loss that adds it. An input
        an IdentityN or Identity passes on to no forward op (a custom gradient's, such as
        ``recompute_grad``'s, variables handed to its gradient function) is no read."""
        g, dep = self.g, self.step.batch_dependent
        through = g.op_types()[n] in ("IdentityN", "Identity")
        outs = g.outputs(n) if through else []
        reads: Set[str] = set()
        terms: List[Tuple[TensorRef, frozenset]] = []
        for i, t in enumerate(g.data_inputs(n)):
            if t.is_function_arg:
                if t.node in self.resources:
                    reads.add(t.node)
                continue
            if t.node in dep or not memo.get(t.node):
                continue
            if through and i < len(outs) and not any(c in self.pos for c, _ in g.consumers(outs[i])):
                continue
            if g.shape(t) == [] and g.nodes[t.node].op not in _FREE:
                terms.append((t, memo[t.node]))
                continue
            reads |= memo[t.node]
        return reads, terms

    def term_nodes(self, t: TensorRef) -> Set[str]:
        """The batch-free ops computing term ``t`` from its variables."""
        dep = self.step.batch_dependent
        return self.g.reachable([t.node], lambda n: [x.node for x in self.g.data_inputs(n)
                                                     if not x.is_function_arg and x.node not in dep])


class _Many:
    def __repr__(self) -> str:
        return "MANY"


_MANY = _Many()


def plan_stages(g: FunctionGraph, step: TrainStep, stages: int, split_at: Sequence[str] = (),
                profile: Optional["StepProfile"] = None, ranks: bool = False) -> StagePlan:
    """Cut the training step ``step`` of function ``g`` into ``stages`` pipeline stages.

    Without ``split_at`` the cuts minimise the largest stage's cost (its forward ops and the
    backward ops placed with them), ties broken by the fewest bytes per example crossing the
    cuts: exact, by dynamic programming over the forward order. The cost is the estimate
    (see the module's note) or, given a ``profile`` of the step
    (:func:`vfgraph.analysis.profile.profile_step`), each op's measured time, which the plan's
    stages then report too. ``split_at`` names the forward ops that start stages 2..K instead.
    Raises InputError for a number of stages or a split the step cannot take (or a profile
    of another model), DetectionError for a step with no forward part.
    """
    sig = step.signature
    if stages < 1:
        raise InputError(f"{stages} stages: a plan needs at least 1 stage")
    s = _Step(g, step)
    measured = None
    if profile is not None:
        from vfgraph.analysis.profile import function_costs

        measured = function_costs(profile, g, s.cost)
    cost = s.cost if measured is None else {n: measured.get(n, 0) for n in s.cost}
    fwd_cost = [cost[x] for x in s.order]
    costed = sum(1 for c in fwd_cost if c > 0)
    if split_at:
        if len(split_at) != stages - 1:
            raise InputError(f"{len(split_at)} split point(s) for {stages} stages: give the {stages - 1} forward "
                             "op(s) that start stages 2.." + str(stages))
        cuts = []
        for name in split_at:
            if name not in s.pos:
                near = difflib.get_close_matches(name, s.order, n=3)
                hint = f" (did you mean {', '.join(near)}?)" if near else ""
                raise InputError(f"split at {name!r}: not a forward op of signature {sig.key!r}{hint}; "
                                 "'vfgraph inspect --stages K --json' lists the stages' first ops")
            p = s.pos[name]
            if p == 0:
                raise InputError(f"split at {name!r}: it is the first forward op, so stage 1 would be empty")
            if cuts and p <= cuts[-1]:
                raise InputError(f"split at {name!r}: it does not come after {s.order[cuts[-1]]!r} in the forward "
                                 "order; give the split points in order")
            cuts.append(p)
        if ranks:
            for p in cuts:
                _check_carried(s, p, sig.key)
    else:
        if stages > costed:
            what = "a measured time" if measured is not None else "an estimated cost"
            raise InputError(f"{stages} stages: signature {sig.key!r} has only {costed} forward op(s) with {what}; "
                             f"give at most {costed} stage(s)")
        weight = list(fwd_cost)
        for x, a in s.anchor.items():
            weight[a] += cost[x]
        blocked = _uncarried_positions(s) if ranks else None
        cuts = _best_cuts(weight, fwd_cost, _live_bytes(s), stages, _fused_positions(s), blocked)
        if not cuts and stages > 1:
            raise InputError(f"{stages} stages on MPI ranks: every cut of signature {sig.key!r} would send a tensor "
                             "the messages between ranks cannot carry (" + _uncarried_example(s) + "); give --devices "
                             "to run the stages in one process, or fewer stages")
    chosen = "split-at" if split_at else "balanced" if measured is None else "measured"
    return _build(s, cuts, chosen, measured, profile.batch if profile is not None else 0, ranks)


def _fused_positions(s: _Step) -> List[bool]:
    """For each position of the forward order, whether a stage starting there would separate a
    contraction from the bias or activation TensorFlow fuses into it (the op reads the one
    before it, the only reader of that op's output)."""
    g, types = s.g, s.g.op_types()
    closed = [False] * len(s.order)
    for node, p in s.pos.items():
        op = types[node]
        ins = g.data_inputs(node)
        if (op != "BiasAdd" and op not in _FUSED_ACTIVATIONS) or not ins or ins[0].node not in s.pos:
            continue
        prev = ins[0].node
        if types[prev] in (_CONTRACTIONS if op == "BiasAdd" else _ACTIVATED) and [c for c, _ in g.consumers(ins[0])] == [node]:
            for q in range(s.pos[prev] + 1, p + 1):
                closed[q] = True
    return closed


def _uncarried_intervals(s: _Step):
    """(first, last position, tensor) of every forward or backward tensor read at another
    position whose dtype the messages between MPI ranks cannot carry."""
    g = s.g
    for name in s.topo:
        for t in g.outputs(name):
            if carried(g.dtype(t)):
                continue
            a = s.tensor_anchor(t)
            if a is None:
                continue
            where = [x for c, slot in g.consumers(t) for x in [s.reader_anchor(c, slot)] if x is not None]
            lo, hi = min(where + [a]), max(where + [a])
            if lo < hi:
                yield lo, hi, t


def _uncarried_positions(s: _Step) -> List[bool]:
    """For each position of the forward order, whether a stage starting there would send a
    tensor the messages between MPI ranks cannot carry."""
    blocked = [False] * len(s.order)
    for lo, hi, _ in _uncarried_intervals(s):
        for p in range(lo + 1, hi + 1):
            blocked[p] = True
    return blocked


def _uncarried_example(s: _Step) -> str:
    from tensorflow.python.framework import dtypes

    for _, _, t in _uncarried_intervals(s):
        return f"{t} is a {dtypes.as_dtype(s.g.dtype(t)).name}"
    return "none found"


def _check_carried(s: _Step, p: int, key: str) -> None:
    """InputError when a stage starting at position ``p`` would receive a tensor the messages
    between MPI ranks cannot carry."""
    from tensorflow.python.framework import dtypes

    for lo, hi, t in _uncarried_intervals(s):
        if lo < p <= hi:
            free = [q for q, b in enumerate(_uncarried_positions(s)) if q and not b]
            near = min(free, key=lambda q: (abs(q - p), q), default=None)
            hint = f" (it can start at {s.order[near]!r}, for one)" if near is not None else ""
            kind = dtypes.as_dtype(s.g.dtype(t)).name
            raise InputError(f"split at {s.order[p]!r}: {t} would cross the cut, a {kind} "
                             f"tensor, which messages between MPI ranks cannot carry; start the stage at another op"
                             f"{hint}, or give --devices to run the stages in one process (signature {key!r})")


def _live_bytes(s: _Step) -> List[int]:
    """Bytes per example of forward tensors live across the boundary before each position."""
    n = len(s.order)
    diff = [0] * (n + 1)
    for lo, hi, b, _ in _forward_intervals(s):
        diff[lo + 1] += b
        diff[hi + 1] -= b
    live, run = [0] * n, 0
    for p in range(n):
        run += diff[p]
        live[p] = run
    return live


def _forward_intervals(s: _Step):
    """(first, last position, bytes, tensor) of every forward tensor read at another position."""
    g = s.g
    for name, p in s.pos.items():
        for t in g.outputs(name):
            where = [a for c, slot in g.consumers(t) for a in [s.reader_anchor(c, slot)] if a is not None]
            lo, hi = min(where + [p]), max(where + [p])
            if lo < hi:
                yield lo, hi, tensor_bytes(g, t), t


def _best_cuts(weight: List[int], fwd_cost: List[int], live: List[int], k: int,
               closed: Optional[List[bool]] = None, blocked: Optional[List[bool]] = None) -> List[int]:
    """Positions starting stages 2..k: the smallest largest stage weight, then the fewest live
    bytes summed over the cuts. Every stage holds a forward op with a cost. No stage starts at
    a ``closed`` position unless the k stages cannot be had otherwise, never at a ``blocked``
    one (empty when the k stages cannot be had without)."""
    n = len(weight)
    hard = [bool(blocked and 0 < p < n and blocked[p]) for p in range(n + 1)]
    shut = [bool(closed and 0 < p < n and closed[p]) or hard[p] for p in range(n + 1)]
    prefix = [0]
    for w in weight:
        prefix.append(prefix[-1] + w)
    last_costed = [-1] * (n + 1)  # last_costed[j]: the last costed position < j
    for j in range(1, n + 1):
        last_costed[j] = j - 1 if fwd_cost[j - 1] > 0 else last_costed[j - 1]

    def feasible(limit: int, no_start: List[bool]) -> bool:
        """Whether k segments within ``limit`` can be had, none starting where ``no_start``."""
        return _cuts_feasible(_cut_windows(prefix, last_costed, limit), no_start, k)

    if any(shut) and not feasible(prefix[n], shut):
        shut = hard
        if any(hard) and not feasible(prefix[n], shut):
            return []
    lo, hi = max(weight), prefix[n]
    while lo < hi:
        mid = (lo + hi) // 2
        if feasible(mid, shut):
            hi = mid
        else:
            lo = mid + 1
    return _fewest_live_cuts(_cut_windows(prefix, last_costed, lo), shut, live, k)


def _cut_windows(prefix: List[int], last_costed: List[int], limit: int) -> List[Tuple[int, int]]:
    """For each end j, the starts i of a segment [i, j) within ``limit`` (of the weights whose
    prefix sums are ``prefix``) holding a costed op: the range (lowest start, last costed
    position before j)."""
    out, lo = [(0, -1)], 0
    for j in range(1, len(prefix)):
        while prefix[j] - prefix[lo] > limit:
            lo += 1
        out.append((lo, last_costed[j]))
    return out


def _cuts_feasible(win: List[Tuple[int, int]], shut: List[bool], k: int) -> bool:
    """Whether the positions split into ``k`` segments of the windows ``win``, none starting
    at a ``shut`` position."""
    n = len(win) - 1
    ok = [False] * (n + 1)
    ok[0] = True
    for _ in range(k):
        count = [0]
        for v in ok:
            count.append(count[-1] + v)
        nxt = [False] * (n + 1)
        for j in range(1, n + 1):
            lo, hi = win[j]
            nxt[j] = hi >= lo and count[hi + 1] - count[lo] > 0 and not shut[j]
        ok = nxt
    return ok[n]


def _fewest_live_cuts(win: List[Tuple[int, int]], shut: List[bool], live: List[int], k: int) -> List[int]:
    """Positions starting segments 2..k of the windows ``win``, none at a ``shut`` position,
    with the fewest ``live`` bytes summed over the cuts (a dynamic program over the segments,
    each step's best start kept in a monotone queue)."""
    n = len(win) - 1
    inf = float("inf")
    best = [0] + [inf] * n  # best[j]: fewest bytes for positions [0, j) in the segments so far
    choice: List[List[int]] = []
    for seg in range(k):
        nxt = [inf] * (n + 1)
        pick = [-1] * (n + 1)
        dq: List[int] = []  # candidate starts, increasing cost (a monotone queue)
        head, added = 0, 0
        for j in range(1, n + 1):
            s0, s1 = win[j]
            while added <= s1:
                if best[added] < inf and not shut[added]:
                    v = best[added] + (live[added] if added else 0)
                    while len(dq) > head and best[dq[-1]] + (live[dq[-1]] if dq[-1] else 0) > v:
                        dq.pop()
                    dq.append(added)
                added += 1
            while head < len(dq) and dq[head] < s0:
                head += 1
            if head < len(dq) and s1 >= s0:
                i = dq[head]
                nxt[j], pick[j] = best[i] + (live[i] if i else 0), i
        best = nxt
        choice.append(pick)
    cuts, j = [], n
    for seg in range(k - 1, 0, -1):
        j = choice[seg][j]
        cuts.append(j)
    return sorted(cuts)


def _var_bytes(sig, arg: str) -> int:
    v = sig.variables.get(arg)
    return 0 if v is None or v.shape is None else _elements(v.shape) * dtype_size(v.dtype)


def _build(s: _Step, cuts: List[int], chosen: str, measured: Optional[Mapping[str, int]] = None,
           profile_batch: int = 0, ranks: bool = False) -> StagePlan:
    """The plan of step ``s`` cut at ``cuts``: each op's and variable's stage, each stage's
    totals, and what crosses each cut."""
    g, step = s.g, s.step
    sig = step.signature
    k = len(cuts) + 1
    stage_of = lambda p: bisect.bisect_right(cuts, p) + 1  # noqa: E731
    name = lambda r: sig.variables[r].name if r in sig.variables else r  # noqa: E731
    node_stage = {n: stage_of(p) for n, p in s.pos.items()}
    node_stage.update({n: stage_of(a) for n, a in s.anchor.items()})
    split_nodes = {n: tuple(stage_of(a) if a is not None else 0 for a in v) for n, v in s.split.items()}

    own = _Owners.of(s, stage_of)
    term_owner = dict(own.owner)
    if ranks:
        _share_updated_together(g, step, own.owner, own.shared, own.slot_owner, own.slot_shared, k)
    replicated = [r for r in sig.resource_args if not own.holds(r)]
    counts = {h: 0 for h in PLACED_BY}
    for n in s.backward:
        counts[s.how[n]] += 1
    order_of = {r: i for i, r in enumerate(sig.resource_args)}
    by_order = lambda rs: sorted(rs, key=lambda r: (order_of.get(r, 1 << 30), r))  # noqa: E731
    stage_list = _stage_list(s, cuts, node_stage, split_nodes, own, measured, name, by_order)
    return StagePlan(
        terms=_term_stages(s, term_owner, stage_of), signature=sig.key, function=g.name, stages=stage_list,
        cuts=_cut_list(s, cuts), chosen=chosen,
        shared=tuple(SharedVariable(name(v), st, _var_bytes(sig, v)) for v, st in
                     ((v, own.shared[v]) for v in by_order(own.shared))),
        replicated=tuple(name(r) for r in replicated), replicated_bytes=sum(_var_bytes(sig, r) for r in replicated),
        placement=counts, misplaced=tuple(own.misplaced), order=tuple(s.order), node_stage=node_stage,
        split_nodes=split_nodes, profile_batch=profile_batch)


@dataclass
class _Owners:
    """Which stage holds each resource of a step: a variable owned by one stage (``owner``) or
    shared by several (``shared``), an optimizer slot likewise (``slot_owner``,
    ``slot_shared``), and the gradients computed on another stage than their variable's
    (``misplaced``: tensor, its stage, the variable's stage)."""
    owner: Dict[str, int] = field(default_factory=dict)
    shared: Dict[str, Tuple[int, ...]] = field(default_factory=dict)
    slot_owner: Dict[str, int] = field(default_factory=dict)
    slot_shared: Dict[str, Tuple[int, ...]] = field(default_factory=dict)
    misplaced: List[Tuple[str, int, int]] = field(default_factory=list)

    def holds(self, r: str) -> bool:
        """Whether some stage holds resource ``r`` (else every stage has a replica)."""
        return r in self.owner or r in self.shared or r in self.slot_owner or r in self.slot_shared

    @classmethod
    def of(cls, s: _Step, stage_of) -> "_Owners":
        """Variables owned by the stage of their forward readers; a gradient's variables and
        slots by the stage of the parameter it updates; a statistic's by the stage computing it."""
        own = cls()
        for v, ps in s.variable_readers().items():
            st = tuple(sorted({stage_of(p) for p in ps}))
            if len(st) == 1:
                own.owner[v] = st[0]
            else:
                own.shared[v] = st
        for c in s.step.cut:
            if c.role == "gradient" and c.variable:
                own._place_gradient(s, c, stage_of)
            elif c.role == "statistic":
                a = s.tensor_anchor(c.ref)
                for w in c.writes:
                    if w not in own.owner and w not in own.shared and a is not None:
                        own.owner[w] = stage_of(a)
        return own

    def _place_gradient(self, s: _Step, c, stage_of) -> None:
        """Place the slots the gradient cut ``c`` updates on the stage of its parameter: the
        variable it is the gradient of, or (where the cut sits inside the optimizer's
        arithmetic, after a Tensordot's gradient lost its shape) the parameter among the
        variables it feeds; failing both, the stage that computes it."""
        owner, shared = self.owner, self.shared
        param = next((v for v in [c.variable] + list(c.writes) if v in owner or v in shared), None)
        where = owner.get(param) if param is not None else None
        a = s.tensor_anchor(c.ref)
        got = stage_of(a) if a is not None else 0
        if where is not None and got != where:
            self.misplaced.append((str(c.ref), got, where))
        if param is None and got:
            where = got
        for w in [c.variable] + list(c.writes):
            if w in owner or w in shared:
                continue
            if where is not None:
                self.slot_owner[w] = where
            elif param is not None:
                self.slot_shared[w] = shared[param]


def _stage_list(s: _Step, cuts: List[int], node_stage: Dict[str, int], split_nodes: Dict[str, Tuple[int, ...]],
                own: _Owners, measured: Optional[Mapping[str, int]], name, by_order) -> Tuple[Stage, ...]:
    """The stages of the plan: each one's first and last forward op, op counts, estimated
    (and, given ``measured``, measured) cost, variables, optimizer state and batch inputs."""
    g, sig = s.g, s.step.signature
    k = len(cuts) + 1
    fwd_count, bwd_count = [0] * (k + 1), [0] * (k + 1)
    fwd_flops, bwd_flops = [0] * (k + 1), [0] * (k + 1)
    fwd_ns, bwd_ns = [0] * (k + 1), [0] * (k + 1)
    ns = measured if measured is not None else {}
    inputs: List[Set[str]] = [set() for _ in range(k + 1)]
    for n, st in node_stage.items():
        if n in s.pos:
            fwd_count[st] += 1
            fwd_flops[st] += s.cost[n]
            fwd_ns[st] += ns.get(n, 0)
        else:
            bwd_count[st] += 1
            bwd_flops[st] += s.cost[n]
            bwd_ns[st] += ns.get(n, 0)
        for t in g.data_inputs(n):
            if t.is_function_arg and t.node in s.batch:
                inputs[st].add(sig.input_keys.get(t.node, t.node))
    for n, sts in split_nodes.items():
        for st in set(sts):
            if st:
                bwd_count[st] += 1
    stage_list = []
    bounds = [0] + cuts + [len(s.order)]
    for i in range(1, k + 1):
        mine = by_order(v for v, o in own.owner.items() if o == i)
        slots = by_order(v for v, o in own.slot_owner.items() if o == i)
        stage_list.append(Stage(
            index=i, first=s.order[bounds[i - 1]], last=s.order[bounds[i] - 1], forward_ops=fwd_count[i],
            backward_ops=bwd_count[i], forward_flops=fwd_flops[i], backward_flops=bwd_flops[i],
            variables=tuple(name(v) for v in mine), parameter_bytes=sum(_var_bytes(sig, v) for v in mine),
            optimizer_state=tuple(name(v) for v in slots),
            optimizer_state_bytes=sum(_var_bytes(sig, v) for v in slots),
            shared=tuple(name(v) for v in by_order(v for v, st in {**own.shared, **own.slot_shared}.items()
                                                   if i in st)),
            inputs=tuple(sorted(inputs[i])),
            forward_ns=fwd_ns[i] if measured is not None else -1,
            backward_ns=bwd_ns[i] if measured is not None else -1))
    return tuple(stage_list)


def _cut_list(s: _Step, cuts: List[int]) -> Tuple[Cut, ...]:
    """The cuts of the plan: the forward tensors crossing each (with their bytes per example)
    and the bytes of the gradients crossing it back."""
    g = s.g
    crossing: List[List[Tuple[str, int]]] = [[] for _ in cuts]
    for lo, hi, b, t in _forward_intervals(s):
        for c, p in enumerate(cuts):
            if lo < p <= hi:
                crossing[c].append((str(t), b))
    grad_bytes = [0] * len(cuts)
    for n in s.backward:
        for t in g.outputs(n):
            a = s.tensor_anchor(t)
            if a is None:
                continue
            where = [x for c, slot in g.consumers(t) for x in [s.reader_anchor(c, slot)] if x is not None]
            lo, hi = min(where + [a]), max(where + [a])
            for c, p in enumerate(cuts):
                if lo < p <= hi:
                    grad_bytes[c] += tensor_bytes(g, t)
    return tuple(Cut(index=c + 1, after=s.order[p - 1], before=s.order[p], tensors=tuple(sorted(crossing[c])),
                     bytes=sum(b for _, b in crossing[c]), gradient_bytes=grad_bytes[c])
                 for c, p in enumerate(cuts))


def _share_updated_together(g: FunctionGraph, step: TrainStep, owner: Dict[str, int],
                             shared: Dict[str, Tuple[int, ...]], slot_owner: Dict[str, int],
                             slot_shared: Dict[str, Tuple[int, ...]], k: int) -> None:
    """On MPI ranks: variables of several stages that one functional op of the update writes
    together (a loss-scale optimizer applying every gradient under its finite check, Keras'
    gradient accumulation applying them every k steps, an update under ``tf.cond`` on the
    gradients) become shared by every stage (moved from ``owner`` and ``slot_owner`` to
    ``shared`` and ``slot_shared``): each holds a copy and runs the whole conditional update on
    the same gradients, as one process runs it, so the copies stay identical. Every stage, not
    only those owning one of them: with a stage holding none left out (3 stages, a middle one
    without variables), the last stage's copy of a first-stage bias came out different under a
    loss-scale optimizer, though the step's losses agreed."""
    from vfgraph.analysis.calls import is_functional

    together: Dict[str, List[str]] = {}
    for v, nodes in step.writes.items():
        for n in nodes:
            if n in g.nodes and is_functional(g.nodes[n].op):
                together.setdefault(n, []).append(v)
    for n in sorted(together):
        held = set()
        for v in together[n]:
            held |= {owner[v]} if v in owner else {slot_owner[v]} if v in slot_owner else set()
            held |= set(shared.get(v, slot_shared.get(v, ())))
        if len(held) < 2:
            continue
        held = set(range(1, k + 1))  # every stage runs it, one holding none of its variables too
        for v in together[n]:
            if v in owner or v in shared:
                owner.pop(v, None)
                shared[v] = tuple(sorted(held | set(shared.get(v, ()))))
            elif v in slot_owner or v in slot_shared:
                slot_owner.pop(v, None)
                slot_shared[v] = tuple(sorted(held | set(slot_shared.get(v, ()))))


def _term_stages(s: _Step, owner: Mapping[str, int], stage_of) -> Dict[str, int]:
    """Op -> stage for the ops of the terms (regularization terms, :meth:`_Step._reads_at`): each
    op reading variables that one stage owns on that stage, which sends what it computes (the
    scalar penalty) to the loss; the ops adding up terms of several stages where they are read."""
    out: Dict[str, int] = {}
    for t, _, p in s.terms:
        for n in s.term_nodes(t):
            st = {owner.get(v) for v in s._memo.get(n, ())}
            if len(st) == 1 and None not in st:
                k = st.pop()
                if k != stage_of(p):
                    out[n] = k
    return out
