"""The training options real scripts use keep their meaning at any number of virtual nodes: what
the optimizer does with the gradient (clipping by value, norm or global norm, EMA) runs once on
the batch's gradient, and a loss summed over the batch is summed over virtual nodes. Each model
is checked at V=1 against the original step and at V=4 against the full-batch step (SGD, no
batch norm: the same update), on the same batches; a loss vfgraph cannot split is refused."""
import numpy as np
import pytest

import vfgraph
from vfgraph.errors import VfgraphError
from vfgraph import cli
from vfgraph.testing.compare import compare_models
from vfgraph.testing.steps import save_step

LOSSES = {
    "mean": lambda tf, keras, y, logits, w: tf.reduce_mean(
        keras.losses.sparse_categorical_crossentropy(y, logits, from_logits=True)),
    "sum": lambda tf, keras, y, logits, w: tf.reduce_sum(
        keras.losses.sparse_categorical_crossentropy(y, logits, from_logits=True)),
    "keras_sum": lambda tf, keras, y, logits, w: keras.losses.SparseCategoricalCrossentropy(
        from_logits=True, reduction="sum")(y, logits),
    "keras_mean": lambda tf, keras, y, logits, w: keras.losses.SparseCategoricalCrossentropy(from_logits=True)(
        y, logits),
    "sum_over_count": lambda tf, keras, y, logits, w: tf.reduce_sum(
        keras.losses.sparse_categorical_crossentropy(y, logits, from_logits=True)) / tf.cast(tf.shape(y)[0],
                                                                                             tf.float32),
    # a per-example mean over a sequence axis (not the batch), summed over the batch
    "sum_of_sequence_means": lambda tf, keras, y, logits, w: tf.reduce_sum(tf.reduce_mean(
        tf.square(logits - tf.one_hot(y, 10)[:, None, :] * tf.ones([1, 3, 1])), axis=[1, 2])),
    "weighted_by_sum": lambda tf, keras, y, logits, w: tf.reduce_sum(
        w * keras.losses.sparse_categorical_crossentropy(y, logits, from_logits=True)) / tf.reduce_sum(w),
}


def export(path, loss="mean", optimizer="sgd", **options):
    """A small MLP in a tf.Module whose train signature applies a Keras optimizer with ``options``."""
    import keras
    import tensorflow as tf

    keras.utils.set_random_seed(0)
    sequence = loss == "sum_of_sequence_means"
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="tanh"), keras.layers.Dense(10)])
    specs = {"x": tf.TensorSpec([None, 8], tf.float32), "y": tf.TensorSpec([None], tf.int32)}
    if loss == "weighted_by_sum":
        specs["w"] = tf.TensorSpec([None], tf.float32)
    opt = {"sgd": keras.optimizers.SGD, "adam": keras.optimizers.Adam}[optimizer](0.3, **options)
    opt.build(model.trainable_variables)
    loss_fn = LOSSES[loss]

    def train(batch):
        with tf.GradientTape() as tape:
            logits = model(batch["x"], training=True)
            if sequence:
                logits = logits[:, None, :] * tf.ones([1, 3, 1])
            value = loss_fn(tf, keras, batch["y"], logits, batch.get("w"))
        grads = tape.gradient(value, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
        return {"loss": value}

    return save_step(path, train, specs, model.variables, (model, opt),
                     lambda x: {"logits": model(x, training=False)}, specs["x"])


def data(n=32):
    """Features and labels under the train signature's input names (its dict flattened in key
    order) and the serving signature's."""
    rng = np.random.default_rng(1)
    x = rng.normal(size=(n, 8)).astype(np.float32)
    return {"batch": x, "batch_1": rng.integers(0, 10, n).astype(np.int32), "x": x}


def assert_same_training(original, tmp_path, name, batch=16, make_data=data, tol=2e-5):
    """V=1 equals the original step and V=4 the full-batch step, over 3 steps on the same batches."""
    for vnodes in (1, 4):
        out = str(tmp_path / f"{name}_v{vnodes}")
        vfgraph.save(vfgraph.rewrite(original, vnodes=vnodes, allreduce="none"), out)
        rep = compare_models(original, out, steps=3, batch=batch, data=make_data(3 * batch))
        assert not rep.nonfinite, (name, vnodes, rep.nonfinite)
        assert rep.worst_param < tol, (name, vnodes, rep.params)
        for step, a, b in rep.loss:
            assert b == pytest.approx(a, rel=1e-5), (name, vnodes, step)


CASES = {
    "clipnorm": dict(clipnorm=0.05),
    "global_clipnorm": dict(global_clipnorm=0.05),
    "clipvalue": dict(clipvalue=0.01),
    "ema": dict(optimizer="adam", use_ema=True, ema_overwrite_frequency=2),
    "sum": dict(loss="sum"),
    "keras_sum": dict(loss="keras_sum"),
    "keras_mean": dict(loss="keras_mean"),
    "sum_over_count": dict(loss="sum_over_count"),
    "sum_of_sequence_means": dict(loss="sum_of_sequence_means"),
    "sum_with_global_clipnorm": dict(loss="sum", global_clipnorm=0.5),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_training_options_keep_their_meaning(name, tmp_path):
    assert_same_training(export(tmp_path / name, **CASES[name]), tmp_path, name)


def test_the_loss_reduction_is_read_from_dataflow(tmp_path, capsys):
    """inspect's analysis says which reduction it found; a loss normalised by a batch-dependent
    value (a sum of sample weights) is refused naming the scalar."""
    from vfgraph.analysis.train_step import analyze_train_step
    from vfgraph.ir.graph import FunctionGraph

    for loss, want in (("mean", "mean"), ("sum", "sum"), ("keras_sum", "sum"), ("sum_over_count", "mean")):
        item = vfgraph.load(export(tmp_path / loss, loss=loss))
        sig = item.signatures["train"]
        step = analyze_train_step(FunctionGraph.over(item.function(sig.function), item.library), sig)
        assert step.loss_reduction == want, loss
        assert [o.averaged for o in step.outputs] == [want == "mean"], loss
    capsys.readouterr()
    assert cli.main(["inspect", str(tmp_path / "sum")]) == 0
    assert "loss over the batch: a sum: virtual nodes' gradients summed" in capsys.readouterr().out
    weighted = export(tmp_path / "weighted", loss="weighted_by_sum")
    with pytest.raises(VfgraphError, match="scaled by .*computed from the batch's values"):
        vfgraph.rewrite(weighted, vnodes=4, allreduce="none")


def export_two_updates(path, dependent: bool):
    """A step with two optimizers: a GAN's (the discriminator updated, then the generator's
    loss through it) when ``dependent``, else two models over disjoint variables."""
    import keras
    import tensorflow as tf

    keras.utils.set_random_seed(0)
    first = keras.Sequential([keras.Input((8,)), keras.layers.Dense(8, activation="tanh"), keras.layers.Dense(1)])
    second = keras.Sequential([keras.Input((8,)), keras.layers.Dense(8, activation="tanh"), keras.layers.Dense(8)])
    specs = {"x": tf.TensorSpec([None, 8], tf.float32), "y": tf.TensorSpec([None], tf.int32)}
    opts = keras.optimizers.SGD(0.1), keras.optimizers.SGD(0.1)
    opts[0].build(first.trainable_variables)
    opts[1].build(second.trainable_variables)

    def train(batch):
        x = batch["x"]
        with tf.GradientTape() as tape:
            made = second(x, training=True)
            d = tf.reduce_mean(tf.nn.softplus(-first(x)) + tf.nn.softplus(first(made)))
        opts[0].apply_gradients(zip(tape.gradient(d, first.trainable_variables), first.trainable_variables))
        with tf.GradientTape() as tape:
            made = second(x, training=True)
            g = (tf.reduce_mean(tf.nn.softplus(-first(made))) if dependent
                 else tf.reduce_mean(tf.square(made - x)))
        opts[1].apply_gradients(zip(tape.gradient(g, second.trainable_variables), second.trainable_variables))
        return {"loss": d + g}

    return save_step(path, train, specs, list(first.variables) + list(second.variables), (first, second, *opts),
                     lambda x: {"made": second(x)}, specs["x"])


def test_two_independent_updates_are_one_step(tmp_path):
    assert_same_training(export_two_updates(tmp_path / "two", dependent=False), tmp_path, "two")


def export_deep(path, depth=400):
    """A step whose forward pass is a chain of ``depth`` layers (two ops each): deeper than
    Python's recursion limit, as the layers of a deep model are."""
    import tensorflow as tf

    w = tf.Variable(np.linspace(0.5, 1.5, 8).astype(np.float32), name="w")
    head = tf.Variable(np.ones((8, 10), np.float32) * 0.1, name="head")
    specs = {"x": tf.TensorSpec([None, 8], tf.float32), "y": tf.TensorSpec([None], tf.int32)}

    def forward(x):
        for _ in range(depth):
            x = tf.tanh(x * w)
        return tf.matmul(x, head)

    def train(batch):
        with tf.GradientTape() as tape:
            value = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(batch["y"], forward(batch["x"])))
        for v, g in zip((w, head), tape.gradient(value, [w, head])):
            v.assign_sub(0.3 * g)
        return {"loss": value}

    return save_step(path, train, specs, [w, head], (), lambda x: {"logits": forward(x)}, specs["x"])


def test_a_loss_deeper_than_python_recursion_is_read(tmp_path):
    """The loss's reduction is read through a chain of 800 ops (it exceeded the recursion
    limit: an internal error), and the deep step trains as the original and the full batch."""
    assert_same_training(export_deep(tmp_path / "deep"), tmp_path, "deep")
