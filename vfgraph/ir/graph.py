"""The function IR: a FunctionDef body as a graph to read, edit and write, the unit every
rewrite works on.

A :class:`FunctionGraph` reads a function (its nodes, typed tensor references
(:class:`TensorRef`), consumers, shapes, op types), rewires it keeping its indexes right
(:meth:`~FunctionGraph.replace_uses`), writes new functions and nodes with every reference
checked as it is written (:meth:`~FunctionGraph.new`, :meth:`~FunctionGraph.op`,
:meth:`~FunctionGraph.ret`), and outlines a part of itself as a new function
(:meth:`~FunctionGraph.outline`); :meth:`~FunctionGraph.verify` says what is wrong and where.

Writing NodeDefs directly costs microseconds per node; tracing costs about a millisecond per
op (TensorFlow builds, shape-infers and auto-orders every op in a FuncGraph). Direct
construction also states every ordering the graph needs as an explicit control dependency
instead of relying on a tracer to infer it.
"""
from __future__ import annotations

import hashlib
import heapq
import sys
from functools import lru_cache
from typing import Callable, Dict, Iterable, Iterator, List, Mapping, NamedTuple, Optional, Sequence, Tuple, Union

import networkx as nx
from tensorflow.core.framework import function_pb2, node_def_pb2, op_def_pb2, types_pb2
from tensorflow.python.framework import op_def_registry

from vfgraph.errors import VerifyError
from vfgraph.ir.attrs import (AttrValue, array_attr, attr_value, const_array, op_defaults, shape_arg_attrs, shapes_attr,
                              type_attr)
from vfgraph.ir.functions import DataType, arg_shape_at, copy_header, output_layout, output_names, shape_list


class TensorRef(NamedTuple):
    """One tensor in a function body: a function argument, or output ``arg:index`` of a node.
    (A named tuple: hashed and compared in C, which the analyses' dictionaries of tensors
    spend much of their time on.)"""

    node: str
    arg: Optional[str] = None
    index: int = 0

    @property
    def is_function_arg(self) -> bool:
        return self.arg is None

    def __str__(self) -> str:
        return self.node if self.arg is None else f"{self.node}:{self.arg}:{self.index}"


# TensorRef's tuple made without its Python-level __new__ (a 100k-node graph parses ~130k strings)
_ref = tuple.__new__
# Names are interned: a node's name read from its NodeDef and parsed from an input reading it
# are then one string, compared by identity, and a graph's output names are a few strings.
_intern = sys.intern


@lru_cache(maxsize=1 << 20)
def parse_input(text: str) -> Tuple[TensorRef, bool]:
    """Parse one FunctionDef input string; returns (tensor, is_control). Results are shared
    (a TensorRef is immutable), so a string is parsed once."""
    if text.startswith("^"):
        return _ref(TensorRef, (_intern(text[1:]), None, 0)), True
    parts = text.split(":")
    if len(parts) == 1:
        return _ref(TensorRef, (_intern(text), None, 0)), False
    if len(parts) == 3:
        return _ref(TensorRef, (_intern(parts[0]), _intern(parts[1]), int(parts[2]))), False
    if len(parts) == 2:  # GraphDef style "node:k"
        return _ref(TensorRef, (_intern(parts[0]), "", int(parts[1]))), False
    raise VerifyError(f"malformed input reference {text!r}")


class FunctionGraph:
    """A FunctionDef body as an editable graph with a consumer index."""

    _node_class: type  # what op() returns: Node (set below, once it is defined)

    def __init__(self, fdef: function_pb2.FunctionDef,
                 library: Optional[Mapping[str, function_pb2.FunctionDef]] = None):
        self._header = function_pb2.FunctionDef()
        self._header.CopyFrom(fdef)
        self.library: Mapping[str, function_pb2.FunctionDef] = library if library is not None else {}
        # The nodes of the private copy, taken out of it (the header keeps everything else).
        self.nodes: Dict[str, node_def_pb2.NodeDef] = {_intern(n.name): n for n in self._header.node_def}
        del self._header.node_def[:]
        self._consumers: Optional[Dict[TensorRef, List[Tuple[str, int]]]] = None
        self._layout_cache: Dict[str, List[Tuple[str, int, DataType]]] = {}
        self._outputs_cache: Dict[str, List[TensorRef]] = {}
        self._index_cache: Dict[str, Dict[Tuple[str, int], int]] = {}
        self._inputs_cache: Dict[str, List[Tuple[TensorRef, bool]]] = {}
        self._shapes_cache: Dict[str, Optional[Tuple[Optional[List[int]], ...]]] = {}
        self._parsed_shapes: Dict[bytes, tuple] = {}  # attribute bytes -> (shapes, fully known)
        self._ops: Optional[Dict[str, str]] = None
        self._by_op: Optional[Dict[str, List[str]]] = None
        self._writing_state(in_place=False)

    def _writing_state(self, in_place: bool) -> None:
        # in_place: new nodes go into the FunctionDef itself (a graph over it), else into
        # ``nodes`` only (a private copy, written out by to_function_def)
        self._in_place = in_place
        # References checked readable so far: arguments, "^node" and the outputs of nodes
        # (learned the first time one is read); a function written only through op() is
        # valid and acyclic by construction.
        self._valid: set = set()
        self._built = not self.nodes  # every node written through op(), checked as written
        self._used: Dict[str, int] = {}
        self._consts: Dict[tuple, "Node"] = {}
        self.memo: Dict[tuple, TensorRef] = {}  # for building blocks that make one node per function

    # ----------------------------------------------------------------- boundary
    @classmethod
    def over(cls, fdef: function_pb2.FunctionDef,
             library: Optional[Mapping[str, function_pb2.FunctionDef]] = None) -> "FunctionGraph":
        """A graph over ``fdef`` itself (no copy): it reads the function, and what it writes
        (:meth:`op`, :meth:`arg`, :meth:`ret`, :meth:`replace_uses`) goes into ``fdef``."""
        g = cls.__new__(cls)
        g._header = fdef
        g.library = library if library is not None else {}
        g.nodes = {_intern(n.name): n for n in fdef.node_def}
        g._consumers = None
        g._layout_cache, g._outputs_cache, g._index_cache, g._inputs_cache = {}, {}, {}, {}
        g._shapes_cache, g._parsed_shapes, g._ops, g._by_op = {}, {}, None, None
        g._writing_state(in_place=True)
        return g

    @classmethod
    def new(cls, name: str, library: Optional[Mapping[str, function_pb2.FunctionDef]] = None,
            into: Optional[function_pb2.FunctionDef] = None) -> "FunctionGraph":
        """An empty function ``name`` to write node by node, into the empty FunctionDef
        ``into`` when given (see :meth:`vfgraph.ir.library.Library.new`). ``library``: the
        functions its nodes may call (it is read as the function is written)."""
        fdef = function_pb2.FunctionDef() if into is None else into
        fdef.signature.name = name
        fdef.signature.is_stateful = True
        return cls.over(fdef, library)

    @classmethod
    def like(cls, header: function_pb2.FunctionDef, library: Optional[Mapping[str, function_pb2.FunctionDef]] = None,
             into: Optional[function_pb2.FunctionDef] = None) -> Tuple["FunctionGraph", List[TensorRef]]:
        """An empty function with ``header``'s name, arguments and attributes (outputs are
        added with :meth:`ret`); returns it and its arguments."""
        g = cls.new(header.signature.name, library, into)
        arg_attr = header.arg_attr
        args = [g.arg(a.name, a.type, attr=arg_attr[i] if i in arg_attr else None)
                for i, a in enumerate(header.signature.input_arg)]
        for k, v in header.attr.items():
            g._header.attr[k].CopyFrom(v)
        return g, args

    @property
    def fdef(self) -> function_pb2.FunctionDef:
        """The FunctionDef a graph over one (:meth:`new`, :meth:`like`, :meth:`over`) writes into."""
        if not self._in_place:
            raise TypeError(f"{self.name}: a copied graph has no FunctionDef of its own; use to_function_def()")
        return self._header

    def to_function_def(self) -> function_pb2.FunctionDef:
        out = copy_header(self._header)
        out.node_def.extend(self.nodes[n] for n in self.nodes)
        return out

    # ----------------------------------------------------------------- signature
    @property
    def name(self) -> str:
        return self._header.signature.name

    @property
    def signature(self) -> op_def_pb2.OpDef:
        return self._header.signature

    @property
    def ret(self):
        return self._header.ret

    @property
    def header(self) -> function_pb2.FunctionDef:
        """The FunctionDef without its nodes (signature, arg_attr, ret, attr): read only."""
        return self._header

    @property
    def arg_names(self) -> List[str]:
        return [a.name for a in self._header.signature.input_arg]

    def _arg_index(self, name: str) -> int:
        index = getattr(self, "_arg_positions", None)
        if index is None or len(index) != len(self._header.signature.input_arg):
            index = self._arg_positions = {a.name: i for i, a in enumerate(self._header.signature.input_arg)}
        return index[name]

    def arg_type(self, name: str) -> DataType:
        return self._header.signature.input_arg[self._arg_index(name)].type

    def arg_shape(self, name: str) -> Optional[List[int]]:
        """Static shape recorded for a function argument (None when unknown)."""
        return arg_shape_at(self._header, self._arg_index(name))

    def output_refs(self) -> List[Tuple[str, TensorRef]]:
        """(output arg name, tensor) for every function output, in signature order."""
        return [(a.name, parse_input(self._header.ret[a.name])[0]) for a in self.signature.output_arg]

    # ----------------------------------------------------------------- queries
    def inputs(self, node: str) -> List[Tuple[TensorRef, bool]]:
        """(tensor, is_control) for each input of ``node``, parsed once (reading a protobuf
        field costs more than the walks that ask for it; edits through the verbs renew it)."""
        found = self._inputs_cache.get(node)
        if found is None:
            found = self._inputs_cache[node] = [parse_input(s) for s in self.nodes[node].input]
        return found

    def data_inputs(self, node: str) -> List[TensorRef]:
        return [t for t, ctl in self.inputs(node) if not ctl]

    def control_inputs(self, node: str) -> List[str]:
        return [t.node for t, ctl in self.inputs(node) if ctl]

    def layout(self, node: str) -> List[Tuple[str, int, DataType]]:
        if node not in self._layout_cache:
            self._layout_cache[node] = output_layout(self.nodes[node], self.library)
        return self._layout_cache[node]

    def outputs(self, node: str) -> List[TensorRef]:
        """Every flat output of ``node``; an op without list outputs needs no attribute read."""
        found = self._outputs_cache.get(node)
        if found is None:
            names = output_names(self.op_types()[node], self.library)
            found = self._outputs_cache[node] = (
                [_ref(TensorRef, (node, a, 0)) for a in names] if names is not None else
                [TensorRef(node, a, k) for a, k, _ in self.layout(node)])
        return found

    def flat_index(self, ref: TensorRef) -> int:
        index = self._index_cache.get(ref.node)
        if index is None:
            index = {}
            for i, t in enumerate(self.outputs(ref.node)):
                index.setdefault((t.arg, t.index), i)
            self._index_cache[ref.node] = index
        i = index.get((ref.arg, ref.index))
        if i is None:
            raise VerifyError(f"node {ref.node!r} has no output {ref.arg}:{ref.index}")
        return i

    def dtype(self, ref: TensorRef) -> DataType:
        if ref.is_function_arg:
            return self.arg_type(ref.node)
        return self.layout(ref.node)[self.flat_index(ref)][2]

    def shape(self, ref: TensorRef) -> Optional[List[int]]:
        """Static shape from the ``_output_shapes`` the exporter recorded (-1: unknown dim)."""
        if ref.is_function_arg:
            return self.arg_shape(ref.node)
        shapes = self.recorded_shapes(ref.node)
        if shapes is None:
            return None
        i = self.flat_index(ref)
        return list(shapes[i]) if i < len(shapes) and shapes[i] is not None else None

    def op_types(self) -> Dict[str, str]:
        """Every node's op type, read once (a protobuf field costs more to read than a
        dictionary entry) and kept right by the edit verbs. Read only."""
        if self._ops is None:
            self._ops = {name: node.op for name, node in self.nodes.items()}
        return self._ops

    def nodes_of(self, op: str) -> List[str]:
        """The nodes of op type ``op``, in stored order. Read only."""
        return self._grouped().get(op, [])

    def present_ops(self) -> List[str]:
        """The op types of the nodes, each once, sorted."""
        return sorted(self._grouped())

    def _grouped(self) -> Dict[str, List[str]]:
        """Node names by op type (grouped once; kept right by the edit verbs)."""
        if self._by_op is None:
            by_op: Dict[str, List[str]] = {}
            for name, t in self.op_types().items():
                by_op.setdefault(t, []).append(name)
            self._by_op = by_op
        return self._by_op

    def recorded_shapes(self, node: str) -> Optional[Tuple[Optional[List[int]], ...]]:
        """Every output's static shape as recorded on ``node`` (None: nothing recorded), read
        only. Kept per node (the gradients' ``IdentityN`` has hundreds of outputs) and parsed
        once per distinct attribute value: a graph repeats a few shapes, and serializing one is
        a single call where reading it dimension by dimension is many."""
        found = self._shapes_cache.get(node, _NOT_READ)
        if found is _NOT_READ:
            found = self._shapes_cache[node] = self._read_shapes(node)[0]
        return found

    def recorded_known(self, node: str) -> Tuple[bool, ...]:
        """For every output of ``node``, whether its recorded static shape is fully known
        (empty when nothing is recorded)."""
        return self._read_shapes(node)[1]

    def _read_shapes(self, node: str) -> Tuple[Optional[Tuple[Optional[List[int]], ...]], Tuple[bool, ...]]:
        value = self.nodes[node].attr.get("_output_shapes")  # (get: reading adds no entry)
        if value is None:
            return None, ()
        key = value.SerializeToString()
        found = self._parsed_shapes.get(key)
        if found is None:
            shapes = tuple(shape_list(s) for s in value.list.shape)
            found = self._parsed_shapes[key] = shapes, tuple(s is not None and all(d >= 0 for d in s) for s in shapes)
        return found

    def consumers(self, ref: TensorRef) -> List[Tuple[str, int]]:
        """(node, input position) of every data input that reads ``ref``."""
        if self._consumers is None:
            self._index()
        return self._consumers.get(ref, [])

    def data_children(self, name: str) -> List[str]:
        """The nodes that read any output of node (or argument) ``name`` through a data edge,
        each once: the node-level graph the reachability walks use."""
        if self._consumers is None:
            self._index()
        return self._children.get(name, [])

    def _index(self) -> None:
        """Build the consumer index and the node-level data edges in one pass over the inputs."""
        idx: Dict[TensorRef, List[Tuple[str, int]]] = {}
        children: Dict[str, List[str]] = {}
        for name in self.nodes:
            last = None
            for i, (t, ctl) in enumerate(self.inputs(name)):
                if not ctl:
                    idx.setdefault(t, []).append((name, i))
                    if t.node != last:
                        kids = children.setdefault(t.node, [])
                        if not kids or kids[-1] != name:
                            kids.append(name)
                        last = t.node
        self._consumers, self._children = idx, children

    def to_networkx(self, control: bool = True) -> nx.DiGraph:
        """Node-level dependency graph (edges producer -> consumer); args are nodes too."""
        g = nx.DiGraph()
        g.add_nodes_from(self.arg_names)
        g.add_nodes_from(self.nodes)
        for name in self.nodes:
            for t, ctl in self.inputs(name):
                if ctl and not control:
                    continue
                g.add_edge(t.node, name)
        return g

    def _dependency_lists(self) -> Tuple[Dict[str, List[str]], Dict[str, int]]:
        """The edges of :meth:`to_networkx` (each producer -> consumer pair once): children of
        every name, and how many distinct producers each name has."""
        children: Dict[str, List[str]] = {a: [] for a in self.arg_names}
        indegree: Dict[str, int] = dict.fromkeys(children, 0)
        for name in self.nodes:
            children.setdefault(name, [])
            indegree.setdefault(name, 0)
        for name, node in self.nodes.items():
            preds = {parse_input(s)[0].node for s in node.input}
            indegree[name] = len(preds)
            for p in preds:
                if p not in children:  # a missing producer is a node of its own
                    children[p] = []
                    indegree[p] = 0
                children[p].append(name)
        return children, indegree

    def topological_order(self) -> List[str]:
        """Nodes in topological order, ties broken by name (deterministic)."""
        children, indegree = self._dependency_lists()
        ready = [n for n, d in indegree.items() if d == 0]
        heapq.heapify(ready)
        order: List[str] = []
        while ready:
            n = heapq.heappop(ready)
            order.append(n)
            for c in children[n]:
                indegree[c] -= 1
                if indegree[c] == 0:
                    heapq.heappush(ready, c)
        if len(order) != len(indegree):
            raise nx.NetworkXUnfeasible("Graph contains a cycle or graph changed during iteration")
        return [n for n in order if n in self.nodes]

    def reachable(self, roots: Iterable[str], follow: Callable[[str], Iterable[str]]) -> set:
        """The nodes reached from ``roots`` (nodes of this graph) by following ``follow(node)``
        (its producers for ancestors, its consumers for descendants), the roots included."""
        seen, stack = set(), [r for r in roots if r in self.nodes]
        while stack:
            n = stack.pop()
            if n in seen:
                continue
            seen.add(n)
            stack.extend(p for p in follow(n) if p in self.nodes and p not in seen)
        return seen

    # ----------------------------------------------------------------- edits
    def replace_all_uses_with(self, old: TensorRef, new: TensorRef) -> int:
        """Point every data consumer of ``old`` (and function outputs) at ``new``."""
        return self.replace_uses({old: new})

    def replace_uses(self, mapping: Dict[TensorRef, TensorRef]) -> int:
        """Several ``replace_all_uses_with`` in one pass over the graph."""
        table = {str(k): str(v) for k, v in mapping.items()}
        count = 0
        for node in self.nodes.values():
            for i, s in enumerate(node.input):
                if s in table:
                    node.input[i] = table[s]
                    count += 1
        for k, v in self._header.ret.items():
            if v in table:
                self._header.ret[k] = table[v]
                count += 1
        self._consumers = None
        self._inputs_cache.clear()
        return count

    # ----------------------------------------------------------------- writing
    def arg(self, name: str, dtype: DataType, shape: Optional[Sequence[int]] = None, attr=None) -> TensorRef:
        """Add argument ``name`` (its static ``shape``, or its ``attr``ibutes, recorded)."""
        sig = self._header.signature
        sig.input_arg.add(name=name, type=dtype)
        self._valid.add(name)
        if attr is None and shape is not None:
            attr = shape_arg_attrs(tuple(shape))
        if attr is not None:
            self._header.arg_attr[len(sig.input_arg) - 1].CopyFrom(attr)
        return _ref(TensorRef, (name, None, 0))

    def args_of(self, fdef: function_pb2.FunctionDef) -> List[TensorRef]:
        """Every argument of ``fdef`` (names, types and attributes, copied in one call each),
        as this function's first arguments."""
        sig = self._header.signature
        if sig.input_arg:
            raise ValueError(f"{sig.name}: args_of adds the first arguments; this function has some")
        sig.input_arg.extend(fdef.signature.input_arg)
        self._header.arg_attr.MergeFrom(fdef.arg_attr)
        names = [a.name for a in sig.input_arg]
        self._valid.update(names)
        return [_ref(TensorRef, (n, None, 0)) for n in names]

    def _unique(self, base: str) -> str:
        k = self._used.get(base, 0)
        name = base if k == 0 else f"{base}_{k}"
        while name in self.nodes:
            k += 1
            name = f"{base}_{k}"
        self._used[base] = k + 1
        return name

    def op(self, op: str, inputs: Sequence[Union[TensorRef, str]] = (), name: str = "",
           deps: Sequence[Union["Node", str]] = (), shapes: Optional[Sequence[Optional[Sequence[int]]]] = None,
           **attrs) -> "Node":
        """Write a node of op type ``op`` reading ``inputs`` after ``deps`` (nodes or node
        names), named ``name`` (default: the op) made unique; every reference must name an
        argument or an output of a node written before. A registered op gets its default
        attributes (what TensorFlow would store); ``shapes`` records its outputs' static shapes."""
        name = self._unique(name or op)
        ins = [s if type(s) is str else str(s) for s in inputs]
        for d in deps:
            ins.append(d.ctl if isinstance(d, Node) else d if d.startswith("^") else "^" + d)
        valid = self._valid
        for s in ins:
            if s not in valid:
                self._check(s, f"node {name!r} reads {s!r}")
        values = {k: v if type(v) is AttrValue else attr_value(v) for k, v in attrs.items()}
        if op not in self.library:
            defaults = op_defaults(op)
            if defaults is None:
                raise KeyError(f"op {op!r} is not registered")
            for a, value in defaults:
                if a not in values:
                    values[a] = value
        if shapes is not None:
            values["_output_shapes"] = shapes_attr(shapes)
        if self._in_place:
            proto = self._header.node_def.add(name=name, op=op, input=ins, attr=values)
        else:
            proto = node_def_pb2.NodeDef(name=name, op=op, input=ins, attr=values)
        self.nodes[name] = proto
        if self._ops is not None:
            self._ops[name] = op
        self._by_op = self._consumers = None
        valid.add("^" + name)
        return self._node_class(self, proto, name, op)

    def _check(self, ref: str, what: str) -> None:
        """Raise unless ``ref`` names an argument, a node (``^node``) or an output of one;
        then remember it as readable."""
        t, ctl = parse_input(ref)
        if ctl:
            ok = t.node in self.nodes
        elif t.arg is None:
            ok = t.node in self.arg_names
        else:
            ok = t.node in self.nodes and ref in {str(r) for r in self.outputs(t.node)}
        if not ok:
            raise KeyError(f"{self.name}: {what}, which is not an argument or an output of a node written before")
        self._valid.add(ref)

    def const(self, value, dtype: DataType, name: str = "Const") -> "Node":
        """A ``Const`` node holding ``value`` as ``dtype`` (one node per distinct constant)."""
        array, key = const_array(value, dtype)
        node = self._consts.get(key)
        if node is None:
            node = self._consts[key] = self.op("Const", [], name=name, dtype=type_attr(dtype),
                                               value=array_attr(array, key), shapes=[list(array.shape)])
        return node

    def ret(self, name: str, ref: Union[TensorRef, str], dtype: DataType) -> None:
        """Add output ``name`` of type ``dtype``, the tensor ``ref``."""
        s = ref if type(ref) is str else str(ref)
        if s not in self._valid:
            self._check(s, f"output {name!r} is {s!r}")
        self._header.signature.output_arg.add(name=name, type=dtype)
        self._header.ret[name] = s

    def control_ret(self, node: "Node") -> None:
        """Make ``node`` a control output (it runs whenever the function does)."""
        self._header.signature.control_output.append(node.name)
        self._header.control_ret[node.name] = node.name

    def finish(self) -> function_pb2.FunctionDef:
        """The written function. One written only through :meth:`op` is recorded as valid (see
        :func:`remember_valid`: every reference was checked as it was written); one that had
        nodes before is verified."""
        fdef = self._header if self._in_place else self.to_function_def()
        if self._built:
            remember_valid(fdef, self.library, self.op_types().values())
        else:
            verify_function_def(fdef, self.library)
        return fdef

    def outline(self, name: str, outputs: Sequence[Tuple[str, TensorRef]],
                new_args: Sequence[Tuple[str, TensorRef]] = (), keep_args: Optional[Sequence[str]] = None,
                drop: frozenset = frozenset(), side_effects: bool = False,
                into: Optional[function_pb2.FunctionDef] = None) -> function_pb2.FunctionDef:
        """A new function ``name`` computing ``outputs`` from a copy of part of this (verified)
        graph, written into the empty FunctionDef ``into`` when given.

        ``new_args`` turns internal tensors into arguments (everything upstream of them that is
        no longer needed disappears); ``keep_args`` are the original arguments kept, in order;
        nodes in ``drop`` are never kept. With ``side_effects``, stateful nodes (variable
        writes) are kept as control outputs; otherwise only data ancestors of the outputs stay."""
        return _outline(self, name, outputs, new_args, keep_args, drop, side_effects, into)

    # ----------------------------------------------------------------- checks
    def verify(self) -> None:
        """Raise :class:`VerifyError` naming the first broken node or output."""
        args = set(self.arg_names)
        nodes = self.nodes
        # Each input is checked in its parsed form, which the consumer index reuses: a data
        # input of a registered op without list outputs names one of its outputs at index 0;
        # other ops' outputs are looked up in their flat layout; anything that fails takes the
        # slow path that says what is wrong.
        library = self.library
        simple: Dict[str, Optional[Tuple[str, ...]]] = {name: output_names(op, library)
                                                        for name, op in self.op_types().items()}
        # A cycle needs an input read from a node stored later ("back"): exporters and builders
        # write nodes in an order with none or one (TensorFlow's output Identity waits for the
        # NoOp after it), so only those are followed (see _check_acyclic).
        before: set = set()
        back: List[Tuple[str, str]] = []
        for name in nodes:
            for i, (t, ctl) in enumerate(self.inputs(name)):
                p = t.node
                if ctl:  # a control input may name an argument (a custom gradient's waits on its inputs)
                    ok = p in nodes or p in args
                elif t.arg is None:
                    if p in args:
                        continue
                    ok = False
                else:
                    names = simple.get(p, _NOT_PRODUCED)
                    ok = names is not None and names is not _NOT_PRODUCED and t.index == 0 and t.arg in names
                    if not ok and names is None:
                        self.flat_index(t)  # names the missing output or unknown op
                        ok = True
                if not ok:
                    self._checked_input(name, nodes[name].input[i], args)
                if p not in before and p in nodes:
                    back.append((name, p))
            before.add(name)
        for k, v in self._header.ret.items():
            t, _ = parse_input(v)
            if t.node not in args and t.node not in self.nodes:
                raise VerifyError(f"{self.name}: output {k!r} refers to missing {v!r}")
        for k, v in self._header.control_ret.items():
            if v not in self.nodes:
                raise VerifyError(f"{self.name}: control output {k!r} refers to missing node {v!r}")
        names = {a.name for a in self.signature.output_arg}
        if names != set(self._header.ret):
            raise VerifyError(f"{self.name}: outputs {sorted(names)} do not match ret {sorted(self._header.ret)}")
        if back:
            self._check_acyclic(back)

    def _check_acyclic(self, back: List[Tuple[str, str]]) -> None:
        """Raise if the graph has a cycle. ``back``: the (node, input node) pairs where the
        input is stored at or after the node; a cycle has one of them. With a few, each is
        checked on its own: node ``c`` reading ``p`` closes a cycle iff ``p`` reads ``c``
        (transitively), and that walk never needs a node stored before the first ``c`` (it
        could only climb back up through another pair). Otherwise the whole graph is ordered."""
        if len(back) <= 8:
            nodes = self.nodes
            position = {n: i for i, n in enumerate(nodes)}
            low = min(position[c] for c, _ in back)
            for c, p in back:
                seen, stack = {p}, [p]
                while stack:
                    q = stack.pop()
                    if q == c:
                        return self._raise_cycle()
                    for t, _ in self.inputs(q):
                        r = t.node
                        if r not in seen and position.get(r, -1) >= low:
                            seen.add(r)
                            stack.append(r)
            return
        try:
            self.topological_order()
        except nx.NetworkXUnfeasible:
            self._raise_cycle()

    def _raise_cycle(self) -> None:
        cycle = nx.find_cycle(self.to_networkx())
        raise VerifyError(f"{self.name}: cycle through {cycle[0][0]!r}")

    def _checked_input(self, name: str, s: str, args) -> Optional[str]:
        """The node input ``s`` of node ``name`` waits for (None: none), or the error."""
        t, ctl = parse_input(s)
        if t.node in args:
            if t.arg is not None and not ctl:
                raise VerifyError(f"{self.name}: node {name!r} reads argument {s!r} with an output index")
            return None
        if t.node not in self.nodes:
            raise VerifyError(f"{self.name}: node {name!r} input {s!r} refers to a missing node")
        if not ctl:
            self.flat_index(t)  # names the missing output
        return t.node


_NOT_PRODUCED = object()
_NOT_READ = object()


class Node:
    """A node written by :meth:`FunctionGraph.op`; ``node[k]`` is its k-th flat output."""

    __slots__ = ("proto", "name", "op", "_graph", "_refs")

    def __init__(self, graph: FunctionGraph, proto: node_def_pb2.NodeDef, name: str, op: str):
        self.proto, self._graph = proto, graph
        self.name, self.op = name, op  # (what the proto holds, without reading it back)
        self._refs: Optional[List[TensorRef]] = None

    @property
    def ctl(self) -> str:
        """This node as a control input."""
        return "^" + self.name

    def __getitem__(self, k: int) -> TensorRef:
        return self.outputs()[k]

    def outputs(self) -> List[TensorRef]:
        """Every flat output (computed once: nodes can have thousands)."""
        if self._refs is None:
            self._refs = self._graph.outputs(self.name)
            self._graph._valid.update(map(str, self._refs))
        return self._refs


FunctionGraph._node_class = Node


def _stateful(g: FunctionGraph, name: str) -> bool:
    op = g.op_types()[name]
    if op in g.library:
        return g.library[op].signature.is_stateful
    return _registered_stateful(op)


@lru_cache(maxsize=None)
def _registered_stateful(op: str) -> bool:
    od = op_def_registry.get(op)
    return bool(od and od.is_stateful)


def _outline(g: FunctionGraph, name: str, outputs, new_args, keep_args, drop, side_effects,
             into) -> function_pb2.FunctionDef:
    """:meth:`FunctionGraph.outline`."""
    cut = {ref: arg_name for arg_name, ref in new_args}  # these tensors become arguments
    nodes = g.nodes
    roots = [r.node for _, r in outputs if not r.is_function_arg]
    effects: List[str] = []
    if side_effects:
        effects = [n for n in nodes if n not in drop and _stateful(g, n)]
        roots += effects
    kept = list(keep_args) if keep_args is not None else [a.name for a in g.header.signature.input_arg]
    args = set(kept).union(cut.values())
    keep, again = _outline_walk(g, roots, cut, args, drop, side_effects)
    if side_effects:
        effects = [n for n in effects if n in keep]
    defined = keep.union(args)
    # Only the kept nodes are copied (in one call); the inputs of those that read a new
    # argument, or wait for a node left out, are rewritten after.
    header = g.header  # its arguments, outputs and control outputs are replaced below
    fdef = copy_header(header, into, skip=("arg_attr", "ret", "control_ret"))
    order = [n for n in nodes if n in keep]
    fdef.node_def.extend(nodes[n] for n in order)
    _outline_inputs(g, name, fdef, order, again, cut, keep, defined)
    sig = fdef.signature
    sig.name = name
    _outline_args(g, fdef, new_args, kept)
    del sig.output_arg[:]
    for out_name, ref in outputs:
        a = sig.output_arg.add()
        a.name = out_name
        a.type = g.dtype(ref)
        fdef.ret[out_name] = str(ref)
    del sig.control_output[:]
    for n in sorted(effects):
        sig.control_output.append(n)
        fdef.control_ret[n] = n
    sig.is_stateful = True
    if "_input_shapes" in fdef.attr:
        del fdef.attr["_input_shapes"]
    for k, v in fdef.ret.items():
        if parse_input(v)[0].node not in defined:
            raise VerifyError(f"{name}: output {k!r} refers to {v!r}, which was left out")
    return fdef


def _outline_walk(g: FunctionGraph, roots: List[str], cut, args: set, drop, side_effects: bool) -> Tuple[set, set]:
    """The nodes an outlined function keeps, and those of them to look at again.

    Every kept node and output must still find what it reads (``drop`` and ``keep_args`` can
    take it away); output names and acyclicity carry over from ``g``, which was verified.
    One walk up from the roots: data inputs (except the new arguments ``cut``), and control
    inputs with ``side_effects``; a node with an input that may need rewriting (it becomes an
    argument, or waits for a node perhaps left out) or is wrong is looked at again after."""
    nodes = g.nodes
    keep: set = set()
    again: set = set()
    stack = [r for r in roots if r in nodes and r not in drop]
    while stack:
        n = stack.pop()
        if n in keep:
            continue
        keep.add(n)
        for t, ctl in g.inputs(n):
            p = t.node
            if ctl:
                if not side_effects or p not in nodes or p in drop:
                    again.add(n)
                    continue
            elif t in cut:
                again.add(n)
                continue
            elif p not in nodes or p in drop:
                if p not in args:
                    again.add(n)
                continue
            if p not in keep:
                stack.append(p)
    return keep, again


def _outline_inputs(g: FunctionGraph, name: str, fdef: function_pb2.FunctionDef, order: List[str], again: set,
                    cut, keep: set, defined: set) -> None:
    """Rewrite the inputs of the copied nodes (``fdef.node_def``, in ``order``) that were
    looked at again: a tensor cut becomes its new argument, a control input left out goes;
    an input from nowhere in ``defined`` is a ``VerifyError``."""
    for k, n in enumerate(order):
        if n not in again:
            continue
        rewrite = False
        for t, ctl in g.inputs(n):
            if ctl:
                rewrite = rewrite or t.node not in keep
            elif t in cut:
                rewrite = True
            elif t.node not in defined:
                raise VerifyError(f"{name}: node {n!r} input {str(t)!r} refers to a node or argument left out")
        if rewrite:
            inputs = fdef.node_def[k].input
            renamed = [s if ctl else cut.get(t, s) for s, (t, ctl) in zip(inputs, g.inputs(n))
                       if not (ctl and t.node not in keep)]
            del inputs[:]
            inputs.extend(renamed)


def _outline_args(g: FunctionGraph, fdef: function_pb2.FunctionDef, new_args, kept: List[str]) -> None:
    """The arguments of an outlined function: the new ones (their dtype and known shape from
    ``g``), then the ``kept`` arguments of ``g`` with their attributes."""
    header = g.header
    sig = fdef.signature
    old_args = {a.name: (i, a) for i, a in enumerate(header.signature.input_arg)}
    arg_attr = header.arg_attr
    del sig.input_arg[:]
    for arg_name, ref in new_args:
        a = sig.input_arg.add()
        a.name = arg_name
        a.type = g.dtype(ref)
        shape = g.shape(ref)
        if shape is not None:
            attr = fdef.arg_attr[len(sig.input_arg) - 1].attr["_output_shapes"].list.shape.add()
            for d in shape:
                attr.dim.add().size = d
    for arg_name in kept:
        i, a = old_args[arg_name]
        sig.input_arg.add().CopyFrom(a)
        if i in arg_attr:
            fdef.arg_attr[len(sig.input_arg) - 1].CopyFrom(arg_attr[i])


def verify_function_def(fdef: function_pb2.FunctionDef,
                        library: Optional[Mapping[str, function_pb2.FunctionDef]] = None) -> None:
    """``FunctionGraph(fdef, library).verify()`` without copying ``fdef``, skipped when these
    exact bytes were found valid before (see :func:`remember_valid`)."""
    library = library or {}
    key = _digest(fdef)
    calls = _VALID.get(key)
    if calls is not None and all(name in library and _digest(library[name].signature) == sig for name, sig in calls):
        return
    g = FunctionGraph.over(fdef, library)
    g.verify()
    remember_valid(fdef, library, g.op_types().values(), key)


# Functions known to be valid, by the SHA-256 of their serialized bytes: what verify found, and
# what FunctionBuilder made (it checks every reference as it writes it). Each entry holds the
# signatures of the library functions the function calls as ops, which its output references
# depend on. Hashing a function costs a few percent of verifying it; a pipeline verifies the
# functions its passes built once more at the end, and a function it changed is checked again.
_VALID: Dict[bytes, Tuple[Tuple[str, bytes], ...]] = {}
_VALID_LIMIT = 4096


def _digest(message) -> bytes:
    return hashlib.sha256(message.SerializeToString(deterministic=True)).digest()


def remember_valid(fdef: function_pb2.FunctionDef, library: Mapping[str, function_pb2.FunctionDef],
                   ops: Iterable[str], key: Optional[bytes] = None) -> None:
    """Record ``fdef`` (whose nodes have the op types ``ops``) as valid against ``library``."""
    if len(_VALID) >= _VALID_LIMIT:
        _VALID.clear()
    _VALID[key or _digest(fdef)] = tuple((op, _digest(library[op].signature)) for op in sorted(set(ops))
                                         if op in library)
