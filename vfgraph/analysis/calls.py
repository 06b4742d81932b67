"""Variable writes inside called functions: what a functional op (``If``, ``Case``, ``While``, a
function call) writes, and which of its inputs each written value is nearest to.

An optimizer wrapper that applies its update under a condition (a loss-scale optimizer's
finite check, gradient accumulation's every-k-steps apply) writes the variables inside the
branches of an ``If`` that takes the gradients as inputs. To the training step's analysis
that ``If`` is then a write of each variable its functions write; which gradient each write
belongs to is the input nearest to it, counting the ops before the call and inside it (a
global-norm clip makes every gradient reach every write, each at a longer distance than its
own). A sparse update inside (an embedding's rows applied under the condition) names the
inputs that are its rows and indices. The dataflow inside is read from the functions, never
from names.
"""
from __future__ import annotations

import heapq
from typing import Callable, Dict, Hashable, List, Mapping, Optional, Set, Tuple

from vfgraph.ir.functions import iter_func_attrs
from vfgraph.ir.graph import FunctionGraph, TensorRef

# Functional ops, and how many of their inputs come before the called functions' first argument
# (an If's condition, a Case's branch index).
_LEADING = {"If": 1, "StatelessIf": 1, "Case": 1, "StatelessCase": 1, "While": 0, "StatelessWhile": 0,
            "PartitionedCall": 0, "StatefulPartitionedCall": 0}
_LOOPS = ("While", "StatelessWhile")
_FAR = 1 << 30

Seeds = Dict[int, Tuple[int, Hashable]]  # input (or argument) position -> (distance, label)
Pair = Tuple[int, int]


def leading_inputs(op: str) -> int:
    """Inputs of functional op ``op`` before its functions' arguments (an If's condition)."""
    return _LEADING[op]


def is_functional(op: str) -> bool:
    return op in _LEADING


class Calls:
    """The variable writes of functional ops, read from the functions they call (memoised)."""

    def __init__(self, library: Mapping, is_write: Callable[[str], bool],
                 resource_root: Callable[[FunctionGraph, TensorRef], Optional[str]]):
        self.library, self.is_write, self.root = library, is_write, resource_root
        self._written: Dict[str, Set[int]] = {}
        self._graphs: Dict[str, FunctionGraph] = {}

    def _graph(self, fname: str) -> FunctionGraph:
        g = self._graphs.get(fname)
        if g is None:
            g = self._graphs[fname] = FunctionGraph.over(self.library[fname], self.library)
        return g

    def _called(self, node) -> List[str]:
        return [f.name for f in iter_func_attrs(node, None) if f.name in self.library]

    def written(self, g: FunctionGraph, name: str) -> Set[int]:
        """The input positions of functional node ``name`` whose resources its functions write
        (empty: it writes none, or it is not a functional op)."""
        node = g.nodes[name]
        if not is_functional(node.op):
            return set()
        lead = leading_inputs(node.op)
        return {a + lead for f in self._called(node) for a in self._written_args(f)}

    def _written_args(self, fname: str) -> Set[int]:
        done = self._written.get(fname)
        if done is not None:
            return done
        self._written[fname] = set()  # (a recursive call writes nothing more)
        g = self._graph(fname)
        index = {a: i for i, a in enumerate(g.arg_names)}
        out = set()
        for name, node in g.nodes.items():
            inputs = g.data_inputs(name)
            if self.is_write(node.op) and inputs:
                out.add(index.get(self.root(g, inputs[0])))
            else:
                out.update(index.get(self.root(g, inputs[w])) for w in self.written(g, name))
        out.discard(None)
        self._written[fname] = out
        return out

    def nearest(self, g: FunctionGraph, name: str, seeds: Seeds) -> Seeds:
        """For each input position of functional node ``name`` whose resource it writes, the
        label of the seed nearest to a write of it and the distance (the seed's own plus the
        ops inside); ``seeds``: the labelled values arriving at its input positions."""
        node = g.nodes[name]
        lead = leading_inputs(node.op)
        found: Seeds = {}
        if node.op in _LOOPS:  # a loop carries values from one argument to another: any may reach any write
            best = min(seeds.values(), key=lambda s: s[0], default=None)
            return {w: (best[0] + 1, best[1]) for w in self.written(g, name)} if best else {}
        args = {k - lead: s for k, s in seeds.items() if k >= lead}
        for f in self._called(node):
            for a, (d, label) in self._nearest_in(f, args).items():
                if d < found.get(a + lead, (_FAR,))[0]:
                    found[a + lead] = (d, label)
        return found

    def _nearest_in(self, fname: str, seeds: Seeds) -> Seeds:
        """In function ``fname``, from seeded arguments: for each written argument, the nearest
        seed to one of its writes (through data edges, a variable read back after a reached write
        of it, an optimizer's slot then the parameter, and into calls; a variable a call writes
        is not followed to its reads after the call)."""
        g = self._graph(fname)
        index = {a: i for i, a in enumerate(g.arg_names)}
        reads: Dict[int, List[TensorRef]] = {}
        for name in g.nodes_of("ReadVariableOp"):
            r = index.get(self.root(g, g.data_inputs(name)[0]))
            if r is not None:
                reads.setdefault(r, []).extend(g.outputs(name))
        found: Seeds = {}
        calls: Dict[str, Seeds] = {}  # functional nodes reached: their own seeds
        best: Dict[TensorRef, int] = {}
        queue: List[tuple] = []

        def push(d: int, t: TensorRef, label) -> None:
            if d < best.get(t, _FAR):
                best[t] = d
                heapq.heappush(queue, (d, str(t), t, label))

        def wrote(a: Optional[int], d: int, label) -> None:
            if a is not None and d < found.get(a, (_FAR,))[0]:
                found[a] = (d, label)
                for r in reads.get(a, ()):
                    push(d + 1, r, label)

        for a, (d, label) in sorted(seeds.items()):
            if a < len(g.arg_names):
                push(d, TensorRef(g.arg_names[a]), label)
        while queue:
            d, _, t, label = heapq.heappop(queue)
            if d > best[t]:
                continue
            for consumer, slot in g.consumers(t):
                op = g.nodes[consumer].op
                if self.is_write(op) and slot > 0:
                    wrote(index.get(self.root(g, g.data_inputs(consumer)[0])), d + 1, label)
                elif is_functional(op) and slot not in calls.get(consumer, {}) and self.written(g, consumer):
                    calls.setdefault(consumer, {})[slot] = (d, label)
                outs = g.outputs(consumer)
                if op == "IdentityN":  # output k passes on input k only
                    outs = [outs[slot]]
                for o in outs:
                    push(d + 1, o, label)
        for name, inner in sorted(calls.items()):
            inputs = g.data_inputs(name)
            for w, (d, label) in sorted(self.nearest(g, name, inner).items()):
                wrote(index.get(self.root(g, inputs[w])), d, label)
        return found

    def sparse_inputs(self, g: FunctionGraph, name: str, roles: Callable[[FunctionGraph, str], Optional[Pair]],
                      rowwise: Set[str], index_pass: Set[str]) -> List[Pair]:
        """The (values, indices) input positions of functional node ``name`` that a sparse update
        inside its functions (``roles``: the values and indices inputs of a sparse op, or None)
        reads as rows and their indices, through ops ``rowwise`` (values) and ``index_pass``."""
        node = g.nodes[name]
        lead = leading_inputs(node.op) if is_functional(node.op) else 0
        found = set()
        for f in self._called(node):
            fg = self._graph(f)
            index = {a: i for i, a in enumerate(fg.arg_names)}
            for n in fg.nodes:
                pairs = [] if roles(fg, n) is None else [roles(fg, n)]
                if is_functional(fg.nodes[n].op) and self.written(fg, n):
                    pairs += self.sparse_inputs(fg, n, roles, rowwise, index_pass)
                inputs = fg.data_inputs(n)
                for v, i in pairs:
                    a, b = _arg_behind(fg, inputs[v], rowwise), _arg_behind(fg, inputs[i], index_pass)
                    if a is not None and b is not None:
                        found.add((index[a] + lead, index[b] + lead))
        return sorted(found)


def _arg_behind(g: FunctionGraph, ref: TensorRef, through: Set[str]) -> Optional[str]:
    """The argument ``ref`` is computed from through ops ``through`` along their one input that
    is not a scalar (a learning rate or a loss scale); None when there is none or no such path."""
    while not ref.is_function_arg:
        if g.nodes[ref.node].op not in through:
            return None
        rows = [t for t in g.data_inputs(ref.node) if g.shape(t) != []]
        if len(rows) != 1:
            return None
        ref = rows[0]
    return ref.node
