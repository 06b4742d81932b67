"""vfgraph.io.signatures on a tiny SavedModel: signatures added to it load with TensorFlow's
own loaders (the object graph through tf.saved_model.load, the signature map through a TF1
session) and run."""
import numpy as np
import pytest
import tensorflow as tf
from tensorflow.core.framework import types_pb2
from tensorflow.core.protobuf import meta_graph_pb2

import vfgraph
from vfgraph.ir.attrs import func_attr, type_attr, types_attr
from vfgraph.io.signatures import (INIT_OP_KEY, add_graph_signature, add_graph_variables, add_object_variables,
                                   add_signature, entry_header, has_object_graph, signature_wrapper, tensor_info)
from vfgraph.ir.graph import FunctionGraph
from vfgraph.ir.names import function_name

F32 = types_pb2.DT_FLOAT
X = np.array([[1.0, 1.0], [2.0, 3.0]], np.float32)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A SavedModel with one variable v = [1, 2] and signature serving_default: y = x * v."""

    class Tiny(tf.Module):
        def __init__(self):
            super().__init__()
            self.v = tf.Variable([1.0, 2.0])

        @tf.function(input_signature=[tf.TensorSpec([None, 2], tf.float32, name="x")])
        def serve(self, x):
            return {"y": x * self.v}

    path = str(tmp_path_factory.mktemp("tiny") / "model")
    m = Tiny()
    tf.saved_model.save(m, path, signatures={"serving_default": m.serve})
    return path


def _call_inner(fb, item, w, args, **replace):
    """A call of signature ``w``'s library function on ``args`` (in ``w.args`` order), with
    the arguments named in ``replace`` replaced."""
    inner = item.function(item.signatures[w.key].function)
    by = dict(zip(w.args, args), **replace)
    return fb.op("StatefulPartitionedCall", [by[a.name] for a in inner.signature.input_arg], name="call",
                 Tin=types_attr([a.type for a in inner.signature.input_arg]),
                 Tout=types_attr([a.type for a in inner.signature.output_arg]), f=func_attr(inner.signature.name))


def test_wrapper_of_a_tf2_signature(tiny):
    item = vfgraph.load(tiny)
    sig = item.signatures["serving_default"]
    assert has_object_graph(item)
    w = signature_wrapper(item, "serving_default")
    assert w is not None and w.key == "serving_default"
    assert list(w.input_args) == sig.batch_args and list(w.bound_args) == sig.resource_args
    assert w.n_bound == 1 and len(w.outputs) == 1
    node = item.meta_graph.object_graph_def.nodes[w.node_id]
    assert node.bare_concrete_function.concrete_function_name == w.function
    assert signature_wrapper(item, "no_such_signature") is None
    assert "no_such_signature" not in item.meta_graph.signature_def  # (looking adds no entry)


def test_no_wrapper_without_an_object_graph(tiny):
    item = vfgraph.load(tiny)
    item.meta_graph.object_graph_def.Clear()
    assert not has_object_graph(item)
    assert signature_wrapper(item, "serving_default") is None


def test_entry_header_keeps_argument_attributes(tiny):
    item = vfgraph.load(tiny)
    sig = item.signatures["serving_default"]
    g = FunctionGraph.over(item.function(sig.function), item.library)
    header = entry_header(g, "f_0", sig.resource_args + sig.batch_args, ["extra"], ["out"], [F32])
    args = [(a.name, a.type) for a in header.signature.input_arg]
    assert args == [(sig.resource_args[0], types_pb2.DT_RESOURCE), (sig.batch_args[0], F32),
                    ("extra", types_pb2.DT_RESOURCE)]
    index = {a.name: i for i, a in enumerate(g.header.signature.input_arg)}
    assert header.arg_attr[1] == g.header.arg_attr[index[sig.batch_args[0]]]
    assert 2 not in header.arg_attr and not header.node_def
    assert [(o.name, o.type) for o in header.signature.output_arg] == [("out", F32)]


def test_tensor_info():
    scalar = meta_graph_pb2.TensorInfo(dtype=F32)
    scalar.tensor_shape.SetInParent()
    assert tensor_info(F32, []).SerializeToString() == scalar.SerializeToString()
    assert tensor_info(F32, [-1, 3]).tensor_shape.dim[1].size == 3
    assert tensor_info(F32, None).tensor_shape.unknown_rank


def _with_signatures(item):
    """Add to ``item``: ``twice`` (y = 2 x v, like serving_default, also counting its calls in
    a new variable) and ``bump`` (no inputs, no outputs: adds 10 to the count)."""
    sig = item.signatures["serving_default"]
    w = signature_wrapper(item, "serving_default")
    g = FunctionGraph.over(item.function(sig.function), item.library)
    ids = add_object_variables(item, "vf_test", [("count", F32, [])])
    handles = add_graph_variables(item, "vf_test", [("count", F32, [])])
    out_types = [a.type for a in item.function(sig.function).signature.output_arg]

    twice = function_name(sig.function, "twice", "0")
    fb, args = FunctionGraph.like(entry_header(g, twice, w.args, ["vf_count"], w.outputs, out_types), item.library)
    x = fb.op("Mul", [args[0], fb.const(2.0, F32, "two")[0]], name="double", T=type_attr(F32))[0]
    y = _call_inner(fb, item, w, args, **{w.input_args[0]: x})
    add = fb.op("AssignAddVariableOp", [args[-1], fb.const(1.0, F32, "one")[0]], name="count", dtype=type_attr(F32))
    fb.control_ret(add)
    fb.ret(w.outputs[0], fb.op("Identity", [y[0]], name="y", deps=[add], T=type_attr(F32))[0], F32)
    item.set_function(fb.finish())
    add_signature(item, "twice", twice, w, takes_inputs=True, bound=ids, graph_handles=handles)

    bump = function_name(sig.function, "bump", "0")
    fb, args = FunctionGraph.like(entry_header(g, bump, w.bound_args, ["vf_count"]), item.library)
    fb.control_ret(fb.op("AssignAddVariableOp", [args[-1], fb.const(10.0, F32, "ten")[0]], name="bump",
                         dtype=type_attr(F32)))
    item.set_function(fb.finish())
    add_signature(item, "bump", bump, w, takes_inputs=False, bound=ids, graph_handles=handles)
    return item, (twice, bump)


def test_added_signatures_load_and_run(tiny, tmp_path):
    item, functions = _with_signatures(vfgraph.load(tiny))
    vfgraph.verify(item)
    assert set(functions) <= item.preserve
    sd = item.meta_graph.signature_def
    assert dict(sd["twice"].inputs) == dict(sd["serving_default"].inputs)
    assert list(sd["twice"].outputs) == list(sd["serving_default"].outputs) and not sd["bump"].inputs
    out = vfgraph.save(item, str(tmp_path / "out"))

    loaded = tf.saved_model.load(out)
    assert float(loaded.vf_test.count.numpy()) == 0.0  # a new variable starts at zero
    want = loaded.signatures["serving_default"](x=tf.constant(X))
    got = loaded.signatures["twice"](x=tf.constant(X))
    assert list(got) == list(want)
    np.testing.assert_allclose(got[list(got)[0]].numpy(), 2 * want[list(want)[0]].numpy())
    assert loaded.signatures["bump"]() == {}
    assert float(loaded.vf_test.count.numpy()) == 11.0


def test_added_signatures_run_in_a_session(tiny, tmp_path):
    """The signature map's entries, as a graph loader (TF1 session, TF Serving) runs them: the
    init op zeroes the new graph variable before the model's own."""
    item, _ = _with_signatures(vfgraph.load(tiny))
    out = vfgraph.save(item, str(tmp_path / "out"))
    with tf.Graph().as_default() as graph, tf.compat.v1.Session() as sess:
        mg = tf.compat.v1.saved_model.load(sess, ["serve"], out)
        assert mg.signature_def[INIT_OP_KEY].outputs[INIT_OP_KEY].name == "vf/init_op"
        twice, bump = mg.signature_def["twice"], mg.signature_def["bump"]
        fetch = {k: t.name for k, t in twice.outputs.items()}
        got = sess.run(fetch, {twice.inputs["x"].name: X})
        np.testing.assert_allclose(got[list(got)[0]], 2 * X * [1.0, 2.0])
        sess.run(graph.get_operation_by_name("vf/bump"))
        count = tf.raw_ops.ReadVariableOp(resource=graph.get_tensor_by_name("vf_test/count:0"), dtype=tf.float32)
        assert sess.run(count) == 11.0


def test_graph_signature_outputs(tiny):
    """add_graph_signature: inputs and method copied from ``like``, outputs named after the
    call's outputs in order (those of ``like`` first, then new ones)."""
    item = vfgraph.load(tiny)
    sig = item.signatures["serving_default"]
    sd = item.meta_graph.signature_def
    out_key = next(iter(sd["serving_default"].outputs))
    serving_call = sd["serving_default"].outputs[out_key].name.split(":")[0]
    fed = list(next(n for n in item.meta_graph.graph_def.node if n.name == serving_call).input)
    w = signature_wrapper(item, "serving_default")
    fn = function_name(sig.function, "pair", "0")
    g = FunctionGraph.over(item.function(sig.function), item.library)
    fb, args = FunctionGraph.like(entry_header(g, fn, w.args, [], [out_key, "n"], [F32, F32]), item.library)
    y = _call_inner(fb, item, w, args)
    fb.ret(out_key, y[0], F32)
    fb.ret("n", fb.const(2.0, F32, "n")[0], F32)
    item.set_function(fb.finish())
    add_graph_signature(item, "pair", fn, fed, like="serving_default", outputs=[out_key], new_outputs=[("n", F32, [])])
    pair = sd["pair"]
    assert pair.method_name == sd["serving_default"].method_name
    assert dict(pair.inputs) == dict(sd["serving_default"].inputs)
    assert pair.outputs[out_key].name == "vf/pair:0" and pair.outputs["n"].name == "vf/pair:1"
    assert pair.outputs[out_key].tensor_shape == sd["serving_default"].outputs[out_key].tensor_shape
    call = next(n for n in item.meta_graph.graph_def.node if n.name == "vf/pair")
    assert list(call.input) == fed and call.attr["f"].func.name == fn
    assert fn in item.preserve
    add_graph_signature(item, "alone", fn, fed, new_outputs=[("a", F32, []), ("b", F32, [])])
    assert sd["alone"].method_name == "tensorflow/serving/predict" and not sd["alone"].inputs
