"""The graph algorithms the training-step cut rests on, against networkx on small generated
graphs: Dinic's maximum flow and its residual network, and the immediate dominators (the
O(log depth) common-ancestor walk on DAGs, networkx's general algorithm on cyclic graphs)."""
import networkx as nx
from hypothesis import given, settings
from hypothesis import strategies as st

from vfgraph.analysis.train_step import _FlowGraph, _max_flow, add_flow_edge


@st.composite
def networks(draw):
    n = draw(st.integers(2, 9))
    edges = draw(st.lists(st.tuples(st.integers(0, n - 1), st.integers(0, n - 1), st.integers(1, 5)),
                          max_size=30))
    return n, [(u, v, c) for u, v, c in edges if u != v]


@settings(max_examples=200, derandomize=True, database=None)
@given(networks())
def test_max_flow_equals_networkx(net):
    n, edges = net
    adj, to, cap = [[] for _ in range(n)], [], []
    g = nx.DiGraph()
    g.add_nodes_from(range(n))
    for u, v, c in edges:
        add_flow_edge(adj, to, cap, u, v, c)
        g.add_edge(u, v, capacity=g[u][v]["capacity"] + c if g.has_edge(u, v) else c)
    flow = _max_flow(n, adj, to, cap)
    assert flow == nx.maximum_flow_value(g, 0, 1)
    # the residual network separates the sink: what 0 still reaches is a minimum cut's source side
    reach, stack = {0}, [0]
    while stack:
        u = stack.pop()
        for e in adj[u]:
            if cap[e] > 0 and to[e] not in reach:
                reach.add(to[e])
                stack.append(to[e])
    assert 1 not in reach
    assert sum(c for u, v, c in edges if u in reach and v not in reach) == flow


def dominators(n, edges):
    fg = object.__new__(_FlowGraph)  # only the adjacency the dominator walk reads
    fg.keys = list(range(n))
    fg.succ = [[] for _ in range(n)]
    fg.pred = [[] for _ in range(n)]
    for u, v in edges:
        fg.succ[u].append(v)
        fg.pred[v].append(u)
    return fg._immediate_dominators()


@st.composite
def graphs(draw, acyclic):
    n = draw(st.integers(1, 14))
    pairs = draw(st.lists(st.tuples(st.integers(0, n - 1), st.integers(0, n - 1)), max_size=40))
    edges = sorted({(min(u, v), max(u, v)) if acyclic else (u, v) for u, v in pairs if u != v})
    return n, edges


@settings(max_examples=200, derandomize=True, database=None)
@given(st.booleans().flatmap(graphs))
def test_immediate_dominators_equal_networkx(graph):
    n, edges = graph
    g = nx.DiGraph()
    g.add_nodes_from(range(n))
    g.add_edges_from(edges)
    want = nx.immediate_dominators(g, 0)
    want[0] = 0  # the source dominates itself (networkx >= 3.5 leaves it out)
    assert dominators(n, edges) == want


def test_dominators_of_a_diamond_and_a_chain():
    # 0 -> 1 -> 3, 0 -> 2 -> 3, 3 -> 4: 3's dominator is the source, 4's is 3
    assert dominators(5, [(0, 1), (0, 2), (1, 3), (2, 3), (3, 4)]) == {0: 0, 1: 0, 2: 0, 3: 0, 4: 3}
    assert dominators(4, [(0, 1), (1, 2), (2, 3)]) == {0: 0, 1: 0, 2: 1, 3: 2}
    assert dominators(3, [(1, 2)]) == {0: 0}  # unreachable vertices have none
