"""FunctionGraph.verify on small hand-written FunctionDefs: what it accepts and what it names."""
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
    from vfgraph.builder import extract_function
    from vfgraph.ir.graph import TensorRef, verify_function_def

    g = graph(GOOD)
    out = extract_function(g, "f_b", [("y", TensorRef("b", "z", 0))],
                           new_args=[("a_value", TensorRef("a", "activations", 0))])
    verify_function_def(out, {})
    assert [n.name for n in out.node_def] == ["b"]  # a is now an argument; c only ordered b
    assert list(out.node_def[0].input) == ["a_value", "x"]
    with pytest.raises(VerifyError, match="node 'a' input 'x' refers to a node or argument left out"):
        extract_function(g, "f_b", [("y", TensorRef("b", "z", 0))], keep_args=[])
    with pytest.raises(VerifyError, match="node 'b' input 'a:activations:0' refers to a node or argument left out"):
        extract_function(g, "f_b", [("y", TensorRef("b", "z", 0))], drop=frozenset({"a"}))


def test_a_read_only_graph_copies_headers_without_nodes_and_extracts_in_place():
    from vfgraph.builder import extract_function
    from vfgraph.ir.graph import TensorRef, copy_header

    text = (GOOD + 'attr { key: "_noinline" value { b: true } }\n'
            'arg_attr { key: 0 value { attr { key: "k" value { i: 1 } } } }')
    fdef = text_format.Parse(text, function_pb2.FunctionDef())
    before = fdef.SerializeToString()
    header = copy_header(fdef)
    assert not header.node_def and header.signature == fdef.signature and header.ret == fdef.ret
    assert header.attr == fdef.attr and header.arg_attr == fdef.arg_attr
    g = FunctionGraph._over(fdef, {})  # over fdef itself: a round trip has each node once
    assert g.to_function_def().SerializeToString() == before
    into = function_pb2.FunctionDef()
    out = extract_function(g, "f_b", [("y", TensorRef("b", "z", 0))],
                           new_args=[("a_value", TensorRef("a", "activations", 0))], into=into)
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
    g = FunctionGraph._over(fdef, {})
    g.verify()
    assert g.dtype(g.outputs("shape")[0]) == types_pb2.DT_INT32
    assert [g.dtype(t) for t in g.outputs("n")] == [types_pb2.DT_FLOAT, types_pb2.DT_INT32]
    assert fdef.SerializeToString(deterministic=True) == before


def _built(extra=None):
    """A FunctionBuilder function: Relu(x), then AddV2 of it and x; ``extra`` adds one more node."""
    from tensorflow.core.framework import types_pb2

    from vfgraph.builder import FunctionBuilder, type_attr

    f32 = type_attr(types_pb2.DT_FLOAT)
    fb = FunctionBuilder("built", {})
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
def test_the_builder_refuses_what_verify_refuses(inputs, deps):
    """What a builder writes is valid by construction (so verify may skip it): each reference it
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
        FunctionGraph._over(fdef, {}).verify()


def test_functions_are_verified_again_once_changed():
    """verify_function_def skips bytes known valid (built, or verified before), and checks a
    function again once a node in it, or the signature of a function it calls, changed."""
    from vfgraph.ir.graph import verify_function_def

    fdef = _built()
    verify_function_def(fdef, {})  # made by the builder: known valid
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


@pytest.fixture(scope="module")
def silu_mlp(tmp_path_factory):
    """A Keras MLP with SiLU activations: tf.nn.silu's custom gradient keeps forward tensors as
    captured tensors of the training function in the object graph."""
    import keras
    import tensorflow as tf

    import export

    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(16, activation="silu"), keras.layers.Dense(10)])
    out = str(tmp_path_factory.mktemp("silu") / "m")
    specs = {"x": tf.TensorSpec([None, 64], tf.float32, name="x"), "y": tf.TensorSpec([None], tf.int32, name="y")}
    m = export.build_module(model, specs, "sgd", 0.05, export.sparse_ce)
    tf.saved_model.save(m, out, signatures={"train": m.train, "serving_default": m.serve})
    return out


def _captured(item):
    return [n.captured_tensor for n in item.meta_graph.object_graph_def.nodes
            if n.WhichOneof("kind") == "captured_tensor"]


def test_captured_tensors_follow_the_nodes_a_rewrite_moves(silu_mlp, tmp_path):
    """split-vnodes moves the training function's nodes into the virtual-node function and
    microbatch-inference the serving function's into its slice function: the object graph's
    captured tensors are relinked, and the output loads in a fresh process."""
    import subprocess
    import sys

    import vfgraph

    item = vfgraph.rewrite(silu_mlp, vnodes=2, vnode_batch=4)
    caps = _captured(item)
    assert caps, "the model has no captured tensors: the test checks nothing"
    lib = item.library
    for ct in caps:
        assert ct.name.rsplit(":", 1)[0] in {n.name for n in lib[ct.concrete_function].node_def}, ct
    assert any(ct.concrete_function.startswith("__vf_") for ct in caps)
    out = vfgraph.save(item, str(tmp_path / "v2"))
    code = f"import vfgraph, tensorflow as tf; m = tf.saved_model.load({out!r}); print(sorted(m.signatures))"
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr[-2000:]


def test_verify_refuses_what_the_loader_would(silu_mlp):
    """A captured tensor whose node is gone, or a concrete function missing from the library,
    is what makes tf.saved_model.load fail: verify names it."""
    import vfgraph

    item = vfgraph.load(silu_mlp)
    vfgraph.verify(item)
    _captured(item)[0].name = "no_such_node:0"
    with pytest.raises(VerifyError, match="captures tensor 'no_such_node:0'"):
        vfgraph.verify(item)
    item = vfgraph.load(silu_mlp)
    name = sorted(item.meta_graph.object_graph_def.concrete_functions)[0]
    lib = item.meta_graph.graph_def.library.function
    del lib[[f.signature.name for f in lib].index(name)]
    with pytest.raises(VerifyError, match="not in the library"):
        vfgraph.verify(item)
