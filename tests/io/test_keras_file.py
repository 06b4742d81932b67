"""Keras 3 models in: a compiled .keras file trains as Keras' own ``train_on_batch`` does (its
optimizer's options and state, schedule, clipping, regularization, loss weights, metrics), at
V=1 and, without batch normalization, at V=4; an inference export fine-tunes with a Keras loss
and optimizer; what cannot be read is one line, exit 2; the same file gives the same output."""
import hashlib
import os
import tempfile

import numpy as np
import pytest

import vfgraph
from vfgraph.testing.cli import one_error, run_in_process, tree_digest
from vfgraph.testing.corpus import _fresh_serve

N = 16  # examples: one batch of 16, fed twice


def _data(shape=(8,), classes=10, seed=1):
    rng = np.random.default_rng(seed)
    return rng.normal(size=(N, *shape)).astype(np.float32), rng.integers(0, classes, N).astype(np.int32)


def _mlp_file(path):
    """The must-show model: no batch norm, SGD with clipnorm, momentum and a learning-rate
    schedule, L2 regularization, an accuracy metric; trained one step before it is saved, so the
    file holds optimizer state (iterations, momentum) that the rewrite must carry on from."""
    import keras

    keras.utils.set_random_seed(0)
    reg = keras.regularizers.L2(1e-2)
    model = keras.Sequential([keras.Input((8,), name="x"),
                              keras.layers.Dense(16, activation="tanh", kernel_regularizer=reg),
                              keras.layers.Dense(10, kernel_regularizer=reg)])
    schedule = keras.optimizers.schedules.ExponentialDecay(0.3, decay_steps=1, decay_rate=0.5)
    model.compile(optimizer=keras.optimizers.SGD(schedule, momentum=0.9, clipnorm=0.5),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])
    model.train_on_batch(*_data(seed=7))
    model.save(path)
    return str(path)


def _keras_after(path, x, y, steps, compile_args=None):
    """What Keras' own train_on_batch makes of the saved model: its predictions after ``steps``
    (``compile_args``: compiled again so, for a model Keras loads with its own defaults)."""
    import keras

    model = keras.saving.load_model(path)
    if compile_args:
        model.compile(**compile_args())
    for _ in range(steps):
        model.train_on_batch(x, y)
    return model.predict(x, verbose=0)


def _trained_here(out, feed, steps):
    """Serving outputs of the rewritten model ``out`` after ``steps`` calls of its train signature."""
    import tensorflow as tf

    loaded, result = tf.saved_model.load(out), None
    serving = loaded.signatures["serving_default"]
    for _ in range(steps):
        result = loaded.signatures["train"](**feed)
    inputs = {k: v for k, v in feed.items() if k in serving.structured_input_signature[1]}
    return result, [v.numpy() for _, v in sorted(serving(**inputs).items())]


def _file_digest(path):
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def _close(got, want, rel=1e-5):
    got, want = np.asarray(got), np.asarray(want)
    assert np.max(np.abs(got - want)) <= rel * np.max(np.abs(want)), np.max(np.abs(got - want))


@pytest.fixture(scope="module")
def mlp(tmp_path_factory):
    return _mlp_file(tmp_path_factory.mktemp("keras") / "m.keras")


@pytest.fixture(scope="module")
def mlp_v4(mlp):
    """The must-show model rewritten with --vnodes 4 (the command line, in this process)."""
    from vfgraph import cli

    out = os.path.join(os.path.dirname(mlp), "v4")
    assert cli.main(["rewrite", mlp, "--vnodes", "4", "--allreduce", "none", "-o", out]) == 0
    return out


def test_keras_file_rewritten_trains_as_keras(mlp, mlp_v4, tmp_path, capsys):
    """The must-show: --vnodes 4, two steps of `vfgraph train` on 16 examples equal two
    train_on_batch on them; the metric is reported; the serving export serves the weights in
    stock TensorFlow."""
    x, y = _data()
    np.savez(tmp_path / "d.npz", x=x, label=y)
    before = _file_digest(mlp)
    assert not [d for d in os.listdir(tempfile.gettempdir()) if d.startswith("vfgraph-keras-")]  # removed
    capsys.readouterr()
    from vfgraph import cli

    assert cli.main(["train", mlp_v4, "--data", str(tmp_path / "d.npz"), "--steps", "2",
                     "--batch-size", "16", "-o", str(tmp_path / "t"), "--no-progress"]) == 0
    assert "accuracy" in capsys.readouterr().out
    want = _keras_after(mlp, x, y, 2)
    code, err = run_in_process(capsys, "export", tmp_path / "t", "-o", tmp_path / "serve")
    assert code == 0, err
    got = _fresh_serve(str(tmp_path / "serve" / "1"), "serving_default", {"x": x}, str(tmp_path),
                       vfgraph=False).result()
    _close(got["output_0"], want)
    assert _file_digest(mlp) == before  # the input untouched


def test_same_keras_file_same_output(mlp, mlp_v4, tmp_path, capsys):
    code, err = run_in_process(capsys, "rewrite", mlp, "--vnodes", "4", "--allreduce", "none", "-o", tmp_path / "again")
    assert code == 0, err
    assert tree_digest(tmp_path / "again") == tree_digest(mlp_v4)


def test_train_reads_keras_file(mlp, tmp_path, capsys):
    """`vfgraph train m.keras` trains the step the file's model is compiled with, as it is."""
    x, y = _data()
    np.savez(tmp_path / "d.npz", x=x, label=y)
    code, err = run_in_process(capsys, "train", mlp, "--data", tmp_path / "d.npz", "--steps", 2, "--batch-size", 16,
                               "-o", tmp_path / "t", "--no-progress")
    assert code == 0, err
    _, got = _trained_here(str(tmp_path / "t"), {"x": x, "label": y}, 0)
    _close(got[0], _keras_after(mlp, x, y, 2))
    assert not [d for d in os.listdir(tempfile.gettempdir()) if d.startswith("vfgraph-keras-")]


CUSTOM = """import keras


@keras.saving.register_keras_serializable(package="vftest")
class Scale(keras.layers.Layer):
    def build(self, shape):
        self.scale = self.add_weight(shape=(shape[-1],), initializer="ones")

    def call(self, x):
        return x * self.scale
"""


def test_two_outputs_with_loss_weights(tmp_path, monkeypatch, capsys):
    """Losses per output with weights, a metric per output, a custom layer (--import): V=1 and
    V=4 train as Keras does."""
    import importlib

    import keras

    (tmp_path / "vf_custom_layers.py").write_text(CUSTOM)
    monkeypatch.syspath_prepend(str(tmp_path))
    custom = importlib.import_module("vf_custom_layers")
    keras.utils.set_random_seed(0)
    inp = keras.Input((8,), name="x")
    h = custom.Scale()(keras.layers.Dense(16, activation="relu")(inp))
    out_a = keras.layers.Dense(10, name="a")(h)
    out_b = keras.layers.Dense(1, name="b")(h)
    model = keras.Model(inp, [out_a, out_b])
    model.compile(optimizer=keras.optimizers.Adam(1e-2),
                  loss={"a": keras.losses.SparseCategoricalCrossentropy(from_logits=True), "b": "mse"},
                  loss_weights={"a": 1.0, "b": 0.25}, metrics={"a": ["accuracy"]})
    path = str(tmp_path / "two.keras")
    model.save(path)
    code, err = run_in_process(capsys, "inspect", path)
    one_error(code, err, "two.keras", "--import MODULE")
    x, y = _data()
    yb = np.random.default_rng(3).normal(size=(N, 1)).astype(np.float32)
    want = _keras_after(path, x, {"a": y, "b": yb}, 2)
    item = vfgraph.load(path, imports=["vf_custom_layers"])
    assert sorted(item.signatures["train"].input_keys.values()) == ["label_a", "label_b", "x"]
    for vnodes in (1, 4):
        out = str(tmp_path / f"v{vnodes}")
        vfgraph.save(vfgraph.rewrite(item, vnodes=vnodes, allreduce="none"), out)
        result, got = _trained_here(out, {"x": x, "label_a": y, "label_b": yb}, 2)
        assert {"loss", "a_accuracy"} <= set(result), sorted(result)
        for g, w in zip(got, want):
            _close(g, w)


def test_keras_applications_cnn(tmp_path):
    """MobileNetV2 (batch norm: checked at V=1, where its statistics are the batch's)."""
    import keras

    keras.utils.set_random_seed(0)
    model = keras.applications.MobileNetV2(input_shape=(32, 32, 3), alpha=0.35, weights=None, classes=10)
    model.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.9), loss="sparse_categorical_crossentropy",
                  metrics=["accuracy"])
    path = str(tmp_path / "cnn.keras")
    model.save(path)
    x, y = _data((32, 32, 3))
    want = _keras_after(path, x, y, 1)
    name = model.layers[0].name  # the Input layer's
    vfgraph.save(vfgraph.rewrite(path, vnodes=1, allreduce="none"), str(tmp_path / "v1"))
    _, got = _trained_here(str(tmp_path / "v1"), {name: x, "label": y}, 1)
    _close(got[0], want)


def test_keras_hub_text_classifier(tmp_path):
    """A keras-hub task (its own compile(), which Keras' loader does not call: the file's optimizer
    and loss are used, not keras-hub's defaults)."""
    keras_hub = pytest.importorskip("keras_hub", reason="keras-hub is not installed")
    import keras

    keras.utils.set_random_seed(0)
    backbone = keras_hub.models.BertBackbone(vocabulary_size=50, num_layers=1, num_heads=2, hidden_dim=8,
                                             intermediate_dim=16, max_sequence_length=12, dropout=0.0)
    model = keras_hub.models.BertTextClassifier(backbone, num_classes=3, preprocessor=None, dropout=0.0)
    def compile_args():
        return dict(optimizer=keras.optimizers.SGD(0.1, momentum=0.5),
                    loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))

    model.compile(**compile_args())
    path = str(tmp_path / "bert.keras")
    model.save(path)
    rng = np.random.default_rng(2)
    feed = {"token_ids": rng.integers(1, 50, (N, 12)).astype(np.int32),
            "segment_ids": np.zeros((N, 12), np.int32), "padding_mask": np.ones((N, 12), np.int32)}
    y = rng.integers(0, 3, N).astype(np.int32)
    want = _keras_after(path, feed, y, 1, compile_args)
    vfgraph.save(vfgraph.rewrite(path, vnodes=1, allreduce="none", imports=["keras_hub"]), str(tmp_path / "v1"))
    _, got = _trained_here(str(tmp_path / "v1"), {**feed, "label": y}, 1)
    _close(got[0], want)


def test_uncompiled_keras_file_refused(tmp_path, capsys):
    import keras

    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
    model.save(tmp_path / "u.keras")
    code, err = run_in_process(capsys, "rewrite", tmp_path / "u.keras", "--vnodes", "2", "-o", tmp_path / "out")
    one_error(code, err, "u.keras", "not compiled", "model.compile(")
    assert not os.path.exists(tmp_path / "out")


def _exported(path):
    import keras

    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((8,), name="x"), keras.layers.Dense(16, activation="tanh"),
                              keras.layers.Dense(10, activation="softmax")])
    model.export(str(path), verbose=False)
    return model


def test_inference_export_fine_tuned(tmp_path, capsys):
    """model.export() has no training step: the rewrite says how to give one; with a Keras loss
    and SGD, V=4 trains as the full batch (Keras' train_on_batch on the same model)."""
    import keras

    model = _exported(tmp_path / "exp")
    code, err = run_in_process(capsys, "rewrite", tmp_path / "exp", "--vnodes", "4", "-o", tmp_path / "v4")
    one_error(code, err, "no training step", "--keras-loss", "--keras-optimizer", "--vnode-batch")
    code, err = run_in_process(capsys, "rewrite", tmp_path / "exp", "--vnodes", "4", "--allreduce", "none",
                               "--keras-loss", "sparse_categorical_crossentropy", "--keras-optimizer", "sgd:lr=0.3",
                               "-o", tmp_path / "v4")
    assert code == 0, err
    x, y = _data()
    model.compile(optimizer=keras.optimizers.SGD(0.3), loss=keras.losses.SparseCategoricalCrossentropy())
    for _ in range(2):
        model.train_on_batch(x, y)
    _, got = _trained_here(str(tmp_path / "v4"), {"x": x, "label": y}, 2)
    _close(got[0], model.predict(x, verbose=0))


def test_fine_tuning_options_checked(tmp_path, capsys):
    _exported(tmp_path / "exp")
    before = tree_digest(tmp_path / "exp")
    for flags, needles in (
            (["--keras-loss", "mse", "--keras-optimizer", "sgdx"], ["--keras-optimizer sgdx", "adam:learning_rate"]),
            (["--keras-loss", "msx", "--keras-optimizer", "sgd"], ["--keras-loss msx", "sparse_categorical"]),
            (["--keras-loss", "mse"], ["--keras-loss without --keras-optimizer"])):
        code, err = run_in_process(capsys, "rewrite", tmp_path / "exp", "--vnodes", "4", *flags,
                                   "-o", tmp_path / "out")
        one_error(code, err, *needles)
    assert not os.path.exists(tmp_path / "out") and tree_digest(tmp_path / "exp") == before
