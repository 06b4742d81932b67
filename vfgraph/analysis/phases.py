"""Steps with several dependent updates, split into phases.

A step whose later loss reads variables an earlier update of the same step wrote (a GAN: the
discriminator updated, then the generator's loss through the updated discriminator) is not one
cut: each virtual node of the later loss must read the variables after the earlier update has
run once on the whole batch's gradient. The step is split by dataflow into phases: the first
phase is everything that does not come after (through data or control edges) a read of a
variable an earlier update wrote that per-example work uses (:class:`DependentUpdates` names
those reads); the rest is the next phase, split again the same way if it has such reads too.
Each phase is a function over the step's own arguments, a one-phase training step that
:func:`analyze_train_step` cuts as usual; run in order (each phase's virtual nodes, then its
update, before the next phase starts), they are the original step.

The step's outputs are assembled from the phases' outputs: an output computed in one phase is
that phase's output; an output that adds values of several phases (``d + g``) is assembled by
its additions run once on the phases' outputs, each combined over virtual nodes as its own
plan says (a mean of ``d``, a mean of ``g``: their sum is the mean of ``d + g``). A later phase
recomputes the stateless work it shares with an earlier one (a generator's forward pass); it is
refused when that work reads a variable before an earlier phase updates it, or is stateful (a
random op): its value would be a different one.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Set, Tuple

from tensorflow.core.framework import function_pb2

from vfgraph.analysis.train_step import (DependentUpdates, TrainStep, analyze_train_step, batch_dependent_nodes,
                                         is_write, resource_root)
from vfgraph.errors import DetectionError, PipelineError
from vfgraph.ir.graph import FunctionGraph, TensorRef
from vfgraph.ir.names import function_name
from vfgraph.item import SignatureInfo

MAX_PHASES = 16
# Why a step with dependent updates has no pipeline stages (partition-stages and split-vnodes say it).
NO_STAGES = ("pipeline stages cannot run a step with dependent updates (each update's virtual nodes must all finish "
             "before the next update's start); train it without --stages (split-vnodes alone runs such a step "
             "phase by phase)")
# Ops through which an output that mixes phases is assembled once from the phases' combined
# values: each is linear, so it commutes with a mean or a sum over virtual nodes.
_LINEAR = {"Identity", "Snapshot", "AddV2", "Add", "Sub", "AddN", "Neg"}


@dataclass
class Phase:
    """One phase of a step: its function (a one-phase training step over the step's arguments)
    and the analysis of it. ``assemble``: for every phase but the last, the function computing
    the outputs of this phase and all later ones together (this phase's outputs, then the later
    phases' assembled outputs, in; the step's outputs from here on, out)."""

    graph: FunctionGraph
    step: TrainStep
    assemble: function_pb2.FunctionDef = None


def train_steps(g: FunctionGraph, sig: SignatureInfo, stages: bool = False) -> List[TrainStep]:
    """The analysis of the training function ``g``: one :class:`TrainStep`, or one per phase of
    a step with dependent updates (refused when ``stages``: cut into pipeline stages)."""
    try:
        return [analyze_train_step(g, sig)]
    except DependentUpdates as e:
        if stages:
            raise PipelineError(f"{e}: {NO_STAGES}") from None
        return [p.step for p in split_phases(g, sig, e)]


def split_phases(g: FunctionGraph, sig: SignatureInfo, dependent: DependentUpdates) -> List[Phase]:
    """The phases of ``g``, whose analysis raised ``dependent``: each a function ``g``'s
    arguments in, its writes and the outputs it contributes out, in the order they run."""
    phases: List[Phase] = []
    current, reads = g, dependent.reads
    while True:
        if len(phases) + 1 >= MAX_PHASES:
            raise DetectionError(f"signature {sig.key!r}: more than {MAX_PHASES} dependent updates in one step")
        k = len(phases) + 1
        first, rest, assemble = _split_first(current, sig, reads, function_name(sig.function, f"phase{k}"),
                                             function_name(sig.function, f"phase{k + 1}", "on"),
                                             function_name(sig.function, f"phase{k}", "assemble"))
        first_graph = FunctionGraph(first, g.library)
        try:
            phases.append(Phase(first_graph, analyze_train_step(first_graph, sig), assemble))
        except DependentUpdates as e:  # (not expected: its reads come after no update of its own)
            raise DetectionError(f"{e}; vfgraph could not split the step into phases there") from None
        rest_graph = FunctionGraph(rest, g.library)
        try:
            phases.append(Phase(rest_graph, analyze_train_step(rest_graph, sig)))
            return phases
        except DependentUpdates as e:
            current, reads = rest_graph, e.reads


def _children(g: FunctionGraph) -> Dict[str, List[str]]:
    """Each node's consumers through data and control edges."""
    kids: Dict[str, List[str]] = {}
    for n in g.nodes:
        for t, _ in g.inputs(n):
            kids.setdefault(t.node, []).append(n)
    return kids


def _split_first(g: FunctionGraph, sig: SignatureInfo, reads: List[str], first_name: str, rest_name: str,
                 assemble_name: str) -> Tuple[function_pb2.FunctionDef, function_pb2.FunctionDef,
                                               function_pb2.FunctionDef]:
    """``g`` as its first phase, the rest, and the function assembling ``g``'s outputs from theirs."""
    kids = _children(g)
    dep = batch_dependent_nodes(g, sig.batch_args)
    seeds = set(reads)
    while True:
        rest = g.reachable(seeds, lambda n: kids.get(n, ()))
        leaves = _output_leaves(g, rest)
        rest_leaves = [r for r in leaves if not r.is_function_arg and r.node in rest]
        needed = _needed_before(g, rest, rest_leaves)
        later = _written_after_needed(g, rest, needed, kids, dep)
        if not later:
            break
        seeds |= later  # (a counter the later phase reads, then increments: increment it there)
    _check_recomputed(g, sig, rest, needed)
    first_leaves = [r for r in leaves if r.is_function_arg or r.node not in rest]
    first = g.outline(first_name, [(f"part_{k}", r) for k, r in enumerate(first_leaves)], drop=frozenset(rest),
                      side_effects=True)
    drop = frozenset(n for n in g.nodes if n not in rest and n not in needed)
    later_fn = g.outline(rest_name, [(f"part_{k}", r) for k, r in enumerate(rest_leaves)], drop=drop,
                         side_effects=True)
    if any(r.is_function_arg for _, r in g.output_refs()):
        raise DetectionError(f"signature {sig.key!r}: an output of {g.name!r} is one of its inputs; vfgraph "
                             "cannot assemble it from the phases of a step with dependent updates")
    return first, later_fn, _assemble_function(g, assemble_name, first_leaves, rest_leaves)


def _assemble_function(g: FunctionGraph, name: str, first_leaves: List[TensorRef],
                       rest_leaves: List[TensorRef]) -> function_pb2.FunctionDef:
    """The function computing ``g``'s outputs from its leaves (the first phase's, then the
    rest's, as arguments) through the linear ops between them."""
    fb = FunctionGraph.new(name, g.library)
    value: Dict[TensorRef, TensorRef] = {}
    for prefix, leaves in (("first", first_leaves), ("rest", rest_leaves)):
        for k, r in enumerate(leaves):
            value[r] = fb.arg(f"{prefix}_{k}", g.dtype(r), g.shape(r))

    def build(ref: TensorRef) -> TensorRef:
        if ref not in value:
            node = g.nodes[ref.node]
            inputs = [build(t) for t in g.data_inputs(ref.node)]
            value[ref] = fb.op(node.op, inputs, name=ref.node, **dict(node.attr))[0]
        return value[ref]

    for out_name, ref in g.output_refs():
        fb.ret(out_name, build(ref), g.dtype(ref))
    return fb.finish()


def _output_leaves(g: FunctionGraph, rest: Set[str]) -> List[TensorRef]:
    """The tensors the step's outputs are assembled from (in a fixed order, each once): an
    output is its own leaf unless it is a linear op (an addition) over values of both the
    first phase and the rest, which then is assembled from its inputs' leaves."""
    memo: Dict[TensorRef, List[TensorRef]] = {}

    def leaves(ref: TensorRef) -> List[TensorRef]:
        if ref in memo:
            return memo[ref]
        memo[ref] = [ref]
        if not ref.is_function_arg and ref.node in rest and g.nodes[ref.node].op in _LINEAR:
            parts = [leaf for t in g.data_inputs(ref.node) for leaf in leaves(t)]
            if any(p.is_function_arg or p.node not in rest for p in parts):
                memo[ref] = parts
        return memo[ref]

    out: List[TensorRef] = []
    for _, ref in g.output_refs():
        out.extend(r for r in leaves(ref) if r not in out)
    return out


def _needed_before(g: FunctionGraph, rest: Set[str], rest_leaves: List[TensorRef]) -> Set[str]:
    """Nodes outside ``rest`` that the rest's outputs and effects read (their data ancestors,
    which the later phase recomputes)."""
    roots = [r.node for r in rest_leaves] + [n for n in rest if is_stateful(g, n)]
    needed: Set[str] = set()
    seen: Set[str] = set()
    stack = list(roots)
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        if n not in rest:
            needed.add(n)
        for t, ctl in g.inputs(n):
            if t.node not in g.nodes:
                continue
            if ctl and (n not in rest or t.node not in rest):
                continue  # (waits on the first phase are the phases' order)
            stack.append(t.node)
    return needed


def _written_after_needed(g: FunctionGraph, rest: Set[str], needed: Set[str], kids, dep: Set[str]) -> Set[str]:
    """Writes outside ``rest`` that do not depend on the batch and come after a read the rest
    needs of the same variable (an optimizer's step counter read for its learning rate, then
    incremented): they belong after the rest's work."""
    read_of: Dict[str, List[str]] = {}
    for n in needed:
        if g.nodes[n].op == "ReadVariableOp":
            res = resource_root(g, g.data_inputs(n)[0])
            if res is not None:
                read_of.setdefault(res, []).append(n)
    out: Set[str] = set()
    for n, node in g.nodes.items():
        if n in rest or n in dep or not is_write(node.op) or not node.input:
            continue
        res = resource_root(g, g.data_inputs(n)[0])
        if res in read_of and n in g.reachable(read_of[res], lambda m: kids.get(m, ())):
            out.add(n)
    return out


def _check_recomputed(g: FunctionGraph, sig: SignatureInfo, rest: Set[str], needed: Set[str]) -> None:
    """Refuse when what a later phase recomputes would not be what the step computed: a read of
    a variable the first phase writes, or a stateful op."""
    written: Dict[str, List[str]] = {}
    for n, node in g.nodes.items():
        if n not in rest and is_write(node.op) and node.input:
            res = resource_root(g, g.data_inputs(n)[0])
            if res is not None:
                written.setdefault(res, []).append(n)
    for n in sorted(needed):
        op = g.nodes[n].op
        if op == "ReadVariableOp":
            res = resource_root(g, g.data_inputs(n)[0])
            before = g.reachable([n], lambda m: [t.node for t, _ in g.inputs(m)])
            after = [w for w in written.get(res, ()) if w not in before]
            if not after:
                continue  # (a read after the updates recomputes the updated value)
            var = sig.variables[res].name if res in sig.variables else res
            raise DetectionError(
                f"signature {sig.key!r}: the update after {after[0]!r} uses {n!r}, which reads {var} before "
                "that update; vfgraph runs the step's dependent updates phase by phase and cannot keep a value "
                "from before an update for a later phase: compute the later loss from the updated variables")
        if is_stateful(g, n):
            raise DetectionError(
                f"signature {sig.key!r}: the later update of a step with dependent updates uses {n!r} ({op}), a "
                "stateful op the earlier update's work runs too; vfgraph runs the updates phase by phase and would "
                "run it twice: compute it inside the later loss")


def is_stateful(g: FunctionGraph, name: str) -> bool:
    """Whether node ``name`` of ``g`` runs a stateful op (a library function marked stateful)."""
    from tensorflow.python.framework import op_def_registry

    op = g.nodes[name].op
    if op in g.library:
        return g.library[op].signature.is_stateful
    od = op_def_registry.get(op)
    return bool(od and od.is_stateful)
