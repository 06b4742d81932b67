"""vfgraph.ir.loops: the layout of a slice loop's variables, and a loop built from its
pieces run by TensorFlow."""
import numpy as np
import pytest
import tensorflow as tf
from tensorflow.core.framework import graph_pb2, types_pb2

from vfgraph.ir.attrs import func_attr, type_attr, types_attr
from vfgraph.ir.blocks import I32, zeros
from vfgraph.ir.graph import FunctionGraph
from vfgraph.ir.loops import LoopLayout, condition, next_index, same_batch, slice_reader, while_loop

F32 = types_pb2.DT_FLOAT


def test_layout_arithmetic():
    layout = LoopLayout.of([(F32, [3]), (types_pb2.DT_VARIANT, [])], [(I32, []), (F32, [-1, 3])])
    assert layout.count_index == 3
    assert layout.types == [I32, F32, types_pb2.DT_VARIANT, I32, I32, F32]
    assert layout.shapes == [[], [3], [], [], [], [-1, 3]]
    values = ["i", "sum", "list", "n", "per", "x"]
    assert layout.split(values) == ("i", ["sum", "list"], "n", ["per", "x"])
    assert layout.join(*layout.split(values)) == values
    fb = FunctionGraph.new("f")
    assert [str(a) for a in layout.args(fb, values)] == values
    assert [a.type for a in fb.fdef.signature.input_arg] == layout.types
    assert 1 in fb.fdef.arg_attr and 5 in fb.fdef.arg_attr  # static shapes recorded


def _sum_of_slices(per: int):
    """Library functions: ``run(x, z)`` checks that x and z have the same batch, then sums the
    rows of x in slices of ``per`` rows with a While loop (body: add the slice's column sums)."""
    layout = LoopLayout.of([(F32, [2])], [(I32, []), (F32, [-1, 2])])
    lib = {}
    fb = FunctionGraph.new("body", lib)
    i, (acc,), n, (p, x) = layout.split(layout.args(fb, ["i", "acc", "n", "per", "x"]))
    rows = slice_reader(fb, i, p)(x, F32)
    total = fb.op("Sum", [rows, fb.const(0, I32, "axis")[0]], name="sum", T=type_attr(F32), Tidx=type_attr(I32))[0]
    new = fb.op("AddV2", [acc, total], name="add", T=type_attr(F32))[0]
    for k, (ref, t) in enumerate(zip(layout.join(next_index(fb, i), [new], n, [p, x]), layout.types)):
        fb.ret(f"out_{k}", ref, t)
    lib["body"] = fb.finish()
    lib["cond"] = condition("cond", lib["body"], layout, lib)
    fb = FunctionGraph.new("run", lib)
    x, z = fb.arg("x", F32, [-1, 2]), fb.arg("z", F32, [-1])
    count, checks = same_batch(fb, [x, z], [F32, F32], ["x", "z"], "inputs")
    per_ = fb.const(per, I32, "per")[0]
    slices = fb.op("FloorDiv", [count, per_], name="slices", deps=checks, T=type_attr(I32))[0]
    loop = while_loop(fb, layout, [zeros(fb, [2], F32)], slices, [per_, x], "cond", "body", "loop", lower=False)
    _, (summed,), _, _ = layout.split(loop.outputs())
    fb.ret("summed", summed, F32)
    lib["run"] = fb.finish()
    assert [n.op for n in lib["cond"].node_def] == ["Less"]
    assert lib["cond"].node_def[0].input[1] == "n"  # i < the number of slices
    return lib


def _run(lib, x, z):
    gd = graph_pb2.GraphDef()
    gd.library.function.extend(lib.values())
    for name in ("x", "z"):
        gd.node.add(name=name, op="Placeholder").attr["dtype"].type = F32
    gd.node.add(name="call", op="StatefulPartitionedCall", input=["x", "z"],
                attr={"f": func_attr("run"), "Tin": types_attr([F32, F32]), "Tout": types_attr([F32])})
    with tf.Graph().as_default() as g, tf.compat.v1.Session() as sess:
        tf.graph_util.import_graph_def(gd, name="")
        return sess.run(g.get_tensor_by_name("call:0"), {"x:0": x, "z:0": z})


def test_a_loop_over_slices_runs():
    lib = _sum_of_slices(per=2)
    x = np.arange(12, dtype=np.float32).reshape(6, 2)
    np.testing.assert_allclose(_run(lib, x, np.zeros(6, np.float32)), x.sum(axis=0))
    message = r"vfgraph: inputs .*x.* and .*z.* have different leading \(batch\) dimensions"
    with pytest.raises(tf.errors.InvalidArgumentError, match=message):
        _run(lib, x, np.zeros(5, np.float32))
