"""Virtual-node training semantics (design.md section 2), checked numerically."""
import numpy as np
import pytest
import tensorflow as tf

from vfgraph.testing.compare import compare_models, make_inputs, variable_values

OPTIMIZERS = ["sgd", "momentum", "adam", "adamw", "rmsprop", "adagrad", "manual"]


@pytest.mark.parametrize("opt", OPTIMIZERS)
def test_one_vnode_is_bit_identical(models, rewritten, opt):
    rep = compare_models(models(f"mlp:{opt}"), rewritten(f"mlp:{opt}", 1), steps=3, batch=32)
    assert rep.params, "no parameters compared"
    assert rep.worst_param == 0.0, rep.params
    assert all(la == lb for _, la, lb in rep.loss)


def test_one_vnode_is_bit_identical_with_batch_norm(models, rewritten):
    rep = compare_models(models("cnn:sgd"), rewritten("cnn:sgd", 1), steps=3, batch=32)
    assert rep.worst_param == 0.0, rep.params


def test_one_vnode_batch_norm_momentum_within_an_ulp(models, rewritten):
    """Grappler reassociates the momentum arithmetic across the cut in the original graph, so
    one slot can differ in the last bit; everything else stays bit-identical."""
    rep = compare_models(models("cnn:momentum"), rewritten("cnn:momentum", 1), steps=3, batch=32)
    assert rep.worst_param < 1e-6, rep.params
    assert sum(1 for v in rep.params.values() if v) <= 1, rep.params


@pytest.mark.parametrize("opt", OPTIMIZERS)
@pytest.mark.parametrize("vnodes", [2, 4, 8])
def test_vnodes_equal_full_batch_step(models, rewritten, opt, vnodes):
    """Without batch statistics, V virtual nodes reproduce the full-batch step."""
    rep = compare_models(models(f"mlp:{opt}"), rewritten(f"mlp:{opt}", vnodes), steps=3, batch=64)
    assert rep.worst_param < 1e-5, rep.params
    for _, la, lb in rep.loss:
        assert lb == pytest.approx(la, rel=1e-5)


def test_fixed_vnode_batch_reads_vnode_count_from_fed_batch(models, rewritten):
    """With b fixed, the same graph runs 2, 4 or 8 virtual nodes depending on the batch fed."""
    orig = models("mlp:adam")
    out = rewritten("mlp:adam", 4, 8)
    for batch in (16, 32, 64):
        rep = compare_models(orig, out, steps=2, batch=batch)
        assert rep.worst_param < 1e-5, (batch, rep.params)


def _per_slice_reference(model_dir, inputs, vnodes):
    """Reference for a batch-norm model, from the original graph only: run the original
    training step on each slice from the same starting state, average the parameter deltas
    of the slices for SGD (linear in the gradient) and the moving statistics' new values."""
    loaded = tf.saved_model.load(model_dir)
    fn = loaded.signatures["train"]
    start = variable_values(fn)
    n = len(next(iter(inputs.values())))
    b = n // vnodes
    finals, losses = [], []
    for k in range(vnodes):
        for v in fn.variables:
            v.assign(start[v.name])
        losses.append(float(fn(**{key: val[k * b:(k + 1) * b] for key, val in inputs.items()})["loss"]))
        finals.append(variable_values(fn))
    ref = {name: np.mean([f[name] for f in finals], axis=0) if start[name].dtype.kind == "f" else finals[-1][name]
           for name in start}
    return ref, float(np.mean(losses))


@pytest.mark.parametrize("vnodes", [2, 4])
def test_batch_norm_uses_per_vnode_statistics(models, rewritten, vnodes):
    """Per-virtual-node batch statistics; moving averages averaged over virtual nodes, applied once."""
    orig = models("cnn:sgd")
    original = tf.saved_model.load(orig)
    inputs = make_inputs(original.signatures["train"], 32, seed=3)
    ref, ref_loss = _per_slice_reference(orig, inputs, vnodes)
    model = tf.saved_model.load(rewritten("cnn:sgd", vnodes))  # keeps the variables alive
    fn = model.signatures["train"]
    loss = float(fn(**inputs)["loss"])
    got = variable_values(fn)
    assert loss == pytest.approx(ref_loss, rel=1e-5)
    for name, value in ref.items():
        if value.dtype.kind == "f":
            np.testing.assert_allclose(got[name], value, rtol=1e-5, atol=1e-6, err_msg=name)
        else:
            np.testing.assert_array_equal(got[name], value, err_msg=name)


def test_optimizer_state_advances_once_per_step(models, rewritten):
    model = tf.saved_model.load(rewritten("mlp:adam", 8))
    fn = model.signatures["train"]
    for _ in range(3):
        fn(**make_inputs(fn, 64))
    iters = [v for v in fn.variables if "iteration" in v.name]
    assert iters and int(iters[0].numpy()) == 3


def test_batch_not_divisible_names_b(models, rewritten):
    model = tf.saved_model.load(rewritten("mlp:sgd", 4, 8))
    fn = model.signatures["train"]
    inputs = make_inputs(fn, 20)
    with pytest.raises(tf.errors.InvalidArgumentError, match="virtual-node batch b=8"):
        fn(**inputs)


def test_leading_dimensions_must_agree(models, rewritten):
    model = tf.saved_model.load(rewritten("mlp:sgd", 4, 8))
    fn = model.signatures["train"]
    inputs = make_inputs(fn, 32)
    inputs["y"] = inputs["y"][:16]
    with pytest.raises(tf.errors.InvalidArgumentError, match="different leading"):
        fn(**inputs)


def test_rewrite_is_deterministic_and_leaves_input_alone(models, tmp_path):
    import hashlib
    import os

    import vfgraph

    src = models("mlp:adam")

    def digest(path):
        h = hashlib.sha256()
        for root, _, files in sorted(os.walk(path)):
            for f in sorted(files):
                with open(os.path.join(root, f), "rb") as fh:
                    h.update(f.encode() + fh.read())
        return h.hexdigest()

    before = digest(src)
    a = vfgraph.save(vfgraph.rewrite(src, vnodes=4, vnode_batch=8), tmp_path / "a")
    b = vfgraph.save(vfgraph.rewrite(src, vnodes=4, vnode_batch=8), tmp_path / "b")
    assert digest(a) == digest(b)
    assert digest(src) == before
    # A loaded item given to rewrite is not edited (the pipeline works on its own copy), and
    # gives the same output as the path.
    item = vfgraph.load(src)
    proto = item.saved_model.SerializeToString(deterministic=True)
    c = vfgraph.save(vfgraph.rewrite(item, vnodes=4, vnode_batch=8), tmp_path / "c")
    assert item.saved_model.SerializeToString(deterministic=True) == proto
    assert digest(c) == digest(a)
    # in_place: the item itself is rewritten (no copy), with the same result.
    edited = vfgraph.rewrite(item, vnodes=4, vnode_batch=8, in_place=True)
    assert edited is item and item.saved_model.SerializeToString(deterministic=True) != proto
    assert digest(vfgraph.save(edited, tmp_path / "d")) == digest(a)


@pytest.mark.parametrize("name", ["embedding:sgd", "embedding:adam", "embedding:adagrad", "lstm", "transformer:sgd"])
def test_model_families(models, rewritten, name):
    """Sparse gradients (Embedding: values and indices concatenated over virtual nodes),
    recurrent loops (LSTM) and attention: V=1 exact, V=4 equal to the full-batch step."""
    orig = models(name)
    assert compare_models(orig, rewritten(name, 1), steps=2, batch=32).worst_param == 0.0
    rep = compare_models(orig, rewritten(name, 4), steps=2, batch=32)
    assert rep.worst_param < 1e-5, rep.params


def test_sparse_gradient_is_concatenated_not_densified(models):
    import vfgraph

    rec = vfgraph.rewrite(models("embedding:adam"), vnodes=4).metadata["rewrites"]["split-vnodes"]["train"]
    roles = sorted(g["role"] for g in rec["gradients"])
    assert roles.count("indices") == 1
    assert any(g["shape"][0] == -1 and g["role"] == "gradient" for g in rec["gradients"])


def test_dropout_masks_differ_between_vnodes(models, rewritten):
    """Four virtual nodes fed four copies of one slice must not reuse one dropout mask: the
    step then differs from one virtual node on that slice. One virtual node stays exact."""
    orig = models("dropout")
    assert compare_models(orig, rewritten("dropout", 1), steps=2, batch=16).worst_param == 0.0
    one = tf.saved_model.load(rewritten("dropout", 1))
    four = tf.saved_model.load(rewritten("dropout", 4, 8))
    inputs = make_inputs(one.signatures["train"], 8, seed=5)
    one.signatures["train"](**inputs)
    four.signatures["train"](**{k: np.concatenate([v] * 4) for k, v in inputs.items()})
    a, b = variable_values(one.signatures["train"]), variable_values(four.signatures["train"])
    kernels = [k for k in a if "kernel" in k]
    assert kernels and max(float(np.max(np.abs(a[k] - b[k]))) for k in kernels) > 1e-4


@pytest.mark.parametrize("opt", ["sgd", "momentum", "adam"])
def test_tf1_graph_one_vnode_exact(models, rewritten, opt):
    rep = compare_models(models(f"tf1:{opt}"), rewritten(f"tf1:{opt}", 1), steps=2, batch=32)
    assert rep.params and rep.worst_param == 0.0, rep.params
    assert rep.serving["serving_default"] == 0.0


@pytest.mark.parametrize("vnodes", [2, 4])
def test_tf1_batch_norm_per_vnode_statistics(models, rewritten, vnodes):
    """TF1 graph: batch-norm moving averages updated under control dependencies."""
    orig = models("tf1:momentum")
    original = tf.saved_model.load(orig)
    inputs = make_inputs(original.signatures["train"], 32, seed=3)
    ref, ref_loss = _per_slice_reference(orig, inputs, vnodes)
    model = tf.saved_model.load(rewritten("tf1:momentum", vnodes))
    fn = model.signatures["train"]
    assert float(fn(**inputs)["loss"]) == pytest.approx(ref_loss, rel=1e-5)
    got = variable_values(fn)
    for name, value in ref.items():
        np.testing.assert_allclose(got[name], value, rtol=1e-5, atol=1e-6, err_msg=name)


def test_tf1_train_op_runs_the_virtual_node_loop(models, rewritten):
    """A TF1 user runs the train_op collection's op in a Session: it is the rewritten step."""
    out = rewritten("tf1:sgd", 4, 8)
    inputs = make_inputs(tf.saved_model.load(out).signatures["train"], 32, seed=1)
    via_signature = tf.saved_model.load(out)
    via_signature.signatures["train"](**inputs)
    expected = variable_values(via_signature.signatures["train"])
    with tf.Graph().as_default() as g, tf.compat.v1.Session(graph=g) as sess:
        meta = tf.compat.v1.saved_model.load(sess, ["serve"], out)
        (train_op,) = meta.collection_def["train_op"].node_list.value[:1]
        sess.run(train_op, {"x:0": inputs["x"], "y:0": inputs["y"]})
        for v in tf.compat.v1.global_variables():
            np.testing.assert_array_equal(sess.run(v), expected[v.name], err_msg=v.name)


def test_static_batch(models, tmp_path):
    """b derives from a static batch; a graph with that batch baked into its constants (what
    Keras exports) cannot run on smaller slices and says so instead of failing at run time."""
    import vfgraph

    item = vfgraph.rewrite(models("mlp32:adam"), vnodes=1)
    assert item.metadata["rewrites"]["split-vnodes"]["train"]["vnode_batch"] == 32
    rep = compare_models(models("mlp32:adam"), vfgraph.save(item, tmp_path / "o"), steps=2, batch=32)
    assert rep.worst_param == 0.0, rep.params
    with pytest.raises(vfgraph.VfgraphError, match="static batch of 32 that its graph depends on.*None batch"):
        vfgraph.rewrite(models("mlp32:adam"), vnodes=4)
    with pytest.raises(vfgraph.VfgraphError, match="static batch 32 is not divisible by vnodes=5"):
        vfgraph.rewrite(models("mlp32:adam"), vnodes=5)


def test_training_input_without_batch_dimension(tmp_path):
    import vfgraph

    class Scalar(tf.Module):
        def __init__(self):
            super().__init__()
            self.w = tf.Variable(1.0)

        @tf.function(input_signature=[tf.TensorSpec([], tf.float32, name="x")])
        def train(self, x):
            with tf.GradientTape() as t:
                loss = tf.square(self.w * x)
            self.w.assign_sub(0.1 * t.gradient(loss, self.w))
            return {"loss": loss}

    m = Scalar()
    tf.saved_model.save(m, str(tmp_path / "m"), signatures={"train": m.train})
    with pytest.raises(vfgraph.VfgraphError, match="input 'x' has no batch dimension"):
        vfgraph.rewrite(tmp_path / "m", vnodes=2)


@pytest.mark.parametrize("name", ["mlp:adam", "cnn:momentum", "embedding:adam"])
def test_stepwise_signatures_match_the_loop(rewritten, name):
    """accumulate(8 examples) x 4 + apply() gives the parameters of one looped step of 32,
    the accumulators persist between calls as saved variables and reset after apply (dense
    sums to zeros, sparse gradients' rows to none)."""
    path = rewritten(name, 4, 8)
    looped, stepped = tf.saved_model.load(path), tf.saved_model.load(path)
    assert {"train_accumulate", "train_apply"} <= set(stepped.signatures)
    for step in range(2):
        inputs = make_inputs(looped.signatures["train"], 32, seed=step)
        want = float(looped.signatures["train"](**inputs)["loss"])
        losses = [float(stepped.signatures["train_accumulate"](**{k: v[i * 8:(i + 1) * 8] for k, v in inputs.items()})["loss"])
                  for i in range(4)]
        assert stepped.signatures["train_apply"]() == {}
        assert np.mean(losses) == pytest.approx(want, rel=1e-6)
    a, b = variable_values(looped.signatures["train"]), variable_values(stepped.signatures["train"])
    for k in a:
        np.testing.assert_allclose(b[k], a[k], rtol=1e-6, atol=1e-7, err_msg=k)
    accs = [v for v in stepped.signatures["train_apply"].variables if "vf_accumulators" in v.name]
    assert accs and all(int(tf.size(v)) == 0 or float(tf.reduce_max(tf.abs(v))) == 0 for v in accs)
    if name.startswith("embedding"):
        assert any(int(tf.size(v)) == 0 for v in accs)
    with pytest.raises(tf.errors.InvalidArgumentError, match="train_apply found no accumulated virtual node"):
        stepped.signatures["train_apply"]()
    assert variable_values(stepped.signatures["train"]).keys() == a.keys()
    for k, v in variable_values(stepped.signatures["train"]).items():
        np.testing.assert_array_equal(v, b[k], err_msg=f"{k} changed by a refused apply")


def test_adam_on_a_dense_layer_over_a_sequence_averages_gradients_not_their_squares(tmp_path):
    """A Dense layer on rank-3 input (Tensordot) exports its kernel gradient without a static
    shape; the shape is recovered from the optimizer's update, so the cut is the gradient
    itself, not Adam's squared gradient after it (averaging squares over virtual nodes would
    change the step)."""
    import keras
    import tensorflow as tf

    import export
    import vfgraph
    from vfgraph.analysis.train_step import analyze_train_step
    from vfgraph.ir.graph import FunctionGraph

    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((4, 8)), keras.layers.Dense(16, activation="relu"), keras.layers.Flatten(),
                              keras.layers.Dense(10)])
    specs = {"x": tf.TensorSpec([None, 4, 8], tf.float32, name="x"), "y": tf.TensorSpec([None], tf.int32, name="y")}
    m = export.build_module(model, specs, "adam", 0.01, export.sparse_ce)
    src = str(tmp_path / "m")
    tf.saved_model.save(m, src, signatures={"train": m.train, "serving_default": m.serve})
    item = vfgraph.load(src)
    sig = item.training_signature()
    step = analyze_train_step(FunctionGraph.over(item.function(sig.function), item.library), sig)
    kernel = next(a for a, v in sig.variables.items() if v.shape == [8, 16] and v.name.endswith("/kernel"))
    cut = [c for c in step.cut if c.variable == kernel]
    assert len(cut) == 1 and cut[0].shape == [8, 16], [(str(c.ref), c.variable, c.shape) for c in step.cut]
    out = vfgraph.save(vfgraph.rewrite(item, vnodes=4, allreduce="none"), tmp_path / "v4")
    rep = compare_models(src, out, steps=3, batch=32)
    assert rep.worst_param < 1e-5, rep.params
