"""The virtual-node loop split-vnodes writes: a ``While`` over the slices of the fed batch
calling the virtual-node function, its sums reduced at the reduce point (the function
``insert-allreduce`` fills in), averaged, and the update called once. Shared by the training
step, its step-wise signatures and the steps of pipeline stages on MPI ranks
(:mod:`vfgraph.rewrites.stage_steps`).
"""
from __future__ import annotations

from typing import Dict, List, NamedTuple, Optional, Tuple

import numpy as np

from tensorflow.core.framework import types_pb2

from vfgraph.analysis.random_ops import VNODE_INDEX, VNODE_LAST
from vfgraph.analysis.train_step import TrainStep
from vfgraph.errors import PipelineError
from vfgraph.ir.attrs import func_attr, type_attr, types_attr
from vfgraph.ir.blocks import EXACT_MAX_TERMS, I32, I64, check, exact_add, from_exact, list_concat, zeros
from vfgraph.ir.graph import FunctionGraph, TensorRef
from vfgraph.ir.loops import LoopLayout, append, condition, next_index, reserve, same_batch, slice_reader, while_loop
from vfgraph.ir.names import function_name
from vfgraph.records import VirtualNodes

MESSAGE_BASE = "vf_message_base"  # argument of a stage's virtual-node function: its first message tag


F32 = types_pb2.DT_FLOAT
_FLOATS = (types_pb2.DT_HALF, types_pb2.DT_BFLOAT16, types_pb2.DT_FLOAT, types_pb2.DT_DOUBLE)


class VnodeLoop:
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
            calls = [call_function(fb, self.vdef, [by_name[a] for a in v_args], "vnode")]
            call = calls[0].outputs()
        else:  # the forward, once the last virtual node's has finished, then the backward
            f, b, stash, where = self.parts
            after = fb.op("Identity", [chain[0]], name="forward_after", T=type_attr(I32))
            calls = [call_function(fb, f, [by_name[a.name] for a in f.signature.input_arg], "forward", deps=[after])]
            ins = calls[0].outputs()[:stash] + [by_name[a.name] for a in b.signature.input_arg[stash:]]
            calls.append(call_function(fb, b, ins, "vnode"))
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

    def run_step(self, fb: FunctionGraph, by: Dict[str, TensorRef], reduce_fn: str, udef):
        """A training step's body in ``fb`` (``by``: its arguments by name): every virtual node
        of the fed batch, their sums reduced by ``reduce_fn`` and averaged, then the update
        ``udef`` once, after the loop; returns (the per-virtual-node outputs, the update's
        call, its outputs)."""
        sig = self.step.signature
        res = [by[a] for a in sig.invariant_args]
        outs, sums, fused, nv, done = self.emit(fb, [by[a] for a in sig.batch_args], res)
        outs, sums, count = self.reduce(fb, outs, sums, fused, nv, reduce_fn)
        results = self.outputs(fb, outs, count, nv)
        call, updated = call_update(fb, udef, mean_gradients(fb, self.step, sums, count), res, after=[done])
        return results, call, updated


class ForwardBackward(NamedTuple):
    """A pipeline stage's virtual-node function in two: ``forward`` returns the tensors the
    backward reads (``stash`` of them) and then its own outputs; ``backward`` takes those
    tensors and then the function's arguments; ``where`` gives, for each output of the whole
    function, (whether the forward computes it, its index among that part's own outputs)."""

    forward: object
    backward: object
    stash: int
    where: Tuple[Tuple[bool, int], ...]


def call_function(fb: FunctionGraph, fdef, inputs: List[TensorRef], name: str, deps=()):
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


def mean_gradients(fb: FunctionGraph, step: TrainStep, sums: List[TensorRef], count: TensorRef) -> List[TensorRef]:
    """The gradients the update gets: sums divided by the number of virtual nodes (those of a
    loss summed over the batch: the sums); sparse gradients' rows are scaled the same way and
    their indices passed as they are."""
    return [divide(fb, a, count, c.dtype, c.shape) if c.combine != "concat" and c.averaged else a
            for c, a in zip(step.cut, sums)]


def assemble_outputs(step: TrainStep, vnode_results: List, updated) -> List:
    """The function's outputs in the original order."""
    vi = iter(vnode_results)
    ui = iter(updated)
    return [next(vi) if o.side == "vnode" else next(ui) for o in step.outputs]


def call_update(fb: FunctionGraph, udef, means: List[TensorRef], res: List[TensorRef], after=()):
    """Call the update function once, after ``after``; returns (its node, its outputs). The
    control dependency matters: inlined, the update's ops that do not read the gradients
    (AdamW's weight decay) would otherwise run as soon as the step starts."""
    call = call_function(fb, udef, means + res, "update", deps=after)
    fb.control_ret(call)
    return call, call.outputs()


# --------------------------------------------------------------------------- reduce point
def output_sum_specs(g: FunctionGraph, step: TrainStep) -> List[Tuple[int, list, str]]:
    """(dtype, shape, "sum") of the loop's output sums (outputs averaged over virtual nodes)."""
    return [(g.dtype(o.ref), g.shape(o.ref), "sum") for o in step.outputs if o.side == "vnode" and o.combine == "mean"]


def reduce_specs(g: FunctionGraph, step: TrainStep, exact: bool = False) -> List[Tuple[str, int, list]]:
    """(argument name, dtype, shape) of what a step reduces over processes: the loop's output
    sums, the gradient sums (``sum_k``) or sparse rows (``gather_k``), and the number of
    virtual nodes (last, float32). ``exact``: floating-point sums are int64 words (``[2] +
    shape``, see :class:`VnodeLoop`)."""
    specs = output_sum_specs(g, step)
    specs += [(c.dtype, c.shape, "sum" if c.combine == "mean" else "gather") for c in step.cut]
    if exact:  # as VnodeLoop.reduce passes them: those summed in floating point, then each exact group's words
        entries = [("mean" if kind == "sum" else kind, dtype, shape) for dtype, shape, kind in specs]
        marks = [c == "mean" and t in _FLOATS for c, t, _ in entries]
        specs = [spec for spec, m in zip(specs, marks) if not m] + [
            (I64, [2 * sum(sizes) + 1], "sum") for _, _, sizes in exact_groups(entries, marks)]
    specs.append((types_pb2.DT_FLOAT, [], "sum"))
    prefix = {"sum": VirtualNodes.SUMMED, "gather": VirtualNodes.GATHERED}
    return [(f"{prefix[kind]}{k}", dtype, shape) for k, (dtype, shape, kind) in enumerate(specs)]


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
