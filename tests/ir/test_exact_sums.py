"""Exact sums for deterministic mode: ``VfExactAdd`` (vfgraph's op library) adds values to
fixed-point int64 words whose sums do not depend on the order of the additions;
``vfgraph.ir.blocks.from_exact`` makes them floating point again."""
import numpy as np
import pytest
import tensorflow as tf
from tensorflow.core.framework import graph_pb2, types_pb2

from vfgraph.ir.attrs import func_attr, types_attr
from vfgraph.ir.blocks import EXACT_LIMIT, I64, from_exact
from vfgraph.ir.graph import FunctionGraph

F32 = types_pb2.DT_FLOAT


def words(*values):
    """The words of ``values`` (float32 arrays) added to zeros."""
    from vfgraph import ops

    n = sum(np.size(v) for v in values)
    return ops.exact_add(tf.zeros([2 * n + 1], tf.int64), [tf.constant(v, tf.float32) for v in values]).numpy()


def value(w, n):
    """``from_exact`` of the words ``w`` (in a graph, as the rewritten step runs it)."""
    lib = {}
    fb = FunctionGraph.new("value", lib)
    fb.ret("v", from_exact(fb, fb.arg("w", I64, [2 * n + 1]), F32, n), F32)
    lib["value"] = fb.finish()
    gd = graph_pb2.GraphDef()
    gd.library.function.extend(lib.values())
    gd.node.add(name="w", op="Placeholder").attr["dtype"].type = I64
    gd.node.add(name="call", op="StatefulPartitionedCall", input=["w"],
                attr={"f": func_attr("value"), "Tin": types_attr([I64]), "Tout": types_attr([F32])})
    with tf.Graph().as_default() as g, tf.compat.v1.Session() as sess:
        tf.graph_util.import_graph_def(gd, name="")
        return sess.run(g.get_tensor_by_name("call:0"), {"w:0": w})


def test_sums_of_words_do_not_depend_on_the_order():
    rng = np.random.default_rng(0)
    # values over many magnitudes, as gradients are; two tensors per term, as a virtual node's
    terms = (rng.normal(size=(16, 1000)) * 10.0 ** rng.integers(-12, 4, size=(16, 1000))).astype(np.float32)
    each = np.stack([words(t[:600].reshape(30, 20), t[600:]) for t in terms])
    sums = []
    for order in (np.arange(16), rng.permutation(16), rng.permutation(16)):
        total = np.zeros_like(each[0])
        for k in order:
            total = total + each[k]
        sums.append(value(total, 1000))
    assert all(np.array_equal(sums[0], s) for s in sums[1:])
    # the exact sum, rounded once (to float32) but for the parts below 2^-60
    np.testing.assert_allclose(sums[0], terms.astype(np.float64).sum(axis=0), rtol=1e-6, atol=1e-17)
    # float32 additions in different orders differ: what the words are for
    assert not np.array_equal(terms.sum(axis=0), terms[::-1].sum(axis=0))


def test_values_outside_the_limit_make_the_sum_nan():
    half = words(np.full(3, 0.5, np.float32))
    total = value(words(np.array([1.0, -EXACT_LIMIT / 2, 3e-25], np.float32)) + half, 3)
    assert total[0] == 1.5 and total[1] == np.float32(-EXACT_LIMIT / 2 + 0.5)
    assert total[2] == 0.5  # below 2^-60: dropped, the same way in every order
    for bad in (np.nan, np.inf, -np.inf, EXACT_LIMIT):  # one such value: the whole sum is NaN
        assert np.isnan(value(words(np.array([1.0, bad, 2.0], np.float32)) + half, 3)).all(), bad


@pytest.mark.parametrize("n", [1, 1024])
def test_many_terms_stay_exact(n):
    x = np.array([EXACT_LIMIT / 2, -1e-10, 0.1], np.float32)
    np.testing.assert_allclose(value(words(x) * n, 3), x.astype(np.float64) * n, rtol=1e-7)
    assert np.isnan(value(words(np.array([np.nan, 1.0, 1.0], np.float32)) * n, 3)).all()


def test_words_of_a_wrong_size_are_refused():
    from vfgraph import ops

    with pytest.raises(tf.errors.InvalidArgumentError, match=r"VfExactAdd .* the sum holds 5 words, the values "
                                                              r"need 2 \* 3 \+ 1"):
        ops.exact_add(tf.zeros([5], tf.int64), [tf.ones([3])])
