"""partition-stages: cut a training step into K pipeline stages placed on K devices.

The forward computation is cut into K consecutive stages (:mod:`vfgraph.analysis.stages`:
balanced by estimated cost, by the measured times of a profiled step with ``balance=profile``
(:mod:`vfgraph.analysis.profile`: a step profiled here, or the one ``vfgraph profile`` wrote to
the file ``profile``), or where ``split-at`` says); every backward op goes on the stage of the
forward op it differentiates, every variable, its update and its optimizer state on
the stage whose forward ops read it. The pass writes where each op runs (the ``device`` of
its node) and where each variable lives (the object graph's saved device), and nothing else:
the step computes what it computed, and TensorFlow's own partitioner sends the tensors that
cross a cut between devices.

It runs before ``split-vnodes``, which then lets the virtual-node loop keep several virtual
nodes in flight, so that stage k works on virtual node i+1 while stage k+1 works on virtual
node i: the virtual nodes are the pipeline's micro-batches. ``schedule=1f1b`` keeps at most K
in flight (at most K virtual nodes' activations alive), ``schedule=gpipe`` all of them.

Without ``devices`` the stages are MPI ranks: rank k of ``mpiexec -n K`` runs stage k+1. The
pass then marks each op with its stage (the attribute ``Stages.MARK`` of
:mod:`vfgraph.records`, which TensorFlow ignores) instead of a device, and ``split-vnodes``
adds one training signature per stage (``train_stage_1`` ...) whose virtual-node loop runs
that stage's ops only, receiving the tensors other stages compute with ``VfRecv`` and sending
its own with ``VfSend``. A variable read by several stages is then held by each of them (its
part lists it), each applying the same update from the same summed gradient (split-vnodes'
stage updates). So is every variable
that one conditional update writes with variables of other stages (a loss-scale optimizer's
apply under its finite check, Keras' gradient accumulation, ``tf.cond`` on the gradients):
each of those stages runs the whole conditional update on every gradient.

An ``IdentityN`` whose outputs belong to different stages (Keras passes the gradients
through one) becomes one ``Identity`` per output, each on its output's stage.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import ClassVar, Dict, List, Optional, Tuple

import numpy as np

from vfgraph import records
from vfgraph.analysis.profile import profile_of
from vfgraph.analysis.stages import StagePlan, dtype_size, plan_stages
from vfgraph.analysis.phases import train_steps
from vfgraph.analysis.train_step import check_batch_inputs, training_signature
from vfgraph.errors import PipelineError
from vfgraph.io.signatures import has_object_graph, set_variable_devices
from vfgraph.ir.attrs import type_attr
from vfgraph.ir.graph import FunctionGraph, TensorRef
from vfgraph.ir.names import canonical_device
from vfgraph.item import GraphItem
from vfgraph.passes.base import Pass, PassResult, option, register
from vfgraph.records import StagePart, Stages, VirtualNodes

SCHEDULES = ("1f1b", "gpipe")
BALANCES = ("estimate", "profile")


@register
@dataclass(frozen=True)
class PartitionStagesPass(Pass):
    """Cut the training step into K pipeline stages on K devices (model parallelism): each
    stage's forward ops, the backward ops that differentiate them, its variables and their
    optimizer state on its device. Run it before split-vnodes, whose virtual nodes become
    the pipeline's micro-batches."""

    name: ClassVar[str] = "partition-stages"
    produces: ClassVar[tuple] = (Stages,)
    stages: int = option(2, "pipeline stages (K), for model parallelism: the training step cut into K stages, stage "
                            "k on the k-th of devices, or without devices on MPI rank k-1 of 'mpiexec -n K vfgraph "
                            "train'; its virtual nodes are the pipeline's micro-batches (a rewrite without stages, "
                            "devices or split-at cuts nothing)", low=1, flag=True, metavar="K")
    devices: str = option("", "the device of each stage, e.g. /GPU:0;/GPU:1 in a pipeline, /GPU:0,/GPU:1 on the "
                              "command line (/CPU:0,/CPU:1: 'vfgraph train' makes logical CPU devices where there are "
                              "fewer); none: stage k runs on MPI rank k-1", flag=True, metavar="D1,D2,...")
    split_at: str = option("", "the forward ops that start stages 2..K, separated by ';' in a pipeline, by ',' on the "
                               "command line (default: the cuts that balance the estimated cost; 'vfgraph inspect "
                               "MODEL --stages K' shows them)", flag=True, metavar="OP,...")
    schedule: str = option("1f1b", "1f1b (the default) keeps at most K virtual nodes in flight, so at most K virtual "
                                   "nodes' activations; gpipe runs all of a step's at once", flag=True,
                           choices=SCHEDULES)
    balance: str = option("estimate", "what the cuts balance: estimate (the default: each op's cost estimated from "
                                      "static shapes; the same cuts on any machine) or profile (each op's time in a "
                                      "training step run here on a synthetic batch, on this machine's CPU, or the "
                                      "times in profile; the cuts chosen are in the notes: give them as split-at to "
                                      "repeat the rewrite)", flag=True, choices=BALANCES)
    profile_batch: int = option(32, "with balance profile: the examples in the profiled step's batch, a virtual "
                                    "node's batch as the stages will run it (on the command line, the default is "
                                    "--vnode-batch where given)", low=1, flag=True, metavar="N")
    profile: str = option("", "a step profile's JSON file ('vfgraph profile MODEL -o FILE', of this machine or the "
                              "one the model will train on) whose times the cuts balance, instead of a step profiled "
                              "here, with balance profile (which --profile implies); the same file gives the same "
                              "cuts", flag=True, metavar="FILE")
    signature: str = option("", "the training signature (default: 'train', or the one found to update variables)",
                            flag="--train-signature", metavar="NAME")

    def differences(self, record: Stages) -> List[str]:
        """K, the schedule, the devices and the cuts (when given) against the record's."""
        split_at = tuple(s.strip() for s in self.split_at.split(";")) if self.split_at.strip() else record.split_at
        pairs = [("stages", self.stages, record.count), ("schedule", self.schedule, record.schedule),
                 ("devices", ";".join(self._devices()), ";".join(p.device for p in record.parts)),
                 ("split-at", ";".join(split_at), ";".join(record.split_at))]
        return [f"{k}={a or repr('')} given, {b or repr('')} recorded" for k, a, b in pairs if a != b]

    def call(self, item: GraphItem) -> PassResult:
        devices = self._devices()
        split_at = tuple(s.strip() for s in self.split_at.split(";")) if self.split_at.strip() else ()
        if self.schedule not in SCHEDULES:
            raise PipelineError(f"schedule={self.schedule!r}: choose {' or '.join(SCHEDULES)}")
        if self.balance not in BALANCES:
            raise PipelineError(f"balance={self.balance!r}: choose {' or '.join(BALANCES)}")
        if self.profile and self.balance != "profile":
            raise PipelineError(f"profile={self.profile}: the cuts balance a profile's times with balance=profile "
                                "only; give both")
        if not has_object_graph(item):
            raise PipelineError(f"{item.source}: partition-stages takes TF2 SavedModels (with an object graph); this "
                                f"is a {item.kind.replace('_', ' ')}: export the model with tf.saved_model.save")
        sig = training_signature(item, self.signature)
        if sig.key in records.get(item, VirtualNodes):
            raise PipelineError(f"signature {sig.key!r} already runs virtual nodes: partition-stages cuts the "
                                "original step, so run it before split-vnodes (rewrite the original model)")
        again = self.rewritten_before(item, sig.key)
        if again:
            return PassResult(item, False, [again])
        g = FunctionGraph.over(item.function(sig.function), item.library)
        g.verify()
        check_batch_inputs(g, sig)
        step = train_steps(g, sig, stages=True)[0]
        profile = None
        if self.balance == "profile" and not split_at and self.stages > 1:
            profile = profile_of(item.source, sig, self.profile_batch, self.profile)
        plan = plan_stages(g, step, self.stages, split_at, profile, ranks=not devices)
        owner = _variable_stages(plan, sig)
        where = place(g, plan, owner)
        fdef = _split_identity_n(item, sig.function, plan, where, _unread_pass_throughs(g, plan))
        ops = [0] * len(plan.stages)
        for node in fdef.node_def:
            k = where.get(node.name)
            if k:
                if devices:
                    node.device = devices[k - 1]
                else:
                    node.attr[Stages.MARK].i = k - 1
                ops[k - 1] += 1
        if devices:
            set_variable_devices(item, sig.key, {a: devices[k - 1] for a, k in owner.items()})
        parts = tuple(StagePart(devices[s.index - 1] if devices else "", s.variables, s.parameter_bytes, s.optimizer_state,
                                s.optimizer_state_bytes, s.flops, ops[s.index - 1]) for s in plan.stages)
        if not devices:
            parts = _with_shared_copies(parts, plan, sig)
        records.put(item, sig.key, Stages(
            function=sig.function, parts=parts, schedule=self.schedule,
            split_at=plan.split_at,
            cut_bytes=tuple(c.bytes for c in plan.cuts), shared=tuple(v.name for v in plan.shared),
            replicated=plan.replicated))
        notes = [f"signature {sig.key!r}: {len(plan.stages)} stages on "
                 + (", ".join(devices) if devices else f"MPI ranks 0..{len(plan.stages) - 1}")]
        if profile is not None:
            times = ", ".join(f"{st.measured_ns / 1e6:.2f}" for st in plan.stages)
            notes.append(f"signature {sig.key!r}: the cuts balance a profiled step's measured times (stages: "
                         f"{times} ms per step of {profile.batch} examples"
                         + (f", profile {self.profile}" if self.profile else "")
                         + "); to repeat this rewrite exactly, split at " + ";".join(plan.split_at))
        if plan.shared and not devices:
            notes.append(f"signature {sig.key!r}: variables read by several stages, or updated together under one "
                         "condition, are held by each of them, their gradients summed or broadcast between them and "
                         "their update applied by each: "
                         + ", ".join(f"{v.name} (stages {', '.join(map(str, v.stages))})" for v in plan.shared[:3])
                         + (" ..." if len(plan.shared) > 3 else ""))
        elif plan.shared:
            notes.append(f"signature {sig.key!r}: variables read by several stages stay where the loader puts them: "
                         + ", ".join(v.name for v in plan.shared[:3]) + (" ..." if len(plan.shared) > 3 else ""))
        return PassResult(item, True, notes)

    def _devices(self) -> Tuple[str, ...]:
        given = [d.strip() for d in self.devices.split(";") if d.strip()]
        if not given:
            return ()
        if len(given) != self.stages:
            raise PipelineError(f"{self.stages} stages need {self.stages} devices, one per stage, e.g. devices="
                                + ";".join(f"/GPU:{k}" for k in range(self.stages)) + f" (given: {len(given)})")
        try:
            out = tuple(canonical_device(d) for d in given)
        except ValueError as e:
            raise PipelineError(str(e)) from None
        if len(set(out)) != len(out):
            raise PipelineError(f"devices={self.devices}: a device is named twice; give each stage its own")
        return out


def _variable_stages(plan: StagePlan, sig) -> Dict[str, int]:
    """Resource argument -> the stage that owns the variable (its parameters and optimizer
    state); shared and replicated variables are absent."""
    by_name: Dict[str, int] = {}
    for s in plan.stages:
        for v in s.variables + s.optimizer_state:
            by_name[v] = s.index
    return {a: by_name[v.name] for a, v in sig.variables.items() if v.name in by_name}


def _with_shared_copies(parts: Tuple[StagePart, ...], plan: StagePlan, sig) -> Tuple[StagePart, ...]:
    """The stages' parts on MPI ranks, each also holding a copy of the variables it shares with
    other stages (a weight read by several stages, and its optimizer state): every holder
    applies the same update to its copy from the same summed gradient (split-vnodes), so the
    copies stay identical, as Megatron-LM keeps embeddings tied between stages."""
    params = {v.name for v in plan.shared}
    size = {v.name: (0 if v.shape is None else int(np.prod([max(d, 1) for d in v.shape])) * dtype_size(v.dtype))
            for v in sig.variables.values()}
    out = []
    for part, s in zip(parts, plan.stages):
        mine = [v for v in s.shared if v in params]
        slots = [v for v in s.shared if v not in params]
        out.append(replace(part, variables=part.variables + tuple(mine),
                           parameter_bytes=part.parameter_bytes + sum(size.get(v, 0) for v in mine),
                           optimizer_state=part.optimizer_state + tuple(slots),
                           optimizer_state_bytes=part.optimizer_state_bytes + sum(size.get(v, 0) for v in slots)))
    return tuple(out)


def place(g: FunctionGraph, plan: StagePlan, owner: Dict[str, int]) -> Dict[str, int]:
    """Node -> stage for the ops of the step: the per-example ops as the plan places them;
    an op reading an owned variable on that variable's stage; any other op on the stage of
    every op that reads its outputs when they agree (a variable's read, its update's
    arithmetic); the rest (shared counters, ops between stages) where TensorFlow puts them."""
    where: Dict[str, int] = {**plan.terms, **plan.node_stage}
    for n in reversed(g.topological_order()):
        if n in where or n in plan.split_nodes:
            continue
        held = {owner[t.node] for t in g.data_inputs(n) if t.is_function_arg and t.node in owner}
        if held:
            if len(held) == 1:
                where[n] = held.pop()
            continue
        readers = {where.get(c) for t in g.outputs(n) for c, _ in g.consumers(t)}
        if len(readers) == 1 and None not in readers:
            where[n] = readers.pop()
    return where


def _unread_pass_throughs(g: FunctionGraph, plan: StagePlan) -> Dict[str, Tuple[int, ...]]:
    """Forward ``IdentityN`` ops with outputs no op reads (a custom gradient's, such as
    ``recompute_grad``'s, passing its variables and inputs to its gradient function), each
    output's stage: the op's for those read, none for the others."""
    out: Dict[str, Tuple[int, ...]] = {}
    for n, k in plan.node_stage.items():
        if g.nodes[n].op == "IdentityN":
            read = [bool(g.consumers(t)) for t in g.outputs(n)]
            if not all(read):
                out[n] = tuple(k if r else 0 for r in read)
    return out


def _split_identity_n(item: GraphItem, function: str, plan: StagePlan, where: Dict[str, int],
                      unread: Optional[Dict[str, Tuple[int, ...]]] = None):
    """Replace each ``IdentityN`` whose outputs the plan puts on several stages, and each of
    ``unread`` (:func:`_unread_pass_throughs`), by one ``Identity`` of each input on that
    output's stage (``where`` gets them), so that no stage needs the others' inputs; returns
    the training function as it now is."""
    fdef = item.function(function)
    split = {n: st for n, st in plan.split_nodes.items() if len(set(st)) > 1}
    split.update(unread or {})
    for n in unread or ():
        where.pop(n, None)
    if not split:
        return fdef
    g = FunctionGraph(fdef, item.library)
    for n in sorted(split):
        types = g.nodes[n].attr["T"].list.type
        for k, (ref, t) in enumerate(zip(g.outputs(n), types)):
            name = f"{n}/vf_stage_output_{k}"
            g.replace_all_uses_with(ref, TensorRef(name, "output", 0))
            g.op("Identity", [g.data_inputs(n)[k]], name=name, T=type_attr(t))
            if split[n][k]:
                where[name] = split[n][k]
    item.set_function(g.finish())
    return item.function(function)

