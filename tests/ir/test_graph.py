"""The function IR on small hand-written FunctionDefs: what verify accepts and what it names,
outlining, and the checks of writing."""
import pytest
from google.protobuf import text_format
from tensorflow.core.framework import function_pb2

from vfgraph.errors import VerifyError
from vfgraph.ir.graph import FunctionGraph

GOOD = """
signature { name: "f" input_arg { name: "x" type: DT_FLOAT } output_arg { name: "y" type: DT_FLOAT } }
node_def { name: "a" op: "Relu" input: "x" attr { key: "T" value { type: DT_FLOAT } } }
node_def { name: "b" op: "AddV2" input: "a:activations:0" input: "x" input: "^c"
           attr { key: "T" value { type: DT_FLOAT } } }
node_def { name: "c" op: "NoOp" input: "^a" }
ret { key: "y" value: "b:z:0" }
"""


def graph(text: str) -> FunctionGraph:
    return FunctionGraph(text_format.Parse(text, function_pb2.FunctionDef()), {})


def test_a_well_formed_function_verifies():
    graph(GOOD).verify()


def test_a_control_input_on_an_argument_verifies():
    """TensorFlow accepts a node waiting on an argument (tf.custom_gradient's gradient functions
    wait on their incoming gradients: ``^result_grads_0``)."""
    graph(GOOD.replace('input: "^a"', 'input: "^x"')).verify()


@pytest.mark.parametrize("edit, message", [
    (('input: "^a"', 'input: "^b"'), "cycle through"),                       # c waits for b, b for c
    (('input: "^a"', 'input: "^missing"'), "refers to a missing node"),
    (('"a:activations:0"', '"a:activations:1"'), "has no output activations:1"),
    (('"a:activations:0"', '"a:output:0"'), "has no output output:0"),
    (('value: "b:z:0"', 'value: "gone:z:0"'), "output 'y' refers to missing"),
    (('input: "x" attr', 'input: "x:0" attr'), "reads argument 'x:0' with an output index"),
    (('input: "x" attr', 'input: "x:output:0" attr'), "reads argument 'x:output:0' with an output index"),
    (('input: "x" attr', 'input: "a" attr'), "has no output None:0"),            # a node read without an output
    (('op: "Relu"', 'op: "NoSuchOp"'), "'NoSuchOp' is neither a registered op"),
])
def test_broken_functions_name_what_is_wrong(edit, message):
    text = GOOD.replace(*edit)
    assert text != GOOD
    with pytest.raises(VerifyError, match=message):
        graph(text).verify()


def test_extracted_functions_verify_and_name_what_was_left_out():
    from vfgraph.ir.graph import TensorRef, verify_function_def

    g = graph(GOOD)
    out = g.outline("f_b", [("y", TensorRef("b", "z", 0))], new_args=[("a_value", TensorRef("a", "activations", 0))])
    verify_function_def(out, {})
    assert [n.name for n in out.node_def] == ["b"]  # a is now an argument; c only ordered b
    assert list(out.node_def[0].input) == ["a_value", "x"]
    with pytest.raises(VerifyError, match="node 'a' input 'x' refers to a node or argument left out"):
        g.outline("f_b", [("y", TensorRef("b", "z", 0))], keep_args=[])
    with pytest.raises(VerifyError, match="node 'b' input 'a:activations:0' refers to a node or argument left out"):
        g.outline("f_b", [("y", TensorRef("b", "z", 0))], drop=frozenset({"a"}))


def test_a_read_only_graph_copies_headers_without_nodes_and_extracts_in_place():
    from vfgraph.ir.functions import copy_header
    from vfgraph.ir.graph import TensorRef

    text = (GOOD + 'attr { key: "_noinline" value { b: true } }\n'
            'arg_attr { key: 0 value { attr { key: "k" value { i: 1 } } } }')
    fdef = text_format.Parse(text, function_pb2.FunctionDef())
    before = fdef.SerializeToString()
    header = copy_header(fdef)
    assert not header.node_def and header.signature == fdef.signature and header.ret == fdef.ret
    assert header.attr == fdef.attr and header.arg_attr == fdef.arg_attr
    g = FunctionGraph.over(fdef, {})  # over fdef itself: a round trip has each node once
    assert g.to_function_def().SerializeToString() == before
    into = function_pb2.FunctionDef()
    out = g.outline("f_b", [("y", TensorRef("b", "z", 0))], new_args=[("a_value", TensorRef("a", "activations", 0))],
                    into=into)
    assert out is into and [n.name for n in into.node_def] == ["b"] and into.signature.name == "f_b"
    assert fdef.SerializeToString() == before  # the source is read, never changed


def test_new_function_is_an_empty_library_entry_that_replaces_one_of_its_name():
    from tensorflow.core.protobuf import saved_model_pb2

    from vfgraph.item import GraphItem

    sm = saved_model_pb2.SavedModel()
    lib = sm.meta_graphs.add().graph_def.library
    lib.function.add().CopyFrom(text_format.Parse(GOOD, function_pb2.FunctionDef()))
    item = GraphItem("m", "saved_model", sm, {})
    fresh = item.new_function("g")
    fresh.node_def.add(name="n", op="NoOp")  # filled in place: the library holds it
    assert [n.name for n in item.function("g").node_def] == ["n"]
    again = item.new_function("f")
    assert again.signature.name == "f" and not again.node_def and len(lib.function) == 2


def _noop_graph(order, edges) -> FunctionGraph:
    fdef = function_pb2.FunctionDef()
    fdef.signature.name = "f"
    for n in order:
        fdef.node_def.add(name=f"n{n}", op="NoOp", input=[f"^n{p}" for p in sorted(edges.get(n, ()))])
    return FunctionGraph(fdef, {})


def test_cycles_are_found_in_any_node_order():
    """verify raises "cycle through" exactly when networkx finds a cycle, whatever order the
    nodes are stored in (few inputs read from later nodes: one walk each; many: Kahn)."""
    import networkx as nx
    from hypothesis import given, settings, strategies as st

    @settings(max_examples=300, deadline=None)
    @given(st.integers(2, 14).flatmap(lambda n: st.tuples(
        st.permutations(range(n)),
        st.lists(st.tuples(st.integers(0, n - 1), st.integers(0, n - 1)), max_size=3 * n))))
    def check(case):
        order, pairs = case
        edges = {}
        for consumer, producer in pairs:
            edges.setdefault(consumer, set()).add(producer)
        g = _noop_graph(order, edges)
        cyclic = not nx.is_directed_acyclic_graph(g.to_networkx())
        if cyclic:
            with pytest.raises(VerifyError, match="cycle through"):
                g.verify()
        else:
            g.verify()

    check()


def test_output_types_of_attributes_left_at_their_default_and_reading_changes_nothing():
    """Exporters strip attributes at their registered default (Shape's out_type: int32)."""
    from tensorflow.core.framework import types_pb2

    fdef = text_format.Parse("""
        signature { name: "f" input_arg { name: "x" type: DT_FLOAT } output_arg { name: "s" type: DT_INT32 } }
        node_def { name: "shape" op: "Shape" input: "x" attr { key: "T" value { type: DT_FLOAT } } }
        node_def { name: "n" op: "IdentityN" input: "x" input: "shape:output:0"
                   attr { key: "T" value { list { type: DT_FLOAT type: DT_INT32 } } } }
        ret { key: "s" value: "shape:output:0" }
    """, function_pb2.FunctionDef())
    before = fdef.SerializeToString(deterministic=True)
    g = FunctionGraph.over(fdef, {})
    g.verify()
    assert g.dtype(g.outputs("shape")[0]) == types_pb2.DT_INT32
    assert [g.dtype(t) for t in g.outputs("n")] == [types_pb2.DT_FLOAT, types_pb2.DT_INT32]
    assert fdef.SerializeToString(deterministic=True) == before


def _built(extra=None):
    """A written function: Relu(x), then AddV2 of it and x; ``extra`` adds one more node."""
    from tensorflow.core.framework import types_pb2

    from vfgraph.ir.attrs import type_attr

    f32 = type_attr(types_pb2.DT_FLOAT)
    fb = FunctionGraph.new("built", {})
    x = fb.arg("x", types_pb2.DT_FLOAT)
    a = fb.op("Relu", [x], name="a", T=f32)
    b = fb.op("AddV2", [a[0], x], name="b", deps=[a], T=f32)
    if extra:
        extra(fb, f32)
    fb.ret("y", b[0], types_pb2.DT_FLOAT)
    return fb.finish()


@pytest.mark.parametrize("inputs, deps", [
    (["a:output:0"], ()),        # Relu's output is "activations"
    (["a:activations:1"], ()),
    (["x:0"], ()),               # an argument read with an output index
    (["a"], ()),                 # a node read without an output
    (["later:z:0"], ()),         # not written yet: built functions are acyclic
])
def test_writing_refuses_what_verify_refuses(inputs, deps):
    """What op() writes is valid by construction (so verify may skip it): each reference it
    refuses, verify refuses too."""
    from tensorflow.core.framework import types_pb2

    def extra(fb, f32):
        fb.op("Identity", inputs, name="bad", deps=deps, T=f32)

    with pytest.raises(KeyError, match="is not an argument or an output of a node written before"):
        _built(extra)
    fdef = _built()
    bad = fdef.node_def.add(name="bad", op="Identity", input=inputs + ["^" + d for d in deps])
    bad.attr["T"].type = types_pb2.DT_FLOAT
    with pytest.raises(VerifyError):
        FunctionGraph.over(fdef, {}).verify()


def test_functions_are_verified_again_once_changed():
    """verify_function_def skips bytes known valid (built, or verified before), and checks a
    function again once a node in it, or the signature of a function it calls, changed."""
    from vfgraph.ir.graph import verify_function_def

    fdef = _built()
    verify_function_def(fdef, {})  # written through op(): known valid
    fdef.node_def[1].input[0] = "a:output:0"
    with pytest.raises(VerifyError, match="has no output output:0"):
        verify_function_def(fdef, {})
    # A call to library function "g" by op name: its outputs come from g's signature.
    callee = text_format.Parse(GOOD.replace('name: "f"', 'name: "g"'), function_pb2.FunctionDef())
    caller = text_format.Parse("""
        signature { name: "h" input_arg { name: "x" type: DT_FLOAT } output_arg { name: "y" type: DT_FLOAT } }
        node_def { name: "call" op: "g" input: "x" }
        node_def { name: "out" op: "Identity" input: "call:y:0" attr { key: "T" value { type: DT_FLOAT } } }
        ret { key: "y" value: "out:output:0" }
    """, function_pb2.FunctionDef())
    lib = {"g": callee}
    verify_function_def(caller, lib)
    callee.signature.output_arg[0].name = "renamed"
    with pytest.raises(VerifyError, match="has no output y:0"):
        verify_function_def(caller, lib)
