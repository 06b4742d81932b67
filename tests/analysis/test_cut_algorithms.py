"""The graph algorithm the training-step cut rests on, against networkx on small generated
graphs: Dinic's maximum flow and its residual network (what the source still reaches in it is
the source side of the minimum cut closest to the source, the one the cut takes)."""
import networkx as nx
from hypothesis import given, settings
from hypothesis import strategies as st

from vfgraph.analysis.train_step import _max_flow, add_flow_edge


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
