"""split-vnodes for a step with dependent updates: each phase over all virtual nodes in turn.

:mod:`vfgraph.analysis.phases` splits such a step (a GAN's discriminator update, then the
generator's through the updated discriminator) into phases, each a one-phase training step.
Each phase becomes what split-vnodes makes of a one-phase step: a loop over the virtual nodes
summing that phase's gradients, its reduce point, its update once. The replacement step runs
them in order: phase k + 1's loop reads the variables once phase k's update has run (its
resource arguments pass through an Identity that waits for that update). The step's outputs
are assembled from the phases' outputs (see :mod:`vfgraph.analysis.phases`).
"""
from __future__ import annotations

from typing import List

from vfgraph import records
from vfgraph.analysis.phases import NO_STAGES, split_phases
from vfgraph.analysis.train_step import DependentUpdates
from vfgraph.errors import PipelineError
from vfgraph.ir.attrs import type_attr
from vfgraph.ir.blocks import EXACT_MAX_TERMS
from vfgraph.ir.graph import FunctionGraph, verify_function_def
from vfgraph.ir.names import function_name
from vfgraph.item import GraphItem
from vfgraph.passes.base import PassResult
from vfgraph.records import Gradient, Stages, VirtualNodes


def split_phased(options, item: GraphItem, sig, g: FunctionGraph, b: int, dependent: DependentUpdates) -> PassResult:
    """The split-vnodes rewrite (``options``: the pass) of the training function ``g`` of
    ``sig`` whose analysis raised ``dependent``: one virtual-node loop and update per phase."""
    from vfgraph.rewrites import split_vnodes as sv

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
        found, keyed, index_fn, random_notes = sv._key_random_ops(item, gk, step, vdef, options.deterministic, 1)
        randoms += found
        seeded += keyed
        index_fns.add(index_fn)
        notes += random_notes
        udef = gk.outline(update_fn, [(f"out_{o.name}", o.ref) for o in update_outputs],
                          new_args=cut_args, keep_args=sig.invariant_args,
                          drop=frozenset(step.vnode_nodes), side_effects=True, into=item.new_function(update_fn))
        reduce_fn = function_name(sig.function, tag, "reduce")
        item.set_function(sv.reduce_function(reduce_fn, sv._reduce_specs(gk, step, options.deterministic)))
        loop = sv._Loop(gk, step, vdef, options.vnodes, b, item.library, item.new_function, 1, tag,
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
    from vfgraph.rewrites import split_vnodes as sv

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
        call, updated = sv._update(fb, udef, sv._means(fb, step, sums, count), res, after=[done] + after)
        values.append(sv._assemble(step, results, updated))
        after = [call]
    out = values[-1]
    for k in reversed(range(len(assembles))):
        fdef = assembles[k]
        out = sv._call(fb, fdef, values[k] + out, "assemble", deps=after).outputs()
    for a, (_, ref), r in zip(original.signature.output_arg, g.output_refs(), out):
        fb.ret(a.name, fb.op("Identity", [r], name="result", deps=after, T=type_attr(a.type),
                             shapes=[g.shape(ref)])[0], a.type)
    return fb.finish()

