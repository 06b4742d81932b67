"""split-vnodes: run a training step as virtual nodes in an in-graph loop.

The training function is cut where per-example work ends (see
:mod:`vfgraph.analysis.train_step`). The part before the cut becomes the *virtual-node
function* (one slice of ``b`` examples in, loss and gradients out); the part after it becomes
the *update function* (averaged gradients in, the original optimizer update, run once).
The original function's name then holds a ``While`` loop over the slices of the fed batch:
the number of virtual nodes a process runs is read from the batch it is fed.

The loop is written by :mod:`vfgraph.rewrites.vnode_loop`; when partition-stages cut the step
into stages on MPI ranks, :mod:`vfgraph.rewrites.stage_steps` adds each stage's training step.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from typing import ClassVar, List, Optional, Tuple

from tensorflow.core.framework import types_pb2

from vfgraph import records
from vfgraph.analysis import random_ops
from vfgraph.analysis.memory import DEFAULT_MARGIN, size_problem
from vfgraph.analysis.phases import NO_STAGES, split_phases
from vfgraph.analysis.train_step import (DependentUpdates, TrainStep, analyze_train_step, check_batch_inputs,
                                         static_batch, training_signature, with_dynamic_batch)
from vfgraph.errors import DetectionError, PipelineError
from vfgraph.io.outputs import size_text
from vfgraph.io.signatures import (add_graph_signature, add_graph_variables, add_object_variables, add_signature,
                                   entry_header, has_object_graph, signature_wrapper)
from vfgraph.ir.attrs import func_attr, type_attr, types_attr
from vfgraph.ir.blocks import EXACT_MAX_TERMS, I32, I64, check, list_concat, zeros
from vfgraph.ir.graph import FunctionGraph, Node, TensorRef, verify_function_def
from vfgraph.ir.names import function_name
from vfgraph.item import GraphItem
from vfgraph.passes.base import OptionError, Pass, PassResult, option, register
from vfgraph.records import Gradient, MemoryBudget, Stages, VirtualNodes
from vfgraph.rewrites.stage_steps import add_stage_steps, check_stage_messages  # noqa: F401 - the stage rewrite
from vfgraph.rewrites.vnode_loop import (F32, VnodeLoop, assemble_outputs, call_function, call_update,
                                         mean_gradients, output_sum_specs, reduce_function, reduce_specs)


@register
@dataclass(frozen=True)
class SplitVnodesPass(Pass):
    """Run the training step as V virtual nodes of b examples in an in-graph loop: gradients
    summed over the virtual nodes, the optimizer's update applied once."""

    name: ClassVar[str] = "split-vnodes"
    produces: ClassVar[tuple] = (VirtualNodes,)
    vnodes: int = option(1, "virtual nodes per training step (V; 1: the same step, ready to be split later)", low=1,
                         flag=True, metavar="V")
    vnode_batch: int = option(0, "examples per virtual node (b); 0: the static batch / V, or, for a model whose batch "
                                 "is not fixed, the fed batch / V at each step", low=0, flag=True, metavar="B")
    signature: str = option("", "the training signature (default: 'train', or the one found to update variables)",
                            flag="--train-signature", metavar="NAME")
    stepwise: bool = option(True, "also add <key>_accumulate and <key>_apply signatures (one virtual node at a "
                                  "time, for a trainer that feeds them)")
    deterministic: bool = option(False, "sum the virtual nodes' gradients and outputs exactly (fixed point): any "
                                        "layout of the virtual nodes over ranks (1x8, 2x4, 5+3) trains bit-identical "
                                        "parameters", flag=True)
    memory_budget: str = option("", "the memory a training step may use, e.g. 2GiB, 512MiB, 1.5GB or bytes: b is the "
                                    "largest batch whose step, measured at b=1,2,4,..,32 and near the b chosen on this "
                                    "machine's CPU (or read from profile) and fitted as fixed + per-example x b, "
                                    "fits the budget less memory-margin (10%); V is then the fed batch / b (not with "
                                    "vnodes or vnode-batch)",
                                flag=True, metavar="SIZE", check=size_problem)
    memory_margin: float = option(DEFAULT_MARGIN, "with memory-budget: the share of the budget kept free of the "
                                                  "fitted memory", low=0.0, high=0.9, flag=True, metavar="SHARE")
    profile: str = option("", "with memory-budget: a step profile's JSON file ('vfgraph profile MODEL -o FILE', of "
                              "the machine the model will train on) whose measured memory chooses b, instead of a "
                              "step measured here; the same file gives the same rewrite", flag=True, metavar="FILE")

    def __post_init__(self) -> None:
        """The options' own checks, then a memory budget alone: it chooses b, and so V."""
        super().__post_init__()
        if not self.memory_budget and self.memory_margin != DEFAULT_MARGIN:
            raise OptionError(self.name, "memory-margin", self.memory_margin, "without memory-budget: nothing to keep "
                              "free; give a memory budget, or leave out the margin")
        if self.memory_budget and (self.vnodes != 1 or self.vnode_batch):
            given = f"vnodes={self.vnodes}" if self.vnodes != 1 else f"vnode-batch={self.vnode_batch}"
            raise OptionError(self.name, "memory-budget", self.memory_budget,
                              f"with {given}: the budget chooses b, and the virtual nodes are the fed batch / b; "
                              "leave out one of them")

    def differences(self, record: VirtualNodes) -> List[str]:
        """V, b (when given), deterministic and step-wise signatures against the record's."""
        # step-wise signatures asked for again where the first rewrite could not add them (a
        # model without an object graph, sparse rows of unknown shape) would not be added now either
        stepwise = self.stepwise and not self.deterministic and record.stepwise
        pairs = [("vnodes", self.vnodes, record.vnodes), ("deterministic", self.deterministic, record.deterministic),
                 ("stepwise", stepwise, record.stepwise)]
        if self.vnode_batch:
            pairs.append(("vnode-batch", self.vnode_batch, record.vnode_batch))
        text = lambda v: str(v).lower() if isinstance(v, bool) else str(v)  # noqa: E731 - as a pipeline writes it
        return [f"{k}={text(a)} given, {text(b)} recorded" for k, a, b in pairs if a != b]

    def call(self, item: GraphItem) -> PassResult:
        sig = training_signature(item, self.signature)
        again = self.rewritten_before(item, sig.key)
        if again:
            return PassResult(item, False, [again])
        # Read in place (no copy): the function is replaced last, once nothing reads it.
        original = FunctionGraph.over(item.function(sig.function), item.library)
        original.verify()
        check_batch_inputs(original, sig)
        self._check_budget(item, original, sig)
        b = 0 if self.memory_budget else self._vnode_batch(original, sig)
        static = static_batch(original, sig) > 0
        g = with_dynamic_batch(original, sig, b) if static else original
        try:
            step = analyze_train_step(g, sig)
        except DependentUpdates as dependent:  # several phases, one after the other
            if self.memory_budget:
                raise PipelineError(f"signature {sig.key!r}: memory-budget with a step of several phases (updates "
                                    "that read earlier ones) is not measured yet; give vnode-batch instead") from None
            return split_phased(self, item, sig, g, b, dependent)
        budget = self._budget(item, sig) if self.memory_budget else None
        b = budget.chosen if budget else b
        vnode_fn = function_name(sig.function, "vnode")
        update_fn = function_name(sig.function, "update")
        vnode_outputs = [o for o in step.outputs if o.side == "vnode"]
        update_outputs = [o for o in step.outputs if o.side == "update"]
        cut_args = [(f"grad_{k}", c.ref) for k, c in enumerate(step.cut)]
        vdef = g.outline(vnode_fn, [(f"out_{o.name}", o.ref) for o in vnode_outputs] + cut_args,
                         into=item.new_function(vnode_fn))
        stages = records.get(item, Stages).get(sig.key)
        in_flight = 1 if stages is None else stages.in_flight(self.vnodes)
        randoms, seeded, index_fn, random_notes = _key_random_ops(item, g, step, vdef, self.deterministic, in_flight)
        udef = g.outline(update_fn, [(f"out_{o.name}", o.ref) for o in update_outputs],
                         new_args=cut_args, keep_args=sig.invariant_args,
                         drop=frozenset(step.vnode_nodes), side_effects=True, into=item.new_function(update_fn))
        if self.deterministic and self.vnodes > EXACT_MAX_TERMS:
            raise PipelineError(f"vnodes={self.vnodes}: deterministic sums hold at most {EXACT_MAX_TERMS} virtual "
                                "nodes per step")
        if self.deterministic:
            from vfgraph import ops

            ops.load()  # VfExactAdd: a clear error when the op library cannot be built
        reduce_fn = function_name(sig.function, "reduce")
        item.set_function(reduce_function(reduce_fn, reduce_specs(g, step, self.deterministic)))
        loop = VnodeLoop(g, step, vdef, self.vnodes, b, item.library, item.new_function, in_flight,
                         exact=self.deterministic, index_fn=index_fn)
        stepped = _step_function(item, g, step, loop, udef, reduce_fn)
        verify_function_def(stepped, item.library)
        stepwise, notes = False, list(random_notes)
        if self.stepwise and self.deterministic:
            notes.append("step-wise signatures: not added (deterministic sums are made in the loop)")
        elif self.stepwise:
            stepwise, added = add_stepwise(item, g, step, loop, udef, reduce_fn)
            notes += added
            if stepwise and index_fn:
                notes.append("step-wise signatures: each process numbers the virtual nodes of its accumulate calls "
                             "from 0 (a call runs no collective); on several processes their random ops draw alike")
        item.set_function(stepped)
        item.preserve.add(sig.function)
        reduce_fns = (reduce_fn,)
        if stages is not None and stages.on_ranks and stages.count > 1:
            keys, stage_reduce = add_stage_steps(item, g, step, vdef, udef, self.vnodes, b, stages,
                                                 self.deterministic, index_fn)
            records.put(item, sig.key, replace(stages, signatures=keys, reduce_functions=stage_reduce))
            reduce_fns += stage_reduce
        gradients = tuple(Gradient(str(c.ref), sig.variables[c.variable].name if c.variable else None, c.role,
                                   None if c.shape is None else tuple(c.shape)) for c in step.cut)
        named = VirtualNodes.stepwise_signatures(sig.key) if stepwise else ("", "")
        records.put(item, sig.key, VirtualNodes(
            function=sig.function, vnodes=self.vnodes, vnode_batch=b, vnode_function=vnode_fn,
            update_function=update_fn, per_vnode_seeds=tuple(seeded), stepwise=stepwise,
            reduce_functions=reduce_fns, gradients=gradients, deterministic=self.deterministic,
            random_ops=tuple(randoms), index_function=index_fn, accumulate_signature=named[0],
            apply_signature=named[1], memory=budget))
        return PassResult(item, True, notes + _budget_notes(budget))

    def _vnode_batch(self, g: FunctionGraph, sig) -> int:
        if self.vnode_batch:
            return self.vnode_batch
        static = static_batch(g, sig)
        if static > 0:
            if static % self.vnodes:
                raise DetectionError(
                    f"signature {sig.key!r}: static batch {static} is not divisible by vnodes={self.vnodes}; "
                    "choose vnodes that divide it or give --vnode-batch")
            return static // self.vnodes
        return 0

    def _check_budget(self, item: GraphItem, g: FunctionGraph, sig) -> None:
        """Refuses a memory budget where it cannot choose b (with pipeline stages, a fixed batch),
        and a profile nothing reads."""
        where = f"signature {sig.key!r}: "
        if not self.memory_budget:
            if self.profile and records.get(item, Stages).get(sig.key) is None:
                raise PipelineError(f"profile={self.profile} without memory-budget or stages: nothing reads the "
                                    "profile; give a memory budget (or pipeline stages), or leave out the profile")
            return
        if records.get(item, Stages).get(sig.key) is not None:
            raise PipelineError(f"{where}memory-budget with pipeline stages: a budget per stage device is not "
                                "measured yet; give vnode-batch (or vnodes) with the stages")
        static = static_batch(g, sig)
        if static > 0:
            raise PipelineError(f"{where}the batch is fixed at {static} examples, so the step cannot be measured at "
                                "other batches; export it with an unknown batch dimension (None), or give "
                                "vnode-batch instead of memory-budget")

    def _budget(self, item: GraphItem, sig) -> MemoryBudget:
        """The virtual-node batch the memory budget allows (:mod:`vfgraph.analysis.memory`): the
        peaks of the step as this pass runs it, read from ``profile``, or measured on the model
        ``item`` was loaded from."""
        from vfgraph.analysis.memory import fit_budget, measure_budget, parse_size
        from vfgraph.analysis.profile import read_profile

        where = f"signature {sig.key!r}: "
        if self.profile:
            profile = read_profile(self.profile)
            if profile.signature != sig.key or profile.memory is None:
                what = (f"is of signature {profile.signature!r}" if profile.signature != sig.key
                        else "holds no memory measurement")
                raise PipelineError(f"{self.profile}: the profile {what}; profile the step with this vfgraph: "
                                    f"vfgraph profile MODEL --train-signature {sig.key} -o FILE")
            fit = fit_budget(profile.memory, parse_size(self.memory_budget), self.memory_margin, where=where)
            source = "profile"
        else:
            fit = measure_budget(item.source, sig.key, parse_size(self.memory_budget), self.memory_margin,
                                 where=where)
            source = "measured"
        p = fit.peaks
        return MemoryBudget(fit.budget, fit.margin, fit.fixed, fit.per_example, fit.chosen, p.batches, p.peaks,
                            p.device, source, p.measured_on)


def _budget_notes(budget: Optional[MemoryBudget]) -> List[str]:
    """The note of the b a memory budget chose (none without one)."""
    if budget is None:
        return []
    return [f"memory budget {size_text(budget.budget)}: b={budget.chosen} examples per virtual node (fit "
            f"{size_text(budget.fixed)} + {size_text(budget.per_example)} per "
            f"example from b={','.join(map(str, budget.batches))}, {budget.margin:.0%} margin); feed a multiple of "
            f"{budget.chosen} examples"]


def _key_random_ops(item: GraphItem, g: FunctionGraph, step: TrainStep, vdef, deterministic: bool, in_flight: int):
    """Key the random ops of virtual-node function ``vdef`` of step ``g`` by the global virtual
    node index (:mod:`vfgraph.analysis.random_ops`): returns (the random ops found, the seed
    reads keyed, the index function added ("" when nothing is keyed), notes)."""
    sig = step.signature
    found, reads, generators, converts = random_ops.find(vdef, item.library, ordered=in_flight == 1)
    counter = None
    if any(not r.keyed and r.op in random_ops.CONVERTIBLE for r in found):  # keyed by the step counter, if any
        counter = random_ops.step_counter(g, step.vnode_nodes, sig.variables)
        if counter:
            found, reads, generators, converts = random_ops.find(vdef, item.library, ordered=in_flight == 1,
                                                                 counter=counter[0])
    notes = random_ops.check(found, sig.key, deterministic)
    if not reads and not generators and not converts:
        return found, [], "", notes
    random_ops.key(vdef, reads, generators, item.library, converts, counter)
    index_fn = function_name(sig.function, "vnode_offset")
    item.set_function(random_ops.offset_function(index_fn))
    return found, reads, index_fn, notes


def _step_function(item: GraphItem, g: FunctionGraph, step: TrainStep, loop: VnodeLoop, udef, reduce_fn: str):
    """The replacement training function: loop, reduce, average, update once; the original's
    name, arguments and outputs."""
    sig = step.signature
    original = item.function(sig.function)
    lib = item.library
    fb, args = FunctionGraph.like(original, lib)
    results, call, updated = loop.run_step(fb, dict(zip(g.arg_names, args)), reduce_fn, udef)
    for o, a, r in zip(step.outputs, original.signature.output_arg, assemble_outputs(step, results, updated)):
        fb.ret(a.name, fb.op("Identity", [r], name="result", deps=[call], T=type_attr(a.type),
                             shapes=[g.shape(o.ref)])[0], a.type)
    return fb.finish()


# --------------------------------------------------------------------------- step-wise mode
ACCUMULATORS = "vf_accumulators"
VNODES_BEFORE = "vf_vnodes_before"  # (keyed random ops) the virtual nodes the step's accumulate calls ran before
GENERATOR_START = "vf_generator_start"  # (a keyed tf.random.Generator) its state at the step's start


def _generator_states(vdef, sig) -> Optional[List[Tuple[str, int, List[int]]]]:
    """The state variables of the keyed ``tf.random.Generator`` reads of virtual-node function
    ``vdef`` as (the step's resource argument, dtype, shape), in order of first read; None when
    one is not read from an argument of a known shape."""
    from vfgraph.ir.names import tensor_node

    args = {a.name for a in vdef.signature.input_arg}
    found: dict = {}
    for node in vdef.node_def:
        if node.op == "RngReadAndSkip":
            arg = tensor_node(node.input[0])
            info = sig.variables.get(arg) if arg in args else None
            if info is None or info.shape is None or any(d < 0 for d in info.shape):
                return None
            found.setdefault(arg, (arg, info.dtype, list(info.shape)))
    return list(found.values())


def _restart_generators(fb: FunctionGraph, by, before: TensorRef, generators, invariant_args,
                        res: List[TensorRef]) -> List[TensorRef]:
    """Start each keyed generator of an accumulate call from its state at the step's start:
    the step's first call (``before``, the virtual nodes before it, is 0) keeps that state in a
    variable, the later calls restore it from there. A call's last virtual node skips the
    state, so after the step's last call it has skipped once, as in the looped step. Returns
    ``res`` (the step's invariant arguments), the generators' read once restarted."""
    first = fb.op("Equal", [before, fb.const(0, I64, "none_before")[0]], name="first_call", T=type_attr(I64))[0]
    writes = []
    for k, (arg, dtype, _) in enumerate(generators):
        t = type_attr(dtype)
        now = fb.op("ReadVariableOp", [by[arg]], name="generator_state", dtype=t)[0]
        kept = fb.op("ReadVariableOp", [by[f"{GENERATOR_START}_{k}"]], name="generator_start", dtype=t)[0]
        start = fb.op("SelectV2", [first, now, kept], name="step_start", T=t)[0]
        writes.append(fb.op("AssignVariableOp", [by[f"{GENERATOR_START}_{k}"], start], name="keep_start", dtype=t))
        writes.append(fb.op("AssignVariableOp", [by[arg], start], name="restart", dtype=t))
    restarted = {arg for arg, _, _ in generators}
    return [fb.op("Identity", [r], name="restarted", deps=writes, T=type_attr(types_pb2.DT_RESOURCE))[0]
            if a in restarted else r for a, r in zip(invariant_args, res)]


def add_stepwise(item: GraphItem, g: FunctionGraph, step: TrainStep, loop: VnodeLoop, udef,
                 reduce_fn: str) -> Tuple[bool, List[str]]:
    """Add ``<train>_accumulate`` (run the fed batch's virtual nodes, add their gradient sums
    and count into accumulator variables, return their mean loss) and ``<train>_apply``
    (average the accumulators, apply the original update once, reset them): the step-wise
    mode for runtimes that feed virtual nodes one call at a time, under the keys
    :meth:`VirtualNodes.stepwise_signatures` gives. With random ops keyed by the global virtual
    node index, a counter variable numbers each call's virtual nodes after those of the step's
    calls before it (apply resets it), so accumulate called on the step's slices in order, then
    apply, draws what the looped step draws on one process. Returns (whether they were added,
    notes: why not)."""
    sig = step.signature
    tf1 = item.kind == "tf1_saved_model"
    refused = _stepwise_refused(item, step, tf1)
    if refused:
        return False, [refused]
    wrapper = None if tf1 else signature_wrapper(item, sig.key)
    if not tf1 and wrapper is None:
        return False, [f"step-wise signatures: signature {sig.key!r} has no wrapper vfgraph can extend"]
    if tf1:  # the signature function is called from the graph: its own arguments and outputs
        inner, n_inputs = list(g.arg_names), len(sig.batch_args)
        out_names = [a.name for a in g.header.signature.output_arg]
    else:  # the wrapper's argument order: inputs, then bound variables
        inner, n_inputs = list(wrapper.args), len(wrapper.input_args)
        out_names = list(wrapper.outputs)
    keyed = bool(loop.index_fn)  # random ops keyed by the global index: each call numbers on from the last
    generators = _generator_states(loop.vdef, sig) if keyed else []
    if generators is None:
        return False, ["step-wise signatures: not added (a keyed tf.random.Generator whose state variable vfgraph "
                       "cannot follow to an argument of the step)"]
    specs, acc_args = _accumulator_specs(step, keyed, generators)
    # Names of object-graph functions end in an integer (TensorFlow's fingerprinting needs it).
    acc_fn = function_name(sig.function, "accumulate", "0")
    apply_fn = function_name(sig.function, "apply", "0")
    acc_header = entry_header(g, acc_fn, inner, acc_args, out_names, [g.dtype(o.ref) for o in step.outputs])
    counted = ["vnodes"] if tf1 else []  # a TF1 signature needs an output: the virtual nodes applied
    apply_header = entry_header(g, apply_fn, inner[n_inputs:], acc_args, counted, [F32] * len(counted))
    _accumulate_function(item, g, step, loop, acc_header, inner + acc_args, generators)
    _apply_function(item, g, step, udef, reduce_fn, apply_header, inner[n_inputs:] + acc_args, acc_args, keyed)
    acc_key, apply_key = VirtualNodes.stepwise_signatures(sig.key)
    handles = add_graph_variables(item, ACCUMULATORS, specs)
    if tf1:
        add_graph_signature(item, acc_key, acc_fn, sig.call_inputs + handles, like=sig.key, outputs=sig.output_keys)
        add_graph_signature(item, apply_key, apply_fn, sig.call_inputs[n_inputs:] + handles,
                            new_outputs=[("vnodes", F32, [])])
        return True, []
    acc_ids = add_object_variables(item, ACCUMULATORS, specs)
    add_signature(item, acc_key, acc_fn, wrapper, takes_inputs=True, bound=acc_ids, graph_handles=handles)
    add_signature(item, apply_key, apply_fn, wrapper, takes_inputs=False, bound=acc_ids, graph_handles=handles)
    return True, []


def _stepwise_refused(item: GraphItem, step: TrainStep, tf1: bool) -> str:
    """Why the step-wise signatures cannot be added to ``item``'s step ``step`` ("" when they can)."""
    if not tf1 and not has_object_graph(item):
        return f"step-wise signatures: not added to {item.kind} models"
    if any(c.combine != "mean" and (not c.shape or any(d < 0 for d in c.shape[1:])) for c in step.cut):
        return "step-wise signatures: not added (sparse gradient rows of unknown shape)"
    if any(o.side != "vnode" for o in step.outputs):
        return "step-wise signatures: not added (an output is computed by the update)"
    return ""


def _accumulator_specs(step: TrainStep, keyed: bool, generators) -> Tuple[list, List[str]]:
    """The accumulator variables of the step-wise signatures as (name, dtype, shape) and their
    arguments: one per gradient, the count of virtual nodes, with keyed random ops the virtual
    nodes before the call, and each keyed generator's state at the step's start."""
    specs = [(f"grad_{k}", c.dtype, c.shape) for k, c in enumerate(step.cut)] + [("count", F32, [])]
    acc_args = [f"vf_accumulator_{k}" for k in range(len(step.cut))] + ["vf_count"]
    if keyed:
        specs.append(("vnodes_before", I64, []))
        acc_args.append(VNODES_BEFORE)
    for k, (_, dtype, shape) in enumerate(generators):  # each generator's state at the step's start
        specs.append((f"generator_start_{k}", dtype, shape))
        acc_args.append(f"{GENERATOR_START}_{k}")
    return specs, acc_args


def _apply_function(item: GraphItem, g: FunctionGraph, step: TrainStep, udef, reduce_fn: str, header, names,
                    acc_args: List[str], keyed: bool) -> None:
    """Write ``<train>_apply`` (``header``, its arguments ``names``) into the library: the
    accumulated sums reduced by the step's reduce function, averaged, the update applied once,
    the accumulators reset (with keyed random ops, the virtual nodes before the next call too);
    a TF1 signature's (its one output) returns the virtual nodes applied."""
    sig = step.signature
    acc_key, apply_key = VirtualNodes.stepwise_signatures(sig.key)
    fb, args = FunctionGraph.like(header, item.library, into=item.new_function(header.signature.name))
    by = dict(zip(names, args))
    types = [c.dtype for c in step.cut] + [F32]
    sums = [fb.op("ReadVariableOp", [by[a]], name="sum", dtype=type_attr(t))[0] for a, t in zip(acc_args, types)]
    # The step's own reduce function (one fused reduction per model); the loop-output sums it
    # also takes (the loss) are zeros here.
    unused = [(zeros(fb, shape, t, "unused"), t) for t, shape, _ in output_sum_specs(g, step)]
    args = [v for v, _ in unused] + sums
    arg_types = [t for _, t in unused] + types
    reduced = fb.op("StatefulPartitionedCall", args, name="reduce", Tin=types_attr(arg_types),
                    Tout=types_attr(arg_types), f=func_attr(reduce_fn))
    got = reduced.outputs()[len(unused):]
    some = fb.op("Greater", [got[-1], fb.const(0.0, F32, "zero")[0]], name="some", T=type_attr(F32))[0]
    ok = check(fb, some, f"vfgraph: {apply_key} found no accumulated virtual node; call {acc_key} with a batch first")
    means = mean_gradients(fb, step, got[:-1], got[-1])
    call, _ = call_update(fb, udef, means, [by[a] for a in sig.invariant_args], after=[reduced, ok])
    for a, c in zip(acc_args, step.cut):
        empty = c.shape if c.combine == "mean" else [0] + list(c.shape[1:])  # sparse: no rows yet
        fb.control_ret(fb.op("AssignVariableOp", [by[a], zeros(fb, empty, c.dtype)], name="reset", deps=[call],
                             dtype=type_attr(c.dtype)))
    reset = fb.op("AssignVariableOp", [by["vf_count"], fb.const(0.0, F32, "zero")[0]], name="reset",
                  deps=[call], dtype=type_attr(F32))
    fb.control_ret(reset)
    if keyed:  # the next step's virtual nodes are numbered from 0
        fb.control_ret(fb.op("AssignVariableOp", [by[VNODES_BEFORE], fb.const(0, I64, "first")[0]], name="reset",
                             deps=[call], dtype=type_attr(I64)))
    for name in [a.name for a in header.signature.output_arg]:
        fb.ret(name, fb.op("Identity", [got[-1]], name="applied", deps=[reset], T=type_attr(F32), shapes=[[]])[0], F32)
    fb.finish()


def _accumulate_function(item: GraphItem, g: FunctionGraph, step: TrainStep, loop: VnodeLoop, header, names,
                         generators) -> None:
    """Write ``<train>_accumulate`` (``header``, its arguments ``names``) into the library:
    the fed batch's virtual nodes, their gradient sums and count added to the accumulators;
    with keyed random ops, numbered from ``vf_vnodes_before``, which it advances, and each
    keyed generator of ``generators`` restarted (:func:`_restart_generators`)."""
    sig = step.signature
    keyed = bool(loop.index_fn)
    fb, args = FunctionGraph.like(header, item.library, into=item.new_function(header.signature.name))
    by = dict(zip(names, args))
    before = fb.op("ReadVariableOp", [by[VNODES_BEFORE]], name="vnodes_before", dtype=type_attr(I64)) if keyed else None
    res = [by[a] for a in sig.invariant_args]
    if generators:
        res = _restart_generators(fb, by, before[0], generators, sig.invariant_args, res)
    outs, sums, _, nv, done = loop.emit(fb, [by[a] for a in sig.batch_args], res, first=before[0] if keyed else None)
    count = fb.op("Cast", [nv], name="count", SrcT=type_attr(I32), DstT=type_attr(F32), Truncate=False)[0]
    acc_args = [f"vf_accumulator_{k}" for k in range(len(step.cut))]
    adds = [_accumulate(fb, by[a], v, c) for a, v, c in zip(acc_args, sums, step.cut)]
    adds.append(fb.op("AssignAddVariableOp", [by["vf_count"], count], name="accumulate", dtype=type_attr(F32)))
    if keyed:  # the next call's first virtual node comes after this call's
        n64 = fb.op("Cast", [nv], name="vnodes", SrcT=type_attr(I32), DstT=type_attr(I64), Truncate=False)[0]
        adds.append(fb.op("AssignAddVariableOp", [by[VNODES_BEFORE], n64], name="number_on", deps=[before, done],
                          dtype=type_attr(I64)))
    for a in adds:
        fb.control_ret(a)
    for o, a, r in zip(step.outputs, header.signature.output_arg, loop.outputs(fb, outs, count, nv)):
        fb.ret(a.name, fb.op("Identity", [r], name="result", deps=adds, T=type_attr(a.type),
                             shapes=[g.shape(o.ref)])[0], a.type)
    fb.finish()


def _accumulate(fb: FunctionGraph, acc: TensorRef, value: TensorRef, c) -> Node:
    """Add one call's gradient sum to accumulator ``acc``; a sparse gradient's rows (a tensor
    list from the loop) are appended to the rows accumulated so far."""
    t = type_attr(c.dtype)
    if c.combine == "mean":
        return fb.op("AssignAddVariableOp", [acc, value], name="accumulate", dtype=t)
    old = fb.op("ReadVariableOp", [acc], name="rows", dtype=t)[0]
    new = list_concat(fb, value, c.dtype)
    rows = fb.op("ConcatV2", [old, new, fb.const(0, I32, "axis")[0]], name="append", N=2, T=t, Tidx=type_attr(I32))
    return fb.op("AssignVariableOp", [acc, rows[0]], name="accumulate", dtype=t)


# --------------------------------------------------------------------------- steps with dependent updates
# split-vnodes for a step with dependent updates: each phase over all virtual nodes in turn.
#
# :mod:`vfgraph.analysis.phases` splits such a step (a GAN's discriminator update, then the
# generator's through the updated discriminator) into phases, each a one-phase training step.
# Each phase becomes what split-vnodes makes of a one-phase step: a loop over the virtual nodes
# summing that phase's gradients, its reduce point, its update once. The replacement step runs
# them in order: phase k + 1's loop reads the variables once phase k's update has run (its
# resource arguments pass through an Identity that waits for that update). The step's outputs
# are assembled from the phases' outputs (see :mod:`vfgraph.analysis.phases`).
def split_phased(options, item: GraphItem, sig, g: FunctionGraph, b: int, dependent: DependentUpdates) -> PassResult:
    """The split-vnodes rewrite (``options``: the pass) of the training function ``g`` of
    ``sig`` whose analysis raised ``dependent``: one virtual-node loop and update per phase."""
    stages = records.get(item, Stages).get(sig.key)
    if stages is not None:
        raise PipelineError(f"{dependent}: {NO_STAGES}")  # (partition-stages refuses it first)
    if options.deterministic and options.vnodes > EXACT_MAX_TERMS:
        raise PipelineError(f"vnodes={options.vnodes}: deterministic sums hold at most {EXACT_MAX_TERMS} virtual "
                            "nodes per step")
    if options.deterministic:
        from vfgraph import ops

        ops.load()
    phases = split_phases(g, sig, dependent)
    built, seeded, reducers, gradients, randoms, notes = [], [], [], [], [], []
    index_fns = set()  # (one function, named after the step: the same for every phase)
    for k, phase in enumerate(phases, 1):
        gk, step = phase.graph, phase.step
        tag = f"phase{k}"
        vnode_fn = function_name(sig.function, tag, "vnode")
        update_fn = function_name(sig.function, tag, "update")
        vnode_outputs = [o for o in step.outputs if o.side == "vnode"]
        update_outputs = [o for o in step.outputs if o.side == "update"]
        cut_args = [(f"grad_{i}", c.ref) for i, c in enumerate(step.cut)]
        vdef = gk.outline(vnode_fn, [(f"out_{o.name}", o.ref) for o in vnode_outputs] + cut_args,
                          into=item.new_function(vnode_fn))
        found, keyed, index_fn, random_notes = _key_random_ops(item, gk, step, vdef, options.deterministic, 1)
        randoms += found
        seeded += keyed
        index_fns.add(index_fn)
        notes += random_notes
        udef = gk.outline(update_fn, [(f"out_{o.name}", o.ref) for o in update_outputs],
                          new_args=cut_args, keep_args=sig.invariant_args,
                          drop=frozenset(step.vnode_nodes), side_effects=True, into=item.new_function(update_fn))
        reduce_fn = function_name(sig.function, tag, "reduce")
        item.set_function(reduce_function(reduce_fn, reduce_specs(gk, step, options.deterministic)))
        loop = VnodeLoop(gk, step, vdef, options.vnodes, b, item.library, item.new_function, 1, tag,
                             exact=options.deterministic, index_fn=index_fn)
        built.append((gk, step, loop, udef, reduce_fn))
        reducers.append(reduce_fn)
        gradients += [Gradient(str(c.ref), sig.variables[c.variable].name if c.variable else None, c.role,
                               None if c.shape is None else tuple(c.shape)) for c in step.cut]
        if phase.assemble is not None:
            item.set_function(phase.assemble)
    stepped = _phased_step_function(item, g, built, [p.assemble for p in phases[:-1]])
    verify_function_def(stepped, item.library)
    item.set_function(stepped)
    item.preserve.add(sig.function)
    first = built[0]
    records.put(item, sig.key, VirtualNodes(
        function=sig.function, vnodes=options.vnodes, vnode_batch=b, vnode_function=first[2].vdef.signature.name,
        update_function=first[3].signature.name, per_vnode_seeds=tuple(seeded), stepwise=False,
        reduce_functions=tuple(reducers), gradients=tuple(gradients), deterministic=options.deterministic,
        random_ops=tuple(randoms), index_function=max(index_fns)))
    notes.insert(0, f"{len(phases)} phases (dependent updates): each runs over all virtual nodes before the next")
    if options.stepwise and not options.deterministic:
        notes.append("step-wise signatures: not added (a step with dependent updates runs each phase over the "
                     "whole batch)")
    return PassResult(item, True, notes)


def _phased_step_function(item: GraphItem, g: FunctionGraph, built, assembles):
    """The replacement training function: each phase's loop, reduce and update in turn (a
    phase's loop reads the variables once the phase before has updated them), then the
    outputs assembled from the phases' results."""
    sig = built[0][1].signature
    original = item.function(sig.function)
    lib = item.library
    fb, args = FunctionGraph.like(original, lib)
    by = dict(zip(g.arg_names, args))
    batch = [by[a] for a in sig.batch_args]
    after: list = []
    values: List[list] = []
    for gk, step, loop, udef, reduce_fn in built:
        res = [by[a] for a in sig.invariant_args]
        if after:  # the variables as the phase before left them
            res = [fb.op("Identity", [r], name="after_phase", deps=after, T=type_attr(g.arg_type(a)))[0]
                   for a, r in zip(sig.invariant_args, res)]
        outs, sums, fused, nv, done = loop.emit(fb, batch, res)
        outs, sums, count = loop.reduce(fb, outs, sums, fused, nv, reduce_fn)
        results = loop.outputs(fb, outs, count, nv)
        call, updated = call_update(fb, udef, mean_gradients(fb, step, sums, count), res, after=[done] + after)
        values.append(assemble_outputs(step, results, updated))
        after = [call]
    out = values[-1]
    for k in reversed(range(len(assembles))):
        fdef = assembles[k]
        out = call_function(fb, fdef, values[k] + out, "assemble", deps=after).outputs()
    for a, (_, ref), r in zip(original.signature.output_arg, g.output_refs(), out):
        fb.ret(a.name, fb.op("Identity", [r], name="result", deps=after, T=type_attr(a.type),
                             shapes=[g.shape(ref)])[0], a.type)
    return fb.finish()
