"""Variable writes inside called functions: what a functional op (``If``, ``Case``, ``While``, a
function call) writes, and which of its inputs the written values are computed from.

An optimizer wrapper that applies its update under a condition (a loss-scale optimizer's
finite check, gradient accumulation's every-k-steps apply) writes the variables inside the
branches of an ``If`` that takes the gradients as inputs. To the training step's analysis
that ``If`` is then a write of each variable its functions write, fed by the inputs whose
values reach those writes; the dataflow inside is read from the functions, never from names.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Dict, List, Mapping, Optional, Set

from vfgraph.ir.functions import iter_func_attrs
from vfgraph.ir.graph import FunctionGraph, TensorRef

# Functional ops, and how many of their inputs come before the called functions' first argument
# (an If's condition, a Case's branch index).
_LEADING = {"If": 1, "StatelessIf": 1, "Case": 1, "StatelessCase": 1, "While": 0, "StatelessWhile": 0,
            "PartitionedCall": 0, "StatefulPartitionedCall": 0}
_LOOPS = ("While", "StatelessWhile")


@dataclass
class CallWrites:
    """What one call (or the functions a functional op may run) writes, by argument position."""

    written: Set[int] = field(default_factory=set)          # resource arguments written
    feeds: Dict[int, Set[int]] = field(default_factory=dict)  # argument -> written arguments its value reaches

    def merge(self, other: "CallWrites") -> None:
        self.written |= other.written
        for k, ws in other.feeds.items():
            self.feeds.setdefault(k, set()).update(ws)


def leading_inputs(op: str) -> int:
    """Inputs of functional op ``op`` before its functions' arguments (an If's condition)."""
    return _LEADING[op]


def is_functional(op: str) -> bool:
    return op in _LEADING


class Calls:
    """The variable writes of a function's functional ops, summarised per function (memoised)."""

    def __init__(self, library: Mapping, is_write: Callable[[str], bool],
                 resource_root: Callable[[FunctionGraph, TensorRef], Optional[str]]):
        self.library, self.is_write, self.root = library, is_write, resource_root
        self._memo: Dict[str, CallWrites] = {}

    def of_node(self, g: FunctionGraph, name: str) -> Optional[CallWrites]:
        """What functional node ``name`` of ``g`` writes, by its input positions (None: it
        writes nothing, or it is not a functional op)."""
        node = g.nodes[name]
        if not is_functional(node.op):
            return None
        out = CallWrites()
        for f in iter_func_attrs(node, None):
            if f.name in self.library:
                out.merge(self.of_function(f.name))
        if not out.written:
            return None
        lead = leading_inputs(node.op)
        written = {w + lead for w in out.written}
        if node.op in _LOOPS:  # a loop carries values from one argument to another: any may reach any write
            feeds = {k: set(written) for k in range(len(g.data_inputs(name)))}
        else:
            feeds = {k + lead: {w + lead for w in ws} for k, ws in out.feeds.items()}
        return CallWrites(written, feeds)

    def of_function(self, fname: str) -> CallWrites:
        """What library function ``fname`` writes (its own writes and its calls'), and which
        of its arguments reach each write (through data edges, and through reading back a
        variable a reached write wrote: an optimizer's slot, then the parameter)."""
        done = self._memo.get(fname)
        if done is not None:
            return done
        self._memo[fname] = CallWrites()  # (a recursive call writes nothing more)
        g = FunctionGraph.over(self.library[fname], self.library)
        index = {a: i for i, a in enumerate(g.arg_names)}
        # node -> {input position -> written argument positions}; a plain write: its value inputs
        writes_at: Dict[str, Dict[int, Set[int]]] = {}
        written: Set[int] = set()
        reads: Dict[int, List[TensorRef]] = {}
        for name, node in g.nodes.items():
            inputs = g.data_inputs(name)
            if node.op == "ReadVariableOp":
                r = self.root(g, inputs[0])
                if r in index:
                    reads.setdefault(index[r], []).extend(g.outputs(name))
            elif self.is_write(node.op) and inputs:
                r = self.root(g, inputs[0])
                if r in index:
                    written.add(index[r])
                    writes_at[name] = {k: {index[r]} for k in range(1, len(inputs))}
            else:
                inner = self.of_node(g, name)
                if inner is not None:
                    mine = {w: index.get(self.root(g, inputs[w])) for w in inner.written}
                    written.update(i for i in mine.values() if i is not None)
                    writes_at[name] = {k: {mine[w] for w in ws if mine[w] is not None}
                                       for k, ws in inner.feeds.items()}
        feeds = {k: _reached(g, TensorRef(a), writes_at, reads) for a, k in index.items()}
        self._memo[fname] = CallWrites(written, {k: ws for k, ws in feeds.items() if ws})
        return self._memo[fname]


def _reached(g: FunctionGraph, start: TensorRef, writes_at: Dict[str, Dict[int, Set[int]]],
             reads: Dict[int, List[TensorRef]]) -> Set[int]:
    """The written arguments whose writes ``start``'s value reaches in ``g``."""
    found: Set[int] = set()
    seen = {start}
    stack = [start]
    while stack:
        t = stack.pop()
        for consumer, slot in g.consumers(t):
            for w in writes_at.get(consumer, {}).get(slot, ()):
                if w not in found:
                    found.add(w)
                    stack.extend(r for r in reads.get(w, ()) if r not in seen)
                    seen.update(reads.get(w, ()))
            outs = g.outputs(consumer)
            if g.nodes[consumer].op == "IdentityN":  # output k passes on input k only
                outs = [outs[slot]]
            for o in outs:
                if o not in seen:
                    seen.add(o)
                    stack.append(o)
    return found
