"""Writing functions with the IR: typed references, checked insertion, editing a function in
place, constants, and the building blocks; each result loads in TensorFlow and computes."""
import numpy as np
import pytest
from google.protobuf import text_format
from tensorflow.core.framework import function_pb2, types_pb2

from vfgraph.errors import VerifyError
from vfgraph.ir.attrs import type_attr
from vfgraph.ir.blocks import I32, batch_size, slice_rows, zeros
from vfgraph.ir.graph import FunctionGraph, TensorRef, verify_function_def

F32 = types_pb2.DT_FLOAT
SQUARE = """
signature { name: "square" input_arg { name: "x" type: DT_FLOAT } output_arg { name: "y" type: DT_FLOAT } }
node_def { name: "sq" op: "Square" input: "x" attr { key: "T" value { type: DT_FLOAT } } }
ret { key: "y" value: "sq:y:0" }
"""


def _run(fdef, library, *args):
    """Call ``fdef`` (with ``library``'s functions) through TensorFlow's function runtime."""
    import tensorflow as tf
    from tensorflow.core.framework import attr_value_pb2, graph_pb2

    gd = graph_pb2.GraphDef()
    for f in list(library.values()) + [fdef]:
        gd.library.function.add().CopyFrom(f)
    with tf.Graph().as_default() as graph:
        tf.graph_util.import_graph_def(gd, name="")
        feeds = [tf.constant(a) for a in args]
        outs = tf.raw_ops.PartitionedCall(args=feeds, Tout=[o.type for o in fdef.signature.output_arg],
                                          f=attr_value_pb2.NameAttrList(name=fdef.signature.name))
        with tf.compat.v1.Session(graph=graph) as sess:
            return sess.run(outs)


def test_written_references_are_typed_and_every_one_is_checked():
    g = FunctionGraph.new("f", {})
    x = g.arg("x", F32, shape=[-1, 3])
    assert x == TensorRef("x") and str(x) == "x"
    relu = g.op("Relu", [x], T=type_attr(F32))
    assert relu[0] == TensorRef("Relu", "activations", 0) and relu.ctl == "^Relu"
    again = g.op("Relu", [relu[0]], deps=[relu], T=type_attr(F32))
    assert again.name == "Relu_1" and list(again.proto.input) == ["Relu:activations:0", "^Relu"]
    for bad in (TensorRef("Relu", "output", 0), "Relu:activations:1", "x:0", "Relu", "later:z:0"):
        with pytest.raises(KeyError, match="is not an argument or an output of a node written before"):
            g.op("Identity", [bad], T=type_attr(F32))
    with pytest.raises(KeyError, match="op 'NoSuchOp' is not registered"):
        g.op("NoSuchOp", [x])
    g.ret("y", again[0], F32)
    fdef = g.finish()
    assert fdef is g.fdef and fdef.ret["y"] == "Relu_1:activations:0"
    verify_function_def(fdef, {})
    assert fdef.signature.is_stateful  # (written functions are, unless told otherwise)


def test_a_function_written_like_another_calls_it_and_computes():
    library = {"square": text_format.Parse(SQUARE, function_pb2.FunctionDef())}
    header = text_format.Parse('signature { name: "twice" input_arg { name: "x" type: DT_FLOAT } }',
                               function_pb2.FunctionDef())
    g, (x,) = FunctionGraph.like(header, library)
    call = g.op("square", [x], name="call")  # a library function as an op: its outputs by name
    assert call[0] == TensorRef("call", "y", 0)
    two = g.const(2.0, F32, "two")
    assert g.const(2.0, F32, "other") is two  # one node per distinct constant
    g.ret("y", g.op("Mul", [call[0], two[0]], T=type_attr(F32))[0], F32)
    out = _run(g.finish(), library, np.array([1.0, 3.0], np.float32))
    np.testing.assert_allclose(out[0], [2.0, 18.0])


def test_building_blocks_compute_what_they_say():
    g = FunctionGraph.new("blocks", {})
    x = g.arg("x", F32)
    start = g.arg("start", I32)
    n = batch_size(g, x, F32)
    rows = slice_rows(g, start, g.const(2, I32, "two")[0])
    z = zeros(g, [2], F32)
    assert zeros(g, [2], F32) == z  # one per shape and type
    g.ret("n", n, I32)
    g.ret("rows", rows(x, F32), F32)
    g.ret("zeros", z, F32)
    out = _run(g.finish(), {}, np.arange(10, dtype=np.float32).reshape(5, 2), np.int32(1))
    assert out[0] == 5
    np.testing.assert_array_equal(out[1], [[2, 3], [4, 5]])
    np.testing.assert_array_equal(out[2], [0, 0])


def test_editing_a_function_in_place_names_new_nodes_apart_and_verifies_the_result():
    fdef = text_format.Parse(SQUARE, function_pb2.FunctionDef())
    g = FunctionGraph.over(fdef, {})
    sq = g.op("Square", [TensorRef("sq", "y", 0)], name="sq", T=type_attr(F32))  # reads a node it did not write
    assert sq.name == "sq_1" and [n.name for n in fdef.node_def] == ["sq", "sq_1"]
    g.replace_uses({TensorRef("sq", "y", 0): sq[0]})  # the output, and sq_1's own input...
    assert fdef.ret["y"] == "sq_1:y:0"
    with pytest.raises(VerifyError, match="cycle through"):  # ...which now reads itself: finish() verifies
        g.finish()
    fdef.node_def[1].input[0] = "sq:y:0"
    g._inputs_cache.clear()
    assert g.finish() is fdef
    np.testing.assert_allclose(_run(fdef, {}, np.float32(3.0))[0], 81.0)


def test_a_copied_graph_writes_into_its_own_nodes():
    fdef = text_format.Parse(SQUARE, function_pb2.FunctionDef())
    before = fdef.SerializeToString()
    g = FunctionGraph(fdef, {})
    g.op("NoOp", deps=["sq"], name="after")
    with pytest.raises(TypeError, match="a copied graph has no FunctionDef of its own"):
        g.fdef
    out = g.finish()
    assert [n.name for n in out.node_def] == ["sq", "after"] and fdef.SerializeToString() == before
