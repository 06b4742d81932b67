"""split-vnodes: run a training step as virtual nodes in an in-graph loop.

The training function is cut where per-example work ends (see
:mod:`vfgraph.analysis.train_step`). The part before the cut becomes the *virtual-node
function* (one slice of ``b`` examples in, loss and gradients out); the part after it becomes
the *update function* (averaged gradients in, the original optimizer update, run once).
The original function's name then holds a ``While`` loop over the slices of the fed batch:
the number of virtual nodes a process runs is read from the batch it is fed.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from typing import ClassVar, List, NamedTuple, Optional, Tuple

import numpy as np

from tensorflow.core.framework import types_pb2

from vfgraph import records
from vfgraph.analysis import random_ops
from vfgraph.analysis.phases import NO_STAGES, split_phases
from vfgraph.analysis.random_ops import VNODE_INDEX, VNODE_LAST
from vfgraph.analysis.train_step import (DependentUpdates, TrainStep, analyze_train_step, check_batch_inputs,
                                         static_batch, training_signature, with_dynamic_batch)
from vfgraph.errors import DetectionError, PipelineError, VerifyError
from vfgraph.io.signatures import (add_graph_signature, add_graph_variables, add_object_variables, add_signature,
                                   entry_header, has_object_graph, signature_wrapper)
from vfgraph.ir.attrs import func_attr, type_attr, types_attr
from vfgraph.ir.blocks import EXACT_MAX_TERMS, I32, I64, check, exact_add, from_exact, list_concat, zeros
from vfgraph.ir.graph import FunctionGraph, Node, TensorRef, verify_function_def
from vfgraph.ir.loops import LoopLayout, append, condition, next_index, reserve, same_batch, slice_reader, while_loop
from vfgraph.ir.names import function_name
from vfgraph.item import GraphItem
from vfgraph.passes.base import Pass, PassResult, option, register
from vfgraph.records import Gradient, Stages, VirtualNodes
from vfgraph.rewrites.partition_stages import STAGE_ATTR, stage_of


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
        b = self._vnode_batch(original, sig)
        static = static_batch(original, sig) > 0
        g = with_dynamic_batch(original, sig, b) if static else original
        try:
            step = analyze_train_step(g, sig)
        except DependentUpdates as dependent:  # several phases, one after the other
            return split_phased(self, item, sig, g, b, dependent)
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
        item.set_function(reduce_function(reduce_fn, _reduce_specs(g, step, self.deterministic)))
        loop = _Loop(g, step, vdef, self.vnodes, b, item.library, item.new_function, in_flight,
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
        records.put(item, sig.key, VirtualNodes(
            function=sig.function, vnodes=self.vnodes, vnode_batch=b, vnode_function=vnode_fn,
            update_function=update_fn, per_vnode_seeds=tuple(seeded), stepwise=stepwise,
            reduce_functions=reduce_fns, gradients=gradients, deterministic=self.deterministic,
            random_ops=tuple(randoms), index_function=index_fn))
        return PassResult(item, True, notes)

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


MESSAGE_BASE = "vf_message_base"  # argument of a stage's virtual-node function: its first message tag


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


F32 = types_pb2.DT_FLOAT
_FLOATS = (types_pb2.DT_HALF, types_pb2.DT_BFLOAT16, types_pb2.DT_FLOAT, types_pb2.DT_DOUBLE)


class _Loop:
    """The virtual-node loop shared by the training step and the step-wise accumulate: a
    ``While`` over the slices of the fed batch whose body calls the virtual-node function and
    adds its gradients to the loop-carried sums (sparse rows and per-example outputs go to
    tensor lists). Its body and condition are library functions, written once into the empty
    entries ``new_function(name)`` gives; :meth:`emit` writes the loop into a function under
    construction. ``in_flight``: how many virtual nodes may run at once (pipeline stages work
    on consecutive virtual nodes at the same time); each sum is added on the device of the
    value it adds, where a pass placed that value. ``exact``: the floating-point sums of each
    dtype are carried as one vector of exact fixed-point words (one ``VfExactAdd`` per virtual
    node, :func:`vfgraph.ir.blocks.exact_add`), so that their value does not depend on the order
    of the additions; they are made floating point after the reduce.

    A virtual-node function with side effects (a pipeline stage's sends and receives) is
    waited for through a "finished" token the loop carries: iteration i's token (its index)
    comes after its call's side effects and its sums. The body has no control outputs, which
    lowered would hold every loop variable's next iteration until the whole call is done, so
    that the iterations ran one after another. ``lag`` L > 0 (a 1F1B pipeline stage): the loop
    carries the last L tokens and virtual node i's messages (so its work, which starts from
    what it receives) wait for virtual node i - L to finish: one forward, then one backward.
    ``parts`` (a stage that receives gradients from later stages): the virtual-node function
    in two (:class:`ForwardBackward`); iteration i calls the forward once virtual node i - 1's
    forward has finished (a token the loop carries), then the backward on what the forward
    left it. The forwards thus run in order, the first stage sending virtual node 0's
    activations first (of calls in flight together, TensorFlow's executor starts the newest
    first), and one waits for no gradient."""

    def __init__(self, g: FunctionGraph, step: TrainStep, vdef, vnodes: int, b: int, library, new_function,
                 in_flight: int = 1, tag: str = "", messages: int = 0, exact: bool = False, lag: int = 0,
                 parts: Optional["ForwardBackward"] = None, index_fn: str = ""):
        self.g, self.step, self.vdef, self.vnodes, self.b = g, step, vdef, vnodes, b
        self.index_fn = index_fn  # (random ops keyed) the global index of the first virtual node
        self.in_flight, self.messages, self.lag, self.parts = in_flight, messages, lag, parts
        # the last virtual nodes' "finished" tokens the loop carries (see _body), and with
        # ``parts`` the last forward's
        self.tokens = max(lag, 1) if lag or vdef.signature.control_output else 0
        self.chained = 1 if parts is not None else 0
        sig = step.signature
        self.keys = [sig.input_keys.get(a, a) for a in sig.batch_args]
        self.vnode_outs = [o for o in step.outputs if o.side == "vnode"]
        self.v_types = [a.type for a in vdef.signature.output_arg]
        n_out = len(self.vnode_outs)
        # what each loop-carried value holds: (combine, dtype, shape)
        self.carried = ([(o.combine, t, g.shape(o.ref)) for o, t in zip(self.vnode_outs, self.v_types)] +
                        [(c.combine, t, c.shape) for c, t in zip(step.cut, self.v_types[n_out:])])
        self.exact = [exact and c == "mean" and t in _FLOATS for c, t, _ in self.carried]
        self.groups = exact_groups(self.carried, self.exact)  # [(dtype, entries, their sizes)]
        self.devices = [("" if r.is_function_arg else g.nodes[r.node].device)
                        for r in [o.ref for o in self.vnode_outs] + [c.ref for c in step.cut]]
        self.batch_types = [g.dtype(TensorRef(a)) for a in sig.batch_args]
        # loop variables: i, carried... (the entries not summed exactly, then a word vector per
        # exact group), nv, then per, batch..., resources...
        self.plain = [k for k, e in enumerate(self.exact) if not e]
        self.layout = LoopLayout.of(
            [(t, s) if c == "mean" else (types_pb2.DT_VARIANT, [])
             for c, t, s in (self.carried[k] for k in self.plain)] +
            [(I64, [2 * sum(sizes) + 1]) for _, _, sizes in self.groups] + [(I32, [])] * (self.tokens + self.chained),
            [(I32, [])] + [(t, g.arg_shape(a)) for a, t in zip(sig.batch_args, self.batch_types)] +
            [(g.dtype(TensorRef(a)), []) for a in sig.resource_args] +
            [(g.dtype(TensorRef(a)), g.arg_shape(a)) for a in sig.captured_args] +
            [(I64, [])] * bool(index_fn))
        lib = dict(library)
        for f in [vdef] + ([parts.forward, parts.backward] if parts is not None else []):
            lib[f.signature.name] = f
        self.body_name = function_name(sig.function, "vnodes", tag, "body")
        self.cond_name = function_name(sig.function, "vnodes", tag, "cond")
        body = self._body(lib, new_function(self.body_name))
        condition(self.cond_name, body, self.layout, lib, new_function(self.cond_name))

    def _body(self, lib, into):
        sig = self.step.signature
        fb = FunctionGraph.new(self.body_name, lib, into)
        n_batch = len(self.batch_types)
        carried_names = [f"carried_{k}" for k in range(len(self.layout.carried_types))]
        args = self.layout.args(fb, ["i"] + carried_names + ["nv", "per"] + [f"batch_{k}" for k in range(n_batch)] +
                                [f"resource_{k}" for k in range(len(sig.invariant_args))] +
                                ["vnode_offset"] * bool(self.index_fn))
        i, carried, nv, fixed = self.layout.split(args)
        sums = len(carried) - self.tokens - self.chained  # the carried values before the tokens
        carried, done, chain = carried[:sums], carried[sums:sums + self.tokens], carried[sums + self.tokens:]
        per, batch, res = fixed[0], fixed[1:1 + n_batch], fixed[1 + n_batch:1 + n_batch + len(sig.invariant_args)]
        rows = slice_reader(fb, i, per)
        by_name = {a: rows(x, t) for a, x, t in zip(sig.batch_args, batch, self.batch_types)}
        by_name.update(zip(sig.invariant_args, res))
        v_args = [a.name for a in self.vdef.signature.input_arg]
        if VNODE_INDEX in v_args:  # the virtual node's global index: after the lower ranks' virtual nodes
            index = fb.op("Cast", [i], name="index", SrcT=type_attr(I32), DstT=type_attr(I64), Truncate=False)[0]
            by_name[VNODE_INDEX] = fb.op("AddV2", [fixed[-1], index], name="global_index",
                                         T=type_attr(I64))[0] if self.index_fn else index
        if VNODE_LAST in v_args:  # this process's last virtual node of the step
            by_name[VNODE_LAST] = fb.op("Equal", [next_index(fb, i), nv], name="last", T=type_attr(I32))[0]
        if MESSAGE_BASE in v_args:  # the first tag of this virtual node's messages between stages
            # (with a lag L, after virtual node i - L has finished)
            after = [fb.op("Identity", [done[self.lag - 1]], name="after", T=type_attr(I32))] if self.lag else []
            by_name[MESSAGE_BASE] = fb.op("Mul", [i, fb.const(self.messages, I32, "messages")[0]], name="tags",
                                          deps=after, T=type_attr(I32))[0]
        if self.parts is None:
            calls = [_call(fb, self.vdef, [by_name[a] for a in v_args], "vnode")]
            call = calls[0].outputs()
        else:  # the forward, once the last virtual node's has finished, then the backward
            f, b, stash, where = self.parts
            after = fb.op("Identity", [chain[0]], name="forward_after", T=type_attr(I32))
            calls = [_call(fb, f, [by_name[a.name] for a in f.signature.input_arg], "forward", deps=[after])]
            ins = calls[0].outputs()[:stash] + [by_name[a.name] for a in b.signature.input_arg[stash:]]
            calls.append(_call(fb, b, ins, "vnode"))
            call = [calls[not forward].outputs()[k + stash * forward] for forward, k in where]
        new = []
        for k, acc in zip(self.plain, carried):
            combine, t, shape = self.carried[k]
            if combine == "mean":
                add = fb.op("AddV2", [acc, call[k]], name="sum", T=type_attr(t), shapes=[shape])
                add.proto.device = self.devices[k]
                new.append(add[0])
            else:
                new.append(append(fb, acc, i, call[k], t))
        for (t, ks, sizes), acc in zip(self.groups, carried[len(self.plain):]):
            new.append(exact_add(fb, acc, [call[k] for k in ks], t, sum(sizes)))
        if done:  # virtual node i has finished, and so have those before it: their calls' side effects and sums
            before = fb.op("Identity", [done[0]], name="before", T=type_attr(I32))
            finished = fb.op("Identity", [i], name="finished", deps=calls + [before] + [r.node for r in new],
                             T=type_attr(I32))[0]
            new += [finished] + done[:-1]
        if chain:  # virtual node i's forward has finished
            new.append(fb.op("Identity", [i], name="forward_finished", deps=calls[:1], T=type_attr(I32))[0])
        for k, (ref, t) in enumerate(zip(self.layout.join(next_index(fb, i), new, nv, fixed), self.layout.types)):
            fb.ret(f"out_{k}", ref, t)
        return fb.finish()

    def emit(self, fb: FunctionGraph, batch: List[TensorRef], res: List[TensorRef],
             first: Optional[TensorRef] = None):
        """Run every virtual node of the fed batch; returns (per-output results, gradient sums
        or tensor lists (None where summed exactly), the exact groups' word vectors, number of
        virtual nodes, the While node). ``first`` (int64): the first virtual node's global index,
        given (a call that runs no collective: the step-wise accumulate) rather than computed
        over the processes."""
        b, vnodes = self.b, self.vnodes
        i32 = type_attr(I32)
        n, checks = same_batch(fb, batch, self.batch_types, self.keys, "training inputs")
        if b:
            per = fb.const(b, I32, "vnode_batch")[0]
            nv = fb.op("FloorDiv", [n, per], name="vnodes", T=i32)[0]
            rem = fb.op("FloorMod", [n, per], name="rest", T=i32)[0]
            message = (f"vfgraph: the fed batch is not a multiple of the virtual-node batch b={b}; "
                       f"feed a multiple of {b} examples")
        else:
            nv = fb.const(vnodes, I32, "vnodes")[0]
            per = fb.op("FloorDiv", [n, nv], name="vnode_batch", T=i32)[0]
            rem = fb.op("FloorMod", [n, nv], name="rest", T=i32)[0]
            message = f"vfgraph: the fed batch is not divisible by vnodes={vnodes}; feed a multiple of {vnodes} examples"
        zero = fb.const(0, I32, "zero")[0]
        checks.append(check(fb, fb.op("Equal", [rem, zero], name="divides", T=i32)[0], message))
        checks.append(check(fb, fb.op("Greater", [nv, zero], name="some", T=i32)[0],
                                   "vfgraph: the fed batch holds no virtual node"))
        nv = fb.op("Identity", [nv], name="checked_vnodes", deps=checks, T=i32)[0]
        inits = []
        for combine, t, shape in (self.carried[k] for k in self.plain):
            if combine == "mean":
                if shape is None or any(d < 0 for d in shape):
                    raise PipelineError(f"signature {self.step.signature.key!r}: a summed value has no static shape "
                                        f"({shape}); vfgraph cannot size its accumulator")
                inits.append(zeros(fb, shape, t, shapes=[shape]))
            else:
                inits.append(reserve(fb, nv, t))
        inits += [zeros(fb, [2 * sum(sizes) + 1], I64, shapes=[[2 * sum(sizes) + 1]]) for _, _, sizes in self.groups]
        if self.tokens + self.chained:
            inits += [fb.const(-1, I32, "none_finished")[0]] * (self.tokens + self.chained)
        offset = []
        if self.index_fn and first is not None:
            offset = [first]
        elif self.index_fn:  # once per step (a collective over ranks): the global index of the first virtual node
            offset = fb.op("StatefulPartitionedCall", [nv], name="vnode_offset", Tin=types_attr([I32]),
                           Tout=types_attr([I64]), f=func_attr(self.index_fn)).outputs()
        loop = while_loop(fb, self.layout, inits, nv, [per] + batch + res + offset, self.cond_name, self.body_name,
                          "vnodes_loop", lower=True, parallel_iterations=self.in_flight)
        _, carried, _, _ = self.layout.split(loop.outputs())
        carried = carried[:len(carried) - self.tokens - self.chained]
        if self.tokens:  # the call's side effects (a stage's sends) run before the function ends
            fb.control_ret(loop)
        every = [None] * len(self.carried)
        for k, ref in zip(self.plain, carried):
            every[k] = ref
        n_out = len(self.vnode_outs)
        return every[:n_out], every[n_out:], carried[len(self.plain):], nv, loop

    def outputs(self, fb: FunctionGraph, outs: List[TensorRef], count: TensorRef, nv: TensorRef) -> List[TensorRef]:
        """The loop's per-output results: sums divided by ``count`` (float32), concatenations,
        last values."""
        results = []
        for o, v, (_, t, shape) in zip(self.vnode_outs, outs, self.carried):
            if o.combine == "mean":
                v = divide(fb, v, count, t, shape) if o.averaged else v
            elif o.combine == "concat":
                v = list_concat(fb, v, t)
            else:
                last = fb.op("Sub", [nv, fb.const(1, I32, "one")[0]], name="last", T=type_attr(I32))[0]
                v = fb.op("TensorListGetItem", [v, last, fb.const(-1, I32, "element_shape")[0]], name="last_value",
                          element_dtype=type_attr(t))[0]
            results.append(v)
        return results

    def reduce(self, fb: FunctionGraph, outs: List[TensorRef], sums: List[TensorRef], fused: List[TensorRef],
               nv: TensorRef, reduce_fn: str):
        """Hand the loop's sums to the step's reduce function (identity on one process; the
        all-reduce over ranks once ``insert-allreduce`` has run): those summed in floating
        point, then the exact groups' words, then the number of virtual nodes. Returns (output
        sums, gradient sums or concatenations, number of virtual nodes as float32)."""
        cut = self.step.cut
        n_out = len(self.vnode_outs)
        plain = [(v, k) for k, (o, v) in enumerate(zip(self.vnode_outs, outs))
                 if o.combine == "mean" and not self.exact[k]]
        plain += [(a if c.combine == "mean" else list_concat(fb, a, self.carried[k][1]), k)
                  for k, (c, a) in enumerate(zip(cut, sums), n_out) if not self.exact[k]]
        count = fb.op("Cast", [nv], name="count", SrcT=type_attr(I32), DstT=type_attr(F32), Truncate=False)[0]
        args = [(r, self.carried[k][1]) for r, k in plain] + [(w, I64) for w in fused] + [(count, F32)]
        types = [t for _, t in args]
        got = fb.op("StatefulPartitionedCall", [r for r, _ in args], name="reduce", Tin=types_attr(types),
                    Tout=types_attr(types), f=func_attr(reduce_fn)).outputs()
        every = list(outs) + list(sums)
        for (_, k), r in zip(plain, got):
            every[k] = r
        if self.groups:
            limit = fb.const(float(EXACT_MAX_TERMS), F32, "most_terms")[0]
            ok = check(fb, fb.op("LessEqual", [got[-1], limit], name="few", T=type_attr(F32))[0],
                       f"vfgraph: deterministic sums hold at most {EXACT_MAX_TERMS} virtual nodes per step; feed "
                       "fewer examples per step")
            for (t, ks, sizes), words in zip(self.groups, got[len(plain):-1]):
                words = fb.op("Identity", [words], name="checked", deps=[ok], T=type_attr(I64))[0]
                values = from_exact(fb, words, t, sum(sizes))
                parts = [values] if len(ks) == 1 else fb.op(
                    "SplitV", [values, fb.const(sizes, I32, "sizes")[0], fb.const(0, I32, "axis")[0]],
                    name="unpack", num_split=len(ks), T=type_attr(t), Tlen=type_attr(I32)).outputs()
                for k, part in zip(ks, parts):
                    shape = self.carried[k][2]
                    every[k] = fb.op("Reshape", [part, fb.const(shape, I32, "shape")[0]], name="sum",
                                     T=type_attr(t), Tshape=type_attr(I32), shapes=[shape])[0]
        return every[:n_out], every[n_out:], got[-1]


class ForwardBackward(NamedTuple):
    """A pipeline stage's virtual-node function in two: ``forward`` returns the tensors the
    backward reads (``stash`` of them) and then its own outputs; ``backward`` takes those
    tensors and then the function's arguments; ``where`` gives, for each output of the whole
    function, (whether the forward computes it, its index among that part's own outputs)."""

    forward: object
    backward: object
    stash: int
    where: Tuple[Tuple[bool, int], ...]


def _call(fb: FunctionGraph, fdef, inputs: List[TensorRef], name: str, deps=()):
    """A call of ``fdef`` on ``inputs`` in ``fb``."""
    return fb.op("StatefulPartitionedCall", inputs, name=name, deps=list(deps),
                 Tin=types_attr([a.type for a in fdef.signature.input_arg]),
                 Tout=types_attr([a.type for a in fdef.signature.output_arg]), f=func_attr(fdef.signature.name))


def exact_groups(entries, exact) -> List[Tuple[int, List[int], List[int]]]:
    """The entries ``(combine, dtype, shape)`` marked ``exact``, grouped by dtype in order of
    first appearance: (dtype, their indices, their sizes)."""
    groups = {}
    for k, ((_, t, shape), e) in enumerate(zip(entries, exact)):
        if e:
            if shape is None or any(d < 0 for d in shape):
                raise PipelineError(f"a summed value has no static shape ({shape}); vfgraph cannot size its "
                                    "exact accumulator")
            ks, sizes = groups.setdefault(t, ([], []))
            ks.append(k)
            sizes.append(int(np.prod(shape, dtype=np.int64)))
    return [(t, ks, sizes) for t, (ks, sizes) in groups.items()]


def divide(fb: FunctionGraph, value: TensorRef, count: TensorRef, dtype: int, shape=None) -> TensorRef:
    """``value / count`` with the float32 ``count`` cast to ``dtype``."""
    if dtype != F32:
        count = fb.op("Cast", [count], name="count_as", SrcT=type_attr(F32), DstT=type_attr(dtype),
                      Truncate=False)[0]
    return fb.op("RealDiv", [value, count], name="mean", T=type_attr(dtype), shapes=[shape])[0]


def _means(fb: FunctionGraph, step: TrainStep, sums: List[TensorRef], count: TensorRef) -> List[TensorRef]:
    """The gradients the update gets: sums divided by the number of virtual nodes (those of a
    loss summed over the batch: the sums); sparse gradients' rows are scaled the same way and
    their indices passed as they are."""
    return [divide(fb, a, count, c.dtype, c.shape) if c.combine != "concat" and c.averaged else a
            for c, a in zip(step.cut, sums)]


def _assemble(step: TrainStep, vnode_results: List, updated) -> List:
    """The function's outputs in the original order."""
    vi = iter(vnode_results)
    ui = iter(updated)
    return [next(vi) if o.side == "vnode" else next(ui) for o in step.outputs]


def _update(fb: FunctionGraph, udef, means: List[TensorRef], res: List[TensorRef], after=()):
    """Call the update function once, after ``after``; returns (its node, its outputs). The
    control dependency matters: inlined, the update's ops that do not read the gradients
    (AdamW's weight decay) would otherwise run as soon as the step starts."""
    call = _call(fb, udef, means + res, "update", deps=after)
    fb.control_ret(call)
    return call, call.outputs()


def _step_function(item: GraphItem, g: FunctionGraph, step: TrainStep, loop: _Loop, udef, reduce_fn: str):
    """The replacement training function: loop, reduce, average, update once; the original's
    name, arguments and outputs."""
    sig = step.signature
    original = item.function(sig.function)
    lib = item.library
    fb, args = FunctionGraph.like(original, lib)
    by = dict(zip(g.arg_names, args))
    res = [by[a] for a in sig.invariant_args]
    outs, sums, fused, nv, done = loop.emit(fb, [by[a] for a in sig.batch_args], res)
    outs, sums, count = loop.reduce(fb, outs, sums, fused, nv, reduce_fn)
    results = loop.outputs(fb, outs, count, nv)
    call, updated = _update(fb, udef, _means(fb, step, sums, count), res, after=[done])
    for o, a, r in zip(step.outputs, original.signature.output_arg, _assemble(step, results, updated)):
        fb.ret(a.name, fb.op("Identity", [r], name="result", deps=[call], T=type_attr(a.type),
                             shapes=[g.shape(o.ref)])[0], a.type)
    return fb.finish()


# --------------------------------------------------------------------------- reduce point
def _output_sum_specs(g: FunctionGraph, step: TrainStep) -> List[Tuple[int, list, str]]:
    """(dtype, shape, "sum") of the loop's output sums (outputs averaged over virtual nodes)."""
    return [(g.dtype(o.ref), g.shape(o.ref), "sum") for o in step.outputs if o.side == "vnode" and o.combine == "mean"]


def _reduce_specs(g: FunctionGraph, step: TrainStep, exact: bool = False) -> List[Tuple[str, int, list]]:
    """(argument name, dtype, shape) of what a step reduces over processes: the loop's output
    sums, the gradient sums (``sum_k``) or sparse rows (``gather_k``), and the number of
    virtual nodes (last, float32). ``exact``: floating-point sums are int64 words (``[2] +
    shape``, see :class:`_Loop`)."""
    specs = _output_sum_specs(g, step)
    specs += [(c.dtype, c.shape, "sum" if c.combine == "mean" else "gather") for c in step.cut]
    if exact:  # as _Loop.reduce passes them: those summed in floating point, then each exact group's words
        entries = [("mean" if kind == "sum" else kind, dtype, shape) for dtype, shape, kind in specs]
        marks = [c == "mean" and t in _FLOATS for c, t, _ in entries]
        specs = [spec for spec, m in zip(specs, marks) if not m] + [
            (I64, [2 * sum(sizes) + 1], "sum") for _, _, sizes in exact_groups(entries, marks)]
    specs.append((types_pb2.DT_FLOAT, [], "sum"))
    return [(f"{kind}_{k}", dtype, shape) for k, (dtype, shape, kind) in enumerate(specs)]


def reduce_function(name: str, specs: List[Tuple[str, int, list]]):
    """The identity function a step calls at its reduce point: one process reduces nothing.
    ``insert-allreduce`` replaces its body; the arguments name what each one needs
    (``sum_k``: summed over processes, ``gather_k``: rows concatenated)."""
    from tensorflow.core.framework import function_pb2

    fdef = function_pb2.FunctionDef()
    fdef.signature.name = name
    for k, (arg, dtype, shape) in enumerate(specs):
        fdef.signature.input_arg.add(name=arg, type=dtype)
        fdef.signature.output_arg.add(name=f"reduced_{k}", type=dtype)
        fdef.ret[f"reduced_{k}"] = arg
        if shape is not None:
            proto = fdef.arg_attr[k].attr["_output_shapes"].list.shape.add()
            for d in shape:
                proto.dim.add().size = d
    return fdef


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


def add_stepwise(item: GraphItem, g: FunctionGraph, step: TrainStep, loop: _Loop, udef,
                 reduce_fn: str) -> Tuple[bool, List[str]]:
    """Add ``<train>_accumulate`` (run the fed batch's virtual nodes, add their gradient sums
    and count into accumulator variables, return their mean loss) and ``<train>_apply``
    (average the accumulators, apply the original update once, reset them): the step-wise
    mode for runtimes that feed virtual nodes one call at a time. With random ops keyed by the
    global virtual node index, a counter variable numbers each call's virtual nodes after those
    of the step's calls before it (apply resets it), so accumulate called on the step's slices
    in order, then apply, draws what the looped step draws on one process. Returns (whether
    they were added, notes: why not)."""
    sig = step.signature
    tf1 = item.kind == "tf1_saved_model"
    if not tf1 and not has_object_graph(item):
        return False, [f"step-wise signatures: not added to {item.kind} models"]
    if any(c.combine != "mean" and (not c.shape or any(d < 0 for d in c.shape[1:])) for c in step.cut):
        return False, ["step-wise signatures: not added (sparse gradient rows of unknown shape)"]
    if any(o.side != "vnode" for o in step.outputs):
        return False, ["step-wise signatures: not added (an output is computed by the update)"]
    if tf1:  # the signature function is called from the graph: its own arguments and outputs
        inner, n_inputs = list(g.arg_names), len(sig.batch_args)
        out_names = [a.name for a in g.header.signature.output_arg]
    else:
        wrapper = signature_wrapper(item, sig.key)
        if wrapper is None:
            return False, [f"step-wise signatures: signature {sig.key!r} has no wrapper vfgraph can extend"]
        # the wrapper's argument order: inputs, then bound variables
        inner, n_inputs = list(wrapper.args), len(wrapper.input_args)
        out_names = list(wrapper.outputs)
    specs = [(f"grad_{k}", c.dtype, c.shape) for k, c in enumerate(step.cut)] + [("count", F32, [])]
    acc_args = [f"vf_accumulator_{k}" for k in range(len(step.cut))] + ["vf_count"]
    keyed = bool(loop.index_fn)  # random ops keyed by the global index: each call numbers on from the last
    generators = _generator_states(loop.vdef, sig) if keyed else []
    if generators is None:
        return False, ["step-wise signatures: not added (a keyed tf.random.Generator whose state variable vfgraph "
                       "cannot follow to an argument of the step)"]
    if keyed:
        specs.append(("vnodes_before", I64, []))
        acc_args.append(VNODES_BEFORE)
    for k, (_, dtype, shape) in enumerate(generators):  # each generator's state at the step's start
        specs.append((f"generator_start_{k}", dtype, shape))
        acc_args.append(f"{GENERATOR_START}_{k}")
    # Names of object-graph functions end in an integer (TensorFlow's fingerprinting needs it).
    acc_fn = function_name(sig.function, "accumulate", "0")
    apply_fn = function_name(sig.function, "apply", "0")
    acc_header = entry_header(g, acc_fn, inner, acc_args, out_names, [g.dtype(o.ref) for o in step.outputs])
    counted = ["vnodes"] if tf1 else []  # a TF1 signature needs an output: the virtual nodes applied
    apply_header = entry_header(g, apply_fn, inner[n_inputs:], acc_args, counted, [F32] * len(counted))
    lib = item.library

    _accumulate_function(item, g, step, loop, acc_header, inner + acc_args, generators)

    fb, args = FunctionGraph.like(apply_header, lib, into=item.new_function(apply_fn))
    by = dict(zip(inner[n_inputs:] + acc_args, args))
    types = [c.dtype for c in step.cut] + [F32]
    sums = [fb.op("ReadVariableOp", [by[a]], name="sum", dtype=type_attr(t))[0] for a, t in zip(acc_args, types)]
    # The step's own reduce function (one fused reduction per model); the loop-output sums it
    # also takes (the loss) are zeros here.
    unused = [(zeros(fb, shape, t, "unused"), t) for t, shape, _ in _output_sum_specs(g, step)]
    args = [v for v, _ in unused] + sums
    arg_types = [t for _, t in unused] + types
    reduced = fb.op("StatefulPartitionedCall", args, name="reduce", Tin=types_attr(arg_types),
                    Tout=types_attr(arg_types), f=func_attr(reduce_fn))
    got = reduced.outputs()[len(unused):]
    some = fb.op("Greater", [got[-1], fb.const(0.0, F32, "zero")[0]], name="some", T=type_attr(F32))[0]
    ok = check(fb, some, f"vfgraph: {sig.key}_apply found no accumulated virtual node; "
                         f"call {sig.key}_accumulate with a batch first")
    means = _means(fb, step, got[:-1], got[-1])
    call, _ = _update(fb, udef, means, [by[a] for a in sig.invariant_args], after=[reduced, ok])
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
    for name in counted:
        fb.ret(name, fb.op("Identity", [got[-1]], name="applied", deps=[reset], T=type_attr(F32), shapes=[[]])[0], F32)
    fb.finish()
    handles = add_graph_variables(item, ACCUMULATORS, specs)
    if tf1:
        add_graph_signature(item, f"{sig.key}_accumulate", acc_fn, sig.call_inputs + handles, like=sig.key,
                            outputs=sig.output_keys)
        add_graph_signature(item, f"{sig.key}_apply", apply_fn, sig.call_inputs[n_inputs:] + handles,
                            new_outputs=[("vnodes", F32, [])])
        return True, []
    acc_ids = add_object_variables(item, ACCUMULATORS, specs)
    add_signature(item, f"{sig.key}_accumulate", acc_fn, wrapper, takes_inputs=True, bound=acc_ids,
                  graph_handles=handles)
    add_signature(item, f"{sig.key}_apply", apply_fn, wrapper, takes_inputs=False, bound=acc_ids,
                  graph_handles=handles)
    return True, []


def _accumulate_function(item: GraphItem, g: FunctionGraph, step: TrainStep, loop: _Loop, header, names,
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


# --------------------------------------------------------------------------- stages on MPI ranks
def add_stage_steps(item: GraphItem, g: FunctionGraph, step: TrainStep, vdef, udef, vnodes: int, b: int,
                    stages: Stages, exact: bool = False, index_fn: str = "") -> Tuple[Tuple[str, ...], Tuple[str, ...]]:
    """Add ``<train>_stage_1`` .. ``<train>_stage_K``: the training step of each pipeline stage
    partition-stages marked for MPI ranks (rank k runs stage k+1). Each runs the virtual-node
    loop over its stage's part of the virtual-node function, whose tensors from other stages
    arrive by ``VfRecv`` and whose tensors for other stages leave by ``VfSend`` (tag: the
    virtual node's index times the messages per virtual node, plus the message's place in
    a fixed order; a stage that receives gradients runs it as a forward and a backward call,
    :func:`_forward_backward`); then its reduce function (identity until ``insert-allreduce``
    sums it over the replicas of the stage: ranks r and r + K of ``mpiexec -n K*D``); then its
    part of the update, once, on its own gradients' means; then it returns the step's outputs,
    broadcast from the stage that computes them. ``index_fn`` (random ops keyed by the global
    virtual node index): each stage numbers a replica's virtual nodes after those of the lower
    replicas (:func:`random_ops.stage_offset_name`, identity until ``insert-allreduce``), so
    the replicas draw what the virtual nodes of the unstaged step draw. Returns the signature
    keys and the reduce functions."""
    from vfgraph import ops as mpi_ops

    sig = step.signature
    key = sig.key
    wrapper = signature_wrapper(item, key)
    if wrapper is None:
        raise PipelineError(f"signature {key!r} has no wrapper vfgraph can add stage signatures like; pipeline "
                            "stages on MPI ranks need a TF2 SavedModel")
    odd = [o.name for o in step.outputs if o.side == "vnode" and (o.combine != "mean" or not _static(g.shape(o.ref)))]
    if odd:
        raise PipelineError(f"signature {key!r}: output {odd[0]!r} is not a mean over virtual nodes of a static "
                            "shape, which pipeline stages on MPI ranks broadcast from the stage computing it; "
                            "give --devices to run the stages in one process")
    mpi_ops.load()  # VfSend, VfRecv and VfBroadcast are written below
    k_count = stages.count
    lib = item.library
    gv = FunctionGraph(vdef, lib)
    where = {n: stage_of(node) for n, node in gv.nodes.items()}
    owner_var = {}
    for k, part in enumerate(stages.parts):
        for name in part.variables + part.optimizer_state:
            owner_var[name] = k
    vnode_outputs = [o for o in step.outputs if o.side == "vnode"]
    n_out = len(vnode_outputs)
    # out_<name>... then grad_<k>..., as outlined; through the unmarked identities that gather
    # tensors of several stages (Keras' IdentityN of the gradients), so no stage needs them all
    rets = [(name, _through_identities(gv, ref, where)) for name, ref in gv.output_refs()]

    def owner(k: int, ref: TensorRef) -> int:
        if not ref.is_function_arg and where.get(ref.node) is not None:
            return where[ref.node]
        if k >= n_out:
            c = step.cut[k - n_out]
            name = sig.variables[c.variable].name if c.variable in sig.variables else None
            return owner_var.get(name, 0)
        return k_count - 1
    owners = [owner(k, r) for k, (_, r) in enumerate(rets)]
    needed, messages = _stage_parts(gv, where, rets, owners, k_count)
    _check_carried(gv, messages, key)
    vdefs = [_stage_vnode_function(item, gv, where, rets, owners, needed[s], messages, s, k_count, f"stage{s + 1}")
             for s in range(k_count)]
    split: List[Optional[ForwardBackward]] = []
    late: set = set()  # messages a stage sends from its backward: its peer must not wait for them in a forward
    for s, vdef_s in enumerate(vdefs):
        split.append(_forward_backward(item, vdef_s, messages, s, late))
        if split[-1] is not None:
            late |= {m for m, _, dst in _sends(split[-1].backward)}
    check_stage_messages([[vdef_s] if parts is None else [parts.forward, parts.backward]
                          for vdef_s, parts in zip(vdefs, split)], messages, key, lib)
    udef = _split_update_identities(udef, lib)
    shares = _update_shares(FunctionGraph(udef, lib), sig, step, stages, owners[n_out:])
    names, reducers = [], []
    stage_index_fn = random_ops.stage_offset_name(index_fn) if index_fn else ""
    if stage_index_fn:
        item.set_function(random_ops.offset_function(stage_index_fn))
    for s in range(k_count):
        tag = f"stage{s + 1}"
        vdef_s, parts = vdefs[s], split[s]
        mine = [k for k, o in enumerate(owners) if o == s]
        view = TrainStep(sig, step.function, [step.cut[k - n_out] for k in mine if k >= n_out], step.vnode_nodes,
                         step.writes, [o for k, o in enumerate(vnode_outputs) if k in mine], step.batch_dependent)
        # 1F1B: stage s (from 0) starts virtual node i once i - (K - s) has finished
        if parts is None:
            item.set_function(vdef_s)
        loop = _Loop(g, view, vdef_s, vnodes, b, lib, item.new_function, stages.in_flight(vnodes), tag,
                     len(messages), exact, lag=k_count - s if s and stages.schedule == "1f1b" else 0, parts=parts,
                     index_fn=stage_index_fn)
        udef_s = _stage_update_function(item, udef, sig, step, [k - n_out for k in mine if k >= n_out], s, tag,
                                        shares)
        reduce_s = function_name(sig.function, tag, "reduce")
        item.set_function(reduce_function(reduce_s, _reduce_specs(g, view, exact)))
        reducers.append(reduce_s)
        fn = function_name(sig.function, tag, "0")
        header = entry_header(g, fn, list(wrapper.args), (), list(wrapper.outputs),
                              [g.dtype(o.ref) for o in step.outputs])
        fb, args = FunctionGraph.like(header, lib, into=item.new_function(fn))
        by = dict(zip(wrapper.args, args))
        res = [by[a] for a in sig.invariant_args]
        outs, sums, fused, nv, done = loop.emit(fb, [by[a] for a in sig.batch_args], res)
        outs, sums, count = loop.reduce(fb, outs, sums, fused, nv, reduce_s)
        results = loop.outputs(fb, outs, count, nv)
        call, updated = _update(fb, udef_s, _means(fb, view, sums, count), res, after=[done])
        _stage_returns(fb, g, step, header, owners[:n_out], s, results, call, updated)
        verify_function_def(fb.finish(), lib)
        names.append(f"{key}_stage_{s + 1}")
        add_signature(item, names[-1], fn, wrapper, takes_inputs=True)
    return tuple(names), tuple(reducers)


def _stage_returns(fb: FunctionGraph, g: FunctionGraph, step: TrainStep, header, owners: List[int], s: int,
                   results: List[TensorRef], call, updated: List[TensorRef]) -> None:
    """Stage ``s``'s step returns the step's outputs: each virtual-node output broadcast from
    the stage computing it (``owners``: by virtual-node output; ``results``: stage ``s``'s own),
    in the outputs' order; each output of the update as its own update computed it (every
    stage's update computes them: :func:`_update_shares`)."""
    results, updated, vnode_k = iter(results), iter(updated), iter(range(len(owners)))
    last = call
    for o, a in zip(step.outputs, header.signature.output_arg):
        t, shape = a.type, g.shape(o.ref)
        if o.side != "vnode":
            fb.ret(a.name, fb.op("Identity", [next(updated)], name="result", deps=[call], T=type_attr(t),
                                 shapes=[shape])[0], t)
            continue
        k = next(vnode_k)
        value = next(results) if owners[k] == s else zeros(fb, shape, t, "not_computed_here")
        last = fb.op("VfBroadcast", [value], name="from_stage", deps=[last], T=type_attr(t), root=owners[k])
        fb.ret(a.name, fb.op("Identity", [last[0]], name="result", T=type_attr(t), shapes=[shape])[0], t)
    fb.control_ret(last)


def _through_identities(gv: FunctionGraph, ref: TensorRef, where) -> TensorRef:
    """The tensor ``ref`` passes on through unmarked Identity and IdentityN ops."""
    while not ref.is_function_arg and where.get(ref.node) is None and gv.op_types()[ref.node] in (
            "Identity", "IdentityN"):
        ref = gv.data_inputs(ref.node)[gv.flat_index(ref)]
    return ref


def _static(shape) -> bool:
    return shape is not None and all(d >= 0 for d in shape)


def _stage_parts(gv: FunctionGraph, where, rets, owners, k_count: int):
    """For each stage, the nodes of the virtual-node function it runs (its own, and the
    unmarked ones they read: constants, variable reads); and every tensor a stage reads from
    another as (tensor, from stage, to stage), in a fixed order."""
    needed: List[set] = []
    crossing = set()
    for s in range(k_count):
        roots = [n for n, st in where.items() if st == s]
        roots += [r.node for (_, r), o in zip(rets, owners) if o == s and not r.is_function_arg]

        def inputs(n: str, s: int = s):
            """Inputs of ``n`` that stage ``s`` computes itself; the others' tensors are crossings."""
            for t, ctl in gv.inputs(n):
                if t.is_function_arg:
                    continue
                st = where.get(t.node)
                if st is None or st == s:
                    yield t.node
                elif not ctl:
                    crossing.add((t, st, s))
        needed.append(gv.reachable(roots, inputs))
    return needed, sorted(crossing, key=lambda m: (m[1], m[2], str(m[0])))


def _check_carried(gv: FunctionGraph, messages, key: str) -> None:
    """PipelineError for a tensor crossing between stages that VfSend cannot carry (the
    planner cuts elsewhere; this holds the line for what it could not see)."""
    from vfgraph.analysis.stages import carried

    for ref, src, dst in messages:
        if not carried(gv.dtype(ref)):
            from tensorflow.python.framework import dtypes

            raise PipelineError(f"signature {key!r}: {ref} ({dtypes.as_dtype(gv.dtype(ref)).name}) would go from stage "
                                f"{src + 1} to stage {dst + 1}, which messages between MPI ranks cannot carry; give "
                                "--split-at to cut elsewhere, or --devices to run the stages in one process")


def _message_ops(fdef, library):
    """The VfSend and VfRecv nodes of ``fdef``: (node, op, peer stage, message index, dtype),
    the index that of the message the node was written for (its name: its tag, which the
    backward of a stage takes from its forward, is known only at run time)."""
    import re

    g = FunctionGraph(fdef, library)
    out = []
    for n, node in g.nodes.items():
        if node.op in ("VfSend", "VfRecv"):
            m = re.fullmatch(r"vf/stage/(?:send|recv)_(\d+)", n)
            out.append((n, node.op, node.attr["stage"].i, int(m.group(1)) if m else -1, node.attr["T"].type))
    return g, out


def check_stage_messages(stages: List[List[object]], messages, key: str, library=None) -> None:
    """Refuse (PipelineError) stage functions whose messages would hang a virtual node.
    ``stages[s]``: the functions stage ``s`` calls for a virtual node, in order (each runs to
    its end before the next starts); ``messages``: (tensor, from stage, to stage) by index.
    Each VfRecv (peer, index, dtype) needs exactly one VfSend in the peer stage's functions
    with the same index and dtype, and each send one receive; and no receive may wait, through
    the functions' dependencies, their order and the messages, on itself (a cycle: every rank
    in it waits for a message its peer sends only later). The virtual-node loops only make
    a virtual node wait for earlier ones, so a virtual node that cannot hang by itself
    cannot hang the step."""
    from tensorflow.python.framework import dtypes

    ends: dict = {}
    deps: dict = {}   # node -> the nodes it waits for
    for s, fns in enumerate(stages):
        barrier = None
        for j, fdef in enumerate(fns):
            g, ops = _message_ops(fdef, library or {})
            ids = {n: (s, j, n) for n in g.nodes}
            for n in g.nodes:
                deps[ids[n]] = [ids[t.node] for t, _ in g.inputs(n) if not t.is_function_arg and t.node in ids]
                if barrier is not None:
                    deps[ids[n]].append(barrier)
            barrier = (s, j, None)
            deps[barrier] = list(ids.values())  # the call ends when all of it has run
            for n, op, peer, m, t in ops:
                src, dst = (s, peer) if op == "VfSend" else (peer, s)
                ends.setdefault((src, dst, m, t), {"VfSend": [], "VfRecv": []})[op].append(ids[n])

    def what(k) -> str:
        src, dst, m, t = k
        ref = messages[m][0] if 0 <= m < len(messages) else "?"
        return f"message {m} ({ref}, {dtypes.as_dtype(t).name}) from stage {src + 1} to stage {dst + 1}"
    for k, ops in sorted(ends.items(), key=lambda e: e[0][:3]):
        if len(ops["VfSend"]) != 1 or len(ops["VfRecv"]) != 1:
            raise PipelineError(f"signature {key!r}: {what(k)} is sent {len(ops['VfSend'])} time(s) and received "
                                f"{len(ops['VfRecv'])} time(s); each must be once, or a rank would wait forever for "
                                "it: this cut cannot run on MPI ranks, give --devices or another --split-at")
        send, recv = ops["VfSend"][0], ops["VfRecv"][0]
        # the receive completes once it is posted and the message sent; the send (its call)
        # once the message is delivered, which a large message is only once the receive is posted
        posted = ("posted",) + recv
        deps[posted], deps[recv] = deps[recv], [posted, send]
        deps[send[:2] + (None,)].append(posted)
    stuck = _waits_on_itself(deps)
    if stuck:
        recv = next((k for k, ops in sorted(ends.items(), key=lambda e: e[0][:3]) if ops["VfRecv"][0] in stuck), None)
        at = what(recv) if recv else f"node {sorted(stuck, key=str)[0][2]!r}"
        raise PipelineError(f"signature {key!r}: the stages' messages would deadlock: {at} is sent only after its "
                            "receiver has waited for it; this cut cannot run on MPI ranks, give --devices or "
                            "another --split-at")


def _waits_on_itself(deps: dict) -> set:
    """The nodes of the wait graph ``deps`` that never run (on or after a cycle)."""
    waiting = {n: len(set(d)) for n, d in deps.items()}
    users: dict = {}
    for n, d in deps.items():
        for p in set(d):
            users.setdefault(p, []).append(n)
    ready = [n for n, c in waiting.items() if c == 0]
    while ready:
        n = ready.pop()
        for u in users.get(n, ()):
            waiting[u] -= 1
            if waiting[u] == 0:
                ready.append(u)
    return {n for n, c in waiting.items() if c > 0}


def _stage_vnode_function(item: GraphItem, gv: FunctionGraph, where, rets, owners, needed: set, messages,
                          s: int, k_count: int, tag: str):
    """Stage ``s``'s part of the virtual-node function: its nodes, ``VfRecv`` for what it
    reads from other stages, ``VfSend`` (control outputs) for what they read from it; its
    outputs are those it computes. Not yet in the library (see :func:`_forward_backward`)."""
    from tensorflow.core.framework import attr_value_pb2

    from vfgraph.ir.attrs import shape_proto

    gc = FunctionGraph(gv.to_function_def(), gv.library)
    base = gc.arg(MESSAGE_BASE, I32, [])
    for m, (ref, src, dst) in enumerate(messages):
        if s not in (src, dst):
            continue
        t = gv.dtype(ref)
        at = gc.op("AddV2", [base, gc.const(m, I32, "message")[0]], name=f"vf/stage/tag_{m}", T=type_attr(I32))[0]
        if dst == s:
            name = f"vf/stage/recv_{m}"
            gc.replace_all_uses_with(ref, TensorRef(name, "output", 0))
            gc.op("VfRecv", [at], name=name, T=type_attr(t), stage=src, stages=k_count,
                  shape=attr_value_pb2.AttrValue(shape=shape_proto(gv.shape(ref))))
        else:
            gc.op("VfSend", [ref, at], name=f"vf/stage/send_{m}", T=type_attr(t), stage=dst, stages=k_count)
    drop = frozenset(n for n in gv.nodes if n not in needed)
    outputs = [(name, ref) for (name, ref), o in zip(rets, owners) if o == s]
    return gc.outline(function_name(gv.name, tag), outputs, drop=drop, side_effects=True)


def _sends(fdef):
    """(message index, node, peer stage) of the VfSend nodes of ``fdef``."""
    import re

    out = []
    for node in fdef.node_def:
        m = re.fullmatch(r"vf/stage/send_(\d+)", node.name)
        if node.op == "VfSend" and m:
            out.append((int(m.group(1)), node.name, node.attr["stage"].i))
    return out


def _forward_backward(item: GraphItem, vdef, messages, s: int, late=frozenset()) -> Optional[ForwardBackward]:
    """Stage ``s``'s virtual-node function ``vdef`` cut where the gradients of later stages
    arrive: the backward is every op that waits for one of them (their ``VfRecv`` and all
    that follows), or for a message ``late`` (one an earlier stage sends from its own
    backward, such as a gradient it computes of a variable this stage holds), the forward
    the rest, which runs and sends its activations without waiting for any gradient (the
    backward starts once the forward has ended: a forward waiting for a message sent after
    this stage's gradients would never end). Both go into the library, ``vdef`` not; None for
    a stage that receives no gradient (the last)."""
    g = FunctionGraph(vdef, item.library)
    recvs = [f"vf/stage/recv_{m}" for m, (_, src, dst) in enumerate(messages) if dst == s and src > s]
    if not recvs:
        return None
    recvs += [f"vf/stage/recv_{m}" for m, (_, src, dst) in enumerate(messages) if dst == s and src < s and m in late]
    kids: dict = {}
    for n in g.nodes:
        for t, _ in g.inputs(n):
            kids.setdefault(t.node, []).append(n)
    backward = g.reachable([r for r in recvs if r in g.nodes], lambda n: kids.get(n, ()))
    if not backward:
        return None
    forward = frozenset(g.nodes) - backward
    stash = sorted({t for n in backward for t, ctl in g.inputs(n)
                    if not ctl and not t.is_function_arg and t.node in forward}, key=str)
    names = [(f"vf_stash_{k}", t) for k, t in enumerate(stash)]
    where, f_out, b_out = [], [], []
    for name, ref in g.output_refs():
        mine = ref.is_function_arg or ref.node in forward
        where.append((mine, len(f_out) if mine else len(b_out)))
        (f_out if mine else b_out).append((name, ref))
    f_name, b_name = function_name(g.name, "forward"), function_name(g.name, "backward")
    f = g.outline(f_name, names + f_out, drop=frozenset(backward), side_effects=True,
                  into=item.new_function(f_name))
    b = g.outline(b_name, b_out, new_args=names, drop=forward, side_effects=True, into=item.new_function(b_name))
    return ForwardBackward(f, b, len(stash), tuple(where))


def _stage_update_function(item: GraphItem, udef, sig, step: TrainStep, mine: List[int], s: int, tag: str,
                           shares: "_UpdateShares"):
    """Stage ``s``'s part of the update function: the ops that run on its stage (see
    :func:`_update_shares`), taking only its own gradients; what it reads of other stages'
    arrives by the broadcasts of ``shares``, which every stage runs in the same order."""
    gu = FunctionGraph(udef, item.library)
    gc = FunctionGraph(gu.to_function_def(), item.library)
    last = None
    for m, (ref, root, shape, dtype) in enumerate(shares.sent):
        value = ref if s == root else zeros(gc, shape, dtype, "not_held_here")
        if s != root:
            gc.replace_all_uses_with(ref, TensorRef(f"vf/stage/shared_{m}", "output", 0))
        last = gc.op("VfBroadcast", [value], name=f"vf/stage/shared_{m}", deps=[last] if last else [],
                     T=type_attr(dtype), root=root, stages=shares.stages, shapes=[shape])
    drop = frozenset(n for n in gu.nodes if s not in shares.where.get(n, (s,)))
    name = function_name(gu.name, tag)
    outputs = [(a.name, gc.output_refs()[k][1]) for k, a in enumerate(udef.signature.output_arg)]
    try:
        return gc.outline(name, outputs, keep_args=[f"grad_{k}" for k in mine] + list(sig.invariant_args),
                          drop=drop, side_effects=True, into=item.new_function(name))
    except VerifyError as e:
        raise PipelineError(f"signature {sig.key!r}: the update of stage {s + 1} reads what other stages compute "
                            f"({e}), which pipeline stages on MPI ranks cannot share: give --devices") from None


_PASS_THROUGH = frozenset({"Identity", "IdentityN", "Snapshot"})


def _split_update_identities(udef, lib):
    """``udef`` with each ``IdentityN`` that nothing waits for (Keras passes the gradients
    through one) replaced by one ``Identity`` of each input, so that a stage's update needs
    only the gradients it uses; a copy, ``udef`` itself unchanged."""
    g = FunctionGraph(udef, lib)
    waited = {t.node for n in g.nodes for t, ctl in g.inputs(n) if ctl}
    split = sorted(n for n, node in g.nodes.items() if node.op == "IdentityN" and n not in waited)
    if not split:
        return udef
    g = FunctionGraph(g.to_function_def(), lib)
    for n in split:
        types = g.nodes[n].attr["T"].list.type
        mark = stage_of(g.nodes[n])
        for k, (ref, t) in enumerate(zip(g.outputs(n), types)):
            name = f"{n}/vf_output_{k}"
            g.replace_all_uses_with(ref, TensorRef(name, "output", 0))
            node = g.op("Identity", [g.data_inputs(n)[k]], name=name, T=type_attr(t), shapes=[g.shape(ref)])
            if mark is not None:
                node.proto.attr[STAGE_ATTR].i = mark
    fdef = g.finish()
    kept = [node for node in fdef.node_def if node.name not in split]
    del fdef.node_def[:]
    fdef.node_def.extend(kept)
    return fdef


class _UpdateShares(NamedTuple):
    """Where each node of the update function runs (the stages, from 0, that compute it), and
    the tensors broadcast from the stage computing them to every stage of the same replica of
    the pipeline (of ``stages`` stages), in the order every stage broadcasts them: (tensor,
    root stage, static shape, dtype)."""

    where: dict
    sent: list
    stages: int


def _update_shares(gu: FunctionGraph, sig, step: TrainStep, stages: Stages, grad_owner: List[int]) -> _UpdateShares:
    """Where each op of the update function ``gu`` runs when its stages are MPI ranks. A
    variable's update runs on every stage holding the variable (its owner; each holder of a
    shared one, from the same summed gradient: the owner of the sum broadcasts it, so the
    copies stay identical); an op partition-stages marked on its stage; an op reading only
    one stage's gradients on that stage; an op combining several stages' (global-norm
    clipping's sum of squared norms) on every stage, each part it reads broadcast from the
    stage computing it: every stage then adds the same parts in the same order, as one
    process does. Raises PipelineError for an op reading variables no one stage holds."""
    every = frozenset(range(stages.count))
    holders: dict = {}
    for k, part in enumerate(stages.parts):
        for name in part.variables + part.optimizer_state:
            holders.setdefault(name, set()).add(k)
    held = {a: (every if v.name in stages.replicated else frozenset(holders.get(v.name, every)))
            for a, v in sig.variables.items()}
    loc: dict = {}
    sent: list = []

    def share(ref: TensorRef, root: int, shape, stages=()) -> None:
        if shape is None or not _static(shape):
            conditional = _conditional_reader(gu, ref) if ref.is_function_arg else None
            if conditional is not None:  # every stage holding its variables runs it: no cut keeps it on one
                raise PipelineError(
                    f"signature {sig.key!r}: {_user_term(gu, ref, sig, step)} goes into the update {conditional!r} "
                    f"({gu.nodes[conditional].op}), which writes the variables of stages "
                    f"{', '.join(str(k + 1) for k in sorted(stages))} under one condition (a LossScaleOptimizer's "
                    "finite check, Keras' gradient accumulation, tf.cond on the gradients): each of those stages "
                    "runs it, and the gradient's shape is not static, which stages on MPI ranks need to broadcast "
                    "it; give --devices to run the stages in one process")
            raise PipelineError(f"signature {sig.key!r}: {_user_term(gu, ref, sig, step)} is needed on several "
                                "pipeline stages, and its shape is not static, which stages on MPI ranks need to "
                                "broadcast it; give --devices to run the stages in one process, or --split-at to keep "
                                "its readers on one stage")
        sent.append((ref, root, list(shape), gu.dtype(ref)))
        loc[ref] = every

    for k, owner in enumerate(grad_owner):
        ref = TensorRef(f"grad_{k}")
        if ref.node not in gu.arg_names:
            continue
        c = step.cut[k]
        loc[ref] = frozenset({owner})
        copies = held.get(c.variable, frozenset()) | {owner}
        if len(copies) > 1:
            v = sig.variables[c.variable]
            rows = c.combine.startswith("concat")  # a sparse gradient's rows: never the variable's shape
            share(ref, owner, gu.shape(ref) if rows or _static(gu.shape(ref) or [-1]) else v.shape, copies)
            loc[ref] = copies
    for n in gu.topological_order():
        loc[n] = _update_location(gu, n, loc, held, every, sig)
        for t in gu.data_inputs(n):
            if t.is_function_arg and t.node in held:
                continue
            lt = loc.get(t, loc.get(t.node, every)) if not t.is_function_arg else loc.get(t, every)
            if not loc[n] <= lt:
                share(t, min(lt), gu.shape(t), loc[n])
    for _, ref in gu.output_refs():
        lt = loc.get(ref, loc.get(ref.node, every)) if not ref.is_function_arg else loc.get(ref, every)
        if lt != every:
            share(ref, min(lt), gu.shape(ref))
    return _UpdateShares({n: v for n, v in loc.items() if isinstance(n, str)}, sent, stages.count)


def _update_location(gu: FunctionGraph, n: str, loc: dict, held: dict, every: frozenset, sig) -> frozenset:
    """The stages computing update op ``n``: its mark (an identity's: where its input is); else
    every stage holding all the variables it reads; else the stages computing all its inputs;
    else (inputs of different stages) every stage."""
    node = gu.nodes[n]
    mark = stage_of(node)
    ins = gu.data_inputs(n)
    if mark is not None and not (node.op in _PASS_THROUGH and ins):
        return frozenset({mark})
    variables = [t.node for t in ins if t.is_function_arg and t.node in held]
    if variables:
        out = every
        for a in variables:
            out &= held[a]
        if not out:
            names = sorted({sig.variables[a].name for a in variables})
            raise PipelineError(f"signature {sig.key!r}: the update reads variables {', '.join(names)} together, "
                                "which no one pipeline stage holds (each is held by the stages whose layers read it); "
                                "give --devices to run the stages in one process, or --split-at to keep their layers "
                                "on one stage")
        return out
    out = every
    for t in ins:
        out &= loc.get(t, every) if t.is_function_arg else loc.get(t, loc.get(t.node, every))
    return out or every


def _conditional_reader(gu: FunctionGraph, ref: TensorRef) -> Optional[str]:
    """The first functional op of the update (an ``If`` applying the gradients under a
    condition) that reads ``ref`` directly or through other ops, None when there is none."""
    from vfgraph.analysis.calls import is_functional

    seen, todo = set(), [ref]
    while todo:
        for consumer, _ in sorted(gu.consumers(todo.pop(0)), key=str):
            if consumer in seen:
                continue
            seen.add(consumer)
            if is_functional(gu.nodes[consumer].op):
                return consumer
            todo.extend(gu.outputs(consumer))
    return None


def _user_term(gu: FunctionGraph, ref: TensorRef, sig, step: TrainStep) -> str:
    """``ref`` of the update function in a user's terms: the gradient of a variable, or an op's name."""
    if ref.is_function_arg and ref.node.startswith("grad_"):
        c = step.cut[int(ref.node[len("grad_"):])]
        for v in [c.variable] + list(c.writes):
            if v in sig.variables:
                what = ("the sparse gradient (row indices)" if c.role == "indices" else "the sparse gradient (rows)"
                        if c.combine.startswith("concat") else "the gradient")
                return f"{what} of variable {sig.variables[v].name!r}"
    return f"{gu.nodes[ref.node].op} {ref.node!r}" if not ref.is_function_arg else f"input {ref.node!r}"


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
        item.set_function(reduce_function(reduce_fn, _reduce_specs(gk, step, options.deterministic)))
        loop = _Loop(gk, step, vdef, options.vnodes, b, item.library, item.new_function, 1, tag,
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
        call, updated = _update(fb, udef, _means(fb, step, sums, count), res, after=[done] + after)
        values.append(_assemble(step, results, updated))
        after = [call]
    out = values[-1]
    for k in reversed(range(len(assembles))):
        fdef = assembles[k]
        out = _call(fb, fdef, values[k] + out, "assemble", deps=after).outputs()
    for a, (_, ref), r in zip(original.signature.output_arg, g.output_refs(), out):
        fb.ret(a.name, fb.op("Identity", [r], name="result", deps=after, T=type_attr(a.type),
                             shapes=[g.shape(ref)])[0], a.type)
    return fb.finish()

