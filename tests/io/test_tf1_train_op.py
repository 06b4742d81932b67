"""A TF1 SavedModel (tags serve + train) whose 'train' signature returns only the loss and
leaves the update to the train op of a collection: that train op is the training step."""
import os
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf

import vfgraph

v1 = tf.compat.v1
TAGS = ["serve", "train"]
ENV = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", TF_ENABLE_ONEDNN_OPTS="0")
RNG = np.random.default_rng(0)
BATCHES = [(RNG.normal(size=(32, 64)).astype(np.float32), RNG.integers(0, 10, 32).astype(np.int32)) for _ in range(3)]
# resource / reference variables; batch-norm averages under control dependencies of minimize,
# or an ExponentialMovingAverage grouped with it (in the saved_model_train_op collection)
VARIANTS = ["", "ref", "ema", "ref,ema"]


def _name(variant):
    return "tf1-serve-train" + (f":{variant}" if variant else "")


def _train_op(mg):
    """The op a TF1 loop runs: SavedModel's train-op collection, else GraphKeys.TRAIN_OP."""
    key = "saved_model_train_op" if "saved_model_train_op" in mg.collection_def else "train_op"
    return mg.collection_def[key].node_list.value[0]


class Session:
    """A TF1 Session over a SavedModel loaded with tags serve + train."""

    def __init__(self, path):
        self.graph = tf.Graph()
        self.sess = v1.Session(graph=self.graph)
        with self.graph.as_default():
            self.mg = v1.saved_model.load(self.sess, TAGS, path)
        self.train_op = _train_op(self.mg)
        self.loss = self.mg.signature_def["train"].outputs["loss"].name
        self.variables = {v.name: v for v in self.graph.get_collection(v1.GraphKeys.GLOBAL_VARIABLES)}

    def step(self, x, y):
        return self.sess.run([self.train_op, self.loss], {"x:0": x, "y:0": y})[1]

    def values(self):
        return {n: self.sess.run(v) for n, v in self.variables.items()}

    def assign(self, values):
        with self.graph.as_default():
            for n, v in self.variables.items():
                v.load(values[n], self.sess)

    def serve(self, x):
        sig = self.mg.signature_def["serving_default"]
        return self.sess.run(sig.outputs["logits"].name, {sig.inputs["x"].name: x})


@pytest.mark.parametrize("variant", VARIANTS)
def test_one_vnode_session_loop_is_bit_identical(models, rewritten, variant):
    """The original's Session loop over 3 steps (sess.run([train_op, loss])) and the same loop
    over the rewritten model (V=1) end with the same variables and losses, bit for bit."""
    want, got = Session(models(_name(variant))), Session(rewritten(_name(variant), 1))
    want_loss = [want.step(x, y) for x, y in BATCHES]
    got_loss = [got.step(x, y) for x, y in BATCHES]
    a, b = want.values(), got.values()
    assert sorted(a) == sorted(b) and "global_step:0" in a
    assert b["global_step:0"] == 3
    for name in a:
        np.testing.assert_array_equal(b[name], a[name], err_msg=name)
    assert got_loss == want_loss
    # the rewritten train op is the rewritten step: the signature now runs it
    meta = vfgraph.load(rewritten(_name(variant), 1)).metadata
    assert meta["rewrites"]["split-vnodes"]["train"]["vnodes"] == 1


@pytest.mark.parametrize("variant", ["", "ref,ema"])
def test_vnodes_use_per_slice_statistics(models, rewritten, variant):
    """V=4 on 32 examples equals the original train op run on each slice of 8 from the same
    state, parameter deltas and moving averages averaged (one momentum step from zero slots
    is linear in the gradient), the global step advanced once, the loss the slices' mean."""
    orig = Session(models(_name(variant)))
    start = orig.values()
    x, y = BATCHES[0]
    finals, losses = [], []
    for k in range(4):
        orig.assign(start)
        losses.append(orig.step(x[8 * k:8 * k + 8], y[8 * k:8 * k + 8]))
        finals.append(orig.values())
    ref = {n: np.mean([f[n] for f in finals], axis=0) if start[n].dtype.kind == "f" else finals[-1][n]
           for n in start}
    got = Session(rewritten(_name(variant), 4))
    loss = got.step(x, y)
    values = got.values()
    assert loss == pytest.approx(np.mean(losses), rel=1e-6)
    assert sorted(values) == sorted(ref) and values["global_step:0"] == 1
    for n, value in ref.items():
        np.testing.assert_allclose(values[n], value, rtol=1e-5, atol=1e-6, err_msg=n)
    # the split happened: the full batch's statistics are not the slices' mean
    full = Session(models(_name(variant)))
    full.step(x, y)
    stats = [n for n in ref if "moving" in n]  # the means agree; the variances do not
    assert stats and any(not np.allclose(full.values()[n], values[n], rtol=1e-6) for n in stats)


def test_serving_signature_equals_the_original(models, rewritten):
    """Before and after a V=4 step, serving_default computes what the original's does on the
    same variables."""
    orig, new = Session(models(_name(""))), Session(rewritten(_name(""), 4))
    x = BATCHES[1][0]
    np.testing.assert_array_equal(new.serve(x), orig.serve(x))
    new.step(*BATCHES[0])
    orig.assign(new.values())
    np.testing.assert_array_equal(new.serve(x), orig.serve(x))
    assert new.values()["global_step:0"] == 1


def test_loads_in_a_fresh_process(rewritten):
    """tf.saved_model.load with tags serve + train: the 'train' signature is the step."""
    out = rewritten(_name("ema"), 4)
    code = (
        "import numpy as np, tensorflow as tf, vfgraph\n"
        f"m = tf.saved_model.load({out!r}, tags=['serve', 'train'])\n"
        "x = np.random.default_rng(0).normal(size=(32, 64)).astype('float32')\n"
        "loss = m.signatures['train'](x=x, y=np.zeros(32, 'int32'))['loss']\n"
        "step = [v for v in m.signatures['train'].variables if v.name == 'global_step:0'][0]\n"
        "logits = m.signatures['serving_default'](x=x)['logits']\n"
        "print('OK', float(loss), int(step.numpy()), logits.shape)\n")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=ENV, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    ok = res.stdout.split()
    assert ok[0] == "OK" and np.isfinite(float(ok[1])) and ok[2] == "1", res.stdout


def test_train_op_reading_other_placeholders_is_named(models, tmp_path):
    """A loss-only 'train' signature whose train op also reads a placeholder it does not take
    (a learning rate fed at run time): refused with a message naming that placeholder."""
    with tf.Graph().as_default() as g:
        x = v1.placeholder(tf.float32, [None, 4], name="x")
        lr = v1.placeholder(tf.float32, [], name="lr")
        w = v1.get_variable("w", initializer=tf.ones([4, 1]), use_resource=True)
        loss = tf.reduce_mean(tf.matmul(x, w), name="loss")
        v1.train.GradientDescentOptimizer(lr).minimize(loss)
        with v1.Session(graph=g) as sess:
            sess.run(v1.global_variables_initializer())
            b = v1.saved_model.Builder(str(tmp_path / "m"))
            sig = v1.saved_model.signature_def_utils.predict_signature_def
            b.add_meta_graph_and_variables(sess, TAGS, signature_def_map={"train": sig({"x": x}, {"loss": loss})})
            b.save()
    with pytest.raises(vfgraph.VfgraphError, match=r"placeholders that are not its inputs \(lr\)"):
        vfgraph.rewrite(str(tmp_path / "m"), vnodes=2)


def test_train_op_in_the_saved_model_train_op_signature(tmp_path):
    """A train op given to SavedModel's builder as ``train_op`` (the
    ``__saved_model_train_op`` signature that loader.get_train_op reads): that op is the step,
    and loader.get_train_op of the rewritten model runs it (V=1 equals the original)."""
    from tensorflow.python.saved_model import builder_impl, loader_impl

    with tf.Graph().as_default() as g:
        x = v1.placeholder(tf.float32, [None, 4], name="x")
        w = v1.get_variable("w", initializer=tf.ones([4, 1]), use_resource=True)
        loss = tf.reduce_mean(tf.square(tf.matmul(x, w)), name="loss")
        step = v1.train.GradientDescentOptimizer(0.1).minimize(loss)
        v1.get_collection_ref(v1.GraphKeys.TRAIN_OP).clear()  # only in the signature
        with v1.Session(graph=g) as sess:
            sess.run(v1.global_variables_initializer())
            b = builder_impl._SavedModelBuilder(str(tmp_path / "m"))
            sig = v1.saved_model.signature_def_utils.predict_signature_def
            b.add_meta_graph_and_variables(sess, TAGS, signature_def_map={"train": sig({"x": x}, {"loss": loss})},
                                           train_op=step)
            b.save()
    vfgraph.save(vfgraph.rewrite(str(tmp_path / "m"), vnodes=1), str(tmp_path / "o"))
    feed = {"x:0": np.arange(32, dtype=np.float32).reshape(8, 4) / 32}
    got = []
    for path in (tmp_path / "m", tmp_path / "o"):
        with tf.Graph().as_default() as g, v1.Session(graph=g) as sess:
            mg = v1.saved_model.load(sess, TAGS, str(path))
            train_op = loader_impl.get_train_op(mg)
            loss = mg.signature_def["train"].outputs["loss"].name
            got.append(([sess.run([train_op, loss], feed)[1] for _ in range(2)], sess.run(v1.global_variables())))
    assert got[0][0] == got[1][0]
    np.testing.assert_array_equal(got[0][1][0], got[1][1][0])
    assert not np.array_equal(got[0][1][0], np.ones([4, 1], np.float32))
