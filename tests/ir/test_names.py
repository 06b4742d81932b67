"""What a reference names (vfgraph.ir.names), and the walks over a graph's node inputs
(vfgraph.ir.walk): one reading of GraphDef inputs, FunctionDef inputs and signature tensor
names for every loader."""
import pytest
from tensorflow.core.framework import node_def_pb2

from vfgraph.ir.graph import parse_input
from vfgraph.ir.names import (control_inputs, data_inputs, function_name, is_control, is_tensor_name, tensor_index,
                              tensor_name, tensor_node)
from vfgraph.ir.walk import ancestors, inputs_of, topological, walk

REFS = ["a", "a:0", "a:3", "^a", "a:out:0", "a:out:2", "scope/a_1", "scope/a_1:1", "^scope/a_1"]


def _node(name, *inputs, op="Identity"):
    return node_def_pb2.NodeDef(name=name, op=op, input=list(inputs))


def _graph(**inputs):
    """name -> NodeDef in the order given: _graph(b=["a"]) is a node b reading a."""
    return {name: _node(name, *ins) for name, ins in inputs.items()}


def test_function_name_is_letters_digits_underscores():
    assert function_name("train", "vnode/0", "") == "__vf_train_vnode_0"


@pytest.mark.parametrize("ref", REFS)
def test_tensor_node_agrees_with_parse_input(ref):
    tensor, control = parse_input(ref)
    assert tensor_node(ref) == tensor.node
    assert is_control(ref) is control


def test_tensor_node_of_each_form():
    assert [tensor_node(r) for r in REFS] == ["a", "a", "a", "a", "a", "a", "scope/a_1", "scope/a_1", "scope/a_1"]


def test_tensor_index_and_name_of_graph_tensors():
    assert [tensor_index(n) for n in ("a", "a:0", "a:3", "scope/a_1:12")] == [0, 0, 3, 12]
    assert [tensor_name(n) for n in ("a", "a:0", "a:3")] == ["a:0", "a:0", "a:3"]
    with pytest.raises(ValueError):
        tensor_index("a:out:0")  # a FunctionDef reference, not a GraphDef tensor name


def test_is_tensor_name():
    assert all(is_tensor_name(n) for n in ("a", "a:0", "scope/a_1:12"))
    assert not any(is_tensor_name(n) for n in ("", "^a", "a:", "a:out:0", "a:x", ":0"))
    assert is_tensor_name("a:0", indexed=True) and not is_tensor_name("a", indexed=True)


def test_data_and_control_inputs_keep_their_order():
    node = _node("n", "b:1", "a", "^d", "c:out:0", "^c")
    assert data_inputs(node) == ["b:1", "a", "c:out:0"]
    assert control_inputs(node) == ["^d", "^c"]
    assert inputs_of(node) == ["b", "a", "d", "c", "c"]
    assert inputs_of(node, data_only=True) == ["b", "a", "c"]


def test_walk_is_depth_first_each_name_once_missing_names_yielded():
    nodes = _graph(a=[], b=["a"], c=["a", "b:0", "^missing"], d=["c:1", "^b"])
    assert list(walk(nodes, ["d"])) == ["d", "b", "a", "c", "missing"]
    assert list(walk(nodes, ["d"], data_only=True)) == ["d", "c", "b", "a"]
    assert ancestors(nodes, ["d"]) == {"a", "b", "c", "d"}  # names not in the graph left out
    assert ancestors(nodes, ["b", "gone"]) == {"a", "b"}
    assert ancestors(nodes, []) == set()


def test_walk_does_not_follow_what_follow_refuses():
    nodes = _graph(x=[], w=[], y=["x", "w"], z=["y"])
    nodes["x"].op = "Placeholder"
    nodes["x"].input.append("^w")  # never followed: x is a stop
    reached = list(walk(nodes, ["z"], follow=lambda n: n.op != "Placeholder"))
    assert reached == ["z", "y", "w", "x"]
    assert list(walk(nodes, ["z"], follow=lambda n: n.name != "y")) == ["z", "y"]


def test_walk_stops_where_the_caller_raises():
    nodes = _graph(b=["a", "missing"], a=[])
    seen = []
    with pytest.raises(KeyError):
        for name in walk(nodes, ["b"]):
            if name not in nodes:
                raise KeyError(name)
            seen.append(name)
    assert seen == ["b"]  # the last input first: 'missing' before 'a'


def test_topological_puts_inputs_first_in_graph_order():
    nodes = _graph(c=["b", "^a"], b=["a:0"], a=[], d=[], e=["d", "c", "outside"])
    order = topological(nodes)
    assert order == ["a", "b", "c", "d", "e"]
    for n in nodes.values():
        assert all(order.index(i) < order.index(n.name) for i in inputs_of(n) if i in nodes)
    assert topological(_graph(z=["y"], y=[], x=[])) == ["y", "z", "x"]
