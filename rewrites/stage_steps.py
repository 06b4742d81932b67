"""The training steps of pipeline stages on MPI ranks, a part of split-vnodes.

When partition-stages marked a training step's ops with their stages for MPI ranks
(``Stages.MARK``), split-vnodes adds one training signature per stage: its part of the
virtual-node loop, with ``VfRecv`` for the tensors other stages compute and ``VfSend`` for
those they read of it, its own reduce function and its part of the update, the tensors
several stages' updates need broadcast from the stage computing them.
"""
from __future__ import annotations

from typing import List, NamedTuple, Optional, Tuple

from vfgraph.analysis import random_ops
from vfgraph.analysis.train_step import TrainStep
from vfgraph.errors import PipelineError, VerifyError
from vfgraph.io.signatures import add_signature, entry_header, signature_wrapper
from vfgraph.ir.attrs import type_attr
from vfgraph.ir.blocks import I32, zeros
from vfgraph.ir.graph import FunctionGraph, TensorRef, verify_function_def
from vfgraph.ir.names import function_name
from vfgraph.item import GraphItem
from vfgraph.records import Stages
from vfgraph.rewrites.vnode_loop import MESSAGE_BASE, ForwardBackward, VnodeLoop, reduce_function, reduce_specs

class _StageCut(NamedTuple):
    """The virtual-node function of a step cut into its stages' parts: ``owners`` (by output
    of the virtual-node function: its virtual-node outputs, then its gradients) the stage
    computing each; ``messages`` the tensors crossing between stages (tensor, from stage, to
    stage), by index; ``vdefs`` each stage's part, ``split`` its forward and backward (None:
    not split, ``vdefs[s]`` not yet in the library)."""

    owners: List[int]
    messages: list
    vdefs: list
    split: List[Optional[ForwardBackward]]


def add_stage_steps(item: GraphItem, g: FunctionGraph, step: TrainStep, vdef, udef, vnodes: int, b: int,
                    stages: Stages, exact: bool = False, index_fn: str = "") -> Tuple[Tuple[str, ...], Tuple[str, ...]]:
    """Add ``<train>_stage_1`` .. ``<train>_stage_K`` (:meth:`Stages.signature_name`): the
    training step of each pipeline stage partition-stages marked for MPI ranks (rank k runs
    stage k+1). Each runs the virtual-node loop over its stage's part of the virtual-node
    function, whose tensors from other stages arrive by ``VfRecv`` and whose tensors for other
    stages leave by ``VfSend`` (tag: the virtual node's index times the messages per virtual
    node, plus the message's place in a fixed order; a stage that receives gradients runs it as
    a forward and a backward call, :func:`_forward_backward`); then its reduce function
    (identity until ``insert-allreduce`` sums it over the replicas of the stage: ranks r and
    r + K of ``mpiexec -n K*D``); then its part of the update, once, on its own gradients'
    means; then it returns the step's outputs, broadcast from the stage that computes them.
    ``index_fn`` (random ops keyed by the global virtual node index): each stage numbers a
    replica's virtual nodes after those of the lower replicas
    (:func:`random_ops.stage_offset_name`, identity until ``insert-allreduce``), so the
    replicas draw what the virtual nodes of the unstaged step draw. Returns the signature keys
    and the reduce functions."""
    from vfgraph import ops as mpi_ops

    wrapper = _stage_wrapper(item, g, step)
    mpi_ops.load()  # VfSend, VfRecv and VfBroadcast are written below
    cut = _cut_stages(item, step, vdef, stages)
    n_out = len([o for o in step.outputs if o.side == "vnode"])
    udef = _split_update_identities(udef, item.library)
    shares = _update_shares(FunctionGraph(udef, item.library), step.signature, step, stages, cut.owners[n_out:])
    stage_index_fn = random_ops.stage_offset_name(index_fn) if index_fn else ""
    if stage_index_fn:
        item.set_function(random_ops.offset_function(stage_index_fn))
    names, reducers = [], []
    for s in range(stages.count):
        loop, view = _stage_loop(item, g, step, cut, s, vnodes, b, stages, exact, stage_index_fn)
        mine = [k - n_out for k, o in enumerate(cut.owners) if o == s and k >= n_out]
        udef_s = _stage_update_function(item, udef, step.signature, step, mine, s, f"stage{s + 1}", shares)
        names.append(Stages.signature_name(step.signature.key, s))
        reducers.append(_add_stage_step(item, g, step, view, loop, udef_s, cut.owners[:n_out], s, exact, wrapper,
                                        names[-1]))
    return tuple(names), tuple(reducers)


def _stage_wrapper(item: GraphItem, g: FunctionGraph, step: TrainStep):
    """The signature wrapper the stages' signatures are made like; PipelineError for a step
    whose stages cannot be MPI ranks (no wrapper; an output not a mean of a static shape)."""
    key = step.signature.key
    wrapper = signature_wrapper(item, key)
    if wrapper is None:
        raise PipelineError(f"signature {key!r} has no wrapper vfgraph can add stage signatures like; pipeline "
                            "stages on MPI ranks need a TF2 SavedModel")
    odd = [o.name for o in step.outputs if o.side == "vnode" and (o.combine != "mean" or not _static(g.shape(o.ref)))]
    if odd:
        raise PipelineError(f"signature {key!r}: output {odd[0]!r} is not a mean over virtual nodes of a static "
                            "shape, which pipeline stages on MPI ranks broadcast from the stage computing it; "
                            "give --devices to run the stages in one process")
    return wrapper


def _cut_stages(item: GraphItem, step: TrainStep, vdef, stages: Stages) -> _StageCut:
    """Virtual-node function ``vdef`` cut into the parts of ``stages``, with the messages
    between them checked (:func:`check_stage_messages`)."""
    sig, lib, k_count = step.signature, item.library, stages.count
    gv = FunctionGraph(vdef, lib)
    where = {n: Stages.stage_of(node) for n, node in gv.nodes.items()}
    owner_var = {}
    for k, part in enumerate(stages.parts):
        for name in part.variables + part.optimizer_state:
            owner_var[name] = k
    n_out = len([o for o in step.outputs if o.side == "vnode"])
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
    _check_carried(gv, messages, sig.key)
    vdefs = [_stage_vnode_function(item, gv, where, rets, owners, needed[s], messages, s, k_count, f"stage{s + 1}")
             for s in range(k_count)]
    split: List[Optional[ForwardBackward]] = []
    late: set = set()  # messages a stage sends from its backward: its peer must not wait for them in a forward
    for s, vdef_s in enumerate(vdefs):
        split.append(_forward_backward(item, vdef_s, messages, s, late))
        if split[-1] is not None:
            late |= {m for m, _, dst in _sends(split[-1].backward)}
    check_stage_messages([[vdef_s] if parts is None else [parts.forward, parts.backward]
                          for vdef_s, parts in zip(vdefs, split)], messages, sig.key, lib)
    return _StageCut(owners, messages, vdefs, split)


def _stage_loop(item: GraphItem, g: FunctionGraph, step: TrainStep, cut: _StageCut, s: int, vnodes: int, b: int,
                stages: Stages, exact: bool, index_fn: str) -> Tuple[VnodeLoop, TrainStep]:
    """Stage ``s``'s virtual-node loop, and the view of ``step`` it runs: the gradients and
    virtual-node outputs it computes."""
    vnode_outputs = [o for o in step.outputs if o.side == "vnode"]
    n_out = len(vnode_outputs)
    mine = [k for k, o in enumerate(cut.owners) if o == s]
    view = TrainStep(step.signature, step.function, [step.cut[k - n_out] for k in mine if k >= n_out],
                     step.vnode_nodes, step.writes, [o for k, o in enumerate(vnode_outputs) if k in mine],
                     step.batch_dependent)
    if cut.split[s] is None:
        item.set_function(cut.vdefs[s])
    # 1F1B: stage s (from 0) starts virtual node i once i - (K - s) has finished
    loop = VnodeLoop(g, view, cut.vdefs[s], vnodes, b, item.library, item.new_function, stages.in_flight(vnodes),
                     f"stage{s + 1}", len(cut.messages), exact,
                     lag=stages.count - s if s and stages.schedule == "1f1b" else 0, parts=cut.split[s],
                     index_fn=index_fn)
    return loop, view


def _add_stage_step(item: GraphItem, g: FunctionGraph, step: TrainStep, view: TrainStep, loop: VnodeLoop, udef_s,
                    owners: List[int], s: int, exact: bool, wrapper, key: str) -> str:
    """Add signature ``key``, stage ``s``'s training step (made like ``wrapper``): its loop,
    its reduce function (returned), its update ``udef_s`` once, the step's outputs."""
    sig, lib = step.signature, item.library
    tag = f"stage{s + 1}"
    reduce_s = function_name(sig.function, tag, "reduce")
    item.set_function(reduce_function(reduce_s, reduce_specs(g, view, exact)))
    fn = function_name(sig.function, tag, "0")
    header = entry_header(g, fn, list(wrapper.args), (), list(wrapper.outputs), [g.dtype(o.ref) for o in step.outputs])
    fb, args = FunctionGraph.like(header, lib, into=item.new_function(fn))
    results, call, updated = loop.run_step(fb, dict(zip(wrapper.args, args)), reduce_s, udef_s)
    _stage_returns(fb, g, step, header, owners, s, results, call, updated)
    verify_function_def(fb.finish(), lib)
    add_signature(item, key, fn, wrapper, takes_inputs=True)
    return reduce_s


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
        mark = Stages.stage_of(g.nodes[n])
        for k, (ref, t) in enumerate(zip(g.outputs(n), types)):
            name = f"{n}/vf_output_{k}"
            g.replace_all_uses_with(ref, TensorRef(name, "output", 0))
            node = g.op("Identity", [g.data_inputs(n)[k]], name=name, T=type_attr(t), shapes=[g.shape(ref)])
            if mark is not None:
                node.proto.attr[Stages.MARK].i = mark
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
    mark = Stages.stage_of(node)
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
