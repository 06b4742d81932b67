"""Random ops of a training step's per-virtual-node part, keyed by the global virtual-node index.

Run as V virtual nodes, a step draws its random numbers (dropout masks, noise, augmentation)
once per virtual node. For the training to be the same on any layout of the virtual nodes over
processes (1x8, 2x4, 5+3, an elastic resize), what virtual node ``k`` draws must depend on its
seed, the step and ``k`` only, never on how many virtual nodes its process ran before it.

The kinds are told apart by op type and dataflow, not by names:

- ``seed variable``: a stateless random op (``StatelessRandom*``) whose seed is read from an
  integer variable (Keras' ``SeedGenerator`` state, which the step's update advances once).
  Each virtual node reads the state of the start of the step; its seed becomes a stateless
  hash of that state and its global index (index 0 keeps the state itself, so one virtual node
  draws what the original step draws).
- ``generator``: ``RngReadAndSkip`` (``tf.random.Generator``): the state it reads is keyed
  the same way, and only a process's last virtual node of the step skips the state, by the
  amount one virtual node draws: every process advances it once per step by the same amount.
- ``fixed seed``: a stateless op whose seed comes from neither (constants, the batch, a scalar
  step counter): its draws are the same on every layout already.
- ``step counter``: a stateful ``RandomUniform``, ``RandomUniformInt``, ``RandomStandardNormal``
  or ``TruncatedNormal`` (its stream advances per call in each process) becomes its stateless
  twin, seeded from a hash of its seed attributes, the step counter (:func:`step_counter`) read
  at the start of the step and the global index.
- Anything else that draws (another stateful op with ``seed``/``seed2`` attributes, those
  above in a step without a step counter, ``RngSkip``, a random op inside a called function,
  an unregistered op that looks random) cannot be keyed: the deterministic mode refuses it,
  the default mode reports it.
"""
from __future__ import annotations

from typing import List, Optional, Tuple

from tensorflow.core.framework import function_pb2, types_pb2

from vfgraph.errors import PipelineError
from vfgraph.ir.attrs import func_attr, shapes_attr, type_attr, types_attr
from vfgraph.ir.graph import FunctionGraph, TensorRef
from vfgraph.records import RandomOp

VNODE_INDEX = "vnode_index"  # int64 argument of the virtual-node function: its global index
VNODE_LAST = "vnode_last"    # bool argument: the process's last virtual node of the step
I32, I64 = types_pb2.DT_INT32, types_pb2.DT_INT64

_STATELESS = ("StatelessRandom", "StatelessTruncatedNormal", "StatelessMultinomial",
              "StatelessParameterizedTruncatedNormal", "StatelessSampleDistortedBoundingBox")
_SEED_ONLY = ("StatelessRandomGetKeyCounter", "StatelessRandomGetAlg", "StatelessRandomGetKeyCounterAlg")
_GENERATOR = "RngReadAndSkip"
_LOOKS_RANDOM = ("Random", "Rng", "Shuffle", "Multinomial", "Dropout", "NonDeterministic")
_CALLS = ("StatefulPartitionedCall", "PartitionedCall")

SEED_VARIABLE, GENERATOR, FIXED, STEP = "seed variable", "generator", "fixed seed", "step counter"
# stateful random ops with seed/seed2 attributes made stateless: their op, the seed's input slot
_STATELESS_OF = {"RandomUniform": ("StatelessRandomUniform", 1), "RandomStandardNormal": ("StatelessRandomNormal", 1),
                 "TruncatedNormal": ("StatelessTruncatedNormal", 1),
                 "RandomUniformInt": ("StatelessRandomUniformInt", 1)}
CONVERTIBLE = frozenset(_STATELESS_OF)


def is_stateless(op: str) -> bool:
    """A stateless random op that draws (not one that only derives a key from a seed)."""
    return op.startswith(_STATELESS) and op not in _SEED_ONLY


def _unkeyable(op: str, library) -> Optional[str]:
    """Why ``op`` draws from a stream vfgraph cannot key (None: it does not draw, or is keyable)."""
    from tensorflow.python.framework import op_def_registry

    if is_stateless(op) or op in _SEED_ONLY or op == _GENERATOR or op in library or op in _CALLS:
        return None
    op_def = op_def_registry.get(op)
    if op_def is None:
        return "an unregistered op that looks random" if any(w in op for w in _LOOKS_RANDOM) else None
    attrs = {a.name for a in op_def.attr}
    if op_def.is_stateful and {"seed", "seed2"} <= attrs:
        return "a stateful random op: its stream advances per call in each process"
    if op_def.is_stateful and any(w in op for w in _LOOKS_RANDOM):
        return "a stateful random op vfgraph does not know"
    return None


def _called_random(fdef, library, seen=None) -> Optional[Tuple[str, str]]:
    """The first (node, op) that draws in ``fdef`` or a function it calls, else None."""
    seen = set() if seen is None else seen
    for node in fdef.node_def:
        fn = node.attr["f"].func.name if node.op in _CALLS else node.op if node.op in library else ""
        if fn:
            if fn not in seen and fn in library:
                seen.add(fn)
                if _called_random(library[fn], library, seen):
                    return node.name, fn
        elif is_stateless(node.op) or node.op == _GENERATOR or _unkeyable(node.op, library):
            return node.name, node.op
    return None


def find(fdef, library, ordered: bool = True,
         counter: Optional[str] = None) -> Tuple[List[RandomOp], List[str], List[str], List[str]]:
    """The random ops of virtual-node function ``fdef``: (every drawing op as a record, the
    integer variable reads and ``RngReadAndSkip`` nodes to key, the stateful ops to make
    stateless). ``ordered``: the virtual nodes of a process run one after another (a
    generator's skip can wait for the last); ``counter``: the step's step counter (see
    :func:`step_counter`), which stateful ops are keyed by."""
    g = FunctionGraph.over(fdef, library)
    kinds = g.present_ops()  # (each op type looked at once: a large model has few)
    odd = {op: why for op in kinds if (why := _unkeyable(op, library))}
    calls = [op for op in kinds if op in _CALLS or op in library]
    if not odd and not calls and not any(is_stateless(op) or op == _GENERATOR for op in kinds):
        return [], [], [], []
    ops = g.op_types()
    drawing = sorted(n for n, op in ops.items() if is_stateless(op))
    reads, generators, keyed_by, found = [], [], {}, []
    for name in drawing:
        for source in sorted(_seed_sources(g, name)):
            kind, words = ops[source], _words(g, source)
            if kind == _GENERATOR and (not ordered or not words):
                if any(r.node == source for r in found):
                    continue
                why = ("its virtual nodes may run at the same time (pipeline stages in flight)" if not ordered
                       else "its state has no static size")
                found.append(RandomOp(source, _GENERATOR, "", why))
            elif kind == _GENERATOR:
                generators += [source] * (source not in generators)
                keyed_by.setdefault(name, GENERATOR)
            elif words and g.nodes[source].attr["dtype"].type in (I64, I32):
                reads += [source] * (source not in reads)
                keyed_by.setdefault(name, SEED_VARIABLE)
    for name in drawing:
        found.append(RandomOp(name, ops[name], keyed_by.get(name, FIXED)))
    converts = []
    for name in sorted(n for op in list(odd) + calls for n in g.nodes_of(op)):
        op = ops[name]
        why = odd.get(op)
        if why and op in _STATELESS_OF and counter:
            converts.append(name)
            found.append(RandomOp(name, op, STEP))
            continue
        if why and op in _STATELESS_OF:
            why += ", and the step has no step counter (an integer variable its update adds a constant to) to key it by"
        if why is None:
            fn = g.nodes[name].attr["f"].func.name if op in _CALLS else op
            inner = _called_random(library[fn], library) if fn in library else None
            if inner:
                why = f"it draws inside function {fn!r} ({inner[0]!r}), which vfgraph does not key"
        if why:
            found.append(RandomOp(name, op, "", why))
    return found, reads, generators, converts


def _seed_sources(g: FunctionGraph, name: str) -> set:
    """The variable reads and generator reads the seed (or key and counter) of random op
    ``name`` is computed from (not its shape or other inputs)."""
    from tensorflow.python.framework import op_def_registry

    args = [a.name for a in op_def_registry.get(g.op_types()[name]).input_arg]
    roots = [t.node for t, a in zip(g.data_inputs(name), args) if a in ("seed", "key", "counter")
             and not t.is_function_arg]
    up = g.reachable(roots, lambda n: [t.node for t in g.data_inputs(n) if not t.is_function_arg])
    return {n for n in up if g.op_types()[n] in ("ReadVariableOp", _GENERATOR)}


def _words(g: FunctionGraph, name: str) -> int:
    """The number of words of the state a seed read or generator read gives (0: unknown)."""
    shape = g.shape(g.outputs(name)[0])
    return shape[0] if shape is not None and len(shape) == 1 and shape[0] > 0 else 0


def check(found: List[RandomOp], key: str, deterministic: bool) -> List[str]:
    """Refuse (deterministic mode) or report (default mode) the random ops that cannot be keyed."""
    bad = [r for r in found if not r.keyed]
    if not bad:
        return []
    first = bad[0]
    what = (f"signature {key!r}: random op {first.node!r} ({first.op}) cannot be keyed by virtual node: "
            f"{first.reason}" + (f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""))
    if deterministic:
        raise PipelineError(f"{what}; its draws would depend on the layout of the virtual nodes over processes, so "
                            "deterministic mode cannot hold: draw from a tf.random.Generator, a Keras SeedGenerator "
                            "or a stateless op seeded from a variable, or rewrite without --deterministic")
    return [f"{what}; its draws depend on the layout of the virtual nodes over processes"]


def key(fdef, reads: List[str], generators: List[str], library, converts: List[str] = (),
        counter: Optional[Tuple[str, int]] = None) -> None:
    """Key the seed reads and generator reads of ``fdef`` (in place) by its new
    ``vnode_index`` argument (and skip each generator only when ``vnode_last`` is true); make
    the stateful ops ``converts`` stateless, seeded from their seeds, the step counter
    ``counter`` (resource argument, dtype) and the index."""
    g = FunctionGraph(fdef, library)
    index = g.arg(VNODE_INDEX, I64, [])
    seeds = {}
    if converts:
        res, dtype = counter
        handle = TensorRef(res) if res in g.arg_names else g.arg(res, types_pb2.DT_RESOURCE, [])
        step = g.op("ReadVariableOp", [handle], name="vf/random/step", dtype=type_attr(dtype))[0]
        if dtype != I64:
            step = g.op("Cast", [step], name="vf/random/step", SrcT=type_attr(dtype), DstT=type_attr(I64),
                        Truncate=False)[0]
        for name in converts:
            seeds[name] = _stateful_seed(g, name, step, index)
    last = g.arg(VNODE_LAST, types_pb2.DT_BOOL, []) if generators else None
    for name in reads + generators:
        _fold(g, name, index)
    for name in generators:
        base = f"vf/random/{name}"
        node = g.nodes[name]
        delta = g.data_inputs(name)[2]
        t = g.dtype(delta)
        skip = g.op("SelectV2", [last, delta, g.const(0, t, f"{base}/none")[0]], name=f"{base}/skip", T=type_attr(t))
        node.input[2] = str(skip[0])
        g.replace_uses({})  # (the edited input: caches dropped)
    fdef.CopyFrom(g.finish())
    for node in fdef.node_def:  # each stateful op becomes its stateless twin, in place
        if node.name in seeds:
            op, slot = _STATELESS_OF[node.op]
            node.op = op
            node.input.insert(slot, seeds[node.name])
            for a in ("seed", "seed2"):
                del node.attr[a]
            if op == "StatelessRandomUniformInt":
                node.attr["dtype"].CopyFrom(node.attr["Tout"])
                del node.attr["Tout"]
            node.attr["Tseed"].type = I64
    if seeds:
        from vfgraph.ir.graph import verify_function_def

        verify_function_def(fdef, library)


def _stateful_seed(g: FunctionGraph, name: str, step: TensorRef, index: TensorRef) -> str:
    """The seed stateful op ``name`` draws with as a stateless op: a stateless hash of its
    ``seed`` and ``seed2`` attributes, the step and the global virtual node index."""
    base = f"vf/random/{name}"
    attrs = g.nodes[name].attr
    fixed = g.const([attrs["seed"].i, attrs["seed2"].i], I64, f"{base}/seeds")[0]
    h = _draw(g, fixed, 2, base)
    one = g.const([1], I32, f"{base}/one")[0]
    for k, word in enumerate((step, index)):
        flat = g.op("Reshape", [word, one], name=f"{base}/word", T=type_attr(I64), Tshape=type_attr(I32))[0]
        h = _draw(g, _mix(g, h, flat, k, base), 2, base)
    return str(h)


def _draw(g: FunctionGraph, seed: TensorRef, size: int, base: str) -> TensorRef:
    """``size`` int64 words drawn statelessly from ``seed`` (a hash of it)."""
    return g.op("StatelessRandomUniformFullInt", [g.const([size], I32, f"{base}/shape")[0], seed],
                name=f"{base}/hash", dtype=type_attr(I64), T=type_attr(I32), Tseed=type_attr(I64))[0]


def _mix(g: FunctionGraph, h: TensorRef, word: TensorRef, slot: int, base: str) -> TensorRef:
    """``h`` (2 words) with ``word`` (1 word) xor-ed into its word ``slot``."""
    zero = g.const([0], I64, f"{base}/zero")[0]
    pair = [word, zero] if slot == 0 else [zero, word]
    other = g.op("ConcatV2", pair + [g.const(0, I32, f"{base}/axis")[0]], name=f"{base}/pair", N=2,
                 T=type_attr(I64), Tidx=type_attr(I32))[0]
    return g.op("BitwiseXor", [h, other], name=f"{base}/mix", T=type_attr(I64))[0]


def _constant(g: FunctionGraph, ref: TensorRef) -> bool:
    """Whether ``ref`` is a constant (through Identity and Cast ops)."""
    while not ref.is_function_arg and g.op_types()[ref.node] in ("Identity", "Cast"):
        ref = g.data_inputs(ref.node)[0]
    return not ref.is_function_arg and g.op_types()[ref.node] == "Const"


def step_counter(g: FunctionGraph, vnode_nodes, variables) -> Optional[Tuple[str, int]]:
    """The step's step counter, from dataflow: an integer scalar variable (resource argument)
    that the update (outside ``vnode_nodes``) adds a constant to, once (an optimizer's
    iterations: ``AssignAddVariableOp(v, c)`` or ``AssignVariableOp(v, read(v) + c)``); its
    (resource argument, dtype), or None. ``variables``: the step's, by resource argument."""
    ops = g.op_types()
    found = {}
    for name, op in ops.items():
        if name in vnode_nodes or op not in ("AssignAddVariableOp", "AssignVariableOp"):
            continue
        dtype = g.nodes[name].attr["dtype"].type
        handle, value = g.data_inputs(name)[:2]
        if dtype not in (I32, I64) or not handle.is_function_arg or value.is_function_arg:
            continue
        terms = [value] if op == "AssignAddVariableOp" else (
            g.data_inputs(value.node) if ops[value.node] in ("AddV2", "Add") else [])
        consts = [t for t in terms if _constant(g, t)]
        reads_self = [t for t in terms if not t.is_function_arg and ops[t.node] == "ReadVariableOp"
                      and g.data_inputs(t.node)[0] == handle]
        if len(consts) == 1 and len(terms) == 1 + len(reads_self) <= 2:
            found.setdefault(handle.node, []).append(dtype)
    once = sorted((res, ds[0]) for res, ds in found.items() if len(ds) == 1 and res in variables
                  and variables[res].shape is not None and len(variables[res].shape) == 0)
    return once[0] if once else None


def _fold(g: FunctionGraph, name: str, index: TensorRef) -> None:
    """Replace the state node ``name`` gives (n integer words) by a stateless hash of it and
    ``index`` (Philox via ``StatelessRandomUniformFullInt``), except at index 0."""
    value = g.outputs(name)[0]
    dtype = g.dtype(value)
    n = _words(g, name)
    base = f"vf/random/{name}"
    g.replace_all_uses_with(value, TensorRef(f"{base}/keyed", "output", 0))
    words = value if dtype == I64 else g.op("Cast", [value], name=f"{base}/words", SrcT=type_attr(dtype),
                                              DstT=type_attr(I64), Truncate=False)[0]

    def part(k: int, size: int) -> TensorRef:
        return g.op("Slice", [words, g.const([k], I32, f"{base}/at")[0], g.const([size], I32, f"{base}/size")[0]],
                    name=f"{base}/word", T=type_attr(I64), Index=type_attr(I32))[0]

    h = _draw(g, part(0, 2) if n >= 2 else _mix(g, g.const([0, 0], I64, f"{base}/zeros")[0], words, 0, base), 2,
              base)
    for k in range(2, n):
        h = _draw(g, _mix(g, h, part(k, 1), 0, base), 2, base)
    flat = g.op("Reshape", [index, g.const([1], I32, f"{base}/one")[0]], name=f"{base}/index", T=type_attr(I64),
                Tshape=type_attr(I32))[0]
    out = _draw(g, _mix(g, h, flat, 1, base), n, base)
    if dtype != I64:
        out = g.op("Cast", [out], name=f"{base}/narrow", SrcT=type_attr(I64), DstT=type_attr(dtype),
                   Truncate=False)[0]
    first = g.op("Equal", [index, g.const(0, I64, f"{base}/first")[0]], name=f"{base}/is_first", T=type_attr(I64))
    g.op("SelectV2", [first[0], value, out], name=f"{base}/keyed", T=type_attr(dtype))


# --------------------------------------------------------------------------- the global index
def offset_function(name: str) -> function_pb2.FunctionDef:
    """The function a step calls once, before its virtual-node loop, for the global index of
    its first virtual node, given its number of virtual nodes: 0 on one process.
    ``insert-allreduce`` gives it a body over MPI ranks (:func:`mpi_offset_functions`)."""
    g = FunctionGraph.new(name)
    g.arg("vnodes", I32, [])
    g.ret("offset", g.const(0, I64, "zero")[0], I64)
    return g.finish()


def stage_offset_name(index_function: str) -> str:
    """The offset function of the pipeline stages' steps of a step whose offset function is
    ``index_function``: the global index of a replica's first virtual node."""
    return f"{index_function}_stages"


def mpi_offset_functions(name: str, library, stages: int = 0) -> List[function_pb2.FunctionDef]:
    """The offset function's body over MPI ranks: the virtual nodes of the lower ranks (which
    feed the rows of the global batch before this rank's), gathered in rank order; 0 on one
    process, with no collective. ``stages`` > 0: a pipeline stage's offset, over the ranks of
    its stage (one per replica of the pipeline, in replica order): the virtual nodes of the
    lower replicas; 0 without replicas. Returns the new body and its multi-process branch."""
    over = {"stages": stages} if stages else {}
    multi = FunctionGraph.new(f"{name}_all", library)
    nv = multi.arg("vnodes", I32, [])
    each = multi.op("VfAllgather", [multi.op("Reshape", [nv, multi.const([1], I32, "one")[0]], name="mine",
                                             T=type_attr(I32), Tshape=type_attr(I32))[0]],
                    name="allgather", T=type_attr(I32), shapes=[[-1]], **over)
    rank = multi.op("VfRank", name="rank", **over)
    rank1 = multi.op("Reshape", [rank[0], multi.const([1], I32, "one")[0]], name="rank_1", T=type_attr(I32),
                     Tshape=type_attr(I32))
    lower = multi.op("Slice", [each[0], multi.const([0], I32, "begin")[0], rank1[0]], name="lower",
                     T=type_attr(I32), Index=type_attr(I32))
    total = multi.op("Sum", [lower[0], multi.const(0, I32, "axis")[0]], name="before", T=type_attr(I32),
                     Tidx=type_attr(I32), keep_dims=False)
    multi.ret("offset", multi.op("Cast", [total[0]], name="offset", SrcT=type_attr(I32), DstT=type_attr(I64),
                                 Truncate=False)[0], I64)
    multi_def = multi.finish()
    one = offset_function(f"{name}_one")
    lib = dict(library)
    lib.update({multi_def.signature.name: multi_def, one.signature.name: one})
    m = FunctionGraph.new(name, lib)
    nv = m.arg("vnodes", I32, [])
    size = m.op("VfSize", name="size", **over)
    cond = m.op("Greater", [size[0], m.const(1, I32, "one")[0]], name="multi", T=type_attr(I32))
    branch = m.op("If", [cond[0], nv], name="offset", Tcond=type_attr(types_pb2.DT_BOOL), Tin=types_attr([I32]),
                  Tout=types_attr([I64]), then_branch=func_attr(multi_def.signature.name),
                  else_branch=func_attr(one.signature.name), output_shapes=shapes_attr([[]]),
                  _lower_using_switch_merge=True, shapes=[[]])
    m.ret("offset", branch[0], I64)
    return [m.finish(), multi_def, one]


def describe(found) -> List[str]:
    """One line per random op for ``vfgraph inspect``."""
    how = {SEED_VARIABLE: "keyed: seed read from a variable at the step's start, hashed with the global virtual "
                          "node index",
           GENERATOR: "keyed: generator state of the step's start hashed with the global virtual node index; "
                      "skipped once per step",
           STEP: "keyed: made stateless, seeded from its seed attributes, the step counter read at the step's "
                 "start and the global virtual node index",
           FIXED: "fixed seed (constants, the batch, or a value every virtual node reads alike): the same draws "
                  "on any layout"}
    return [f"{r.node!r} ({r.op}): " + (how.get(r.keyed, r.keyed) if r.keyed else f"NOT keyed: {r.reason}")
            for r in found]


__all__ = ["VNODE_INDEX", "VNODE_LAST", "find", "check", "key", "offset_function", "stage_offset_name",
           "mpi_offset_functions", "describe"]
