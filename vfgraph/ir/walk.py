"""Walks over the inputs of a graph's nodes, given as a ``name -> NodeDef`` mapping (a
GraphDef's nodes, as the loaders hold them before a graph becomes functions).

:func:`walk` is the one ancestor search (what a set of nodes depends on); :func:`ancestors`
is its set; :func:`topological` orders a whole graph, each node after its inputs. Function
bodies are walked by :class:`vfgraph.ir.graph.FunctionGraph`.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Iterable, Iterator, List, Mapping, Optional, Set, Tuple

from vfgraph.ir.names import data_inputs, tensor_node

if TYPE_CHECKING:
    from tensorflow.core.framework.node_def_pb2 import NodeDef


def inputs_of(node: "NodeDef", data_only: bool = False) -> List[str]:
    """The names of the nodes ``node`` reads, in input order (control inputs too, unless
    ``data_only``)."""
    return [tensor_node(s) for s in (data_inputs(node) if data_only else node.input)]


def walk(nodes: Mapping[str, "NodeDef"], roots: Iterable[str], data_only: bool = False,
         follow: Optional[Callable[["NodeDef"], bool]] = None) -> Iterator[str]:
    """The names ``roots`` reach through node inputs, each once, depth first (the last input
    first). A name is yielded before its inputs are followed, so a caller that raises on it
    stops the walk there. A name not in ``nodes`` is yielded and not followed, nor are the
    inputs of a node for which ``follow(node)`` is false; control inputs are followed unless
    ``data_only``."""
    seen: Set[str] = set()
    stack = list(roots)
    while stack:
        name = stack.pop()
        if name in seen:
            continue
        seen.add(name)
        yield name
        node = nodes.get(name)
        if node is None or (follow is not None and not follow(node)):
            continue
        stack.extend(inputs_of(node, data_only))


def ancestors(nodes: Mapping[str, "NodeDef"], roots: Iterable[str], data_only: bool = False) -> Set[str]:
    """Names of ``roots`` and of every node they depend on, those in ``nodes`` (data and
    control inputs, or data inputs only)."""
    return {n for n in walk(nodes, roots, data_only) if n in nodes}


def topological(nodes: Mapping[str, "NodeDef"]) -> List[str]:
    """Every name of ``nodes`` after the nodes it reads (data and control inputs): a depth
    first walk from each node in the mapping's order, inputs in their order."""
    deps = {name: inputs_of(node) for name, node in nodes.items()}
    seen: Set[str] = set()
    out: List[str] = []
    for root in deps:
        stack: List[Tuple[str, bool]] = [(root, False)]
        while stack:
            n, done = stack.pop()
            if done:
                out.append(n)
                continue
            if n in seen or n not in deps:
                continue
            seen.add(n)
            stack.append((n, True))
            stack.extend((d, False) for d in reversed(deps[n]) if d not in seen)
    return out
